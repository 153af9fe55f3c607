"""The Responses API (POST /v1/responses) through the official `openai` client: text input and
instructions rendered as the chat endpoint renders the same messages, streamed events that add up
to the unstreamed response, the length limit, text.format, function tools (and a conversation
continued with their calls and outputs), logprobs, cached tokens, and 400s that name the field."""

import json

import httpx
import jsonschema
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from servers import MODEL, running_server, thinker

from llmserve.sampling_params import SamplingParams
from llmserve.server.protocol import APIError
from llmserve.server.responses import ResponsesRequest, ResponseWriter

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
LOOKUP = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 12}},
          "required": ["query"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "lookup", "parameters": LOOKUP}]
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added", "response.output_text.done", "response.content_part.done",
               "response.output_item.done"]


@pytest.fixture(scope="module")
def server():
    with running_server() as s:
        yield s


def create(server, **kw):
    return server.client().responses.create(**{"model": MODEL, "max_output_tokens": 12, "temperature": 0.0, **kw})


def streamed(server, **kw):
    """The events of the streamed request; the last one carries the whole response."""
    return list(create(server, stream=True, **kw))


def chat(server, messages, **kw):
    return server.client().chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=12,
                                                   temperature=0.0, **kw)


def post(server, **body):
    """A raw request (what the SDK would not send) and its error object."""
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "Hi", **body})
    assert r.status_code == 400, r.text
    return r.json()["error"]


def check_calls(response, names):
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.id.startswith("fc_") and call.call_id.startswith("call_") and call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return calls


# ---- text -------------------------------------------------------------------------------------------

def test_text_input_gives_a_message_and_counts_its_tokens(server):
    r = create(server, input="The os module")
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL and r.error is None
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert r.output_text and message.content[0].text == r.output_text and message.content[0].annotations == []
    prompt = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "The os module"}]})
    assert r.usage.input_tokens == prompt.json()["count"]
    assert 0 < r.usage.output_tokens <= 12 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.status == ("incomplete" if r.usage.output_tokens == 12 else "completed")
    assert r.temperature == 0.0 and r.max_output_tokens == 12 and r.tools == [] and r.text.format.type == "text"
    nulls = dict.fromkeys(("stream", "temperature", "top_p", "instructions", "tools", "text", "store"))
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 3, **nulls})
    assert r.status_code == 200 and r.json()["object"] == "response", r.text  # null: unset
    for text, param in (({"format": {"type": "text"}, "foo": 1}, "text.foo"),
                        ({"format": {"type": "json_object", "foo": 1}}, "text.format.foo")):
        r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "hi", "text": text})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_instructions_and_input_items_are_the_chat_messages_they_name(server):
    r = create(server, instructions="Answer in prose.", input="The sys module")
    c = chat(server, [{"role": "system", "content": "Answer in prose."}, {"role": "user", "content": "The sys module"}])
    assert r.output_text == c.choices[0].message.content and r.usage.input_tokens == c.usage.prompt_tokens
    assert create(server, input="The sys module").usage.input_tokens < r.usage.input_tokens
    items = [{"role": "developer", "content": "Be terse."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "The re "},
                                                             {"type": "input_text", "text": "module"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "It matches.", "annotations": []}]},
             {"role": "user", "content": "And json?"}]
    r = create(server, input=items)
    c = chat(server, [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "The re module"},
                      {"role": "assistant", "content": "It matches."}, {"role": "user", "content": "And json?"}])
    assert r.output_text == c.choices[0].message.content and r.usage.input_tokens == c.usage.prompt_tokens


def test_a_stream_adds_up_to_the_response(server):
    whole = create(server, input="The json module", max_output_tokens=10)
    events = streamed(server, input="The json module", max_output_tokens=10)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    final = events[-1].response
    assert [t for t in types if t != "response.output_text.delta"] == TEXT_EVENTS + [f"response.{final.status}"]
    assert types.index("response.content_part.added") < types.index("response.output_text.delta")
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == final.output_text == whole.output_text
    assert {e.item_id for e in deltas} == {final.output[0].id} and all(e.logprobs == [] for e in deltas)
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert final.id == events[0].response.id and final.usage == whole.usage


def test_max_output_tokens_ends_the_response_incomplete(server):
    r = create(server, input="The os module", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = streamed(server, input="The os module", max_output_tokens=3)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].type == "response.output_item.done" and events[-2].item.status == "incomplete"
    assert events[-1].response.output_text == r.output_text


