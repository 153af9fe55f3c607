"""The engine's actors under both asyncio and trio: concurrency, bad input, aborts, no leaked blocks."""

import anyio
import pytest
import torch

from llmserve import EngineConfig, LLM, SamplingParams
from llmserve.engine import Engine

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture
def engine(checkpoint):
    config = EngineConfig.from_kwargs(model=checkpoint("llama"), dtype="float32", device="cpu", block_size=4,
                                      num_blocks=40, max_model_len=128, log_interval_s=0)
    return Engine(config)


async def collect(engine, prompt, params, **kw):
    last = None
    async for out in engine.generate(prompt, params, **kw):
        last = out
    return last


def pool_is_full(engine):
    return engine.kv.num_free_blocks() == engine.kv.pool.num_blocks


async def wait_until(cond, timeout=10.0):
    with anyio.fail_after(timeout):
        while not cond():
            await anyio.sleep(0.01)


async def test_concurrent_requests_bad_input_and_abort(engine):
    params = SamplingParams(max_tokens=12, temperature=0)
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        results = {}

        async def good(i):
            results[i] = await collect(engine, [3 + i, 4, 5, 6], params)

        async def bad(prompt, p, match):
            with pytest.raises(ValueError, match=match):
                await collect(engine, prompt, p)

        async def aborted():
            async for out in engine.generate([9, 9, 9], SamplingParams(max_tokens=100, temperature=0)):
                if len(out.outputs[0].token_ids) >= 3:
                    break  # leaving the loop aborts the request

        async with anyio.create_task_group() as inner:
            for i in range(4):
                inner.start_soon(good, i)
            inner.start_soon(bad, [], params, "prompt must not be empty")
            inner.start_soon(bad, list(range(1, 129)), params, "max_model_len is 128")
            inner.start_soon(bad, [1, 99999], params, r"prompt_token_ids must be integers in \[0, ")
            inner.start_soon(bad, [1, 2], SamplingParams(logit_bias={99999: 1.0}), "vocab size")
            inner.start_soon(aborted)
        assert sorted(results) == [0, 1, 2, 3]
        assert all(len(r.outputs[0].token_ids) == 12 and r.outputs[0].finish_reason == "length"
                   for r in results.values())
        await wait_until(lambda: pool_is_full(engine) and not engine.scheduler.has_work())
        # Still serving after all that.
        assert (await collect(engine, [7, 8], params)).finished
        engine.stop()


async def test_abort_heavy_load_leaks_no_blocks(engine):
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)

        async def client(i):
            with anyio.move_on_after(0.02 * (i % 5)):
                await collect(engine, list(range(1, 20 + i)), SamplingParams(max_tokens=60, temperature=0))

        async with anyio.create_task_group() as inner:
            for i in range(16):
                inner.start_soon(client, i)
        await wait_until(lambda: pool_is_full(engine) and not engine.scheduler.has_work())
        assert not engine.scheduler.requests
        engine.stop()


async def test_explicit_abort_ends_stream(engine):
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        outs = []

        async def consume():
            async for out in engine.generate([5, 6, 7], SamplingParams(max_tokens=1000, ignore_eos=True),
                                             request_id="victim"):
                outs.append(out)

        tg.start_soon(consume)
        await wait_until(lambda: outs and len(outs[-1].outputs[0].token_ids) >= 2)
        await engine.abort("victim")
        await wait_until(lambda: outs[-1].finished)
        assert outs[-1].outputs[0].finish_reason == "abort"
        await wait_until(lambda: pool_is_full(engine))
        engine.stop()


