"""Tool calling over HTTP through the `openai` client: tool_choice named and required (constrained
to the tools' schemas), auto (the hermes parser reading the model's own `<tool_call>` blocks,
forced here by a regex), none; streamed deltas that add up to the unstreamed message; the chat
template seeing tools and earlier calls; 400s that name the field; the parser chosen by config."""

import json
import shutil

import httpx
import jsonschema
import openai
import pytest
from servers import MODEL, running_server

from llmserve.engine import BUILTIN_MODEL_DIR
from llmserve.hookspecs import hookimpl
from llmserve.plugin_manager import get_plugin_manager
from llmserve.tool_parsers import ArgumentsPiece, CallStart

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "days"], "additionalProperties": False}
LOOKUP = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12}, "exact": {"type": "boolean"}},
          "required": ["query", "exact"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}},
         {"type": "function", "function": {"name": "now"}}]
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP, "now": {"type": "object", "maxProperties": 0}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HERMES_REGEX = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}"\}\}\n</tool_call>'

# A template that writes the tools and earlier calls out (arguments with tojson, as Qwen's does).
TEMPLATE = (
    "{% if tools %}# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<tool_response id={{ m['tool_call_id'] }}>{{ m['content'] }}</tool_response>"
    "{% elif m['tool_calls'] is defined %}{{ m['content'] }}{% for c in m['tool_calls'] %}<tool_call>\n"
    "{{ {'name': c['function']['name'], 'arguments': c['function']['arguments']} | tojson }}\n</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}\n\n{% endfor %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    model = tmp_path_factory.mktemp("tools") / "llmserve-builtin"
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    return model


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def server(request, model_dir):
    with running_server(request.param == "engine-process", model=str(model_dir)) as s:
        yield s


def create(server, **kw):
    args = dict(model=MODEL, messages=MSGS, tools=TOOLS, max_completion_tokens=120, seed=7)
    return server.client().chat.completions.create(**{**args, **kw})


def streamed(server, **kw):
    """The streamed response accumulated the way the openai SDK does it (strings added up by key,
    tool calls by index), and its chunks."""
    from openai.lib.streaming._deltas import accumulate_delta

    chunks = list(create(server, stream=True, **kw))
    messages, finish = {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            messages[c.index] = accumulate_delta(messages.get(c.index, {}), c.delta.to_dict())
            finish[c.index] = c.finish_reason or finish.get(c.index)
    choices = [openai.types.chat.chat_completion.Choice(index=i, finish_reason=finish[i], message=messages[i])
               for i in sorted(messages)]
    return openai.types.chat.ChatCompletion(id=chunks[0].id, choices=choices, created=0, model=MODEL,
                                            object="chat.completion"), chunks


def check_calls(message, names=None):
    assert message.content is None and message.tool_calls
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def check_deltas(chunks):
    """Each call's first delta carries id, type, name and arguments "" (and nothing of it comes
    again); the following ones only argument pieces."""
    started = set()
    for chunk in chunks:
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                key = (choice.index, d.index)
                if key not in started:
                    assert d.id.startswith("call_") and d.type == "function" and d.function.name
                    assert d.function.arguments == ""
                    started.add(key)
                else:
                    assert d.id is None and d.type is None and d.function.name is None and d.function.arguments
    return started


# ---- named and required: constrained to the tools' schemas -----------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_named_tool_choice_gives_that_call_streamed_or_not(server, temperature):
    out = create(server, tool_choice=NAMED, temperature=temperature, n=2)
    for choice in out.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message, {"get_weather"})
        assert len(choice.message.tool_calls) == 1
    final, chunks = streamed(server, tool_choice=NAMED, temperature=temperature, n=2)
    assert len(check_deltas(chunks)) == 2
    for a, b in zip(out.choices, final.choices):
        assert b.finish_reason == "tool_calls" and b.message.content is None
        assert [c.function.arguments for c in a.message.tool_calls] == [c.function.arguments for c in b.message.tool_calls]


def test_the_sdks_stream_helper_puts_the_calls_together(server):
    args = dict(model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=NAMED, max_completion_tokens=120, seed=3,
                temperature=1.0)
    c = server.client()
    with c.chat.completions.stream(**args) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    whole = c.chat.completions.create(**args).choices[0].message.tool_calls[0].function
    call = final.choices[0].message.tool_calls[0].function
    assert (call.name, call.arguments) == (whole.name, whole.arguments)
    assert "tool_calls.function.arguments.done" in events and final.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("parallel", [False, True])
def test_required_gives_calls_of_the_tools_streamed_or_not(server, temperature, parallel):
    kw = dict(tool_choice="required", temperature=temperature, parallel_tool_calls=parallel, n=3,
              max_completion_tokens=200)
    out = create(server, **kw)
    final, chunks = streamed(server, **kw)
    assert len(check_deltas(chunks)) == sum(len(c.message.tool_calls) for c in final.choices)
    for a, b in zip(out.choices, final.choices):
        if a.finish_reason == "length":  # a random model may list calls until max_tokens
            assert parallel and a.message.tool_calls
            continue
        assert a.finish_reason == b.finish_reason == "tool_calls"
        check_calls(a.message, set(SCHEMAS))
        if not parallel:
            assert len(a.message.tool_calls) == 1
        assert [(c.function.name, c.function.arguments) for c in a.message.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in b.message.tool_calls]


def test_usage_counts_every_choice_streamed_or_not(server):
    kw = dict(tool_choice="required", temperature=1.0, n=3, max_completion_tokens=60)
    out = create(server, **kw)
    chunks = list(create(server, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].usage == out.usage and out.usage.completion_tokens > 3
    plain = server.client().chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=1)
    assert out.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools are in the prompt


def test_an_output_cut_by_length_reports_what_it_has(server):
    out = create(server, tool_choice=NAMED, max_completion_tokens=4, temperature=0.0)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls[0].function.name == "get_weather"
    args = choice.message.tool_calls[0].function.arguments
    assert args.startswith("{") and out.usage.completion_tokens == 4
    final, _ = streamed(server, tool_choice=NAMED, max_completion_tokens=4, temperature=0.0)
    assert final.choices[0].finish_reason == "length" and final.choices[0].message.tool_calls[0].function.arguments == args
    cut = create(server, tool_choice="required", max_completion_tokens=3, temperature=0.0)
    assert cut.choices[0].finish_reason == "length"  # `[{"name` at most: no call begun, no crash


# ---- auto: the model's own format, parsed -------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", "Sure. "])
def test_auto_parses_the_models_hermes_calls(server, prefix):
    regex = prefix.replace(".", r"\.") + HERMES_REGEX
    kw = dict(extra_body={"structured_outputs": {"regex": regex}}, temperature=1.0, n=2)
    out = create(server, tool_choice="auto", **kw)
    final, chunks = streamed(server, **kw)  # (auto is the default with tools)
    check_deltas(chunks)
    for a, b in zip(out.choices, final.choices):
        assert a.finish_reason == b.finish_reason == "tool_calls"
        assert a.message.content == b.message.content == (prefix.strip() or None)
        (call,) = a.message.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
        assert [(c.function.name, c.function.arguments) for c in b.message.tool_calls] == \
            [(call.function.name, call.function.arguments)]
    assert not any("<tool" in (c.delta.content or "") for ch in chunks for c in ch.choices)


def test_auto_without_calls_and_none_give_content(server):
    plain = create(server, tool_choice="auto", temperature=0.0, max_completion_tokens=12)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "length"
    forced = dict(extra_body={"structured_outputs": {"regex": HERMES_REGEX}}, temperature=0.0)
    none = create(server, tool_choice="none", **forced)
    assert none.choices[0].message.tool_calls is None and none.choices[0].finish_reason == "stop"
    assert none.choices[0].message.content.startswith('<tool_call>\n{"name": "get_weather"')
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # the template still saw the tools
    final, _ = streamed(server, tool_choice="none", **forced)
    assert final.choices[0].message.content == none.choices[0].message.content


def test_parallel_tool_calls_false_keeps_the_first_call(server):
    two = HERMES_REGEX + "\n" + HERMES_REGEX.replace("get_weather", "lookup").replace("city", "query")
    kw = dict(extra_body={"structured_outputs": {"regex": two}}, temperature=1.0)
    both = create(server, **kw)
    assert [c.function.name for c in both.choices[0].message.tool_calls] == ["get_weather", "lookup"]
    one = create(server, parallel_tool_calls=False, **kw)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]
    final, _ = streamed(server, parallel_tool_calls=False, **kw)
    assert [c.function.name for c in final.choices[0].message.tool_calls] == ["get_weather"]


