"""Structured outputs (the `structured_outputs` decoding strategy, through xgrammar) offline: every
output parses and matches its schema, regex, choice or grammar, on a random-weight model, greedy and
sampled; unconstrained neighbours are untouched; bad input names its field."""

import json
import re
import time

import anyio
import jsonschema
import pytest

from llmserve import LLM, EngineConfig, SamplingParams
from llmserve.engine import Engine
from llmserve import StructuredOutputsParams as Structured

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "b": {"enum": ["x", "yy"]}, "c": {"type": "boolean"}},
     "required": ["a", "b", "c"], "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "tags": {"type": "array", "items": {"enum": ["p", "q"]}, "minItems": 1,
                                               "maxItems": 3}},
     "required": ["name", "tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -5, "maximum": 5}, "y": {"type": "integer", "minimum": -5, "maximum": 5}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"},
                                      "kind": {"anyOf": [{"type": "boolean"}, {"enum": [1, 2, 3]}]}},
     "required": ["id", "kind"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"enum": ["red", "green", "blue"]},
]


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        yield llm


def structured(temperature: float, seed: int = 0, max_tokens: int = 80, **kind) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=Structured(**kind))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_parse_and_validate(llm, temperature):
    params = [structured(temperature, seed, json=schema) for schema in SCHEMAS for seed in range(3)]
    outs = llm.generate(["the quick brown fox"] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), p.structured_outputs.json)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_forty_schemas_every_output_validates(llm, temperature):
    """tests/json_schemas.py: nested objects, bounded arrays, enums, patterns and formats, numbers with
    limits, optional fields, anyOf; formats are checked too."""
    from json_schemas import SCHEMAS as CORPUS

    params = [structured(temperature, seed, max_tokens=150, json=schema) for schema in CORPUS for seed in range(2)]
    outs = llm.generate(["the quick brown fox"] * len(params), params, use_tqdm=False)
    checker = jsonschema.FormatChecker()
    for out, p in zip(outs, params):
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), p.structured_outputs.json, format_checker=checker)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_regex_choice_and_grammar_outputs_match(llm, temperature):
    regex, choices = r"[0-9]{3}-[a-c]+!", ["apple pie", "banana", "cherry"]
    grammar = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-z] | [0-9][0-9]?'
    params = [structured(temperature, seed, regex=regex) for seed in range(3)]
    params += [structured(temperature, seed, choice=choices) for seed in range(3)]
    params += [structured(temperature, seed, grammar=grammar) for seed in range(3)]
    outs = [o.outputs[0] for o in llm.generate(["hello"] * len(params), params, use_tqdm=False)]
    assert all(o.finish_reason == "stop" for o in outs)
    assert all(re.fullmatch(regex, o.text) for o in outs[:3])
    assert all(o.text in choices for o in outs[3:6])
    assert all(re.fullmatch(r"\((?:[a-z]|[0-9]{1,2})(?:,(?:[a-z]|[0-9]{1,2}))*\)", o.text) for o in outs[6:])


def test_a_json_object_output_is_an_object(llm):
    outs = llm.generate(["x"] * 4, [structured(0.7, seed, max_tokens=120, json_object=True) for seed in range(4)],
                        use_tqdm=False)
    done = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
    assert done, "no output completed within max_tokens"
    assert all(isinstance(json.loads(o.text), dict) for o in done)
    assert all(o.outputs[0].text.startswith("{") for o in outs)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_unconstrained_requests_beside_constrained_ones_are_unchanged(checkpoint, async_scheduling):
    """Including requests whose draws read their own outputs (penalties, min_tokens): the masked
    rows' tokens are accepted apart from theirs, which must still be booked."""
    free = [SamplingParams(temperature=1.0, seed=0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=1.0, seed=1, max_tokens=24, repetition_penalty=1.8, presence_penalty=1.5),
            SamplingParams(temperature=1.0, seed=2, max_tokens=24, min_tokens=20, frequency_penalty=1.0)]
    prompts = ["one two", "three four five", "six"]
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0,
             async_scheduling=async_scheduling) as llm:
        alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
        mixed = llm.generate(prompts + ["seven"] * 2, free + [structured(1.0, 5, json=SCHEMAS[0]),
                                                               structured(0.0, 0, regex=r"[a-z]{2,5}")],
                             use_tqdm=False)
        assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
        jsonschema.validate(json.loads(mixed[3].outputs[0].text), SCHEMAS[0])
        assert re.fullmatch(r"[a-z]{2,5}", mixed[4].outputs[0].text)


def test_n_samples_and_preemption_keep_each_output_valid(checkpoint):
    """Four samples of one request, in a pool small enough to preempt them: a resumed sample's
    constraint catches up with the tokens it already has; outputs equal those of a roomy pool."""
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=60, structured_outputs=Structured(json=SCHEMAS[1]))
    common = dict(dtype="float32", device="cpu", block_size=4, max_model_len=128, log_interval_s=0)
    with LLM(checkpoint("llama"), **common) as roomy:
        expected = [c.text for c in roomy.generate([prompt], params, use_tqdm=False)[0].outputs]
    with LLM(checkpoint("llama"), num_blocks=36, reserve_growth=False, **common) as tight:
        got = [c.text for c in tight.generate([prompt], params, use_tqdm=False)[0].outputs]
        assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    for text in got:
        jsonschema.validate(json.loads(text), SCHEMAS[1])


