"""The OpenAI-compatible server, end to end on 127.0.0.1: the official openai client (sync and async),
a real WebSocket client, raw HTTP for malformed input, and the `llmserve` command itself."""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import websockets
import websockets.sync.client as ws_client
from anyio.from_thread import start_blocking_portal

from llmserve.config import EngineConfig
from llmserve.engine import BUILTIN_MODEL_DIR
from llmserve.engine_process import ProcessEngine
from llmserve.server.run import serve
from servers import MODEL, launched, running_server, thinker, wait_for

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def server(request):
    with running_server(request.param == "engine-process", max_body_bytes=64 * 1024, max_ws_requests=3) as s:
        yield s


# ---- completions and chat through the official client -------------------------------------------

def test_completion_with_usage(server):
    out = server.client().completions.create(model=MODEL, prompt="The list type", max_tokens=12, temperature=0)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason == "length" and out.choices[0].text.strip()
    n_prompt = len(httpx.post(f"{server.url}/tokenize", json={"prompt": "The list type"}).json()["tokens"])
    assert out.usage.prompt_tokens == n_prompt and out.usage.completion_tokens == 12
    assert out.usage.total_tokens == n_prompt + 12


def test_streamed_text_equals_non_streamed(server):
    c = server.client()
    args = dict(model=MODEL, prompt="To open a file,", max_tokens=20, temperature=0.8, seed=11)
    whole = c.completions.create(**args).choices[0].text
    chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].choices == []
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    msgs = [{"role": "system", "content": "Python documentation."}, {"role": "user", "content": "A dictionary is"}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0.7, seed=3)
    streamed = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0.7, seed=3, stream=True)
    pieces = list(streamed)
    assert pieces[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in pieces) == chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant" and chat.object == "chat.completion"
    counted = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0.7, seed=3,
                                             stream=True, stream_options={"include_usage": True,
                                                                          "continuous_usage_stats": True}))
    assert all(p.usage is not None for p in counted)  # vLLM's continuous usage: on every chunk
    completion = [p.usage.completion_tokens for p in counted]
    assert completion == sorted(completion) and completion[-1] == chat.usage.completion_tokens
    assert {p.usage.prompt_tokens for p in counted} == {chat.usage.prompt_tokens}
    assert all(p.usage is None for p in pieces)


