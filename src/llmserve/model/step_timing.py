"""Where a step's time goes, measured around the runner's step() calls, optionally on the device
too (CUDA events around each step's queued work: how long it ran and how long the device sat idle
before it), and an optional torch profiler window over a few steps (`llmserve bench throughput
--profile`)."""

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
    events: tuple | None = None  # CUDA events around its queued work, when timing the device


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
        self.timing_device = False
        self._events: tuple | None = None  # the current step's, when timing the device

    def time_device(self) -> None:
        """Start a timed run (clear()), recording a CUDA event pair around each step's device work
        from now on (a few µs of host time a step): by_batch() then splits the run into device busy
        and idle time."""
        self.clear()
        self.timing_device = True

    @contextmanager
    def step(self, num_reqs: int, num_tokens: int):
        index = len(self.records)
        window = next((w for w in self.profile_windows if w[0] <= index < sum(w)), None)
        if window is not None and index == window[0]:
            self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                            torch.profiler.ProfilerActivity.CUDA])
            self._prof.__enter__()
        events = None
        if self.timing_device:
            events = self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        start = self._launched = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            launched = self._launched if self._launched > start else end  # unmarked: all of it was launch
            if events is not None and self._launched <= start:
                events[1].record()
            self._events = None
            self.records.append(StepRecord(num_reqs, num_tokens, start, launched, end, events))
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
        if self._events is not None:
            self._events[1].record()

    def clear(self) -> None:
        self.records.clear()

    def device_s(self) -> list[tuple[float, float]] | None:
        """(busy, idle before) seconds on the device per step: from the step's first queued work to
        its last, and from the previous step's last to its first (0 when the device was still busy
        with earlier work as the step was queued; 0 and 0 for a step without events, one begun as
        timing started). Waits for the device. None if not timing it."""
        last = next((r.events for r in reversed(self.records) if r.events is not None), None)
        if not self.timing_device or last is None:
            return None
        last[1].synchronize()
        out, prev_end = [], None
        for events in (r.events for r in self.records):
            if events is None:
                out.append((0.0, 0.0))
                continue
            start, end = events
            idle = 0.0 if prev_end is None else max(prev_end.elapsed_time(start), 0.0) / 1e3
            out.append((start.elapsed_time(end) / 1e3, idle))
            prev_end = end
        return out

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

    def report(self) -> dict:
        """summary() with by_batch(), slowest() and most_idle(); when timing the device, its busy
        seconds over the recorded steps ("device_busy_s"). Computed over the steps recorded as it
        is called: the engine's thread may still be stepping (a last step for requests already
        returned) and appending records meanwhile."""
        steps = StepTiming()
        steps.records, steps.timing_device = list(self.records), self.timing_device
        out = {**steps.summary(), "by_batch": steps.by_batch(), "slowest": steps.slowest(), "most_idle": steps.most_idle()}
        device = steps.device_s()
        if device:
            out["device_busy_s"] = sum(b for b, _ in device)
        return out

    def periods(self) -> list[tuple[float, int, int, int]]:
        """(seconds, step index, requests, tokens) for each step after the first: from the previous
        step() returning to this one returning; with a step in flight, the pipeline's rate."""
        return [(r.end - prev.end, i, r.requests, r.tokens)
                for i, (prev, r) in enumerate(zip(self.records, self.records[1:]), 1)]

    def by_batch(self, edges: tuple[int, ...] = (8, 32, 64, 128, 256)) -> list[dict]:
        """Where the whole run's wall time went: step periods summed for steps with prompt tokens
        ("mixed") and for decode steps by batch size (up to each edge), with the mean host time
        that launching them took ("launch_ms"; a period close to it means the host paces the device).
        When timing the device: the steps' device time ("device_s") and the device's idle time
        before them ("idle_s"), which together make up the wall time."""
        names = ["mixed", *(f"decode <= {x}" for x in edges), f"decode > {edges[-1]}"]
        rows: dict[str, list[tuple[float, float, float, float]]] = {name: [] for name in names}
        timed = self.device_s()
        device = timed or [(float("nan"), float("nan"))] * len(self.records)
        for period, i, r, t in self.periods():
            name = "mixed" if t != r else names[1 + next((j for j, x in enumerate(edges) if r <= x), len(edges))]
            rows[name].append((period, self.records[i].launched - self.records[i].start, *device[i]))
        out = []
        for name, v in rows.items():
            if not v:
                continue
            row = {"steps": name, "count": len(v), "total_s": sum(x[0] for x in v),
                   "mean_ms": 1e3 * sum(x[0] for x in v) / len(v), "launch_ms": 1e3 * sum(x[1] for x in v) / len(v)}
            if timed:
                row.update(device_s=sum(x[2] for x in v), idle_s=sum(x[3] for x in v))
            out.append(row)
        return out

    def slowest(self, n: int = 8) -> list[dict]:
        """The n longest step periods, with the step's index, requests and tokens, and where the
        period went: waiting for the plan before step() ("before_ms"), launching ("launch_ms"),
        waiting for the step before to finish ("finish_ms"); when timing the device, the step's
        device time and the device's idle time before it ("device_ms", "idle_ms")."""
        device = self.device_s()
        return [self._row(i, device) for _, i, _, _ in sorted(self.periods(), key=lambda x: (-x[0], x[1]))[:n]]

    def most_idle(self, n: int = 8) -> list[dict]:
        """The n steps before which the device sat idle longest (timing the device), as slowest() rows."""
        device = self.device_s() or []
        order = sorted(range(1, len(device)), key=lambda i: (-device[i][1], i))
        return [self._row(i, device) for i in order[:n]]

    def _row(self, i: int, device: list[tuple[float, float]] | None = None) -> dict:
        prev, rec = self.records[i - 1], self.records[i]
        row = {"step": i, "requests": rec.requests, "tokens": rec.tokens, "ms": 1e3 * (rec.end - prev.end),
               "before_ms": 1e3 * (rec.start - prev.end), "launch_ms": 1e3 * (rec.launched - rec.start),
               "finish_ms": 1e3 * (rec.end - rec.launched)}
        if device:
            row.update(device_ms=1e3 * device[i][0], idle_ms=1e3 * device[i][1])
        return row