def test_seeded_sampling_is_reproducible_whatever_the_batch(checkpoint):
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", block_size=4, log_interval_s=0) as llm:
        p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=42)
        alone = llm.generate({"prompt_token_ids": [5, 6, 7]}, p, use_tqdm=False)[0].outputs[0].token_ids
        others = [{"prompt_token_ids": list(range(3, 3 + i))} for i in range(1, 6)]
        crowd = llm.generate(others[:2] + [{"prompt_token_ids": [5, 6, 7]}] + others[2:],
                             [SamplingParams(temperature=0.8, max_tokens=20)] * 2 + [p]
                             + [SamplingParams(temperature=1.0, max_tokens=8)] * 3, use_tqdm=False)
        assert crowd[2].outputs[0].token_ids == alone
        unseeded = [llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=1.0, max_tokens=16),
                                 use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
        assert len({tuple(u) for u in unseeded}) > 1
        # n > 1 with a seed: distinct samples, reproducible as a whole.
        n3 = lambda: [c.token_ids for c in llm.generate({"prompt_token_ids": [5, 6, 7]},  # noqa: E731
                                                        SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7),
                                                        use_tqdm=False)[0].outputs]
        first = n3()
        assert first == n3() and len({tuple(x) for x in first}) > 1


def test_prompt_logprobs_survive_preemption(checkpoint):
    """A preempted request computes its prompt again: its prompt logprobs still come once a
    position, as without preemption (they came twice, misplaced, before)."""
    path = checkpoint("llama")
    prompts = [{"prompt_token_ids": list(range(2, 2 + 10 + i))} for i in range(5)]
    params = [SamplingParams(temperature=1.0, max_tokens=40, seed=i, ignore_eos=True, prompt_logprobs=1)
              for i in range(5)]
    with LLM(path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=8, log_interval_s=0) as roomy:
        expected = roomy.generate(prompts, params, use_tqdm=False)
    with LLM(path, dtype="float32", device="cpu", block_size=4, num_blocks=20, max_model_len=64,
             max_num_batched_tokens=8, reserve_growth=False, log_interval_s=0) as tight:
        got = tight.generate(prompts, params, use_tqdm=False)
        assert tight.engine.scheduler.num_preemptions > 0
    for prompt, out, ref in zip(prompts, got, expected):
        assert len(out.prompt_logprobs) == len(prompt["prompt_token_ids"]) and out.prompt_logprobs[0] is None
        for token, entry, ref_entry in zip(prompt["prompt_token_ids"][1:], out.prompt_logprobs[1:],
                                           ref.prompt_logprobs[1:]):
            assert entry.keys() == ref_entry.keys() and token in entry
            assert entry[token].logprob == pytest.approx(ref_entry[token].logprob, abs=1e-5)


def test_seeded_sampling_survives_preemption(checkpoint):
    path = checkpoint("llama")
    prompts = [{"prompt_token_ids": list(range(2, 2 + 10 + i))} for i in range(5)]
    params = [SamplingParams(temperature=1.0, max_tokens=40, seed=i, ignore_eos=True) for i in range(5)]
    with LLM(path, dtype="float32", device="cpu", block_size=4, log_interval_s=0) as roomy:
        expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    with LLM(path, dtype="float32", device="cpu", block_size=4, num_blocks=20, max_model_len=64,
             reserve_growth=False, log_interval_s=0) as tight:
        got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
        assert tight.engine.scheduler.num_preemptions > 0
        kv = tight.engine.kv  # what the preempted requests' tokens were kept in is gone with them
        assert kv.parked == {} and kv.requests == {} and kv.num_free_blocks() == kv.pool.num_blocks
    assert got == expected
    # Admission that keeps room for the running requests' growth: the same pool, nothing preempted.
    with LLM(path, dtype="float32", device="cpu", block_size=4, num_blocks=20, max_model_len=64,
             log_interval_s=0) as reserving:
        got = [o.outputs[0].token_ids for o in reserving.generate(prompts, params, use_tqdm=False)]
        assert reserving.engine.scheduler.num_preemptions == 0
        assert reserving.engine.kv.num_free_blocks() == reserving.engine.kv.pool.num_blocks
    assert got == expected


def word_bias(tok):
    """logit_bias that confines a random model to ASCII-word tokens, so its output is valid text."""
    words = [i for i in range(len(tok)) if tok.decode([i]).strip().isalpha() and tok.decode([i]).isascii()]
    return {i: 100.0 for i in words}


