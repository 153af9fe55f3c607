"""Triton paged attention over a flattened variable-length batch (prefill chunks and decodes together).

Cache layout: k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; see reference.py
for the batch layout. The reference implementation there is this kernel's oracle.

Grid: (query tiles, 1, num_kv_heads). One program owns BLOCK_Q query tokens of one sequence (a
query tile) and *all* the query heads that share one KV head (GQA group), so each K/V tile is
loaded once for the whole group. Program p of axis 0 finds its tile from query_start_loc alone:
sequence i has cdiv(query_len_i, BLOCK_Q) tiles, numbered on after those of the sequences before
it (a cumulative sum over the batch, done by every program), so the grid need only be at least
the batch's tile count, cdiv(num_tokens, BLOCK_Q) + num_seqs: programs past the last tile exit.
The grid thus depends on no host-side value but the batch's shape, and a CUDA graph captured for
a padded token count serves any batch that fits (padding sequences have empty queries). Its tile
of BLOCK_M = BLOCK_Q * GROUP_P rows is

    row r  ->  query token  q_tile * BLOCK_Q + r // GROUP_P,   query head  kv_head * GROUP + r % GROUP_P

(GROUP_P is the group size rounded up to a power of two; padded rows and tokens past the
sequence's query length are masked). The program walks the sequence's keys BLOCK_N at a time,
gathering each key's row through the block table (so BLOCK_N is independent of block_size), and
keeps an online softmax in base 2 (running max m of the scores times scale * log2(e), running sum
l, float32 accumulator). It stops at the last key its last query may see: causal masking against
the already-cached context is just key_pos <= ctx_len + query_index. The key tiles that every row
of the tile sees in full (all but the last one or two of a prompt's query tile) run without any
mask: a score costs one fused multiply-add and one exp2 besides the two dots; only the tiles the
diagonal crosses compare positions. Programs whose tile lies past their sequence's queries exit at once.

FP8 cache: K and V tiles load as e4m3 (half the bytes) and convert exactly to DOT_TY: float16
for half-precision queries (one hardware conversion per pair of values; e4m3 fits fp16 exactly,
and fp16 probabilities keep more mantissa than bf16), float32 otherwise. The per-token scales are
applied to the [BLOCK_M, BLOCK_N] tiles, not to K and V: scores are multiplied by each key's
k_scale after the dot, and probabilities by each key's v_scale before it.

Split-KV (decode steps with too few sequences to fill the GPU): grid (num_seqs, NUM_SPLITS,
num_kv_heads). Program (seq, s, h) walks only the s-th of NUM_SPLITS equal, BLOCK_N-aligned slices
of the sequence's keys and writes its unnormalised accumulator with its running max m and sum l;
a second kernel, one program per (token, head), merges the slices with their log-sum-exp weights:

    M = max_s m_s,   out = sum_s exp2(m_s - M) * acc_s / sum_s exp2(m_s - M) * l_s

The number of splits depends only on the batch size, so a CUDA graph captures it.

Decode steps (every query length 1) keep a program per sequence: grid (num_seqs, NUM_SPLITS,
num_kv_heads), program (i, s, h) on sequence seq_order[i] when an order is given. Contexts differ
by up to 10x in a batch, so the GPU's block scheduler, which starts programs in index order, ends
the step on a few long sequences started last; longest first (the order the caller passes) keeps
the SMs busy to the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.hardware import pdl, pdl_start, sm_count


# Arguments that change with the batch are not specialized on (Triton would compile a variant
# each time their divisibility by 16 changes, possibly mid-run): the block table's width, ml_half,
# num_seqs. (SEQS_P, the batch's sequences rounded up to a power of two, is a variant per size
# class for eager steps; a graphed step always passes every sequence slot of its buffers.)
@triton.jit(do_not_specialize=["ml_half", "stride_bt", "num_seqs"])
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr,
    seq_order_ptr, k_scale_ptr, v_scale_ptr, part_ptr, ml_ptr, kv_start_ptr, levels_ptr, part_rows_ptr, scale,
    num_heads, num_seqs, ml_half,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch, stride_bt, stride_sb, stride_st,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    HEAD_D: tl.constexpr, HEAD_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, FP8: tl.constexpr, DOT_TY: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DECODE: tl.constexpr, ORDERED: tl.constexpr, SEQS_P: tl.constexpr, PDL: tl.constexpr,
    CASCADE: tl.constexpr, NUM_SLOTS: tl.constexpr, SLOT0: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
    COMPACT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pdl_start(PDL)
    if DECODE:  # a program per sequence; axis 1 numbers the key slices
        seq = tl.program_id(0)
        if ORDERED:
            seq = tl.load(seq_order_ptr + seq)
        split = tl.program_id(1)
        q_tile = 0
    else:
        seq, q_tile = _find_query_tile(query_start_loc_ptr, num_seqs, tl.program_id(0), BLOCK_Q, SEQS_P)
        if seq >= num_seqs:
            return
        split = 0
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    tok = q_tile * BLOCK_Q + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (tok < q_len) & (rows % GROUP_P < GROUP)
    d = tl.arange(0, HEAD_P)
    d_ok = d < HEAD_D
    q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx_len + tok
    if FP8:
        q = q.to(DOT_TY)

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_P], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # softmax in base 2: exp(x * scale) = exp2(x * qk_scale)
    if SOFTCAP > 0:  # scores SOFTCAP * tanh(x * scale / SOFTCAP): the query takes scale / SOFTCAP
        q = (q * (scale / SOFTCAP)).to(q.dtype)
        qk_scale = 1.4426950408889634
    kv_end = tl.minimum(seq_len, ctx_len + (q_tile + 1) * BLOCK_Q)
    kv = (k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_bt, k_scale_ptr, v_scale_ptr, kv_head,
          stride_cb, stride_ct, stride_ch, stride_sb, stride_st)
    kv_lo = 0
    if CASCADE:  # the keys before kv_start are a shared prefix, attended by the cascade kernel
        kv_lo = tl.load(kv_start_ptr + seq)
    if DECODE:  # one query: every key is visible to it, only the last tile needs a mask; a few
        # (BLOCK_Q > 1: a step checking drafts) see the keys up to their own
        if WINDOW > 0:  # (from the first query's window: for one query, all visible)
            kv_lo = tl.maximum(kv_lo, ctx_len - WINDOW + 1)
        if NUM_SPLITS > 1:
            chunk = tl.cdiv(tl.cdiv(kv_end - kv_lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
            kv_lo = kv_lo + split * chunk
            kv_end = tl.minimum(kv_lo + chunk, kv_end)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, kv_lo, kv_end, kv_end, qk_scale, d, d_ok, *kv,
                                BLOCK_SIZE, BLOCK_N, PRECISION, FP8, DOT_TY, MASKED=True, CAUSAL=BLOCK_Q > 1,
                                WINDOW=WINDOW if BLOCK_Q > 1 else 0, SOFTCAP=SOFTCAP)
    elif WINDOW > 0:  # from the first key the tile's first row sees, every tile masked both ways
        kv_lo = tl.maximum(kv_lo, ctx_len + q_tile * BLOCK_Q - WINDOW + 1)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, kv_lo, kv_end, kv_end, qk_scale, d, d_ok, *kv,
                                BLOCK_SIZE, BLOCK_N, PRECISION, FP8, DOT_TY, MASKED=True, CAUSAL=True, WINDOW=WINDOW,
                                SOFTCAP=SOFTCAP)
    else:  # whole tiles every query row sees in full, then the tiles the causal diagonal crosses
        full_end = kv_lo + tl.maximum(ctx_len + q_tile * BLOCK_Q + 1 - kv_lo, 0) // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, kv_lo, full_end, kv_end, qk_scale, d, d_ok, *kv,
                                BLOCK_SIZE, BLOCK_N, PRECISION, FP8, DOT_TY, MASKED=False, CAUSAL=False, WINDOW=0,
                                SOFTCAP=SOFTCAP)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, q_pos, full_end, kv_end, kv_end, qk_scale, d, d_ok, *kv,
                                BLOCK_SIZE, BLOCK_N, PRECISION, FP8, DOT_TY, MASKED=True, CAUSAL=True, WINDOW=0,
                                SOFTCAP=SOFTCAP)
    if CASCADE and NUM_SPLITS == 1:  # fold in the prefix partials the cascade kernel left in slots [0, SLOT0)
        covered = tl.load(levels_ptr + q_start + tok, mask=row_ok, other=0) * PREFIX_SPLITS
        if COMPACT:  # only covered rows have partials, at their own rows
            prow = tl.load(part_rows_ptr + q_start + tok, mask=row_ok & (covered > 0), other=0)
        else:
            prow = q_start + tok
        base = (prow * num_heads + head) * NUM_SLOTS
        for s in tl.static_range(SLOT0):
            ok = row_ok & (s < covered)
            m_s = tl.load(ml_ptr + base + s, mask=ok, other=float("-inf"))
            l_s = tl.load(ml_ptr + ml_half + base + s, mask=ok, other=0.0)
            a_s = tl.load(part_ptr + (base + s)[:, None] * HEAD_D + d[None, :], mask=ok[:, None] & d_ok[None, :],
                          other=0.0)
            m_new = tl.maximum(m_i, m_s)  # finite on stored rows: the suffix holds the row's own key
            alpha, beta = tl.math.exp2(m_i - m_new), tl.math.exp2(m_s - m_new)
            acc = acc * alpha[:, None] + a_s * beta[:, None]
            l_i = l_i * alpha + l_s * beta
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    elif NUM_SLOTS > 1:  # partials [T, Hq, NUM_SLOTS, D] and (m, l) [2, T, Hq, NUM_SLOTS], float32
        slot = ((q_start + tok) * num_heads + head) * NUM_SLOTS + SLOT0 + split
        tl.store(part_ptr + slot[:, None] * HEAD_D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(ml_ptr + slot, m_i, mask=row_ok)
        tl.store(ml_ptr + ml_half + slot, l_i, mask=row_ok)
    else:
        acc = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _attend(acc, m_i, l_i, q, q_pos, lo, hi, kv_end, qk_scale, d, d_ok,
            k_cache_ptr, v_cache_ptr, table_ptr, k_scale_ptr, v_scale_ptr, kv_head,
            stride_cb, stride_ct, stride_ch, stride_sb, stride_st,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, FP8: tl.constexpr,
            DOT_TY: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
            SOFTCAP: tl.constexpr):
    """The online softmax over keys [lo, hi), BLOCK_N at a time, each key's row gathered through the
    sequence's block table (table_ptr). Unmasked (MASKED false), every key of every tile must exist
    and be visible to every row: no compare or select per score. MASKED loads no key at or past
    kv_end and gives those keys no weight; CAUSAL weighs only keys at or before each row's position
    q_pos (a prompt's diagonal tiles: one or two, so a two-stage pipeline, which keeps the prefill
    kernel within the registers of three programs an SM; scripts/sass_stats.py). WINDOW > 0 (with
    CAUSAL): also only keys past q_pos - WINDOW (sliding-window attention); a row may then see no
    key of a whole tile, whose scores must not make its running maximum NaN. SOFTCAP > 0: scores
    (the query pre-scaled) pass through SOFTCAP * tanh before the masks (Gemma 2)."""
    for start in tl.range(lo, hi, BLOCK_N, num_stages=2 if CAUSAL else None):
        k_pos = start + tl.arange(0, BLOCK_N)
        if MASKED:
            k_ok = k_pos < kv_end
            blk = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            kv_mask = k_ok[:, None] & d_ok[None, :]
        else:
            k_ok = None
            blk = tl.load(table_ptr + k_pos // BLOCK_SIZE).to(tl.int64)
            kv_mask = d_ok[None, :]
        kv_off = blk[:, None] * stride_cb + (k_pos % BLOCK_SIZE)[:, None] * stride_ct + kv_head * stride_ch + d[None, :]
        k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        s_off = blk * stride_sb + (k_pos % BLOCK_SIZE) * stride_st + kv_head  # FP8 scales of these keys
        if FP8:
            k_sc = tl.load(k_scale_ptr + s_off, mask=k_ok, other=0.0 if MASKED else None)
            s = tl.dot(q, tl.trans(k.to(DOT_TY)), input_precision=PRECISION) * k_sc[None, :]
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if SOFTCAP > 0:  # tanh(x) = 1 - 2 / (exp(2x) + 1): exact at both ends (exp's overflow gives 1)
            s = SOFTCAP * (1.0 - 2.0 / (tl.exp(2.0 * s) + 1.0))
        if WINDOW > 0:
            seen = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(seen, s, float("-inf"))
        elif CAUSAL:  # keys past kv_end lie past every stored row's position too
            s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
        elif MASKED:
            s = tl.where(k_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        if WINDOW > 0 or CAUSAL:  # a row with no key seen yet: subtract 0, not -inf (its weights are all 0)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        p = tl.math.exp2(s * qk_scale - m_sub[:, None])  # one fused multiply-add a score
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
        if FP8:
            v_sc = tl.load(v_scale_ptr + s_off, mask=k_ok, other=0.0 if MASKED else None)
            acc = acc * alpha[:, None] + tl.dot((p * v_sc[None, :]).to(DOT_TY), v.to(DOT_TY), input_precision=PRECISION)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _find_query_tile(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr, SEQS_P: tl.constexpr):
    """(sequence, its query tile) of the batch's tile number `tile`; sequence num_seqs past the last."""
    s = tl.arange(0, SEQS_P)
    ok = s < num_seqs
    lo = tl.load(query_start_loc_ptr + s, mask=ok, other=0)
    hi = tl.load(query_start_loc_ptr + s + 1, mask=ok, other=0)
    tiles = (hi - lo + BLOCK_Q - 1) // BLOCK_Q
    ends = tl.cumsum(tiles, 0)
    seq = tl.sum((ends <= tile).to(tl.int32), 0)
    first = tl.sum(tl.where(s == seq, ends - tiles, 0), 0)
    return seq, tile - first


