"""Fused Gumbel-max sampling: one pass over a row of logits, no [B, V] temporaries.

For row b with temperature T > 0 the token is argmax_v (logits[b, v] * (1 / T) + g(key[b], v)) with
Gumbel noise g = -log(-log u) and u in (0, 1) from the top 23 bits of a 32-bit counter hash of
(row key, v) (u = (k + 0.5) / 2**23, at most 1 - 2**-24: g < 16.7, never infinite): an exact
sample from softmax(logits / T), reproducible from the key alone. T == 0 rows take argmax_v
logits[b, v]. Ties resolve to the smallest index, as torch.argmax does.

The kernel is bound by arithmetic, not by reading the logits, so on the GPU the outer logarithm
is the hardware's approximate one (MUFU lg2: relative error ~2**-22 of e = -log u, an absolute
error ~1e-7 of the noise); the inner stays accurate, since near u = 1 e is tiny and an absolute
error there would be a large relative error of e, i.e. of the noise. The scale is one multiply
by 1 / T, not a division per logit.

Grid: (B, S). Program (b, s) walks slice s of row b BLOCK entries at a time, keeping per-lane
running maxima and their indices, and leaves the slice's best (value, index); a second kernel
picks each row's best slice. S is chosen so that the grid fills the device even when the batch
alone would not (a row of 151,936 logits is one long walk for a single program). Logits may be in
the model's dtype: they are upcast to float32 as they are read, so the draw is the same.

`gumbel_argmax_reference` computes the same function in torch (int64 arithmetic masked to 32 bits),
for the CPU backend and as this kernel's test oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.language.extra import libdevice

from llmserve.kernels.hardware import pdl, pdl_start, sm_count

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
def _gumbel_argmax_kernel(logits_ptr, stride, temp_ptr, key_ptr, best_ptr, index_ptr, V, CHUNK, BLOCK: tl.constexpr,
                          FAST_LOG: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row, part = tl.program_id(0), tl.program_id(1)
    t = tl.load(temp_ptr + row)
    inv_t = 1.0 / t
    key = tl.load(key_ptr + row).to(tl.uint32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    for start in range(part * CHUNK, (part + 1) * CHUNK, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        valid = idx < V
        x = tl.load(logits_ptr + row.to(tl.int64) * stride + idx, mask=valid, other=float("-inf")).to(tl.float32)
        if t > 0:
            h = _hash32(key + idx.to(tl.uint32) * 0x9E3779B9)
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # see _uniform
            e = -tl.log(u)  # accurate: near u = 1, e is tiny and its relative error would be the noise's error
            x = tl.where(valid, x * inv_t - (libdevice.fast_logf(e) if FAST_LOG else tl.log(e)), float("-inf"))
        better = x > best
        best = tl.where(better, x, best)
        best_idx = tl.where(better, idx, best_idx)
    top = tl.max(best, 0)
    out = row * tl.num_programs(1) + part
    tl.store(best_ptr + out, top)
    tl.store(index_ptr + out, tl.min(tl.where(best == top, best_idx, V), 0))


@triton.jit(do_not_specialize=["S"])  # one variant whatever the batch's slice count
def _pick_slice_kernel(best_ptr, index_ptr, out_ptr, S, V, S_P: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0)
    s = tl.arange(0, S_P)
    best = tl.load(best_ptr + row * S + s, mask=s < S, other=float("-inf"))
    idx = tl.load(index_ptr + row * S + s, mask=s < S, other=V)
    top = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, idx, V), 0).to(tl.int64))


MAX_SLICES = 32
_BLOCK, _WARPS = 2048, 16  # scripts/sampler_bench.py (H100): 7% over (1024, 8) at 128-256 rows, equal below


def vocab_slices(rows: int, vocab: int, device: torch.device) -> int:
    """Slices per row: about four programs per SM in all, each at least a few BLOCKs long."""
    want = triton.cdiv(4 * sm_count(device), max(rows, 1))
    return max(1, min(MAX_SLICES, want, triton.cdiv(vocab, 2 * _BLOCK)))


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor,
                  slices: int | None = None) -> torch.Tensor:
    """logits float [B, V] (any float dtype; row stride free, unit column stride), temperature
    float32 [B], key int64 [B] (low 32 bits used) -> int64 tokens [B]. `slices` overrides the
    number of vocabulary slices per row (at most MAX_SLICES)."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        S = slices or vocab_slices(B, V, logits.device)
        chunk = triton.cdiv(triton.cdiv(V, S), _BLOCK) * _BLOCK
        best = torch.empty(B, S, dtype=torch.float32, device=logits.device)
        index = torch.empty(B, S, dtype=torch.int32, device=logits.device)
        on = pdl(logits.device)
        _gumbel_argmax_kernel[(B, S)](logits, logits.stride(0), temperature, key, best, index, V, chunk,
                                      BLOCK=_BLOCK, FAST_LOG=logits.is_cuda, PDL=on, num_warps=_WARPS, launch_pdl=on)
        _pick_slice_kernel[(B,)](best, index, out, S, V, S_P=MAX_SLICES, PDL=on, launch_pdl=on)
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
    return -torch.log(-torch.log(_uniform(h)))


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """float32 u in (0, 1) from the top 23 bits of a hash: (k + 0.5) / 2**23 is exact in float32
    for k < 2**23, so u <= 1 - 2**-24 and the noise stays finite (with 24 bits, k + 0.5 rounds up
    to 2**24 for the largest k: u = 1, infinite noise, a uniformly random token for ~1% of rows of
    a 152k vocabulary)."""
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def gumbel_argmax_reference(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    scaled = logits.float() * (1.0 / torch.where(temperature > 0, temperature, 1.0))[:, None]
    noisy = scaled + gumbel_noise_reference(key, logits.shape[1])
    return torch.where(temperature > 0, noisy.argmax(-1), logits.argmax(-1))


def row_keys(seeds, out_index):
    """int64 [B] keys in [0, 2**32) from a request's seed (any int64) and its output position.
    Works alike on torch tensors and numpy int64 arrays (the runner hashes on the host: a few
    vector ops there instead of ~35 tiny kernel launches per step)."""
    lo, hi = seeds & _MASK, (seeds >> 32) & _MASK
    return _hash32_torch(_hash32_torch(lo ^ _hash32_torch(hi)) ^ ((out_index * _GOLDEN) & _MASK))