def test_text_stop_strings_and_token_limits(checkpoint):
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        tok = llm.get_tokenizer()
        bias = word_bias(tok)
        SP = lambda **kw: SamplingParams(temperature=0, max_tokens=30, logit_bias=bias, **kw)  # noqa: E731
        base = llm.generate("The quick brown fox", SP(ignore_eos=True), use_tqdm=False)[0].outputs[0]
        assert base.text == tok.decode(base.token_ids, skip_special_tokens=True)
        stop = base.text[5:9]
        assert stop.strip(), "test needs a non-blank stop string"
        cut = llm.generate("The quick brown fox", SP(ignore_eos=True, stop=[stop]), use_tqdm=False)[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == base.text[:base.text.index(stop)]
        assert base.token_ids[:len(cut.token_ids)] == cut.token_ids
        kept = llm.generate("The quick brown fox", SP(ignore_eos=True, stop=stop, include_stop_str_in_output=True),
                            use_tqdm=False)
        assert kept[0].outputs[0].text == base.text[:base.text.index(stop) + len(stop)]
        # stop_token_ids and min_tokens.
        tid = base.token_ids[3]
        first = base.token_ids.index(tid)
        out = llm.generate("The quick brown fox", SP(stop_token_ids=[tid]), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base.token_ids[:first + 1] and out.stop_reason == tid
        out = llm.generate("The quick brown fox", SP(min_tokens=first + 2, stop_token_ids=[tid]),
                           use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) >= first + 2 and tid not in out.token_ids[:first + 1]


def test_logprobs_and_prompt_logprobs_match_transformers(checkpoint):
    path = checkpoint("qwen3")
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = [5, 17, 33, 2, 9, 40, 41, 42, 43]
    with LLM(path, dtype="float32", device="cpu", block_size=4, max_num_batched_tokens=4, log_interval_s=0) as llm:
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    seq = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert entry[prompt[pos]].rank == int((ref[pos - 1] > ref[pos - 1, prompt[pos]]).sum()) + 1
        assert len(entry) <= 3
    total = 0.0
    for i, entry in enumerate(out.outputs[0].logprobs):
        tok, row = out.outputs[0].token_ids[i], ref[len(prompt) - 1 + i]
        assert entry[tok].rank == 1 and abs(entry[tok].logprob - row.max().item()) < 1e-4
        assert sorted(entry) == sorted(row.topk(3).indices.tolist())
        total += entry[tok].logprob
    assert abs(out.outputs[0].cumulative_logprob - total) < 1e-6


def test_penalties_and_bias_change_greedy_output(checkpoint):
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        prompt = {"prompt_token_ids": [5, 6, 7]}
        base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
        base = base[0].outputs[0].token_ids
        biased = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, logit_bias={77: 100.0}),
                              use_tqdm=False)[0].outputs[0].token_ids
        assert biased == [77] * 5
        rep = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=2.0,
                                                  presence_penalty=2.0), use_tqdm=False)[0].outputs[0].token_ids
        assert len(set(rep)) >= len(set(base)) and rep != base


def test_generate_rejects_bad_input_and_keeps_serving(checkpoint):
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", max_model_len=64, log_interval_s=0) as llm:
        with pytest.raises(ValueError, match="max_model_len is 64"):
            llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": list(range(1, 80))}],
                         SamplingParams(max_tokens=40), use_tqdm=False)
        with pytest.raises(ValueError, match="prompt must not be empty"):
            llm.generate("", use_tqdm=False)
        with pytest.raises(ValueError, match="min_tokens is 63 but the prompt has 2 tokens .* at most 62 remain"):
            llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=None, min_tokens=63), use_tqdm=False)
        out = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        kv = llm.engine.kv
        assert kv.num_free_blocks() == kv.pool.num_blocks


