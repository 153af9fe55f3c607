"""The KV block pool: fixed-size blocks with ref counts, an LRU free queue and the prefix-cache index.

    blocks      [0] [1] [2] [3] [4] [5] ...        every block is in exactly one state:
    in use      ref_cnt > 0                         held by one or more requests
    free        ref_cnt == 0, in the free queue     oldest-freed first out; a free block that still
                                                    carries a hash is a cached block, reusable by a
                                                    prefix hit until allocation evicts it

Freed blocks go to the back of the queue, allocation takes from the front, so the least recently
used cached blocks are evicted first. Requests free their blocks tail first, so a request's last
blocks (the least shareable) are evicted before its prefix.

Plain synchronous code: no event loop, no device.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    """Chained hash of the block's tokens (and all tokens before them) once the block is full."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` blocks (ref_cnt 1 each), evicting cached ones as needed; None if too few are free."""
        if n > len(self._free):
            return None
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                # Evict: the block's contents are about to be overwritten.
                if self._cached.get(block.block_hash) == block_id:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            ids.append(block_id)
        return ids

    def touch(self, block_ids: list[int]) -> None:
        """Take one more reference on each block (prefix-cache hits); a free one leaves the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block, given in the request's order; freed tail first."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def lookup(self, block_hash: int) -> int | None:
        """The id of the cached block holding these tokens, or None."""
        return self._cached.get(block_hash)

    def cache(self, block_id: int, block_hash: int) -> None:
        """Record that a full block holds the tokens `block_hash` stands for."""
        block = self.blocks[block_id]
        block.block_hash = block_hash
        self._cached.setdefault(block_hash, block_id)

    def num_evictable_among(self, block_ids: list[int]) -> int:
        """How many of these blocks are free now (touching them takes them out of the free queue)."""
        return sum(1 for b in block_ids if self.blocks[b].ref_cnt == 0)
