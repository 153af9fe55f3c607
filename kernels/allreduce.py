"""A tensor-parallel all-reduce fused with the RMSNorm (and residual add) after it, for the small
batches of decode steps: one kernel, and no barrier between the ranks.

Every rank holds a buffer of symmetric memory (mapped into each peer over NVLink), laid out as
[3 slots][P ranks][M elements], every element "empty" between calls. A call in slot s, rank r,
rows x [T, N], one program a row:

1. Writes its partial row into place r of slot s of every rank's buffer (its own included).
2. Reads places 0 .. P-1 of slot s in its own buffer, each until none of the row's elements is
   empty any more, and sums them in float32 in rank order (every rank the same order, so every
   rank the same bits), rounded to the model dtype as an all-reduce returns it.
3. Marks what it read empty again, and fences: a peer writes into slot s again two calls later
   at the earliest (parallel_state never gives two successive calls one slot), only once it has
   this rank's rows of the call between. That call's writes come after this call has finished
   because every kernel between them waits for the one before it: with PDL each starts with
   pdl_start (a kernel launched early that wrote before its gdc_wait would break this).
4. Adds the residual and normalises (kernels/fused.py's add_norm_row, as its rms_norm does).

Empty is negative zero, the sign bit alone (0x8000 in 16-bit floats, 0x80000000 in float32): a
writer writes +0.0 in its place (the sum is unchanged), so a reader waits for exactly the values it
lacks, and a value that has arrived is never taken for a missing one (the Lamport scheme of
TensorRT-LLM's small all-reduces). No barrier: a call costs one write across NVLink and the wait
for the peers' writes, where a barrier's one-shot all-reduce waits for flags both ways first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.kernels.fused import add_norm_row
from llmserve.kernels.hardware import pdl, pdl_start


@triton.jit
def _fence_system():
    """This thread's earlier writes are seen by every device before its later ones."""
    tl.inline_asm_elementwise("fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _all_reduce_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, bufs_ptr, N, eps, rank, slot,
                                RANKS: tl.constexpr, PLACE: tl.constexpr, BITS: tl.constexpr, EMPTY: tl.constexpr,
                                HAS_RES: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=mask, other=0.0)
    bits = x.to(BITS, bitcast=True)
    bits = tl.where(bits == EMPTY, 0, bits).to(BITS)  # -0.0 -> +0.0
    at = (slot * RANKS + rank) * PLACE + row * N + cols
    for p in tl.static_range(RANKS):
        peer = tl.multiple_of(tl.load(bufs_ptr + p).to(tl.pointer_type(BITS)), 16)  # (symm_mem aligns them)
        tl.store(peer + at, bits, mask=mask)

    own = tl.multiple_of(tl.load(bufs_ptr + rank).to(tl.pointer_type(BITS)), 16)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(RANKS):
        place = own + (slot * RANKS + src) * PLACE + row * N + cols
        got = tl.load(place, mask=mask, other=0, volatile=True)
        while tl.max((got == EMPTY).to(tl.int32), 0) > 0:
            got = tl.load(place, mask=mask, other=0, volatile=True)
        tl.store(place, EMPTY, mask=mask)
        acc += got.to(x.dtype, bitcast=True).to(tl.float32)
    _fence_system()

    add_norm_row(acc.to(x.dtype), res_ptr + row * N, w_ptr, out_ptr + row * N, res_out_ptr + row * N, cols, mask, N,
                 eps, HAS_RES)


_BITS = {2: (tl.int16, -(1 << 15)), 4: (tl.int32, -(1 << 31))}


def empty_mark(dtype: torch.dtype) -> int:
    """The empty mark's bits as a signed integer of dtype's width (negative zero)."""
    return _BITS[dtype.itemsize][1]


def summed_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                    bufs: torch.Tensor, rank: int, ranks: int, place: int,
                    slot: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(the sum over the ranks of x [T, N], weight, eps, residual), returned as
    kernels/fused.py's rms_norm returns it. bufs: int64 [ranks] on this device, each rank's buffer's
    address ([3, ranks, place] elements of x.dtype, T * N <= place); slot: this call's (0-2)."""
    rows, n = x.shape
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    if rows:
        bits, empty = _BITS[x.dtype.itemsize]
        on = pdl(x.device)
        _all_reduce_rms_norm_kernel[(rows,)](
            x, residual if residual is not None else x, weight, out, res_out, bufs, n, eps, rank, slot,
            RANKS=ranks, PLACE=place, BITS=bits, EMPTY=empty, HAS_RES=residual is not None,
            BLOCK=triton.next_power_of_2(n), PDL=on, num_warps=4 if n <= 2048 else 8, launch_pdl=on)
    return out if residual is None else (out, res_out)
