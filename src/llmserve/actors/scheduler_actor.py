"""Scheduler actor: owns the Scheduler (queues, token budgets); proposes a step whenever none is in
flight, follows the KV manager's feedback, applies step results, and logs engine statistics."""

from __future__ import annotations

import time

import anyio
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llmserve.core.scheduler import RequestStatus, Scheduler
from llmserve.messages import (EngineOutputs, FinishInFlight, FinishRequests, NewRequests, StepFeedback, StepProposal,
                               StepResult)

log = structlog.get_logger("llmserve.engine")


class EngineStats:
    """Counters since start and the interval log line."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.kv_usage = 0.0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self._last = (time.monotonic(), 0, 0, 0, 0)

    def maybe_log(self, scheduler: Scheduler) -> None:
        now = time.monotonic()
        t0, p0, g0, d0, a0 = self._last
        if not self.interval_s or now - t0 < self.interval_s:
            return
        dt = now - t0
        spec = scheduler.spec
        extra = {}
        if scheduler.speculation is not None:  # the interval's drafts and the share kept
            drafts = spec.draft_tokens - d0
            extra = {"spec_draft_tokens": drafts,
                     "spec_acceptance": round((spec.accepted_tokens - a0) / drafts, 3) if drafts else 0.0}
        log.info("engine", running=scheduler.num_running, waiting=scheduler.num_waiting,
                 kv_usage=round(self.kv_usage, 3),
                 prefix_hit_rate=round(self.prefix_hits / self.prefix_queries, 3) if self.prefix_queries else 0.0,
                 prompt_tok_s=round((scheduler.prompt_tokens - p0) / dt, 1),
                 gen_tok_s=round((scheduler.generation_tokens - g0) / dt, 1),
                 preemptions=scheduler.num_preemptions, **extra)
        self._last = (now, scheduler.prompt_tokens, scheduler.generation_tokens, spec.draft_tokens, spec.accepted_tokens)


class SchedulerActor:
    def __init__(self, scheduler: Scheduler, stats: EngineStats, *, inbox: ObjectReceiveStream,
                 to_kv: ObjectSendStream, to_requests: ObjectSendStream, async_scheduling: bool = True) -> None:
        self.scheduler = scheduler
        self.stats = stats
        self.inbox, self.to_kv, self.to_requests = inbox, to_kv, to_requests
        # Steps proposed whose results have not arrived. With async scheduling the next step is
        # planned while one runs, so the device never waits for the CPU's bookkeeping.
        self.max_in_flight = 2 if async_scheduling else 1
        self.in_flight = 0
        self.awaiting_feedback = False
        self.stalled = False  # the last step scheduled nothing: wait for news before trying again
        self.news = False  # requests arrived or ended since the proposal awaiting feedback went out
        self.finish_sent = False  # told the executor no plan follows until results arrive
        self.outputs: list[EngineOutputs] = []

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.inbox:
            while True:
                msg = await self.inbox.receive()
                await self._handle(msg)
                # Take everything already queued (a burst of arrivals joins one step).
                while True:
                    try:
                        msg = self.inbox.receive_nowait()
                    except anyio.WouldBlock:
                        break
                    await self._handle(msg)
                # The next step goes out before the last step's outputs: detokenizing and waking
                # the requests' readers then happens while the device runs it.
                # (A step whose requests speculate is the last one out: their drafts follow its tokens.)
                if (self.in_flight < self.max_in_flight and not self.awaiting_feedback and not self.stalled
                        and self.scheduler.has_work() and not (self.in_flight and self.scheduler.must_wait())):
                    proposal = self._schedule()
                    if proposal is not None and (proposal.entries or proposal.freed):
                        self.in_flight += 1
                        self.awaiting_feedback = True
                        self.news = False
                        self.finish_sent = False
                        if not self._to_kv(proposal):
                            return
                # The executor launches each plan before it finishes the step before, so with one
                # step out it waits for the next plan; when none comes before that step's result,
                # it must hear so. (With two out, launching the second returns the first's result.)
                if self.in_flight == 1 and not self.awaiting_feedback and not self.finish_sent:
                    self.finish_sent = True
                    if not self._to_kv(FinishInFlight()):
                        return
                for outputs in self.outputs:
                    await self.to_requests.send(outputs)
                self.outputs.clear()
                self.stats.maybe_log(self.scheduler)

    def _to_kv(self, msg: StepProposal | FinishInFlight) -> bool:
        """Send without a checkpoint (the KV manager runs next, before the request actor's work);
        False: the KV manager is gone, the engine is shutting down."""
        try:
            self.to_kv.send_nowait(msg)
            return True
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False

    def _schedule(self) -> StepProposal | None:
        """The next proposal. Should planning ever fail (a bug: it runs on validated requests
        only), no request can be blamed: all of them end with the error, and the engine serves on."""
        try:
            return self.scheduler.schedule()
        except Exception as exc:
            log.exception("scheduling failed; ending the requests it held")
            self.outputs.append(self.scheduler.fail({r: f"scheduling failed: {exc!r}" for r in self.scheduler.requests}))
            return None

    async def _handle(self, msg: object) -> None:
        # The step counters move first, so that a failure below cannot stall the loop; a message
        # that fails ends the requests it names, never the engine.
        if isinstance(msg, StepFeedback):
            self.awaiting_feedback = False
        elif isinstance(msg, StepResult):
            self.in_flight -= 1
        try:
            self._apply(msg)
        except Exception as exc:
            names = _request_ids(msg)
            log.exception("scheduler: message failed; ending its requests", message=type(msg).__name__,
                          request_ids=names[:8], num_requests=len(names))
            self.outputs.append(self.scheduler.fail({r: f"scheduling failed: {exc!r}" for r in names}))

    def _apply(self, msg: object) -> None:
        s = self.scheduler
        if isinstance(msg, NewRequests):
            failed = {}
            for new in msg.requests:  # one at a time: one that cannot be taken in fails alone
                try:
                    s.add(new)
                except Exception as exc:
                    log.exception("scheduler: request not taken in", request_id=new.req_id)
                    failed[new.req_id] = f"scheduling failed: {exc!r}"
            if failed:
                self.outputs.append(s.fail(failed))
            self.stalled, self.news = False, True
        elif isinstance(msg, FinishRequests):
            s.finish(msg.req_ids, RequestStatus.FINISHED_STOPPED if msg.reason == "stop"
                     else RequestStatus.FINISHED_ABORTED)
            self.stalled, self.news = False, True
        elif isinstance(msg, StepFeedback):
            failed = s.on_feedback(msg)
            if failed.updates:
                self.outputs.append(failed)
            # Nothing scheduled and nothing running: wait for news, unless some came while this
            # proposal was out (a request that arrived then was not in it).
            self.stalled = not msg.scheduled and not s.running and not self.news
            self.stats.kv_usage = msg.kv_usage
            self.stats.prefix_queries, self.stats.prefix_hits = msg.prefix_queries, msg.prefix_hits
        elif isinstance(msg, StepResult):
            outputs = s.on_result(msg)
            if outputs.updates:
                self.outputs.append(outputs)
        else:
            raise TypeError(f"scheduler actor got unexpected message {type(msg).__name__}")


def _request_ids(msg: object) -> list[str]:
    """The requests a message is about (those a failure to handle it must end)."""
    if isinstance(msg, NewRequests):
        return [r.req_id for r in msg.requests]
    if isinstance(msg, FinishRequests):
        return list(msg.req_ids)
    if isinstance(msg, StepFeedback):
        return [*msg.scheduled, *msg.preempted, *msg.not_admitted, *msg.failed]
    if isinstance(msg, StepResult):
        return [*msg.req_ids, *msg.failed]
    return []
