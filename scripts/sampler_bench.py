"""The fused Gumbel-max sampler (kernels/sampling.py) at decode batch sizes of W-small's vocabulary,
over its tile sizes, warps and vocabulary slices, against the bandwidth floor of reading the
logits once (a row max). Timed inside a CUDA graph, logits in bf16 as the lm_head leaves them.
GPU only.

    python scripts/sampler_bench.py [--batches 15,48,128,218,256] [--json out.json]

Per batch: the shipped configuration's µs, the best configuration and its µs, and the row max's µs.
"""

import argparse
import itertools
import json

import torch
import triton

from graph_timing import graph_us
from llmserve.bench.report import report
from llmserve.kernels import sampling

VOCAB = 151936


def run_config(logits, temperature, key, out, block: int, warps: int, slices: int) -> None:
    B, V = logits.shape
    chunk = triton.cdiv(triton.cdiv(V, slices), block) * block
    best = torch.empty(B, slices, dtype=torch.float32, device=logits.device)
    index = torch.empty(B, slices, dtype=torch.int32, device=logits.device)
    sampling._gumbel_argmax_kernel[(B, slices)](logits, logits.stride(0), temperature, key, best, index, V, chunk,
                                                BLOCK=block, FAST_LOG=True, PDL=False, num_warps=warps)
    sampling._pick_slice_kernel[(B,)](best, index, out, slices, V, S_P=sampling.MAX_SLICES, PDL=False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="15,48,128,218,256")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for B in map(int, args.batches.split(",")):
        logits = torch.randn(B, VOCAB, device="cuda").to(torch.bfloat16)
        temperature = torch.full((B,), 0.6, device="cuda")
        key = torch.randint(0, 2**32, (B,), device="cuda")
        out = torch.empty(B, dtype=torch.int64, device="cuda")
        want = sampling.gumbel_argmax(logits, temperature, key)
        shipped = graph_us(lambda _: sampling.gumbel_argmax(logits, temperature, key), reps=50)
        floor = graph_us(lambda _: logits.amax(-1), reps=50)
        timed = []
        default_s = sampling.vocab_slices(B, VOCAB, logits.device)
        for block, warps, mult in itertools.product((512, 1024, 2048, 4096), (4, 8, 16), (0.5, 1, 2, 4)):
            slices = max(1, min(sampling.MAX_SLICES, round(default_s * mult)))
            try:
                us = graph_us(lambda _: run_config(logits, temperature, key, out, block, warps, slices), reps=50)
            except Exception:  # too many registers and the like
                continue
            run_config(logits, temperature, key, out, block, warps, slices)
            assert torch.equal(out, want), (block, warps, slices)
            timed.append((us, block, warps, slices))
        us, block, warps, slices = min(timed)
        row = {"batch": B, "shipped_us": round(shipped, 1), "shipped_slices": default_s, "best_us": round(us, 1),
               "best": {"BLOCK": block, "num_warps": warps, "slices": slices}, "row_max_us": round(floor, 1),
               "logits_tb_s_best": round(B * VOCAB * 2 / us / 1e6, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
