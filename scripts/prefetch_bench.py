"""Does pulling a decode GEMM's weights into L2 during the small kernel before it pay? W-small's
four layer shapes, each as 28 x [RMSNorm of the activations -> F.linear(x, W_layer)] inside one
CUDA graph (28 distinct weights, so they come from HBM), three ways:

- cold: the norm as shipped; the GEMM reads its weights from HBM;
- prefetch: the norm's programs also issue L2 prefetches of W_layer (prefetch.global.L2 per
  128-byte line), so the GEMM finds (part of) them in L2;
- hot: one weight matrix for all 28 (L2-resident): the most any prefetch could give.

    python scripts/prefetch_bench.py [--ms 8,64,224] [--json out.json]
"""

import argparse

import torch
import triton
import triton.language as tl

from graph_timing import emit, graph_us
from llmserve.bench.report import report
from llmserve.kernels.fused import rms_norm

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LAYERS = 28
LINE = 128


@triton.jit
def _prefetch_l2(ptrs):
    return tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _norm_prefetch_kernel(x_ptr, w_ptr, out_ptr, pre_ptr, lines_per_prog, total_lines, N, eps,
                          BLOCK: tl.constexpr, LINES: tl.constexpr):
    row = tl.program_id(0)
    first = row * lines_per_prog
    for start in range(first, first + lines_per_prog, LINES):
        idx = start + tl.arange(0, LINES)
        ok = (idx < first + lines_per_prog) & (idx < total_lines)
        _prefetch_l2(tl.where(ok, pre_ptr + idx.to(tl.int64) * 64, pre_ptr))  # 64 bf16 = one 128-byte line
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (x * inv * w).to(out_ptr.dtype.element_ty), mask=mask)


def norm_prefetch(x, w, weight_to_fetch, eps=1e-6):
    M, N = x.shape
    out = torch.empty_like(x)
    total = weight_to_fetch.numel() * weight_to_fetch.element_size() // LINE
    per = triton.cdiv(total, M)
    _norm_prefetch_kernel[(M,)](x, w, out, weight_to_fetch, per, total, N, eps, BLOCK=triton.next_power_of_2(N),
                                LINES=256, num_warps=4)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="8,64,224")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    for layer, (N, K) in SHAPES.items():
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        g = torch.ones(K, device="cuda", dtype=torch.bfloat16)
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            F = torch.nn.functional
            row = {"M": M, "layer": layer,
                   "norm_us": graph_us(lambda i: rms_norm(x, g, 1e-6), LAYERS),
                   "norm_prefetch_us": graph_us(lambda i: norm_prefetch(x, g, ws[i]), LAYERS),
                   "cold_us": graph_us(lambda i: F.linear(rms_norm(x, g, 1e-6), ws[i]), LAYERS),
                   "prefetch_us": graph_us(lambda i: F.linear(norm_prefetch(x, g, ws[i]), ws[i]), LAYERS),
                   "hot_us": graph_us(lambda i: F.linear(rms_norm(x, g, 1e-6), ws[0]), LAYERS)}
            y = F.linear(norm_prefetch(x, g, ws[0]), ws[0])
            torch.testing.assert_close(y, F.linear(rms_norm(x, g, 1e-6), ws[0]))
            emit(rows, row)
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
