"""Cascade attention: a prefix shared by a group of sequences is read once for the whole group.

Prefix caching stores a shared prefix once, but plain paged attention still reads it once per
sequence. Here each group's query rows (the decode tokens of all its sequences, and prefill
chunks that lie past the prefix) attend the prefix's keys together, then each sequence's own keys
(its suffix) separately, and the two are merged exactly by their log-sum-exp:

    sequence a:  | shared prefix [lo, hi)  | a's own keys |        rows of a and b: one pass over
    sequence b:  | (same blocks in tables) | b's own keys  |       the prefix (this kernel), one
                                                                    pass each over their suffixes

Groups come from the KV manager (llmserve/messages.py PrefixGroups), nested to two levels: a
level-0 group shares keys [0, hi0); a level-1 group, a subset of a level-0 group, shares keys
[hi0, hi1) as well. A row's partial results sit in slots of one buffer, merged at the end:

    slots  [0, S)      level-0 prefix, S key slices     (valid for rows with levels >= 1)
           [S, 2S)     level-1 prefix                   (valid for rows with levels == 2)
           [2S, 2S+X)  the row's suffix, X decode splits (always)

In a decode step every row has such a row of slots; in a step with prompt rows (no suffix
splits) only the covered rows do, at their part_rows (attention.CascadeMetadata), so that a
step of thousands of prompt tokens with a few hundred decode rows in groups takes partials for
those alone.

Prefix kernel grid: (query tiles of all groups, S, num_kv_heads). Like the paged kernel, program p
finds its (group, tile) from the groups' row offsets alone (a cumulative sum), so the grid depends
only on capacities and a CUDA graph serves any groups that fit. A tile is BLOCK_Q query rows x
the GQA group's heads, gathered through the group's row list (rows of different sequences); it
walks slice s of the prefix's keys through the group's representative block table (the blocks
are the same in every member's table), with no causal mask: every row lies past the prefix.

The prefix is read once per (group, tile, KV head), so a group of n decode rows reads it
ceil(n / BLOCK_Q) times instead of n, and its dots run on tensor-core tiles of BLOCK_Q rows.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from llmserve.attention import CascadeMetadata
from llmserve.kernels.hardware import pdl, pdl_start
from llmserve.kernels.paged_attention import _attend, _find_query_tile, decode_splits, merge_partials, paged_attention

LEVELS = 2
"""Prefix levels a row can be covered by (a group and one nested group)."""
PREFIX_SPLITS = 4
"""Key slices of each group's prefix (programs for long prefixes; few groups would leave SMs idle)."""