def test_logprobs_come_with_the_text_when_included(server):
    kw = dict(input="The os module", max_output_tokens=6, top_logprobs=2, include=["message.output_text.logprobs"])
    r = create(server, **kw)
    logprobs = r.output[0].content[0].logprobs
    assert len(logprobs) == r.usage.output_tokens == 6 and "".join(lp.token for lp in logprobs) == r.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.top_logprobs[0].logprob >= lp.logprob for lp in logprobs)
    events = streamed(server, **kw)
    streamed_lps = [lp.token for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert streamed_lps == [lp.token for lp in done.logprobs] == [lp.token for lp in logprobs]
    assert create(server, input="The os module", max_output_tokens=6).output[0].content[0].logprobs == []


def test_a_repeated_input_reports_its_cached_tokens(server):
    text = "The collections module provides specialized container datatypes. " * 3
    first = create(server, input=text, max_output_tokens=2)
    again = create(server, input=text, max_output_tokens=2)
    assert first.usage.input_tokens == again.usage.input_tokens > 32
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert 16 <= again.usage.input_tokens_details.cached_tokens < again.usage.input_tokens  # whole blocks of 16


@pytest.mark.parametrize("extra", [{}, {"tools": TOOLS, "tool_choice": "required"}])
def test_the_wire_format_is_what_the_sdks_types_declare(server, extra):
    """Checked strictly (the SDK itself parses leniently): every event under its type's name, the
    stream over after the final event (no [DONE]), and the unstreamed object."""
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 20, "temperature": 0.0, "top_logprobs": 1, **extra}
    with httpx.stream("POST", f"{server.url}/v1/responses", json={**body, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        frames = r.read().decode().split("\n\n")
    assert frames[-1] == ""
    events = pydantic.TypeAdapter(list[ResponseStreamEvent])
    parsed = []
    for frame in frames[:-1]:
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        parsed.append(event)
    assert events.validate_python(parsed, strict=True)[-1].type in ("response.completed", "response.incomplete")
    whole = Response.model_validate(httpx.post(f"{server.url}/v1/responses", json=body).json(), strict=True)
    last = events.validate_python(parsed)[-1].response
    assert [item.model_dump(exclude={"id", "call_id"}) for item in whole.output] == \
        [item.model_dump(exclude={"id", "call_id"}) for item in last.output]


def test_the_openapi_document_states_the_body(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    schema = doc["paths"]["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator({**schema, "components": doc["components"]})
    assert validator.is_valid({"model": MODEL, "input": [{"role": "user", "content": "Hi"}], "temperature": 0.5})
    assert not validator.is_valid({"input": "Hi", "temperature": 101})
    assert not validator.is_valid({"input": "Hi", "use_beam_search": True})


# ---- the writer, alone ------------------------------------------------------------------------------

def chunk(content=None, calls=None, finish=None, reasoning=None):
    """A chat stream chunk, as OpenAIServing.stream sends them."""
    delta = {"content": content} if content is not None else {}
    if reasoning is not None:
        delta.update(reasoning=reasoning, reasoning_content=reasoning)
    if calls:
        delta["tool_calls"] = calls
    return {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}


def writer(**body):
    return ResponseWriter(ResponsesRequest.model_validate({"input": "x", **body}), MODEL, SamplingParams())


def test_text_after_a_call_is_a_message_item_of_its_own():
    w = writer()
    events = w.feed(chunk("Let me look. "))
    events += w.feed(chunk(calls=[{"index": 0, "id": "call_a", "type": "function",
                                   "function": {"name": "lookup", "arguments": ""}}]))
    events += w.feed(chunk(calls=[{"index": 0, "function": {"arguments": '{"query": "x"}'}}]))
    events += w.feed(chunk("Done.", finish="stop"))
    events += w.finish()
    output = w.response("completed")["output"]
    assert [(item["type"], item["status"]) for item in output] == [("message", "completed"),
                                                                   ("function_call", "completed"),
                                                                   ("message", "completed")]
    assert output[1]["call_id"] == "call_a" and output[1]["arguments"] == '{"query": "x"}'
    assert [item["content"][0]["text"] for item in (output[0], output[2])] == ["Let me look. ", "Done."]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [0, 1, 2] and events[-1]["type"] == "response.completed"
    pydantic.TypeAdapter(list[ResponseStreamEvent]).validate_python(events, strict=True)


def test_thinking_is_a_reasoning_item_before_the_answer():
    w = ResponseWriter(ResponsesRequest.model_validate({"input": "x"}), MODEL, SamplingParams(),
                       count_tokens=lambda text: len(text.split()))
    events = w.feed(chunk(reasoning="I should ")) + w.feed(chunk(reasoning="say hi"))
    events += w.feed(chunk("Hi", finish="stop"))
    events += w.feed({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12,
                                               "prompt_tokens_details": {"cached_tokens": 0}}})
    events += w.finish()
    output = events[-1]["response"]["output"]
    assert [(item["type"], item["status"]) for item in output] == [("reasoning", "completed"), ("message", "completed")]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "I should say hi"}] and output[0]["summary"] == []
    assert output[0]["id"].startswith("rs_") and output[1]["content"][0]["text"] == "Hi"
    assert events[-1]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
    types = [e["type"] for e in events]
    assert types[:4] == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                         "response.reasoning_text.delta"]
    assert types[4:7] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "I should say hi"
    pydantic.TypeAdapter(list[ResponseStreamEvent]).validate_python(events, strict=True)
    Response.model_validate(events[-1]["response"], strict=True)