@pytest.mark.parametrize("kind, match", [
    (dict(json={"type": "nope"}), r"structured_outputs\.json: .*nope"),
    (dict(json="{not json"), r"structured_outputs\.json"),
    (dict(regex="a("), r"structured_outputs\.regex: .*parenthesis"),
    (dict(grammar="root ::= undefined_rule"), r"structured_outputs\.grammar"),
    (dict(json={"type": "object", "properties": {"c": {"type": "string", "pattern": "^a+$", "maxLength": 3}}}),
     r"structured_outputs\.json: not supported: maxLength together with pattern \(at \$\.properties\.c\)"),
    (dict(json={"type": "array", "items": {"type": "integer", "multipleOf": 3}}),
     r"not supported: multipleOf \(at \$\.items\)"),
    (dict(regex="ab$c"), r"structured_outputs\.regex: not supported: an anchor \(\$\) inside the regex, at character 2"),
    (dict(json={"type": "string", "pattern": "a^b"}), r"an anchor inside the pattern, at character 1 \(at \$\)"),
    (dict(json={"allOf": [{"type": "integer"}, {"minimum": 3}]}), r"not supported: allOf of several schemas \(at \$\)"),
    (dict(json={"type": "object", "properties": {"a": {"type": "array", "contains": {"const": 1}}}, "not": {}}),
     r"not supported: not \(at \$\); contains \(at \$\.properties\.a\)"),
    (dict(json={"$ref": "http://example.com/s.json"}), r"\$ref to another document, http://example\.com/s\.json"),
    (dict(json={"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}), r"not supported: if \(at \$\)"),
])
def test_a_bad_schema_regex_or_grammar_fails_its_request_alone(llm, kind, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(["x"], SamplingParams(structured_outputs=Structured(**kind)), use_tqdm=False)
    assert len(llm.generate(["x"], structured(0.0, regex="[0-9]{2}"), use_tqdm=False)[0].outputs[0].text) == 2


def test_outputs_the_constraints_rule_out_are_refused_naming_the_field(llm):
    """A grammar that admits nothing, or allowed_token_ids none of which can begin it, is refused
    before it runs; constraints that exclude each other later fail that request alone with a
    ValueError (a 400 over HTTP), not an engine error."""
    from llmserve.decoding import NoTokenAllowed

    tok = llm.engine.tokenizer
    with pytest.raises(ValueError, match=r"structured_outputs\.grammar: the grammar admits no output"):
        llm.generate(["x"], structured(0.0, grammar="root ::= root"), use_tqdm=False)
    digit = tok.convert_tokens_to_ids("7")
    with pytest.raises(ValueError, match="allowed_token_ids: none of them can begin"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=[digit], structured_outputs=Structured(choice=["yes"])),
                     use_tqdm=False)
    # "y" can begin "yes"; nothing of "es" is allowed after it
    first = [t for t in range(len(tok)) if tok.decode([t]) == "y"]
    with pytest.raises(NoTokenAllowed, match=r"structured_outputs: no token may come next"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=first + [digit], structured_outputs=Structured(choice=["yes"])),
                     use_tqdm=False)
    assert len(llm.generate(["x"], structured(0.0, regex="[0-9]{2}"), use_tqdm=False)[0].outputs[0].text) == 2


def test_a_requests_own_constraints_that_leave_no_token_are_named(llm):
    """The error names the fields that constrain the request: here allowed_token_ids and bad_words
    (no grammar), or a grammar alone that admits nothing after its first token."""
    from llmserve.decoding import NoTokenAllowed

    tok = llm.engine.tokenizer
    seven = tok.encode("7", add_special_tokens=False)
    with pytest.raises(NoTokenAllowed, match="allowed_token_ids: no token may come next: allowed_token_ids and "
                                             "bad_words together exclude every token"):
        llm.generate(["x"], SamplingParams(allowed_token_ids=seven, bad_words=["7"]), use_tqdm=False)
    with pytest.raises(NoTokenAllowed, match="structured_outputs: no token may come next: structured_outputs "
                                             "excludes every token"):
        llm.generate(["x"], structured(0.0, grammar='root ::= "b" dead\ndead ::= dead'), use_tqdm=False)


def test_a_grammar_too_large_to_serve_is_refused(llm, monkeypatch):
    """A compiled grammar past MAX_GRAMMAR_BYTES (its token masks, held by each process that runs
    it) is a ValueError naming the field and the limit; the engine serves on."""
    from llmserve.plugins import structured_outputs as so

    monkeypatch.setattr(so, "MAX_GRAMMAR_BYTES", 1000)
    with pytest.raises(ValueError, match=r"structured_outputs\.json: the grammar is too large to serve: its token "
                                         r"masks take [\d.]+ MB, over the limit of 0\.0 MB"):
        llm.generate(["x"], structured(0.0, json=SCHEMAS[0]), use_tqdm=False)
    monkeypatch.undo()
    assert llm.generate(["x"], structured(0.0, json=SCHEMAS[0]), use_tqdm=False)[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("kind, suffix", [(dict(regex="[a-c]{2}x+[0-9]"), ".regex"), (dict(regex="a\r[0-9]"), ".regex"),
                                          (dict(json=SCHEMAS[1]), ".ebnf"),
                                          (dict(choice=["yes", "no", "maybe"]), ".ebnf"),
                                          (dict(json_object=True), ".ebnf")])
def test_a_large_grammar_crosses_as_its_source_and_masks_alike_there(checkpoint, monkeypatch, kind, suffix):
    """A grammar whose serialization would be large (it grows with the square of a wide anyOf) is
    written as its source and compiled on the executor's side; a small one crosses compiled.
    Either way the masks there are the request side's, token by token."""
    import pickle
    import random

    import torch
    from transformers import AutoTokenizer

    from llmserve.decoding import mask_width
    from llmserve.plugins import structured_outputs as so

    tokenizer = AutoTokenizer.from_pretrained(checkpoint("llama"))
    for up_to, written in ((so.SERIALIZED_UP_TO, ".json"), (0, suffix)):
        monkeypatch.setattr(so, "SERIALIZED_UP_TO", up_to)
        strategy = so.StructuredOutputs()
        prepared = strategy.prepare(structured(0.0, **kind), tokenizer, 384, (2,))
        assert prepared.paths[1].endswith(written)
        here, there = so.GrammarConstraint(prepared.compiled), strategy.start(pickle.loads(pickle.dumps(prepared)))
        masks = torch.empty(2, mask_width(384), dtype=torch.int32)
        rng = random.Random(0)
        for _ in range(40):
            here.fill_mask(masks, 0)
            there.fill_mask(masks, 1)
            assert torch.equal(masks[0], masks[1])
            allowed = [t for t in range(384) if masks[0, t >> 5] >> (t & 31) & 1]
            token = 2 if allowed == [2] else rng.choice([t for t in allowed if t != 2])
            here.accept(token)
            there.accept(token)
            if token == 2:
                break
        assert here.terminated() == there.terminated()


def test_each_tokenizer_and_its_end_ids_get_their_own_file_and_grammar_on_the_engines_side(checkpoint, monkeypatch):
    """One regex for two end-id sets (the end token allowed where the output ends): one source file,
    two tokenizer files, each read back with its own; a tokenizer's file is written once."""
    import os
    import pickle

    import torch
    from transformers import AutoTokenizer

    from llmserve.decoding import mask_width
    from llmserve.plugins import structured_outputs as so

    monkeypatch.setattr(so, "SERIALIZED_UP_TO", 0)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint("llama"))
    strategy = so.StructuredOutputs()
    one = strategy.prepare(structured(0.0, regex="[0-9]"), tokenizer, 384, (2,))
    two = strategy.prepare(structured(0.0, regex="[0-9]"), tokenizer, 384, (2, 7))
    assert one.paths[1] == two.paths[1] and one.paths[0] != two.paths[0]
    for regex in ("[a-z]", "x+", "y+"):
        strategy.prepare(structured(0.0, regex=regex), tokenizer, 384, (2,))
    assert len([f for f in os.listdir(strategy._files._dir) if f.endswith(".json")]) == 2  # the tokenizers
    digit = tokenizer.convert_tokens_to_ids("5")
    masks = torch.empty(2, mask_width(384), dtype=torch.int32)
    for row, prepared in enumerate((one, two)):
        constraint = strategy.start(pickle.loads(pickle.dumps(prepared)))
        constraint.accept(digit)
        constraint.fill_mask(masks, row)
    allowed = [[t for t in range(384) if masks[row, t >> 5] >> (t & 31) & 1] for row in range(2)]
    assert allowed == [[2], [2, 7]]


def test_anchors_are_told_from_escapes_and_character_classes():
    from llmserve.plugins.structured_outputs import mid_anchor

    assert [mid_anchor(r) for r in ("^ab$", "[^a]b$", r"\^a\$", "[]^]x", r"[a\]^]b", "a$")] == [None] * 6
    assert [mid_anchor(r) for r in ("ab$c", "a^b", "(^a)")] == [2, 1, 1]


@pytest.mark.parametrize("kwargs, match", [
    (dict(structured_outputs={}), "exactly one of"),
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "exactly one of"),
    (dict(structured_outputs={"choice": []}), r"structured_outputs\.choice"),
    (dict(structured_outputs={"regex": "a"}, ignore_eos=True), "ignore_eos"),
    (dict(structured_outputs={"regex": "a"}, min_tokens=2), "min_tokens must be 0 with structured_outputs"),
    (dict(structured_outputs={"jsn": {}}), "structured_outputs"),
])
def test_structured_outputs_params_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_a_blocked_strategy_is_named_not_ignored(checkpoint):
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0,
             block=["structured_outputs"]) as llm:
        with pytest.raises(ValueError, match="no decoding strategy of this engine serves it"):
            llm.generate(["x"], structured(0.0, regex="a+"), use_tqdm=False)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_request_aborted_while_its_grammar_compiles_never_runs(checkpoint, monkeypatch, anyio_backend):
    config = EngineConfig.from_kwargs(model=checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0)
    engine = Engine(config)
    strategy = engine.strategies["structured_outputs"]
    prepare = strategy.prepare
    monkeypatch.setattr(strategy, "prepare", lambda *a: (time.sleep(0.3), prepare(*a))[1])
    async with anyio.create_task_group() as tg:
        await tg.start(engine.run)
        with anyio.move_on_after(0.05):  # the caller leaves while the grammar compiles
            async for _ in engine.generate("hello", structured(0.0, regex="[a-z]{30}", max_tokens=40)):
                pass
        await anyio.sleep(0.6)
        assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
        assert engine.scheduler.generation_tokens == 0
        engine.stop()


