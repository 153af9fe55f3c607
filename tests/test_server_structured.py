"""Structured outputs over HTTP through the `openai` client, with the engine on the server's loop
and in its own process (where compiled grammars cross as files): response_format, vLLM's
structured_outputs, streaming, and 400s that name the field."""

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from servers import MODEL, running_server

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "kind": {"enum": ["module", "function", "class"]}},
          "required": ["name", "count", "kind"], "additionalProperties": False}
MSGS = [{"role": "user", "content": "Describe the os module as JSON."}]


class Item(BaseModel):
    name: str = Field(max_length=8)
    count: int = Field(ge=0, le=99)
    kind: str = Field(pattern="^(module|function)$")


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def server(request):
    with running_server(request.param == "engine-process") as s:
        yield s


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_response_format_validates(server, temperature):
    c = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    out = c.chat.completions.create(model=MODEL, messages=MSGS, response_format=fmt, max_completion_tokens=80,
                                    temperature=temperature, seed=1, n=3)
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_the_clients_parse_with_a_pydantic_model(server):
    out = server.client().chat.completions.parse(model=MODEL, messages=MSGS, response_format=Item,
                                                  max_completion_tokens=80, temperature=0.7, seed=2)
    item = out.choices[0].message.parsed
    assert isinstance(item, Item) and item.kind in ("module", "function")


def test_json_object_streamed(server):
    stream = server.client().chat.completions.create(model=MODEL, messages=MSGS, response_format={"type": "json_object"},
                                                     max_completion_tokens=120, temperature=0.0, stream=True)
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text.startswith("{")
    if chunks[-1].choices and chunks[-1].choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_vllm_structured_outputs_on_completions(server):
    c = server.client()
    regex = c.completions.create(model=MODEL, prompt="The answer is", max_tokens=20, temperature=0.8, seed=4,
                                 extra_body={"structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}})
    assert re.fullmatch("[0-9]{2}-[a-z]{3}", regex.choices[0].text)
    choice = c.completions.create(model=MODEL, prompt="Pick:", max_tokens=10, temperature=1.0, seed=5,
                                  extra_body={"structured_outputs": {"choice": ["list", "dict", "tuple"]}})
    assert choice.choices[0].text in ("list", "dict", "tuple")


@pytest.mark.parametrize("body, param, match", [
    ({"guided_json": SCHEMA}, "guided_json", r"guided_json is no longer supported: send structured_outputs"),
    ({"guided_choice": ["a"]}, "guided_choice", r"send structured_outputs: \{\"choice\""),
    ({"response_format": {"type": "json_object"}, "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     r"guided_decoding_backend is not supported: the grammar engine is the server's"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "guided_whitespace_pattern is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", r"response_format\.json_schema\.schema: .*nope"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema is required"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "response_format"),
    ({"structured_outputs": {"regex": "a("}}, "structured_outputs", r"structured_outputs\.regex: .*parenthesis"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs",
     "send one"),
    ({"structured_outputs": {"regex": "a"}, "ignore_eos": True}, "ignore_eos", "ignore_eos must be false"),
    ({"structured_outputs": {"regex": "a"}, "min_tokens": 3}, "min_tokens", "min_tokens must be 0"),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "structured_outputs", "the grammar admits no output"),
])
def test_bad_structured_requests_are_400s_naming_the_field(server, body, param, match):
    with pytest.raises(openai.BadRequestError, match=match) as info:
        server.client().chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=5,
                                                extra_body=body)
    assert info.value.body["param"] == param
    assert server.client().completions.create(model=MODEL, prompt="ok", max_tokens=1).choices  # still serving


def test_a_wide_anyof_is_served(server):
    """600 branches: written for the engine process as its source (compiled there), not xgrammar's
    serialization, which grows with the square of the branches (~4 GB here)."""
    wide = {"anyOf": [{"type": "object", "properties": {"name": {"const": f"f{i}"}, "x": {"type": "integer"}},
                       "required": ["name", "x"], "additionalProperties": False} for i in range(600)]}
    fmt = {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide}}
    out = server.client().chat.completions.create(model=MODEL, messages=MSGS, response_format=fmt,
                                                  max_completion_tokens=60, seed=0)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), wide)


def test_constraints_that_exclude_each_other_midway_are_a_400(server):
    """allowed_token_ids that can begin the choice but not go on with it: the request fails where
    no token is left (its own parameters' fault), and the server goes on serving."""
    def ids(text):
        return httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]

    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "allowed_token_ids": ids("y") + ids("7"),
            "structured_outputs": {"choice": ["yes"]}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs", r.text
    assert "no token may come next" in r.json()["error"]["message"]
    assert server.client().completions.create(model=MODEL, prompt="ok", max_tokens=1).choices


def test_a_websocket_request_takes_the_same_fields(server):
    import websockets.sync.client as ws_client
    from test_server import collect_ws, ws_text, ws_url

    body = {"model": MODEL, "prompt": "The answer is", "max_tokens": 20, "temperature": 0.5, "seed": 6,
            "structured_outputs": {"regex": "[0-9]{2}-[a-z]{3}"}}
    with ws_client.connect(ws_url(server)) as conn:
        conn.send(json.dumps({"id": "ok", "endpoint": "/v1/completions", "body": body}))
        conn.send(json.dumps({"id": "bad", "endpoint": "/v1/completions",
                              "body": {**body, "structured_outputs": {"regex": "a("}}}))
        got = collect_ws(conn, ["ok", "bad"])
    assert got["ok"][-1] == {"id": "ok", "done": True} and re.fullmatch("[0-9]{2}-[a-z]{3}", ws_text(got["ok"]))
    assert got["bad"][-1]["error"]["param"] == "structured_outputs"
