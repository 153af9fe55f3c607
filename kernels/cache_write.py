"""Triton kernel that stores a step's new keys and values into their KV-cache slots.

Grid: (num_tokens,). Program t copies key[t] and value[t] ([num_kv_heads, head_dim] each, one
tile) to row slot % block_size of block slot // block_size, slot = slot_mapping[t]. A negative
slot (a padding token) writes nothing. Layout as in reference.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ct, stride_ch,
    BLOCK_SIZE: tl.constexpr, HEADS: tl.constexpr, HEADS_P: tl.constexpr, HEAD_D: tl.constexpr, HEAD_P: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_P)[:, None]
    d = tl.arange(0, HEAD_P)[None, :]
    mask = (h < HEADS) & (d < HEAD_D)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + h * stride_ch + d
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Same contract as reference.write_kv_reference."""
    num_tokens, heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert k_cache.stride() == v_cache.stride() and key.stride(2) == 1 and value.stride(2) == 1
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEADS=heads, HEADS_P=triton.next_power_of_2(heads),
        HEAD_D=head_dim, HEAD_P=triton.next_power_of_2(head_dim),
    )
