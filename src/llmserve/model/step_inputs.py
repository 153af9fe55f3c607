"""A step's inputs: positions, KV slots and attention metadata from the plan's arrays, and the one
path by which host arrays reach the device.

Derived with numpy vector ops (no Python loop over tokens):

    query_lens [2, 1, 3]  ->  query_start_loc [0, 2, 3, 6],  req_idx per token [0 0 1 2 2 2]
    positions  = context_len[req_idx] + (token index - query_start_loc[req_idx])
    slot       = block_table[req_idx, position // B] * B + position % B

On CUDA every array goes through one pinned ring (model/pinned.py) and one non-blocking copy,
queued without waiting for the device: an eager step gets fresh device tensors from it, a CUDA
graph's replay copies into its static buffers from it (model/cuda_graphs.py). From pageable memory
the driver stages larger copies only after the stream's earlier work, so the host would wait for
the step in flight before launching more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmserve.attention import AttentionMetadata, CascadeMetadata
from llmserve.messages import PrefixGroups, StepPlan
from llmserve.model.pinned import PinnedRing


@dataclass(slots=True)
class StepInputs:
    """One step's host arrays: S requests, T tokens."""
    token_ids: np.ndarray
    """int64 [T] (the plan's own array: placeholders are filled in there)."""
    positions: np.ndarray
    """int64 [T]"""
    slots: np.ndarray
    """int64 [T]: each token's KV-cache slot."""
    query_start_loc: np.ndarray
    """int32 [S + 1]"""
    seq_lens: np.ndarray
    """int32 [S]: context plus this step's tokens."""
    block_tables: np.ndarray
    """int32 [S, max_blocks]"""
    max_query_len: int

    @classmethod
    def build(cls, token_ids: np.ndarray, query_lens: np.ndarray, context_lens: np.ndarray,
              block_tables: np.ndarray, block_size: int) -> StepInputs:
        qsl = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=qsl[1:])
        req_idx = np.repeat(np.arange(len(query_lens)), query_lens)
        positions = context_lens[req_idx].astype(np.int64) + (np.arange(len(token_ids)) - qsl[:-1][req_idx])
        slots = block_tables[req_idx, positions // block_size].astype(np.int64) * block_size + positions % block_size
        return cls(token_ids, positions, slots, qsl, (context_lens + query_lens).astype(np.int32), block_tables,
                   int(query_lens.max()) if len(query_lens) else 0)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class Staging:
    """Host arrays to the device without a blocking copy (a plain tensor on CPU)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._ring: PinnedRing | None = None

    def stage(self, array: np.ndarray) -> torch.Tensor:
        """`array` where one non-blocking copy to the device can be queued from (pinned on CUDA)."""
        if self.device.type != "cuda":
            return torch.from_numpy(array)
        if self._ring is None:
            self._ring = PinnedRing(self.device)
        return self._ring.stage(array)

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, torch.Tensor]:
        """An array to fill in place, and the tensor one non-blocking copy to the device is queued
        from (on CUDA the pinned ring's memory: no host array is copied into it first)."""
        if self.device.type != "cuda":
            host = np.empty(shape, dtype=dtype)
            return host, torch.from_numpy(host)
        if self._ring is None:
            self._ring = PinnedRing(self.device)
        return self._ring.empty(shape, dtype)

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        return self.send(self.stage(array))

    def send(self, staged: torch.Tensor) -> torch.Tensor:
        """A staged tensor (stage(), empty()) on the device, its copy queued without waiting."""
        return staged if self.device.type != "cuda" else staged.to(self.device, non_blocking=True)

    def forward_inputs(self, inputs: StepInputs, cascade: PrefixGroups | None = None,
                       ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input ids, positions, attention metadata) on the device, for an eager forward pass;
        with `cascade`, the metadata attends those groups' prefixes once per group."""
        to_dev = self.to_device
        meta = AttentionMetadata(slot_mapping=to_dev(inputs.slots), block_tables=to_dev(inputs.block_tables),
                                 query_start_loc=to_dev(inputs.query_start_loc), seq_lens=to_dev(inputs.seq_lens),
                                 max_query_len=inputs.max_query_len)
        if cascade is not None:
            qsl = inputs.query_start_loc
            rows = int(np.diff(qsl)[cascade.members].sum())
            capacity = (cascade.num_groups, rows, inputs.num_reqs, inputs.num_tokens)
            host, staged = self.empty((CascadeMetadata.size(*capacity),), np.int32)
            CascadeMetadata.pack(cascade, qsl, host, capacity)
            meta.cascade = CascadeMetadata.view(self.send(staged), capacity)
            if inputs.max_query_len > 1:  # prompt rows: partials for the covered rows alone
                part_rows, staged = self.empty((inputs.num_tokens,), np.int32)
                meta.cascade.num_part_rows = CascadeMetadata.pack_part_rows(host[-inputs.num_tokens:], part_rows)
                meta.cascade.part_rows = self.send(staged)  # (levels: the layout's last part)
        return to_dev(inputs.token_ids), to_dev(inputs.positions), meta


def fill_placeholders(plan: StepPlan, qsl: np.ndarray, holes: np.ndarray,
                      in_flight: tuple[dict[str, int], torch.Tensor] | None, seqs: dict,
                      staging: Staging) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A PLACEHOLDER input (at `holes`) is the token its request sampled in the step before
    (planned before that step had finished). Tokens already on the host (`seqs`: request id ->
    its SeqState) go into plan.token_ids; those of the step still in flight (`in_flight`: its
    rows by request id, its device tokens) come back as (positions, device tokens) to copy on the
    device."""
    if not holes.size:
        return None
    owners = [plan.req_ids[r] for r in np.searchsorted(qsl[1:], holes, side="right")]
    dst, src = [], []
    for hole, req_id in zip(holes.tolist(), owners):
        if in_flight is not None and req_id in in_flight[0]:
            dst.append(hole)
            src.append(in_flight[0][req_id])
            plan.token_ids[hole] = 0  # overwritten on the device
        else:
            plan.token_ids[hole] = seqs[req_id].output_ids[-1]
    if not dst:
        return None
    to_dev = lambda xs: staging.to_device(np.array(xs, dtype=np.int64))  # noqa: E731
    return to_dev(dst), in_flight[1][to_dev(src)]
