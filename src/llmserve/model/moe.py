"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE (with its gated shared expert) and Mixtral.

Their attention is the Llama family's (model/llama.py); the feed-forward block of their sparse
layers routes each token to its top-k of E experts. A layer's experts are stacked, as the fused
kernel (kernels/moe.py) reads them:

    w13  [E, 2I, H]   expert e's gate rows, then its up rows   (checkpoint: experts.e.gate_proj / up_proj,
    w2   [E, H, I]    expert e's down rows                      Mixtral's w1 / w3 / w2)

Checkpoints store one tensor per expert and projection; each is copied (or quantized) into its
slice as it is read, so the experts never exist twice. Where the quantization method quantizes,
w13 and w2 hold its INT8/FP8 rows with float32 per-row scales beside them.

Under tensor parallelism every rank holds every expert, each cut like a dense MLP: I/P of its gate
and up rows and the matching I/P columns of down, so a layer's output is one all-reduce of the
ranks' partial sums. (Expert parallelism, whole experts per rank, would cut the same tensors along
E instead.)
"""

from __future__ import annotations

import os
import re

import torch
from torch import nn

from llmserve.attention import AttentionBackend
from llmserve.distributed.parallel_state import all_reduce, tp
from llmserve.model.layers import Linear
from llmserve.model.llama import MLP, LlamaForCausalLM
from llmserve.model.spec import ModelSpec
from llmserve.quantization import QuantizationMethod, Unquantized, copy_checked, empty_param

# layers.{layer}.mlp.experts.{expert}.{projection}.weight, Mixtral's names made Qwen's first
_EXPERT = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# Benchmarks on random weights: their routers send most tokens of a step to a few experts, which a
# trained (load-balanced) model does not, so a step reads fewer experts than it would. With
# LLMSERVE_MOE_ROUTING=uniform every token's router logits are drawn at random instead (vLLM's
# VLLM_MOE_ROUTING_SIMULATION_STRATEGY does the same): each expert gets an equal share on average.
ROUTING_ENV = "LLMSERVE_MOE_ROUTING"
ROUTINGS = ("model", "uniform")
_MIXTRAL_NAMES = {".block_sparse_moe.": ".mlp.", ".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


class FusedExperts(nn.Module):
    """A layer's E experts, stacked: w13 [E, 2I, H] and w2 [E, H, I] (with scale13 [E, 2I] and
    scale2 [E, H] when quantized)."""

    def __init__(self, num_experts: int, hidden: int, inter: int, quant: QuantizationMethod) -> None:
        super().__init__()
        storage = quant.expert_weights()
        dtype, self.quantize = storage if storage is not None else (None, None)
        self.tp = tp()
        self.num_experts, self.full_inter = num_experts, inter
        self.inter = inter = self.tp.split(inter, "moe_intermediate_size")  # this rank's rows of each expert
        self.dtype = torch.get_default_dtype()  # the model dtype: a full-precision checkpoint's
        self.w13 = empty_param(num_experts, 2 * inter, hidden, dtype=dtype)
        self.w2 = empty_param(num_experts, hidden, inter, dtype=dtype)
        quantized = self.quantize is not None
        self.scale13 = empty_param(num_experts, 2 * inter, dtype=torch.float32) if quantized else None
        self.scale2 = empty_param(num_experts, hidden, dtype=torch.float32) if quantized else None

    def _rows(self, expert: int, projection: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        i = self.inter
        if projection == "down_proj":
            return self.w2[expert], None if self.scale2 is None else self.scale2[expert]
        rows = slice(0, i) if projection == "gate_proj" else slice(i, 2 * i)
        return self.w13[expert, rows], None if self.scale13 is None else self.scale13[expert, rows]

    def load(self, expert: int, projection: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor: `projection` (gate_proj, up_proj or down_proj) of `expert`."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}, but the config says num_experts={self.num_experts}")
        rows, scale = self._rows(expert, projection)
        what = f"experts.{expert}.{projection}.weight"
        dim = 1 if projection == "down_proj" else 0  # (down: [H, I]; gate, up: [I, H])
        if self.tp.size > 1 and tensor.shape[dim] == self.full_inter:
            tensor = tensor.narrow(dim, self.tp.rank * self.inter, self.inter)
        if self.quantize is None:
            copy_checked(rows, tensor, what)
            return
        if rows.shape != tensor.shape:
            raise ValueError(f"shape mismatch loading {what}: checkpoint {tuple(tensor.shape)}, model {tuple(rows.shape)}")
        q, s = self.quantize(tensor.to(rows.device))
        rows.copy_(q)
        scale.copy_(s)

    def fill_dummy(self, generator: torch.Generator, std: float) -> None:
        """Random full-precision experts, one projection at a time, loaded through the method."""
        for expert in range(self.num_experts):
            for projection in ("gate_proj", "up_proj", "down_proj"):
                w = torch.empty(self._rows(expert, projection)[0].shape, dtype=self.dtype, device=self.w13.device)
                self.load(expert, projection, w.normal_(0.0, std, generator=generator))


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the shared expert: x [T, H] -> [T, H]."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, quant: QuantizationMethod) -> None:
        super().__init__()
        moe = spec.moe
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.backend = backend
        self.gate = Linear(spec.hidden_size, moe.num_experts, quant=Unquantized())  # the router stays full precision
        self.experts = FusedExperts(moe.num_experts, spec.hidden_size, moe.intermediate_size, quant)
        shared = moe.shared_intermediate_size
        self.shared_expert = MLP(spec, backend, quant, shared) if shared else None
        self.shared_expert_gate = Linear(spec.hidden_size, 1, quant=Unquantized()) if shared else None
        routing = os.environ.get(ROUTING_ENV, "model")
        if routing not in ROUTINGS:
            raise ValueError(f"{ROUTING_ENV} must be one of {', '.join(ROUTINGS)}, got {routing!r}")
        self.uniform_routing = routing == "uniform"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.experts
        logits = self.gate(x)
        if self.uniform_routing:
            logits = torch.rand_like(logits)
        out = all_reduce(self.backend.fused_moe(x, logits, self.top_k, self.renormalize, e.w13, e.w2, e.scale13,
                                                e.scale2), e.tp)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeForCausalLM(LlamaForCausalLM):
    """The Llama-family decoder with SparseMoeBlock where spec.moe.sparse_layers says."""

    def __init__(self, spec: ModelSpec, backend: AttentionBackend, max_positions: int,
                 quant: QuantizationMethod) -> None:
        self.mixtral = spec.architecture == "MixtralForCausalLM"
        super().__init__(spec, backend, max_positions, quant)

    def make_mlp(self, layer: int, backend: AttentionBackend, quant: QuantizationMethod) -> nn.Module:
        if self.spec.moe.sparse_layers[layer]:
            return SparseMoeBlock(self.spec, backend, quant)
        return super().make_mlp(layer, backend, quant)

    def load_weight(self, name: str, tensor: torch.Tensor) -> bool:
        if self.mixtral:
            for theirs, ours in _MIXTRAL_NAMES.items():
                name = name.replace(theirs, ours)
        if (m := _EXPERT.search(name)) is not None:
            block = self.layers[int(m[1])].mlp
            if not isinstance(block, SparseMoeBlock):
                return False
            block.experts.load(int(m[2]), m[3], tensor)
            return True
        return super().load_weight(name, tensor)

    def checkpoint_names(self) -> list[str]:
        names = super().checkpoint_names()
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                names += [f"layers.{i}.mlp.experts.{e}.{p}.weight" for e in range(layer.mlp.experts.num_experts)
                          for p in ("gate_proj", "up_proj", "down_proj")]
        if self.mixtral:
            for theirs, ours in _MIXTRAL_NAMES.items():
                names = [n.replace(ours, theirs) for n in names]
        return names
