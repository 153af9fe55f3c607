"""Host stalls inside a timed run that the step timing alone cannot name: Triton kernel variants
used for the first time (compiled, or loaded from Triton's disk cache) and Python's garbage
collector. A benchmark wraps its timed region in `watch_stalls()` and reports what it saw."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def watch_stalls() -> Iterator[dict]:
    """Yields a dict filled as the region runs: "kernels" [{"kernel", "variant", "ms"}] for each Triton
    specialization first used in it (None where this Triton has no JIT hooks), "gc" {"collections",
    "ms", "max_ms"} for collections of generation 1 and 2, and "gc_pauses" [(perf_counter at the
    start, ms)] of those that took 1 ms or more."""
    seen: dict = {"kernels": None, "gc": {"collections": 0, "ms": 0.0, "max_ms": 0.0}, "gc_pauses": []}
    gc_start = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if info.get("generation", 0) < 1:
            return
        if phase == "start":
            gc_start[0] = time.perf_counter()
        else:
            ms = 1e3 * (time.perf_counter() - gc_start[0])
            if ms >= 1.0:
                seen["gc_pauses"].append((gc_start[0], ms))
            g = seen["gc"]
            g["collections"] += 1
            g["ms"] += ms
            g["max_ms"] = max(g["max_ms"], ms)

    runtime = _triton_runtime_knobs()
    saved = None
    if runtime is not None:
        seen["kernels"] = []
        started: dict = {}
        saved = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)

        def before(*args, **kwargs):
            started[str(kwargs.get("key"))] = time.perf_counter()
            return None  # compile as usual

        def after(*args, **kwargs):
            t0 = started.pop(str(kwargs.get("key")), None)
            variant = str(kwargs.get("repr", "?"))
            seen["kernels"].append({"kernel": variant.split("[", 1)[0], "variant": variant,
                                    "ms": None if t0 is None else 1e3 * (time.perf_counter() - t0)})
            return None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
    gc.callbacks.append(on_gc)
    try:
        yield seen
    finally:
        gc.callbacks.remove(on_gc)
        if runtime is not None:
            runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def _triton_runtime_knobs():
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    return runtime if hasattr(runtime, "jit_post_compile_hook") and hasattr(runtime, "jit_cache_hook") else None
