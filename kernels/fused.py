"""Fused elementwise kernels of the decoder layer, each one pass over its rows, and their torch
references (the CPU backend's implementation and the test oracle).

Numerics follow transformers so that float32 stays token-exact and half precision rounds where
transformers rounds: the residual sum is rounded to the activation dtype before it is normalised,
the normalised value is rounded before the weight multiplies it, SiLU is rounded before the product.

- rms_norm(x, w, eps, residual=None): grid (rows,); one row of `hidden` per program.
  With a residual: s = x + residual (rounded), returns (norm(s) * w, s) — the add fused in.
- rotary(q, k, positions, cos, sin): grid (tokens,); one token's query and key heads per program,
  rotate-halves (neox) style, in place. rotary_and_write_kv: the same, with the rotated key and
  the value stored straight into their KV-cache slot (the decoder's path: one kernel, not two).
- silu_and_mul(x): grid (rows, column blocks); x = [gate | up] per row -> silu(gate) * up.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.hardware import pdl, pdl_start


# ---- RMSNorm (+ residual add) -------------------------------------------------------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o, stride_ro, N, eps,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    add_norm_row(x, res_ptr + row * stride_r, w_ptr, out_ptr + row * stride_o, res_out_ptr + row * stride_ro, cols,
                 mask, N, eps, HAS_RES)


@triton.jit
def add_norm_row(x, res_ptr, w_ptr, out_ptr, res_out_ptr, cols, mask, N, eps, HAS_RES: tl.constexpr):
    """One row x [BLOCK] (its first N valid): with HAS_RES, s = x + the residual row (rounded) is
    stored as the new residual; norm(s) * w is stored at out_ptr. (The all-reduce kernel's ending.)"""
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(res_ptr + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [..., N] -> normalised [..., N]; with residual, (normalised, x + residual)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    rows, n = x2.shape
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res2 = residual.reshape(-1, n) if residual is not None else x2
    if rows:
        on = pdl(x.device)
        _rms_norm_kernel[(rows,)](x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0), out.stride(0),
                                  res_out.stride(0), n, eps, HAS_RES=residual is not None,
                                  BLOCK=triton.next_power_of_2(n), PDL=on, num_warps=4 if n <= 2048 else 8,
                                  launch_pdl=on)
    if residual is None:
        return out.view(shape)
    return out.view(shape), res_out.view(shape)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, x)


# ---- rotary embedding ---------------------------------------------------------------------------

