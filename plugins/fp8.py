"""FP8-e4m3 W8A8 with dynamic per-token activation scales.

- `fp8`: a full-precision checkpoint quantized at load, one float32 scale per output channel.
- `compressed-tensors`: an FP8 checkpoint as common quantization tools publish it: `weight`
  (float8_e4m3fn [out, in]) and `weight_scale` ([out, 1] per channel, or one per tensor) for each
  linear layer, described by config.json's `quantization_config` (quant_method
  "compressed-tensors", 8-bit float weights); selected automatically from config.json. A per-tensor
  scale becomes that shard's rows' per-channel scale, so merged q/k/v keep their own. Activations
  are always quantized per token at run time; a static `input_scale` in the checkpoint is not used.

GPU: torch._scaled_mm on FP8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell);
other GPUs are refused at start-up. CPU: a float32 emulation of the same arithmetic.
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve.hookspecs import hookimpl
from llmserve.kernels.fp8 import FP8, fp8_matmul, fp8_matmul_reference, quantize_fp8_rows
from llmserve.quantization import QuantizeAtLoad, copy_checked, shard_rows


class Fp8Dynamic(QuantizeAtLoad):
    name = "fp8"
    weight_dtype = FP8

    def check_device(self, device: torch.device) -> None:
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            raise ValueError(f"model.quantization {self.name!r} needs FP8 tensor cores (compute capability >= 8.9); "
                             f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use 'int8' instead")

    def quantize_rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_fp8_rows(w)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        matmul = fp8_matmul if x.is_cuda else fp8_matmul_reference
        return matmul(x, layer.weight, layer.weight_scale, layer.bias)


class CompressedTensorsFp8(Fp8Dynamic):
    name = "compressed-tensors"
    prequantized = True

    def __init__(self, checkpoint_config: dict[str, Any] | None = None) -> None:
        cfg = checkpoint_config or {}
        groups = cfg.get("config_groups") or {}
        if not groups:
            raise ValueError("model.quantization 'compressed-tensors' reads a pre-quantized checkpoint, but "
                             "config.json has no quantization_config.config_groups")
        for name, group in groups.items():
            w = group.get("weights") or {}
            if (w.get("num_bits"), w.get("type"), w.get("strategy")) not in ((8, "float", "channel"), (8, "float", "tensor")):
                raise ValueError(f"quantization_config.config_groups.{name}.weights: only 8-bit float weights with "
                                 f"strategy 'channel' or 'tensor' are supported, got {w}")
        if not any("lm_head" in target for target in cfg.get("ignore", [])):
            raise ValueError("quantization_config: a quantized lm_head is not supported (add it to 'ignore')")

    def checkpoint_leaves(self, layer) -> list[str]:
        return ["weight", "weight_scale"]

    def expert_weights(self):
        raise ValueError("model.quantization 'compressed-tensors': pre-quantized mixture-of-experts checkpoints "
                         "are not supported; serve the full-precision checkpoint with quantization 'fp8'")

    def load(self, layer, leaf: str, tensor: torch.Tensor, shard: object = None) -> bool:
        if leaf == "weight" and tensor.dtype == FP8:
            copy_checked(shard_rows(layer, layer.weight, shard), tensor, f"weight{'' if shard is None else f'[{shard}]'}")
            return True
        if leaf == "weight_scale":
            rows = shard_rows(layer, layer.weight_scale, shard)
            scale = tensor.float().reshape(-1)
            rows.copy_(scale.expand(rows.shape[0]) if scale.numel() == 1 else scale)
            return True
        if leaf == "input_scale":
            return True
        return super().load(layer, leaf, tensor, shard)  # full-precision weights: dummy fill


@hookimpl
def llmserve_register_quantization_methods(register) -> None:
    register("fp8", Fp8Dynamic)
    register("compressed-tensors", CompressedTensorsFp8)
