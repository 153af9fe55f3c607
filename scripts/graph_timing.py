"""Timing GPU work the way the engine runs it: inside one CUDA graph (the benchmark scripts' helper),
and printing a result row as it comes."""

import json

import torch


def graph_us(fn, calls: int = 1, reps: int = 20) -> float:
    """µs per fn(i) call, with fn(0) .. fn(calls - 1) captured in one CUDA graph and replayed `reps`
    times (distinct i, e.g. one weight matrix per layer, keep operands out of L2). The calls are
    run once outside the capture first: compilation, cuBLAS kernel loading. Two graphs are captured
    and timed, the faster kept: the first timing over freshly allocated inputs can run 3-5% slow
    whatever it times, and warm-up replays of the same graph do not remove that (H100, 2026-11-23)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    best = float("inf")
    for _ in range(2):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(i)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / reps / calls)
    return best


def events_us(fn, iters: int = 50) -> float:
    """µs per fn() call, `iters` calls back to back timed by CUDA events after three warm-up calls
    (fn: a graph's replay, or eager work)."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def emit(rows: list, row: dict) -> None:
    """Round the row's floats to 2 decimals, keep it in `rows` and print it as one JSON line."""
    row = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
    rows.append(row)
    print(json.dumps(row), flush=True)