def test_n2_multiple_prompts_and_token_prompts(server):
    out = server.client().completions.create(model=MODEL, prompt=["The list type", "A dictionary is"], n=2,
                                             max_tokens=5, temperature=1.0, seed=1)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 20
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The list type"}).json()["tokens"]
    by_ids = server.client().completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    by_text = server.client().completions.create(model=MODEL, prompt="The list type", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_stop_strings_and_echo(server):
    c = server.client()
    base = c.completions.create(model=MODEL, prompt="The list type", max_tokens=30, temperature=0).choices[0].text
    stop = base.split()[3]
    cut = c.completions.create(model=MODEL, prompt="The list type", max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == base[:base.index(stop)]
    streamed = c.completions.create(model=MODEL, prompt="The list type", max_tokens=30, temperature=0, stop=stop,
                                    stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == base[:base.index(stop)]
    echo = c.completions.create(model=MODEL, prompt="The list type", max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == "The list type" + base[:len(echo.choices[0].text) - len("The list type")]


def test_logprobs(server):
    c = server.client()
    out = c.completions.create(model=MODEL, prompt="The list type", max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and value <= 0 and max(top.values()) == pytest.approx(value)  # greedy: top-1
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The list type"}],
                                     max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)
    # vLLM's return_tokens_as_token_ids: each token named "token_id:N", N the id of the token the text names
    ids = c.completions.create(model=MODEL, prompt="The list type", max_tokens=6, temperature=0, logprobs=3,
                               extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    named = [int(t.removeprefix("token_id:")) for t in ids.tokens]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": named}).json()["prompt"] == "".join(lp.tokens)
    assert ids.token_logprobs == pytest.approx(lp.token_logprobs)
    assert all(name.startswith("token_id:") for top in ids.top_logprobs for name in top)
    chat_ids = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The list type"}],
                                         max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.content
    assert [t.logprob for t in chat_ids] == pytest.approx([t.logprob for t in content])
    assert all(t.token.startswith("token_id:") and all(x.token.startswith("token_id:") for x in t.top_logprobs)
               for t in chat_ids)
    assert [t.bytes for t in chat_ids] == [list(t.token.encode()) for t in content]  # the chosen token's: its text's
    echoed = c.completions.create(model=MODEL, prompt="The list type", max_tokens=3, temperature=0, echo=True,
                                  logprobs=1, extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert all(b - a == len(t) for a, b, t in zip(echoed.text_offset, echoed.text_offset[1:], echoed.tokens))
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs: true") as err:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                  top_logprobs=2)
    assert err.value.body["param"] == "top_logprobs"


def test_vllms_prompt_logprobs(server):
    """prompt_logprobs k: per prompt position (None first) the prompt token's logprob and the k most
    likely, as echo's logprobs give them; a completion choice's, a chat response's; not streamed."""
    c = server.client()
    prompt = "The list type is a sequence"
    echoed = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, echo=True, logprobs=2).choices[0].logprobs
    out = c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2}).choices[0]
    positions = out.model_extra["prompt_logprobs"]
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
    assert len(positions) == len(ids) and positions[0] is None
    for tid, entry, value, top in zip(ids[1:], positions[1:], echoed.token_logprobs[1:], echoed.top_logprobs[1:]):
        assert entry[str(tid)]["logprob"] == pytest.approx(value)
        best = sorted(entry.values(), key=lambda e: e["rank"])
        assert {e["decoded_token"]: e["logprob"] for e in best if e["rank"] <= 2} == pytest.approx(top)
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "prompt_logprobs": 1})
    assert chat.status_code == 200 and chat.json()["prompt_logprobs"][0] is None
    assert all(len([e for e in p.values() if e["rank"] <= 1]) == 1 for p in chat.json()["prompt_logprobs"][1:])
    with pytest.raises(openai.BadRequestError, match="cannot be streamed") as err:
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, stream=True, extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"


def test_vllms_truncate_prompt_tokens(server):
    """A prompt keeps its last k tokens: the output is the cut prompt's, echo shows the cut prompt,
    usage counts what was kept; -1 keeps what the context lets a prompt have; more is a 400."""
    c = server.client()
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": "The list type is a sequence of items"}).json()["tokens"]
    assert len(ids) > 4
    cut = c.completions.create(model=MODEL, prompt="The list type is a sequence of items", max_tokens=6,
                               temperature=0, echo=True, extra_body={"truncate_prompt_tokens": 4})
    alone = c.completions.create(model=MODEL, prompt=ids[-4:], max_tokens=6, temperature=0, echo=True)
    assert cut.choices[0].text == alone.choices[0].text and cut.usage.prompt_tokens == 4
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 300}], max_tokens=1,
                                     extra_body={"truncate_prompt_tokens": -1})
    assert chat.usage.prompt_tokens == server.engine.max_model_len - 1
    for value, match in ((server.engine.max_model_len, "at most"), (0, "an integer >= 1, or -1")):
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "a", "truncate_prompt_tokens": value})
        assert r.status_code == 400 and match in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_vllms_add_special_tokens(checkpoint, tmp_path):
    """Completions add the tokenizer's special tokens (a BOS here) unless told not to; chat adds
    them only when told to (its template writes its own)."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer
    model = tmp_path / "bos"
    shutil.copytree(checkpoint("llama"), model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.bos_token_id)])
    tok.save_pretrained(model)
    with running_server(model=str(model)) as s:
        def prompt_tokens(path: str, **body) -> int:
            r = httpx.post(f"{s.url}/v1/{path}", json={"max_tokens": 1, **body})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens"]
        plain = prompt_tokens("completions", prompt="a b c", add_special_tokens=False)
        assert prompt_tokens("completions", prompt="a b c") == plain + 1
        messages = [{"role": "user", "content": "a b c"}]
        chat = prompt_tokens("chat/completions", messages=messages)
        assert prompt_tokens("chat/completions", messages=messages, add_special_tokens=True) == chat + 1


def test_echo_with_max_tokens_0_scores_the_prompt(server):
    """lm-eval-harness's loglikelihood request: the prompt's own logprobs, nothing generated. Scored
    after a greedy continuation, its tokens carry the logprobs they were sampled with, each the top-1."""
    c = server.client()
    prompt = "The list type"
    gen = c.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, logprobs=2).choices[0]
    text = prompt + gen.text
    scored = c.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2)
    choice = scored.choices[0]
    assert choice.text == text and choice.finish_reason == "length"
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(choice.logprobs.tokens)
    lp = choice.logprobs
    assert "".join(lp.tokens) == text and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    tail = slice(len(lp.tokens) - 5, None)  # the continuation, as the prompt tokenizes it back
    assert lp.tokens[tail] == gen.logprobs.tokens
    assert lp.token_logprobs[tail] == pytest.approx(gen.logprobs.token_logprobs, abs=1e-3)
    for value, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert value <= 0 and len(top) >= 2 and max(top.values()) >= value
    for value, top in zip(lp.token_logprobs[tail], lp.top_logprobs[tail]):
        assert max(top.values()) == pytest.approx(value)  # greedy picked each
    chunks = list(c.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="echo") as err:
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
    assert server.idle()


def test_seed_reproducibility(server):
    c = server.client()
    run = lambda seed: c.completions.create(model=MODEL, prompt="The asyncio module", max_tokens=16,  # noqa: E731
                                            temperature=1.0, seed=seed).choices[0].text
    assert run(5) == run(5)
    assert len({run(s) for s in range(4)}) > 1


def test_requests_leaving_sampling_unset_take_the_checkpoints_generation_config(tmp_path):
    """top_k 1 in generation_config.json: a request that sets no top_k samples the argmax, as a
    greedy one does; one that sets top_k itself (even to the OpenAI default) keeps it."""
    model = tmp_path / "with-defaults"  # the name it is served under
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    gen = model / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "do_sample": True, "temperature": 0.8, "top_k": 1}))
    with running_server(model=str(model)) as s:
        client = s.client()

        def texts(**kw):
            return [client.completions.create(model=model.name, prompt=p, max_tokens=12, seed=3, **kw).choices[0].text
                    for p in ("The list type", "A tuple is", "Dictionaries map")]

        greedy = texts(temperature=0)
        assert texts() == greedy
        assert texts(temperature=1.0) == greedy  # top_k 1 still from the file
        assert texts(extra_body={"top_k": -1}) != greedy  # temperature 0.8 from the file, no filter
        nulls = dict.fromkeys(("temperature", "top_k", "top_p", "n", "stream", "echo", "logprobs", "presence_penalty",
                               "frequency_penalty", "seed"))
        assert texts(extra_body=nulls) == greedy  # null: unset, as OpenAI's API takes it (the file's top_k applies)
    # vLLM's --override-generation-config: its keys over the file's (top_k 1 lifted, the file's temperature kept)
    with running_server(model=str(model), model_opts={"override_generation_config": {"top_k": -1, "top_p": 0.9}}) as s:
        assert s.engine.sampling_defaults == {"temperature": 0.8, "top_k": -1, "top_p": 0.9}
        client = s.client()
        assert texts() != greedy and texts(extra_body={"top_k": 1}) == greedy
    for bad, match in (({"max_new_tokens": 5}, "an object of temperature, top_p"),
                       ({"top_p": 0}, r"model.override_generation_config: top_p must be in \(0, 1\]")):
        with pytest.raises(ValueError, match=match):
            EngineConfig.from_dict({"model": {"override_generation_config": bad}})


def test_chat_template_variables_and_a_continued_final_message(tmp_path):
    """chat_template_kwargs reach the template (a Qwen3-style enable_thinking switch here);
    continue_final_message renders the last message open, without its separator or a new turn."""
    model = tmp_path / "thinking"
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['content'] }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}Answer:{% if enable_thinking is defined and not enable_thinking %}"
        " (no thinking){% endif %}{% endif %}")
    with running_server(model=str(model)) as s:
        def render(**body):
            r = httpx.post(f"{s.url}/tokenize", json={"messages": msgs, **body})
            assert r.status_code == 200, r.text
            return httpx.post(f"{s.url}/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]

        msgs = [{"role": "user", "content": "A list"}, {"role": "assistant", "content": "is a sequence"}]
        assert render() == "A list\n\nis a sequence\n\nAnswer:"
        no_thinking = render(chat_template_kwargs={"enable_thinking": False})
        assert no_thinking == "A list\n\nis a sequence\n\nAnswer: (no thinking)"
        assert render(add_generation_prompt=False, continue_final_message=True) == "A list\n\nis a sequence"
    # vLLM's --default-chat-template-kwargs: every request's, unless its own say otherwise
    with running_server(model=str(model), default_chat_template_kwargs={"enable_thinking": False}) as s:
        assert render() == "A list\n\nis a sequence\n\nAnswer: (no thinking)"
        assert render(chat_template_kwargs={"enable_thinking": True}) == "A list\n\nis a sequence\n\nAnswer:"
    with pytest.raises(ValueError, match=r"server.default_chat_template_kwargs must be template variables, not "
                                         r"arguments of the rendering, got \['tokenize'\]"):
        EngineConfig.from_dict({"server": {"default_chat_template_kwargs": {"tokenize": True}}})
    with running_server(model=str(model)) as s:
        c = s.client()
        usage = lambda **extra: c.chat.completions.create(  # noqa: E731
            model=model.name, messages=msgs, max_tokens=2, extra_body=extra).usage.prompt_tokens
        plain = usage()
        assert usage(chat_template_kwargs={"enable_thinking": False}) > plain
        assert usage(add_generation_prompt=False, continue_final_message=True) < plain
        for extra, param in [({"continue_final_message": True}, "continue_final_message"),
                             ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
                             ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                             ({"echo": True, "tool_choice": "required", "tools": [
                                 {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
                              "echo")]:
            with pytest.raises(openai.BadRequestError) as err:
                usage(**extra)
            assert err.value.body["param"] == param

        # echo: the continued message comes back whole, streamed or not, each choice
        def answer(**extra):
            out = c.chat.completions.create(model=model.name, messages=msgs, max_tokens=6, temperature=0, n=2,
                                            extra_body={"add_generation_prompt": False, **extra})
            return [choice.message.content for choice in out.choices]

        continued = answer(continue_final_message=True)
        assert answer(continue_final_message=True, echo=True) == ["is a sequence" + t for t in continued]
        chunks = c.chat.completions.create(model=model.name, messages=msgs, max_tokens=6, temperature=0, n=2,
                                           stream=True, extra_body={"add_generation_prompt": False,
                                                                    "continue_final_message": True, "echo": True})
        streamed = ["", ""]
        for chunk in chunks:
            for choice in chunk.choices:
                streamed[choice.index] += choice.delta.content or ""
        assert streamed == ["is a sequence" + t for t in continued]
        asked = [{"role": "user", "content": "A list"}]  # the last message is not the assistant's: nothing to echo
        plain_answer = c.chat.completions.create(model=model.name, messages=asked, max_tokens=6, temperature=0)
        echoed = c.chat.completions.create(model=model.name, messages=asked, max_tokens=6, temperature=0,
                                           extra_body={"echo": True})
        assert echoed.choices[0].message.content == plain_answer.choices[0].message.content
        assert s.idle()


def test_a_reasoning_parser_reports_the_thinking_apart_from_the_answer(tmp_path, capsys):
    """server.reasoning_parser "qwen3": a choice's `<think>...</think>` is its `reasoning` (and
    `reasoning_content`), the rest its content, streamed or not; include_reasoning false leaves it
    out; an assistant message's thinking sent back reaches the template."""
    model = thinker(tmp_path)
    with running_server(model=str(model), reasoning_parser="qwen3") as s:
        c = s.client()
        kw = dict(model=model.name, messages=[{"role": "user", "content": "A list"}], max_tokens=60, temperature=1.0,
                  seed=3, n=2)
        regex = "<think>\n[a-z]{3,8}\n</think>\n\n[a-z]{2,6}"
        forced = {"structured_outputs": {"regex": regex}}
        whole = c.chat.completions.create(**kw, extra_body=forced).choices
        for choice in whole:
            thinking = choice.message.model_extra["reasoning"]
            assert re.fullmatch("[a-z]{3,8}", thinking) and choice.message.model_extra["reasoning_content"] == thinking
            assert re.fullmatch("[a-z]{2,6}", choice.message.content)
        streamed = [["", ""], ["", ""]]
        for chunk in c.chat.completions.create(**kw, extra_body=forced, stream=True):
            for choice in chunk.choices:
                streamed[choice.index][0] += (choice.delta.model_extra or {}).get("reasoning") or ""
                streamed[choice.index][1] += choice.delta.content or ""
        assert streamed == [[w.message.model_extra["reasoning"], w.message.content] for w in whole]
        hidden = c.chat.completions.create(**kw, extra_body={**forced, "include_reasoning": False}).choices
        assert [h.message.content for h in hidden] == [w.message.content for w in whole]
        assert all("reasoning" not in (h.message.model_extra or {}) for h in hidden)
        plain = c.chat.completions.create(**kw, extra_body={"structured_outputs": {"regex": "[a-z]{2,6}"}}).choices
        assert all(re.fullmatch("[a-z]{2,6}", p.message.content) and "reasoning" not in (p.message.model_extra or {})
                   for p in plain)  # no thinking written: all content
        back = [{"role": "user", "content": "A list"},
                {"role": "assistant", "content": "yes", "reasoning": "hm"}, {"role": "user", "content": "B"}]
        r = httpx.post(f"{s.url}/tokenize", json={"messages": back})
        text = httpx.post(f"{s.url}/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
        assert text == "A list\n\n(hm)yes\n\nB\n\n"
        assert s.idle()
    with running_server(reasoning_parser="deepseek_r1") as s:  # its choices begin inside their thinking,
        c = s.client()                                            # but not a grammar's output
        answer = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A list"}], max_tokens=40,
                                           response_format={"type": "json_object"}, temperature=0)
        assert answer.choices[0].message.content.startswith("{")
        assert "reasoning" not in (answer.choices[0].message.model_extra or {})
        free = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A list"}], max_tokens=5,
                                         temperature=0)  # no </think> written: all thinking, no answer
        assert free.choices[0].message.content is None and free.choices[0].message.model_extra["reasoning"]
    with pytest.raises(ValueError, match=r"server.reasoning_parser 'nope' is not available; registered parsers: "
                                         r"\['deepseek_r1', 'qwen3'\]"):
        with running_server(reasoning_parser="nope"):
            pass
    from llmserve.cli import main
    capsys.readouterr()
    assert main(["serve", "builtin", "--device", "cpu", "--reasoning-parser", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "server.reasoning_parser 'nope' is not available" in err[0]


@pytest.mark.parametrize("kwargs,error,param", [
    (dict(model="gpt-9"), openai.NotFoundError, "model"),
    (dict(temperature=-1.0), openai.BadRequestError, "temperature"),
    (dict(top_p=1.5), openai.BadRequestError, "top_p"),
    (dict(n=0), openai.BadRequestError, "n"),
    (dict(max_tokens=100000), openai.BadRequestError, "max_tokens"),
    (dict(prompt="word " * 600), openai.BadRequestError, "prompt"),
    (dict(prompt=""), openai.BadRequestError, "prompt"),
    (dict(prompt=[1, True, 3]), openai.BadRequestError, "prompt"),  # a token id; LLM.generate refuses it too
    (dict(prompt=[[1, 2], [3.0]]), openai.BadRequestError, "prompt"),
    (dict(extra_body={"stop": [3]}), openai.BadRequestError, "stop"),
    (dict(logprobs=50), openai.BadRequestError, "logprobs"),
    (dict(logit_bias={"99999999": 1}), openai.BadRequestError, "logit_bias"),
    (dict(extra_body={"stop_token_ids": [5, 99999999]}), openai.BadRequestError, "stop_token_ids"),
    (dict(stream_options={"include_usage": True}), openai.BadRequestError, "stream_options"),  # without stream
])
def test_errors_are_typed_exceptions_naming_the_field(server, kwargs, error, param):
    args = dict(model=MODEL, prompt="The list type", max_tokens=4)
    args.update(kwargs)
    with pytest.raises(error) as info:
        server.client().completions.create(**args)
    assert info.value.body["param"] == param, info.value.body
    assert server.client().completions.create(model=MODEL, prompt="ok", max_tokens=1).choices  # still serving


def test_nullable_fields_sent_as_null_are_left_unset(server):
    """Clients in other languages send OpenAI's nullable fields as null: each takes its default."""
    nulls = dict.fromkeys(("stream", "stream_options", "n", "temperature", "top_p", "logprobs", "top_logprobs",
                           "presence_penalty", "frequency_penalty", "max_tokens", "seed", "stop", "user"))
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3, **nulls})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 1, chat.text
    nulls.pop("top_logprobs")  # (chat's)
    text = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "A list", "echo": None,
                                                            "best_of": None, "suffix": None, **nulls, "max_tokens": 3})
    assert text.status_code == 200 and text.json()["choices"][0]["logprobs"] is None, text.text
    assert httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "A", "messages": None}
                      ).status_code == 400  # (an unknown field stays one, null or not)