def test_the_strategy_is_a_plugin_listed_with_the_others():
    from llmserve.plugin_manager import Plugins

    rows = {r["name"]: r for r in Plugins().describe()}
    assert rows["structured_outputs"]["decoding_strategies"] == ["structured_outputs"]
    assert "llmserve_register_decoding_strategies" in rows["structured_outputs"]["hooks"]


def test_the_compilers_cache_of_ever_new_schemas_stays_bounded(checkpoint, monkeypatch):
    """Each distinct schema is compiled once and kept for the next request that sends it, up to
    COMPILER_CACHE_BYTES of compiled grammars: a client sending ever new schemas does not grow the
    server's memory past it, and a schema sent again after it went is compiled again."""
    from transformers import AutoTokenizer

    from llmserve.plugins import structured_outputs
    from llmserve.plugins.structured_outputs import StructuredOutputs

    monkeypatch.setattr(structured_outputs, "COMPILER_CACHE_BYTES", 1 << 20)
    strategy = StructuredOutputs()
    tokenizer = AutoTokenizer.from_pretrained(checkpoint("llama"))

    def schema(i):
        return {"type": "object", "properties": {f"key{i}": {"type": "string", "maxLength": 5 + i % 7}},
                "required": [f"key{i}"]}

    def prepare(i):
        params = SamplingParams(max_tokens=8, structured_outputs=Structured(json=schema(i)))
        return strategy.prepare(params, tokenizer, 384, (2,))

    prepare(0)
    (compiler, _), = strategy._compilers.values()
    one = compiler.get_cache_size_bytes()
    prepare(0)
    assert compiler.get_cache_size_bytes() == one > 0  # the same schema again: from the cache
    for i in range(1, 200):  # (~9 KB each on this vocabulary: 1.8 MB unbounded)
        prepare(i)
    assert compiler.get_cache_size_bytes() <= 1 << 20
    constraint = strategy.start(prepare(0))  # compiled again after it went
    assert constraint.matcher.accept_token(tokenizer.convert_tokens_to_ids("{"))


