"""Building blocks of the decoder: linear layers with shard-aware loading (whole, or split across
tensor-parallel ranks: distributed/parallel_state.py), embeddings, RMSNorm, rotary embedding.

Parameters are created uninitialised on the target device, in the default dtype the loader sets:
the loader fills them in place from the checkpoint (or with random values for dummy weights), so
weights exist once. A parallel layer cuts its rank's slice out of each checkpoint tensor before its
quantization method sees it, so methods never know about ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.attention import AttentionBackend, KVCache
from llmserve.distributed.parallel_state import (TensorParallel, all_gather_columns, all_reduce, all_reduce_rms_norm,
                                                 tp)
from llmserve.quantization import QuantizationMethod, Unquantized, copy_checked, empty_param, shard_rows


class Linear(nn.Module):
    """y = x W^T (+ b). A merged layer lists its shards' output sizes; the loader fills each slice.

    `shard_sizes` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its number of output rows, in
    order. How the weight is stored, loaded and multiplied is the quantization method's business
    (quantization.py); the bias, when there is one, stays in the model dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shard_sizes: dict[object, int] | None = None, quant: QuantizationMethod | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.dtype = torch.get_default_dtype()
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard, size in (shard_sizes or {}).items():
            self.shard_offsets[shard] = (offset, size)
            offset += size
        assert not shard_sizes or offset == out_features
        self.quant = quant or Unquantized()
        self.quant.create_weights(self)
        self.bias = empty_param(out_features) if bias else None

    def load(self, leaf: str, tensor: torch.Tensor, shard: object = None) -> bool:
        """Copy a checkpoint tensor (weight, bias, or a quantization method's own tensors) into this
        layer, into `shard`'s rows if merged; False if nothing here uses `leaf`."""
        tensor = self.rank_slice(leaf, tensor, shard)
        if leaf == "bias" and self.bias is not None:
            copy_checked(shard_rows(self, self.bias, shard), tensor, f"bias{'' if shard is None else f'[{shard}]'}")
            return True
        return self.quant.load(self, leaf, tensor, shard)

    def fill_dummy(self, generator: torch.Generator, std: float) -> None:
        """Random weights as a full-precision checkpoint would hold them, loaded through the method."""
        w = torch.empty(self.out_features, self.in_features, dtype=self.dtype, device=next(self.parameters()).device)
        self.quant.load(self, "weight", w.normal_(0.0, std, generator=generator))
        if self.bias is not None:
            self.bias.zero_()

    def rank_slice(self, leaf: str, tensor: torch.Tensor, shard: object) -> torch.Tensor:
        """This rank's part of a checkpoint tensor: all of it, as every rank holds the whole layer."""
        return tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant.apply(self, x)


class ColumnParallelLinear(Linear):
    """Output rows split across the tensor-parallel ranks. Each shard (q, k, v; gate, up; or the
    whole layer) is cut into `parts` equal row slices of which this rank holds slice `index`:
    `splits` maps a shard to (parts, index), by default (ranks, rank). Rank-local rows keep the
    shards' order, so a merged layer's local weight is [q_r; k_r; v_r] or [gate_r; up_r]."""

    def __init__(self, in_features: int, shard_sizes: dict[object, int], bias: bool = False,
                 quant: QuantizationMethod | None = None, splits: dict[object, tuple[int, int]] | None = None) -> None:
        self.tp = tp()
        self.full_sizes = dict(shard_sizes)
        self.splits = {s: (splits or {}).get(s, (self.tp.size, self.tp.rank)) for s in shard_sizes}
        local = {}
        for s, n in shard_sizes.items():
            parts = self.splits[s][0]
            if n % parts:
                raise ValueError(f"{n} output rows{'' if s is None else f' of {s!r}'} must divide evenly over {parts} "
                                 "tensor-parallel ranks")
            local[s] = n // parts
        merged = list(shard_sizes) != [None]
        super().__init__(in_features, sum(local.values()), bias, local if merged else None, quant)

    def rank_slice(self, leaf: str, tensor: torch.Tensor, shard: object) -> torch.Tensor:
        if all(parts == 1 for parts, _ in self.splits.values()) or tensor.dim() == 0:
            return tensor
        shards = [shard] if shard is not None or list(self.full_sizes) == [None] else list(self.full_sizes)
        full = sum(self.full_sizes[s] for s in shards)
        if tensor.shape[0] != full:
            if tensor.numel() == 1:  # a per-tensor value (an FP8 scale): every rank takes it
                return tensor
            raise ValueError(f"{self.quant.name!r} tensor {leaf!r} of shape {tuple(tensor.shape)} has no {full} output "
                             f"rows to split across tensor-parallel ranks")
        pieces, offset = [], 0
        for s in shards:
            parts, index = self.splits[s]
            n = self.full_sizes[s] // parts
            pieces.append(tensor.narrow(0, offset + index * n, n))
            offset += self.full_sizes[s]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