def test_the_answers_logprobs_are_its_own_tokens():
    """The thinking's tokens, and the closing tag's (held back, their chunks without text), have no
    output_text logprobs; nor the tag's in the chunk where the answer begins."""
    def lp(*tokens):
        return {"content": [{"token": t, "logprob": -1.0, "bytes": list(t.encode()), "top_logprobs": []}
                            for t in tokens]}
    w = writer(top_logprobs=0)
    for c, tokens in ((chunk(reasoning="hm"), ("hm",)), (chunk(), ("</", "think")), (chunk("Yes"), (">", "\n\n", "Yes")),
                      (chunk(" it"), (" it",))):
        c["choices"][0]["logprobs"] = lp(*tokens)
        w.feed(c)
    w.finish()
    (message,) = [item for item in w.response("completed")["output"] if item["type"] == "message"]
    assert [e["token"] for e in message["content"][0]["logprobs"]] == ["Yes", " it"]
    w = writer(top_logprobs=0)  # thinking and answer in one chunk (several tokens a step)
    c = chunk("Hi", reasoning="hm")
    c["choices"][0]["logprobs"] = lp("hm", "</think>", "Hi")
    w.feed(c)
    w.finish()
    assert [e["token"] for e in w.response("completed")["output"][1]["content"][0]["logprobs"]] == ["Hi"]


def test_a_failed_stream_ends_with_an_error_event_and_response_failed():
    w = writer()
    events = w.feed(chunk("")) + w.feed(chunk("Hel"))
    events += w.fail(APIError("the engine process died", status=500, type="server_error"))
    assert [e["type"] for e in events[-5:]] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "error", "response.failed"]
    assert events[-3]["item"]["status"] == "incomplete" and events[-2]["message"] == "the engine process died"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output"][0]["content"][0]["text"] == "Hel"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    pydantic.TypeAdapter(list[ResponseStreamEvent]).validate_python(events, strict=True)


def test_a_reasoning_parser_gives_reasoning_items_and_takes_them_back(tmp_path):
    """Under deepseek_r1 the built-in model's output, which writes no </think>, is all thinking: a
    reasoning item holding chat's `reasoning` for the same messages, streamed alike; a reasoning item
    sent back reaches the template with the assistant turn after it."""
    model = thinker(tmp_path)
    with running_server(model=str(model), reasoning_parser="deepseek_r1") as s:
        c = s.client()
        kw = dict(model=model.name, max_output_tokens=12, temperature=0.0)
        r = c.responses.create(input="The os module", **kw)
        expected = c.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "The os module"}],
                                             max_completion_tokens=12, temperature=0.0).choices[0].message
        assert [item.type for item in r.output] == ["reasoning"] and r.status == "incomplete"
        assert r.output[0].content[0].text == expected.model_extra["reasoning"] and r.output_text == ""
        assert 0 < r.usage.output_tokens_details.reasoning_tokens <= 12
        events = list(c.responses.create(input="The os module", stream=True, **kw))
        final = events[-1].response.output
        assert [item.type for item in final] == ["reasoning"] and final[0].content == r.output[0].content
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
            r.output[0].content[0].text
        items = [{"role": "user", "content": "Hi"},
                 {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
                 {"role": "assistant", "content": "yes"}, {"role": "user", "content": "B"}]
        cut_short = [{"role": "user", "content": "The os module"}, r.output[0].model_dump(exclude_none=True),
                     {"role": "user", "content": "B"}]  # a reply that only thought, sent back
        assert c.responses.create(input=cut_short, **kw).usage.input_tokens > r.usage.input_tokens + 2
        with_thought = c.responses.create(input=items, **kw).usage.input_tokens
        without = c.responses.create(input=[items[0], *items[2:]], **kw).usage.input_tokens
        hm = httpx.post(f"{s.url}/tokenize", json={"prompt": "(hm)", "add_special_tokens": False}).json()["count"]
        assert with_thought == without + hm


# ---- text.format ----------------------------------------------------------------------------------

def test_a_json_schema_format_constrains_the_text(server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "size": {"type": "integer"}},
              "required": ["name", "size"], "additionalProperties": False}
    fmt = {"format": {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}}
    r = create(server, input="A thing", text=fmt, max_output_tokens=60)
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema" and r.text.format.name == "thing"
    events = streamed(server, input="A thing", text=fmt, max_output_tokens=60)
    assert events[-1].response.output_text == r.output_text

    class Thing(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=10)
        size: int

    parsed = server.client().responses.parse(model=MODEL, input="A thing", text_format=Thing, max_output_tokens=60,
                                             temperature=0.0)
    assert isinstance(parsed.output_parsed, Thing)