def test_truncate_prompt_tokens_keeps_the_prompts_end(checkpoint):
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", max_model_len=64, log_interval_s=0) as llm:
        long = list(range(1, 100))
        cut, end = llm.generate([{"prompt_token_ids": long}, {"prompt_token_ids": long[-10:]}],
                                [SamplingParams(max_tokens=5, temperature=0, truncate_prompt_tokens=10),
                                 SamplingParams(max_tokens=5, temperature=0)], use_tqdm=False)
        assert cut.prompt_token_ids == long[-10:] and cut.outputs[0].token_ids == end.outputs[0].token_ids
        (most,) = llm.generate({"prompt_token_ids": long}, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1),
                               use_tqdm=False)
        assert most.prompt_token_ids == long[-63:]
        with pytest.raises(ValueError, match="truncate_prompt_tokens is 64; max_model_len is 64"):
            llm.generate({"prompt_token_ids": long}, SamplingParams(truncate_prompt_tokens=64), use_tqdm=False)
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be"):
            SamplingParams(truncate_prompt_tokens=0)


@pytest.mark.parametrize("field,value,match", [
    ("temperature", -0.1, r"temperature must be in \[0, 100\]"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("n", 0, r"n must be an integer in \[1, 128\]"),
    ("max_tokens", 0, "max_tokens must be >= 1"),
    ("stop", 5, "stop must be a string or a list of non-empty strings"),
    ("stop", ["ok", 3], "stop must be a string or a list of non-empty strings"),
    ("top_k", -3, "top_k must be"),
    ("logprobs", 50, r"logprobs must be an integer in \[0, 20\]"),
    ("repetition_penalty", 0.0, "repetition_penalty"),
    ("repetition_penalty", 1e-276, r"repetition_penalty must be in \[0.01, 10\]"),  # 0 in float32
    ("top_k", 2**63, r"top_k must be an integer in \[-1, 2147483647\]"),  # overflows int64 arrays
    ("temperature", float("nan"), "temperature must be in"),
    ("logit_bias", {5: float("inf")}, r"biases in \[-100, 100\]"),
])
def test_sampling_params_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


async def test_a_request_aborted_while_its_long_prompt_is_tokenized_never_runs(engine, monkeypatch):
    import time

    from llmserve.actors import request_actor
    monkeypatch.setattr(request_actor, "LONG_PROMPT_CHARS", 4)  # every prompt text takes the worker thread
    encode = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda *a, **kw: (time.sleep(0.3), encode(*a, **kw))[1])
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        with anyio.move_on_after(0.05):  # the caller leaves while the text is tokenized
            await collect(engine, "the quick brown fox", SamplingParams(max_tokens=50, ignore_eos=True))
        await anyio.sleep(0.6)
        s = engine.scheduler
        assert s.num_running == s.num_waiting == 0 and s.generation_tokens == 0  # it never ran for nobody
        out = await collect(engine, "the quick brown fox", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(out.outputs[0].token_ids) == 3
        engine.stop()


def test_values_that_would_overflow_float32_are_clamped_safely():
    assert SamplingParams(temperature=1e-300).temperature == 0  # greedy: logits / 1e-300 is inf
    assert SamplingParams(temperature=1e-5).temperature == 1e-5
    assert 0 < SamplingParams(top_p=5e-324).top_p == 2.0 ** -126  # 0 in float32 would keep no token


def test_a_request_the_tokenizer_cannot_take_fails_alone(checkpoint):
    """A lone surrogate reaches the tokenizer only offline (the server refuses it first): that request
    fails with the tokenizer's error and the engine serves on."""
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        with pytest.raises(TypeError):  # what the tokenizer raises: not a ValueError, which used to end the engine
            llm.generate(["fine", "bad \ud800"], SamplingParams(max_tokens=2), use_tqdm=False)
        out = llm.generate(["fine"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        kv = llm.engine.kv
        assert kv.num_free_blocks() == kv.pool.num_blocks


def test_a_submission_cancelled_as_it_was_delivered_is_aborted():
    """The inbox took the request, then the caller was cancelled (a client gone): it is aborted,
    not left to run for nobody."""
    from llmserve.actors.request_actor import Abort
    from llmserve.engine import Frontend

    class Inbox:
        sent: list = []

        async def send(self, msg):
            self.sent.append(msg)
            if isinstance(msg, list):
                raise anyio.get_cancelled_exc_class()()

    class Front(Frontend):  # no engine behind it: the inbox is all generate() talks to
        async def run(self, **kw):
            pass

        def snapshot(self):
            pass

    frontend = Front.__new__(Front)
    frontend._requests_in = Inbox()

    async def main():
        with pytest.raises(anyio.get_cancelled_exc_class()):
            async for _ in frontend.generate("x", request_id="r1"):
                pass
    anyio.run(main)
    submitted, aborted = Inbox.sent
    assert submitted[0].req_id == "r1" and aborted == Abort("r1")


def with_generation_config(src: str, dst, **values) -> str:
    """A copy of checkpoint `src` whose generation_config.json also sets `values`."""
    import json
    import shutil
    shutil.copytree(src, dst)
    gen = dst / "generation_config.json"
    gen.write_text(json.dumps({**(json.loads(gen.read_text()) if gen.is_file() else {}), **values}))
    return str(dst)


def test_generate_without_sampling_params_uses_the_checkpoints_generation_config(checkpoint, tmp_path):
    model = with_generation_config(checkpoint("llama"), tmp_path / "model", do_sample=True, temperature=0.7,
                                   top_p=0.9, top_k=1, max_new_tokens=99)
    prompts = [{"prompt_token_ids": [5 + i, 17, 33]} for i in range(4)]
    with LLM(model, dtype="float32", device="cpu", log_interval_s=0) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p) == (0.7, 0.9, 1, 0.0)
        assert defaults.max_tokens == SamplingParams().max_tokens  # only the sampling values are read
        greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0), use_tqdm=False)]
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)] == greedy  # top_k 1
    with LLM(model, dtype="float32", device="cpu", log_interval_s=0, generation_config="none") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, use_tqdm=False)] != greedy  # T = 1, no filter


