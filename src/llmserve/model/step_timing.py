"""Where a step's time goes, measured around the runner's step() calls, and an optional torch
profiler window over a few steps (`llmserve bench throughput --profile`)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import NamedTuple

import torch


class StepRecord(NamedTuple):
    requests: int
    tokens: int
    start: float  # step() entered
    launched: float  # launched() marked (= end if the step never marked it)
    end: float  # step() returned


class StepTiming:
    """Host time inside each step() call (launching one step, `launched()`, then waiting for the
    one before) and between calls (the rest of the pipeline; with a step in flight the device keeps
    working then). Optionally a torch profiler over a window of steps."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self._launched = 0.0
        self.profile_windows: list[tuple[int, int]] = []  # (first step, steps)
        self.profile_out: str | None = None
        self._prof = None

    @contextmanager
    def step(self, num_reqs: int, num_tokens: int):
        index = len(self.records)
        window = next((w for w in self.profile_windows if w[0] <= index < sum(w)), None)
        if window is not None and index == window[0]:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
        start = self._launched = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            launched = self._launched if self._launched > start else end  # unmarked: all of it was launch
            self.records.append(StepRecord(num_reqs, num_tokens, start, launched, end))
            if self._prof is not None and index == sum(window) - 1:
                self._prof.__exit__(None, None, None)
                out = f"{self.profile_out}-step{window[0]}"
                self._prof.export_chrome_trace(f"{out}.trace.json")
                with open(f"{out}.txt", "w") as f:
                    f.write(f"steps {window[0]}..{sum(window) - 1}: "
                            f"{[r[:2] for r in self.records[window[0]:]]} (requests, tokens)\n")
                    f.write(self._prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40))
                self._prof = None

    def launched(self) -> None:
        """Mark the end of the current step's launch (the host work that queues it on the device)."""
        self._launched = time.perf_counter()

    def clear(self) -> None:
        self.records.clear()

    @property
    def launch_s(self) -> list[float]:
        """Host time each step spent launching (all of step() for one that never marked it)."""
        return [r.launched - r.start for r in self.records]

    def summary(self, decode_only: bool = True) -> dict:
        """Mean ms inside step() ("execute_ms") and before it since the previous call ended
        ("between_ms"), over decode steps (tokens == requests) or all steps."""
        rows = [(r.requests, r.start, r.end, r.start - prev.end) for prev, r in zip(self.records, self.records[1:])
                if not decode_only or r.requests == r.tokens]
        if not rows:
            return {}
        n = len(rows)
        return {"steps": n, "mean_batch": sum(r[0] for r in rows) / n,
                "execute_ms": 1e3 * sum(e - s for _, s, e, _ in rows) / n,
                "between_ms": 1e3 * sum(max(gap, 0.0) for *_, gap in rows) / n}

    def periods(self) -> list[tuple[float, int, int, int]]:
        """(seconds, step index, requests, tokens) for each step after the first: from the previous
        step() returning to this one returning; with a step in flight, the pipeline's rate."""
        return [(r.end - prev.end, i, r.requests, r.tokens)
                for i, (prev, r) in enumerate(zip(self.records, self.records[1:]), 1)]

    def by_batch(self, edges: tuple[int, ...] = (8, 32, 64, 128, 256)) -> list[dict]:
        """Where the whole run's wall time went: step periods summed for steps with prompt tokens
        ("mixed") and for decode steps by batch size (up to each edge), with the mean host time
        that launching them took ("launch_ms"; a period close to it means the host paces the device)."""
        names = ["mixed", *(f"decode <= {x}" for x in edges), f"decode > {edges[-1]}"]
        rows: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for period, i, r, t in self.periods():
            name = "mixed" if t != r else names[1 + next((j for j, x in enumerate(edges) if r <= x), len(edges))]
            rows[name].append((period, self.records[i].launched - self.records[i].start))
        return [{"steps": name, "count": len(v), "total_s": sum(p for p, _ in v),
                 "mean_ms": 1e3 * sum(p for p, _ in v) / len(v), "launch_ms": 1e3 * sum(x for _, x in v) / len(v)}
                for name, v in rows.items() if v]

    def slowest(self, n: int = 8) -> list[dict]:
        """The n longest step periods, with the step's index, requests and tokens, and where the
        period went: waiting for the plan before step() ("before_ms"), launching ("launch_ms"),
        waiting for the step before to finish ("finish_ms")."""
        periods = sorted(self.periods(), key=lambda x: (-x[0], x[1]))
        out = []
        for p, i, r, t in periods[:n]:
            prev, rec = self.records[i - 1], self.records[i]
            out.append({"step": i, "requests": r, "tokens": t, "ms": 1e3 * p, "before_ms": 1e3 * (rec.start - prev.end),
                        "launch_ms": 1e3 * (rec.launched - rec.start), "finish_ms": 1e3 * (rec.end - rec.launched)})
        return out
