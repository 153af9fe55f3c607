"""What a quantization method provides: how a linear layer creates, loads and applies its weights.

Methods are plugins (hookspecs.llmserve_register_quantization_methods registers a factory per
name); `Linear` in model/layers.py asks its method for everything weight-related, so a layer never
knows whether it holds bf16, INT8, FP8 or packed INT4 weights. The life of a layer's weights:

    create_weights(layer)                 empty parameters on the target device (shapes, dtypes)
    load(layer, leaf, tensor, shard)      one checkpoint tensor ("weight", "weight_scale", "qweight",
                                          ...) into `shard`'s rows of a merged layer (q/k/v, gate/up)
    finish_loading(layer)                 once every tensor is in: repack, transpose, check
    apply(layer, x)                       x [T, in] -> [T, out] in x's dtype
    apply_gated(layer, x, silu_and_mul)   an MLP's gate_up layer: x -> silu(gate) * up (default:
                                          apply, then the backend's SiLU·mul)

A method instance is made per engine by its factory: `factory(checkpoint_config)` where
checkpoint_config is config.json's `quantization_config` (None for a full-precision checkpoint),
so one method can quantize at load and another read a pre-quantized checkpoint.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llmserve.kernels.matmul import dense_matmul, gated_matmul, gated_takes
from llmserve.kernels.matmul import takes as decode_matmul_takes


class Linear(Protocol):
    """What a method sees of a linear layer (model/layers.py's Linear, an nn.Module): its shape,
    its merged shards' rows and its bias; the method registers its own parameters on it."""
    in_features: int
    out_features: int
    dtype: torch.dtype
    shard_offsets: dict[object, tuple[int, int]]
    """shard id -> (first output row, rows), for a merged layer (q/k/v, gate/up)."""
    bias: torch.Tensor | None

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None: ...


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialised frozen parameter on the current default device (and dtype unless given)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def shard_rows(layer: Linear, param: torch.Tensor, shard: object) -> torch.Tensor:
    """The rows of `param` (dim 0 = output features) that belong to `shard`; all of it for None."""
    if shard is None:
        return param
    start, size = layer.shard_offsets[shard]
    return param.narrow(0, start, size)


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch loading {what}: checkpoint {tuple(src.shape)}, model {tuple(dst.shape)}")
    dst.copy_(src)


class QuantizationMethod:
    """Base class; the default implementation is the unquantized layer (weight in the model dtype)."""

    name = "none"
    #: True when the checkpoint's own quantized tensors are read (the method came from config.json).
    prequantized = False

    def check_device(self, device: torch.device) -> None:
        """Raise ValueError naming the method and the requirement if `device` cannot run it."""

    def create_weights(self, layer: Linear) -> None:
        """Register the layer's parameters; layer.in_features/out_features/shard_offsets are set."""
        layer.weight = empty_param(layer.out_features, layer.in_features)

    def checkpoint_leaves(self, layer: Linear) -> list[str]:
        """Tensor names (last part) a checkpoint must provide for this layer, bias excluded."""
        return ["weight"]

    def load(self, layer: Linear, leaf: str, tensor: torch.Tensor, shard: object = None) -> bool:
        """Copy one checkpoint tensor into the layer; False if this method has no use for `leaf`."""
        if leaf != "weight":
            return False
        copy_checked(shard_rows(layer, layer.weight, shard), tensor, f"weight{'' if shard is None else f'[{shard}]'}")
        return True

    def finish_loading(self, layer: Linear) -> None:
        """Called once after every tensor of the layer is loaded (or dummy-filled)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        """x [T, in_features] -> [T, out_features] in x.dtype, bias included."""
        return F.linear(x, layer.weight, layer.bias)

    def apply_gated(self, layer: Linear, x: torch.Tensor, silu_and_mul) -> torch.Tensor:
        """An MLP's merged gate_up layer (two equal shards, gate first): x [T, in_features] ->
        silu(x W_gate^T) * (x W_up^T) [T, out_features / 2]. `silu_and_mul` is the backend's kernel
        for [gate | up] rows; a method may fuse it into its matmul instead."""
        return silu_and_mul(self.apply(layer, x))

    def expert_weights(self) -> tuple[torch.dtype, Any] | None:
        """How a mixture-of-experts layer (model/moe.py) stores its stacked expert weights under this
        method: None keeps them in the model dtype; (dtype, quantize_rows) quantizes each expert's
        gate, up and down rows as they load, quantize_rows(w [rows, in]) -> (dtype [rows, in],
        float32 scales [rows]), which the fused-MoE kernel applies per output row. A method that
        cannot raises ValueError naming itself."""
        raise ValueError(f"model.quantization {self.name!r} does not support mixture-of-experts weights")

    def weight_bytes(self, layer: Linear) -> int:
        return sum(p.numel() * p.element_size() for p in layer.parameters())


class Unquantized(QuantizationMethod):
    """The default: weights stay in the model dtype. Decode batches on Hopper multiply with
    kernels/matmul.py (PDL-launched, SiLU·mul fused into gate_up), as do prefill-sized batches'
    gate_up projections (a TMA kernel with SiLU·mul in its epilogue); the rest with cuBLAS."""

    def __init__(self, checkpoint_config: dict[str, Any] | None = None) -> None:
        pass

    def expert_weights(self) -> None:
        return None

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if decode_matmul_takes(x, layer.weight):
            return dense_matmul(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def apply_gated(self, layer: Linear, x: torch.Tensor, silu_and_mul) -> torch.Tensor:
        if layer.bias is None and decode_matmul_takes(x, layer.weight, gated=True):
            return dense_matmul(x, layer.weight, gated=True)
        if layer.bias is None and gated_takes(x, layer.weight):
            return gated_matmul(x, layer.weight)
        return silu_and_mul(F.linear(x, layer.weight, layer.bias))


class QuantizeAtLoad(QuantizationMethod):
    """Base for methods that quantize a full-precision checkpoint as it loads, one shard at a time.

    Per-output-channel scales make this exact shard by shard: each output row's scale depends on
    that row alone, so quantizing q, k and v separately equals quantizing the merged matrix, and the
    full-precision weight never exists on the device. Subclasses implement `quantize_rows`.
    """

    weight_dtype: torch.dtype = torch.int8

    def __init__(self, checkpoint_config: dict[str, Any] | None = None) -> None:
        if checkpoint_config is not None:
            raise ValueError(f"model.quantization {self.name!r} quantizes a full-precision checkpoint at load, but "
                             f"this checkpoint is already quantized ({checkpoint_config.get('quant_method')!r})")

    def create_weights(self, layer: Linear) -> None:
        layer.weight = empty_param(layer.out_features, layer.in_features, dtype=self.weight_dtype)
        layer.weight_scale = empty_param(layer.out_features, dtype=torch.float32)

    def quantize_rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """w [rows, in] (any float dtype) -> (quantized [rows, in] of weight_dtype, float32 scales [rows])."""
        raise NotImplementedError

    def expert_weights(self) -> tuple[torch.dtype, Any]:
        return self.weight_dtype, self.quantize_rows

    def load(self, layer: Linear, leaf: str, tensor: torch.Tensor, shard: object = None) -> bool:
        if leaf != "weight":
            return False
        rows = shard_rows(layer, layer.weight, shard)
        if rows.shape != tensor.shape:
            raise ValueError(f"shape mismatch loading weight{'' if shard is None else f'[{shard}]'}: "
                             f"checkpoint {tuple(tensor.shape)}, model {tuple(rows.shape)}")
        q, scale = self.quantize_rows(tensor.to(rows.device))
        rows.copy_(q)
        shard_rows(layer, layer.weight_scale, shard).copy_(scale)
        return True
