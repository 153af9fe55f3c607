"""KV-manager actor: fits each StepProposal into the block pool (KVCacheManager) and sends the
plan on to the executor and the feedback back to the scheduler."""

from __future__ import annotations

import anyio
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.messages import FinishInFlight, StepFeedback, StepPlan, StepProposal

log = structlog.get_logger("llmserve.engine")


class KVActor:
    def __init__(self, manager: KVCacheManager, *, inbox: ObjectReceiveStream, to_executor: ObjectSendStream,
                 to_scheduler: ObjectSendStream) -> None:
        self.manager = manager
        self.inbox, self.to_executor, self.to_scheduler = inbox, to_executor, to_scheduler

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.inbox:
            async for proposal in self.inbox:
                if isinstance(proposal, FinishInFlight):
                    messages = [(self.to_executor, proposal)]  # in order behind the plans before it
                else:
                    try:
                        plan, feedback = self.manager.process(proposal)
                    except Exception as exc:
                        plan, feedback = self._failed(proposal, exc)
                    # Both go out before any other task runs (no checkpoint between them), so the
                    # feedback is in the scheduler's inbox before the step's result can be, and the
                    # executor, woken first, launches the step before the scheduler takes the feedback.
                    messages = [(self.to_executor, plan), (self.to_scheduler, feedback)]
                try:
                    for stream, msg in messages:
                        stream.send_nowait(msg)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return  # the engine is shutting down: nobody is left to read it

    def _failed(self, proposal: StepProposal, exc: Exception) -> tuple[StepPlan, StepFeedback]:
        """A proposal the manager could not fit (a bug: proposals hold validated requests only)
        ends its requests with the error; their blocks go back, and the executor still gets a
        step, empty, so that the scheduler's count of steps in flight stays right."""
        names = [e.req_id for e in proposal.entries]
        log.exception("KV manager: step failed; ending its requests", step=proposal.step_id,
                      request_ids=names[:8], num_requests=len(names))
        for req_id in names:
            self.manager.free(req_id)
        feedback = StepFeedback(proposal.step_id, {}, [], [], {}, self.manager.pool.usage(),
                                self.manager.prefix_queries, self.manager.prefix_hits,
                                failed={r: f"KV cache allocation failed: {exc!r}" for r in names})
        return StepPlan.empty(proposal.step_id, proposal.freed), feedback
