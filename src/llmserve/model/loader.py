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
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.spec import ModelSpec


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
               device: torch.device, max_positions: int, load_format: str = "auto", seed: int = 0) -> LlamaForCausalLM:
    with torch.device(device):
        model = LlamaForCausalLM(spec, backend, max_positions)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    if load_format == "dummy":
        gen = torch.Generator(device=device).manual_seed(seed)
        for p in model.parameters():
            p.uniform_(-1e-3, 1e-3, generator=gen)
        return model.eval()
    loaded: set[str] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if model.load_weight(name, f.get_tensor(name)):
                    loaded.add(name.removeprefix("model."))
    missing = sorted(set(checkpoint_names(model)) - loaded)
    if missing:
        raise ValueError(f"checkpoint in {model_dir!r} lacks {len(missing)} weight(s), e.g. {missing[:3]}")
    return model.eval()


def checkpoint_names(model: LlamaForCausalLM) -> list[str]:
    """The transformers tensor names (without the "model." prefix) that fill every parameter."""
    unstack: dict[str, list[str]] = {}
    for hf_name, (merged, _) in model.STACKED.items():
        unstack.setdefault(merged, []).append(hf_name)
    names = []
    for name, _ in model.named_parameters():
        parts = name.split(".")
        for part in unstack.get(parts[-2], [parts[-2]]) if len(parts) > 1 else [parts[-2]]:
            names.append(".".join(parts[:-2] + [part, parts[-1]]))
    return names
