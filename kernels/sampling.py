"""Fused sampling: two short kernels over a batch of logits rows, no [B, V] temporaries.

For row b with temperature T > 0 the token is drawn by inverse transform from softmax(logits / T):
with weights w_v = 2^(y_v - max y), y = logits * (log2(e) / T), it is the first v whose cumulative
weight exceeds u * sum(w), u in (0, 1) from the top 23 bits of a 32-bit hash of the row's key
(u = (k + 0.5) / 2**23, exact in float32, below 1). Reproducible from the key alone: the vocabulary
is cut into slices of a fixed SLICE entries whatever the batch, so no sum's rounding depends on
the rows around it. T == 0 rows take argmax_v logits[b, v], the smallest index on ties, as
torch.argmax does.

Kernel 1, grid (B, cdiv(V, SLICE)): program (b, j) reads slice j of row b once, BLOCK entries at a
time, and leaves the slice's maximum m_j of y and s_j = sum 2^(y - m_j) (per-lane sums, rescaled
when a tile raises the maximum: one exp2 a logit); greedy rows the slice's maximum and its first
index. Kernel 2, grid (B,): program b weighs the slices, w_j = s_j * 2^(m_j - M), finds the slice
where u * sum(w) falls and walks only that slice, BLOCK at a time, to the token (a cumulative sum
a tile). It reads at most one slice a row again, from L2 as a rule.

This replaced a one-pass Gumbel-max kernel (argmax of y + Gumbel noise, a hash and two logarithms
a logit), which was bound by that arithmetic: at W-small's 218 rows on an H100, 63.6 µs against
32.4 µs now (2.0 TB/s of logits; `scripts/sampler_bench.py`, BENCHMARKS.md). Rows with min_p,
top_k or top_p still draw Gumbel-max in torch (model/sampler.py, gumbel_noise_reference). Logits
may be in the model's dtype: they are upcast to float32 as they are read, so the draw is the same.

`sample_rows_reference` computes the same function in torch (int64 arithmetic masked to 32 bits,
the cumulative sums in float64), for the CPU backend and as this kernel's test oracle.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.hardware import pdl, pdl_start

_GOLDEN = 0x9E3779B9
_M1, _M2 = 0x7FEB352D, 0x846CA68B
_MASK = 0xFFFFFFFF
_U_SALT = 0x5BD1E995  # a row's u hashes its key with this, apart from the Gumbel streams of gumbel_noise_reference
_LOG2E = 1.4426950408889634


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
def _slice_stats_kernel(logits_ptr, stride, temp_ptr, m_ptr, s_ptr, idx_ptr, V, NUM_SLICES,
                        SLICE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (b, j): over slice j of row b, y = logits * log2(e) / T, its maximum m and
    s = sum 2^(y - m); greedy rows (T == 0) the maximum of the logits and its first index."""
    pdl_start(PDL)
    row, part = tl.program_id(0), tl.program_id(1)
    t = tl.load(temp_ptr + row)
    c = tl.where(t > 0, 1.4426950408889634 / tl.where(t > 0, t, 1.0), 1.0)  # greedy rows: the logits as they are
    base = logits_ptr + row.to(tl.int64) * stride
    m_run = tl.full([], -3.0e38, tl.float32)  # finite: a slice of -inf logits keeps s = 0, not 2^(-inf + inf)
    acc = tl.zeros([BLOCK], tl.float32)
    best_idx = tl.full([], V, tl.int32)
    for start in range(part * SLICE, (part + 1) * SLICE, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        y = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32) * c
        m_blk = tl.max(y, 0)
        if t > 0:
            m_new = tl.maximum(m_run, m_blk)
            acc = acc * tl.math.exp2(m_run - m_new) + tl.math.exp2(y - m_new)
            m_run = m_new
        elif m_blk > m_run:  # strictly: the first index of the maximum wins
            m_run = m_blk
            best_idx = tl.min(tl.where(y == m_blk, idx, V), 0)
    out = row * NUM_SLICES + part
    tl.store(m_ptr + out, m_run)
    tl.store(s_ptr + out, tl.sum(acc, 0))
    tl.store(idx_ptr + out, best_idx)


