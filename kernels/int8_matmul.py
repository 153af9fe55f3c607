"""W8A16 matrix multiply: activations in bf16/fp16/fp32, weights INT8 with one float32 scale per
output channel, dequantized on the fly.

    out[m, n] = scale[n] * sum_k x[m, k] * w[n, k]  (+ bias[n])

Grid: (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)). A program owns a BLOCK_M x BLOCK_N output tile and
walks K in BLOCK_K steps: it loads an x tile [BLOCK_M, BLOCK_K] and the weight tile
[BLOCK_K, BLOCK_N] as int8 (half the bytes of bf16: the whole point for memory-bound decode),
converts the weights to x's dtype (exact: |w| <= 127), and accumulates on the tensor cores in
float32. The per-channel scale is applied once to the finished tile, not per K step.
Small M (decode) wants narrow N tiles so that enough programs stream the weight matrix; large M
(prefill) wants square tiles that reuse each weight tile across many rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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


@triton.jit
def _int8_matmul_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K,
    stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = rk + k0 < K
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0)
        acc = tl.dot(a, b.to(a.dtype), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(M: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by batch size (chosen on an H100; see BENCHMARKS.md)."""
    if M <= 16:
        return 16, 32, 256, 4, 4
    if M <= 64:
        return triton.next_power_of_2(M), 64, 128, 4, 4
    if M <= 256:
        return 64, 128, 64, 4, 4
    return 128, 128, 64, 8, 3


def int8_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """Same contract as int8_matmul_reference (x may have leading dims; the last one is K);
    `config` overrides the tile choice (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M, N = x2.shape[0], w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    bm, bn, bk, warps, stages = config or _config(M)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm))
    _int8_matmul_kernel[grid](
        x2, w, scale, bias if bias is not None else scale, out, M, N, K,
        x2.stride(0), w.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=stages,
    )
    return out.reshape(*lead, N)
