"""Structured outputs' grammar process (plugins/grammar_process.py): matchers that do not jump
advanced, and their masks filled, in a process beside the engine. The outputs are the in-process
engine's; what the process does not serve (drafts, resumed requests, a process that died) falls to
the mirrors in the engine's process."""

import gc
import json
import time

import jsonschema
import pytest
import torch

from conftest import hold_speculation_on
from llmserve import LLM, SamplingParams
from llmserve import StructuredOutputsParams as Structured
from llmserve.plugins.grammar_process import SharedGrammarConstraint
from llmserve.plugins.structured_outputs import GrammarConstraint

COMMON = dict(dtype="float32", device="cpu", log_interval_s=0)
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "b": {"enum": ["x", "yy", "zzz"]}, "d": {"type": "string", "maxLength": 12}},
          "required": ["a", "b", "d"], "additionalProperties": False}


def strategy_of(llm):
    return llm.engine.runner.sampling.strategies["structured_outputs"]


def in_process_tokens(monkeypatch, path, prompts, params, **options) -> list[list[int]]:
    """Each output's tokens with every matcher in the engine's process; the process switched on
    for what follows."""
    monkeypatch.setenv("LLMSERVE_GRAMMAR_PROCESS", "0")
    with LLM(path, **COMMON, **options) as llm:
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert strategy_of(llm)._process is None
    monkeypatch.setenv("LLMSERVE_GRAMMAR_PROCESS", "1")
    return tokens


def ready(llm) -> None:
    """Start the grammar process (as a fill would, after a request that does not jump) and wait
    until it is ready."""
    params = SamplingParams(max_tokens=2, structured_outputs=Structured(json_object=True))
    llm.generate({"prompt_token_ids": [3, 4]}, params, use_tqdm=False)
    process, deadline = strategy_of(llm)._process, time.monotonic() + 60
    while not process.serves():
        assert time.monotonic() < deadline and not process.dead, "the grammar process did not get ready"
        time.sleep(0.05)


def count_process_fills(llm) -> list[bool]:
    """Per masked step from now: whether its masks were filled in the grammar process."""
    strategy, calls = strategy_of(llm), []
    fill = strategy.fill_masks_async

    def counted(constraints, rows, width):
        pending = fill(constraints, rows, width)
        calls.append(pending is not None)
        return pending

    strategy.fill_masks_async = counted
    return calls


def record_starts(llm) -> list[type]:
    """The type of each constraint started from now."""
    strategy, types = strategy_of(llm), []
    start = strategy.start

    def recorded(prepared):
        constraint = start(prepared)
        types.append(type(constraint))
        return constraint

    strategy.start = recorded
    return types


def mixed_params(n: int = 8) -> list[SamplingParams]:
    kinds = [dict(json_object=True), dict(json=SCHEMA, jump_forward=False), dict(regex=r"[a-z]{2,6}( [0-9]{2}){1,3}",
                                                                                 jump_forward=False),
             dict(json=SCHEMA)]  # (the last jumps: its matcher stays here)
    return [SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=48,
                           structured_outputs=Structured(**kinds[i % len(kinds)])) for i in range(n)]


PROMPTS = [{"prompt_token_ids": list(range(3, 9 + i))} for i in range(8)]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_outputs_equal_the_in_process_engines_with_matchers_in_the_grammar_process(checkpoint, monkeypatch,
                                                                                    async_scheduling):
    params = mixed_params()
    expected = in_process_tokens(monkeypatch, checkpoint("llama"), PROMPTS, params, async_scheduling=async_scheduling)
    with LLM(checkpoint("llama"), async_scheduling=async_scheduling, **COMMON) as llm:
        if async_scheduling:
            ready(llm)
        calls, types = count_process_fills(llm), record_starts(llm)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        process = strategy_of(llm)._process
        assert process.ready == async_scheduling  # (no fill asked of it: never started)
    assert types.count(SharedGrammarConstraint) == 6 and len(types) == 8  # (two jump: their matchers stay here)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # steps with only matchers of the process are filled there, with a jumping one's here; without
    # async scheduling every step's masks are filled as it is launched: here, on the mirrors
    assert (any(calls) and not all(calls)) if async_scheduling else not any(calls)
    for out, p in zip(outs, params):
        if p.structured_outputs.json is not None and out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


