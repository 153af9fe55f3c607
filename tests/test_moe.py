"""Mixture-of-experts: the fused kernel (kernels/moe.py) against the per-expert torch reference, in
the interpreter here and on the GPU; the MoE decoders through the real loader and engine with that
kernel, quantized experts, and checkpoint errors. Token-exactness of each MoE architecture with
transformers is in test_equivalence.py (ARCHS)."""

import json

import pytest
import torch
from conftest import hf_greedy

from llmserve import LLM, SamplingParams
from llmserve.kernels.fp8 import quantize_fp8_rows
from llmserve.kernels.int8_matmul import quantize_int8_rows
from llmserve.kernels.moe import fused_moe, fused_moe_reference, route, route_reference
from llmserve.model.moe import FusedExperts, SparseMoeBlock
from llmserve.model.spec import ModelSpec
from llmserve.quantization import QuantizationMethod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (tokens, experts, top_k, hidden, inter, renormalize): a decode step (a row or two per expert, the
# smallest tiles), prefill-sized ones (the 64- and 128-row tiles), k=1, widths off the tile sizes
CASES = [(1, 8, 2, 32, 16, True), (5, 8, 2, 32, 48, False), (40, 4, 2, 64, 32, True), (3, 6, 1, 32, 16, False),
         (70, 16, 4, 32, 24, True), (150, 2, 2, 32, 16, False)]


def moe_inputs(T, E, H, I, dtype=torch.float32, device=DEVICE, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    logits = torch.randn(T, E, generator=g).to(device, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.2).to(device, dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.2).to(device, dtype)
    return x, logits, w13, w2


def quantized(w, quantize_rows):
    pairs = [quantize_rows(m) for m in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


@pytest.mark.parametrize("case", CASES)
def test_route_picks_transformers_top_k_and_counts_each_expert(case):
    T, E, k, _, _, renormalize = case
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weights, ids, counts = route(logits, k, renormalize)
    ref_weights, ref_ids = route_reference(logits, k, renormalize)
    assert torch.equal(ids.long(), ref_ids)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-6, atol=1e-7)
    assert torch.equal(counts.long(), torch.bincount(ref_ids.flatten(), minlength=E))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_fused_moe_matches_the_per_expert_reference(case, dtype):
    T, E, k, H, I, renormalize = case
    x, logits, w13, w2 = moe_inputs(T, E, H, I, dtype)
    out = fused_moe(x, logits, k, renormalize, w13, w2)
    ref = fused_moe_reference(x, logits, k, renormalize, w13, w2)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-3)
    assert out.dtype == dtype
    torch.testing.assert_close(out, ref, **tol)


@pytest.mark.parametrize("case", CASES[:3])
def test_int8_experts_are_dequantized_per_row(case):
    T, E, k, H, I, renormalize = case
    x, logits, w13, w2 = moe_inputs(T, E, H, I)
    (q13, s13), (q2, s2) = quantized(w13, quantize_int8_rows), quantized(w2, quantize_int8_rows)
    out = fused_moe(x, logits, k, renormalize, q13, q2, s13, s2)
    torch.testing.assert_close(out, fused_moe_reference(x, logits, k, renormalize, q13, q2, s13, s2),
                               rtol=1e-5, atol=1e-5)
    full = fused_moe_reference(x, logits, k, renormalize, w13, w2)
    assert (out - full).abs().max() < 0.05 * full.abs().max()  # and close to the unquantized layer


@pytest.mark.parametrize("T", [1, 3])
def test_small_steps_without_the_sort_equal_the_sorted_path(T, monkeypatch):
    import llmserve.kernels.moe as moe
    x, logits, w13, w2 = moe_inputs(T, 8, 32, 16)
    ref = fused_moe_reference(x, logits, 2, True, w13, w2)
    calls = []
    real = moe._sort_kernel
    monkeypatch.setattr(moe, "_sort_kernel", type("Spy", (), {"__getitem__": lambda self, g: (
        calls.append(g), real[g])[1]})())
    direct = fused_moe(x, logits, 2, True, w13, w2)  # 2 or 6 pairs: unsorted
    assert calls == []
    monkeypatch.setattr(moe, "DIRECT_PAIRS", 0)
    sorted_ = fused_moe(x, logits, 2, True, w13, w2)
    assert len(calls) == 1
    torch.testing.assert_close(direct, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(direct, sorted_, rtol=0, atol=0)


def test_a_row_of_nan_logits_still_routes_inside_the_experts():
    x, logits, w13, w2 = moe_inputs(3, 8, 32, 16)
    logits[1] = float("nan")  # a diverged row must not send the kernels past the last expert
    _, ids, counts = route(logits, 2, True)
    assert ids.min() >= 0 and ids.max() < 8 and counts.sum() == 6
    out = fused_moe(x, logits, 2, True, w13, w2)
    assert torch.isfinite(out[[0, 2]]).all()


def test_an_empty_step_and_an_unchosen_expert_are_fine():
    x, logits, w13, w2 = moe_inputs(0, 4, 32, 16)
    assert fused_moe(x, logits, 2, True, w13, w2).shape == (0, 32)
    x, logits, w13, w2 = moe_inputs(6, 4, 32, 16)
    logits[:, 3] = -1e4  # expert 3 chosen by nobody: its segment is empty
    _, _, counts = route(logits, 2, True)
    assert counts[3] == 0
    torch.testing.assert_close(fused_moe(x, logits, 2, True, w13, w2),
                               fused_moe_reference(x, logits, 2, True, w13, w2), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's; on a GPU the engine runs it (test_gpu.py)")
def test_the_kernel_in_the_engine_gives_transformers_tokens(checkpoint, monkeypatch):
    """The CPU backend's MoE replaced by the Triton kernel (interpreted): the same greedy tokens."""
    from llmserve.attention import AttentionBackend
    calls = []

    def kernel(self, *args):
        calls.append(args[0].shape[0])
        return fused_moe(*args)

    monkeypatch.setattr(AttentionBackend, "fused_moe", kernel)
    path = checkpoint("qwen3-moe")
    prompts = [[5, 9, 30, 41, 7, 12, 80, 3], [100, 101, 5], [60] * 20]
    expected = hf_greedy(path, prompts, 8)
    with LLM(path, dtype="float32", device="cpu", log_interval_s=0, max_num_batched_tokens=16) as llm:
        calls.clear()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=8, temperature=0),
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert 1 in calls or 2 in calls or 3 in calls  # decode steps
    assert max(calls) == 16  # chunked prefill


def experts_of(llm):
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]


@pytest.mark.parametrize("method,quantize_rows", [("int8", quantize_int8_rows), ("fp8", quantize_fp8_rows)])
def test_quantized_experts_load_each_projection_per_row(checkpoint, method, quantize_rows):
    path = checkpoint("qwen2-moe")
    ids = list(range(3, 40))
    with LLM(path, device="cpu", log_interval_s=0) as full_llm, \
            LLM(path, device="cpu", log_interval_s=0, quantization=method) as llm:
        full, quant = experts_of(full_llm), experts_of(llm)
        assert len(full) == 1  # layer 0 is dense (mlp_only_layers)
        for a, b in zip(full, quant):
            for w, q, s in ((a.w13, b.w13, b.scale13), (a.w2, b.w2, b.scale2)):
                ref_q, ref_s = quantized(w, quantize_rows)  # the stacked rows at once == projection by projection
                assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(s, ref_s)
        block = llm.engine.runner.model.layers[1].mlp
        assert isinstance(block, SparseMoeBlock) and block.gate.weight.dtype == torch.float32  # router unquantized
        cos = torch.nn.functional.cosine_similarity(llm.engine.runner.prompt_logits(ids),
                                                    full_llm.engine.runner.prompt_logits(ids), dim=-1)
    assert cos.mean() > (0.999 if method == "int8" else 0.98)


def test_dummy_experts_are_the_same_numbers_for_every_method(checkpoint):
    path = checkpoint("mixtral")
    with LLM(path, device="cpu", log_interval_s=0, load_format="dummy") as full, \
            LLM(path, device="cpu", log_interval_s=0, load_format="dummy", quantization="int8") as q:
        for a, b in zip(experts_of(full), experts_of(q)):
            assert torch.equal(b.w13, quantized(a.w13, quantize_int8_rows)[0])
        assert full.generate("Hi", SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids


def test_methods_without_expert_support_are_refused_by_name():
    class Packed(QuantizationMethod):
        name = "int4-example"

    with pytest.raises(ValueError, match="model.quantization 'int4-example' does not support mixture-of-experts"):
        FusedExperts(4, 32, 16, Packed())
    from llmserve.plugins.fp8 import CompressedTensorsFp8
    ct = CompressedTensorsFp8({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float",
                                                                  "strategy": "channel"}}}, "ignore": ["lm_head"]})
    with pytest.raises(ValueError, match="pre-quantized mixture-of-experts checkpoints are not supported"):
        FusedExperts(4, 32, 16, ct)