def test_grammars_sent_to_another_process_keep_a_bounded_folder(checkpoint):
    """Each grammar source is written once, however often it is sent; past `max_grammars` sources the
    oldest grammar file goes (a client sending ever new schemas cannot fill the disk)."""
    import os
    import pickle

    from transformers import AutoTokenizer

    from llmserve.plugins.structured_outputs import StructuredOutputs

    strategy = StructuredOutputs()
    strategy._files.max_grammars = 2
    tokenizer = AutoTokenizer.from_pretrained(checkpoint("llama"))

    def send(regex):
        prepared = strategy.prepare(structured(0.0, regex=regex), tokenizer, 384, (2,))
        received = pickle.loads(pickle.dumps(prepared))
        return received, strategy.start(received)

    first, _ = send("a+")
    assert send("a+")[0].paths == first.paths  # the same source: nothing new written
    send("b+")
    send("c+")
    folder = strategy._files._dir
    assert len(os.listdir(folder)) == 3 and not os.path.exists(first.paths[1])  # a tokenizer, two grammars
    constraint = send("[0-9]{2}")[1]
    constraint.accept(tokenizer.convert_tokens_to_ids("1"))  # a real matcher, read back from the files


def test_grammars_compiled_alike_share_their_file_until_neither_is_held(checkpoint):
    """Two sources that compile to the same grammar (EBNF differing in spaces) are written to one
    file: evicting the source no request holds leaves it to the one still held."""
    import gc
    import os
    import pickle

    from transformers import AutoTokenizer

    from llmserve.plugins.structured_outputs import StructuredOutputs

    strategy = StructuredOutputs()
    strategy._files.max_grammars = 1
    tokenizer = AutoTokenizer.from_pretrained(checkpoint("llama"))

    def send(grammar):
        prepared = strategy.prepare(structured(0.0, grammar=grammar), tokenizer, 384, (2,))
        return prepared, pickle.loads(pickle.dumps(prepared))

    held, received = send('root ::= "ab"')
    spaced = send('root  ::=  "ab"')[1]
    assert spaced.paths == received.paths  # one file for both
    gc.collect()  # the spaced source's PreparedGrammar is gone: nothing holds it
    send('root ::= "cd"')  # past the bound: the spaced source goes, not the file
    assert os.path.exists(received.paths[1])
    constraint = strategy.start(received)  # read back from the file
    constraint.accept(tokenizer.convert_tokens_to_ids("a"))
    del held, received, constraint
    gc.collect()
    last = send('root ::= "ef"')[1]  # now no source of it is held: its file goes
    assert not os.path.exists(spaced.paths[1]) and os.path.exists(last.paths[1])


