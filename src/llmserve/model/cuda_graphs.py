"""CUDA graphs of decode-only forward passes.

A decode step (every request computes exactly one token) has a shape fixed by its batch size alone,
so the forward pass for each size in a ladder (1, 2, 4, 8, then every 16 up to max_num_seqs) is
captured once, after the KV cache exists, into one shared memory pool, largest first. A step of B
requests replays the smallest captured size b >= B; rows B..b-1 are padding:

    static buffer      rows 0 .. B-1 (this step)        rows B .. b-1 (padding)
    input_ids          the step's tokens                 0
    positions          context length of each request    0
    slot_mapping       the new token's KV slot           -1: the KV write skips it
    seq_lens           context + 1                       1: attention reads one (stale) slot
    block_tables       the requests' tables              whatever was there: only column 0 is read

Inputs travel through pinned host buffers with one non-blocking copy each. Two sets alternate:
with a step in flight, step N + 1 fills its buffers while N's copies may still be queued, and N + 2
(which reuses N's) is launched only after N has finished. The lm_head runs eagerly on the padded
output (rows past B are ignored), so cuBLAS meets one shape per captured size, all of them first
at capture time rather than a new one whenever the batch shrinks mid-run.
"""

from __future__ import annotations

import numpy as np
import torch

from llmserve.attention import AttentionMetadata


def graph_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model, device: torch.device, max_batch: int, max_blocks_per_seq: int) -> None:
        self.model = model
        self.sizes = graph_sizes(max_batch)
        self.max_batch = max_batch
        n = max_batch
        i32, i64 = torch.int32, torch.int64
        self.input_ids = torch.zeros(n, dtype=i64, device=device)
        self.positions = torch.zeros(n, dtype=i64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=i64, device=device)
        self.seq_lens = torch.ones(n, dtype=i32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=i32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=i32, device=device)
        # Pinned staging, two sets: [ids | positions | slots] as int64, seq_lens as int32, tables as int32.
        self._staging = [(torch.zeros(3, n, dtype=i64, pin_memory=True), torch.ones(n, dtype=i32, pin_memory=True),
                          torch.zeros(n, max_blocks_per_seq, dtype=i32, pin_memory=True)) for _ in range(2)]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:b], self.block_tables[:b], self.query_start_loc[:b + 1],
                                 self.seq_lens[:b], max_query_len=1)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in reversed(self.sizes):
            meta = self._meta(b)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up off the capture: kernel compilation, workspaces
                self.model(self.input_ids[:b], self.positions[:b], meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model(self.input_ids[:b], self.positions[:b], meta)
            self.graphs[b] = graph
        for b in self.sizes:  # cuBLAS picks (and lazily loads) a kernel per shape on first use
            self.model.compute_logits(self.outputs[b])
        torch.cuda.synchronize()

    def fits(self, num_reqs: int) -> bool:
        return num_reqs <= self.max_batch

    def run(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, seq_lens: np.ndarray,
            block_tables: np.ndarray, from_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Replay for B decoding requests; returns hidden states [b, hidden] for the captured size
        b >= B (the graph's output: rows B.. are padding).
        from_device: (rows, token ids) already on the device that overwrite those rows of token_ids."""
        B = len(token_ids)
        b = next(s for s in self.sizes if s >= B)
        host64, host32, host_tables = self._staging[self.replays % 2]
        host = host64.numpy()
        host[0, :B], host[1, :B], host[2, :B] = token_ids, positions, slots
        host[:, B:b] = 0
        host[2, B:b] = -1
        lens = host32.numpy()
        lens[:B], lens[B:b] = seq_lens, 1
        width = block_tables.shape[1]
        host_tables.numpy()[:B, :width] = block_tables
        self.input_ids[:b].copy_(host64[0, :b], non_blocking=True)
        if from_device is not None:
            self.input_ids[from_device[0]] = from_device[1]
        self.positions[:b].copy_(host64[1, :b], non_blocking=True)
        self.slot_mapping[:b].copy_(host64[2, :b], non_blocking=True)
        self.seq_lens[:b].copy_(host32[:b], non_blocking=True)
        self.block_tables[:B, :width].copy_(host_tables[:B, :width], non_blocking=True)
        self.graphs[b].replay()
        self.replays += 1
        return self.outputs[b]
