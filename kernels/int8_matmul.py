"""W8A16 matrix multiply: activations in bf16/fp16/fp32, weights INT8 with one float32 scale per
output channel, dequantized on the fly.

    out[m, n] = scale[n] * sum_k x[m, k] * w[n, k]  (+ bias[n])

The kernel is kernels/matmul.py's (HAS_SCALE); this module chooses its tiles and split for INT8
weights. Grid: (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)). A program owns a BLOCK_M x BLOCK_N output tile and
walks K in BLOCK_K steps: it loads an x tile [BLOCK_M, BLOCK_K] and the weight tile
[BLOCK_K, BLOCK_N] as int8 (half the bytes of bf16: the whole point for memory-bound decode),
converts the weights to x's dtype (exact: |w| <= 127), and accumulates on the tensor cores in
float32. The per-channel scale is applied once to the finished tile, not per K step.
Small M (decode) wants narrow N tiles so that enough programs stream the weight matrix; large M
(prefill) wants square tiles that reuse each weight tile across many rows.

Split-K (small M, matrices with few N tiles): grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K).
Program k walks only its 1/SPLIT_K of K, so a 4096-row matrix keeps SPLIT_K times more programs
streaming. Each stores its float32 partial tile in a workspace slice [k, M, N], then bumps the
tile's counter; the program that arrives last sums the SPLIT_K partials, applies scale and bias,
writes the output and resets the counter to 0 for the next call. One launch, no memset, and
graph-safe: the workspace and counters are allocated once per device and only ever grow before
CUDA-graph capture (the warm-up runs every layer first).
"""

from __future__ import annotations

import torch
import triton

from llmserve.kernels.matmul import weight_matmul


def quantize_int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row INT8: w [rows, in] -> (int8 [rows, in], float32 scale [rows]), w ~= q * scale."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def int8_matmul_reference(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float, w [N, K] int8, scale [N] float32, bias [N] or None -> [M, N] in x.dtype (float32 math)."""
    out = (x.float() @ w.float().t()) * scale
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


_SPLIT_M_MAX = 16  # split-K only for batches up to this; the workspace is sized for it


def _split_k(M: int, N: int, K: int, block_n: int, block_k: int) -> int:
    """Enough programs to cover every SM a few times over when N alone gives too few tiles."""
    if M > _SPLIT_M_MAX:
        return 1
    tiles = triton.cdiv(N, block_n)
    split = 1
    while tiles * split < SPLIT_TARGET_PROGRAMS and K // (2 * split) >= 2 * block_k and split < 8:
        split *= 2
    return split


SPLIT_TARGET_PROGRAMS = 384  # chosen on an H200 with scripts/int8_sweep.py (BENCHMARKS.md)


def _config(M: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by batch size (swept on an H200; BENCHMARKS.md)."""
    if M <= 16:
        return 16, 32, 256, 4, 4
    if M <= 64:
        return triton.next_power_of_2(M), 32, 128, 4, 4
    if M <= 256:
        return 64, 128, 64, 4, 4
    return 128, 128, 64, 8, 3


def int8_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                config: tuple[int, int, int, int, int] | None = None, split_k: int | None = None) -> torch.Tensor:
    """Same contract as int8_matmul_reference (x may have leading dims; the last one is K);
    `config` overrides the tile choice (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) and
    `split_k` the number of K slices."""

    def choose(M: int, N: int, K: int) -> tuple[tuple[int, int, int, int, int], int]:
        cfg = config or _config(M)
        return cfg, split_k or _split_k(M, N, K, cfg[1], cfg[2])

    return weight_matmul(x, w, choose, scale=scale, bias=bias, owner="int8", max_rows=_SPLIT_M_MAX)
