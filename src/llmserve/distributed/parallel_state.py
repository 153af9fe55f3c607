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
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


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


def enable_one_shot(device: torch.device, dtype: torch.dtype) -> str | None:
    """Set up the symmetric-memory buffer for small all-reduces of `dtype` (a collective: every rank
    calls it) and check a sum through it; None when set up, else why not (NCCL then does them all)."""
    import torch.distributed as dist

    def agreed(why: str | None) -> str | None:
        """why, or another rank's failure: every rank takes the same path (a MIN over the ranks)."""
        ready = torch.tensor([why is None], dtype=torch.int32, device=device)
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=_tp.group)
        return why or (None if ready.item() else "another rank could not set it up")

    name, why = _tp.group.group_name, None
    try:
        import torch.distributed._symmetric_memory as symm_mem
        buf = symm_mem.empty(3 * ONE_SHOT_MAX_BYTES // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group=name)
    except Exception as exc:  # no symmetric memory here (torch, driver, or devices without peer access)
        why = f"{type(exc).__name__}: {exc}"
    why = agreed(why)  # before the check's kernel, whose barrier would wait for a rank that failed
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
    why = agreed(why)
    if why is None:
        _tp.one_shot = buf.view(3, -1)
    return why


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
