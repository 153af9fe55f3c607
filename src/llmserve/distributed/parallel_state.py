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


@contextlib.contextmanager
def single_rank() -> Iterator[None]:
    """Models built meanwhile are whole on this rank (a draft model: each rank runs its own copy)."""
    global _tp
    saved, _tp = _tp, TensorParallel()
    try:
        yield
    finally:
        _tp = saved


def all_reduce(x: torch.Tensor, group: TensorParallel | None = None) -> torch.Tensor:
    """The sum of x over the ranks, in place (x itself with one rank)."""
    g = group or _tp
    if g.size > 1:
        import torch.distributed as dist
        dist.all_reduce(x, group=g.group)
    return x


def all_gather_columns(x: torch.Tensor, group: TensorParallel | None = None) -> torch.Tensor:
    """[N, C] per rank -> [N, size * C], rank r's columns at r*C (x itself with one rank)."""
    g = group or _tp
    if g.size == 1:
        return x
    import torch.distributed as dist
    parts = [torch.empty_like(x) for _ in range(g.size)]
    dist.all_gather(parts, x.contiguous(), group=g.group)
    return torch.cat(parts, dim=-1)
