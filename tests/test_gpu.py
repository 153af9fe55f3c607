"""On CUDA with the Triton kernels: float32 token-exact with transformers, bf16 greedy agreement,
KV sizing from gpu_memory_utilization. Skipped without a GPU."""

import pytest
import torch
from conftest import ARCHS, hf_greedy, hold_speculation_on, record_calls
from test_equivalence import MAX_TOKENS, TEXTS, VARIANTS

from llmserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def prompts_for(path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    return [tok.encode(t) for t in TEXTS]


def run(llm, prompts, max_tokens=MAX_TOKENS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=max_tokens, temperature=0),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_cuda_float32_matches_transformers(checkpoint, arch, variant):
    path = checkpoint(arch)
    prompts = prompts_for(path)
    expected = hf_greedy(path, prompts, MAX_TOKENS, device="cuda")
    options = {"num_blocks": 4096, **VARIANTS[variant]}  # a fixed pool: sizing has its own test
    with LLM(path, dtype="float32", device="cuda", log_interval_s=0, **options) as llm:
        assert llm.engine.backend.name == "cuda"
        assert run(llm, prompts + prompts) == expected + expected  # the repeat hits the prefix cache
        assert llm.engine.kv.num_free_blocks() == llm.engine.kv.pool.num_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3-moe", "qwen2-moe",
                                  "mixtral"])
def test_cuda_bfloat16_greedy_agrees_on_short_outputs(checkpoint, arch):
    """In bf16 two implementations may split a near-tie differently, after which the texts diverge
    legitimately. So: every token we choose must be transformers' argmax at that position given our
    own prefix (teacher forcing), up to a margin of 2% of the logit range; and first tokens agree.
    Mixtures of experts: a router near-tie in bf16 (gaps of one bf16 step occur on random weights)
    flips a token's experts in transformers' bf16 run as much as in ours, so there the referee is
    transformers in bf16 or in float32 (the same weights), whichever accepts the token, and the
    first token is held to that margin only."""
    path = checkpoint(arch, dtype=torch.bfloat16)
    prompts = prompts_for(path)
    with LLM(path, dtype="bfloat16", device="cuda", num_blocks=4096, log_interval_s=0) as llm:
        got = run(llm, prompts, 8)
    assert_transformers_argmax(path, prompts, got, moe="moe" in arch or arch == "mixtral")


def assert_transformers_argmax(path, prompts, got, moe=False):
    """Every token of `got` is transformers' bf16 argmax (float32's too for a mixture of experts)
    given the tokens before it, within 2% of the logit range; first tokens equal (not for experts)."""
    from transformers import AutoModelForCausalLM
    referees = [AutoModelForCausalLM.from_pretrained(path, dtype=d).cuda().eval()
                for d in ((torch.bfloat16, torch.float32) if moe else (torch.bfloat16,))]
    if not moe:
        first = hf_greedy(path, prompts, 1, device="cuda", dtype=torch.bfloat16)
        assert [g[0] for g in got] == [f[0] for f in first]
    with torch.no_grad():
        for p, g in zip(prompts, got):
            accepted, gaps = torch.zeros(len(g), dtype=torch.bool, device="cuda"), []
            for hf in referees:
                logits = hf(torch.tensor([p + g], device="cuda")).logits[0, len(p) - 1:len(p) - 1 + len(g)].float()
                chosen = logits.gather(1, torch.tensor(g, device="cuda")[:, None])[:, 0]
                top = logits.max(-1).values
                accepted |= top - chosen <= 0.02 * (top - logits.min(-1).values)
                gaps.append((top - chosen).tolist())
            assert accepted.all(), (p, g, gaps)


