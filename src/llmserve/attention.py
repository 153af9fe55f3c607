"""What a hardware backend provides: the KV-cache write, paged attention, the decoder's fused
elementwise operations and fused sampling. kernels/ holds both implementations of each.

Backends are plugins (see hookspecs.py); the model calls them through this interface only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from llmserve.messages import PrefixGroups


@dataclass(slots=True)
class AttentionMetadata:
    """Device tensors describing one step's flattened batch (layout in kernels/reference.py)."""
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    seq_lens: torch.Tensor  # int32 [num_seqs]
    max_query_len: int  # 1: a decode step (every query length 1)
    seq_order: torch.Tensor | None = None  # int32 [num_seqs]: decode sequences longest first, or None
    cascade: CascadeMetadata | None = None  # shared prefixes to attend once per group, or None


@dataclass(slots=True)
class CascadeMetadata:
    """Groups of query rows that share a prefix of keys (kernels/cascade.py: the algorithm), as
    int32 device tensors: group g's rows (flattened token indices) are rows[row_start[g] :
    row_start[g + 1]], all past keys [lo[g], hi[g]) of sequence seq[g]'s block table, which their
    own tables hold too; level[g] 0 (lo = 0) or 1 (nested in a level-0 group, its keys after that
    group's). kv_start [S]: each sequence's first key of its own; levels [T]: the groups covering
    each row. Groups past the last real one have no rows (a CUDA graph's padding).

    A row's partial results (the prefix passes' and, in a decode step split over key slices, the
    suffix's) take a row of float32 slots each: a decode step gives every row its own (row t's
    are row t). A step with prompt rows, where only a few of up to max_num_batched_tokens rows
    are covered, gives them to the covered rows alone: part_rows [T] int32, the partials row of
    each covered row (covered rows in order; the others' entries are never read), num_part_rows
    of them."""
    row_start: torch.Tensor
    rows: torch.Tensor
    seq: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    level: torch.Tensor
    kv_start: torch.Tensor
    levels: torch.Tensor
    part_rows: torch.Tensor | None = None
    num_part_rows: int = 0

    @staticmethod
    def _layout(groups: int, rows: int, seqs: int, tokens: int) -> tuple[list[int], list[int]]:
        """(offsets, lengths) of the sections [row_start | rows | seq | lo | hi | level | kv_start |
        levels], each starting on 16 bytes: Triton specializes a kernel on whether each pointer it
        gets is 16-byte aligned, so sections at offsets that vary with the step's counts would
        compile a variant of the attention kernels per layout (seconds each, mid-run)."""
        lengths = [groups + 1, rows, groups, groups, groups, groups, seqs, tokens]
        offsets, o = [], 0
        for n in lengths:  # (plain ints: this runs three times a cascade step)
            offsets.append(o)
            o += -(-n // 4) * 4
        return offsets, lengths

    @staticmethod
    def size(groups: int, rows: int, seqs: int, tokens: int) -> int:
        """int32 elements of the packed layout for these capacities (levels, last, unpadded)."""
        offsets, lengths = CascadeMetadata._layout(groups, rows, seqs, tokens)
        return offsets[-1] + lengths[-1]

    @staticmethod
    def pack(groups: PrefixGroups, query_start_loc: np.ndarray, out: np.ndarray, capacity: tuple[int, int, int, int]) -> None:
        """Fill `out` (int32, size(*capacity)) with the packed layout (_layout) of `groups` (plan
        rows) over a batch with these query offsets, padded to capacity (groups, rows, seqs, tokens)."""
        n = groups.num_groups
        out[:] = 0
        row_start, rows, seq, lo, hi, level, kv_start, levels = (
            out[o:o + length] for o, length in zip(*CascadeMetadata._layout(*capacity)))
        counts = np.diff(query_start_loc)
        member_counts = counts[groups.members]  # each member's query rows, in group order
        np.cumsum(np.add.reduceat(member_counts, groups.starts[:-1]) if n else [], out=row_start[1:n + 1])
        row_start[n + 1:] = row_start[n]
        total = int(row_start[n])
        firsts = np.cumsum(member_counts) - member_counts  # each member's first slot in `rows`
        rows[:total] = np.repeat(query_start_loc[groups.members] - firsts, member_counts) + np.arange(total)
        for part, field in zip((seq, lo, hi, level), (groups.members[groups.starts[:-1]], groups.lo, groups.hi,
                                                      groups.level)):
            part[:n] = field
        member_group = np.repeat(np.arange(n), np.diff(groups.starts))
        np.maximum.at(kv_start, groups.members, groups.hi[member_group])
        covered = np.bincount(groups.members, minlength=len(counts))  # a level-1 member is in a level-0 group too
        levels[:int(query_start_loc[-1])] = np.repeat(covered, counts)

    @staticmethod
    def pack_part_rows(levels: np.ndarray, out: np.ndarray) -> int:
        """Fill `out` (int32 [T]) with part_rows for a batch whose rows are covered `levels` [T]
        times: the covered rows' partials rows in order; returns how many rows are covered."""
        np.cumsum(levels > 0, out=out)
        out -= 1
        return int(out[-1]) + 1 if len(out) else 0

    @classmethod
    def view(cls, packed: torch.Tensor, capacity: tuple[int, int, int, int]) -> CascadeMetadata:
        """The tensors of a packed layout (views into `packed`)."""
        return cls(*(packed[o:o + length] for o, length in zip(*cls._layout(*capacity))))


@dataclass(slots=True)
class KVCache:
    """One layer's paged KV cache (layout in kernels/reference.py).

    k, v: [num_blocks, block_size, num_kv_heads, head_dim] in the model dtype, or float8_e4m3fn
    with k_scale, v_scale [num_blocks, block_size, num_kv_heads] float32 (value = stored * scale).
    """
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None


class AttentionBackend:
    """Base class of hardware backends. Subclasses implement the two kernels for their device."""

    name: str = "base"
    supports_cascade: bool = False
    """attention() follows meta.cascade (shared prefixes once per group); without it, the runner
    never sets one."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor) -> None:
        """Store key/value [T, Hkv, D] into the paged cache at slot_mapping [T] (quantizing for FP8)."""
        raise NotImplementedError

    def attention(self, query: torch.Tensor, cache: KVCache, meta: AttentionMetadata, scale: float,
                  window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """Causal paged attention of query [T, Hq, D]; returns [T, Hq, D]. With meta.cascade (only
        for backends that support it), each group's shared prefix is read once for the group.
        window: a sliding-window layer's (each query sees its `window` latest keys); softcap: scaled
        scores become softcap * tanh(score / softcap) (neither comes with a cascade)."""
        raise NotImplementedError

    def cascade_pays(self, sizes: np.ndarray, lengths: np.ndarray, num_heads: int, num_kv_heads: int,
                     head_dim: int, device: torch.device, eager_ns: float = 0.0) -> bool:
        """Cascade attention's cost model: whether a step's attention is faster with it, where its
        groups have sizes [G] query rows and prefixes of lengths [G] keys (cache.cascade_attention
        = "auto" asks this every step). eager_ns: what a layer of the step loses besides, running
        eagerly instead of replaying its CUDA graph (a step with prompt rows: their graphs have no
        cascade); cascade must save more than that too."""
        return False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
        """RMSNorm of x [..., N]; with a residual, returns (norm(x + residual), x + residual)."""
        raise NotImplementedError

    def rotary(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor, q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
               eps: float = 0.0) -> None:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (rotate-halves style) by cos/sin [max_pos, D].
        With q_weight/k_weight [D] (Qwen3), RMS-normalise each head of q and k first, also in place."""
        raise NotImplementedError

    def rotary_and_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor,
                            q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                            eps: float = 0.0) -> None:
        """rotary() of q in place, then the rotated k with v stored into the cache as write_kv stores
        them; k itself may be left unrotated. Backends with a fused kernel override this composition."""
        self.rotary(q, k, positions, cos, sin, q_weight, k_weight, eps)
        self.write_kv(k, v, cache, slot_mapping)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2N] = [gate | up] -> silu(gate) * up, [T, N]."""
        raise NotImplementedError

    def gelu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """[T, 2N] = [gate | up] -> gelu_tanh(gate) * up, [T, N] (GeGLU: Gemma). This torch version
        serves every device; backends with a kernel override it."""
        gate, up = x.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate, approximate="tanh") * up

    def fused_moe(self, x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool, w13: torch.Tensor,
                  w2: torch.Tensor, scale13: torch.Tensor | None = None,
                  scale2: torch.Tensor | None = None) -> torch.Tensor:
        """A mixture-of-experts layer: x [T, H] routed by its router logits [T, E] to the top_k
        experts (softmax in float32, renormalised over the chosen if asked), each expert's
        silu(x W_gate^T) * (x W_up^T) times W_down^T weighted and summed -> [T, H]. w13 [E, 2I, H]
        holds each expert's gate rows then up rows, w2 [E, H, I]; INT8/FP8 weights come with float32
        per-row scales [E, 2I] and [E, H]. This torch version (one expert at a time) serves every
        device; backends with a kernel override it (kernels/moe.py)."""
        from llmserve.kernels.moe import fused_moe_reference
        return fused_moe_reference(x, logits, top_k, renormalize, w13, w2, scale13, scale2)

    def sample_rows(self, logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """Fused sampling: a draw from softmax(logits / T) per row at the row key's u (T == 0: plain
        argmax); see kernels/sampling.py (in torch: sampling_reference.py) for the exact function every
        backend must compute."""
        raise NotImplementedError

    def sample_filtered_rows(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                             top_p: torch.Tensor, min_p: torch.Tensor, key: torch.Tensor, rows: torch.Tensor,
                             out: torch.Tensor) -> torch.Tensor:
        """The rows `rows` (all with T > 0) drawn from softmax(logits / T) over the tokens min_p,
        top_k and top_p keep, into `out`; see kernels/sampling.py (in torch: sampling_reference.py) for
        the exact function."""
        raise NotImplementedError

    def check_drafts(self, logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, drafts: torch.Tensor,
                     q: torch.Tensor) -> torch.Tensor:
        """Speculative decoding's rejection sampler: rows of logits [R, V] each checking a draft
        [R] drawn from q [R, V] keep it with probability min(1, p / q), else draw from the residual;
        see kernels/sampling_reference.py check_drafts_reference for the exact function. This torch
        version (on the backend's sample_rows) serves every device; backends with a kernel
        override it."""
        from llmserve.kernels.sampling_reference import check_drafts_reference
        return check_drafts_reference(logits, temperature, keys, drafts, q, self.sample_rows)

    def apply_token_mask(self, logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
        """logits[rows[r], t] = -inf in place wherever bit t of packed mask row r is clear (float32
        logits; masks int32 [R, ceil(V / 32)], llmserve/decoding.py). This torch version unpacks the
        masks; backends with a kernel override it."""
        from llmserve.kernels.token_mask import apply_token_mask_reference
        apply_token_mask_reference(logits, rows, masks)

    def memory_available(self, device: torch.device) -> tuple[int, int]:
        """(free, total) bytes on the device."""
        raise NotImplementedError
