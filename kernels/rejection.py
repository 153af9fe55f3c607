"""Speculative decoding's rejection sampler on the device: R rows, each checking one draft d drawn
from a distribution q (kernels/sampling_reference.py check_drafts_reference is the function, and
these kernels' oracle).

p is weighed as sample_rows weighs a row: y = logits * log2(e) / T, p = 2^(y - M) / S, with M and
S combined from per-slice maxima and sums (kernels/sampling.py's slices of SLICE entries), so no
[R, V] softmax is ever materialised. Launches, in order:

1. sampling's slice-stats kernel, grid (R, slices): each slice's maximum m_j of y and
   s_j = sum 2^(y - m_j).
2. the residual kernel, grid (R, slices): M = max m_j, S = sum s_j 2^(m_j - M); the slice's
   log max(p - q, 0) into a scratch row (-inf where p <= q) and its sum; a row's first program
   also writes the redraw's key, hash32(key ^ RESIDUAL_SALT).
3. sample_rows on the scratch at temperature 1 (two launches): the redraw, from the residual.
4. the settle kernel, grid (R,): p(d) from the stats; the row keeps d where u * q(d) < p(d)
   (u from the key salted with ACCEPT_SALT) or its residual sums to zero, else takes the redraw.

Six launches (with the caller's gathers and copies, about a dozen) where the same function in
torch takes some fifty: the host's time per verify step is what a sampled batch of one waits on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.sampling import _BLOCK, _WARPS, SLICE, _hash32, _slice_stats_kernel, sample_rows


@triton.jit
def _row_scale(m_ptr, s_ptr, row, NUM_SLICES, SLICES_P: tl.constexpr):
    """(M, S) of a row from its slices' maxima and sums: p = 2^(y - M) / S."""
    j = tl.arange(0, SLICES_P)
    ok = j < NUM_SLICES
    m = tl.load(m_ptr + row * NUM_SLICES + j, mask=ok, other=-3.0e38)
    top = tl.max(m, 0)
    s = tl.load(s_ptr + row * NUM_SLICES + j, mask=ok, other=0.0)
    return top, tl.sum(s * tl.math.exp2(m - top), 0)


@triton.jit
def _residual_kernel(logits_ptr, stride, q_ptr, q_stride, temp_ptr, key_ptr, m_ptr, s_ptr, res_ptr, rsum_ptr,
                     rkey_ptr, V, NUM_SLICES, SLICE: tl.constexpr, BLOCK: tl.constexpr, SLICES_P: tl.constexpr):
    """Program (r, j): slice j of row r's log max(p - q, 0), and its sum."""
    row, part = tl.program_id(0), tl.program_id(1)
    top, total = _row_scale(m_ptr, s_ptr, row, NUM_SLICES, SLICES_P)
    c = 1.4426950408889634 / tl.load(temp_ptr + row)
    base = logits_ptr + row.to(tl.int64) * stride
    q_base = q_ptr + row.to(tl.int64) * q_stride
    out = res_ptr + row.to(tl.int64) * V
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(part * SLICE, (part + 1) * SLICE, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        ok = idx < V
        y = tl.load(base + idx, mask=ok, other=float("-inf")).to(tl.float32) * c
        r = tl.maximum(tl.math.exp2(y - top) / total - tl.load(q_base + idx, mask=ok, other=0.0), 0.0)
        acc += r
        tl.store(out + idx, tl.log(r), mask=ok)
    tl.store(rsum_ptr + row * NUM_SLICES + part, tl.sum(acc, 0))
    if part == 0:
        key = tl.load(key_ptr + row).to(tl.uint32)
        tl.store(rkey_ptr + row, _hash32(key ^ 0x165667B1).to(tl.int64))  # RESIDUAL_SALT


@triton.jit
def _settle_kernel(logits_ptr, stride, q_ptr, q_stride, temp_ptr, key_ptr, draft_ptr, m_ptr, s_ptr, rsum_ptr,
                   redrawn_ptr, out_ptr, NUM_SLICES, SLICES_P: tl.constexpr):
    """Program r: row r's draft if kept, else its redraw."""
    row = tl.program_id(0)
    top, total = _row_scale(m_ptr, s_ptr, row, NUM_SLICES, SLICES_P)
    j = tl.arange(0, SLICES_P)
    rest = tl.sum(tl.load(rsum_ptr + row * NUM_SLICES + j, mask=j < NUM_SLICES, other=0.0), 0)
    d = tl.load(draft_ptr + row)
    c = 1.4426950408889634 / tl.load(temp_ptr + row)
    p = tl.math.exp2(tl.load(logits_ptr + row.to(tl.int64) * stride + d).to(tl.float32) * c - top) / total
    q = tl.load(q_ptr + row.to(tl.int64) * q_stride + d)
    key = tl.load(key_ptr + row).to(tl.uint32)
    u = ((_hash32(key ^ 0x27D4EB2F) >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # ACCEPT_SALT
    keep = (u * q < p) | (rest == 0)
    tl.store(out_ptr + row, tl.where(keep, d, tl.load(redrawn_ptr + row)))


def check_drafts(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, drafts: torch.Tensor,
                 q: torch.Tensor, tiles: tuple[int, int] = (SLICE, _BLOCK)) -> torch.Tensor:
    """check_drafts_reference on the device: logits [R, V] (any float dtype), temperature float32
    [R] (all > 0), keys int64 [R], drafts int64 [R], q [R, V] (float32 with unit column stride, as
    a proposer's rows are; else copied so) -> int64 [R]. `tiles` (slice, block) only for tests, as
    in sample_rows."""
    R, V = logits.shape
    if q.shape != logits.shape:
        raise ValueError(f"check_drafts: q {tuple(q.shape)} for logits {tuple(logits.shape)}")
    q = q.float()  # (a proposer's q in another layout: copied once, not misread)
    q, logits = (t if t.stride(1) == 1 else t.contiguous() for t in (q, logits))
    out = torch.empty(R, dtype=torch.int64, device=logits.device)
    if not R:
        return out
    slice_len, block = tiles
    slices = triton.cdiv(V, slice_len)
    slices_p = max(16, triton.next_power_of_2(slices))
    stats = torch.empty(3, R, slices, dtype=torch.float32, device=logits.device)  # m, s, the residual's sums
    m, s, rsum = stats.unbind(0)
    idx = torch.empty(R, slices, dtype=torch.int32, device=logits.device)  # (greedy rows' indices: unused)
    residual = torch.empty(R, V, dtype=torch.float32, device=logits.device)
    rkey = torch.empty(R, dtype=torch.int64, device=logits.device)
    _slice_stats_kernel[(R, slices)](logits, logits.stride(0), temperature, m, s, idx, V, slices,
                                     SLICE=slice_len, BLOCK=block, PDL=False, num_warps=_WARPS)
    _residual_kernel[(R, slices)](logits, logits.stride(0), q, q.stride(0), temperature, keys, m, s, residual, rsum,
                                  rkey, V, slices, SLICE=slice_len, BLOCK=block, SLICES_P=slices_p,
                                  num_warps=_WARPS)
    redrawn = sample_rows(residual, torch.ones_like(temperature), rkey, tiles)
    _settle_kernel[(R,)](logits, logits.stride(0), q, q.stride(0), temperature, keys, drafts, m, s, rsum, redrawn,
                         out, slices, SLICES_P=slices_p, num_warps=1)
    return out