@pytest.mark.parametrize("crosses_as", ["compiled", "source"])
def test_masks_filled_in_the_process_equal_each_matchers_own(checkpoint, monkeypatch, crosses_as):
    """Matchers at different places of json_object's grammar (inside a key, a string, a number,
    after the end): the process's rows are the in-process matchers' bit for bit, whether the
    grammar crossed compiled or as its source (compiled there); an unknown grammar file fails its
    row alone, allowing every token."""
    from llmserve.plugins import structured_outputs as so

    monkeypatch.setenv("LLMSERVE_GRAMMAR_PROCESS", "1")
    if crosses_as == "source":
        monkeypatch.setattr(so, "SERIALIZED_UP_TO", 0)
    with LLM(checkpoint("llama"), **COMMON) as llm:
        ready(llm)
        strategy, tok = strategy_of(llm), llm.get_tokenizer()
        vocab, eos = llm.engine.spec.vocab_size, tuple(llm.engine.runner.eos_token_ids)
        params = SamplingParams(structured_outputs=Structured(json_object=True))
        prepared = strategy.prepare(params, tok, vocab, eos)
        assert prepared.paths[1].endswith(".json" if crosses_as == "compiled" else ".ebnf")
        texts = ['{"ke', '{"key": "some te', '{"key": 12', '{"a": [true, {"b": null}', '{}']
        shared, local = [], []
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False)
            s, c = strategy.start(prepared), GrammarConstraint(prepared.compiled)
            assert isinstance(s, SharedGrammarConstraint)
            for t in ids:
                s.accept(t)
                c.accept(t)
            shared.append(s)
            local.append(c)
        eos_row = len(texts) - 1
        shared[eos_row].accept(eos[0])
        local[eos_row].accept(eos[0])
        broken = SharedGrammarConstraint(strategy._process, ("/nonexistent/t.json", "/nonexistent/g.json"),
                                         lambda: GrammarConstraint(prepared.compiled))
        width = -(-vocab // 32)
        pending = strategy.fill_masks_async(shared + [broken], list(range(len(shared) + 1)), width)
        failed = pending.result()
        expected = torch.zeros((len(local), width), dtype=torch.int32)
        for row, c in enumerate(local):
            c.fill_mask(expected, row)
        assert torch.equal(pending.host[:len(local)], expected)
        assert (expected[eos_row] == -1).all() and not (expected[0] == -1).all()
        assert list(failed) == [len(local)] and "did not load in the grammar process" in failed[len(local)]
        assert (pending.host[len(local)] == -1).all()


def test_a_grammar_process_that_dies_leaves_its_requests_to_their_mirrors(checkpoint, monkeypatch):
    """Killed while requests run: their outputs are unchanged (the fill it owed is made here), new
    requests keep their matchers here, and it is not started again."""
    params = mixed_params()[:3]
    expected = in_process_tokens(monkeypatch, checkpoint("llama"), PROMPTS[:3], params)
    with LLM(checkpoint("llama"), **COMMON) as llm:
        ready(llm)
        strategy = strategy_of(llm)
        process, fill, fills = strategy._process, strategy.fill_masks_async, []

        def killing(constraints, rows, width):
            pending = fill(constraints, rows, width)
            fills.append(pending)
            if len(fills) == 5:
                process._proc.kill()
                process._proc.wait()
            return pending

        strategy.fill_masks_async = killing
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        assert process.dead and process._proc is None
        assert fills[4] is not None and fills[-1] is None
        again = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        assert strategy._process is process and process._proc is None  # not started again
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.outputs[0].token_ids for o in again] == expected


def test_every_matcher_opened_in_the_process_is_closed_there(checkpoint, monkeypatch):
    monkeypatch.setenv("LLMSERVE_GRAMMAR_PROCESS", "1")
    with LLM(checkpoint("llama"), **COMMON) as llm:
        ready(llm)
        process, opened, closed = strategy_of(llm)._process, set(), set()
        send = process._send

        def recorded(ops):
            opened.update(op[1] for op in ops if op[0] == "open")
            closed.update(op[1] for op in ops if op[0] == "close")
            send(ops)

        process._send = recorded
        params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=30,
                                structured_outputs=Structured(json_object=True))
        llm.generate(PROMPTS[:4], params, use_tqdm=False)
        first = set(opened)
        gc.collect()
        # (the engine keeps the last masked step's layout, and its constraints, until the next one)
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
        gc.collect()
        process.flush()
        assert len(first) == 12 and first - closed == set()


def test_resumed_requests_catch_up_in_the_process(checkpoint, monkeypatch):
    """Samples preempted in a small pool and resumed: each new matcher is sent its tokens so far;
    the outputs equal those of a roomy pool with the matchers here."""
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=60,
                            structured_outputs=Structured(json=SCHEMA, jump_forward=False))
    common = dict(block_size=4, max_model_len=128, **COMMON)
    monkeypatch.setenv("LLMSERVE_GRAMMAR_PROCESS", "0")
    with LLM(checkpoint("llama"), **common) as roomy:
        expected = [c.token_ids for c in roomy.generate([prompt], params, use_tqdm=False)[0].outputs]
    monkeypatch.setenv("LLMSERVE_GRAMMAR_PROCESS", "1")
    with LLM(checkpoint("llama"), num_blocks=36, reserve_growth=False, **common) as tight:
        ready(tight)
        calls = count_process_fills(tight)
        got = [c.token_ids for c in tight.generate([prompt], params, use_tqdm=False)[0].outputs]
        assert tight.engine.scheduler.num_preemptions > 0 and sum(calls) > 10
    assert got == expected