@triton.jit(do_not_specialize=["num_groups", "ml_half", "stride_bt"])
def _cascade_prefix_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, k_scale_ptr, v_scale_ptr, part_ptr, ml_ptr,
    row_start_ptr, rows_ptr, seq_ptr, lo_ptr, hi_ptr, level_ptr, part_rows_ptr,
    scale, num_heads, num_groups, ml_half, stride_qt, stride_qh,
    stride_cb, stride_ct, stride_ch, stride_bt, stride_sb, stride_st,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_D: tl.constexpr,
    HEAD_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    FP8: tl.constexpr, DOT_TY: tl.constexpr, SPLITS: tl.constexpr, NUM_SLOTS: tl.constexpr,
    GROUPS_P: tl.constexpr, COMPACT: tl.constexpr, PDL: tl.constexpr,
):
    pdl_start(PDL)
    g, q_tile = _find_query_tile(row_start_ptr, num_groups, tl.program_id(0), BLOCK_Q, GROUPS_P)
    if g >= num_groups:
        return
    r0 = tl.load(row_start_ptr + g)
    n = tl.load(row_start_ptr + g + 1) - r0
    if q_tile * BLOCK_Q >= n:
        return
    split = tl.program_id(1)
    kv_head = tl.program_id(2)
    rows = tl.arange(0, BLOCK_Q * GROUP_P)
    idx = q_tile * BLOCK_Q + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (idx < n) & (rows % GROUP_P < GROUP)
    tok = tl.load(rows_ptr + r0 + idx, mask=row_ok, other=0)
    d = tl.arange(0, HEAD_P)
    d_ok = d < HEAD_D
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8:
        q = q.to(DOT_TY)
    seq = tl.load(seq_ptr + g)
    lo = tl.load(lo_ptr + g)
    hi = tl.load(hi_ptr + g)
    chunk = tl.cdiv(tl.cdiv(hi - lo, SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, hi)
    full = s_lo + tl.maximum(s_hi - s_lo, 0) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_Q * GROUP_P], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_P], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_P, HEAD_P], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634
    kv = (k_cache_ptr, v_cache_ptr, block_tables_ptr + seq.to(tl.int64) * stride_bt, k_scale_ptr, v_scale_ptr,
          kv_head, stride_cb, stride_ct, stride_ch, stride_sb, stride_st)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, idx, s_lo, full, s_hi, qk_scale, d, d_ok, *kv,
                            BLOCK_SIZE, BLOCK_N, PRECISION, FP8, DOT_TY, MASKED=False, CAUSAL=False, WINDOW=0, SOFTCAP=0.0)
    acc, m_i, l_i = _attend(acc, m_i, l_i, q, idx, full, s_hi, s_hi, qk_scale, d, d_ok, *kv,
                            BLOCK_SIZE, BLOCK_N, PRECISION, FP8, DOT_TY, MASKED=True, CAUSAL=False, WINDOW=0, SOFTCAP=0.0)
    if COMPACT:  # only covered rows have partials, at their own rows
        prow = tl.load(part_rows_ptr + tok, mask=row_ok, other=0)
    else:
        prow = tok
    slot = (prow.to(tl.int64) * num_heads + head) * NUM_SLOTS + tl.load(level_ptr + g) * SPLITS + split
    tl.store(part_ptr + slot[:, None] * HEAD_D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(ml_ptr + slot, m_i, mask=row_ok)
    tl.store(ml_ptr + ml_half + slot, l_i, mask=row_ok)


def prefix_config(fp32: bool, group: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, key slices) of the prefix kernel. Its tiles are
    prefill-like (many rows, every key visible); a group's prefix is read once per tile, so the
    more heads share a KV head, the fewer sequences a tile takes."""
    if fp32:
        return 64, 32, 4, 2, PREFIX_SPLITS
    return 64, 64, 4, 3, PREFIX_SPLITS  # `cascade_bench.py --tune`: within 5% of the best everywhere


SUFFIX_TILES = (64, 4, 2)
"""(BLOCK_N, num_warps, num_stages) of a decode step's suffix pass (each request's own keys, few):
64-key tiles in two stages, three programs an SM against the decode tiles' one; measured within
3 us of the decode tiles at 32-256 rows (BENCHMARKS.md), no faster."""


def cascade_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, scale: float, max_query_len: int,
                      cascade: CascadeMetadata, out: torch.Tensor | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      seq_order: torch.Tensor | None = None, num_splits: int | None = None,
                      config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """paged_attention's result (the same arguments), with each group's shared prefix attended
    once for the group: the prefix kernel, the paged kernel over each sequence's own keys, the
    merge. `config` overrides prefix_config()."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or seq_lens.shape[0] == 0:
        return out
    decode = max_query_len == 1
    suffix_splits = 1 if not decode else (num_splits or decode_splits(seq_lens.shape[0], num_kv_heads, query.device))
    group = num_heads // num_kv_heads
    fp8 = k_scale is not None
    fp32 = query.dtype == torch.float32
    block_m, block_n, warps, stages, prefix_splits = config or prefix_config(fp32, group)
    prefix_slots = LEVELS * prefix_splits
    slots = prefix_slots + (suffix_splits if suffix_splits > 1 else 0)  # one slice: merged in the suffix kernel
    compact = cascade.part_rows is not None
    assert not compact or suffix_splits == 1, "compact partials serve steps without suffix splits"
    part_rows = cascade.num_part_rows if compact else num_tokens
    part = torch.empty(part_rows, num_heads, slots, head_dim, dtype=torch.float32, device=query.device)
    ml = torch.empty(2, part_rows, num_heads, slots, dtype=torch.float32, device=query.device)
    group_p = triton.next_power_of_2(group)
    block_q = max(block_m, group_p) // group_p
    num_groups, num_rows = cascade.seq.shape[0], cascade.rows.shape[0]
    on = pdl(query.device)
    if num_groups and num_rows:
        grid = (triton.cdiv(num_rows, block_q) + num_groups, prefix_splits, num_kv_heads)
        _cascade_prefix_kernel[grid](
            query, k_cache, v_cache, block_tables, *((k_scale, v_scale) if fp8 else (seq_lens, seq_lens)), part, ml,
            cascade.row_start, cascade.rows, cascade.seq, cascade.lo, cascade.hi, cascade.level,
            cascade.part_rows if compact else cascade.levels,
            scale, num_heads, num_groups, part_rows * num_heads * slots, query.stride(0), query.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
            BLOCK_SIZE=block_size, GROUP=group, GROUP_P=group_p, HEAD_D=head_dim,
            HEAD_P=max(triton.next_power_of_2(head_dim), 16), BLOCK_Q=block_q, BLOCK_N=block_n,
            PRECISION="ieee" if fp32 else "tf32", FP8=fp8, DOT_TY=tl.float32 if fp32 else tl.float16,
            SPLITS=prefix_splits, NUM_SLOTS=slots, GROUPS_P=max(16, triton.next_power_of_2(num_groups)),
            COMPACT=compact, PDL=on, num_warps=warps, num_stages=stages, launch_pdl=on)
    paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len,
                    out=out, k_scale=k_scale, v_scale=v_scale, num_splits=suffix_splits, seq_order=seq_order,
                    tiles=SUFFIX_TILES if decode and not fp32 else None, kv_start=cascade.kv_start,
                    partials=(part, ml, prefix_slots), levels=(cascade.levels, prefix_splits),
                    part_rows=cascade.part_rows)
    if suffix_splits > 1:
        merge_partials(out, part, ml, cascade.levels, prefix_splits, LEVELS)
    return out