# ---- the prompt -------------------------------------------------------------------------------------

def rendered(server, **body):
    r = httpx.post(f"{server.url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return httpx.post(f"{server.url}/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]


def test_the_template_gets_the_tools_and_earlier_calls(server):
    assert rendered(server, messages=MSGS, tools=TOOLS).startswith('# Tools\n{"type": "function", "function": '
                                                                    '{"name": "get_weather", "description": "Weather"')
    assert "# Tools" not in rendered(server, messages=MSGS)
    turns = MSGS + [
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get_weather", "arguments": '{"city": "paris", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = rendered(server, messages=turns, add_generation_prompt=False)
    # (transformers renders with trim_blocks: the newline right after a tag goes)
    assert text == (MSGS[0]["content"] + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris", '
                    '"days": 2}}\n</tool_call>\n<tool_response id=call_1>sunny</tool_response>\n')
    out = create(server, messages=turns, tool_choice="none", max_completion_tokens=3)
    assert out.choices[0].message.content is not None and out.usage.prompt_tokens > create(
        server, tool_choice="none", max_completion_tokens=3).usage.prompt_tokens


# ---- refused -----------------------------------------------------------------------------------------

def tool(name="f", parameters=None):
    return {"type": "function", "function": {"name": name, **({"parameters": parameters} if parameters else {})}}


ASSISTANT = {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                  "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("body, param, match", [
    ({"tools": []}, "tools", "must not be empty"),
    ({"tools": [tool(f"f{i}") for i in range(129)]}, "tools", "at most 128 functions, got 129"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", "function"),
    ({"tools": [tool("get weather")]}, "tools[0].function.name", "letters, digits"),
    ({"tools": [tool("f"), tool("g"), tool("f")]}, "tools[2].function.name", "also the name of tools\\[0\\]"),
    ({"tools": [tool("f", {"type": "array"})]}, "tools[0].function.parameters", "must be \"object\""),
    ({"tools": [tool("f", {"type": "object", "required": "a"})]}, "tools[0].function.parameters", "required"),
    ({"tools": [tool("f", {"type": "object", "properties": {"a": {"type": "nope"}}})],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools[0].function.parameters", "nope"),
    ({"tools": [tool("f"), tool("g", {"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 2}}})],
      "tool_choice": "required"}, "tools[1].function.parameters", "multipleOf"),
    ({"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice",
     "not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when tools are given"),
    ({"tools": [tool("f")], "tool_choice": "sometimes"}, "tool_choice", "it takes \"none\", \"auto\""),
    ({"tools": [tool("f")], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": [tool("f")], "tool_choice": {"type": "function", "function": {"name": "f"}},
      "structured_outputs": {"regex": "a"}}, "tool_choice", "cannot be combined"),
    ({"tools": [tool("f")], "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
    ({"messages": MSGS + [ASSISTANT, {"role": "tool", "content": "x"}]}, "messages[2].tool_call_id", "needs"),
    ({"messages": MSGS + [{**ASSISTANT, "tool_calls": [{**ASSISTANT["tool_calls"][0], "function": {
        "name": "f", "arguments": "{oops"}}]}]}, "messages[1].tool_calls[0].function.arguments", "not valid JSON"),
    *[({"messages": MSGS + [{**ASSISTANT, "tool_calls": [{**ASSISTANT["tool_calls"][0], "function": {
        "name": "f", "arguments": arguments}}]}]}, "messages[1].tool_calls[0].function.arguments", match)
      for arguments, match in (('{"a": ' + "[" * 5000 + "]" * 5000 + "}", "nested more than 64 levels"),
                               ('{"a": ' + "[" * 100 + "]" * 100 + "}", "nested more than 64 levels"),
                               ('{"a": 1' + "0" * 10000 + "}", "not acceptable JSON"),
                               ('{"a": NaN}', "NaN is not a JSON number"),
                               ('{"a": "\\ud800"}', "lone UTF-16 surrogate"),
                               ('{"\\udfff": 1}', "lone UTF-16 surrogate"))],
    ({"messages": MSGS + [{**ASSISTANT, "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].id", "required"),
    ({"messages": [{**MSGS[0], "tool_calls": ASSISTANT["tool_calls"]}]}, "messages[0].tool_calls", "only assistant"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server, body, param, match):
    body = dict(body)
    with pytest.raises(openai.BadRequestError, match=match) as info:
        server.client().chat.completions.create(model=MODEL, messages=body.pop("messages", MSGS),
                                                max_completion_tokens=5, extra_body=body)
    assert info.value.body["param"] == param
    if "tools" in body:
        r = httpx.post(f"{server.url}/tokenize", json={"messages": MSGS, "tools": body["tools"]})
        assert r.status_code == 200 or r.json()["error"]["param"] == param
    assert create(server, max_completion_tokens=1).choices  # still serving


def test_a_websocket_chat_streams_tool_calls(server):
    import websockets.sync.client as ws_client
    from test_server import collect_ws, ws_url

    body = {"model": MODEL, "messages": MSGS, "tools": TOOLS, "tool_choice": "required", "temperature": 0.0,
            "max_tokens": 120, "parallel_tool_calls": False}
    with ws_client.connect(ws_url(server)) as conn:
        conn.send(json.dumps({"id": "t", "endpoint": "/v1/chat/completions", "body": body}))
        got = collect_ws(conn, ["t"])["t"]
    assert got[-1] == {"id": "t", "done": True}
    choices = [c for m in got[:-1] for c in m["chunk"]["choices"]]
    name = "".join(d["function"].get("name") or "" for c in choices for d in c["delta"].get("tool_calls", []))
    args = "".join(d["function"]["arguments"] for c in choices for d in c["delta"].get("tool_calls", []))
    whole = create(server, tool_choice="required", temperature=0.0, parallel_tool_calls=False).choices[0]
    assert (name, args) == (whole.message.tool_calls[0].function.name, whole.message.tool_calls[0].function.arguments)
    assert choices[-1]["finish_reason"] == "tool_calls"


# ---- the parser the server uses ----------------------------------------------------------------------

class Bracketed:
    """A toy format for a plugin's parser: `[[name]]` is a call without arguments."""

    def __init__(self, tools):
        self.text = ""

    def feed(self, text):
        self.text += text
        return []

    def finish(self):
        if self.text.startswith("[[") and self.text.endswith("]]"):
            return [CallStart(0, self.text[2:-2]), ArgumentsPiece(0, "{}")]
        return [self.text]


class BracketedPlugin:
    @hookimpl
    def llmserve_register_tool_parsers(self, register):
        register("bracketed", Bracketed)


def test_server_tool_call_parser_picks_a_plugins_parser(model_dir):
    pm = get_plugin_manager()
    plugin = BracketedPlugin()
    pm.register(plugin, name="bracketed")
    try:
        with running_server(model=str(model_dir), tool_call_parser="bracketed") as s:
            out = create(s, extra_body={"structured_outputs": {"regex": r"\[\[now\]\]"}})
            assert out.choices[0].message.tool_calls[0].function.name == "now"
            assert out.choices[0].finish_reason == "tool_calls"
    finally:
        pm.unregister(plugin)


def test_an_unknown_parser_stops_start_up(model_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match=r"server.tool_call_parser 'nope' is not available; registered parsers: "
                                         r"\[.*'hermes'.*\]"):
        with running_server(model=str(model_dir), tool_call_parser="nope"):
            pass
    from llmserve.cli import main
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\ndevice = "cpu"\n')
    capsys.readouterr()  # the server started above logged its start-up
    code = main(["--config", str(cfg), "--enable-auto-tool-choice", "--tool-call-parser", "nope"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "server.tool_call_parser 'nope' is not available" in err[0]


def test_langchain_binds_tools_and_gets_the_calls(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="none", temperature=0,
                                      max_completion_tokens=120, max_retries=0)
    bound = llm.bind_tools(TOOLS, tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], WEATHER)
    chunks = list(bound.stream("What is the weather in Paris?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(call["name"], call["args"])]
    anything = llm.bind_tools(TOOLS, tool_choice="any").invoke("Weather?")
    assert anything.tool_calls and all(c["name"] in SCHEMAS for c in anything.tool_calls)


def test_litellm_gets_text_streams_and_tool_calls(server):
    """litellm's OpenAI-compatible provider, as its users point it at a vLLM server."""
    litellm = pytest.importorskip("litellm")
    base = dict(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="none", num_retries=0)
    text = litellm.completion(messages=[{"role": "user", "content": "A list is"}], max_tokens=8, temperature=0, **base)
    assert text.choices[0].message.content and text.usage.completion_tokens <= 8
    pieces = litellm.completion(messages=[{"role": "user", "content": "A list is"}], max_tokens=8, temperature=0,
                                stream=True, **base)
    assert "".join(c.choices[0].delta.content or "" for c in pieces) == text.choices[0].message.content
    called = litellm.completion(messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                                tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                max_tokens=120, temperature=0, **base)
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
