"""Decode GEMMs as a step runs them: a model's four layer shapes, each as 28 x [RMSNorm of the
activations -> GEMM with W_layer] in one CUDA graph (28 distinct weights: they come from HBM), the
GEMM being cuBLAS (F.linear) or kernels/matmul.py's PDL kernel with its default tiles; gate_up as
cuBLAS + SiLU·mul against the gated kernel. --sweep also times every tile configuration. GPU only.

    python scripts/decode_gemm_bench.py [--model w-small|w-large] [--ms 8,16,...] [--tp P] [--sweep]
                                        [--layers qkv,o,gate_up,down] [--json out.json]

Per (M, layer): µs per norm + GEMM (+ SiLU·mul) for each, the norm alone, and the weights' read
rate (GB/s) each GEMM reached. --tp P: the shapes one rank of P holds (qkv's and gate_up's rows,
o's and down's columns split P ways), to see how a tensor-parallel step's smaller GEMMs stream.
"""

import argparse
import itertools

import torch

from graph_timing import emit, graph_us
from llmserve.bench.report import report
from llmserve.kernels.fused import rms_norm, silu_and_mul
from llmserve.kernels.matmul import dense_matmul

SHAPES = {  # (N, K); gate_up's N counts gate and up rows
    "w-small": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "w-large": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}
LAYERS = {"w-small": 28, "w-large": 8}  # distinct weights per graph: more than L2 holds


def configs(M: int):
    bms = {max(16, min(1 << (M - 1).bit_length(), 64)), 128 if M > 64 else 64, 256 if M > 128 else 64}
    for bm, bn, bk, split in itertools.product(sorted(bms), (32, 64, 128), (64, 128), (1, 2, 4)):
        if bm * bn > 128 * 128 or (bm >= 256 and bn > 64):
            continue
        warps = 8 if bm * bn >= 128 * 128 or bm >= 256 else 4
        yield (bm, bn, bk, warps, 3 if bm * bn >= 128 * 128 else 4), split


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--model", default="w-small", choices=list(SHAPES))
    ap.add_argument("--ms", default="8,16,32,64,96,128,160,192,224,256")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--layers", help="comma-separated: only these of qkv, o, gate_up, down")
    args = ap.parse_args()
    rows = []
    F = torch.nn.functional
    layers = LAYERS[args.model]
    for layer, (N, K) in SHAPES[args.model].items():
        if args.layers and layer not in args.layers.split(","):
            continue
        if layer in ("qkv", "gate_up"):  # column-parallel: each rank holds N / P rows
            N //= args.tp
        else:  # row-parallel: K / P columns, the partial sums all-reduced after
            K //= args.tp
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        g = torch.ones(K, device="cuda", dtype=torch.bfloat16)
        gated = layer == "gate_up"
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            if gated:
                cublas = lambda i: silu_and_mul(F.linear(rms_norm(x, g, 1e-6), ws[i]))  # noqa: E731
            else:
                cublas = lambda i: F.linear(rms_norm(x, g, 1e-6), ws[i])  # noqa: E731
            ref = cublas(0)
            ours = lambda i: dense_matmul(rms_norm(x, g, 1e-6), ws[i], gated=gated)  # noqa: E731
            torch.testing.assert_close(ours(0), ref, rtol=2e-2, atol=2e-2)
            row = {"M": M, "layer": layer, "tp": args.tp, "N": N, "K": K,
                   "norm_us": graph_us(lambda i: rms_norm(x, g, 1e-6), layers),
                   "cublas_us": graph_us(cublas, layers), "default_us": graph_us(ours, layers)}
            row["gain_us"] = row["cublas_us"] - row["default_us"]
            for side in ("cublas", "default"):  # the weights' bytes over the GEMM's time (the norm's taken out)
                row[f"{side}_gb_s"] = 2e-3 * N * K / max(row[f"{side}_us"] - row["norm_us"], 1e-3)
            if args.sweep:
                timed = []
                for cfg, split in configs(M):
                    fn = lambda i: dense_matmul(rms_norm(x, g, 1e-6), ws[i], gated=gated, config=cfg, split_k=split)  # noqa: E731
                    try:
                        torch.testing.assert_close(fn(0), ref, rtol=2e-2, atol=2e-2)
                        timed.append((graph_us(fn, layers), cfg, split))
                    except Exception as e:  # out of shared memory and the like
                        print("skip", layer, M, cfg, split, type(e).__name__, str(e)[:100], flush=True)
                row["top5"] = [(round(u, 2), c, s) for u, c, s in sorted(timed)[:5]]
            emit(rows, row)
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