# ---- tools ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "lookup"}])
def test_a_forced_tool_choice_gives_function_calls_streamed_or_not(server, choice):
    kw = dict(input="Find it", tools=TOOLS, tool_choice=choice, parallel_tool_calls=False, max_output_tokens=60)
    r = create(server, **kw)
    [call] = check_calls(r, {"lookup"} if isinstance(choice, dict) else set(SCHEMAS))
    assert r.status == "completed" and call.status == "completed" and r.output_text == ""
    assert r.tool_choice == choice if isinstance(choice, str) else r.tool_choice.name == "lookup"
    events = streamed(server, **kw)
    final = events[-1].response
    [streamed_call] = check_calls(final, {call.name})
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)
    assert [e.type for e in events] == (["response.created", "response.in_progress", "response.output_item.added"]
                                        + ["response.function_call_arguments.delta"] * (len(events) - 6)
                                        + ["response.function_call_arguments.done", "response.output_item.done",
                                           "response.completed"])
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == events[-3].arguments == call.arguments
    assert events[2].item.arguments == "" and events[2].item.status == "in_progress"
    assert {e.item_id for e in events[3:-2]} == {streamed_call.id}
    with server.client().responses.stream(model=MODEL, temperature=0.0, **kw) as stream:  # the SDK's accumulation
        assert [e.type for e in stream][-1] == "response.completed"
    [accumulated] = check_calls(stream.get_final_response(), {call.name})
    assert (accumulated.name, accumulated.arguments) == (call.name, call.arguments)


def test_a_tool_conversation_continues_from_its_call_and_output(server):
    items = [{"role": "user", "content": "Weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris", "days": 1}', "id": "fc_1", "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny, 21 C"}]
    r = create(server, input=items, tools=TOOLS, tool_choice="none")
    c = chat(server, [{"role": "user", "content": "Weather in Paris?"},
                      {"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}],
             tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS],
             tool_choice="none")
    assert r.output_text == c.choices[0].message.content and r.usage.input_tokens == c.usage.prompt_tokens
    without = create(server, input=items[:1], tools=TOOLS, tool_choice="none")
    assert r.usage.input_tokens > without.usage.input_tokens  # the call's output is in the prompt
    orphan = post(server, input=[items[2]])
    assert orphan["param"] == "input[0].call_id"


# ---- refused ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"use_beam_search": True}, "use_beam_search"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"tool_choice": {"type": "file_search"}, "tools": TOOLS}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "Look:"},
                                              {"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input[0].content[1]"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
                {"role": "assistant", "content": "Hi"}]}, "input[0].encrypted_content"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "output_text", "text": "t"}]},
                {"role": "assistant", "content": "Hi"}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input[0].arguments"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input[0].role"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}, "stream": True},
     "text.format"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),
    ({"max_output_tokens": 100_000, "stream": True}, "max_output_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"include": ["message.output_text.everything"]}, "include"),
])
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, param):
    error = post(server, **body)
    assert error["param"] == param and error["message"].startswith(param)


def test_openais_advisory_fields_are_accepted(server):
    r = create(server, input="Hi", max_output_tokens=2, user="u", metadata={"k": "v"}, store=False,
               service_tier="auto", prompt_cache_key="p", safety_identifier="s", truncation="disabled",
               include=["reasoning.encrypted_content"], tool_choice="auto", tools=[],
               reasoning={"effort": None, "summary": None})  # what clients that always send it send
    assert r.usage.output_tokens == 2 and r.metadata == {"k": "v"}
