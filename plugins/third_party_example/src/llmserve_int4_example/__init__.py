"""llmserve plugin: `int4-rtn`, 4-bit group-wise round-to-nearest weight-only quantization, the
decoding strategy `allowed_token_ids` (allowed_tokens.py) and the architecture
`ExampleLlamaForCausalLM` (renamed_llama.py).

Per output row and group of GROUP_SIZE input channels: scale = max|w| / 7, q = round(w / scale)
clamped to [-8, 7], stored as q + 8 in a nibble; byte k of a row holds columns 2k (low nibble) and
2k + 1 (high nibble). Layer tensors:

    qweight  uint8   [out, in / 2]
    scales   float32 [out, in / GROUP_SIZE]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmserve.hookspecs import hookimpl
from llmserve_int4_example.allowed_tokens import llmserve_register_decoding_strategies  # noqa: F401 (a hook)
from llmserve_int4_example.renamed_llama import llmserve_register_models  # noqa: F401 (a hook)
from llmserve.quantization import QuantizationMethod, empty_param, shard_rows

GROUP_SIZE = 32


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, in] -> (packed uint8 [rows, in / 2], float32 scales [rows, in / GROUP_SIZE])."""
    rows, cols = w.shape
    groups = w.float().reshape(rows, cols // GROUP_SIZE, GROUP_SIZE)
    scales = groups.abs().amax(-1).clamp_min(1e-12) / 7.0
    q = (torch.round(groups / scales[..., None]).clamp_(-8, 7) + 8).to(torch.uint8).reshape(rows, cols)
    return q[:, 0::2] | (q[:, 1::2] << 4), scales


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of quantize: [rows, in] in `dtype`."""
    q = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1).float() - 8.0
    return (q.reshape(*scales.shape, GROUP_SIZE) * scales[..., None]).reshape(q.shape).to(dtype)


class Int4RoundToNearest(QuantizationMethod):
    name = "int4-rtn"

    def __init__(self, checkpoint_config: dict | None = None) -> None:
        if checkpoint_config is not None:
            raise ValueError("int4-rtn quantizes a full-precision checkpoint; this one is already quantized")

    def create_weights(self, layer) -> None:
        if layer.in_features % GROUP_SIZE:
            raise ValueError(f"int4-rtn needs input features divisible by {GROUP_SIZE}, got {layer.in_features}")
        layer.qweight = empty_param(layer.out_features, layer.in_features // 2, dtype=torch.uint8)
        layer.scales = empty_param(layer.out_features, layer.in_features // GROUP_SIZE, dtype=torch.float32)

    def load(self, layer, leaf: str, tensor: torch.Tensor, shard: object = None) -> bool:
        if leaf != "weight":
            return False
        packed, scales = quantize(tensor.to(layer.qweight.device))
        shard_rows(layer, layer.qweight, shard).copy_(packed)
        shard_rows(layer, layer.scales, shard).copy_(scales)
        return True

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(layer.qweight, layer.scales, x.dtype), layer.bias)


@hookimpl
def llmserve_register_quantization_methods(register) -> None:
    register("int4-rtn", Int4RoundToNearest)