def test_chat_takes_a_text_response_format(server):
    c = server.client()
    msgs = [{"role": "user", "content": "hi"}]
    ok = c.chat.completions.create(model=MODEL, messages=msgs, response_format={"type": "text"}, max_completion_tokens=3)
    assert ok.usage.completion_tokens == 3


def test_async_client_concurrent_requests(server):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        outs = await asyncio.gather(*[client.completions.create(model=MODEL, prompt=f"The {w} module", max_tokens=8,
                                                                temperature=0) for w in ("os", "sys", "re", "json")])
        stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Lists"}],
                                                      max_tokens=6, stream=True, temperature=0)
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
        await client.close()
        return outs, text

    outs, text = asyncio.run(main())
    assert all(o.usage.completion_tokens == 8 for o in outs) and text


# ---- raw HTTP: malformed input, limits, operations ------------------------------------------------

def test_malformed_requests_get_openai_errors(server):
    post = lambda body, **kw: httpx.post(f"{server.url}/v1/completions", content=body,  # noqa: E731
                                         headers={"Content-Type": "application/json"}, **kw)
    r = post(b"{not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = post(b'{"prompt": "\xff\xfe", "max_tokens": 2}')
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    r = post(json.dumps({"prompt": "x", "temperature": "hot"}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = post(json.dumps({"max_tokens": 3}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = post(b'{"prompt": [5, true], "max_tokens": 2}')
    assert r.status_code == 400 and "list of token ids (integers)" in r.json()["error"]["message"]
    r = post(b"[1, 2]")
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    for options, param in (({"stream": True, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo"),
                           ({"response_format": {"type": "json_object", "strict": True}}, "response_format.strict")):
        r = post(json.dumps({"prompt": "x", "max_tokens": 2, **options}).encode())  # (options: not echoed, not lenient)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = post(json.dumps({"prompt": "x", "max_tokens": 2, "bad_words": ["w"] * 1025}).encode())
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words" and "max_bad_words is 1024" in r.text
    r = post(json.dumps({"prompt": "x" * 70000}).encode())
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]
    body = json.dumps({"prompt": "x", "max_tokens": 2}).encode()
    for encoding, sent in (("gzip", gzip.compress(body)), ("br", body)):  # (not decoded: refused, not misread)
        r = httpx.post(f"{server.url}/v1/completions", content=sent,
                       headers={"Content-Type": "application/json", "Content-Encoding": encoding})
        assert r.status_code == 415 and r.json()["error"]["param"] == "Content-Encoding", r.text
    r = httpx.post(f"{server.url}/v1/completions", content=body,
                   headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for part, param in (({"type": "text", "text": {"a": 1}}, "messages[1].content[0].text"),
                        ({"type": "image_url", "image_url": {"url": "x"}}, "messages[1].content[0].type")):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={"max_tokens": 2, "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": [part]}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_operational_endpoints(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version").json()["version"]
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    card = server.client().models.retrieve(MODEL)  # the SDK's models.retrieve: /v1/models/{id}
    assert card.id == MODEL and card.created > time.time() - 3600 and os.path.isdir(card.root)
    with pytest.raises(openai.NotFoundError) as missing:
        server.client().models.retrieve("org/other-model")
    assert missing.value.body["code"] == "model_not_found" and "org/other-model" in missing.value.body["message"]
    for path, body in (("/tokenize", {"prompt": "Hello"}), ("/detokenize", {"tokens": [5]})):
        r = httpx.post(f"{server.url}{path}", json={**body, "model": "org/other-model"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert httpx.post(f"{server.url}{path}", json={**body, "model": MODEL}).status_code == 200
    tok = httpx.post(f"{server.url}/tokenize", json={"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 512
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello world"
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [10 ** 9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tokens"
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["count"] > 0


def test_metrics(server):
    server.client().completions.create(model=MODEL, prompt="Metrics", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("llmserve_num_requests_running", "llmserve_num_requests_waiting", "llmserve_kv_cache_usage_perc",
                 "llmserve_prefix_cache_queries_total", "llmserve_prefix_cache_hits_total",
                 "llmserve_num_preemptions_total", "llmserve_prompt_tokens_total", "llmserve_generation_tokens_total",
                 f'llmserve_request_success_total{{finished_reason="length",model_name="{MODEL}"}}',
                 f'llmserve_num_requests_running{{model_name="{MODEL}"}}', "llmserve_jump_forward_tokens_total",
                 "llmserve_time_to_first_token_seconds_bucket", "llmserve_inter_token_latency_seconds_count",
                 "llmserve_e2e_request_latency_seconds_sum", "llmserve_request_queue_time_seconds_count"):
        assert name in text, name
    gen = [line for line in text.splitlines() if line.startswith("llmserve_generation_tokens_total")]
    assert float(gen[0].split()[-1]) >= 3
    value = lambda name: float(next(line for line in text.splitlines() if line.startswith(name)).split()[-1])  # noqa: E731
    for name in ("llmserve_request_prefill_time_seconds_count", "llmserve_request_decode_time_seconds_count",
                 "llmserve_request_inference_time_seconds_count", "llmserve_request_prompt_tokens_count",
                 "llmserve_request_params_n_count", "llmserve_request_params_max_tokens_count"):
        assert value(name) >= 1, name
    assert value("llmserve_request_generation_tokens_sum") >= 3 and value("llmserve_request_params_max_tokens_sum") >= 3
    assert value("llmserve_iteration_tokens_total_count") >= 2 and value("llmserve_iteration_tokens_total_sum") >= 3
    assert value('llmserve_iteration_tokens_total_bucket{le="+Inf"') == value("llmserve_iteration_tokens_total_count")
    info = next(line for line in text.splitlines() if line.startswith("llmserve_cache_config_info{"))
    labels = dict(re.findall(r'(\w+)="([^"]*)"', info))
    assert labels["block_size"] == "16" and int(labels["num_gpu_blocks"]) > 0 and info.endswith(" 1.0")


def test_openapi_document_matches_routes_and_bodies(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    app_paths = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/v1/models/{model_id}", "/v1/ws", "/health", "/version",
                 "/metrics", "/tokenize", "/detokenize", "/openapi.json"}
    assert set(doc["paths"]) == app_paths
    schemas = {"components": doc["components"]}

    def check(path, body, valid=True):
        schema = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        validator = jsonschema.Draft202012Validator({**schema, **schemas})
        assert validator.is_valid(body) == valid, body

    check("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True, "top_k": 5})
    check("/v1/completions", {"prompt": [[1, 2], [3]], "stop": ["a"], "logit_bias": {"5": 1.0}})
    check("/v1/completions", {"prompt": "hi", "temperature": "hot"}, valid=False)
    check("/v1/completions", {"max_tokens": 3}, valid=False)
    check("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True})
    check("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, valid=False)
    check("/tokenize", {"prompt": "hi"})
    check("/detokenize", {"tokens": ["x"]}, valid=False)
    # the limits the server enforces are stated: ranges, and this server's per-request bounds
    check("/v1/completions", {"prompt": "hi", "top_p": 0}, valid=False)
    check("/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-276}, valid=False)
    check("/v1/completions", {"prompt": "hi", "stop": ["a"] * 64})
    check("/v1/completions", {"prompt": "hi", "stop": ["a"] * 65}, valid=False)
    check("/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, valid=False)
    check("/v1/completions", {"prompt": "hi", "bad_words": ["a"] * 1024})
    check("/v1/completions", {"prompt": "hi", "bad_words": ["a"] * 1025}, valid=False)
    check("/v1/completions", {"prompt": ["hi"] * 257}, valid=False)
    check("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, valid=False)


def test_client_disconnect_aborts_stream_and_frees_blocks(server):
    wait_for(server.idle)
    before = server.engine.snapshot().generation_tokens
    body = {"model": MODEL, "prompt": "The list type", "max_tokens": 500, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert server.engine.snapshot().running  # still generating when we hang up
    wait_for(server.idle)
    assert server.engine.snapshot().generation_tokens - before < 250  # aborted, not run to its 500 tokens


# ---- WebSocket ---------------------------------------------------------------------------------

def ws_url(server):
    return server.url.replace("http://", "ws://") + "/v1/ws"


def collect_ws(conn, ids, timeout=30):
    """Read messages until every id in `ids` is done, cancelled or failed; returns {id: [messages]}."""
    got = {i: [] for i in ids}
    open_ids = set(ids)
    while open_ids:
        msg = json.loads(conn.recv(timeout=timeout))
        got.setdefault(msg["id"], []).append(msg)
        if msg.get("done") or msg.get("cancelled") or "error" in msg:
            open_ids.discard(msg["id"])
    return got


def ws_text(messages):
    return "".join(c["text"] for m in messages if "chunk" in m for c in m["chunk"]["choices"])


def test_websocket_streams_two_requests_on_one_socket(server):
    body = {"model": MODEL, "prompt": "The list type", "max_tokens": 12, "temperature": 0}
    http_text = server.client().completions.create(**body).choices[0].text
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "A dictionary is"}], "max_tokens": 8,
            "temperature": 0}
    with ws_client.connect(ws_url(server)) as conn:
        conn.send(json.dumps({"id": "a", "endpoint": "/v1/completions", "body": body}))
        conn.send(json.dumps({"id": "b", "endpoint": "/v1/chat/completions", "body": chat}))
        got = collect_ws(conn, ["a", "b"])
    assert got["a"][-1] == {"id": "a", "done": True} and ws_text(got["a"]) == http_text
    deltas = [c["delta"].get("content", "") for m in got["b"] if "chunk" in m for c in m["chunk"]["choices"]]
    assert "".join(deltas) == server.client().chat.completions.create(**chat).choices[0].message.content


def test_websocket_cancel_close_and_errors(server):
    wait_for(server.idle)
    long = {"model": MODEL, "prompt": "The list type", "max_tokens": 400, "ignore_eos": True}
    with ws_client.connect(ws_url(server)) as conn:
        conn.send(json.dumps({"id": "x", "body": long}))
        first = json.loads(conn.recv(timeout=30))
        assert first["id"] == "x" and "chunk" in first
        conn.send(json.dumps({"id": "x", "cancel": True}))
        got = collect_ws(conn, ["x"])
        assert got["x"][-1] == {"id": "x", "cancelled": True}
        conn.send(json.dumps({"id": "bad", "body": {"prompt": "x", "temperature": -3}}))
        err = collect_ws(conn, ["bad"])["bad"][-1]
        assert err["error"]["param"] == "temperature"
        conn.send(json.dumps({"id": "beams", "body": {"prompt": "x", "max_tokens": 2, "use_beam_search": True}}))
        assert collect_ws(conn, ["beams"])["beams"][-1]["error"]["param"] == "use_beam_search"  # not streamed
        conn.send("not json")
        assert "error" in json.loads(conn.recv(timeout=10))
        before = server.engine.snapshot().generation_tokens
        for i in range(4):  # max_ws_requests is 3
            conn.send(json.dumps({"id": f"r{i}", "body": long}))
        got = collect_ws(conn, ["r3"])
        assert got["r3"][-1]["error"]["code"] == "too_many_requests"
        wait_for(lambda: server.engine.snapshot().running)
    # Closing the socket aborted r0..r2 long before their 3 x 400 tokens.
    wait_for(server.idle)
    assert server.engine.snapshot().generation_tokens - before < 600


# ---- configuration-dependent behaviour --------------------------------------------------------------

def test_api_key():
    with running_server(api_key="s3cret") as s:
        with pytest.raises(openai.AuthenticationError):
            s.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert s.client(api_key="s3cret").completions.create(model=MODEL, prompt="x", max_tokens=1).choices
        assert httpx.get(f"{s.url}/health").status_code == 200 and httpx.get(f"{s.url}/metrics").status_code == 200
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        with pytest.raises(Exception):
            with ws_client.connect(ws_url(s)) as conn:
                conn.recv(timeout=5)


def test_vllms_api_key_variable_guards_the_server_too(monkeypatch):
    monkeypatch.delenv("LLMSERVE_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    with running_server() as s:
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        assert httpx.get(f"{s.url}/v1/models", headers={"Authorization": "Bearer vk"}).status_code == 200


def test_several_served_names_and_api_keys():
    """vLLM's lists: a request may name any served name (its response reports that one; the first
    where it names none) and carry any key."""
    with running_server(served_model_name=["main", "org/alias"], api_key=["k1", "k2"]) as s:
        for key in ("k1", "k2"):
            out = s.client(api_key=key).completions.create(model="org/alias", prompt="x", max_tokens=1)
            assert out.model == "org/alias"
        unnamed = httpx.post(f"{s.url}/v1/chat/completions", headers={"Authorization": "Bearer k1"},
                             json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 1})
        assert unnamed.json()["model"] == "main"
        r = s.client(api_key="k2").responses.create(model="org/alias", input="x", max_output_tokens=1)
        assert r.model == "org/alias"
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="k3").completions.create(model="main", prompt="x", max_tokens=1)
        with pytest.raises(openai.NotFoundError):
            s.client(api_key="k1").completions.create(model=MODEL, prompt="x", max_tokens=1)
        assert [m.id for m in s.client(api_key="k2").models.list()] == ["main", "org/alias"]
        assert s.client(api_key="k2").models.retrieve("org/alias").id == "org/alias"


def test_vllms_serving_switches():
    """--enable-prompt-tokens-details, --enable-force-include-usage, --return-tokens-as-token-ids
    and --enable-request-id-headers, each as vLLM has it."""
    with running_server(enable_prompt_tokens_details=True, enable_force_include_usage=True,
                        return_tokens_as_token_ids=True, enable_request_id_headers=True) as s:
        c = s.client()
        prompt = "The list type is a mutable sequence of items, and the tuple type is an immutable one " * 2
        first = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        again = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=1)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens >= 16  # its first blocks, from the cache
        assert all(re.fullmatch(r"token_id:\d+", t) for t in again.choices[0].logprobs.tokens)
        as_text = c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": False})
        assert not any(t.startswith("token_id:") for t in as_text.choices[0].logprobs.tokens)
        chunks = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=3, stream=True))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
        counted = list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=3, stream=True,
                                                 stream_options={"continuous_usage_stats": True}))
        assert all(chunk.usage is not None for chunk in counted)  # (as vLLM forces it: usage on every chunk)
        given = httpx.get(f"{s.url}/v1/models", headers={"X-Request-Id": "abc-1"})
        assert given.headers["X-Request-Id"] == "abc-1"
        assert re.fullmatch("[0-9a-f]{32}", httpx.get(f"{s.url}/health").headers["X-Request-Id"])
    with running_server() as s:  # the defaults: none of it
        out = s.client().completions.create(model=MODEL, prompt="The list", max_tokens=2, logprobs=1)
        assert out.usage.prompt_tokens_details is None and "X-Request-Id" not in httpx.get(f"{s.url}/health").headers
        assert not any(t.startswith("token_id:") for t in out.choices[0].logprobs.tokens)
        chunks = list(s.client().completions.create(model=MODEL, prompt="The list", max_tokens=2, stream=True))
        assert all(chunk.usage is None for chunk in chunks)


def test_vllms_request_id(server):
    """The response's id is made of the request's X-Request-Id header, else its request_id; two
    requests under one id both run (the engine tells them apart), neither hurting the other."""
    c = server.client()
    out = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                    extra_body={"request_id": "trace-7"})
    assert out.id == "chatcmpl-trace-7"
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "request_id": "body"},
                   headers={"X-Request-Id": "from-proxy"})
    assert r.json()["id"] == "cmpl-from-proxy"  # (vLLM's order)
    body = {"prompt": "The list", "max_tokens": 400, "n": 8, "ignore_eos": True, "stream": True, "request_id": "twice"}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{server.url}/v1/completions", json=body) as first:
        lines = first.iter_lines()  # (kept: a dropped iterator closes the stream)
        assert next(lines).startswith("data: ")
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as second:  # left early: aborted,
            assert next(second.iter_lines()).startswith("data: ")                     # it alone
        again = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False, "max_tokens": 2, "n": 1})
        assert again.status_code == 200 and again.json()["id"] == "cmpl-twice"
        events = [line for line in lines if line]  # the first one was not hurt
    assert events[-1] == "data: [DONE]" and '"finish_reason": "length"' in events[-2]
    beam = {"prompt": "The list", "max_tokens": 8, "n": 4, "use_beam_search": True, "request_id": "b"}
    with ThreadPoolExecutor(4) as pool:  # beam searches under one id at once: each step's ids stay apart
        beams = list(pool.map(lambda _: httpx.post(f"{server.url}/v1/completions", json=beam, timeout=60), range(4)))
    assert [b.status_code for b in beams] == [200] * 4


def test_https_with_a_certificate(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    with running_server(ssl_certfile=str(cert), ssl_keyfile=str(key)) as s:
        url = s.url.replace("http://", "https://")
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "The list", "max_tokens": 2}, verify=str(cert))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        with pytest.raises(httpx.TransportError):  # it speaks TLS only
            httpx.get(f"{s.url}/health")


def test_full_queue_answers_503_with_retry_after():
    with running_server(max_waiting_requests=1, scheduler={"max_num_seqs": 1}) as s:
        body = {"model": MODEL, "prompt": "The list type", "max_tokens": 300, "ignore_eos": True}

        async def until(cond):
            deadline = time.monotonic() + 15
            while not cond(s.engine.snapshot()):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)

        async def main():
            async with httpx.AsyncClient(timeout=60) as http:
                post = lambda: asyncio.create_task(http.post(f"{s.url}/v1/completions", json=body))  # noqa: E731
                busy = [post()]
                await until(lambda snap: snap.generation_tokens > 0)  # the one seat is taken, first token out...
                busy.append(post())
                await until(lambda snap: snap.waiting == 1)  # ...and the queue is full
                rejected = await http.post(f"{s.url}/v1/completions", json=body)
                return rejected, await asyncio.gather(*busy)

        rejected, done = asyncio.run(main())
        assert rejected.status_code == 503 and rejected.headers["Retry-After"] == "1"
        assert rejected.json()["error"]["code"] == "overloaded"
        assert all(r.status_code == 200 for r in done)


def test_server_stops_with_an_error_when_its_engine_process_dies():
    config = EngineConfig.from_dict({"model": {"model": "builtin", "device": "cpu", "dtype": "float32"},
                                     "cache": {"num_blocks": 64, "block_size": 16},
                                     "server": {"port": 0, "engine_process": True}})
    engine = ProcessEngine(config)
    body = {"model": MODEL, "prompt": "The list type", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with start_blocking_portal("asyncio") as portal:
        future, port = portal.start_task(partial(serve, config, handle_signals=False, engine=engine))
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            os.kill(engine.pid, signal.SIGKILL)
            events = [line for line in lines if line]
        with pytest.raises(BaseException) as info:
            future.result(timeout=30)
    # The stream in flight ends with an in-band error, then [DONE]; the server exits with the cause.
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "engine process died (exit code -9)" in error["message"]
    leaf = info.value
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    assert type(leaf).__name__ == "EngineProcessError" and "exit code -9" in str(leaf)
    with pytest.raises(httpx.TransportError):  # and it no longer listens
        httpx.get(f"{url}/health", timeout=2)


def test_llmserve_command_serves_the_builtin_model_and_stops_on_sigterm(tmp_path):
    proc, url, log = launched([sys.executable, "-m", "llmserve.cli", "--config", str(ROOT / "config.example.toml")])
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "The list type"}],
                                               max_tokens=20, temperature=0)
        words = reply.choices[0].message.content.split()
        assert len(words) >= 5 and sum(w.strip(".,:;()*`'\"").isalpha() for w in words) >= len(words) // 2
        # SIGTERM mid-stream: the stream still completes within the grace period, then the process exits 0.
        stream = client.completions.create(model=MODEL, prompt="The list type", max_tokens=200,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [next(stream)]
        proc.send_signal(signal.SIGTERM)
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=30) == 0
        log += proc.stdout.read()
        assert "serving" in log and "llmserve-builtin" in log and "shutting down" in log
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- shutdown ---------------------------------------------------------------------------------------

def launch(tmp_path, **server) -> tuple[subprocess.Popen, str]:
    """`llmserve --config` on the built-in model with these [server] keys; temporary files (the
    engine's socket) under tmp_path. Returns once it serves."""
    keys = "\n".join(f"{k} = {json.dumps(v)}" for k, v in server.items())
    (tmp_path / "config.toml").write_text(f'[model]\nmodel = "builtin"\ndevice = "cpu"\n[scheduler]\n'
                                          f'log_interval_s = 0\n[server]\n{keys}\n')
    proc, url, _ = launched([sys.executable, "-m", "llmserve.cli", "--config", str(tmp_path / "config.toml")],
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    return proc, url


LONG_STREAM = {"model": MODEL, "prompt": "The list type", "max_tokens": 400, "n": 16, "ignore_eos": True,
               "stream": True}


def read_events(lines) -> list:
    return [json.loads(d) if d != "[DONE]" else d for d in (ln.removeprefix("data: ") for ln in lines if ln)]


def test_at_the_end_of_the_grace_streams_end_with_an_error_and_idle_sockets_close_at_once(tmp_path):
    proc, url = launch(tmp_path, shutdown_grace_s=1.0)
    try:
        ws = url.replace("http://", "ws://") + "/v1/ws"
        with ws_client.connect(ws) as idle, ws_client.connect(ws) as busy, \
                httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=LONG_STREAM) as r:
            busy.send(json.dumps({"id": "w", "body": {k: v for k, v in LONG_STREAM.items() if k != "stream"}}))
            assert "chunk" in json.loads(busy.recv(timeout=10))
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            with pytest.raises(websockets.ConnectionClosed) as closed:
                idle.recv(timeout=10)
            assert closed.value.rcvd.code == 1001 and time.monotonic() - t0 < 0.9  # before the grace ends
            events = read_events(lines)
            last = None
            with pytest.raises(websockets.ConnectionClosed) as closed:
                while True:
                    last = json.loads(busy.recv(timeout=10))
            assert last == {"id": "w", "cancelled": True, "reason": "server shutting down"}
            assert closed.value.rcvd.code == 1001
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutdown", events[-3:]
        assert 0.9 < time.monotonic() - t0 < 8
        assert not any(c["finish_reason"] for e in events[:-2] for c in e["choices"])  # it was cut, and says so
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_second_signal_ends_the_requests_at_once_and_cleans_up(tmp_path, sig):
    proc, url = launch(tmp_path, shutdown_grace_s=60.0)
    try:
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=LONG_STREAM) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: {")
            proc.send_signal(sig)
            assert next(lines) == "" and next(lines).startswith("data: {")  # the grace: it goes on
            t0 = time.monotonic()
            proc.send_signal(sig)
            events = read_events(lines)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutdown"
        assert proc.wait(timeout=30) == 0 and time.monotonic() - t0 < 10
        log = proc.stdout.read()
        assert "second signal" in log and "Traceback" not in log, log
        assert not list(tmp_path.glob("llmserve-*"))  # the engine's socket and its directory are gone
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_base_checkpoint_chats_with_the_servers_chat_template(checkpoint, tmp_path):
    """A tokenizer without a chat template: chat is a 400 saying how to give one; with
    server.chat_template (a file) the messages render through it; a per-request template is refused."""
    base = tmp_path / "base"
    shutil.copytree(checkpoint("llama"), base)
    (base / "chat_template.jinja").unlink()
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yo"}]
    with running_server(model=str(base)) as s:
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 400 and "server.chat_template" in r.json()["error"]["message"]
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    with running_server(model=str(base), chat_template=str(template)) as s:
        tokens = httpx.post(f"{s.url}/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        text = httpx.post(f"{s.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert text == "<user>Hi<assistant>yo"
        r = httpx.post(f"{s.url}/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
        r = httpx.post(f"{s.url}/v1/chat/completions",
                       json={"messages": messages, "max_tokens": 2, "chat_template": "{{ 'x' }}"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


def test_a_chat_template_setting_that_is_neither_file_nor_template_stops_start_up():
    from llmserve.server.chat_template import load_chat_template
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    with pytest.raises(ValueError, match="server.chat_template: 'missing.jinja' is neither a file nor a Jinja template"):
        load_chat_template("missing.jinja")


def test_unknown_fields_are_refused_and_openais_advisory_ones_accepted(server):
    """OpenAI's API answers an unknown argument with a 400: so does this server, naming it; the
    fields OpenAI documents as advisory are accepted; those it defines and this server cannot honour
    are refused by name; messages a client sends back keep the fields they came with."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for url, body in ((f"{server.url}/v1/chat/completions", chat),
                      (f"{server.url}/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}),
                      (f"{server.url}/tokenize", {"prompt": "Hi"}), (f"{server.url}/detokenize", {"tokens": [5]})):
        r = httpx.post(url, json={**body, "beam_search_width": 2})  # no API has it
        assert r.status_code == 400 and r.json()["error"]["param"] == "beam_search_width", url
        assert "not a field of this request" in r.json()["error"]["message"]
    advisory = {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                "prompt_cache_key": "p", "safety_identifier": "s"}
    assert httpx.post(f"{server.url}/v1/chat/completions", json={**chat, **advisory}).status_code == 200
    for field, value in (("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "x"}),
                         ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
                         ("reasoning_effort", "low"), ("web_search_options", {})):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, field
    assert httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "modalities": ["text"]}).status_code == 200
    echoed = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "yo", "refusal": None,
                                                  "annotations": []}, {"role": "user", "content": "and?"}]
    assert httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "messages": echoed}).status_code == 200


def test_metrics_under_vllms_names_for_its_dashboards():
    """server.metrics_prefix = "vllm:": the same series under vLLM's own names, with model_name."""
    with running_server(metrics_prefix="vllm:", served_model_name="m") as s:
        # (ignore_eos: a sampled end of sequence within two tokens would finish it as "stop")
        s.client().completions.create(model="m", prompt="Metrics", max_tokens=2, extra_body={"ignore_eos": True})
        text = httpx.get(f"{s.url}/metrics").text
    for name in ('vllm:num_requests_waiting{model_name="m"}', 'vllm:kv_cache_usage_perc{model_name="m"}',
                 'vllm:generation_tokens_total{model_name="m"}', 'vllm:request_success_total{finished_reason="length",model_name="m"}',
                 'vllm:time_to_first_token_seconds_bucket{le="0.005",model_name="m"}',
                 'vllm:e2e_request_latency_seconds_count{model_name="m"}',
                 'vllm:iteration_tokens_total_bucket{le="8.0",model_name="m"}', 'vllm:cache_config_info{block_size="16"'):
        assert name in text, name
    assert "llmserve_" not in text
