"""Where a step's time goes, measured around the runner's step() calls, and an optional torch
profiler window over a few steps (`llmserve bench throughput --profile`)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class StepTiming:
    """Host time inside each step() call (launching one step and waiting for the one before) and
    between calls (the rest of the pipeline; with a step in flight the device keeps working then).
    Optionally a torch profiler over a window of steps."""

    def __init__(self) -> None:
        self.records: list[tuple[int, int, float, float]] = []  # (requests, tokens, start, end)
        self.profile_window: tuple[int, int] | None = None  # (first step, steps)
        self.profile_out: str | None = None
        self._prof = None

    @contextmanager
    def step(self, num_reqs: int, num_tokens: int):
        index = len(self.records)
        if self.profile_window and index == self.profile_window[0]:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
        start = time.perf_counter()
        try:
            yield
        finally:
            self.records.append((num_reqs, num_tokens, start, time.perf_counter()))
            if self._prof is not None and index == sum(self.profile_window) - 1:
                self._prof.__exit__(None, None, None)
                self._prof.export_chrome_trace(f"{self.profile_out}.trace.json")
                with open(f"{self.profile_out}.txt", "w") as f:
                    f.write(self._prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
                self._prof = None

    def summary(self, decode_only: bool = True) -> dict:
        """Mean ms inside step() ("execute_ms") and before it since the previous call ended
        ("between_ms"), over decode steps (tokens == requests) or all steps."""
        rows = [(r, s, e, s - prev[3]) for prev, (r, t, s, e) in zip(self.records, self.records[1:])
                if not decode_only or r == t]
        if not rows:
            return {}
        n = len(rows)
        return {"steps": n, "mean_batch": sum(r[0] for r in rows) / n,
                "execute_ms": 1e3 * sum(e - s for _, s, e, _ in rows) / n,
                "between_ms": 1e3 * sum(max(gap, 0.0) for *_, gap in rows) / n}
