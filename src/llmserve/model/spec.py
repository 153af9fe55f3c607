"""The model shape we need, read from a checkpoint's config.json (transformers 4 and 5 layouts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from llmserve.sampling_params import MODEL_DEFAULT_FIELDS

# architecture name -> (q/k/v bias default, q/k RMSNorm)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Phi3ForCausalLM": (False, False),
    "Gemma2ForCausalLM": (False, False),
    "Gemma3ForCausalLM": (False, True),
    "Qwen2MoeForCausalLM": (True, False),
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
}
MOE_ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


@dataclass(slots=True, frozen=True)
class MoeSpec:
    """A mixture-of-experts model's feed-forward shape (model/moe.py)."""
    num_experts: int
    top_k: int
    """Experts per token."""
    intermediate_size: int
    """Each expert's gate/up width."""
    renormalize: bool
    """The top-k routing weights divided by their sum (Mixtral; Qwen's norm_topk_prob)."""
    sparse_layers: tuple[bool, ...]
    """Per layer: experts (True) or a dense MLP of the model's intermediate_size (False)."""
    shared_intermediate_size: int = 0
    """Qwen2-MoE: a shared expert of this width, its output scaled by a sigmoid gate, added to every
    token's (0: none)."""

    @classmethod
    def from_dict(cls, arch: str, cfg: dict[str, Any]) -> MoeSpec:
        layers = cfg["num_hidden_layers"]
        if arch == "MixtralForCausalLM":
            return cls(num_experts=cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                       intermediate_size=cfg["intermediate_size"], renormalize=True, sparse_layers=(True,) * layers)
        # Qwen: experts in every decoder_sparse_step-th layer but those listed dense
        dense, step = set(cfg.get("mlp_only_layers") or ()), cfg.get("decoder_sparse_step") or 1
        shared = (cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
        return cls(num_experts=cfg.get("num_experts") or cfg["num_local_experts"], top_k=cfg["num_experts_per_tok"],
                   intermediate_size=cfg["moe_intermediate_size"], renormalize=bool(cfg.get("norm_topk_prob", False)),
                   sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(layers)),
                   shared_intermediate_size=shared)


