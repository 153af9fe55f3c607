"""This process's place in its tensor-parallel group, and the collectives the model's layers call.

Each rank is a process of its own (distributed/workers.py) that sets its group once, before it
builds the model: the parallel layers (model/layers.py) read their rank when they are made and
load only their slice. With one rank, the default, every collective returns its input untouched,
so the single-GPU engine never meets torch.distributed.

Megatron's split, per decoder layer, for ranks r = 0 .. P-1:

    qkv_proj, gate_up_proj   column-parallel: rank r holds heads (and MLP rows) r*n/P .. (r+1)*n/P
    o_proj, down_proj        row-parallel: the matching input columns; partial sums, one all-reduce
    embed_tokens, lm_head    by vocabulary: ceil(V/P) rows each; embeddings all-reduced (a row lives
                             on one rank), logits all-gathered so that every rank samples alike

KV heads split like query heads while they are at least as many as the ranks; with fewer, each KV
head is repeated on P / num_kv_heads consecutive ranks (those whose query heads read it).

On CUDA, all-reduces of up to ONE_SHOT_MAX_BYTES (decode steps' activations) skip NCCL's protocol:
every rank copies its part into a buffer of symmetric memory (torch's, mapped into every peer over
NVLink), the ranks meet at a barrier of flags, and each sums all the peers' buffers in one kernel
(torch.ops.symm_mem one-shot). A rank may copy its next part in while a slower peer still reads
the last call's, never the one before that (each call's barrier waits for every peer to arrive), so
no two successive calls may share a slot of the buffer. A forward pass opens with the embeddings'
all-reduce, which takes slot 2; the layers' calls after it alternate between slots 0 and 1, counted
from the pass's start. So the slots are the same whether a pass is replayed from a CUDA graph
(captured with them) or runs eagerly, and one pass's last call (slot 0 or 1) never meets the next
pass's first (slot 2), whether or not a collective came between them.

An all-reduce whose sum an RMSNorm takes next (the row-parallel layers' outputs: model/layers.py's
reduce_into) goes through all_reduce_rms_norm instead, where it fits (as many bytes, at most
NORM_REDUCE_MAX_ROWS rows): one kernel (kernels/allreduce.py) in which each rank writes its rows
into every peer's buffer and waits for theirs, with no barrier, then normalises. Its buffer has three slots too, counted alike: the first
such call after the embeddings' takes slot 2, the next ones 0, 1, 0, ... A pass makes none of them
or at least two (reduce_into's caller sees to it): a single one would take slot 2 in every pass,
and two successive calls must never share a slot (a peer could write the next call's rows where
this rank still reads the last's).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from llmserve.kernels.allreduce import empty_mark, summed_rms_norm

log = structlog.get_logger("llmserve.parallel_state")


@dataclass(slots=True)
class TensorParallel:
    size: int = 1
    rank: int = 0
    group: Any = None
    """torch.distributed's process group of the ranks (None with one rank)."""
    one_shot: torch.Tensor | None = None
    """[3, ONE_SHOT_MAX_BYTES / itemsize] of symmetric memory for small all-reduces (CUDA), or None."""
    calls: int = 0
    """All-reduces since the pass's opening one: the parity of the next picks its slot (0 or 1)."""
    norm_reduce: NormReduce | None = None
    """Symmetric memory for all_reduce_rms_norm (CUDA), or None: an all-reduce, then the norm."""

    def split(self, n: int, what: str) -> int:
        """n items (heads, rows) over the ranks: this rank's count; every rank holds as many."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) must divide evenly over tensor_parallel_size {self.size}")
        return n // self.size

    def kv_split(self, num_kv_heads: int) -> tuple[int, int]:
        """(parts, index): KV heads cut into `parts` equal slices, this rank holding slice `index`."""
        parts = min(self.size, num_kv_heads)
        if self.size % parts or num_kv_heads % parts:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({self.size}) must "
                             "divide one another")
        return parts, self.rank * parts // self.size

    def kv_heads(self, num_kv_heads: int) -> int:
        """This rank's KV heads (a slice of kv_split's)."""
        return num_kv_heads // self.kv_split(num_kv_heads)[0]


@dataclass(slots=True)
class NormReduce:
    """all_reduce_rms_norm's symmetric memory on this rank (kernels/allreduce.py's layout) and its
    slot count (the module docstring's rules)."""
    buffer: torch.Tensor
    """This rank's [3, size, place] of symmetric memory, every element empty between calls."""
    addresses: torch.Tensor
    """int64 [size]: every rank's buffer's address, as mapped into this process."""
    place: int
    """Elements of one rank's rows a call may hold."""
    calls: int = 0
    """all_reduce_rms_norm calls since the pass opened: the next takes slot 2 if none, else 0 or 1."""

    def next_slot(self) -> int:
        slot = 2 if self.calls == 0 else (self.calls - 1) & 1
        self.calls += 1
        return slot


_tp = TensorParallel()

ONE_SHOT_MAX_BYTES = 1 << 19
"""All-reduces up to this size (64 rows of a 4,096-wide bf16 model) take the one-shot kernel."""


def tp() -> TensorParallel:
    """This process's tensor-parallel group."""
    return _tp


def init_tensor_parallel(rank: int, size: int, backend: str, init_method: str, timeout_s: float) -> None:
    """Join the group of `size` ranks as `rank` (torch.distributed: NCCL on CUDA, gloo on CPU)."""
    import torch.distributed as dist
    global _tp
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    _tp = TensorParallel(size, rank, dist.group.WORLD)


def _agreed(why: str | None, device: torch.device) -> str | None:
    """why, or another rank's failure: every rank takes the same path (a MIN over the ranks)."""
    import torch.distributed as dist
    ready = torch.tensor([why is None], dtype=torch.int32, device=device)
    dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=_tp.group)
    return why or (None if ready.item() else "another rank could not set it up")


