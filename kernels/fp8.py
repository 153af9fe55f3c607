"""FP8 (e4m3) quantization helpers: per-row weight scales, per-token dynamic activation scales, and
the W8A8 matrix multiply (torch._scaled_mm on the GPU, a float32 emulation as the reference).

    x [M, K] -> xq = x / xs  (xs [M, 1] = amax over the row / 448, computed per step)
    w [N, K] -> wq = w / ws  (ws [N]    = amax over the row / 448, computed at load)
    out      =  (xq @ wq^T) * xs * ws^T

Per-token kernel grid: (M,). Program m loads row m whole (BLOCK = K rounded up to a power of
two), takes its absolute maximum, writes the scale and the quantized row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.hardware import pdl, pdl_start

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
_MIN_SCALE = 1e-12  # an all-zero row still gets a positive scale


def quantize_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, in] -> (float8_e4m3fn [rows, in], float32 scale [rows]), w ~= q * scale."""
    w = w.float()
    # times the reciprocal, as the Triton kernels do: CPU and GPU then agree bit for bit
    scale = w.abs().amax(dim=-1).clamp_min(_MIN_SCALE * FP8_MAX) * (1.0 / FP8_MAX)
    return (w / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def per_token_fp8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8 [M, K], float32 scale [M, 1])."""
    q, scale = quantize_fp8_rows(x)
    return q, scale[:, None]


@triton.jit
def _per_token_fp8_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, BLOCK: tl.constexpr,
                          FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    m = tl.program_id(0)
    k = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + m * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), MIN_SCALE * FP8_MAX) * (1.0 / FP8_MAX)
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(scale_ptr + m, scale)
    tl.store(q_ptr + m * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=k < K)


def per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as per_token_fp8_reference (one Triton program per row)."""
    M, K = x.shape
    q = torch.empty(M, K, dtype=FP8, device=x.device)
    scale = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        on = pdl(x.device)
        _per_token_fp8_kernel[(M,)](x, q, scale, K, x.stride(0), q.stride(0), BLOCK=triton.next_power_of_2(K),
                                    FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, PDL=on,
                                    num_warps=4 if K <= 4096 else 8, launch_pdl=on)
    return q, scale


def fp8_matmul_reference(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float, wq [N, K] fp8, w_scale [N] -> [M, N] in x.dtype: x quantized per token, the
    product computed in float32 from the dequantized operands (what the FP8 tensor cores compute)."""
    xq, xs = per_token_fp8_reference(x)
    out = (xq.float() * xs) @ (wq.float() * w_scale[:, None]).t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def fp8_matmul(x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as fp8_matmul_reference, on FP8 tensor cores (compute capability >= 8.9)."""
    xq, xs = per_token_fp8(x)
    # Row-wise scaled FP8 GEMMs produce bfloat16; other model dtypes get a conversion.
    out = torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=w_scale.view(1, -1), out_dtype=torch.bfloat16)
    if bias is not None:
        out = out.add_(bias)
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)
