"""Fused sampling: short kernels over a batch of logits rows, no [B, V] temporaries.

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

Two passes at the speed of reading the logits beat one pass bound by arithmetic (a Gumbel-max
draw: argmax of y + Gumbel noise, a hash and two logarithms a logit; `scripts/sampler_bench.py`).
Logits may be in the model's dtype: they are upcast to float32 as they are read, so the draw is
the same.

Rows with min_p, top_k or top_p (`sample_filtered_rows`) are drawn by rejection, with no sort.
What the filters keep is the tokens of weight w >= min_p * max w that have fewer than top_k tokens
and less than top_p of the kept weight strictly above them (ties at the threshold all kept; torch's
sort would keep some of them). Round r draws a candidate by inverse transform at
u_r = hash(key + r * golden) from the tokens still in play (key >= lo, where tokens are ordered by
int32 keys of their float32 logits), then counts the tokens and weight above it and above PIVOTS - 1
keys spread from it to hi (the lowest key known to keep everything above it). If the candidate
passes it is the draw: conditioned on landing among the kept tokens, a draw from a superset of
them is a draw from them, so the rounds change no probability. Otherwise every token below the
highest failing pivot fails too: lo rises to it, hi falls to the lowest passing one, and the next
round draws above lo. Each failure shrinks [lo, hi) to a PIVOTS-th or less, so a row needs at most
~17 rounds of int32 keys (MAX_ROUNDS = 64 is never reached) and usually one to four: a real
model's mass sits in its top tokens (random weights' flat rows take ~3.4 at top_k 20).

The rows are cut into slices of SLICE entries, a program a slice: one pass finds each slice's top
logit and key, then each of the first SPLIT_ROUNDS rounds is four launches: the candidates'
weight a slice; a program a row picks the slice where u * total falls and walks it to the
candidate; the pivots' counts and weights a slice; a program a row sums them and judges. A row
done skips the later launches at once; a row that needs more rounds finishes them in a program of
its own (the same rounds, over the whole row). A program a row for every round keeps too few
bytes in flight to read a large vocabulary at memory speed, hence the slices (`sampler_bench.py
--filtered`); all of it is far cheaper than sorting the rows. A round whose rows are all done still
costs its four launches.

kernels/sampling_reference.py computes the same functions in torch (int64 arithmetic masked to 32
bits, sums in float64), for the CPU backend and as the kernels' test oracles; its constants (the
hash's, the salts, PIVOTS, MAX_ROUNDS) are the ones written into these kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.hardware import pdl, pdl_start
from llmserve.kernels.sampling_reference import MAX_ROUNDS, PIVOTS



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
        rest = tl.maximum(target - tl.sum(tl.where(j < hit, w, 0.0), 0), 0.0)
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
            run = tl.cumsum(p, 0)
            # the first token of nonzero weight whose running sum passes rest: a remainder that
            # rounding left at or below zero must not land on a token of zero weight (masked)
            first = tl.min(tl.where((run > rest) & (p > 0), tl.arange(0, BLOCK), BLOCK), 0)
            if first < BLOCK:
                token = start + first
            else:
                rest -= tl.max(run, 0)  # the running sum, not a sum rounded otherwise: rest stays >= 0
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


@triton.jit
def _order_key(x):
    """int32 keys ordered as the float32 values x are (a sign-magnitude float's bits, the negative
    ones' magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _above(base, lo_idx, hi_idx, V, c, top, ythr, q, BLOCK: tl.constexpr, PIVOTS: tl.constexpr):
    """For each pivot key q[i]: how many tokens of index in [lo_idx, hi_idx) of weight kept by min_p
    have a key >= q[i], and their weight, sum 2^(y - top). Per-lane sums, reduced once at the end;
    the pivots the major axis, so that each token is loaded and weighed by one thread (with them
    minor, the layout spread a token's pivots over threads that each loaded and weighed it)."""
    count = tl.zeros([PIVOTS, BLOCK], tl.int32)
    mass = tl.zeros([PIVOTS, BLOCK], tl.float32)
    for start in range(lo_idx, hi_idx, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        y = x * c
        w = tl.where(y >= ythr, tl.math.exp2(y - top), 0.0)
        ge = (_order_key(x)[None, :] >= q[:, None]) & (w[None, :] > 0)
        count += ge.to(tl.int32)
        mass += tl.where(ge, w[None, :], 0.0)
    return tl.sum(count, 1), tl.sum(mass, 1)


@triton.jit
def _pick(base, start, end, c, top, ythr, lo, target, BLOCK: tl.constexpr):
    """The first token of index in [start, end) where the cumulative weight of the candidates
    (keys >= lo, kept by min_p) exceeds target, and its key; rounding short of it: the last one."""
    acc = tl.full([], 0.0, tl.float32)
    pick = tl.full([], -1, tl.int32)
    last = tl.full([], 0, tl.int32)
    pick_key = tl.full([], 0, tl.int32)
    start += tl.zeros([], tl.int32)  # a loop-carried tensor even when called with a literal
    while (pick < 0) & (start < end):
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < end, other=float("-inf")).to(tl.float32)
        y = x * c
        key = _order_key(x)
        w = tl.where((y >= ythr) & (key >= lo), tl.math.exp2(y - top), 0.0)  # 0 past the end: y = -inf
        block_sum = tl.sum(w, 0)
        last = tl.max(tl.where(w > 0, idx, last), 0)
        if acc + block_sum > target:
            below = tl.sum((acc + tl.cumsum(w, 0) <= target).to(tl.int32), 0)
            pick = tl.where(below < BLOCK, start + below, last)
            pick_key = tl.max(tl.where(idx == pick, key, -2147483647 - 1), 0)
        acc += block_sum
        start += BLOCK
    if pick < 0:
        pick = last
        pick_key = _order_key(tl.load(base + pick).to(tl.float32))
    return pick, pick_key


@triton.jit
def _round_u(stream):
    """A filtered round's u in (0, 1) from its uint32 stream (uniform_reference with _FILTER_SALT)."""
    return ((_hash32(stream ^ 0x2545F491) >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def _pivots(pick_key, hi, PIVOTS: tl.constexpr):
    """PIVOTS keys from just above the candidate's up to hi, evenly spread."""
    q0 = pick_key.to(tl.int64) + 1
    span = tl.maximum(hi.to(tl.int64) - q0, 0)
    return (q0 + span * tl.arange(0, PIVOTS) // PIVOTS).to(tl.int32)


@triton.jit
def _row(rows_ptr, temp_ptr, logits_ptr, stride, i):
    """Filtered row i: its row index, temperature, log2(e) / T and the start of its logits."""
    row = tl.load(rows_ptr + i)
    t = tl.load(temp_ptr + row)
    return row, t, 1.4426950408889634 / tl.where(t > 0, t, 1.0), logits_ptr + row.to(tl.int64) * stride


@triton.jit
def _filter_top_kernel(logits_ptr, stride, rows_ptr, temp_ptr, m_ptr, kmax_ptr, V, NUM_SLICES,
                       SLICE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): over slice j of filtered row i, the top y and the top key."""
    pdl_start(PDL)
    i, part = tl.program_id(0), tl.program_id(1)
    _, _, c, base = _row(rows_ptr, temp_ptr, logits_ptr, stride, i)
    m_lane = tl.full([BLOCK], -3.0e38, tl.float32)
    key_lane = tl.full([BLOCK], -2147483647, tl.int32)
    for start in range(part * SLICE, (part + 1) * SLICE, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
        m_lane = tl.maximum(m_lane, x * c)
        key_lane = tl.maximum(key_lane, _order_key(x))  # past V: -inf, the lowest key
    tl.store(m_ptr + i * NUM_SLICES + part, tl.max(m_lane, 0))
    tl.store(kmax_ptr + i * NUM_SLICES + part, tl.max(key_lane, 0))


@triton.jit(do_not_specialize=["NUM_SLICES"])
def _filter_setup_kernel(rows_ptr, temp_ptr, minp_ptr, key_ptr, m_ptr, kmax_ptr, fstate_ptr, istate_ptr, NUM_SLICES,
                         SLICES_P: tl.constexpr, PDL: tl.constexpr):
    """Program i: row i's state before its first round: top y, min_p's threshold, lo, hi, stream;
    status -1 (to draw) or -2 (a greedy row: the caller's argmax stays)."""
    pdl_start(PDL)
    i = tl.program_id(0)
    row = tl.load(rows_ptr + i)
    j = tl.arange(0, SLICES_P)
    ok = j < NUM_SLICES
    top = tl.max(tl.load(m_ptr + i * NUM_SLICES + j, mask=ok, other=-3.0e38), 0)
    hi = tl.max(tl.load(kmax_ptr + i * NUM_SLICES + j, mask=ok, other=-2147483647), 0) + 1
    min_p = tl.load(minp_ptr + row)
    ythr = tl.where(min_p > 0, top + tl.math.log2(tl.where(min_p > 0, min_p, 1.0)), -3.0e38)
    f, n = fstate_ptr + i * 4, istate_ptr + i * 6
    tl.store(f + 0, top)
    tl.store(f + 1, ythr)
    tl.store(n + 0, -2147483647 - 1)  # lo: every key
    tl.store(n + 1, hi)
    tl.store(n + 2, tl.load(key_ptr + row).to(tl.uint32).to(tl.int32, bitcast=True))  # the round's stream
    tl.store(n + 3, 0)  # rounds drawn
    tl.store(n + 4, tl.where(tl.load(temp_ptr + row) > 0, -1, -2))


@triton.jit
def _in_play_kernel(logits_ptr, stride, rows_ptr, temp_ptr, fstate_ptr, istate_ptr, w_ptr, V, NUM_SLICES,
                    SLICE: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (i, j): the weight in slice j of row i's candidates (keys >= lo, kept by min_p)."""
    pdl_start(PDL)
    i, part = tl.program_id(0), tl.program_id(1)
    if tl.load(istate_ptr + i * 6 + 4) == -1:
        _, _, c, base = _row(rows_ptr, temp_ptr, logits_ptr, stride, i)
        top, ythr = tl.load(fstate_ptr + i * 4), tl.load(fstate_ptr + i * 4 + 1)
        lo = tl.load(istate_ptr + i * 6)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(part * SLICE, (part + 1) * SLICE, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            y = x * c
            acc += tl.where((y >= ythr) & (_order_key(x) >= lo), tl.math.exp2(y - top), 0.0)
        tl.store(w_ptr + i * NUM_SLICES + part, tl.sum(acc, 0))


@triton.jit(do_not_specialize=["V", "NUM_SLICES"])
def _candidate_kernel(logits_ptr, stride, rows_ptr, temp_ptr, fstate_ptr, istate_ptr, w_ptr, q_ptr, out_ptr,
                      V, NUM_SLICES, FIRST: tl.constexpr, SLICE: tl.constexpr, BLOCK: tl.constexpr,
                      SLICES_P: tl.constexpr, PIVOTS: tl.constexpr, PDL: tl.constexpr):
    """Program i: this round's candidate of row i, drawn at the round's u from the candidates'
    weight (the slice where u * total falls, then the token inside it), and the pivots to test it
    with. The first round's total is the kept weight (top_p's 100%); none at all: token 0."""
    pdl_start(PDL)
    i = tl.program_id(0)
    f, n = fstate_ptr + i * 4, istate_ptr + i * 6
    if tl.load(n + 4) == -1:
        row, _, c, base = _row(rows_ptr, temp_ptr, logits_ptr, stride, i)
        j = tl.arange(0, SLICES_P)
        w = tl.load(w_ptr + i * NUM_SLICES + j, mask=j < NUM_SLICES, other=0.0)
        total = tl.sum(w, 0)
        if FIRST:
            tl.store(f + 2, total)
        if total == 0:  # every logit -inf (only in the first round: a later one always keeps its candidate)
            tl.store(n + 4, 0)
            tl.store(out_ptr + row, tl.zeros([], tl.int64))
        else:
            stream = tl.load(n + 2).to(tl.uint32, bitcast=True)
            u = _round_u(stream)
            target = u * total
            last = tl.max(tl.where(w > 0, j, 0), 0)  # rounding may leave target at or past the last sum
            hit = tl.minimum(tl.sum((tl.cumsum(w, 0) <= target).to(tl.int32), 0), last)
            rest = target - tl.sum(tl.where(j < hit, w, 0.0), 0)
            top, ythr = tl.load(f), tl.load(f + 1)
            lo, hi = tl.load(n), tl.load(n + 1)
            pick, pick_key = _pick(base, hit * SLICE, tl.minimum(hit * SLICE + SLICE, V), c, top, ythr, lo, rest, BLOCK)
            tl.store(n + 5, pick)
            tl.store(q_ptr + i * PIVOTS + tl.arange(0, PIVOTS), _pivots(pick_key, hi, PIVOTS))


@triton.jit
def _pivot_count_kernel(logits_ptr, stride, rows_ptr, temp_ptr, fstate_ptr, istate_ptr, q_ptr, count_ptr, mass_ptr,
                        V, NUM_SLICES, SLICE: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
                        PDL: tl.constexpr):
    """Program (i, j): in slice j of row i, the tokens at or above each pivot and their weight."""
    pdl_start(PDL)
    i, part = tl.program_id(0), tl.program_id(1)
    if tl.load(istate_ptr + i * 6 + 4) == -1:
        _, _, c, base = _row(rows_ptr, temp_ptr, logits_ptr, stride, i)
        top, ythr = tl.load(fstate_ptr + i * 4), tl.load(fstate_ptr + i * 4 + 1)
        p = tl.arange(0, PIVOTS)
        count, mass = _above(base, part * SLICE, (part + 1) * SLICE, V, c, top, ythr,
                             tl.load(q_ptr + i * PIVOTS + p), BLOCK, PIVOTS)
        out = (i * NUM_SLICES + part) * PIVOTS + p
        tl.store(count_ptr + out, count)
        tl.store(mass_ptr + out, mass)


@triton.jit
def _judge(pick, count, mass, q, k, p, kept_mass, lo, hi):
    """Is the candidate kept (fewer than k tokens and less than p of the kept weight above it)? If
    not, the candidates for the next round: keys >= the highest failing pivot (lo), below the
    lowest passing one (hi), and their weight. Returns (token or -1, lo, hi, total)."""
    out = (count >= k) | (mass >= p * kept_mass)  # the tokens below each pivot are all cut
    token = tl.where(tl.sum(out.to(tl.int32), 0) == 0, pick, -1)
    new_lo = tl.max(tl.where(out, q, -2147483647 - 1), 0)
    total = tl.min(tl.where(out, mass, 3.0e38), 0)
    new_hi = tl.min(tl.where(out, hi, q), 0)
    return token, tl.where(token < 0, new_lo, lo), tl.where(token < 0, new_hi, hi), total


@triton.jit(do_not_specialize=["NUM_SLICES"])
def _decide_kernel(rows_ptr, topk_ptr, topp_ptr, fstate_ptr, istate_ptr, q_ptr, count_ptr, mass_ptr, out_ptr,
                   NUM_SLICES, SLICES_P: tl.constexpr, PIVOTS: tl.constexpr, PDL: tl.constexpr):
    """Program i: row i's candidate judged on the pivots' counts summed over the slices."""
    pdl_start(PDL)
    i = tl.program_id(0)
    f, n = fstate_ptr + i * 4, istate_ptr + i * 6
    if tl.load(n + 4) == -1:
        row = tl.load(rows_ptr + i)
        j = tl.arange(0, SLICES_P)[:, None]
        p = tl.arange(0, PIVOTS)[None, :]
        at = (i * NUM_SLICES + j) * PIVOTS + p
        ok = j < NUM_SLICES
        count = tl.sum(tl.load(count_ptr + at, mask=ok, other=0), 0)
        mass = tl.sum(tl.load(mass_ptr + at, mask=ok, other=0.0), 0)
        q = tl.load(q_ptr + i * PIVOTS + tl.arange(0, PIVOTS))
        token, lo, hi, total = _judge(tl.load(n + 5), count, mass, q, tl.load(topk_ptr + row).to(tl.int32),
                                      tl.load(topp_ptr + row), tl.load(f + 2), tl.load(n), tl.load(n + 1))
        stream = tl.load(n + 2).to(tl.uint32, bitcast=True) + tl.full([], 0x9E3779B9, tl.uint32)
        tl.store(n, lo)
        tl.store(n + 1, hi)
        tl.store(n + 2, stream.to(tl.int32, bitcast=True))
        tl.store(n + 3, tl.load(n + 3) + 1)
        tl.store(n + 4, token)
        tl.store(f + 3, total)
        if token >= 0:
            tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit(do_not_specialize=["V"])
def _finish_kernel(logits_ptr, stride, rows_ptr, temp_ptr, topk_ptr, topp_ptr, fstate_ptr, istate_ptr, out_ptr, V,
                   BLOCK: tl.constexpr, PIVOTS: tl.constexpr, MAX_ROUNDS: tl.constexpr, PDL: tl.constexpr):
    """Program i: the rounds row i still needs after the split ones, a program for the whole row
    (rare: most rows end in the first round or two)."""
    pdl_start(PDL)
    i = tl.program_id(0)
    f, n = fstate_ptr + i * 4, istate_ptr + i * 6
    token = tl.load(n + 4)
    if token == -1:
        row, _, c, base = _row(rows_ptr, temp_ptr, logits_ptr, stride, i)
        k, p = tl.load(topk_ptr + row).to(tl.int32), tl.load(topp_ptr + row)
        top, ythr, kept_mass, total = tl.load(f), tl.load(f + 1), tl.load(f + 2), tl.load(f + 3)
        lo, hi = tl.load(n), tl.load(n + 1)
        stream = tl.load(n + 2).to(tl.uint32, bitcast=True)
        golden = tl.full([], 0x9E3779B9, tl.uint32)
        r = tl.load(n + 3)
        pick = tl.load(n + 5)
        while (token < 0) & (r < MAX_ROUNDS):
            u = _round_u(stream)
            pick, pick_key = _pick(base, 0, V, c, top, ythr, lo, u * total, BLOCK)
            q = _pivots(pick_key, hi, PIVOTS)
            count, mass = _above(base, 0, V, V, c, top, ythr, q, BLOCK, PIVOTS)
            token, lo, hi, total = _judge(pick, count, mass, q, k, p, kept_mass, lo, hi)
            stream += golden
            r += 1
        if token < 0:  # MAX_ROUNDS spent (the bound in the docstring says never): the last candidate
            token = pick
        tl.store(out_ptr + row, token.to(tl.int64))


_SPLIT_ROUNDS = 4
FILTER_TILES = (8192, 1024, 4)  # (slice, block, warps): sampler_bench.py --filtered --sweep (H100), with 4 split rounds


def sample_filtered_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                         min_p: torch.Tensor, key: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
                         tiles: tuple[int, int, int] | None = None, pivots: int = PIVOTS,
                         split_rounds: int = _SPLIT_ROUNDS) -> torch.Tensor:
    """For each row index in `rows` (int64 [R]) with T > 0: a draw from softmax(logits / T) over
    the tokens that min_p, top_k (int64) and top_p keep, written to out[row] (int64 [B]); other
    rows of `out` untouched. Same per-row parameters as sample_rows, plus the filters. The first
    `split_rounds` rounds (>= 1) run with each row cut into slices, a program a slice; a row that
    needs more finishes in a program of its own. `tiles` (slice, block, warps: powers of two,
    block <= slice), `pivots` and `split_rounds` for tests and benchmarks: the pivots change the
    rounds, so the draw; the others only the rounding."""
    n = rows.numel()
    if n:
        slice_len, block, warps = tiles or FILTER_TILES
        V, dev = logits.shape[1], logits.device
        slices = triton.cdiv(V, slice_len)
        slices_p = max(16, triton.next_power_of_2(slices))
        m = torch.empty(n, slices, dtype=torch.float32, device=dev)
        kmax = torch.empty(n, slices, dtype=torch.int32, device=dev)
        fstate = torch.empty(n, 4, dtype=torch.float32, device=dev)  # top, ythr, kept weight, candidates' weight
        istate = torch.empty(n, 6, dtype=torch.int32, device=dev)  # lo, hi, stream, rounds, status/token, candidate
        q = torch.empty(n, pivots, dtype=torch.int32, device=dev)
        count = torch.empty(n, slices, pivots, dtype=torch.int32, device=dev)
        mass = torch.empty(n, slices, pivots, dtype=torch.float32, device=dev)
        on = pdl(dev)
        common = {"PDL": on, "num_warps": warps, "launch_pdl": on}
        row_args = (logits, logits.stride(0), rows, temperature)
        _filter_top_kernel[(n, slices)](*row_args, m, kmax, V, slices, SLICE=slice_len, BLOCK=block, **common)
        _filter_setup_kernel[(n,)](rows, temperature, min_p, key, m, kmax, fstate, istate, slices, SLICES_P=slices_p,
                                   **common)
        for r in range(max(split_rounds, 1)):
            _in_play_kernel[(n, slices)](*row_args, fstate, istate, m, V, slices, SLICE=slice_len, BLOCK=block,
                                         **common)  # m: now each slice's candidates' weight
            _candidate_kernel[(n,)](*row_args, fstate, istate, m, q, out, V, slices, FIRST=r == 0, SLICE=slice_len,
                                    BLOCK=block, SLICES_P=slices_p, PIVOTS=pivots, **common)
            _pivot_count_kernel[(n, slices)](*row_args, fstate, istate, q, count, mass, V, slices, SLICE=slice_len,
                                             BLOCK=block, PIVOTS=pivots, **common)
            _decide_kernel[(n,)](rows, top_k, top_p, fstate, istate, q, count, mass, out, slices,
                                 SLICES_P=slices_p, PIVOTS=pivots, **common)
        _finish_kernel[(n,)](*row_args, top_k, top_p, fstate, istate, out, V, BLOCK=block, PIVOTS=pivots,
                             MAX_ROUNDS=MAX_ROUNDS, **common)
    return out