@pytest.mark.parametrize("values,match", [
    (dict(top_p=0.0), r"generation_config.json: top_p must be in \(0, 1\]"),
    (dict(temperature="warm"), "generation_config.json: temperature must be a number"),
])
def test_a_bad_generation_config_is_a_startup_error_naming_the_file(checkpoint, tmp_path, values, match):
    model = with_generation_config(checkpoint("llama"), tmp_path / "model", **values)
    with pytest.raises(ValueError, match=match):
        LLM(model, dtype="float32", device="cpu")
    with LLM(model, dtype="float32", device="cpu", log_interval_s=0, generation_config="none") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="unsupported model architecture.*GPT2LMHeadModel"):
        LLM(str(tmp_path), device="cpu")


def test_dummy_weights_from_config_alone(tmp_path, checkpoint):
    import shutil
    shutil.copy(f"{checkpoint('qwen3')}/config.json", tmp_path / "config.json")
    with LLM(str(tmp_path), load_format="dummy", device="cpu", log_interval_s=0) as llm:
        assert llm.get_tokenizer() is None
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=5, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 5 and out[0].outputs[0].text == ""
        with pytest.raises(ValueError, match="no tokenizer"):
            llm.generate("text", use_tqdm=False)


def test_the_tokenizer_loads_beside_the_device_start_up(checkpoint, monkeypatch):
    """The tokenizer's loading (importing transformers takes seconds) overlaps building the model;
    the engine still has it, or its error, when construction returns."""
    import threading

    import llmserve.engine as engine_module
    building = threading.Event()
    real_runner, real_load = engine_module.ModelRunner, engine_module.load_tokenizer

    def runner(*args, **kwargs):
        building.set()
        return real_runner(*args, **kwargs)

    def load(path):  # finishes only once the model is being built: after it, were it loaded first
        assert building.wait(timeout=30), "the model was not built while the tokenizer loaded"
        return real_load(path)

    monkeypatch.setattr(engine_module, "ModelRunner", runner)
    monkeypatch.setattr(engine_module, "load_tokenizer", load)
    with LLM(checkpoint("llama"), device="cpu", log_interval_s=0) as llm:
        assert llm.get_tokenizer().decode(llm.get_tokenizer().encode("hello world")).strip() == "hello world"
        assert llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].text

    def broken(path):
        raise OSError(f"cannot read {path}/tokenizer.json")

    monkeypatch.setattr(engine_module, "load_tokenizer", broken)
    with pytest.raises(OSError, match="tokenizer.json"):
        LLM(checkpoint("llama"), device="cpu", log_interval_s=0)


