"""Decode-batch matrix multiply for weights in the model dtype: out = x @ w^T (+ bias), x [M, K],
w [N, K]; and the gated form of an MLP's gate_up projection, out = silu(x @ w_gate^T) * (x @ w_up^T),
with w = [w_gate; w_up] (the merged gate_up weight, [2N, K]).

cuBLAS is the GEMM for prefill, but for the gate_up projection: there gated_matmul (end of this
file) multiplies through TMA descriptors in a persistent grid and applies SiLU·mul to the finished
tiles, about as fast as cuBLAS's GEMM alone at prefill sizes, so that the SiLU·mul kernel's pass
over the [M, 2N] product is saved (`gated_takes`).

At decode batches a GEMM is a short stream of its weight matrix, and what costs is the time around
the stream: this kernel launches with PDL like the engine's other kernels, so its programs are
placed while the kernel before it (RMSNorm, attention) drains instead of after, and the kernel
after it is placed while it drains; the gated form also saves the SiLU·mul kernel and the round
trip of the [M, 2N] gate_up output through memory. `takes(x, w)` says when it is the faster choice:
up to DECODE_MAX_M rows and weights of up to 16 MB, on Hopper (`scripts/decode_gemm_bench.py` on a
small model's layers, graphed after an RMSNorm: ahead of cuBLAS up to 128 rows, behind above);
larger weights only at the few rows of a batch-1 or small-batch decode (SMALL_M, GATED_MAX_M).

Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M), SPLIT_K): program (n, m, k) owns a BLOCK_M x BLOCK_N
output tile and the k-th slice of K. Gated, it multiplies the tile's gate rows and up rows (N
apart in w) into two accumulators and writes silu(gate) * up with transformers' roundings (each
product rounded to the activation dtype, SiLU rounded before the multiply, as SiLU·mul does).
Split-K (matrices with too few output tiles to fill the SMs: a small model's o and down
projections): program k stores its float32 partial tile(s) in a workspace slice
[k, PARTS, M, N] and bumps the tile's counter; the program that arrives last sums the SPLIT_K
partials, writes the output and resets the counter to 0 for the next call. One launch, no memset,
and graph-safe: the workspace and counters are allocated once per device and only grow before
CUDA-graph capture (the warm-up runs every layer first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from llmserve.kernels.fused import silu_and_mul_reference
from llmserve.kernels.hardware import hopper, pdl, pdl_start, sm_count


_workspaces: dict[tuple[torch.device, str], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_k_workspace(device: torch.device, numel: int, tiles: int, owner: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 partials and int32 per-tile counters (zero between calls), grown on demand; one pair
    per device and `owner` (a kernel), so that one kernel's growth never moves another's buffers."""
    ws, counts = _workspaces.get((device, owner), (None, None))
    if ws is None or ws.numel() < numel or counts.numel() < tiles:
        ws = torch.empty(max(numel, 0 if ws is None else ws.numel()), dtype=torch.float32, device=device)
        counts = torch.zeros(max(tiles, 0 if counts is None else counts.numel()), dtype=torch.int32, device=device)
        _workspaces[device, owner] = ws, counts
    return ws, counts