@triton.jit
def _store_halves(cache_ptr, scale_ptr, dst, scale_dst, x1, x2, mask, heads_ok, HALF: tl.constexpr,
                  FP8: tl.constexpr):
    """One token's heads, given as halves [H, HALF] each, into their cache row; for an FP8 cache
    quantized per head exactly as cache_write._store does."""
    if FP8:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(f1), 1), tl.max(tl.abs(f2), 1))
        scale = tl.maximum(amax, 1e-12 * 448.0) * (1.0 / 448.0)
        tl.store(scale_ptr + scale_dst, scale, mask=heads_ok)
        x1 = tl.clamp(f1 / scale[:, None], -448.0, 448.0)
        x2 = tl.clamp(f2 / scale[:, None], -448.0, 448.0)
    tl.store(cache_ptr + dst, x1.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + dst + HALF, x2.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
                   k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
                   stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
                   HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
                   NORM: tl.constexpr, WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    d = tl.arange(0, DP)
    dmask = d < HALF
    cos = tl.load(cos_ptr + pos * stride_c + d, mask=dmask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_c + d, mask=dmask, other=0.0)
    heads_p = tl.arange(0, HP)
    h = heads_p[:, None]
    for which in tl.static_range(2):
        if which == 0:
            base = q_ptr + t * stride_qt
            stride_h = stride_qh
            heads = HQ
            w_ptr = qw_ptr
        else:
            base = k_ptr + t * stride_kt
            stride_h = stride_kh
            heads = HK
            w_ptr = kw_ptr
        m = (h < heads) & dmask[None, :]
        p1 = base + h * stride_h + d[None, :]
        x1 = tl.load(p1, mask=m, other=0.0)
        x2 = tl.load(p1 + HALF, mask=m, other=0.0)
        dtype = x1.dtype
        if NORM:  # Qwen3's RMSNorm of each head first, as the rms_norm kernel computes it
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            inv = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
            w1 = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
            w2 = tl.load(w_ptr + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
            x1 = ((f1 * inv).to(dtype).to(tl.float32) * w1).to(dtype)
            x2 = ((f2 * inv).to(dtype).to(tl.float32) * w2).to(dtype)
        c, s = cos.to(dtype)[None, :], sin.to(dtype)[None, :]
        # transformers: x * cos + rotate_half(x) * sin, each product in the activation dtype.
        y1 = ((x1 * c).to(dtype) - (x2 * s).to(dtype)).to(dtype)
        y2 = ((x2 * c).to(dtype) + (x1 * s).to(dtype)).to(dtype)
        if WRITE_KV and which == 1:  # the rotated key and the value go straight to the cache slot
            slot = tl.load(slot_ptr + t)
            block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            dst = block * stride_cb + offset * stride_ct + h * stride_ch + d[None, :]
            scale_dst = block * stride_sb + offset * stride_st + heads_p
            # a padding token (slot -1) writes nothing; slot broadcast to a vector (the interpreter
            # turns a scalar condition & a vector into an int32 mask)
            heads_ok = (heads_p < HK) & (heads_p * 0 + slot >= 0)
            ok = heads_ok[:, None] & dmask[None, :]
            _store_halves(k_cache_ptr, k_scale_ptr, dst, scale_dst, y1, y2, ok, heads_ok, HALF, FP8)
            pv = v_ptr + t * stride_vt + h * stride_vh + d[None, :]
            v1 = tl.load(pv, mask=m, other=0.0)
            v2 = tl.load(pv + HALF, mask=m, other=0.0)
            _store_halves(v_cache_ptr, v_scale_ptr, dst, scale_dst, v1, v2, ok, heads_ok, HALF, FP8)
        else:
            tl.store(p1, y1, mask=m)
            tl.store(p1 + HALF, y2, mask=m)


def _launch_rotary(q, k, v, positions, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping,
                   k_scale, v_scale) -> None:
    T, hq, dim = q.shape
    if not T:
        return
    norm, write_kv, fp8 = q_weight is not None, k_cache is not None, k_scale is not None
    if write_kv:
        assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and v.stride(2) == 1
        assert not fp8 or (k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1)
    else:  # unused pointers and strides
        v, k_cache, v_cache, slot_mapping = k, cos, cos, positions
    scales = (k_scale, v_scale) if fp8 else (cos, cos)
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)) if write_kv else (0, 0, 0)
    on = pdl(q.device)
    _rotary_kernel[(T,)](q, k, v, positions, cos, sin, q_weight if norm else cos, k_weight if norm else cos, eps,
                         k_cache, v_cache, slot_mapping, *scales,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
                         *cache_strides, k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
                         HQ=hq, HK=k.shape[1], HALF=dim // 2,
                         HP=triton.next_power_of_2(max(hq, k.shape[1])), DP=triton.next_power_of_2(dim // 2),
                         NORM=norm, WRITE_KV=write_kv, BLOCK_SIZE=k_cache.shape[1] if write_kv else 1, FP8=fp8,
                         PDL=on, launch_pdl=on)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None, eps: float = 0.0) -> None:
    """In place: q [T, Hq, D], k [T, Hkv, D] (unit stride on D); cos/sin float32 [max_pos, D].
    With q_weight/k_weight [D], each head is RMS-normalised first (Qwen3's q/k norm): one pass
    instead of copying the strided heads out, normalising and rotating them in three."""
    _launch_rotary(q, k, None, positions, cos, sin, q_weight, k_weight, eps, None, None, None, None, None)


def rotary_and_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                        v_scale: torch.Tensor | None = None, q_weight: torch.Tensor | None = None,
                        k_weight: torch.Tensor | None = None, eps: float = 0.0) -> None:
    """rotary() of q in place, and of k into the cache: the rotated keys and the values v [T, Hkv, D]
    are stored at slot_mapping [T] as cache_write.write_kv stores them (negative slot: nothing),
    and k itself is left as it was. One kernel per layer instead of two, k not written back."""
    _launch_rotary(q, k, v, positions, cos, sin, q_weight, k_weight, eps, k_cache, v_cache, slot_mapping,
                   k_scale, v_scale)


def rotary_reference(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                     eps: float = 0.0) -> None:
    if q_weight is not None:
        q.copy_(rms_norm_reference(q, q_weight, eps))
        k.copy_(rms_norm_reference(k, k_weight, eps))
    c = cos[positions].to(q.dtype)[:, None, :]
    s = sin[positions].to(q.dtype)[:, None, :]
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * c + rotated * s)


# ---- SiLU(gate) * up ----------------------------------------------------------------------------

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


SILU_BLOCK = 1024
"""Columns a silu_and_mul program takes: a decode step's few rows spread over many programs (one
program looping over a 14,336-wide row waits on one load after another)."""


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2N] = [gate | up] -> silu(gate) * up [T, N]."""
    rows, two_n = x.shape
    n = two_n // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        on = pdl(x.device)
        block = min(triton.next_power_of_2(n), SILU_BLOCK)
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block,
                                                            PDL=on, launch_pdl=on)
    return out


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