def test_a_constrained_step_queues_its_forward_pass_before_waiting_for_the_last_tokens(checkpoint, monkeypatch):
    """The mask needs the last token on the host, the forward pass does not: the runner launches a
    step's forward pass, then finishes the step before it, then has the masks filled on the mask
    thread while the result goes back; the next launch samples first. The tokens are those of the
    strictly sequential engine."""
    import threading

    from llmserve.plugins.structured_outputs import StructuredOutputs

    fill_masks, threads = StructuredOutputs.fill_masks, set()

    def recorded(self, *args):
        threads.add(threading.current_thread().name)
        return fill_masks(self, *args)
    params = [structured(1.0, s, json=SCHEMAS[0]) for s in range(3)] + [structured(0.0, 0, regex=r"[a-z]{2,9}")]
    prompts = ["one two", "three", "four five six", "seven"]
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0, async_scheduling=False) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        monkeypatch.setattr(StructuredOutputs, "fill_masks", recorded)
        runner, events = llm.engine.runner, []
        forward, finish = runner._forward, runner._finish
        runner._forward = lambda plan, *a: (events.append(("forward", plan.step_id)), forward(plan, *a))[1]
        runner._finish = lambda flight, *a: (events.append(("finish", flight.result.step_id)), finish(flight, *a))[1]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == expected
    overlapped = [step for (kind, step), nxt in zip(events, events[1:])
                  if kind == "forward" and nxt == ("finish", step - 1)]
    assert len(overlapped) >= 5
    assert any(name.startswith("llmserve-masks") for name in threads)


# A tokenizer that has learnt JSON's punctuation (`",`, `": "`) as tokens: where a forced stretch
# begins, the model's last token (`"`) merges with it.
JSON_CORPUS = [json.dumps({"name": w, "city": c, "count": i, "active": i % 2 == 0}) + ", " + json.dumps([w, c])
               for i, (w, c) in enumerate(zip("fox dog cat owl bee ant elk yak".split() * 4,
                                              "rome oslo lima bern kiev riga".split() * 6))]
KEYED = {"type": "object", "properties": {
    "customer_identifier": {"type": "integer", "minimum": 0, "maximum": 99},
    "name": {"type": "string", "maxLength": 5},
    "shipping_destination_city": {"enum": ["rome", "oslo", "lima"]},
    "city": {"type": "string", "maxLength": 5},
    "is_priority_delivery": {"type": "boolean"}},
    "required": ["customer_identifier", "name", "shipping_destination_city", "city", "is_priority_delivery"],
    "additionalProperties": False}


def _run_counting(llm, prompts, params) -> tuple[list, int, list]:
    """Outputs, the forward steps that ran, and each jump as (sampled token, tokens replacing it,
    whether the step after it had been launched already)."""
    runner, steps, jumps = llm.engine.runner, [], []
    stepping, finish = runner.stepping, runner._finish  # (how the executor runs a local runner's steps)

    def counting(plan):
        steps.append(len(plan.req_ids))
        return (yield from stepping(plan))

    def recording(flight, *ahead):
        result = finish(flight, *ahead)
        jumps.extend((t, result.jumps[r], r in result.dropped_next)
                     for r, t in zip(result.req_ids, result.token_ids) if r in result.jumps)
        return result

    runner.stepping, runner._finish = counting, recording
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.stepping, runner._finish = stepping, finish
    assert steps  # (the executor ran its steps through stepping())
    return outs, sum(1 for n in steps if n), jumps


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_jump_forward_appends_forced_text_in_fewer_steps_and_outputs_stay_valid(checkpoint, temperature):
    """Key-heavy schema, batch 1 and 4: every output validates with jump-forward on and off; on,
    the forced keys and punctuation are computed a stretch a step."""
    with LLM(checkpoint("llama", corpus=JSON_CORPUS), dtype="float32", device="cpu", log_interval_s=0) as llm:
        for batch in (1, 4):
            prompts = [f"order {i}" for i in range(batch)]
            counted = {}
            for jump in (False, True):
                params = [SamplingParams(temperature=temperature, seed=i, max_tokens=200,
                                         structured_outputs=Structured(json=KEYED, jump_forward=jump))
                          for i in range(batch)]
                outs, steps, jumps = _run_counting(llm, prompts, params)
                for o in outs:
                    assert o.outputs[0].finish_reason == "stop"
                    jsonschema.validate(json.loads(o.outputs[0].text), KEYED)
                assert bool(jumps) == jump
                counted[jump] = steps
            assert counted[False] >= 1.5 * counted[True], counted


def test_every_jumped_stretch_is_the_canonical_encoding_of_its_text(checkpoint):
    """Each jump's tokens re-encode to themselves and decode to the sampled token's text and the
    forced text after it; where the sampled `"` merges with the forced `, "` the token is replaced."""
    with LLM(checkpoint("llama", corpus=JSON_CORPUS), dtype="float32", device="cpu", log_interval_s=0) as llm:
        tok = llm.engine.tokenizer
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=200, structured_outputs=Structured(json=KEYED))
                  for s in range(6)]
        outs, _, jumps = _run_counting(llm, ["order"] * 6, params)
    assert all(jsonschema.validate(json.loads(o.outputs[0].text), KEYED) is None for o in outs)
    decode = lambda ids: tok.decode(ids, clean_up_tokenization_spaces=False)  # noqa: E731
    for sampled, tokens, _ in jumps:
        text = decode(tokens)
        assert tok.encode(text, add_special_tokens=False) == tokens
        assert text.startswith(decode([sampled])) and len(text) > len(decode([sampled]))
    merged = [(s, t, ahead) for s, t, ahead in jumps if t[0] != s]
    assert any(decode([s]) == '"' and decode(t).startswith('", "') for s, t, _ in merged)
    # with a step launched ahead: its sample dropped, and where the token was replaced, taken back
    assert any(ahead for _, _, ahead in merged) and any(ahead and t[0] == s for s, t, ahead in jumps)
    # the outputs' token ids are what the jumps made them: they decode to the output's text
    assert all(o.outputs[0].text == tok.decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in outs)