@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, ws_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    GATED: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    """The GEMM of dense_matmul and int8_matmul: with HAS_SCALE the weights may be INT8, converted
    to x's dtype as they load (exact) and scaled per output channel on the finished tile."""
    pdl_start(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_per = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per
    k_hi = tl.minimum(k_lo + k_per, K)
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + (k_lo + rk)[None, :]
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + (k_lo + rk)[:, None]
    up_offset = tl.cast(N, tl.int64) * stride_wn  # gated: the up rows follow the gate rows (N may be a constant 1)
    acc, acc_up = k_loop(x_ptrs, w_ptrs, up_offset, m_ok, n_ok, rk, k_lo, k_hi, BLOCK_M, BLOCK_N, BLOCK_K, GATED,
                         PRECISION)
    tile_mask = m_ok[:, None] & n_ok[None, :]
    out_ptrs = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    if SPLIT_K > 1:
        parts = 2 if GATED else 1
        tile_off = rm[:, None] * N + rn[None, :]
        part = ws_ptr + pid_k * parts * M * N + tile_off
        tl.store(part, acc, mask=tile_mask)
        if GATED:
            tl.store(part + M * N, acc_up, mask=tile_mask)
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLIT_K - 1:  # the last partial is in
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for k in tl.static_range(SPLIT_K):
                part = ws_ptr + k * parts * M * N + tile_off
                acc += tl.load(part, mask=tile_mask, other=0.0, cache_modifier=".cg")
                if GATED:
                    acc_up += tl.load(part + M * N, mask=tile_mask, other=0.0, cache_modifier=".cg")
            _store(out_ptrs, acc, acc_up, scale_ptr, bias_ptr, rn, n_ok, tile_mask, GATED, HAS_SCALE, HAS_BIAS)
            tl.atomic_xchg(counter, 0)
    else:
        _store(out_ptrs, acc, acc_up, scale_ptr, bias_ptr, rn, n_ok, tile_mask, GATED, HAS_SCALE, HAS_BIAS)


@triton.jit
def k_loop(x_ptrs, w_ptrs, up_offset, m_ok, n_ok, rk, k_lo, k_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_K: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr):
    """A [BLOCK_M, BLOCK_N] tile's products over K in [k_lo, k_hi), BLOCK_K at a time, from x rows
    (x_ptrs: [BLOCK_M, BLOCK_K] at k_lo) and weight rows (w_ptrs: [BLOCK_K, BLOCK_N] at k_lo), the
    weights converted to x's dtype as they load (INT8, FP8 or the same). GATED: the up rows
    `up_offset` after the gate rows into a second accumulator. -> float32 (acc, acc_up)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = rk + k0 < k_hi
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[None, :] & k_ok[:, None]
        acc = tl.dot(a, tl.load(w_ptrs, mask=w_mask, other=0.0).to(a.dtype), acc, input_precision=PRECISION)
        if GATED:
            acc_up = tl.dot(a, tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0).to(a.dtype), acc_up,
                            input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc, acc_up


@triton.jit
def _store(out_ptrs, acc, acc_up, scale_ptr, bias_ptr, rn, n_ok, mask, GATED: tl.constexpr, HAS_SCALE: tl.constexpr,
           HAS_BIAS: tl.constexpr):
    ty = out_ptrs.dtype.element_ty
    if GATED:
        gate = acc.to(ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(ty)
        tl.store(out_ptrs, (act * acc_up.to(ty)).to(ty), mask=mask)
    else:
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rn, mask=n_ok, other=0.0)[None, :]
        if HAS_BIAS:  # as F.linear: the bias added to the float32 sum, rounded once
            acc = acc + tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(ty), mask=mask)


DECODE_MAX_M = 128  # above this cuBLAS is as fast or faster (scripts/decode_gemm_bench.py, BENCHMARKS.md)
DECODE_MAX_WEIGHT_BYTES = 16 << 20  # larger matrices stream long enough for cuBLAS's tiles to win...
SMALL_M, SMALL_M_MAX_WEIGHT_BYTES, SMALL_M_MIN_N = 8, 64 << 20, 3072
"""...but at batches of up to SMALL_M rows: matrices of up to 64 MB with at least SMALL_M_MIN_N
outputs (the 8B shape's qkv and o whole, qkv, o and down at TP = 2, down at 4) stream faster cut
into SMALL_M_TILES with K in four slices (1.5-3 waves of programs) than through cuBLAS: by
0.3-2.1 µs of 9-21 at 1-4 rows, 0.1-1.5 at 8, and no longer at 16 (2026-11-28-decode-gemm-split).
Narrower matrices (a 2-4B model's o and down) would give fewer programs than a wave and a half,
which was not measured: they stay with cuBLAS."""
SMALL_M_TILES, SMALL_M_SPLIT = (16, 64, 128, 4, 4), 4
GATED_MAX_M, GATED_MAX_WEIGHT_BYTES = 16, 128 << 20
"""The gated form also saves the SiLU·mul kernel and the product's round trip: it beats cuBLAS +
SiLU·mul on the 8B shape's gate_up at TP = 2 (117 MB; 31.1-32.4 against 34.1-34.6 µs at 1-16 rows)
and 4, not whole (235 MB)."""


def takes(x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> bool:
    """Whether dense_matmul is the faster GEMM for x [M, K] @ w^T (gated: its gated form): a
    half-precision decode batch and a weight matrix of a few microseconds' reading (a small model's
    few MB; an 8B model's hundreds of MB stream long enough for cuBLAS's tiles to win), on a GPU
    that launches with PDL (Hopper; the choice does not follow LLMSERVE_PDL, so that PDL on and off
    compute the same numbers)."""
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and hopper(x.device)):
        return False
    M, size = x.shape[0], w.numel() * w.element_size()
    return (M <= DECODE_MAX_M and size <= DECODE_MAX_WEIGHT_BYTES) or \
        (gated and M <= GATED_MAX_M and size <= GATED_MAX_WEIGHT_BYTES) or \
        (not gated and M <= SMALL_M and size <= SMALL_M_MAX_WEIGHT_BYTES and w.shape[0] >= SMALL_M_MIN_N)


def dense_matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, gated: bool = False,
                 config: tuple[int, int, int, int, int] | None = None, split_k: int | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias [N]) -> [..., N] in x's dtype; gated: w is [2N, K] = [gate; up]
    and the result silu(x @ gate^T) * (x @ up^T) (no bias). `config` = (BLOCK_M, BLOCK_N, BLOCK_K,
    num_warps, num_stages) and `split_k` override the choice for the batch."""
    assert not (gated and bias is not None)
    small_m_only = not gated and w.numel() * w.element_size() > DECODE_MAX_WEIGHT_BYTES  # (as takes() allows)

    def choose(M: int, N: int, K: int) -> tuple[tuple[int, int, int, int, int], int]:
        if config is None and small_m_only:
            return SMALL_M_TILES, split_k or SMALL_M_SPLIT
        cfg = config or _config(M)
        tiles = triton.cdiv(N, cfg[1]) * triton.cdiv(M, cfg[0])
        return cfg, split_k or _split_k(tiles, K, sm_count(x.device))

    return weight_matmul(x, w, choose, bias=bias, gated=gated, owner="dense", max_rows=DECODE_MAX_M)


def weight_matmul(x: torch.Tensor, w: torch.Tensor, choose, *, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, gated: bool = False, owner: str, max_rows: int) -> torch.Tensor:
    """_matmul_kernel's launcher, shared by dense_matmul and int8_matmul: x [..., K] @ w^T -> [..., N].
    choose(M, N, K) -> (config, split_k), at most 8 slices (4 when gated); the split-K workspace
    (one per `owner`) is sized for max(M, max_rows) rows, so CUDA-graph replays never regrow it."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    N = w.shape[0] // 2 if gated else w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    (bm, bn, bk, warps, stages), split = choose(M, N, K)
    if split > 1:
        rows = max(M, max_rows)
        ws, counts = _split_k_workspace(x.device, 8 * rows * N, triton.cdiv(N, 16) * triton.cdiv(rows, 16), owner)
    else:
        ws, counts = out, out  # unused
    on = pdl(x.device)
    _matmul_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm), split)](
        x2, w, scale if scale is not None else w, bias if bias is not None else w, out, ws, counts, M, N, K,
        x2.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, GATED=gated, HAS_SCALE=scale is not None,
        HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=on,
        num_warps=warps, num_stages=stages, launch_pdl=on,
    )
    return out.reshape(*lead, N)


def dense_matmul_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                           gated: bool = False) -> torch.Tensor:
    out = torch.nn.functional.linear(x, w, bias)
    return silu_and_mul_reference(out) if gated else out


def _config(M: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the best of a sweep on an H100 at a small
    model's decode batches (`scripts/decode_gemm_bench.py`): narrow 32-column tiles up to 64 rows, then 64."""
    if M <= 16:
        return 16, 32, 128, 4, 4
    return (64, 32 if M <= 64 else 64, 128, 4, 4)


def _split_k(tiles: int, K: int, sms: int) -> int:
    """K slices: as many as keep the programs within one wave of the SMs, each slice >= 512 deep
    (the o and down projections of a small model: 32 tiles of 1,024 outputs, K 2,048-3,072)."""
    split = 1
    while tiles * split * 2 <= sms and K // (split * 2) >= 512 and split < 4:  # gated: 4 fill the workspace
        split *= 2
    return split


# ---- gated GEMM for prefill-sized batches (TMA, persistent) --------------------------------------

@triton.jit
def _gated_tma_kernel(x_desc, w_desc, out_desc, M, N, K, NUM_PROGS,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                      PRECISION: tl.constexpr, PDL: tl.constexpr):
    """silu(x @ w_gate^T) * (x @ w_up^T) over [M, N] output tiles, NUM_PROGS programs taking every
    NUM_PROGS-th tile in GROUP_M-row bands (the weight tiles of a band stay in L2 across its rows);
    x, w and out move through TMA descriptors, the gate and up tiles of w (N rows apart) feed two
    accumulators from one x tile."""
    pdl_start(PDL)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * tiles_n
    ty = x_desc.dtype
    for tile in range(tl.program_id(0), tiles_m * tiles_n, NUM_PROGS):
        first_m = (tile // band) * GROUP_M
        rows = tl.minimum(tiles_m - first_m, GROUP_M)
        om = (first_m + (tile % band) % rows) * BLOCK_M
        on = ((tile % band) // rows) * BLOCK_N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            a = x_desc.load([om, k])
            acc = tl.dot(a, w_desc.load([on, k]).T, acc, input_precision=PRECISION)
            acc_up = tl.dot(a, w_desc.load([N + on, k]).T, acc_up, input_precision=PRECISION)
        gate = acc.to(ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(ty)
        out_desc.store([om, on], (act * acc_up.to(ty)).to(ty))


GATED_TMA_CONFIG = (128, 128, 64, 8, 3, 16)  # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M


def gated_takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether gated_matmul is the faster gate_up (+ SiLU·mul) for x [M, K] and w [2N, K]: a
    half-precision batch above the decode kernel's rows whose output tiles fill the SMs at least
    twice, on Hopper, operands laid out as TMA takes them (contiguous rows of a multiple of 16 bytes
    from 16-byte aligned addresses).
    `scripts/gated_gemm_bench.py`: ahead of cuBLAS + SiLU·mul from two waves of output tiles on,
    behind or level below."""
    if not (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16) and w.dtype == x.dtype and x.dim() == 2
            and x.shape[0] > DECODE_MAX_M and x.is_contiguous() and w.is_contiguous()
            and x.shape[1] * x.element_size() % 16 == 0 and x.data_ptr() % 16 == 0 and w.data_ptr() % 16 == 0
            and hopper(x.device)):
        return False
    bm, bn = GATED_TMA_CONFIG[:2]
    n = w.shape[0] // 2  # the output's rows, a multiple of 16 bytes too
    return n * x.element_size() % 16 == 0 and triton.cdiv(x.shape[0], bm) * triton.cdiv(n, bn) >= 2 * sm_count(x.device)


def gated_matmul(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int, int, int] | None = None,
                 persistent: bool = True) -> torch.Tensor:
    """silu(x @ w[:N]^T) * (x @ w[N:]^T) -> [M, N] for x [M, K] and the merged gate_up weight w [2N, K]
    (both contiguous, half precision), with the roundings of dense_matmul's gated form."""
    M, K = x.shape
    N = w.shape[0] // 2
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    bm, bn, bk, warps, stages, group = config or GATED_TMA_CONFIG
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    progs = min(tiles, sm_count(x.device)) if persistent else tiles
    on = pdl(x.device)
    _gated_tma_kernel[(progs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]), M, N, K, progs,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=on,
        num_warps=warps, num_stages=stages, launch_pdl=on)
    return out