def test_cuda_bfloat16_long_prompts_take_the_fused_gate_up_and_agree(checkpoint, monkeypatch):
    """A bf16 model with an MLP wide enough (intermediate 4,096: 32 tile columns) that a step of two
    1,100-token prompts takes the fused gate_up kernel on Hopper: it runs on the prompts, and every
    token chosen is transformers' argmax given our prefix, within 2% of the logit range."""
    from transformers import AutoModelForCausalLM

    import llmserve.quantization as quantization
    real, rows = quantization.gated_matmul, []
    monkeypatch.setattr(quantization, "gated_matmul", lambda x, w: rows.append(x.shape[0]) or real(x, w))
    path = checkpoint("llama", dtype=torch.bfloat16, intermediate_size=4096, max_position_embeddings=2048)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (1100,), generator=g).tolist() for _ in range(2)]
    with LLM(path, dtype="bfloat16", device="cuda", num_blocks=512, enforce_eager=True, log_interval_s=0) as llm:
        rows.clear()  # start-up's profiling step
        got = run(llm, prompts, 4)
    if torch.cuda.get_device_capability() >= (9, 0):  # both layers, every prompt token, no decode-only step
        assert min(rows) >= 1100 and sum(rows) >= 2 * 2200, rows
    else:
        assert rows == []
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():
        for p, out in zip(prompts, got):
            logits = hf(torch.tensor([p + out], device="cuda")).logits[0, len(p) - 1:len(p) - 1 + len(out)].float()
            chosen = logits.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
            top = logits.max(-1).values
            assert (top - chosen <= 0.02 * (top - logits.min(-1).values)).all(), (top - chosen).tolist()


def test_kv_cache_sized_from_gpu_memory(checkpoint):
    path = checkpoint("llama")
    with LLM(path, device="cuda", gpu_memory_utilization=0.5, log_interval_s=0) as llm:
        free, total = torch.cuda.mem_get_info()
        blocks = llm.engine.kv.pool.num_blocks
        block_bytes = llm.engine.runner.block_bytes()
        assert blocks * block_bytes > 0.3 * total  # most of the half given to the engine
        assert blocks * block_bytes < 0.5 * total
    with pytest.raises(ValueError, match="lower model.max_model_len or give the cache more memory"):
        LLM(path, device="cuda", num_blocks=4, max_model_len=256)


def test_cuda_graphs_replay_decode_steps_with_the_same_tokens(checkpoint):
    path = checkpoint("qwen3")
    prompts = prompts_for(path)
    with LLM(path, dtype="float32", device="cuda", num_blocks=2048, max_num_seqs=24, enforce_eager=True,
             log_interval_s=0) as eager:
        expected = run(eager, prompts * 4)
        assert eager.engine.runner.graphs is None
    with LLM(path, dtype="float32", device="cuda", num_blocks=2048, max_num_seqs=24, log_interval_s=0) as graphed:
        replays = record_calls(graphed.engine.runner.graphs, "_replay")
        assert run(graphed, prompts * 4) == expected  # 20 requests: padded to the captured size 24
        assert len(replays) > MAX_TOKENS // 2


