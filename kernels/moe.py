"""Fused mixture-of-experts: route each token to its top-k experts, then two grouped GEMMs over all
experts at once.

    route      logits [T, E] -> weights [T, k] (float32 softmax, renormalised over the k chosen
               where the model says so), expert ids [T, k], tokens per expert counts [E]
    sort       pair p = t * k + j (token t's j-th expert) -> a slot in its expert's segment of
               `order`; each segment padded to a multiple of BLOCK_M:

                   order:  | e0: p p p . | e1: (none) | e2: p p p p | p . . . | e3: p . . . |
                           ^ start[e0]                ^ start[e2]             ^ start[e3]
                   a block of BLOCK_M slots belongs to one expert; padding slots are never read

    gate_up    block b of `order` (expert e): its pairs' token rows x[p // k] [BLOCK_M, H] times
               w13[e] ([2I, H]: gate rows, then up rows) in BLOCK_N columns of I: gate and up
               tiles into two float32 accumulators, silu(gate) * up written to h[p] [T*k, I]
    down       the same blocks: h[p] [BLOCK_M, I] times w2[e] ([H, I]), times the pair's routing
               weight, written to y[p] [T*k, H]
    sum        out[t] = sum_j y[t * k + j]

Both GEMMs share `_expert_gemm`; grid (blocks, cdiv(N, BLOCK_N)) with blocks the most `order` can
need, cdiv(T*k, BLOCK_M) + min(E, T*k): a program finds its expert from the counts (padded
prefix sums, E values) and leaves if its block is past the last segment. Sizes depend on T
alone, so CUDA graphs capture the whole layer. Steps of at most DIRECT_PAIRS pairs (decode at a
few tokens) skip counts and sort: a program per pair, its expert read from the ids.

Each pair's output row depends only on its own row and its expert's weights (a tile's other rows
never enter it), so the order of pairs within a segment, which the atomics leave open, never
changes a result. Quantized experts (INT8, FP8 e4m3) are converted to the activations' dtype as
they load and scaled per output channel on the finished tile: kernels/matmul.py's K loop.

The weights are stacked per expert, [E, ...]: expert parallelism would hold a slice of E.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from llmserve.kernels.matmul import k_loop


@triton.jit
def _route_kernel(logits_ptr, stride_l, weights_ptr, ids_ptr, counts_ptr, E,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program per token: softmax over its E logits in float32, the k largest in order (the
    lowest expert id first among equal probabilities, as torch.topk), each counted for its expert
    (COUNT: the sorted path's segments need the counts)."""
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    ok = offs < E
    x = tl.load(logits_ptr + t * stride_l + offs, mask=ok, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = tl.where(ok, p / tl.sum(p, 0), -1.0)
    total = 0.0
    if RENORMALIZE:
        left = p
        for _ in tl.static_range(TOP_K):
            best = tl.max(left, 0)
            total += best
            left = tl.where(offs == tl.min(tl.where(left == best, offs, BLOCK_E), 0), -1.0, left)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        # (NaN logits match nothing: a diverged row still names an expert, never memory past the last)
        idx = tl.minimum(tl.min(tl.where(p == best, offs, BLOCK_E), 0), E - 1)
        tl.store(ids_ptr + t * TOP_K + j, idx)
        tl.store(weights_ptr + t * TOP_K + j, best / total if RENORMALIZE else best)
        if COUNT:
            tl.atomic_add(counts_ptr + idx, 1)
        p = tl.where(offs == idx, -1.0, p)


@triton.jit
def _segments(counts_ptr, E, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    """Per expert (a [BLOCK_E] vector): its pair count, and its segment's start and end in `order`."""
    e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    return e, counts, ends - padded, ends


@triton.jit
def _sort_kernel(ids_ptr, counts_ptr, cursor_ptr, order_ptr, num_pairs, E,
                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK: tl.constexpr):
    """Program i places pairs [i*BLOCK, (i+1)*BLOCK): one atomic per expert claims the slots its
    pairs here need (so no two addresses of one atomic coincide), then each pair takes the next
    slot after the earlier pairs of its expert in this chunk."""
    e, counts, starts, ends = _segments(counts_ptr, E, BLOCK_M, BLOCK_E)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=ok, other=E)
    match = ids[:, None] == e[None, :]  # [BLOCK, BLOCK_E]
    here = tl.sum(match.to(tl.int32), 0)
    base = tl.atomic_add(cursor_ptr + e, here, mask=(e < E) & (here > 0))
    base = tl.where(here > 0, base, 0)
    slot = tl.sum(tl.where(match, (starts + base)[None, :], 0), 1)
    i = tl.arange(0, BLOCK)
    earlier = (ids[:, None] == ids[None, :]) & (i[None, :] < i[:, None])  # [BLOCK, BLOCK]
    slot += tl.sum(earlier.to(tl.int32), 1)
    tl.store(order_ptr + slot, offs, mask=ok)


@triton.jit
def _expert_gemm(a_ptr, w_ptr, scale_ptr, route_ptr, out_ptr, order_ptr, counts_ptr, ids_ptr, N, K, E,
                 stride_a, stride_we, stride_wn, stride_out, A_ROW_DIV: tl.constexpr, GATED: tl.constexpr,
                 HAS_SCALE: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr):
    """Block b of `order` times its expert's weights, columns [n*BLOCK_N, (n+1)*BLOCK_N) of N.
    A's row of pair p is p // A_ROW_DIV (the token for gate_up, the pair for down). GATED: the up
    rows follow the N gate rows in w, out = silu(gate) * up; else out = route[p] * (a @ w^T).
    DIRECT (a few pairs, no sort): program b takes pair b alone, its expert ids[b]."""
    b = tl.program_id(0)
    rm = tl.arange(0, BLOCK_M)
    if DIRECT:
        expert = tl.load(ids_ptr + b)
        m_ok = rm == 0
        pairs = b + rm * 0
    else:
        e, counts, starts, ends = _segments(counts_ptr, E, BLOCK_M, BLOCK_E)
        expert = tl.sum((ends <= b * BLOCK_M).to(tl.int32), 0)
        if expert >= E:
            return
        count = tl.sum(tl.where(e == expert, counts, 0), 0)
        first = b * BLOCK_M - tl.sum(tl.where(e == expert, starts, 0), 0)  # this block's first slot in the segment
        m_ok = first + rm < count
        pairs = tl.load(order_ptr + b * BLOCK_M + rm, mask=m_ok, other=0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // A_ROW_DIV)[:, None].to(tl.int64) * stride_a + rk[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    up_offset = tl.cast(N, tl.int64) * stride_wn
    acc, acc_up = k_loop(a_ptrs, w_ptrs, up_offset, m_ok, n_ok, rk, 0, K, BLOCK_M, BLOCK_N, BLOCK_K, GATED, PRECISION)
    ty = out_ptr.dtype.element_ty
    if HAS_SCALE:
        scales = scale_ptr + expert.to(tl.int64) * (2 * N if GATED else N) + rn
        acc = acc * tl.load(scales, mask=n_ok, other=0.0)[None, :]
        if GATED:
            acc_up = acc_up * tl.load(scales + N, mask=n_ok, other=0.0)[None, :]
    if GATED:  # transformers' roundings: each product in the activation dtype, SiLU rounded before the multiply
        gate = acc.to(ty).to(tl.float32)
        out = ((gate / (1.0 + tl.exp(-gate))).to(ty) * acc_up.to(ty)).to(ty)
    else:
        route = tl.load(route_ptr + pairs, mask=m_ok, other=0.0)
        out = (acc.to(ty).to(tl.float32) * route[:, None]).to(ty)
    out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * stride_out + rn[None, :]
    tl.store(out_ptrs, out, mask=m_ok[:, None] & n_ok[None, :])


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          count: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logits [T, E] -> (weights float32 [T, k], expert ids int32 [T, k], pairs per expert int32 [E],
    or None without `count`)."""
    T, E = logits.shape
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    counts = torch.zeros(E, dtype=torch.int32, device=logits.device) if count else None
    if T:
        _route_kernel[(T,)](logits, logits.stride(0), weights, ids, counts, E, TOP_K=top_k, RENORMALIZE=renormalize,
                            COUNT=count, BLOCK_E=triton.next_power_of_2(E))
    return weights, ids, counts


def _tiles(pairs: int, E: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the pairs an expert gets on average:
    decode steps give each picked expert a row or two, so the smallest tensor-core tile and narrow
    columns that spread each expert's weights over many programs; prefill gives each hundreds."""
    per_expert = pairs / E
    if per_expert <= 16:
        return 16, 64, 128, 4, 3
    if per_expert <= 64:
        return 64, 64, 64, 4, 3
    return 128, 128, 64, 8, 3


DIRECT_PAIRS = 32
"""Steps of at most this many (token, expert) pairs skip the sort: a program per pair. A token's k
experts are distinct, and at a few tokens the counts' memset, the cursor's and the sort (three of
a sorted layer's seven launches) cost more than the weights two tokens' pairs may read twice: on
an H100 the unsorted layer is the faster up to 4 tokens of 8 experts (scripts/moe_bench.py)."""


def fused_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor | None,
                  w13: torch.Tensor, w2: torch.Tensor, scale13: torch.Tensor | None = None,
                  scale2: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] (bf16/fp16/fp32); weights, ids [T, k] and counts [E] from `route` (counts None: a
    program per pair, unsorted); w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] in x's
    dtype, or INT8/FP8 with float32 per-row scales scale13 [E, 2I] and scale2 [E, H] -> [T, H] in
    x's dtype."""
    T, H = x.shape
    k = ids.shape[1]
    E, two_i, _ = w13.shape
    inter = two_i // 2
    pairs = T * k
    out_pairs = torch.empty(pairs, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out_pairs
    direct = counts is None
    block_m, block_n, block_k, warps, stages = _tiles(pairs, E)
    block_e = triton.next_power_of_2(E)
    if direct:
        order, blocks = None, pairs
    else:
        cursor = torch.zeros(E, dtype=torch.int32, device=x.device)
        order = torch.empty(pairs + E * block_m, dtype=torch.int32, device=x.device)
        sort_block = 128
        _sort_kernel[(triton.cdiv(pairs, sort_block),)](ids, counts, cursor, order, pairs, E, BLOCK_M=block_m,
                                                        BLOCK_E=block_e, BLOCK=sort_block)
        blocks = triton.cdiv(pairs, block_m) + min(E, pairs)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    quantized = scale13 is not None
    for a, w, scale, out, n, K, row_div in ((x, w13, scale13, h, inter, H, k), (h, w2, scale2, out_pairs, H, inter, 1)):
        _expert_gemm[(blocks, triton.cdiv(n, block_n))](
            a, w, scale, weights, out, order, counts, ids, n, K, E, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
            A_ROW_DIV=row_div, GATED=w is w13, HAS_SCALE=quantized, DIRECT=direct, PRECISION=precision,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=block_e, num_warps=warps, num_stages=stages)
    return out_pairs.view(T, k, H).sum(1) if k > 1 else out_pairs  # (accumulated in float32, rounded once)


def fused_moe(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, w13: torch.Tensor,
              w2: torch.Tensor, scale13: torch.Tensor | None = None, scale2: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer on the GPU: `route`, then `fused_experts` (unsorted up to DIRECT_PAIRS pairs)."""
    weights, ids, counts = route(logits, top_k, renormalize, count=x.shape[0] * top_k > DIRECT_PAIRS)
    return fused_experts(x, weights, ids, counts, w13, w2, scale13, scale2)


def route_reference(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """As transformers' routers: softmax in float32, top-k, renormalised if asked -> (weights, ids int64)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _dequantized(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    return w.to(dtype) if scale is None else (w.float() * scale[:, None]).to(dtype)


def fused_moe_reference(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, w13: torch.Tensor,
                        w2: torch.Tensor, scale13: torch.Tensor | None = None,
                        scale2: torch.Tensor | None = None) -> torch.Tensor:
    """The same arithmetic in plain torch, one expert at a time over the tokens that chose it (the
    CPU backend's MoE and the kernels' test oracle); quantized weights are dequantized per expert."""
    weights, ids = route_reference(logits, top_k, renormalize)
    T, H = x.shape
    inter = w13.shape[1] // 2
    out = torch.zeros(T, top_k, H, dtype=x.dtype, device=x.device)
    for expert in ids.unique().tolist():
        tokens, slots = torch.nonzero(ids == expert, as_tuple=True)
        w_in = _dequantized(w13[expert], None if scale13 is None else scale13[expert], x.dtype)
        w_out = _dequantized(w2[expert], None if scale2 is None else scale2[expert], x.dtype)
        gate_up = F.linear(x[tokens], w_in)
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w_out)
        out[tokens, slots] = (y.float() * weights[tokens, slots, None]).to(x.dtype)
    return out.sum(1, dtype=torch.float32).to(x.dtype)
