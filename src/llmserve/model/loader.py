"""Build a model on its device and fill its weights from safetensors (single file or sharded), or
with random values in the real shapes (load_format="dummy").

Tensors are read one at a time and copied into the already-allocated parameters, so the weights
never exist twice.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from llmserve.attention import AttentionBackend
from llmserve.model.layers import Embedding, Linear, RMSNorm
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.moe import FusedExperts, MoeForCausalLM
from llmserve.model.spec import ModelSpec
from llmserve.quantization import QuantizationMethod, Unquantized


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {str(model_dir)!r} (use load_format='dummy' for random weights)")
    return files


@torch.no_grad()
def load_model(model_dir: str, spec: ModelSpec, backend: AttentionBackend, *, dtype: torch.dtype,
               device: torch.device, max_positions: int, quant: QuantizationMethod | None = None,
               load_format: str = "auto", seed: int = 0,
               model_class: type | None = None) -> LlamaForCausalLM:
    """Build the model (`model_class`, a plugin's architecture, else the built-in decoder, the
    mixture-of-experts one for MoE configs) on `device` with parameters in `dtype` (a quantization
    method picks its own dtypes for the tensors it owns) and fill it from the checkpoint or with
    random values."""
    quant = quant or Unquantized()
    quant.check_device(device)
    default_dtype = torch.get_default_dtype()
    try:
        torch.set_default_dtype(dtype)
        with torch.device(device):
            builtin = MoeForCausalLM if spec.moe is not None else LlamaForCausalLM
            model = (model_class or builtin)(spec, backend, max_positions, quant)
    finally:
        torch.set_default_dtype(default_dtype)
    if load_format == "dummy":
        fill_dummy(model, seed)
    else:
        loaded: set[str] = set()
        for path in checkpoint_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if model.load_weight(name, f.get_tensor(name)):
                        loaded.add(name.removeprefix("model."))
        missing = sorted(set(model.checkpoint_names()) - loaded)
        if missing:
            raise ValueError(f"checkpoint in {model_dir!r} lacks {len(missing)} weight(s), e.g. {missing[:3]}")
    for module in model.modules():
        if isinstance(module, Linear):
            module.quant.finish_loading(module)
    return model.eval()


def fill_dummy(model: LlamaForCausalLM, seed: int, std: float = 0.02) -> None:
    """Random weights as a freshly initialised transformers model has them (normal(0, std) matrices,
    unit norm weights), module by module in a fixed order, so every quantization method sees the same
    full-precision numbers for the same seed."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for module in model.modules():
        if isinstance(module, (Linear, FusedExperts)):
            module.fill_dummy(gen, std)
        elif isinstance(module, Embedding):
            module.weight.normal_(0.0, std, generator=gen)
        elif isinstance(module, RMSNorm):
            module.weight.fill_(1.0)
