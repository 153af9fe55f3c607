"""Time the W8A16 kernel's tile configurations on the 8B layer shapes against bf16 F.linear (GPU).

    python scripts/int8_sweep.py [--json out.json]

Prints, per (M, layer), the best configuration, its time and its weight-read bandwidth, next to
the bf16 matmul; kernels/int8_matmul.py's _config table is chosen from this output.
"""

import argparse
import itertools
import json

import torch
import triton

from llmserve.bench.report import report
from llmserve.kernels.int8_matmul import _config, _split_k, int8_matmul, quantize_int8_rows

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=40)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--ms", default="1,32,256")
    args = ap.parse_args()
    rows = []
    for M in map(int, args.ms.split(",")):
        for layer, (N, K) in SHAPES.items():
            w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02
            w8, scale = quantize_int8_rows(w16)
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            bf16_ms = bench(lambda: torch.nn.functional.linear(x, w16))
            bm = max(16, min(triton.next_power_of_2(M), 64))
            candidates = [(c, 1) for c in itertools.product([bm], (16, 32, 64, 128), (64, 128, 256), (4,), (3, 4, 5))]
            if M <= 16:  # split-K
                candidates += [(c, split) for c in itertools.product([bm], (32, 64), (128, 256), (4,), (4,))
                               for split in (2, 4, 8)]
            timed = []
            for cfg, split in candidates:
                try:
                    timed.append((bench(lambda: int8_matmul(x, w8, scale, config=cfg, split_k=split)), (cfg, split)))
                except Exception:  # out of shared memory and the like
                    continue
            best_ms, best = min(timed)
            default_ms = bench(lambda: int8_matmul(x, w8, scale))
            row = {"M": M, "layer": layer, "bf16_ms": bf16_ms, "int8_best_ms": best_ms, "best_config": best,
                   "int8_default_ms": default_ms, "default_config": (_config(M), _split_k(M, N, K, *_config(M)[1:3])),
                   "best_weight_gb_s": N * K / best_ms / 1e6, "speedup_vs_bf16": bf16_ms / best_ms}
            rows.append(row)
            print(json.dumps(row), flush=True)
    report(rows, args.json, echo=False)  # each row was printed as it came


if __name__ == "__main__":
    main()