def enable_one_shot(device: torch.device, dtype: torch.dtype) -> str | None:
    """Set up the symmetric-memory buffers for small all-reduces of `dtype` (a collective: every rank
    calls it) and check sums through them; None when set up, else why not (NCCL then does them all).
    all_reduce_rms_norm's buffer is set up after the one-shot kernel's: without it, its all-reduces
    take the one-shot kernel, then the norm (the reason is logged)."""
    name, why = _tp.group.group_name, None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(3 * ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group=name)
    except Exception as exc:  # no symmetric memory here (torch, driver, or devices without peer access)
        why = f"{type(exc).__name__}: {exc}"
    why = _agreed(why, device)  # before the check's kernel, whose barrier would wait for a rank that failed
    if why is not None:
        return why
    try:
        x = torch.full((8, 64), float(_tp.rank + 1), dtype=dtype, device=device)
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[:x.numel()].view_as(x), x, "sum", name, out)
        if not bool((out == _tp.size * (_tp.size + 1) // 2).all()):
            why = "its check sum came out wrong"
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    why = _agreed(why, device)
    if why is None:
        _tp.one_shot = buf.view(3, -1)
        if (why_not := _enable_norm_reduce(device, dtype)) is not None and _tp.rank == 0:
            log.warning("the all-reduces that norms take stay apart from them", reason=why_not)
    return why


def _enable_norm_reduce(device: torch.device, dtype: torch.dtype) -> str | None:
    """Set up all_reduce_rms_norm's buffer and check it: a pass of three calls (slots 2, 0, 1), each
    against NCCL's sum normalised, on rows with zeros of both signs; None when set up, else why not."""
    import torch.distributed as dist

    from llmserve.kernels.fused import rms_norm_reference
    why = None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        place = ONE_SHOT_MAX_BYTES // dtype.itemsize
        buf = symm_mem.empty(3 * _tp.size * place, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(buf, group=_tp.group.group_name)
        buf.view({2: torch.int16, 4: torch.int32}[dtype.itemsize]).fill_(empty_mark(dtype))
        addresses = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    # every rank's buffer is marked empty (its fill precedes this all-reduce on the stream) before
    # any rank writes into a peer's
    if (why := _agreed(why, device)) is not None:
        return why
    _tp.norm_reduce = NormReduce(buf.view(3, _tp.size, place), addresses, place)
    try:
        gen = torch.Generator(device).manual_seed(_tp.rank)
        weight = torch.rand(64, dtype=dtype, device=device, generator=gen) + 0.5
        xs = [torch.randn(rows, 64, dtype=dtype, device=device, generator=gen) for rows in (3, 1, 5)]
        xs[0][0, :8], xs[0][0, 8:16] = 0.0, -0.0
        residuals = [torch.randn_like(x) for x in xs]
        # every call on every rank before any comparison: a rank that stopped early would leave its
        # peers waiting in the next call for rows it never writes
        got = [all_reduce_rms_norm(x, r, weight, 1e-6, rms_norm_reference) for x, r in zip(xs, residuals)]
        for x, r, (out, res_out) in zip(xs, residuals, got):
            summed = x.clone()
            dist.all_reduce(summed, group=_tp.group)
            want, want_res = rms_norm_reference(summed, weight, 1e-6, r)
            if not (torch.allclose(out.float(), want.float(), rtol=0.02, atol=0.02)
                    and torch.allclose(res_out.float(), want_res.float(), rtol=0.02, atol=0.02)):
                why = "its check came out wrong"
    except Exception as exc:
        why = f"{type(exc).__name__}: {exc}"
    _tp.norm_reduce.calls = 0
    if (why := _agreed(why, device)) is not None:
        _tp.norm_reduce = None
    return why


NORM_REDUCE_MAX_ROWS = 256
"""all_reduce_rms_norm's kernel runs a program a row, each waiting for the peers' same row: at most
this many, so that every program of a call is on the GPU at once (a narrow model's long prompt
fits the buffer in thousands of rows)."""

RmsNorm = Callable[[torch.Tensor, torch.Tensor, float, "torch.Tensor | None"],
                   "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]


def all_reduce_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                        rms_norm: RmsNorm, group: TensorParallel | None = None
                        ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(the sum of x over the ranks, weight, eps, residual), the backend's RMSNorm: one
    kernel through symmetric memory where it is set up and x [T, N] fits, else all_reduce, then
    rms_norm."""
    g = group or _tp
    f = g.norm_reduce
    if f is not None and x.dtype == f.buffer.dtype and x.dim() == 2 and x.numel() <= f.place and \
            x.shape[0] <= NORM_REDUCE_MAX_ROWS:
        return summed_rms_norm(x, residual, weight, eps, f.addresses, g.rank, g.size, f.place, f.next_slot())
    return rms_norm(all_reduce(x, g), weight, eps, residual)


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Models built meanwhile are whole on this rank (a draft model: each rank runs its own copy)."""
    global _tp
    saved, _tp = _tp, TensorParallel()
    try:
        yield
    finally:
        _tp = saved


def all_reduce(x: torch.Tensor, group: TensorParallel | None = None, *, opens_pass: bool = False) -> torch.Tensor:
    """The sum of x over the ranks: x summed in place, or a new tensor (one-shot); x with one rank.
    opens_pass: the forward pass's first all-reduce (the embeddings'), which restarts the slots."""
    g = group or _tp
    if g.size == 1:
        return x
    if opens_pass and g.norm_reduce is not None:
        g.norm_reduce.calls = 0
    buf = g.one_shot
    if buf is not None and x.dtype == buf.dtype and x.numel() <= buf.shape[1] and x.is_contiguous():
        if opens_pass:
            slot, g.calls = 2, 0
        else:
            slot, g.calls = g.calls & 1, g.calls + 1
        out = torch.empty_like(x)
        torch.ops.symm_mem.one_shot_all_reduce_copy_out(buf[slot, :x.numel()].view_as(x), x, "sum",
                                                         g.group.group_name, out)
        return out
    import torch.distributed as dist
    dist.all_reduce(x, group=g.group)
    return x


def all_gather_columns(x: torch.Tensor, group: TensorParallel | None = None) -> torch.Tensor:
    """[N, C] per rank -> [N, size * C], rank r's columns at r*C (x itself with one rank)."""
    g = group or _tp
    if g.size == 1:
        return x
    import torch.distributed as dist
    n, c = x.shape
    stacked = torch.empty((g.size * n, c), dtype=x.dtype, device=x.device)  # rank r's rows at r*N
    dist.all_gather_into_tensor(stacked, x.contiguous(), group=g.group)
    return stacked.view(g.size, n, c).transpose(0, 1).reshape(n, g.size * c)
