"""Executor actor: runs each StepPlan on the model runner and sends the StepResults to the scheduler.

The runner keeps one step in flight (model/runner.py): each call launches the next step on the
device before it waits for the previous one's tokens. A step whose sampler waits for masks (a
constrained request's) has it queued by the next call, before that call's forward pass. After a
launch the actor waits for the next message: a plan (launch it, finish the one before) or
FinishInFlight, the scheduler's word that no plan comes before a result (finish the step in
flight).

A local CUDA runner's calls (its launches only queue device work) run here, on the event loop's
thread, as generators (ModelRunner.stepping) that yield what they are about to wait for: the actor
waits for it between the loop's other work, so the call goes on as soon as it can. (On a worker
thread, a call that waited for the device would then wait for the interpreter lock, which the loop
holds while the other actors run: up to the 5 ms switch interval, on every step of a host-bound
batch.) It waits for masks without holding the lock (the mask thread needs it to finish), and for
the device by polling, for up to POLL_S (a decode step's device time; a long prompt's step is
waited for on a worker thread).

The other runners' calls run on a worker thread: a runner of several ranks (RankRunner) waits there
for their replies, and a CPU runner computes the step while it launches it, which would hold the
loop for the whole forward pass. (Torch's OpenMP team driven from a process's main thread is also
many times slower than from another thread when the cores are shared with other processes.)
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import anyio
import anyio.from_thread
import anyio.lowlevel
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llmserve.messages import FinishInFlight
from llmserve.model.runner import ModelRunner
from llmserve.model.waits import Steps, Wait, block, is_done

POLL_S = 0.02
"""Longest the loop polls for the step in flight to land before a worker thread waits for it: the
device time of a decode step, not that of a long prompt's."""


class ExecutorActor:
    def __init__(self, runner: ModelRunner, *, inbox: ObjectReceiveStream, to_scheduler: ObjectSendStream,
                 launch_here: bool = False) -> None:
        self.runner = runner
        self.launch_here = launch_here  # a launch only queues device work: its calls run on the loop
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
                if self.launch_here:
                    results = await self._drive(self.runner.flushing() if plan is None else self.runner.stepping(plan))
                elif plan is None:
                    results = await anyio.to_thread.run_sync(self.runner.flush, limiter=self._thread)
                else:
                    results = await anyio.to_thread.run_sync(self.runner.step, plan, limiter=self._thread)
                if not self._send(results):
                    return  # the engine is shutting down: nobody is left to read the result

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

    async def _drive(self, steps: Steps) -> list:
        """A runner call's results, waiting for each thing it yields without blocking the loop."""
        try:
            wait = next(steps)
            while True:
                await self._until(wait)
                wait = steps.send(None)
        except StopIteration as stop:
            return stop.value
        finally:
            steps.close()  # (cancelled while waiting: the call ends there)

    async def _until(self, wait: Wait) -> None:
        if isinstance(wait, Future):
            await _completed(wait)
            return
        deadline = anyio.current_time() + POLL_S
        while not is_done(wait):
            if anyio.current_time() > deadline:
                await anyio.to_thread.run_sync(block, wait, limiter=self._thread)
                return
            await anyio.sleep(0)


async def _completed(future: Future) -> None:
    """Wait for a thread's future with the loop asleep (the thread needs the interpreter lock to
    end, which a polling loop would hardly ever hand over)."""
    done = anyio.Event()
    token, loop_thread = anyio.lowlevel.current_token(), threading.get_ident()

    def wake(_: Future) -> None:
        if threading.get_ident() == loop_thread:  # done already: the callback runs here, at once
            done.set()
            return
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except RuntimeError:  # the loop has ended: nobody waits
            pass

    future.add_done_callback(wake)
    await done.wait()