def test_cuda_kernels_launched_with_pdl_give_the_same_tokens(monkeypatch):
    """Programmatic dependent launch (Hopper on) lets each Triton kernel start while the one before
    drains; every kernel waits for its predecessor before touching memory, so graphed and eager
    steps, greedy and sampled, give the same tokens as plain launches."""
    from llmserve.kernels import hardware
    prompts = ["The json module", "import os\nos.path.", "Raises ValueError if", "class Foo:\n    def"] * 5
    params = [SamplingParams(max_tokens=24, temperature=0), SamplingParams(max_tokens=24, temperature=0.8, seed=3)]
    results = []
    for enabled in (False, True):
        monkeypatch.setattr(hardware, "PDL_ENABLED", enabled)
        for eager in (True, False):
            with LLM("builtin", dtype="bfloat16", device="cuda", num_blocks=512, max_num_seqs=24, enforce_eager=eager,
                     log_interval_s=0) as llm:
                assert hardware.pdl(llm.engine.device) == (enabled and torch.cuda.get_device_capability() >= (9, 0))
                results.append([[o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
                                for p in params])
    assert results[1] == results[0] and results[3] == results[2]  # PDL changes nothing, eager or graphed
    assert len({len(t) for r in results for rows in r for t in rows}) == 1


def test_cuda_int8_kernel_matches_the_cpu_reference_through_the_engine(checkpoint):
    """The Triton W8A16 kernels (tiled and GEMV) on the GPU against the CPU's float32 reference,
    same checkpoint, same prompt (FP8 is compared per matmul in test_kernels.py: its bf16 output
    rounding makes whole-model logits of a random tiny model drift too far for a tolerance)."""
    path = checkpoint("qwen2")  # biases too
    with LLM(path, dtype="float32", device="cuda", num_blocks=256, quantization="int8", log_interval_s=0) as llm:
        gpu = [llm.engine.runner.prompt_logits(ids).cpu() for ids in (list(range(3, 60)), [7])]
    with LLM(path, dtype="float32", device="cpu", quantization="int8", log_interval_s=0) as llm:
        cpu = [llm.engine.runner.prompt_logits(ids) for ids in (list(range(3, 60)), [7])]
    for g, c in zip(gpu, cpu):
        assert torch.allclose(g, c, atol=1e-3 * c.abs().max().item()), (g - c).abs().max()


@pytest.mark.parametrize("options", [{"kv_cache_dtype": "fp8"}, {"quantization": "int8"}, {"quantization": "fp8"}])
def test_cuda_graphs_replay_quantized_decode_with_the_same_tokens(options):
    """Graph capture bakes in the FP8 cache's scale tensors and the quantized weights; replay must
    match eager decode token for token (bf16, the built-in trained model)."""
    prompts = ["The json module", "import os\nos.path.", "Raises ValueError if", "class Foo:\n    def"] * 3
    params = SamplingParams(max_tokens=32, temperature=0)
    results = []
    for eager in (True, False):
        with LLM("builtin", dtype="bfloat16", device="cuda", num_blocks=512, max_num_seqs=16, enforce_eager=eager,
                 log_interval_s=0, **options) as llm:
            replays = [] if eager else record_calls(llm.engine.runner.graphs, "_replay")
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            assert eager or replays
    assert results[0] == results[1]


def test_cuda_quantized_perplexity_within_bounds():
    from llmserve.bench.quality import perplexity
    from llmserve.engine import BUILTIN_MODEL_DIR
    text = (BUILTIN_MODEL_DIR / "heldout.txt").read_text()
    ppl = {name: perplexity("builtin", text, ctx=512, max_chunks=16, device="cuda", dtype="bfloat16", **kw)["perplexity"]
           for name, kw in [("none", {}), ("int8", {"quantization": "int8"}), ("fp8", {"quantization": "fp8"}),
                            ("fp8-kv", {"kv_cache_dtype": "fp8"})]}
    assert all(ppl[k] / ppl["none"] < 1.02 for k in ppl), ppl


def test_cuda_prequantized_checkpoint_equals_fp8_at_load(checkpoint, tmp_path):
    from test_quantization import compressed_tensors_checkpoint
    src = checkpoint("llama", dtype=torch.bfloat16)
    ct = compressed_tensors_checkpoint(src, tmp_path / "ct", "channel", device="cuda")  # as fp8 at load does
    ids = list(range(5, 40))
    with LLM(str(ct), device="cuda", num_blocks=256, log_interval_s=0) as llm:
        pre = llm.engine.runner.prompt_logits(ids)
    with LLM(src, device="cuda", num_blocks=256, quantization="fp8", log_interval_s=0) as llm:
        at_load = llm.engine.runner.prompt_logits(ids)
    assert torch.equal(pre, at_load)


def test_pinned_ring_copies_survive_wrapping_behind_a_busy_stream():
    """Arrays staged through a ring far smaller than what passes through it, while the stream is
    still busy with earlier work: a half is rewritten only after its copies ran, so every array
    arrives intact."""
    import numpy as np

    from llmserve.model.pinned import PinnedRing
    ring = PinnedRing(torch.device("cuda"), nbytes=4096)
    rng = np.random.default_rng(0)
    sent, got = [], []
    torch.cuda._sleep(50_000_000)  # ~25 ms of queued work ahead of every copy
    for i in range(300):
        dtype = [np.int64, np.int32, np.float32, np.bool_][i % 4]
        array = (rng.random(rng.integers(1, 60)) * 1000).astype(dtype)
        sent.append(array)
        got.append(ring.to_device(array))
    torch.cuda.synchronize()
    assert all(np.array_equal(a, g.cpu().numpy()) for a, g in zip(sent, got))
    assert all(g.dtype == torch.from_numpy(a).dtype for a, g in zip(sent, got))


def test_cuda_structured_outputs_validate_beside_unconstrained_requests(checkpoint):
    """Masks applied on the device, in bf16 with CUDA graphs: every constrained output validates,
    and the unconstrained requests of the same steps keep the tokens they have alone."""
    import json

    import jsonschema
    from test_structured_outputs import SCHEMAS

    from llmserve import StructuredOutputsParams

    free = [SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)]
    constrained = [SamplingParams(temperature=1.0, seed=s, max_tokens=80,
                                  structured_outputs=StructuredOutputsParams(json=schema))
                   for schema in SCHEMAS for s in range(2)]
    with LLM(checkpoint("llama"), dtype="bfloat16", device="cuda", num_blocks=4096, log_interval_s=0) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(["a b c"] * 4, free, use_tqdm=False)]
        outs = llm.generate(["a b c"] * 4 + ["d"] * len(constrained), free + constrained, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:4]] == alone
    for out, p in zip(outs[4:], constrained):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), p.structured_outputs.json)