class RowParallelLinear(Linear):
    """Input columns split across the tensor-parallel ranks: each computes a partial product of
    its slice of x, and one all-reduce sums them. The bias is added once, by rank 0."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 quant: QuantizationMethod | None = None) -> None:
        self.tp = tp()
        self.full_in = in_features
        self.skip_bias = bias and self.tp.rank > 0
        self.reduce = True  # False: the partial sums go out as they are (reduce_into)
        super().__init__(self.tp.split(in_features, "input columns"), out_features, bias and not self.skip_bias,
                         None, quant)

    def load(self, leaf: str, tensor: torch.Tensor, shard: object = None) -> bool:
        if leaf == "bias" and self.skip_bias:
            return True  # rank 0 adds it
        return super().load(leaf, tensor, shard)

    def rank_slice(self, leaf: str, tensor: torch.Tensor, shard: object) -> torch.Tensor:
        if self.tp.size == 1 or tensor.dim() < 2:  # per-output-row values (scales, bias): whole on every rank
            return tensor
        if tensor.shape[-1] != self.full_in:
            raise ValueError(f"{self.quant.name!r} tensor {leaf!r} of shape {tuple(tensor.shape)} has no {self.full_in} "
                             f"input columns to split across tensor-parallel ranks")
        return tensor.narrow(-1, self.tp.rank * self.in_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.quant.apply(self, x)
        return all_reduce(y, self.tp) if self.reduce else y


class Embedding(nn.Module):
    """A [num_embeddings, dim] table (token embeddings; an untied lm_head's weight), split across
    tensor-parallel ranks by rows: rank r holds rows [r*n, (r+1)*n) for n = ceil(num / ranks), the
    last rank's tail zero-padded. A lookup takes each id's row from the rank that holds it (the
    others add zeros); `logits` multiplies by every row and gathers the ranks' columns."""

    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.tp: TensorParallel = tp()
        self.num_embeddings = num_embeddings
        self.rows = -(-num_embeddings // self.tp.size)
        self.start = self.tp.rank * self.rows
        self.weight = empty_param(self.rows, dim)

    def load(self, tensor: torch.Tensor) -> None:
        if tensor.shape != (self.num_embeddings, self.weight.shape[1]):
            raise ValueError(f"shape mismatch loading an embedding: checkpoint {tuple(tensor.shape)}, model "
                             f"{(self.num_embeddings, self.weight.shape[1])}")
        mine = tensor[self.start:self.start + self.rows]
        self.weight[:len(mine)].copy_(mine)
        self.weight[len(mine):].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        x = F.embedding(torch.where(mine, local, 0), self.weight) * mine[:, None].to(self.weight.dtype)
        return all_reduce(x, self.tp, opens_pass=True)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, dim] -> hidden x table^T [N, num_embeddings], on every rank."""
        out = F.linear(hidden, self.weight)
        if self.tp.size == 1:
            return out
        out = all_gather_columns(out, self.tp)
        return out if out.shape[1] == self.num_embeddings else out[:, :self.num_embeddings].contiguous()


class RMSNorm(nn.Module):
    """RMSNorm (float32 statistics, scaled in the input dtype, as transformers does), optionally
    fused with the residual add before it: forward(x, residual) -> (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float, backend: AttentionBackend) -> None:
        super().__init__()
        self.weight = empty_param(dim)
        self.eps = eps
        self.backend = backend
        self.reduce_group: TensorParallel | None = None  # sum x over these ranks first (reduce_into)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.reduce_group is not None:
            return all_reduce_rms_norm(x, residual, self.weight, self.eps, self.backend.rms_norm, self.reduce_group)
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


def reduce_into(pairs: list[tuple[RowParallelLinear, RMSNorm]]) -> None:
    """Each row-parallel layer's partial sums go to the norm that takes its output next, unsummed:
    the norm sums them as it normalises (parallel_state.all_reduce_rms_norm: on CUDA one kernel
    for both). Nothing changes with one rank, nor for a single pair (a pass must make none of those
    calls or at least two: parallel_state's slots)."""
    if len(pairs) < 2 or pairs[0][0].tp.size == 1:
        return
    for linear, norm in pairs:
        linear.reduce, norm.reduce_group = False, linear.tp


def _inv_freq(head_dim: int, theta: float, scaling: dict | None, max_positions: int) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling["rope_type"] == "longrope":
        # Phi-3: per-frequency factors, the long set for contexts past the pretrained one. transformers
        # switches all positions to it once a sequence passes that length; here the choice is made
        # once, by max_model_len, so a sequence's keys never mix the two.
        long = max_positions > scaling["original_max_position_embeddings"]
        return inv_freq / torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths scaled down by `factor`, short ones kept, a smooth ramp between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def _attention_factor(scaling: dict | None) -> float:
    """LongRoPE's scale of cos and sin (so of every score): the config's attention_factor, else
    sqrt(1 + ln(s) / ln(original context)) for the context's extension s (1 without one)."""
    if scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a precomputed cos/sin table per position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend
        inv_freq = _inv_freq(head_dim, theta, scaling, max_positions)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = _attention_factor(scaling)
        self.register_buffer("cos", emb.cos() * scale, persistent=False)  # float32 [max_positions, head_dim]
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                slot_mapping: torch.Tensor, q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> None:
        """Rotate q [T, Hq, D] in place and k [T, Hkv, D] by their positions [T], after normalising
        each head with q_norm / k_norm where the model has them, and store the rotated keys with
        v into the cache at slot_mapping (one fused pass on the GPU; k may be left unrotated)."""
        norm = () if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        self.backend.rotary_and_write_kv(q, k, v, positions, self.cos, self.sin, cache, slot_mapping, *norm)