def test_jump_forward_is_off_for_requests_with_logprobs(checkpoint):
    """A jumped token is not sampled, so it has no logprobs: such requests sample every token."""
    with LLM(checkpoint("llama", corpus=JSON_CORPUS), dtype="float32", device="cpu", log_interval_s=0) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=200, logprobs=2, structured_outputs=Structured(json=KEYED))
        outs, _, jumps = _run_counting(llm, ["order"], [params])
    out = outs[0].outputs[0]
    assert not jumps and len(out.logprobs) == len(out.token_ids)
    jsonschema.validate(json.loads(out.text), KEYED)


@pytest.mark.parametrize("schema", [KEYED, None])
def test_json_strings_never_take_utf16_surrogates(checkpoint, schema):
    """xgrammar's negated classes take U+D800-DFFF, whose UTF-8-like bytes (ED A0 80) decode to
    three U+FFFD: a five-character maxLength overrun. Its JSON grammars here refuse them."""
    import xgrammar
    from transformers import AutoTokenizer

    from llmserve.plugins.structured_outputs import json_object_grammar, json_schema_grammar
    tok = AutoTokenizer.from_pretrained(checkpoint("llama"))
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    grammar = compiler.compile_grammar(json_schema_grammar(schema) if schema else json_object_grammar())
    byte = {b: tok.convert_tokens_to_ids(c) for b, c in _byte_symbols().items()}
    matcher = xgrammar.GrammarMatcher(grammar)
    assert matcher.accept_string('{"customer_identifier": 1, "name": "' if schema else '{"k": "')
    assert matcher.accept_token(byte[0xE2]) and matcher.accept_token(byte[0x82]) and matcher.accept_token(byte[0xAC])
    assert matcher.accept_token(byte[0xED]) and not matcher.accept_token(byte[0xA0])


def _byte_symbols() -> dict[int, str]:
    """The byte-level BPE alphabet: byte -> the character standing for it."""
    shown = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = [b for b in range(256) if b not in shown]
    return {**{b: chr(b) for b in shown}, **{b: chr(256 + i) for i, b in enumerate(hidden)}}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_jumps_with_steps_launched_ahead_give_the_sequential_engines_tokens(checkpoint, temperature):
    """A jump found while the next step (computing the sampled token) is running drops that step's
    sample and, where it replaced the token, takes its computation back: the tokens equal those of
    the engine that finishes every step before planning the next (where nothing is taken back)."""
    prompts = [f"order {i}" for i in range(5)]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=200, structured_outputs=Structured(json=KEYED))
              for i in range(5)]
    runs = {}
    for async_scheduling in (False, True):
        with LLM(checkpoint("llama", corpus=JSON_CORPUS), dtype="float32", device="cpu", log_interval_s=0,
                 async_scheduling=async_scheduling) as llm:
            outs, _, jumps = _run_counting(llm, prompts, params)
            runs[async_scheduling] = [o.outputs[0].token_ids for o in outs]
            assert any(ahead for *_, ahead in jumps) == async_scheduling
            assert llm.engine.kv.pool.usage() == 0 and not llm.engine.kv.requests  # no block leaked
    assert runs[True] == runs[False]


def test_an_end_id_of_the_model_that_is_a_plain_piece_to_the_tokenizer_never_ends_an_output_early(checkpoint):
    """The model's config names token 100 as end-of-sequence, which the tokenizer has as an
    ordinary piece: pushed up by a bias, it is still allowed only where the grammar ends."""
    with LLM(checkpoint("llama", eos_token_id=100), dtype="float32", device="cpu", log_interval_s=0) as llm:
        params = [SamplingParams(temperature=t, seed=1, max_tokens=120, logit_bias={100: 30.0},
                                 structured_outputs=Structured(json=SCHEMAS[0])) for t in (0.0, 1.0)]
        outs = llm.generate(["a b", "c"], params, use_tqdm=False)
        decode = llm.engine.tokenizer.decode
    for o in outs:  # the text ends in token 100's piece: not a special token to the tokenizer
        assert o.outputs[0].finish_reason == "stop" and o.outputs[0].token_ids[-1] == 100
        jsonschema.validate(json.loads(decode(o.outputs[0].token_ids[:-1])), SCHEMAS[0])


def test_the_engine_switch_turns_jump_forward_off_for_every_request(checkpoint):
    with LLM(checkpoint("llama", corpus=JSON_CORPUS), dtype="float32", device="cpu", log_interval_s=0,
             jump_forward=False) as llm:
        outs, _, jumps = _run_counting(llm, ["order"], [structured(1.0, 3, max_tokens=200, json=KEYED)])
    assert not jumps
    jsonschema.validate(json.loads(outs[0].outputs[0].text), KEYED)


def test_json_object_admits_objects_only(checkpoint):
    """OpenAI's JSON mode answers with an object; xgrammar's JSON grammar also admits an array."""
    import xgrammar
    from transformers import AutoTokenizer

    from llmserve.plugins.structured_outputs import json_object_grammar
    tok = AutoTokenizer.from_pretrained(checkpoint("llama"))
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    grammar = compiler.compile_grammar(json_object_grammar())
    assert not xgrammar.GrammarMatcher(grammar).accept_string("[")
    matcher = xgrammar.GrammarMatcher(grammar)
    assert matcher.accept_string('{"a": [1, {"b": null}], "c": "d"}') and matcher.is_completed()


