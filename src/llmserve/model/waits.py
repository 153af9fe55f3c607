"""What a step waits for, and two ways to wait.

ModelRunner.stepping() (and flushing()) are generators that yield each thing they are about to wait
for, then wait for it themselves, finding it done: the masks of a step still filling on the mask
thread (a concurrent.futures.Future), or a launched step's tokens on their way to the host (a CUDA
event: anything with query() and synchronize()). Whoever drives one chooses how to wait meanwhile:
run_waiting() blocks (a worker thread's way, and step()'s); the executor actor waits between the
event loop's other work, so that no hand-off of the interpreter lock between threads sits on a
step's path.

A wait that fails (a device error) ends quietly here: the step's own wait raises the error again,
where its requests fail with it.
"""

from __future__ import annotations

from collections.abc import Generator
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any

Wait = Any  # a Future, or an event with query() and synchronize()
Steps = Generator[Wait, None, list]  # returns the StepResults


def is_done(wait: Wait) -> bool:
    if isinstance(wait, Future):
        return wait.done()
    try:
        return wait.query()
    except Exception:  # the device failed: the step's own wait says so
        return True


def block(wait: Wait) -> None:
    if isinstance(wait, Future):
        wait_futures([wait])
        return
    try:
        wait.synchronize()
    except Exception:
        pass


def run_waiting(steps: Steps) -> list:
    """Drive a stepping() generator to its results, blocking on each wait."""
    try:
        wait = next(steps)
        while True:
            block(wait)
            wait = steps.send(None)
    except StopIteration as stop:
        return stop.value
