"""Decode-step GEMMs of W-small's layers: cuBLAS (F.linear) against cuBLASLt, torch's TunableOp
(every cuBLAS/cuBLASLt algorithm timed per shape, the fastest kept) and the Triton tile kernel of
kernels/int8_matmul.py run on bf16 weights (unit scales), timed the way a decode step runs them:
inside a CUDA graph, over 28 distinct weight matrices (one per layer, so the weights come from
HBM, not L2). GPU only.

    python scripts/gemm_bench.py [--ms 8,16,48,96,224] [--modes cublas,cublaslt,tunable,triton] [--json out.json]
    python scripts/gemm_bench.py --model w-large --ms 256,8192 --modes cublas,cublaslt,tunable,carveout16,carveout32

carveoutN: cuBLASLt told to leave N SMs free (what another stream's kernel could run on).

Per (M, layer): µs per GEMM in each mode (the best Triton configuration's) and the weight-read
bandwidth of the fastest. Decides whether anything beats the default cuBLAS at decode batch sizes.
"""

import argparse
import itertools
import json

import torch
import triton

from graph_timing import graph_us
from llmserve.bench.report import report
from llmserve.kernels.int8_matmul import int8_matmul

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LAYERS = 28
# W-large's (Llama-3.1-8B) layers: --model w-large --ms 256,8192 (its decode and mixed steps); fewer
# distinct matrices, its GEMMs at 8,192 rows are compute-bound
SHAPES_W_LARGE = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LAYERS_W_LARGE = 8


def carveout(sms: int | None) -> None:
    """cuBLASLt GEMMs on all SMs but `sms` (None: all); torch's experimental switch."""
    torch._C._set_sm_carveout_experimental(sms)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--ms", default="8,16,48,96,224")
    ap.add_argument("--modes", default="cublas,cublaslt,tunable,triton")
    ap.add_argument("--model", choices=("w-small", "w-large"), default="w-small")
    args = ap.parse_args()
    modes = args.modes.split(",")
    shapes, layers = (SHAPES, LAYERS) if args.model == "w-small" else (SHAPES_W_LARGE, LAYERS_W_LARGE)
    rows = []
    for layer, (N, K) in shapes.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        ones = torch.ones(N, device="cuda")
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            linear = lambda i: torch.nn.functional.linear(x, ws[i])  # noqa: E731
            row = {"M": M, "layer": layer}
            for mode in modes:
                if mode == "triton":
                    bm = max(16, min(triton.next_power_of_2(M), 64))
                    timed = []
                    for bn, bk, split in itertools.product((32, 64, 128), (64, 128), (1, 2, 4)):
                        cfg = (bm, bn, bk, 4, 4)
                        try:
                            us = graph_us(lambda i: int8_matmul(x, ws[i], ones, config=cfg, split_k=split), layers)
                        except Exception:  # out of shared memory and the like
                            continue
                        timed.append((us, cfg, split))
                    us, row["triton_config"], row["triton_split_k"] = min(timed)
                elif mode == "tunable":  # tuned on the first (warm-up) calls, outside the capture
                    torch.cuda.tunable.enable(True)
                    torch.cuda.tunable.tuning_enable(True)
                    torch.cuda.tunable.set_rotating_buffer_size(256)  # tune on cold operands, as in a step
                    try:
                        us = graph_us(linear, layers)
                    finally:
                        torch.cuda.tunable.enable(False)
                elif mode.startswith("carveout"):
                    torch.backends.cuda.preferred_blas_library("cublaslt")
                    carveout(int(mode.removeprefix("carveout")))
                    try:
                        us = graph_us(linear, layers)
                    finally:
                        carveout(None)
                        torch.backends.cuda.preferred_blas_library("cublas")
                else:
                    torch.backends.cuda.preferred_blas_library(mode)
                    us = graph_us(linear, layers)
                    torch.backends.cuda.preferred_blas_library("cublas")
                row[f"{mode}_us"] = round(us, 2)
            best = min(modes, key=lambda m: row[f"{m}_us"])
            row.update(best=best, best_weight_tb_s=round(N * K * 2 / row[f"{best}_us"] / 1e6, 2),
                       best_tflop_s=round(2 * M * N * K / row[f"{best}_us"] / 1e6, 1))
            rows.append(row)
            print(json.dumps(row), flush=True)
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
