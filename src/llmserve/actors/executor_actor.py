"""Executor actor: runs each StepPlan on the model runner in a worker thread, so the event loop
keeps serving while the device works, and sends the StepResult to the scheduler."""

from __future__ import annotations

import anyio
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llmserve.messages import StepResult
from llmserve.model.runner import ModelRunner

log = structlog.get_logger("llmserve.executor")


class ExecutorActor:
    def __init__(self, runner: ModelRunner, *, inbox: ObjectReceiveStream, to_scheduler: ObjectSendStream) -> None:
        self.runner = runner
        self.inbox, self.to_scheduler = inbox, to_scheduler
        self._thread = anyio.CapacityLimiter(1)

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.inbox:
            async for plan in self.inbox:
                try:
                    result = await anyio.to_thread.run_sync(self.runner.execute, plan, limiter=self._thread)
                except Exception as exc:  # a failed step fails its requests, not the engine
                    log.exception("step failed", step=plan.step_id, num_reqs=len(plan.req_ids))
                    result = StepResult(plan.step_id, list(plan.req_ids), [], error=exc)
                # The scheduler's inbox is unbounded: this never blocks and, unlike `await send`,
                # never yields, so the next plan (already queued under async scheduling) starts
                # on the device before the scheduler digests this result.
                try:
                    self.to_scheduler.send_nowait(result)
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    return  # the engine is shutting down: nobody is left to read the result
