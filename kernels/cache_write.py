"""Triton kernel that stores a step's new keys and values into their KV-cache slots.

Grid: (num_tokens,). Program t copies key[t] and value[t] ([num_kv_heads, head_dim] each, one
tile) to row slot % block_size of block slot // block_size, slot = slot_mapping[t]. A negative
slot (a padding token) writes nothing. Layout as in reference.py. For an FP8 cache the program
also reduces each head's row to its absolute maximum, stores scale = amax / 448 per head, and the
row divided by it in e4m3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.hardware import pdl, pdl_start


@triton.jit
def _store(x_ptr, cache_ptr, scale_ptr, dst, scale_dst, h_ok, mask, FP8: tl.constexpr):
    x = tl.load(x_ptr, mask=mask, other=0.0)
    if FP8:
        x = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-12 * 448.0) * (1.0 / 448.0)
        tl.store(scale_ptr + scale_dst, scale, mask=h_ok)
        x = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(cache_ptr + dst, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
    BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_D: tl.constexpr, HEAD_P: tl.constexpr,
    FP8: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_P)
    h = heads[:, None]
    d = tl.arange(0, HEAD_P)[None, :]
    mask = (h < HEADS) & (d < HEAD_D)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h * stride_ch + d
    scale_dst = (slot // BLOCK_SIZE) * stride_sb + (slot % BLOCK_SIZE) * stride_st + heads
    _store(key_ptr + t * stride_kt + h * stride_kh + d, k_cache_ptr, k_scale_ptr, dst, scale_dst, heads < HEADS,
           mask, FP8)
    _store(value_ptr + t * stride_vt + h * stride_vh + d, v_cache_ptr, v_scale_ptr, dst, scale_dst, heads < HEADS,
           mask, FP8)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    """Same contract as reference.write_kv_reference."""
    num_tokens, heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride() and key.stride(2) == 1 and value.stride(2) == 1
    fp8 = k_scale is not None
    assert not fp8 or (k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1)
    scales = (k_scale, v_scale) if fp8 else (k_cache, v_cache)  # unused pointers without FP8
    on = pdl(key.device)
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, *scales,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scales[0].stride(0), scales[0].stride(1),
        BLOCK_SIZE=k_cache.shape[1], HEADS=heads, HEADS_P=triton.next_power_of_2(heads),
        HEAD_D=head_dim, HEAD_P=triton.next_power_of_2(head_dim), FP8=fp8, PDL=on, launch_pdl=on,
    )