# ---- when cascade pays ------------------------------------------------------------------------

# The cost model's constants, fitted on the H100 to `scripts/cascade_bench.py --sweep` (decode
# batches of 2 to 256 in 1 or 8 groups, prefixes of 32 to 8,192 keys, 16 and 32 query heads over 8
# KV heads of 128): with them it picks the faster path in all 80 layouts (BENCHMARKS.md).
SHARED_BYTES_PER_NS = 7000.0
"""Plain attention's rate over a prefix its sequences share: concurrent programs reading the same
blocks meet in L2, so faster than the memory's ~3,000."""
PREFIX_BYTES_PER_NS = 4000.0
"""The prefix kernel's rate over a group's prefix, once per query tile."""
FIXED_NS = 3000.0
"""Two more launches a layer."""
ROW_HEAD_NS = 4.0
"""Per query row and head: the partial results' round trip."""


def worth_it(sizes: np.ndarray, lengths: np.ndarray, num_heads: int, num_kv_heads: int, head_dim: int,
             sms: int, fp32: bool = False, extra_ns: float = 0.0) -> bool:
    """Whether cascade attention makes a step's attention faster: the prefix reads it saves (each
    group of n rows reads its prefix once a query tile instead of n times) against what it adds
    (the prefix kernel's reads, which run at less than full speed with fewer programs than two an
    SM, two launches, the partials, and `extra_ns` a layer besides). `sizes` [G] query rows per
    group, `lengths` [G] prefix keys."""
    sizes, lengths = sizes.astype(np.float64), lengths.astype(np.float64)
    key_bytes = 4.0 * num_kv_heads * head_dim  # K and V, two bytes each
    saved = float(((sizes - 1) * lengths).sum()) * key_bytes / SHARED_BYTES_PER_NS
    group = num_heads // num_kv_heads
    block_m, *_, splits = prefix_config(fp32, group)
    tiles = np.ceil(sizes / max(1, block_m // triton.next_power_of_2(group)))
    programs = float(tiles.sum()) * splits * num_kv_heads
    prefix = float((tiles * lengths).sum()) * key_bytes / PREFIX_BYTES_PER_NS * max(1.0, 2 * sms / programs)
    return saved > FIXED_NS + extra_ns + ROW_HEAD_NS * float(sizes.sum()) * num_heads + prefix