def test_a_checkpoint_without_a_tokenizer_does_not_import_transformers(tmp_path):
    import subprocess
    import sys
    code = ("import sys; from llmserve.engine import load_tokenizer; "
            f"assert load_tokenizer({str(tmp_path)!r}) is None; assert 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_max_model_len_that_cannot_fit_is_a_startup_error(checkpoint):
    with pytest.raises(ValueError, match=r"max_model_len 128 needs 32 KV blocks of 4 tokens, but only 10 fit"):
        LLM(checkpoint("llama"), device="cpu", block_size=4, num_blocks=10, max_model_len=128)


def test_engine_logs_an_interval_line(checkpoint, capsys):
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0.001) as llm:
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    lines = [line for line in capsys.readouterr().err.splitlines() if "[info     ] engine " in line]
    assert lines, "no engine statistics line"
    for key in ("running=", "waiting=", "kv_usage=", "prefix_hit_rate=", "prompt_tok_s=", "gen_tok_s="):
        assert key in lines[-1]


def test_the_runner_launches_the_next_step_before_finishing_the_last(checkpoint):
    """With async scheduling a step is launched while the one before it is still in flight; the
    tokens are those of the strictly sequential engine."""
    from llmserve import LLM, SamplingParams
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=3)
    prompts = ["the quick brown", "a b c d", "once upon"]
    with LLM(checkpoint("qwen3"), device="cpu", log_interval_s=0, async_scheduling=False) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(checkpoint("qwen3"), device="cpu", log_interval_s=0) as llm:
        runner, overlapped, off_loop = llm.engine.runner, [], []
        stepping = runner.stepping  # (how step() runs)

        def recording(plan):
            try:  # a CPU runner computes as it launches: on a worker thread, not holding the loop
                anyio.from_thread.check_cancelled()
                off_loop.append(True)
            except RuntimeError:
                off_loop.append(False)
            results = yield from stepping(plan)
            overlapped.extend(r.step_id < plan.step_id for r in results)
            return results

        runner.stepping = recording
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    assert sum(overlapped) >= 3  # decode steps finished only after their successor launched
    assert off_loop and all(off_loop)


def test_penalties_and_min_tokens_see_every_token_with_steps_in_flight(checkpoint):
    """Penalties and min_tokens read a request's tokens on the host, so the runner finishes the step
    in flight before launching theirs: outputs equal the strictly sequential engine's."""
    from llmserve import LLM, SamplingParams
    # Token 100 is pushed up by a bias: the penalty must see it the step right after it is drawn, and
    # as a stop token it must be banned for exactly min_tokens tokens.
    params = [SamplingParams(max_tokens=16, temperature=0, logit_bias={100: 8.0}, repetition_penalty=10.0,
                             presence_penalty=2.0, frequency_penalty=2.0, ignore_eos=True),
              SamplingParams(max_tokens=16, temperature=0, logit_bias={100: 20.0}, stop_token_ids=[100], min_tokens=6),
              SamplingParams(max_tokens=16, temperature=0.7, seed=1, ignore_eos=True)]
    prompts = ["the quick brown", "a b c d", "once upon"]
    outs = []
    for async_scheduling in (False, True):
        with LLM(checkpoint("llama"), device="cpu", log_interval_s=0, async_scheduling=async_scheduling) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            sampling = llm.engine.runner.sampling
            assert sampling.host_sampled <= set(sampling.seqs)  # forgotten with their requests' state
    assert outs[0] == outs[1]
    assert outs[1][0].count(100) == 1 and len(outs[1][1]) == 7 and outs[1][1][-1] == 100


