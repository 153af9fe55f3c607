"""The fused sampler (kernels/sampling.py) at decode batch sizes of W-small's vocabulary, against
the bandwidth floor of reading the logits once (a row max). Timed inside a CUDA graph, logits in
bf16 as the lm_head leaves them, temperature 0.6. GPU only.

    python scripts/sampler_bench.py [--batches 15,48,128,218,256] [--sweep] [--filtered] [--kernels] [--json out.json]

Per batch: the shipped sampler's µs and the row max's µs; --sweep also times sample_rows for
every (slice, block, warps). Runs against an llmserve with either sampler (sample_rows, or the
Gumbel-max gumbel_argmax before it), so `gpu_suite.sh run ab-script sampler_bench.py` compares them.
--filtered instead times the whole `sample()` with every row filtered as model cards ask (top_k 20 +
top_p 0.95: Qwen3; top_p 0.9: Llama 3.1; min_p 0.05) against no filter, on flat logits (random
weights) and peaked ones (a real model's: most mass on a few tokens), and torch's topk and sort
of the same rows; with --sweep also sample_filtered_rows alone for every (block, warps, split rounds, pivots).
"""

import argparse
import itertools
import json

import torch

from graph_timing import graph_us
from llmserve.bench.report import report
from llmserve.kernels import sampling

VOCAB = 151936


def filtered(batches: list[int], sweep: bool) -> list[dict]:
    from llmserve.model.sampler import SamplingBatch, sample

    fns = [sampling.sample_rows] + ([sampling.sample_filtered_rows] if hasattr(sampling, "sample_filtered_rows") else [])
    rows = []
    for B, shape in itertools.product(batches, ("flat", "peaked")):
        logits = torch.randn(B, VOCAB, device="cuda") * (1.0 if shape == "flat" else 4.0)
        logits = logits.to(torch.bfloat16)
        row = {"batch": B, "logits": shape}
        full = lambda v, dtype: torch.full((B,), v, dtype=dtype, device="cuda")  # noqa: E731
        for name, k, p, min_p in (("none", VOCAB, 1.0, 0.0), ("top_k20_top_p0.95", 20, 0.95, 0.0),
                                  ("top_p0.9", VOCAB, 0.9, 0.0), ("min_p0.05", VOCAB, 1.0, 0.05)):
            batch = SamplingBatch(full(0.6, torch.float32), full(k, torch.int64), full(p, torch.float32),
                                  full(min_p, torch.float32), torch.randint(0, 2**62, (B,), device="cuda"), False,
                                  None if name == "none" else torch.arange(B, device="cuda"))
            row[name + "_us"] = round(graph_us(lambda _: sample(logits, batch, *fns), reps=20), 1)
        if sweep and len(fns) == 2:
            rows_ = torch.arange(B, device="cuda")
            out = torch.empty(B, dtype=torch.int64, device="cuda")
            for name, k, p, min_p in (("top_k20_top_p0.95", 20, 0.95, 0.0), ("min_p0.05", VOCAB, 1.0, 0.05)):
                args = (logits, full(0.6, torch.float32), full(k, torch.int64), full(p, torch.float32),
                        full(min_p, torch.float32), torch.randint(0, 2**62, (B,), device="cuda"), rows_, out)
                timed = []
                for block, warps, split, pivots in itertools.product((512, 1024), (4, 8), (2, 3, 4, 5, 6), (4, 8)):
                    try:
                        us = graph_us(lambda _: sampling.sample_filtered_rows(
                            *args, tiles=(8192, block, warps), split_rounds=split, pivots=pivots), reps=10)
                    except Exception:  # too many registers and the like
                        continue
                    timed.append((round(us, 1), block, warps, split, pivots))
                row[name + "_best"] = sorted(timed)[:6]
                row[name + "_all"] = timed
        row["torch_topk20_us"] = round(graph_us(lambda _: logits.topk(20, dim=-1), reps=20), 1)
        row["torch_sort_us"] = round(graph_us(lambda _: logits.float().sort(dim=-1, descending=True), reps=20), 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def kernel_times(batches: list[int]) -> list[dict]:
    """--kernels: sample_filtered_rows at top_k 20 + top_p 0.95 on flat and peaked rows, each of its
    kernels' device time (µs a call, torch profiler over 20 calls)."""
    from torch.profiler import ProfilerActivity, profile
    rows = []
    for B, shape in itertools.product(batches, ("flat", "peaked")):
        logits = (torch.randn(B, VOCAB, device="cuda") * (1.0 if shape == "flat" else 4.0)).to(torch.bfloat16)
        full = lambda v, dtype: torch.full((B,), v, dtype=dtype, device="cuda")  # noqa: E731
        args = (logits, full(0.6, torch.float32), full(20, torch.int64), full(0.95, torch.float32),
                full(0.0, torch.float32), torch.randint(0, 2**62, (B,), device="cuda"), torch.arange(B, device="cuda"),
                torch.empty(B, dtype=torch.int64, device="cuda"))
        for _ in range(3):
            sampling.sample_filtered_rows(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                sampling.sample_filtered_rows(*args)
            torch.cuda.synchronize()
        times = {}
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and "kernel" in e.key:
                times[e.key] = (round(e.device_time_total / 20, 1), e.count // 20)
        row = {"batch": B, "logits": shape, "us_per_call_and_launches": times,
               "logits_mb": round(B * VOCAB * 2 / 1e6, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="15,48,128,218,256")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--filtered", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="the filtered sampler's kernels' device times")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.kernels:
        report(kernel_times(list(map(int, args.batches.split(",")))), args.json, echo=False)
        return
    if args.filtered:
        report(filtered(list(map(int, args.batches.split(","))), args.sweep), args.json, echo=False)
        return
    shipped_fn = getattr(sampling, "sample_rows", None) or sampling.gumbel_argmax
    rows = []
    for B in map(int, args.batches.split(",")):
        logits = torch.randn(B, VOCAB, device="cuda").to(torch.bfloat16)
        temperature = torch.full((B,), 0.6, device="cuda")
        key = torch.randint(0, 2**32, (B,), device="cuda")
        row = {"batch": B, "sampler": shipped_fn.__name__,
               "shipped_us": round(graph_us(lambda _: shipped_fn(logits, temperature, key), reps=50), 1),
               "row_max_us": round(graph_us(lambda _: logits.amax(-1), reps=50), 1)}
        if args.sweep and hasattr(sampling, "sample_rows"):
            timed, warps0 = [], sampling._WARPS
            for slice_len, block, warps in itertools.product((8192, 16384, 32768), (1024, 2048, 4096), (4, 8, 16)):
                sampling._WARPS = warps
                try:
                    us = graph_us(lambda _: sampling.sample_rows(logits, temperature, key, tiles=(slice_len, block)),
                                  reps=50)
                except Exception:  # too many registers and the like
                    continue
                finally:
                    sampling._WARPS = warps0
                timed.append((round(us, 1), slice_len, block, warps))
            row["best"] = sorted(timed)[:3]
        row["logits_tb_s"] = round(B * VOCAB * 2 / row["shipped_us"] / 1e6, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
