"""`int8`: weight-only INT8 (W8A16). Per-output-channel symmetric INT8 weights quantized as a
full-precision checkpoint loads; activations stay in the model dtype. Weights take half the memory
of bf16, and memory-bound (small-batch) decode reads half the bytes.

GPU: the Triton W8A16 kernel (kernels/int8_matmul.py); CPU: its float32 reference.
"""

from __future__ import annotations

import torch

from llmserve.hookspecs import hookimpl
from llmserve.kernels.int8_matmul import int8_matmul, int8_matmul_reference, quantize_int8_rows
from llmserve.quantization import QuantizeAtLoad


class Int8WeightOnly(QuantizeAtLoad):
    name = "int8"
    weight_dtype = torch.int8

    def quantize_rows(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_int8_rows(w)

    def apply(self, layer, x: torch.Tensor) -> torch.Tensor:
        matmul = int8_matmul if x.is_cuda else int8_matmul_reference
        return matmul(x, layer.weight, layer.weight_scale, layer.bias)


@hookimpl
def llmserve_register_quantization_methods(register) -> None:
    register("int8", Int8WeightOnly)
