"""Greedy outputs of LLM.generate equal transformers' generate token for token (float32), for every
supported architecture, also under tiny chunk budgets, prefix-cache hits, forced preemption and n=3."""

import pytest
import torch
from conftest import ARCHS, hf_greedy, record_calls

from llmserve import LLM, SamplingParams

TEXTS = [
    "The quick brown fox",
    "A paged KV cache stores keys and values in fixed-size blocks. Continuous batching",
    "Hi",
    "The capital of France is Paris, and the capital of Japan is",
    "def hello(name):",
]
MAX_TOKENS = 24
_reference: dict[str, tuple[list[list[int]], list[list[int]]]] = {}


def reference(checkpoint, arch):
    """(prompt ids, transformers' greedy continuations), computed once per architecture."""
    if arch not in _reference:
        path = checkpoint(arch)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path)
        prompts = [tok.encode(t) for t in TEXTS]
        _reference[arch] = (prompts, hf_greedy(path, prompts, MAX_TOKENS))
    return _reference[arch]


def generate(llm, prompts, n=1):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, n=n)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_gate_up_through_the_fused_prefill_kernel_matches_transformers(checkpoint, monkeypatch):
    """kernels/matmul.py's gated_matmul (TMA loads, SiLU·mul in the epilogue: a Hopper GPU's gate_up
    for prefill-sized batches) taken at every step, here through the interpreter: the same tokens."""
    import llmserve.quantization as quantization
    real, rows = quantization.gated_matmul, []
    monkeypatch.setattr(quantization, "gated_takes", lambda x, w: True)
    monkeypatch.setattr(quantization, "gated_matmul", lambda x, w: rows.append(x.shape[0]) or real(x, w))
    prompts, expected = reference(checkpoint, "llama")
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        rows.clear()  # start-up's profiling step
        outs = generate(llm, prompts)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert max(rows) == sum(map(len, prompts))  # the prompts' step, then the decode steps


def assert_pool_back_to_total(llm):
    assert llm.engine.kv.num_free_blocks() == llm.engine.kv.pool.num_blocks


VARIANTS = {
    "default": dict(),
    "chunk7": dict(max_num_batched_tokens=7, block_size=4),
    "preempt": dict(num_blocks=24, block_size=4, max_model_len=96, reserve_growth=False),
    "sync-preempt": dict(num_blocks=24, block_size=4, max_model_len=96, async_scheduling=False, reserve_growth=False),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_matches_transformers(checkpoint, arch, variant, monkeypatch):
    from llmserve.model import runner

    prompts, expected = reference(checkpoint, arch)
    with LLM(checkpoint(arch), dtype="float32", device="cpu", log_interval_s=0, **VARIANTS[variant]) as llm:
        fills, fill = [], runner.fill_placeholders
        monkeypatch.setattr(runner, "fill_placeholders", lambda *args: fills.append(args) or fill(*args))
        outs = generate(llm, prompts)
        assert [o.outputs[0].token_ids for o in outs] == expected
        if variant.endswith("preempt") and llm.engine.kv.window:  # every layer windowed: passed blocks go back
            assert llm.engine.kv.released_blocks > 0
        elif variant.endswith("preempt"):
            assert llm.engine.scheduler.num_preemptions > 0
        # Async scheduling planned decode steps on tokens still being sampled.
        holes = sum(args[2].size for args in fills)
        assert (holes > 0) == llm.config.scheduler.async_scheduling
        assert_pool_back_to_total(llm)


@pytest.mark.parametrize("options", [dict(), dict(max_num_batched_tokens=7, block_size=4), dict(max_num_seqs=3)])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_graph_padded_steps_match_transformers(checkpoint, arch, options):
    """Every step through the CUDA graphs' padded buffers (emulated: the same buffers run eagerly),
    decode steps padded to a captured batch size and mixed steps to a captured token count, with
    padding sequences behind the batch's."""
    prompts, expected = reference(checkpoint, arch)
    with LLM(checkpoint(arch), dtype="float32", device="cpu", log_interval_s=0, **options) as llm:
        sched = llm.config.scheduler
        llm.engine.runner.capture_graphs(sched.max_num_seqs, sched.max_num_batched_tokens, emulate=True)
        replays = record_calls(llm.engine.runner.graphs, "_replay")
        outs = generate(llm, prompts)
        assert [o.outputs[0].token_ids for o in outs] == expected
        kinds = [kind for kind, _ in replays]
        assert kinds.count("mixed") > 0 and kinds.count("decode") > 0
        assert_pool_back_to_total(llm)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "mistral-window", "qwen3-moe",
                                  "qwen2-moe", "mixtral"])