@triton.jit(do_not_specialize=["NUM_SLICES"])
def _pick_token_kernel(logits_ptr, stride, temp_ptr, key_ptr, m_ptr, s_ptr, idx_ptr, out_ptr, V, NUM_SLICES,
                       SLICE: tl.constexpr, BLOCK: tl.constexpr, SLICES_P: tl.constexpr, PDL: tl.constexpr):
    """Program b: the slice where u * (sum of row b's weights) falls, then the token inside it."""
    pdl_start(PDL)
    row = tl.program_id(0)
    t = tl.load(temp_ptr + row)
    j = tl.arange(0, SLICES_P)
    ok = j < NUM_SLICES
    m = tl.load(m_ptr + row * NUM_SLICES + j, mask=ok, other=-3.0e38)
    top = tl.max(m, 0)
    if t > 0:
        s = tl.load(s_ptr + row * NUM_SLICES + j, mask=ok, other=0.0)
        w = s * tl.math.exp2(m - top)
        cum = tl.cumsum(w, 0)
        total = tl.sum(w, 0)
        key = tl.load(key_ptr + row).to(tl.uint32)
        u = ((_hash32(key ^ 0x5BD1E995) >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # uniform_reference
        target = u * total
        last = tl.max(tl.where(w > 0, j, 0), 0)  # rounding may leave target at or past the last sum
        hit = tl.minimum(tl.sum((cum <= target).to(tl.int32), 0), last)
        rest = target - tl.sum(tl.where(j < hit, w, 0.0), 0)
        c = 1.4426950408889634 / t
        base = logits_ptr + row.to(tl.int64) * stride
        start = hit * SLICE
        end = tl.minimum(start + SLICE, V)
        token = tl.full([], -1, tl.int32)
        fallback = tl.full([], 0, tl.int32)
        while (token < 0) & (start < end):
            idx = start + tl.arange(0, BLOCK)
            y = tl.load(base + idx, mask=idx < end, other=float("-inf")).to(tl.float32) * c
            p = tl.math.exp2(y - top)
            below = tl.sum((tl.cumsum(p, 0) <= rest).to(tl.int32), 0)
            if below < BLOCK:
                token = start + below
            else:
                rest -= tl.sum(p, 0)
                fallback = tl.max(tl.where(p > 0, idx, fallback), 0)
                start += BLOCK
        if token < 0:  # target at the very end of the slice: its last token of nonzero weight
            token = fallback
        if total == 0:  # no token of nonzero weight at all: token 0, as torch.argmax gives
            token = 0
    else:
        idx = tl.load(idx_ptr + row * NUM_SLICES + j, mask=ok, other=V)
        token = tl.min(tl.where(m == top, idx, V), 0)
    token = tl.where(token < V, token, 0)  # a greedy row of -inf logits: token 0 too
    tl.store(out_ptr + row, token.to(tl.int64))


SLICE, _BLOCK, _WARPS = 8192, 4096, 4  # scripts/sampler_bench.py --sweep (H100): the best of 27 at 15-256 rows


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor,
                tiles: tuple[int, int] = (SLICE, _BLOCK)) -> torch.Tensor:
    """logits float [B, V] (any float dtype; row stride free, unit column stride), temperature
    float32 [B], key int64 [B] (low 32 bits used) -> int64 tokens [B]: a draw from
    softmax(logits / T) per row, the token where u(key) falls in the cumulative weights; T == 0:
    argmax (first index on ties). `tiles` (slice, block: powers of two, block <= slice) only for
    tests: the draw's rounding, and so rarely its token, depends on the slice."""
    B, V = logits.shape
    out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B:
        slice_len, block = tiles
        slices = triton.cdiv(V, slice_len)
        m = torch.empty(B, slices, dtype=torch.float32, device=logits.device)
        s = torch.empty_like(m)
        idx = torch.empty(B, slices, dtype=torch.int32, device=logits.device)
        on = pdl(logits.device)
        _slice_stats_kernel[(B, slices)](logits, logits.stride(0), temperature, m, s, idx, V, slices,
                                         SLICE=slice_len, BLOCK=block, PDL=on, num_warps=_WARPS, launch_pdl=on)
        _pick_token_kernel[(B,)](logits, logits.stride(0), temperature, key, m, s, idx, out, V, slices,
                                 SLICE=slice_len, BLOCK=block, SLICES_P=max(16, triton.next_power_of_2(slices)),
                                 PDL=on, num_warps=_WARPS, launch_pdl=on)
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


def uniform_reference(key: torch.Tensor) -> torch.Tensor:
    """float32 [B]: the u in (0, 1) that sample_rows draws for each row key."""
    return _uniform(_hash32_torch((key & _MASK) ^ _U_SALT))


def sample_rows_reference(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """sample_rows in torch: the same weights 2^(y - max y), y = logits * (log2(e) / T) in float32,
    summed in float64, so the kernel's choice differs only where u falls within float32 rounding of
    a boundary between two tokens' cumulative weights."""
    x = logits.float()
    t = temperature.float()
    c = torch.tensor(_LOG2E, dtype=torch.float32, device=x.device) / torch.where(t > 0, t, 1.0)
    y = x * c[:, None]
    w = torch.exp2(y - y.max(-1, keepdim=True).values).double()
    cum = w.cumsum(-1)
    target = uniform_reference(key).double() * cum[:, -1]
    last = torch.where(w > 0, torch.arange(x.shape[1], device=x.device), 0).max(-1).values
    drawn = torch.minimum((cum <= target[:, None]).sum(-1), last)
    drawn = torch.where(cum[:, -1] > 0, drawn, 0)
    return torch.where(t > 0, drawn, x.argmax(-1))


def row_keys(seeds, out_index):
    """int64 [B] keys in [0, 2**32) from a request's seed (any int64) and its output position.
    Works alike on torch tensors and numpy int64 arrays (the runner hashes on the host: a few
    vector ops there instead of ~35 tiny kernel launches per step)."""
    lo, hi = seeds & _MASK, (seeds >> 32) & _MASK
    return _hash32_torch(_hash32_torch(lo ^ _hash32_torch(hi)) ^ ((out_index * _GOLDEN) & _MASK))
