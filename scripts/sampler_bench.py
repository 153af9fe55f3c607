"""The fused sampler (kernels/sampling.py) at decode batch sizes of W-small's vocabulary, against
the bandwidth floor of reading the logits once (a row max). Timed inside a CUDA graph, logits in
bf16 as the lm_head leaves them, temperature 0.6. GPU only.

    python scripts/sampler_bench.py [--batches 15,48,128,218,256] [--sweep] [--json out.json]

Per batch: the shipped sampler's µs and the row max's µs; --sweep also times sample_rows for
every (slice, block, warps). Runs against an llmserve with either sampler (sample_rows, or the
Gumbel-max gumbel_argmax before it), so `gpu_suite.sh run ab-script sampler_bench.py` compares them.
"""

import argparse
import itertools
import json

import torch

from graph_timing import graph_us
from llmserve.bench.report import report
from llmserve.kernels import sampling

VOCAB = 151936


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="15,48,128,218,256")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
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