async def test_a_running_prompt_is_held_in_no_list_but_the_callers(engine):
    """The engine's copies of a prompt (scheduler, KV manager, executor) are int64 arrays, which the
    garbage collector does not walk item by item: a full collection with 1,000 prompts of 1,024
    tokens in lists paused the loop for 45-85 ms (W-large). Mid-request, no list other than the
    caller's starts with the prompt's tokens."""
    import gc
    prompt = [(7 * i) % 300 + 50 for i in range(100)]
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        async for out in engine.generate(prompt, SamplingParams(max_tokens=20, ignore_eos=True)):
            if len(out.outputs[0].token_ids) >= 2:
                break
        copies = [o for o in gc.get_objects() if type(o) is list and o is not prompt
                  and len(o) >= len(prompt) and o[0] == prompt[0] and o[:len(prompt)] == prompt]
        assert copies == []
        await wait_until(lambda: pool_is_full(engine))
        engine.stop()


def test_engine_hides_its_start_up_heap_from_the_collector_until_released(checkpoint):
    import gc
    engine = Engine(EngineConfig.from_kwargs(model=checkpoint("llama"), dtype="float32", device="cpu",
                                             num_blocks=8, max_model_len=32, log_interval_s=0))
    assert gc.get_freeze_count() > 0  # modules, weights' wrappers, libraries: out of full collections
    engine.release()
    assert gc.get_freeze_count() == 0


async def test_a_large_batch_reaches_the_scheduler_two_steps_at_a_time():
    """The request actor hands a big submission on in slices of two steps' prompt tokens, the
    first before the rest is admitted (so its first step can launch meanwhile), all in order."""
    from math import inf

    from llmserve.actors.request_actor import OutputSlot, RequestActor, Submit
    from llmserve.messages import NewRequests

    inbox_in, inbox = anyio.create_memory_object_stream(inf)
    to_scheduler, from_actor = anyio.create_memory_object_stream(inf)
    actor = RequestActor(None, vocab_size=100, max_model_len=64, inbox=inbox, to_scheduler=to_scheduler,
                         step_tokens=16)
    subs = [Submit(str(i), [i + 1] * 5, SamplingParams(max_tokens=2), OutputSlot()) for i in range(20)]
    messages, admitted_at_first = [], None
    async with anyio.create_task_group() as tg:
        tg.start_soon(actor.run)
        await inbox_in.send(subs)
        while sum(len(m.requests) for m in messages) < len(subs):
            messages.append(await from_actor.receive())
            if admitted_at_first is None:
                admitted_at_first = len(actor.requests)
        inbox_in.close()
    assert all(isinstance(m, NewRequests) for m in messages)
    assert [len(m.requests) for m in messages] == [7, 7, 6]  # 35 >= 2 x 16 prompt tokens, then the rest
    assert [r.req_id for m in messages for r in m.requests] == [s.req_id for s in subs]
    assert admitted_at_first < len(subs)