@triton.jit(do_not_specialize=["ml_half"])
def _merge_splits_kernel(out_ptr, part_ptr, ml_ptr, levels_ptr, num_heads, ml_half, stride_ot, stride_oh,
                         NUM_SLOTS: tl.constexpr, SLOTS_P: tl.constexpr, PREFIX_SLOTS: tl.constexpr,
                         PREFIX_SPLITS: tl.constexpr, HEAD_D: tl.constexpr, HEAD_P: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_start(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SLOTS_P)
    ok = s < NUM_SLOTS
    if PREFIX_SLOTS > 0:  # a row's prefix slots hold partials only for the cascade levels covering it
        ok = ok & ((s >= PREFIX_SLOTS) | (s < tl.load(levels_ptr + t) * PREFIX_SPLITS))
    slot = (t * num_heads + h) * NUM_SLOTS + s
    m = tl.load(ml_ptr + slot, mask=ok, other=float("-inf"))
    l = tl.load(ml_ptr + ml_half + slot, mask=ok, other=0.0)
    d = tl.arange(0, HEAD_P)
    acc = tl.load(part_ptr + slot[:, None] * HEAD_D + d[None, :], mask=ok[:, None] & (d[None, :] < HEAD_D), other=0.0)
    w = tl.math.exp2(m - tl.max(m, 0))  # base-2 maxima; slices without keys have m = -inf: weight 0
    out = tl.sum(w[:, None] * acc, 0) / tl.sum(w * l, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_D)


def merge_partials(out: torch.Tensor, part: torch.Tensor, ml: torch.Tensor, levels: torch.Tensor | None = None,
                   prefix_splits: int = 0, levels_count: int = 0) -> torch.Tensor:
    """out [T, Hq, D] = the log-sum-exp merge of each row's partial results part [T, Hq, S, D]
    with (m, l) ml [2, T, Hq, S]. With cascade levels: slots [0, levels_count * prefix_splits)
    are prefix partials, of which row t has levels[t] * prefix_splits."""
    num_tokens, num_heads, slots, head_dim = part.shape
    on = pdl(out.device)
    _merge_splits_kernel[(num_tokens, num_heads)](
        out, part, ml, levels if levels is not None else ml, num_heads, num_tokens * num_heads * slots,
        out.stride(0), out.stride(1), NUM_SLOTS=slots, SLOTS_P=triton.next_power_of_2(slots),
        PREFIX_SLOTS=levels_count * prefix_splits, PREFIX_SPLITS=prefix_splits, HEAD_D=head_dim,
        HEAD_P=max(triton.next_power_of_2(head_dim), 16), PDL=on, launch_pdl=on)
    return out


PREFILL_BLOCK_M, DECODE_BLOCK_M = 64, 16  # rows (query tokens x group heads) of a program
MAX_DECODE_QUERY = 16  # the longest queries a program per sequence takes (k + 1 for k drafts)


MAX_SPLITS = 16


def decode_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Key slices per sequence for a decode step. A batch of fewer than four waves of programs
    (one per SM at a time) ends on a partly idle GPU: split each sequence at least in two, and
    further until there are 1.5 programs per SM (chosen with `attention_bench.py --splits` on a
    small model's decode batches, graphed)."""
    sms, programs = sm_count(device), num_seqs * num_kv_heads  # one "SM" off the GPU: no split
    if programs >= 4 * sms or sms == 1:
        return 1
    split = 2
    while programs * split * 2 < 3 * sms and split < MAX_SPLITS:
        split *= 2
    return split


# (BLOCK_N, num_warps, num_stages) below: chosen with scripts/attention_bench.py (BENCHMARKS.md).
def prefill_tiles(fp32: bool) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of a step with prompts: 64-key tiles against 64-row query
    tiles, 2 programs an SM (`attention_bench.py --prefill`: faster than 32-key tiles for small and
    8B models' heads); float32 (tests) keeps 32 keys, 64 would spill."""
    return (32, 4, 3) if fp32 else (64, 4, 3)


def decode_tiles(fp8: bool) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) of a decode step, which streams the cache: wide key tiles
    keep more bytes in flight, most of all when few sequences leave SMs idle. 128 keys (with the
    slices above, the best of `attention_bench.py`'s sweep at every decode batch size)."""
    return (128, 4, 4) if fp8 else (128, 4, 3)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int,
                    out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, tiles: tuple[int, int, int] | None = None,
                    num_splits: int | None = None, block_m: int | None = None,
                    seq_order: torch.Tensor | None = None, kv_start: torch.Tensor | None = None,
                    partials: tuple[torch.Tensor, torch.Tensor, int] | None = None,
                    levels: tuple[torch.Tensor, int] | None = None, window: int | None = None,
                    softcap: float | None = None, part_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as reference.paged_attention_reference. `max_query_len` bounds every query's
    length: 1 is a decode step, a program per sequence; up to MAX_DECODE_QUERY (a step checking
    drafts; without cascade or a given `block_m`) the same, each program's rows a sequence's queries
    (while they fit 64 rows); above, prompt tiles (its exact value then does not matter).
    `tiles` overrides (BLOCK_N, num_warps, num_stages); `num_splits` the decode key slices (a power
    of two; decode steps only); `block_m` the rows
    (query tokens x group heads) of a program; `seq_order` int32 [num_seqs], a permutation: the
    order in which decode programs take the sequences. `window`: sliding-window attention, each
    query sees only its `window` latest keys (itself included). `softcap`: scores (scaled) become
    softcap * tanh(score / softcap) (Gemma 2's logit soft-capping).

    Cascade (kernels/cascade.py): `kv_start` int32 [num_seqs] leaves each sequence's keys before it
    out; `partials` (part [T, Hq, S, D], ml [2, T, Hq, S], first slot) holds the prefix partials in
    the slots before `first`, of which row t has levels[0][t] * levels[1] (`levels`). With one key
    slice a sequence, each program merges them into its result and writes `out`; with more, the
    unnormalised results go to slots first .. first + splits - 1 (the caller merges them all).
    `part_rows` int32 [T] (one key slice only): row t's partials are part's row part_rows[t], where
    part holds the covered rows' alone (attention.CascadeMetadata)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and query.stride(2) == 1
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    # A program per sequence (decode) while every query fits one tile of at most 64 rows: each then
    # reads its sequence's keys once, in key slices, rather than in prompt tiles nearly all masked.
    few = 1 < max_query_len <= MAX_DECODE_QUERY and kv_start is None and block_m is None
    decode = max_query_len == 1 or (few and triton.next_power_of_2(max_query_len) * group_p <= PREFILL_BLOCK_M)
    if block_m is None:
        block_m = triton.next_power_of_2(max_query_len) * group_p if decode else PREFILL_BLOCK_M
        block_m = max(block_m, DECODE_BLOCK_M if decode else 0)
    block_m = max(block_m, group_p)
    block_q = block_m // group_p
    if out is None:
        out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or num_tokens == 0:
        return out
    fp8 = k_scale is not None
    assert not fp8 or (k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1)
    scales = (k_scale, v_scale) if fp8 else (seq_lens, seq_lens)  # unused pointers without FP8
    fp32 = query.dtype == torch.float32
    block_n, warps, stages = tiles or (decode_tiles(fp8) if decode and block_m <= DECODE_BLOCK_M
                                       else prefill_tiles(fp32))
    splits = 1 if not decode else (num_splits or decode_splits(num_seqs, num_kv_heads, query.device))
    if partials is not None:
        part, ml, slot0 = partials
        assert slot0 + (splits if splits > 1 else 0) <= part.shape[2] and kv_start is not None and levels is not None
        assert part_rows is None or splits == 1
    elif splits > 1:
        part = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=query.device)
        ml = torch.empty(2, num_tokens, num_heads, splits, dtype=torch.float32, device=query.device)
        slot0 = 0
    else:
        part = ml = out  # unused
        slot0 = 0
    num_slots = part.shape[2] if part is not out else 1
    if decode:
        grid = (num_seqs, splits, num_kv_heads)
    else:  # an upper bound on the query tiles: each sequence's last tile may be partial
        grid = (triton.cdiv(num_tokens, block_q) + num_seqs, 1, num_kv_heads)
    ml_half = (part.shape[0] if part is not out else num_tokens) * num_heads * num_slots
    on = pdl(query.device)
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        seq_order if seq_order is not None else seq_lens, *scales, part, ml,
        kv_start if kv_start is not None else seq_lens, levels[0] if levels is not None else seq_lens,
        part_rows if part_rows is not None else seq_lens, scale, num_heads, num_seqs, ml_half,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        BLOCK_SIZE=block_size, GROUP=group, GROUP_P=group_p, HEAD_D=head_dim,
        HEAD_P=max(triton.next_power_of_2(head_dim), 16), BLOCK_Q=block_q, BLOCK_N=block_n,
        PRECISION="ieee" if fp32 else "tf32", FP8=fp8,
        DOT_TY=tl.float32 if fp32 else tl.float16, NUM_SPLITS=splits,
        DECODE=decode, ORDERED=seq_order is not None, SEQS_P=0 if decode else max(16, triton.next_power_of_2(num_seqs)),
        PDL=on, CASCADE=kv_start is not None, NUM_SLOTS=num_slots, SLOT0=slot0,
        PREFIX_SPLITS=levels[1] if levels is not None else 0, COMPACT=part_rows is not None, WINDOW=window or 0,
        SOFTCAP=float(softcap or 0.0),
        num_warps=warps, num_stages=stages, launch_pdl=on,
    )
    if splits > 1 and partials is None:
        merge_partials(out, part, ml)
    return out