def test_a_checkpoint_missing_an_expert_names_it(checkpoint, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file
    src = checkpoint("qwen3-moe")
    shutil.copytree(src, tmp_path / "m")
    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 weight\(s\), e.g. \['layers.1.mlp.experts.5.up_proj.weight'\]"):
        LLM(str(tmp_path / "m"), device="cpu", log_interval_s=0)


def test_uniform_routing_for_benchmarks_spreads_tokens_over_every_expert(checkpoint, monkeypatch):
    """LLMSERVE_MOE_ROUTING=uniform (random weights' benchmarks): random router logits, so a step's
    tokens pick all experts about equally; anything but model/uniform is refused by name."""
    from llmserve.attention import AttentionBackend
    picked = []
    real = AttentionBackend.fused_moe

    def spy(self, x, logits, top_k, *args):
        picked.append(route_reference(logits, top_k, True)[1].flatten())
        return real(self, x, logits, top_k, *args)

    monkeypatch.setattr(AttentionBackend, "fused_moe", spy)
    monkeypatch.setenv("LLMSERVE_MOE_ROUTING", "uniform")
    with LLM(checkpoint("qwen3-moe"), device="cpu", log_interval_s=0) as llm:
        picked.clear()
        llm.generate({"prompt_token_ids": [7] * 200}, SamplingParams(max_tokens=1))
    counts = torch.bincount(torch.cat(picked), minlength=8)  # 200 equal tokens: model routing would pick 2 experts
    assert counts.min() > 0.5 * counts.float().mean()
    monkeypatch.setenv("LLMSERVE_MOE_ROUTING", "balanced")
    with pytest.raises(ValueError, match="LLMSERVE_MOE_ROUTING must be one of model, uniform, got 'balanced'"):
        LLM(checkpoint("qwen3-moe"), device="cpu", log_interval_s=0)


def test_moe_shapes_from_published_configs():
    """Qwen3-30B-A3B's config.json (transformers 4 keys) and a Qwen2-MoE one with dense layers."""
    qwen3 = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
             "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "shared_expert_intermediate_size": 0}
    moe = ModelSpec.from_dict(qwen3).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (128, 8, 768, True)
    assert moe.sparse_layers == (True,) * 48 and moe.shared_intermediate_size == 0
    qwen2 = {**qwen3, "architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 6, "decoder_sparse_step": 2,
             "mlp_only_layers": [3], "norm_topk_prob": False, "shared_expert_intermediate_size": 5632}
    spec = ModelSpec.from_dict(qwen2)
    assert spec.moe.sparse_layers == (False, True, False, False, False, True)
    assert spec.moe.shared_intermediate_size == 5632 and not spec.moe.renormalize and spec.attention_bias
    assert ModelSpec.from_dict({**qwen3, "architectures": ["LlamaForCausalLM"]}).moe is None
    mixtral = json.loads(json.dumps({**qwen3, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8,
                                     "num_experts_per_tok": 2, "intermediate_size": 14336}))
    moe = ModelSpec.from_dict(mixtral).moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.renormalize) == (8, 2, 14336, True)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 64, 512, 4096])