def test_script_that_never_shuts_the_llm_down_exits(checkpoint):
    """`llm = LLM(...)`, `llm.generate(...)`, end of script: the interpreter exits. (It used to wait
    forever: the LLM stopped its engine from __del__, during finalization, through a loop thread the
    interpreter had already frozen.)"""
    import subprocess
    import sys
    script = (f"from llmserve import LLM, SamplingParams\n"
              f"llm = LLM({checkpoint('llama')!r}, dtype='float32', device='cpu', log_interval_s=0)\n"
              f"out = llm.generate({{'prompt_token_ids': [1, 2, 3]}}, SamplingParams(max_tokens=2), use_tqdm=False)\n"
              f"print(len(out[0].outputs[0].token_ids))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "2"


def test_llm_chat_renders_each_conversation_with_the_chat_template(checkpoint):
    """vLLM's offline chat: one conversation or several, through the tokenizer's template (or one
    passed in), tokenized without special tokens; the same tokens as generate() on that rendering."""
    from llmserve import LLM, SamplingParams
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    first = [{"role": "user", "content": "the quick brown"}]
    second = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a b c"}]
    with LLM(checkpoint("llama"), device="cpu", log_interval_s=0) as llm:
        tok = llm.get_tokenizer()
        rendered = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False),
                               add_special_tokens=False) for c in (first, second)]
        assert rendered[0][0] == tok.bos_token_id and rendered[0][1] != tok.bos_token_id  # the template's own <s> alone
        expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": r} for r in rendered], params,
                                                                 use_tqdm=False)]
        both = llm.chat([first, second], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in both] == expected
        assert [o.prompt_token_ids for o in both] == rendered
        (one,) = llm.chat(first, params, use_tqdm=False)
        assert one.outputs[0].token_ids == expected[0]
        (own,) = llm.chat(first, params, use_tqdm=False, chat_template="{{ messages[0]['content'] }}!")
        assert tok.decode(own.prompt_token_ids) == "the quick brown!"
        with pytest.raises(ValueError, match="continue_final_message"):
            llm.chat(first, params, continue_final_message=True)


async def test_the_executor_waits_for_what_a_step_yields_on_the_loop_and_for_a_slow_device_on_a_worker():
    """A local runner's call runs on the loop's thread as a generator; the executor waits for what
    it yields: masks filling on another thread (the call goes on once they are filled), the device
    by polling (a step that lands within POLL_S), or else on a worker thread (a long wait must not
    hold the loop)."""
    import threading
    from concurrent.futures import Future

    from llmserve.actors import executor_actor
    from llmserve.actors.executor_actor import ExecutorActor
    from llmserve.messages import FinishInFlight, StepResult

    class Event:  # a launched step's tokens on their way to the host
        def __init__(self, polls_to_land):
            self.polls, self.to_land, self.blocked_on = 0, polls_to_land, None

        def query(self):
            self.polls += 1
            return self.polls > self.to_land

        def synchronize(self):
            self.blocked_on = threading.current_thread()

    class Runner:
        def __init__(self, *waits):
            self.waits, self.busy, self.ran_on, self.resumed = waits, True, None, []

        def flushing(self):
            self.ran_on = threading.current_thread()
            for wait in self.waits:
                yield wait
                self.resumed.append(wait.done() if isinstance(wait, Future) else wait.polls > wait.to_land or
                                    wait.blocked_on is not None)
            self.busy = False
            return [StepResult(1, ["a"], [5])]

    async def finish(runner):
        to_exec, inbox = anyio.create_memory_object_stream(8)
        to_sched, results = anyio.create_memory_object_stream(8)
        actor = ExecutorActor(runner, inbox=inbox, to_scheduler=to_sched, launch_here=True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(actor.run)
            await to_exec.send(FinishInFlight())
            with anyio.fail_after(5):
                assert (await results.receive()).token_ids == [5]
            await to_exec.aclose()
        assert runner.ran_on is threading.current_thread() and all(runner.resumed)

    lands = Event(polls_to_land=3)
    await finish(Runner(lands))
    assert lands.polls == 4 and lands.blocked_on is None
    masks, filled = Future(), Future()
    filled.set_result(None)
    threading.Timer(0.05, masks.set_result, (None,)).start()
    await finish(Runner(masks, filled, Event(polls_to_land=0)))
    slow = Event(polls_to_land=10 ** 9)
    start = anyio.current_time()
    await finish(Runner(slow))
    assert anyio.current_time() - start >= executor_actor.POLL_S and slow.polls > 1
    assert slow.blocked_on not in (None, threading.current_thread())
