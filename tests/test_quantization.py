"""Quantization methods and the FP8 KV cache through the real loader and engine, against the
unquantized model. The bounds asserted here are the ones docs/plugins.md documents."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmserve import LLM
from llmserve.bench.quality import perplexity
from llmserve.engine import BUILTIN_MODEL_DIR
from llmserve.kernels.fp8 import FP8, quantize_fp8_rows
from llmserve.kernels.int8_matmul import quantize_int8_rows
from llmserve.model.layers import Linear

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def engine(path, **kwargs):
    return LLM(path, device="cpu", log_interval_s=0, **kwargs)


def logits_of(llm, ids):
    return llm.engine.runner.prompt_logits(ids)


def linear_layers(llm):
    return [m for m in llm.engine.runner.model.layers.modules() if isinstance(m, Linear)]


@pytest.fixture(scope="module")
def heldout_perplexity():
    text = (BUILTIN_MODEL_DIR / "heldout.txt").read_text()
    return lambda **kw: perplexity("builtin", text, ctx=256, max_chunks=6, device="cpu", **kw)["perplexity"]


def test_perplexity_of_the_trained_model_stays_within_documented_bounds(heldout_perplexity):
    base = heldout_perplexity()
    assert 5 < base < 100  # the built-in model has learned its text
    assert heldout_perplexity(quantization="int8") / base < 1.005
    assert heldout_perplexity(quantization="fp8") / base < 1.01
    assert heldout_perplexity(kv_cache_dtype="fp8") / base < 1.01


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
@pytest.mark.parametrize("method,mean_cosine,min_cosine", [("int8", 0.999, 0.998), ("fp8", 0.98, 0.95)])
def test_quantized_logits_stay_close_to_the_unquantized_model(checkpoint, arch, method, mean_cosine, min_cosine):
    """Tiny random models (hidden 64) have nearly flat logits, the hardest case for the cosine."""
    path = checkpoint(arch)
    ids = list(range(3, 40))
    with engine(path) as ref_llm:
        ref = logits_of(ref_llm, ids)
    with engine(path, quantization=method) as llm:
        out = logits_of(llm, ids)
        layers = linear_layers(llm)
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    assert cos.mean() > mean_cosine and cos.min() > min_cosine and not torch.equal(out, ref)
    assert all(layer.weight.dtype == (torch.int8 if method == "int8" else FP8) for layer in layers)
    assert all(layer.weight_scale.shape == (layer.out_features,) for layer in layers)


def test_int8_weights_take_a_quarter_of_float32_and_merged_shards_quantize_per_row(checkpoint):
    path = checkpoint("llama")
    with engine(path) as full, engine(path, quantization="int8") as q:
        full_layers, q_layers = linear_layers(full), linear_layers(q)
        for a, b in zip(full_layers, q_layers):
            w, scale = quantize_int8_rows(a.weight)  # the merged matrix at once == shard by shard at load
            assert torch.equal(b.weight, w) and torch.allclose(b.weight_scale, scale)
        full_bytes = sum(layer.quant.weight_bytes(layer) for layer in full_layers)
        q_bytes = sum(layer.quant.weight_bytes(layer) for layer in q_layers)
    assert q_bytes < 0.3 * full_bytes


def test_dummy_weights_are_the_same_numbers_for_every_method(checkpoint):
    path = checkpoint("qwen3")
    with engine(path, load_format="dummy") as full, engine(path, load_format="dummy", quantization="fp8") as q:
        for a, b in zip(linear_layers(full), linear_layers(q)):
            w, scale = quantize_fp8_rows(a.weight)
            assert torch.equal(b.weight.view(torch.uint8), w.view(torch.uint8))


def test_fp8_kv_cache_holds_about_twice_the_tokens_of_a_bf16_one(checkpoint):
    path = checkpoint("llama")
    with engine(path, dtype="bfloat16", cpu_kv_cache_gib=0.01) as a, \
            engine(path, dtype="bfloat16", cpu_kv_cache_gib=0.01, kv_cache_dtype="fp8") as b:
        head_dim = a.engine.spec.head_dim
        ratio = b.engine.runner.num_blocks / a.engine.runner.num_blocks
        cache = b.engine.runner.model.layers[0].self_attn.kv_cache
    assert ratio == pytest.approx(2 * head_dim / (head_dim + 4), rel=0.01)  # e4m3 values + a float32 scale per head
    assert cache.k.dtype == FP8 and cache.k_scale.shape == cache.k.shape[:3]


def test_fp8_kv_cache_generates_like_the_full_precision_cache_with_preemption(checkpoint):
    """Greedy tokens with an FP8 cache on the trained model: preemption and prefix-cache reuse read
    back the same quantized blocks, so a forced-preemption run equals a roomy one."""
    from llmserve import SamplingParams
    prompts = ["The json module", "import os\nos.path.", "Raises ValueError if"]
    params = SamplingParams(max_tokens=24, temperature=0)
    with engine("builtin", kv_cache_dtype="fp8") as llm:
        roomy = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with engine("builtin", kv_cache_dtype="fp8", num_blocks=6, block_size=8, max_num_seqs=3, max_model_len=48,
                reserve_growth=False) as llm:
        tight = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.scheduler.num_preemptions > 0
    with engine("builtin") as llm:
        full = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tight == roomy
    assert sum(a[:8] == b[:8] for a, b in zip(roomy, full)) >= 2  # close to bf16, not bit-identical


def compressed_tensors_checkpoint(src: str, dst: Path, strategy: str, device: str = "cpu") -> Path:
    """Re-save a checkpoint the way FP8 quantization tools publish one (compressed-tensors layout),
    quantizing on `device`."""
    dst.mkdir()
    for f in Path(src).iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    tensors = {}
    for f in sorted(Path(src).glob("*.safetensors")):
        for name, t in load_file(f).items():
            if name.endswith(".weight") and name.split(".")[-2] in LINEARS:
                if strategy == "channel":
                    q, scale = quantize_fp8_rows(t.to(device))
                    tensors[name], tensors[name + "_scale"] = q.cpu(), scale[:, None].cpu()
                else:
                    scale = t.abs().max().float() / 448.0
                    tensors[name], tensors[name + "_scale"] = (t.float() / scale).to(FP8), scale.reshape(1)
                tensors[name.removesuffix("weight") + "input_scale"] = torch.ones(1)
            else:
                tensors[name] = t
    save_file(tensors, dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                                                  "symmetric": True, "dynamic": False},
                                      "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                                            "dynamic": True}}}}
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_prequantized_fp8_checkpoint_is_detected_and_loads_exactly(checkpoint, tmp_path):
    src = checkpoint("qwen2")  # q/k/v bias too
    ct = compressed_tensors_checkpoint(src, tmp_path / "ct", "channel")
    ids = list(range(5, 30))
    with engine(str(ct)) as llm:
        assert llm.engine.quant.name == "compressed-tensors"
        prequantized = logits_of(llm, ids)
    with engine(src, quantization="fp8") as llm:  # the same weights, quantized at load
        at_load = logits_of(llm, ids)
    assert torch.equal(prequantized, at_load)


def test_prequantized_per_tensor_scales_keep_each_shard_its_own(checkpoint, tmp_path):
    src = checkpoint("llama")
    ct = compressed_tensors_checkpoint(src, tmp_path / "ct", "tensor")
    with engine(str(ct)) as llm:
        qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
        scales = {shard: qkv.weight_scale[start:start + size].unique().tolist()
                  for shard, (start, size) in qkv.shard_offsets.items()}
        expected = {shard: load_file(ct / "model.safetensors")[f"model.layers.0.self_attn.{shard}_proj.weight_scale"]
                    .tolist() for shard in "qkv"}
        out = logits_of(llm, list(range(5, 30)))
    with engine(src) as llm:
        ref = logits_of(llm, list(range(5, 30)))
    assert scales == expected and len({v[0] for v in scales.values()}) == 3
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=-1)
    assert cos.mean() > 0.98 and cos.min() > 0.95


def test_quantization_errors_name_the_field(checkpoint, tmp_path):
    src = checkpoint("llama")
    ct = compressed_tensors_checkpoint(src, tmp_path / "ct", "channel")
    with pytest.raises(ValueError, match="model.quantization 'int8' conflicts with the checkpoint, which is quantized "
                                         "with 'compressed-tensors'"):
        engine(str(ct), quantization="int8")
    config = json.loads((ct / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config_groups.group_0.weights: only 8-bit float weights"):
        engine(str(ct))
    config["quantization_config"]["quant_method"] = "gptq"
    (ct / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantization_config.quant_method 'gptq' is not available; registered "
                                         r"methods: \['compressed-tensors', 'fp8', 'int8'\]"):
        engine(str(ct))
    with pytest.raises(ValueError, match=r"cache.kv_cache_dtype must be 'auto', 'fp8' or 'fp8_e4m3', got 'int4'"):
        engine(src, kv_cache_dtype="int4")


def test_fp8_is_refused_on_gpus_without_fp8_tensor_cores(monkeypatch):
    from llmserve.plugins.fp8 import Fp8Dynamic
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    with pytest.raises(ValueError, match=r"needs FP8 tensor cores \(compute capability >= 8.9\); NVIDIA A100 is "
                                         r"8.0: use 'int8' instead"):
        Fp8Dynamic().check_device(torch.device("cuda"))
    Fp8Dynamic().check_device(torch.device("cpu"))  # emulated


def test_perplexity_is_the_exponent_of_the_mean_token_loss(checkpoint):
    """The quality benchmark's perplexity, recomputed from transformers' own loss on the same window."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = checkpoint("llama")
    text = "The quick brown fox jumps over the lazy dog. " * 4
    ours = perplexity(path, text, ctx=32, max_chunks=1, device="cpu")
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"][:33]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        loss = model(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    assert ours["tokens"] == 32 and ours["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)