@pytest.mark.parametrize("quant", ["none", "int8", "fp8"])
def test_fused_moe_on_the_gpu_matches_the_reference_at_qwen3_30b_a3b_width(tokens, quant):
    """128 experts, 8 a token, hidden 2048, expert width 768, bf16; and captured in a CUDA graph."""
    x, logits, w13, w2 = moe_inputs(tokens, 128, 2048, 768, torch.bfloat16, "cuda")
    x, w13, w2 = x * 4, w13 / 8, w2 / 4
    scales = (None, None)
    if quant != "none":
        rows = quantize_int8_rows if quant == "int8" else quantize_fp8_rows
        (w13, s13), (w2, s2) = quantized(w13, rows), quantized(w2, rows)
        scales = (s13, s2)
    ref = fused_moe_reference(x.float(), logits, 8, True, w13, w2, *scales).to(torch.bfloat16) if quant != "none" \
        else fused_moe_reference(x.float(), logits, 8, True, w13.float(), w2.float()).to(torch.bfloat16)
    out = fused_moe(x, logits, 8, True, w13, w2, *scales)
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.05, atol=0.02 * ref.abs().max().item())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, logits, 8, True, w13, w2, *scales)
    graph.replay()
    torch.testing.assert_close(captured, out, rtol=0, atol=0)