def test_prefix_cache_hits_keep_outputs(checkpoint, arch):
    prompts, expected = reference(checkpoint, arch)
    shared = prompts[1][:12]
    with LLM(checkpoint(arch), dtype="float32", device="cpu", block_size=4, log_interval_s=0) as llm:
        first = generate(llm, prompts)
        # Repeated prompts (in one batch and across calls) and prompts sharing a prefix.
        again = generate(llm, prompts + prompts)
        assert [o.outputs[0].token_ids for o in first] == expected
        assert [o.outputs[0].token_ids for o in again] == expected + expected
        assert all(o.num_cached_tokens > 0 for o, p in zip(again, prompts + prompts) if len(p) > 4)
        fresh = [shared + [5, 6, 7], shared + [8]]
        hits_before = llm.engine.kv.prefix_hits
        outs = generate(llm, fresh)
        assert llm.engine.kv.prefix_hits - hits_before >= 2 * 8
        assert [o.outputs[0].token_ids for o in outs] == hf_greedy(checkpoint(arch), fresh, MAX_TOKENS)
        assert_pool_back_to_total(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3", "qwen3-moe", "mixtral"])
def test_n3_greedy_samples_share_prompt_blocks(checkpoint, arch, prefix_caching):
    prompts, expected = reference(checkpoint, arch)
    with LLM(checkpoint(arch), dtype="float32", device="cpu", block_size=4, enable_prefix_caching=prefix_caching,
             log_interval_s=0) as llm:
        shared = []
        real_process = llm.engine.kv.process

        def spy(proposal):
            plan, fb = real_process(proposal)
            shared.extend(n for r, n in fb.cached_tokens.items() if r.endswith(("#1", "#2")))
            return plan, fb

        llm.engine.kv.process = spy
        outs = generate(llm, prompts, n=3)
        for out, exp in zip(outs, expected):
            assert [c.index for c in out.outputs] == [0, 1, 2]
            assert all(c.token_ids == exp for c in out.outputs)
        # Samples 1 and 2 reuse sample 0's full prompt blocks, with or without the shared prefix cache.
        assert sum(shared) == sum(2 * ((len(p) - 1) // 4) * 4 for p in prompts)
        assert_pool_back_to_total(llm)


def test_sharded_checkpoint_and_dtype_override(checkpoint):
    path = checkpoint("llama", shard_size="40KB")
    import os
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    from transformers import AutoTokenizer
    prompts = [AutoTokenizer.from_pretrained(path).encode(t) for t in TEXTS[:3]]
    with LLM(path, dtype="float32", device="cpu", log_interval_s=0) as llm:
        assert [o.outputs[0].token_ids for o in generate(llm, prompts)] == hf_greedy(path, prompts, MAX_TOKENS)


def test_half_precision_checkpoint_loads_as_float32_on_cpu(checkpoint):
    path = checkpoint("qwen3", dtype=torch.bfloat16)
    with LLM(path, device="cpu", log_interval_s=0) as llm:
        assert llm.engine.dtype == torch.float32
        prompts = [[5, 6, 7, 8], [9, 10]]
        assert [o.outputs[0].token_ids for o in generate(llm, prompts)] == hf_greedy(path, prompts, MAX_TOKENS)


def test_prefix_caching_off_shares_nothing_across_requests(checkpoint):
    prompts, expected = reference(checkpoint, "llama")
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", block_size=4, enable_prefix_caching=False,
             log_interval_s=0) as llm:
        outs = generate(llm, prompts + prompts)
        assert [o.outputs[0].token_ids for o in outs] == expected + expected
        assert all(o.num_cached_tokens == 0 for o in outs) and llm.engine.kv.prefix_queries == 0
        assert_pool_back_to_total(llm)


# Padding rows of an emulated graph step hold whatever the uninitialised buffers held: the
# interpreter's numpy may warn as they overflow on their way through the layers (never read).
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("arch, graphs", [("llama3-rope", False), ("llama3-rope", True), ("qwen3", False),
                                          ("qwen3", True), ("mistral-window", True), ("gemma2", False),
                                          ("gemma3", True)])
def test_triton_backend_matches_transformers(checkpoint, arch, graphs):
    """The CUDA backend's Triton kernels end to end (in the interpreter without a GPU), also over
    the CUDA graphs' padded buffers (emulated) with at most 4 requests a step."""
    from llmserve.hookspecs import hookimpl
    from llmserve.plugin_manager import get_plugin_manager
    from llmserve.plugins.cuda import CUDABackend

    class TritonEverywhere:
        @hookimpl
        def llmserve_select_backend(self, device, config):
            return CUDABackend()

    prompts, expected = reference(checkpoint, arch)
    pm, plugin = get_plugin_manager(), TritonEverywhere()
    pm.register(plugin, name="triton-everywhere")
    try:
        with LLM(checkpoint(arch), dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=16,
                 max_num_seqs=4, log_interval_s=0) as llm:
            assert llm.engine.backend.name == "cuda"
            if graphs:
                llm.engine.runner.capture_graphs(4, 16, emulate=True)
                replays = record_calls(llm.engine.runner.graphs, "_replay")
            outs = generate(llm, prompts[:3], n=1)
            if graphs:
                assert any(kind == "mixed" for kind, _ in replays)
    finally:
        pm.unregister(plugin)
    assert [o.outputs[0].token_ids for o in outs] == expected[:3]


@pytest.mark.parametrize("long", [False, True])
def test_phi3_longrope_matches_transformers(checkpoint, long):
    """LongRoPE (Phi-3, pretrained on 32 positions, extended to 256): prompts past 32 positions take
    the long factors and the attention scale in transformers from their first step, as here with a
    max_model_len past 32; within 32 positions both use the short factors."""
    from llmserve.testing import PHI3_LONGROPE
    path = checkpoint("phi3", **PHI3_LONGROPE)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    if long:
        prompts = [tok.encode((t + " ") * 4) for t in (TEXTS[0], TEXTS[1], TEXTS[3])]
        assert all(len(p) > 32 for p in prompts)
        n, options = MAX_TOKENS, {}
    else:
        prompts = [p[:16] for p in (tok.encode(t) for t in TEXTS[:3])]
        n, options = 32 - max(len(p) for p in prompts), {"max_model_len": 32}
    expected = hf_greedy(path, prompts, n)
    with LLM(path, dtype="float32", device="cpu", block_size=4, log_interval_s=0, **options) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, temperature=0),
                            use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_partial_rotary_is_refused_by_name(checkpoint):
    from llmserve.model.spec import ModelSpec
    import json
    path = checkpoint("phi3")
    cfg = json.load(open(f"{path}/config.json"))
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75"):
        ModelSpec.from_dict({**cfg, "partial_rotary_factor": 0.75})


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_prompt_logits_match_transformers(checkpoint, arch):
    """Every position's logits, not only their argmax: Gemma 2's final soft-capping (monotonic,
    so invisible to greedy outputs) and its attention soft-capping, Gemma 3's scales and norms."""
    from transformers import AutoModelForCausalLM
    path = checkpoint(arch)
    prompt = reference(checkpoint, arch)[0][1]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0]
    with LLM(path, dtype="float32", device="cpu", block_size=4, log_interval_s=0) as llm:
        got = llm.engine.runner.prompt_logits(prompt)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_layer_windows_from_either_config_layout(checkpoint):
    """transformers 5 lists each layer's kind; a transformers 4 Qwen2 config says from which layer
    on the window applies; a Mistral config windows every layer."""
    import json

    from llmserve.model.spec import ModelSpec
    qwen2 = json.load(open(f"{checkpoint('qwen2-window')}/config.json"))
    assert ModelSpec.from_dict(qwen2).layer_windows == (0, 6)
    assert ModelSpec.from_dict({k: v for k, v in qwen2.items() if k != "layer_types"}).layer_windows == (0, 6)
    mistral = json.load(open(f"{checkpoint('mistral-window')}/config.json"))
    assert ModelSpec.from_dict(mistral).layer_windows == (6, 6)
    assert ModelSpec.from_dict({**mistral, "sliding_window": None}).layer_windows == (0, 0)


