"""Llama-family decoder (Llama incl. Llama-3 rope scaling, Mistral, Qwen2 with q/k/v bias, Qwen3 with
q/k RMSNorm, Phi-3/Phi-4 with fused qkv and gate_up in the checkpoint and LongRoPE; sliding-window
layers where the config has them; Gemma 3 with GeGLU, sandwich norms, scaled embeddings and a local
rotary base for its sliding layers) over the paged KV cache. Numerics follow transformers' implementations.

Input is the step's flattened batch: input_ids and positions [T]; attention state in AttentionMetadata.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.attention import AttentionBackend, AttentionMetadata, KVCache
from llmserve.distributed.parallel_state import tp
from llmserve.model.layers import (ColumnParallelLinear, Embedding, Linear, RMSNorm, RotaryEmbedding, RowParallelLinear,
                                   reduce_into)
from llmserve.model.spec import ModelSpec
from llmserve.quantization import QuantizationMethod


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant: QuantizationMethod, window: int = 0) -> None:
        super().__init__()
        self.window = window or None  # sliding-window attention: the latest `window` keys only
        # this rank's heads (all of them with one rank): parallel_state.py's split
        group, self.head_dim = tp(), spec.head_dim
        self.num_heads = group.split(spec.num_heads, "num_attention_heads")
        kv_split = group.kv_split(spec.num_kv_heads)
        self.num_kv_heads = group.kv_heads(spec.num_kv_heads)
        q_size, kv_size = spec.num_heads * self.head_dim, spec.num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, {"q": q_size, "k": kv_size, "v": kv_size},
                                             bias=spec.attention_bias, quant=quant,
                                             splits={"k": kv_split, "v": kv_split})
        self.o_proj = RowParallelLinear(q_size, spec.hidden_size, quant=quant)
        self.q_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, backend) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, spec.rms_norm_eps, backend) if spec.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.scale = spec.attention_scale or self.head_dim ** -0.5
        self.softcap = spec.attn_softcap
        self.kv_cache: KVCache | None = None  # set by the runner

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], -1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        self.rotary(positions, q, k, v, self.kv_cache, meta.slot_mapping, self.q_norm, self.k_norm)
        out = self.backend.attention(q, self.kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        return self.o_proj(out.view(T, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, backend: AttentionBackend, quant: QuantizationMethod,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or spec.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(spec.hidden_size, {0: inter, 1: inter}, quant=quant)
        self.down_proj = RowParallelLinear(inter, spec.hidden_size, quant=quant)
        self.backend = backend
        self.gelu = spec.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if self.gelu:  # (a method's fused gated matmul computes SiLU)
            return self.down_proj(self.backend.gelu_and_mul(gate_up.quant.apply(gate_up, x)))
        return self.down_proj(gate_up.quant.apply_gated(gate_up, x, self.backend.silu_and_mul))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, rotary: RotaryEmbedding, backend: AttentionBackend,
                 quant: QuantizationMethod, window: int, mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = Attention(spec, rotary, backend, quant, window)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        if spec.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
            self.post_feedforward_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.sandwich = spec.sandwich_norms

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output (or the embeddings, with residual None); residual: the
        stream before it. Each norm adds the pending output into the residual stream as it
        normalises. Sandwich norms (Gemma) normalise the attention's and the MLP's outputs before
        they join the stream: the MLP's input norm is then the one that adds."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our merged module, shard id)
    STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
               "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, max_positions: int,
                 quant: QuantizationMethod) -> None:
        """Decoder layers' linear layers use `quant`; embeddings and lm_head stay in the model dtype."""
        super().__init__()
        self.spec = spec
        if spec.architecture == "Phi3ForCausalLM":  # its checkpoints hold qkv_proj and gate_up_proj already merged
            self.STACKED = {}
        rotary = RotaryEmbedding(spec.head_dim, max_positions, spec.rope_theta, spec.rope_scaling, backend)
        local = rotary if spec.local_rope_theta is None else \
            RotaryEmbedding(spec.head_dim, max_positions, spec.local_rope_theta, None, backend)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        windows = spec.layer_windows or (0,) * spec.num_layers
        self.layers = nn.ModuleList(DecoderLayer(spec, local if windows[i] else rotary, backend, quant, windows[i],
                                                 self.make_mlp(i, backend, quant))
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, backend)
        self.lm_head = None if spec.tie_word_embeddings else Embedding(spec.vocab_size, spec.hidden_size)
        reduce_into(self.norm_inputs())

    def norm_inputs(self) -> list[tuple[RowParallelLinear, RMSNorm]]:
        """Each row-parallel output with the norm that takes it next: o_proj's the post-attention
        norm; a dense MLP's down_proj the next layer's input norm (the final norm after the last),
        or with sandwich norms its own post-feed-forward norm. (A mixture of experts sums its own.)
        A subclass whose layers feed their norms otherwise returns its own pairs, or none."""
        pairs = []
        for i, layer in enumerate(self.layers):
            pairs.append((layer.self_attn.o_proj, layer.post_attention_layernorm))
            if type(layer.mlp) is MLP:
                after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
                pairs.append((layer.mlp.down_proj, layer.post_feedforward_layernorm if layer.sandwich else after))
        return pairs

    def make_mlp(self, layer: int, backend: AttentionBackend, quant: QuantizationMethod) -> nn.Module:
        """Layer `layer`'s feed-forward block: x [T, hidden] -> [T, hidden]."""
        return MLP(self.spec, backend, quant)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        if self.spec.embed_scale != 1.0:  # (Gemma: rounded to the model dtype first, as transformers does)
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype)
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in the model's dtype (a float32 copy of a decode
        step's logits would cost more than the lm_head itself; consumers upcast where they compute)."""
        logits = (self.lm_head or self.embed_tokens).logits(hidden)
        cap = self.spec.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def set_kv_caches(self, caches: list[KVCache | None]) -> None:
        for layer, cache in zip(self.layers, caches):
            layer.self_attn.kv_cache = cache

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        """Load one checkpoint tensor by its transformers name; False if the model has no use for it."""
        if "rotary_emb" in name or (name.startswith("lm_head") and self.lm_head is None):
            return False
        name = name.removeprefix("model.")
        parts = name.split(".")
        leaf = parts[-1]
        if parts[0] in ("embed_tokens", "lm_head"):
            getattr(self, parts[0]).load(tensor)
            return True
        if parts[0] == "norm":
            self.norm.weight.copy_(tensor + self.spec.norm_offset)
            return True
        if parts[0] != "layers":
            return False
        module = self.layers[int(parts[1])]
        for part in parts[2:-2]:
            module = getattr(module, part)
        target = parts[-2]
        if target in self.STACKED:
            merged, shard = self.STACKED[target]
            return getattr(module, merged).load(leaf, tensor, shard)
        if isinstance(sub := getattr(module, target), Linear):
            return sub.load(leaf, tensor)
        offset = self.spec.norm_offset if isinstance(sub, RMSNorm) else 0.0  # (Gemma's norms: 1 + weight)
        getattr(sub, leaf).copy_(tensor + offset if offset else tensor)
        return True

    def checkpoint_names(self) -> list[str]:
        """The transformers tensor names (without the "model." prefix) that must fill this model."""
        unstack: dict[str, list[str]] = {}
        for hf_name, (merged, _) in self.STACKED.items():
            unstack.setdefault(merged, []).append(hf_name)
        names = []
        for prefix, module in self.named_modules():
            if isinstance(module, Linear):
                leaves = module.quant.checkpoint_leaves(module) + (["bias"] if module.bias is not None else [])
            elif isinstance(module, (Embedding, RMSNorm)):
                leaves = ["weight"]
            else:
                continue
            head, _, last = prefix.rpartition(".")
            for part in unstack.get(last, [last]):
                names += [f"{head}.{part}.{leaf}".lstrip(".") for leaf in leaves]
        return names
