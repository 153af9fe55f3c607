"""Fused Gumbel-max sampling: one pass over a row of logits, no [B, V] temporaries.

For row b with temperature T > 0 the token is argmax_v (logits[b, v] / T + g(key[b], v)) with Gumbel
noise g = -log(-log u) and u in (0, 1) from a 32-bit counter hash of (row key, v): an exact sample
from softmax(logits / T), reproducible from the key alone. T == 0 rows take argmax_v logits[b, v].
Ties resolve to the smallest index, as torch.argmax does.

Grid: (B,). Program b walks its row BLOCK entries at a time, keeping per-lane running maxima and
their indices, and reduces them once at the end.

`gumbel_argmax_reference` computes the same function in torch (int64 arithmetic masked to 32 bits),
for the CPU backend and as this kernel's test oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_GOLDEN = 0x9E3779B9
_M1, _M2 = 0x7FEB352D, 0x846CA68B
_MASK = 0xFFFFFFFF


@triton.jit
def _hash32(x):
    # "lowbias32" integer hash on uint32 (wrapping multiplies).
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, temp_ptr, key_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    key = tl.load(key_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(0, V, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        valid = idx < V
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + idx, mask=valid, other=float("-inf")).to(tl.float32)
        if t > 0:
            h = _hash32(key + idx.to(tl.uint32) * 0x9E3779B9)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            x = tl.where(valid, x / t - tl.log(-tl.log(u)), float("-inf"))
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best, 0)
    winner = tl.min(tl.where(best == top, best_idx, V), 0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """logits float [B, V] (row stride free, unit column stride), temperature float32 [B], key int64 [B]
    (low 32 bits used) -> int64 tokens [B]."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        _gumbel_argmax_kernel[(B,)](logits, logits.stride(0), temperature, key, out, V, BLOCK=1024, num_warps=8)
    return out


def _hash32_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def gumbel_noise_reference(key: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [B, V]: the kernel's Gumbel noise g(key, v)."""
    idx = torch.arange(vocab, device=key.device, dtype=torch.int64)
    h = _hash32_torch(((key & _MASK)[:, None] + idx[None, :] * _GOLDEN) & _MASK)
    u = ((h >> 8).float() + 0.5) * (1.0 / 16777216.0)
    return -torch.log(-torch.log(u))


def gumbel_argmax_reference(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    scaled = logits.float() / torch.where(temperature > 0, temperature, 1.0)[:, None]
    noisy = scaled + gumbel_noise_reference(key, logits.shape[1])
    return torch.where(temperature > 0, noisy.argmax(-1), logits.argmax(-1))


def row_keys(seeds, out_index):
    """int64 [B] keys in [0, 2**32) from a request's seed (any int64) and its output position.
    Works alike on torch tensors and numpy int64 arrays (the runner hashes on the host: a few
    vector ops there instead of ~35 tiny kernel launches per step)."""
    lo, hi = seeds & _MASK, (seeds >> 32) & _MASK
    return _hash32_torch(_hash32_torch(lo ^ _hash32_torch(hi)) ^ ((out_index * _GOLDEN) & _MASK))
