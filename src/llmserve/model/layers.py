"""Building blocks of the decoder: linear layers with shard-aware loading, RMSNorm, rotary embedding.

Parameters are created uninitialised on the target device: the loader fills them in place from
the checkpoint (or with random values for dummy weights), so weights exist once.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.attention import AttentionBackend


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b). A merged layer lists its shards' output sizes; the loader fills each slice.

    `shard_sizes` maps a shard id (e.g. "q", "k", "v" or 0, 1) to its number of output rows, in
    order. The seam where quantization methods will decide how weights are created and applied.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shard_sizes: dict[object, int] | None = None) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for shard, size in (shard_sizes or {}).items():
            self.shard_offsets[shard] = (offset, size)
            offset += size
        assert not shard_sizes or offset == out_features

    def load(self, name: str, tensor: torch.Tensor, shard: object = None) -> None:
        """Copy a checkpoint tensor (weight or bias) into this layer, into `shard`'s rows if merged."""
        param = self.weight if name == "weight" else self.bias
        if shard is not None:
            start, size = self.shard_offsets[shard]
            param = param.narrow(0, start, size)
        if param.shape != tensor.shape:
            raise ValueError(f"shape mismatch loading {name}{'' if shard is None else f'[{shard}]'}: "
                             f"checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}")
        param.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int) -> None:
        super().__init__()
        self.weight = _param(num_embeddings, dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """RMSNorm (float32 statistics, scaled in the input dtype, as transformers does), optionally
    fused with the residual add before it: forward(x, residual) -> (norm(x + residual), x + residual)."""

    def __init__(self, dim: int, eps: float, backend: AttentionBackend) -> None:
        super().__init__()
        self.weight = _param(dim)
        self.eps = eps
        self.backend = backend

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self.backend.rms_norm(x, self.weight, self.eps, residual)


def _inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
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


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves) with a precomputed cos/sin table per position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.backend = backend
        inv_freq = _inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # float32 [max_positions, head_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> None:
        """Rotate q [T, Hq, D] and k [T, Hkv, D] in place by their positions [T]."""
        self.backend.rotary(q, k, positions, self.cos, self.sin)