def test_speculating_requests_check_drafts_on_their_mirrors(checkpoint, monkeypatch):
    """Drafts are checked here, on mirrors caught up from the tokens; the outputs are the plain
    engine's."""
    ck = checkpoint("llama")
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], [20, 21, 22, 23], [44, 45])]
    params = [SamplingParams(max_tokens=60, temperature=0.0 if i < 2 else 0.9, seed=i,
                             structured_outputs=Structured(json=SCHEMA, jump_forward=False)) for i in range(3)]
    expected = in_process_tokens(monkeypatch, ck, prompts, params)
    with LLM(ck, **COMMON, speculative_config={"method": "draft", "model": ck, "num_speculative_tokens": 3}) as llm:
        ready(llm)
        hold_speculation_on(llm)
        types = record_starts(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        spec = llm.engine.scheduler.spec
    assert types == [SharedGrammarConstraint] * 3
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert spec.drafts > 5 and 0 < spec.accepted_tokens < spec.draft_tokens


def test_a_hung_grammar_process_is_stopped_and_its_fill_made_here(checkpoint, monkeypatch):
    """Stopped (SIGSTOP) while requests run: its answer does not come within TIMEOUT_S, so it is
    killed and the fill it owed made from the mirrors; the outputs are unchanged."""
    import os
    import signal

    from llmserve.plugins import grammar_process

    params = mixed_params()[:3]
    expected = in_process_tokens(monkeypatch, checkpoint("llama"), PROMPTS[:3], params)
    monkeypatch.setattr(grammar_process, "TIMEOUT_S", 1.0)
    with LLM(checkpoint("llama"), **COMMON) as llm:
        ready(llm)
        process = strategy_of(llm)._process
        os.kill(process._proc.pid, signal.SIGSTOP)
        start = time.monotonic()
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        assert process.dead and process._proc is None and time.monotonic() - start < 30
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_a_mask_buffer_that_cannot_be_made_leaves_the_fills_here(checkpoint, monkeypatch):
    """No shared memory for a buffer (a full /dev/shm): no step fails; the process is given up and
    the masks are filled from the mirrors."""
    from llmserve.plugins import grammar_process

    params = mixed_params()[:3]
    expected = in_process_tokens(monkeypatch, checkpoint("llama"), PROMPTS[:3], params)
    with LLM(checkpoint("llama"), **COMMON) as llm:
        ready(llm)

        def no_room(self, rows, width):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(grammar_process._Buffer, "__init__", no_room)
        isolated = []
        monkeypatch.setattr(llm.engine.runner, "_isolate", lambda plan: isolated.append(plan))
        outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
        assert strategy_of(llm)._process.dead and not isolated
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_the_process_ignores_ctrl_c_and_ends_quietly_with_its_pipe():
    """Ctrl-C reaches the whole process group: the grammar process leaves it to the engine, and
    exits with status 0 when its pipe closes, even before it could say it is ready."""
    import signal

    from llmserve.plugins.grammar_process import GrammarProcess

    for wait_ready in (False, True):
        process = GrammarProcess()
        process.start()
        child = process._proc
        if wait_ready:
            deadline = time.monotonic() + 60
            while not process.serves():
                assert time.monotonic() < deadline
                time.sleep(0.05)
            child.send_signal(signal.SIGINT)
            time.sleep(0.5)
            assert child.poll() is None  # still there
        process._conn.close()  # the engine went
        assert child.wait(timeout=60) == 0
        process._proc = None


def test_grammar_files_of_waiting_requests_outlive_the_folders_bound(checkpoint, monkeypatch):
    """More distinct grammars than the folder keeps, most of them waiting for a place to run: a
    waiting request's grammar file stays until its request ends (the process opens its matcher
    from it only when it first runs), then goes."""
    import os
    import re

    monkeypatch.setenv("LLMSERVE_GRAMMAR_PROCESS", "1")
    regexes = [f"{w}[a-z]{{2,5}}( [0-9]{{1,3}}){{1,3}}" for w in ("ab", "cd", "ef", "gh", "ij", "kl", "mn", "op")]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=24,
                             structured_outputs=Structured(regex=r, jump_forward=False)) for i, r in enumerate(regexes)]
    with LLM(checkpoint("llama"), max_num_seqs=2, **COMMON) as llm:
        ready(llm)
        files = strategy_of(llm)._files
        files.max_grammars = 2
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for out, regex in zip(outs, regexes):
            assert out.outputs[0].finish_reason in ("stop", "length"), out.outputs[0]
            if out.outputs[0].finish_reason == "stop":
                assert re.fullmatch(regex, out.outputs[0].text), (regex, out.outputs[0].text)
        gc.collect()
        llm.generate(PROMPTS[0], params[0], use_tqdm=False)  # (the ended requests' files go as one is written)
        assert len([f for f in os.listdir(files._dir) if f.endswith(".json")]) <= 1 + files.max_grammars