@dataclass(slots=True, frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    quantization_config: dict[str, Any] | None = None
    """config.json's `quantization_config` (a pre-quantized checkpoint), or None."""
    layer_windows: tuple[int, ...] = ()
    """Per layer, its sliding window (each query sees that many latest keys) or 0 (all keys)."""
    local_rope_theta: float | None = None
    """The rotary base of the sliding-window layers where it differs (Gemma 3), else None."""
    hidden_act: str = "silu"
    """The MLP's gate activation: silu, or gelu_pytorch_tanh (GeGLU)."""
    attention_scale: float | None = None
    """Scores' scale where not head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)."""
    embed_scale: float = 1.0
    """Embeddings multiplied by it (Gemma: sqrt(hidden_size), in the model dtype)."""
    norm_offset: float = 0.0
    """RMSNorm multiplies by offset + weight (Gemma: 1 + weight)."""
    sandwich_norms: bool = False
    """Norms after attention and after the MLP too, before each joins the residual (Gemma)."""
    attn_softcap: float | None = None
    """Scaled attention scores become cap * tanh(score / cap) (Gemma 2), or None."""
    final_softcap: float | None = None
    """Logits become cap * tanh(logit / cap) (Gemma 2), or None."""
    moe: MoeSpec | None = None
    """The experts of a mixture-of-experts model, or None."""

    @property
    def windowed(self) -> bool:
        return any(self.layer_windows)

    @property
    def kv_window(self) -> int:
        """The keys any layer still reads behind a query: the largest window when every layer has
        one (older KV blocks can go back to the pool), else 0 (some layer reads them all)."""
        w = self.layer_windows
        return max(w) if w and all(w) else 0

    @property
    def cascade_exact(self) -> bool:
        """Cascade attention computes this model's attention: no layer cuts a shared prefix per
        row (a window) or bends its scores (soft-capping)."""
        return not self.windowed and self.attn_softcap is None

    @classmethod
    def from_dir(cls, path: str | Path, models: dict[str, Any] | None = None) -> ModelSpec:
        """config.json's shape; the end-of-sequence ids of config.json and of generation_config.json
        (which transformers' generate stops on: instruct checkpoints often list their turn-end token
        there alone). models: architectures plugins add (name -> model class)."""
        config_file = Path(path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in model directory {str(path)!r}")
        spec = cls.from_dict(json.loads(config_file.read_text()), models)
        eos = generation_config(path).get("eos_token_id")
        more = [eos] if isinstance(eos, int) else list(eos or [])
        return replace(spec, eos_token_ids=tuple(dict.fromkeys([*spec.eos_token_ids, *more])))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], models: dict[str, Any] | None = None) -> ModelSpec:
        """The shape of a config.json of a built-in architecture, or of one in `models` (a plugin's:
        its spec_from_config if it has one, else read as a Llama config), named by the config's
        architecture either way (the engine finds the model class by it)."""
        models = models or {}
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES or a in models), None)
        if arch is None:
            raise ValueError(f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                             f"supported: {sorted(SUPPORTED_ARCHITECTURES) + sorted(models)}")
        if arch not in SUPPORTED_ARCHITECTURES and hasattr(models[arch], "spec_from_config"):
            return replace(models[arch].spec_from_config(cfg), architecture=arch)
        bias_default, qk_norm = SUPPORTED_ARCHITECTURES.get(arch, (False, False))
        num_heads = cfg["num_attention_heads"]
        gemma = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}; supported: {', '.join(ACTIVATIONS)}")
        # transformers 5 folds rope_theta and rope_scaling into rope_parameters, per layer kind
        # where they differ (Gemma 3: full_attention / sliding_attention).
        params = dict(cfg.get("rope_parameters") or {})
        local_theta = cfg.get("rope_local_base_freq")
        if "full_attention" in params:
            local_theta = params.get("sliding_attention", {}).get("rope_theta", local_theta)
            params = dict(params["full_attention"])
        rope = dict(params or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        rope_type = "longrope" if rope_type == "su" else rope_type  # (Phi-3's first name for it)
        if rope_type not in ("default", "llama3", "linear", "longrope"):
            raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, llama3, linear, longrope")
        partials = (rope.pop("partial_rotary_factor", None), cfg.get("partial_rotary_factor"))  # (5 / 4 layouts)
        partial = next((float(p) for p in partials if p is not None and float(p) != 1.0), 1.0)
        if partial != 1.0:
            raise ValueError(f"unsupported partial_rotary_factor {partial} (rotary over part of each head); "
                             "supported: 1.0")
        rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
        if rope_type == "longrope":  # its factors and attention scale depend on the pretrained context
            rope_scaling.setdefault("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
            rope_scaling["max_position_embeddings"] = cfg.get("max_position_embeddings", 4096)
        use_window = cfg.get("use_sliding_window", True)
        window = cfg.get("sliding_window") if use_window else None
        # transformers 5 names each layer's kind; a transformers 4 Qwen2 config windows the layers from
        # max_window_layers on; Mistral windows them all
        first = cfg.get("max_window_layers", 0)
        kinds = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                           for i in range(cfg["num_hidden_layers"])]
        layer_windows = tuple(window if window and kind == "sliding_attention" else 0 for kind in kinds)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        dtype_name = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("qkv_bias", bias_default)),  # (Qwen2-MoE: qkv_bias)
            qk_norm=qk_norm,
            torch_dtype=getattr(torch, dtype_name) if isinstance(dtype_name, str) else torch.float32,
            eos_token_ids=eos_ids,
            quantization_config=cfg.get("quantization_config"),
            layer_windows=layer_windows,
            local_rope_theta=float(local_theta) if local_theta is not None and float(local_theta) != rope_theta else None,
            hidden_act=act,
            attention_scale=cfg["query_pre_attn_scalar"] ** -0.5 if cfg.get("query_pre_attn_scalar") else None,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            norm_offset=1.0 if gemma else 0.0,
            sandwich_norms=gemma,
            attn_softcap=cfg.get("attn_logit_softcapping"),
            final_softcap=cfg.get("final_logit_softcapping"),
            moe=MoeSpec.from_dict(arch, cfg) if arch in MOE_ARCHITECTURES else None,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V of one token over all layers; an FP8 cache adds a float32 scale per token and head."""
        per_head = self.head_dim * dtype.itemsize + (4 if dtype.itemsize == 1 else 0)
        return 2 * self.num_layers * self.num_kv_heads * per_head


def generation_config(path: str | Path) -> dict[str, Any]:
    """The checkpoint's generation_config.json ({} without one)."""
    file = Path(path) / "generation_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def sampling_defaults(path: str | Path) -> dict[str, float | int]:
    """The sampling values the checkpoint's generation_config.json sets, of MODEL_DEFAULT_FIELDS (its
    do_sample and the rest are not read): what transformers' generate samples with and vLLM takes
    for requests that leave them unset."""
    cfg = generation_config(path)
    values = {key: cfg[key] for key in MODEL_DEFAULT_FIELDS if cfg.get(key) is not None}
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{key} must be a number, got {value!r}")
    return values