@pytest.mark.parametrize("arch", ["mistral-window", "mistral"])
def test_windowed_models_hold_only_their_windows_blocks(checkpoint, arch):
    """Four 40-token prompts, 60 tokens each, in a pool of 48 blocks of 4: their 100 tokens need 25
    blocks each, so without windows they cannot all run at once; with 6-key windows on every layer
    each soon holds only its window's few blocks, all four run together, nothing is preempted, and
    the tokens are transformers'."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 300, (40,), generator=g).tolist() for _ in range(4)]
    expected = hf_greedy(checkpoint(arch), prompts, 60)
    with LLM(checkpoint(arch), dtype="float32", device="cpu", log_interval_s=0, block_size=4, num_blocks=48,
             max_model_len=128) as llm:
        held, batch = [], []
        kv, real = llm.engine.kv, llm.engine.kv.process

        def process(proposal):
            plan, feedback = real(proposal)
            held.append(kv.pool.num_blocks - kv.num_free_blocks())
            batch.append(len(plan.req_ids))
            return plan, feedback

        kv.process = process
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=60, temperature=0),
                            use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected
        if arch == "mistral-window":
            assert max(batch) == 4 and llm.engine.scheduler.num_preemptions == 0 and kv.released_blocks > 0
            assert max(held[len(held) // 2:]) <= 4 * 4  # each: its window's blocks and the step's
        else:
            assert max(batch) < 4 and kv.released_blocks == 0
        assert_pool_back_to_total(llm)