def test_cuda_masks_from_the_grammar_process_give_the_in_process_engines_tokens(checkpoint, monkeypatch):
    """The grammar process's masks, copied to the device from its pinned shared buffers: the
    outputs (fp32, greedy and seeded) are those with every matcher in the engine's process."""
    from test_grammar_process import PROMPTS, count_process_fills, mixed_params, ready, strategy_of

    params = mixed_params()
    options = dict(dtype="float32", device="cuda", num_blocks=4096, log_interval_s=0)
    monkeypatch.setenv("LLMSERVE_GRAMMAR_PROCESS", "0")
    with LLM(checkpoint("llama"), **options) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    monkeypatch.setenv("LLMSERVE_GRAMMAR_PROCESS", "1")
    with LLM(checkpoint("llama"), **options) as llm:
        ready(llm)
        calls = count_process_fills(llm)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        buffers = [b for b in strategy_of(llm)._process._buffers if b is not None]
        assert any(calls) and buffers and all(b.pinned for b in buffers)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_cuda_speculation_gives_the_plain_engines_tokens_with_cuda_graphs(checkpoint, oracle):
    """Drafts checked in graphed mixed steps (fp32): greedy and seeded outputs are the plain
    engine's; the built-in model (bf16) keeps n-gram drafts on a text it was given twice."""
    from test_speculative import COPY_PROMPT, PROMPTS, params_of, reference_of
    from test_speculative import run as run_all

    path = checkpoint("llama")
    params = params_of("greedy") + params_of("sampled")
    prompts = PROMPTS + PROMPTS
    options = dict(dtype="float32", device="cuda", num_blocks=4096, log_interval_s=0)
    with LLM(path, **options) as llm:
        plain = run_all(llm, params, prompts)
    name = oracle(reference_of(prompts, plain))
    with LLM(path, **options, speculative_config={"method": name, "num_speculative_tokens": 4}) as llm:
        hold_speculation_on(llm)
        mixed = record_calls(llm.engine.runner.graphs, "run_mixed")
        assert run_all(llm, params, prompts) == plain
        assert llm.engine.scheduler.spec.accepted_tokens > 0 and mixed
    with LLM("builtin", device="cuda", num_blocks=4096, log_interval_s=0,
             speculative_config={"method": "ngram"}) as llm:
        hold_speculation_on(llm)
        llm.generate(COPY_PROMPT + "\n\n" + COPY_PROMPT[:300], SamplingParams(max_tokens=48, temperature=0),
                     use_tqdm=False)
        assert llm.engine.scheduler.spec.accepted_tokens > 0