def test_json_objects_grammar_forces_only_the_rest_of_a_literal(checkpoint):
    """Why json_object does not jump by default: with whitespace admitted between any two tokens,
    the only text its grammar ever forces is the rest of a true, false or null."""
    import xgrammar
    from transformers import AutoTokenizer

    from llmserve.plugins.structured_outputs import json_object_grammar
    tok = AutoTokenizer.from_pretrained(checkpoint("llama"))
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok)))
    matcher = xgrammar.GrammarMatcher(compiler.compile_grammar(json_object_grammar()))
    text = '{"a": [1, -2.5e3, {"b": null}], "c": "d\\n\\u00e9", "e": true, "f": false, "g": {}, "h": []}'
    forced = {}
    for i, char in enumerate(text):
        if s := matcher.find_jump_forward_string():
            forced[i] = s
        assert matcher.accept_string(char)
    assert matcher.is_completed()
    literals = {text.index(w) + k: w[k:] for w in ("null", "true", "false") for k in range(1, len(w))}
    assert forced == {0: "{", **literals}  # (the brace comes before any sampled token: never jumped)


def test_json_object_jumps_forward_only_when_asked(checkpoint):
    from transformers import AutoTokenizer

    from llmserve.plugins.structured_outputs import StructuredOutputs
    tok = AutoTokenizer.from_pretrained(checkpoint("llama"))
    strategy = StructuredOutputs()

    def jumps(**spec):
        params = SamplingParams(structured_outputs=spec)
        return strategy.prepare(params, tok, len(tok), (tok.eos_token_id,)).jump_forward
    assert not jumps(json_object=True) and jumps(json_object=True, jump_forward=True)
    assert jumps(json=KEYED) and not jumps(json=KEYED, jump_forward=False) and jumps(regex="a+")


def test_the_dict_form_takes_jump_forward():
    """HTTP bodies give structured_outputs as an object: jump_forward is one of its keys."""
    params = SamplingParams(structured_outputs={"regex": "a+", "jump_forward": False})
    assert params.structured_outputs.jump_forward is False and params.structured_outputs.regex == "a+"


def test_a_constraint_that_cannot_fill_its_mask_fails_its_request_alone(checkpoint, monkeypatch):
    """Masks are filled on their own thread while the step's result goes back: a constraint whose
    mask cannot be filled (the strategy's call for all rows fails, then its own row) ends its
    request with the error; the others of its steps get the tokens of a run without it."""
    from test_engine_failures import run_together

    from llmserve.plugins.structured_outputs import GrammarConstraint, StructuredOutputs

    poison = "[b]{3,9}"
    prompts = [[5, 17, 33], [6, 17, 2], [7, 40, 3]]
    params = [structured(1.0, 0, regex="[a-z]{4,12}"), structured(0.0, 1, json=SCHEMAS[0]),
              structured(1.0, 2, regex=poison)]
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        expected = run_together(llm, prompts[:2], params[:2])
        poisoned: set[int] = set()
        prepare, start = StructuredOutputs.prepare, StructuredOutputs.start
        fill_mask, fill_masks = GrammarConstraint.fill_mask, StructuredOutputs.fill_masks

        def prepare_marked(self, p, *args):
            prepared = prepare(self, p, *args)
            if p.structured_outputs.regex == poison:
                poisoned.add(id(prepared))
            return prepared

        def start_marked(self, prepared):
            constraint = start(self, prepared)
            constraint.poisoned = id(prepared) in poisoned
            return constraint

        def broken_fill_mask(self, bitmask, row):
            if self.poisoned:
                raise RuntimeError("this mask cannot be built")
            fill_mask(self, bitmask, row)

        def broken_fill_masks(self, constraints, bitmask, rows):
            if any(c.poisoned for c in constraints):
                raise RuntimeError("one of these masks cannot be built")
            fill_masks(self, constraints, bitmask, rows)

        monkeypatch.setattr(StructuredOutputs, "prepare", prepare_marked)
        monkeypatch.setattr(StructuredOutputs, "start", start_marked)
        monkeypatch.setattr(GrammarConstraint, "fill_mask", broken_fill_mask)
        monkeypatch.setattr(StructuredOutputs, "fill_masks", broken_fill_masks)
        got = run_together(llm, prompts, params)
        assert got[:2] == expected
        assert isinstance(got[2], Exception) and "this mask cannot be built" in str(got[2])
        assert llm.engine.kv.pool.usage() == 0 and not llm.engine.kv.requests  # no block leaked


