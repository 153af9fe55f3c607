"""Executor actor: runs each StepPlan on the model runner, in a worker thread wherever the call may
wait for the device (so the event loop keeps serving meanwhile), and sends the StepResults to the
scheduler. A launch with no step in flight waits for nothing: it runs on the loop's own thread.

The runner keeps one step in flight (model/runner.py): each call launches the next step on the
device before it waits for the previous one's tokens. A step whose sampler waits for masks (a
constrained request's) has it queued as soon as they are filled, before the next message. After a
launch the actor waits for the next message: a plan (launch it, finish the one before) or
FinishInFlight, the scheduler's word that no plan comes before a result (finish the step in
flight). That finish first polls the device from the loop for up to POLL_S (a step that waits for
the one before, as under speculation, goes on as soon as its tokens land, without the hops to a
worker thread and back), then waits on the worker thread.
"""

from __future__ import annotations

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llmserve.messages import FinishInFlight
from llmserve.model.runner import ModelRunner

POLL_S = 0.02
"""Longest the loop polls for the step in flight to land before a worker thread waits for it: the
device time of a decode step, not that of a long prompt's."""


class ExecutorActor:
    def __init__(self, runner: ModelRunner, *, inbox: ObjectReceiveStream, to_scheduler: ObjectSendStream,
                 launch_here: bool = False) -> None:
        self.runner = runner
        self.launch_here = launch_here  # a launch is local work (not a call to other processes)
        self.inbox, self.to_scheduler = inbox, to_scheduler
        self._thread = anyio.CapacityLimiter(1)

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.inbox:
            while True:
                try:
                    plan = await self.inbox.receive()
                except anyio.EndOfStream:
                    plan = None
                if plan is None and not self.runner.busy:
                    return  # inbox closed, nothing left to finish
                if isinstance(plan, FinishInFlight):
                    plan = None
                # A failed step comes back as an error result for its requests (the runner logs it).
                if plan is None:
                    if self.launch_here and not self.runner.masks_pending and await self._landed():
                        results = self.runner.flush()
                    else:
                        results = await anyio.to_thread.run_sync(self.runner.flush, limiter=self._thread)
                elif self.launch_here and not self.runner.busy:
                    # Nothing in flight: the launch waits for no device work, so it runs now, on
                    # this thread. Handed to the worker, it would wait for the thread to wake and
                    # for the interpreter lock, which this loop holds while other actors run: time
                    # the device idles when a step waits for the one before (speculation).
                    results = self.runner.step(plan)
                else:
                    results = await anyio.to_thread.run_sync(self.runner.step, plan, limiter=self._thread)
                if not self._send(results):
                    return  # the engine is shutting down: nobody is left to read the result
                if self.launch_here and self.runner.masks_pending:
                    # The step just launched samples once its masks are filled: its sampler is
                    # queued then, while the scheduler plans the next step (which would otherwise
                    # queue it, leaving the device idle from the forward pass's end until then).
                    results = await anyio.to_thread.run_sync(self.runner.queue_sampler, limiter=self._thread)
                    if not self._send(results):
                        return

    def _send(self, results: list) -> bool:
        """Send results to the scheduler; False once it is gone (the engine shutting down).
        The scheduler's inbox is unbounded: this never blocks and, unlike `await send`, never
        yields, so the next plan (already queued under async scheduling) starts on the device
        before the scheduler digests these results."""
        for result in results:
            try:
                self.to_scheduler.send_nowait(result)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return False
        return True

    async def _landed(self) -> bool:
        """Whether the step in flight landed within POLL_S, polled between the loop's other work."""
        deadline = anyio.current_time() + POLL_S
        while not self.runner.landed():
            if anyio.current_time() > deadline:
                return False
            await anyio.sleep(0)
        return True