def test_cuda_a_draft_model_that_is_the_model_itself_has_every_greedy_draft_kept(checkpoint):
    """The draft proposer on CUDA (its passes fed from the device): fp32 outputs are the plain
    engine's, and drafting with the model itself keeps every greedy draft."""
    from test_speculative import run as run_all

    path = checkpoint("llama")
    options = dict(dtype="float32", device="cuda", num_blocks=4096, log_interval_s=0)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(path, **options) as llm:
        plain = run_all(llm, params)
    with LLM(path, **options, speculative_config={"method": "draft", "model": path, "num_speculative_tokens": 4}) as llm:
        hold_speculation_on(llm)
        replays = record_calls(llm.engine.runner.proposer.chain, "_replay")
        assert run_all(llm, params) == plain
        spec = llm.engine.scheduler.spec
        assert spec.drafts > 0 and spec.accepted_tokens == spec.draft_tokens
        assert any(variant == "fused" for _, variant in replays)  # pass 0 and the chain: one captured graph


def test_cuda_drawn_drafts_from_the_model_itself_are_kept_through_one_replay(checkpoint):
    """Unseeded requests sampling at T 1 draw their drafts from the draft's distribution; with the
    model itself as the draft q is p, so (fp32) every drawn draft is kept, and in steady state a
    proposal is the fused draws' one captured graph."""
    from test_speculative import PROMPTS, sampled_runs

    path = checkpoint("llama")
    options = dict(dtype="float32", device="cuda", num_blocks=4096, log_interval_s=0)
    with LLM(path, **options, speculative_config={"method": "draft", "model": path, "num_speculative_tokens": 3}) as llm:
        hold_speculation_on(llm)
        replays = record_calls(llm.engine.runner.proposer.chain, "_replay")
        sampled_runs(llm, 4, PROMPTS, max_tokens=30)
        spec = llm.engine.scheduler.spec
        assert spec.drafts > 20 and spec.accepted_tokens >= 0.99 * spec.draft_tokens
        chain = llm.engine.runner.proposer.chain
        assert any(variant == "fused_draw" and (b, variant) in chain.graphs for b, variant in replays)


def test_cuda_cascade_forced_on_gives_transformers_tokens_through_its_graphs(checkpoint):
    """Prompts sharing a 42-token prefix (float32): with cascade attention forced on, the decode
    steps replay cascade graphs, and the tokens are transformers' and the plain engine's."""
    from test_cascade import PROMPTS
    path = checkpoint("qwen3")
    options = dict(dtype="float32", device="cuda", num_blocks=2048, block_size=4, max_num_seqs=8, log_interval_s=0)
    with LLM(path, cascade_attention="never", **options) as plain:
        expected = run(plain, PROMPTS * 2)
        assert plain.engine.runner.cascade_steps == 0
    assert expected[:len(PROMPTS)] == hf_greedy(path, PROMPTS, MAX_TOKENS, device="cuda")
    with LLM(path, cascade_attention="always", **options) as cascade:
        replays = record_calls(cascade.engine.runner.graphs, "_replay")
        assert run(cascade, PROMPTS * 2) == expected
        assert sum(kind == "cascade" for kind, _ in replays) >= MAX_TOKENS // 2
        assert cascade.engine.kv.num_free_blocks() == cascade.engine.kv.pool.num_blocks