def test_a_matchers_token_calls_keep_the_interpreter_beside_a_busy_thread(checkpoint):
    """xgrammar's calls release the interpreter lock; for a matcher's microsecond calls that hands
    it to any busy thread (the event loop) at every row. The strategy keeps it there: a step's
    worth of accepts (one by one, and in one batch call), jump checks and rollbacks takes about as
    long beside a busy thread as alone."""
    import threading

    from transformers import AutoTokenizer

    from llmserve.plugins.structured_outputs import StructuredOutputs

    strategy, tokenizer = StructuredOutputs(), AutoTokenizer.from_pretrained(checkpoint("llama"))
    prepared = strategy.prepare(structured(0.0, regex="[a-z]*"), tokenizer, 384, (2,))
    constraints = [strategy.start(prepared) for _ in range(256)]
    matchers = [c.matcher for c in constraints]
    letter = tokenizer.convert_tokens_to_ids("a")

    def row_calls() -> float:
        start = time.perf_counter()
        for _ in range(4):
            for m in matchers:
                m.accept_token(letter)
                m.find_jump_forward_string()
                m.rollback(1)
        return time.perf_counter() - start

    def batch_calls() -> float:
        start = time.perf_counter()
        for _ in range(16):
            strategy.accept_tokens(constraints, [letter] * len(constraints))
            for m in matchers:
                m.rollback(1)
        return time.perf_counter() - start

    for calls in (row_calls, batch_calls):
        alone = min(calls() for _ in range(3))
        stop = threading.Event()
        busy = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
        busy.start()
        try:
            beside = min(calls() for _ in range(3))
        finally:
            stop.set()
            busy.join()
        assert beside < 5 * alone + 0.005, (calls.__name__, alone, beside)


def test_a_token_its_mask_did_not_allow_fails_its_request_alone(checkpoint, monkeypatch):
    """Each token a masked request draws is checked against the mask it was drawn under before any
    constraint advances: a backend that fails to apply masks ends the constrained requests with an
    error naming the token, and the unconstrained ones beside them get their usual tokens."""
    from test_engine_failures import run_together

    from llmserve.attention import AttentionBackend

    prompts = [[5, 17, 33], [6, 17, 2]]
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=12), structured(1.0, 4, regex="[b]{3,9}")]
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        expected = run_together(llm, prompts[:1], params[:1])
        monkeypatch.setattr(AttentionBackend, "apply_token_mask", lambda self, logits, rows, masks: None)
        got = run_together(llm, prompts, params)
        assert got[0] == expected[0]
        assert isinstance(got[1], Exception) and "is not allowed by its constraints' mask" in str(got[1])
        assert llm.engine.kv.pool.usage() == 0 and not llm.engine.kv.requests


def test_a_failing_batch_accept_fails_the_requests_it_held_alone(checkpoint, monkeypatch):
    """A strategy's accept_tokens that raises ends the requests whose tokens it was given; an
    unconstrained request of the same steps is untouched."""
    from test_engine_failures import run_together

    from llmserve.plugins.structured_outputs import StructuredOutputs

    prompts = [[5, 17, 33], [6, 17, 2]]
    params = [SamplingParams(temperature=1.0, seed=3, max_tokens=12), structured(1.0, 4, regex="[a-z]{4,12}")]
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", log_interval_s=0) as llm:
        expected = run_together(llm, prompts[:1], params[:1])

        def broken(self, constraints, tokens):
            raise RuntimeError("the grammar engine is gone")

        monkeypatch.setattr(StructuredOutputs, "accept_tokens", broken)
        got = run_together(llm, prompts, params)
        assert got[0] == expected[0]
        assert isinstance(got[1], Exception) and "the grammar engine is gone" in str(got[1])
        assert llm.engine.kv.pool.usage() == 0 and not llm.engine.kv.requests


def test_the_batch_accept_advances_each_matcher_as_its_own_accept_does(checkpoint, monkeypatch):
    """accept_tokens (one xgrammar call for all rows, its results unread) leaves every matcher where
    one accept a row leaves it: their masks agree step after step, along random tokens each mask
    allows, through a JSON schema's keys, values and end. It goes around xgrammar's Python wrapper
    (whose reading of the results back costs as much as the accepts): the wrapper is never called."""
    import random

    import torch
    import xgrammar
    from transformers import AutoTokenizer

    from llmserve.decoding import mask_width
    from llmserve.kernels.token_mask import unpack_mask
    from llmserve.plugins.structured_outputs import StructuredOutputs

    def wrapper(*args, **kwargs):
        raise AssertionError("the wrapper reads every result back")

    monkeypatch.setattr(xgrammar.BatchGrammarMatcher, "batch_accept_token", wrapper)
    strategy, tokenizer = StructuredOutputs(), AutoTokenizer.from_pretrained(checkpoint("llama"))
    vocab = 384
    prepared = strategy.prepare(structured(0.0, json=SCHEMAS[1]), tokenizer, vocab, (2,))
    one_by_one = [strategy.start(prepared) for _ in range(8)]
    batched = [strategy.start(prepared) for _ in range(8)]
    rng = random.Random(0)
    for _ in range(300):
        live = [i for i, c in enumerate(one_by_one) if not c.terminated()]
        assert live == [i for i, c in enumerate(batched) if not c.terminated()]
        if not live:
            break
        masks = [torch.empty(len(live), mask_width(vocab), dtype=torch.int32) for _ in range(2)]
        strategy.fill_masks([one_by_one[i] for i in live], masks[0], list(range(len(live))))
        strategy.fill_masks([batched[i] for i in live], masks[1], list(range(len(live))))
        assert torch.equal(masks[0], masks[1])
        allowed = unpack_mask(masks[0], vocab)
        tokens = [rng.choice(row.nonzero().flatten().tolist()) for row in allowed]
        for i, t in zip(live, tokens):
            one_by_one[i].accept(t)
        strategy.accept_tokens([batched[i] for i in live], tokens)
    assert not live  # every walk reached the schema's end
