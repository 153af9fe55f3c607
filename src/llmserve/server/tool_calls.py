"""Tool calling on the chat API: the request's `tools`, `tool_choice` and `parallel_tool_calls`,
the messages of earlier calls as the chat template takes them, and the choices' tool calls.

    tool_choice   how the calls are found                          output constraint
    none          not looked for: the text is content              (the request's own, if any)
    auto          the server's tool-call parser (server.tool_call_parser) reads the model's own format
                                                                   (the request's own, if any)
    required      the output is a JSON array of calls:             [{"name": NAME, "parameters": ARGS}, ...]
                  anyOf over the tools, at least one, at most one without parallel_tool_calls
    {"type": "function", "function": {"name": NAME}}
                  the output is that function's arguments          its parameters schema

The constraints go through the structured-outputs decoding strategy (a JSON schema), so
`required` and a named choice cannot be combined with response_format or structured_outputs.
Each choice's text is fed to a parser (llmserve.tool_parsers' protocol; `required` and named
choices have their own here) whose events become stream deltas or, fed the whole text, the final
message: a stream's deltas add up to exactly the message the same request gets unstreamed.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from llmserve.config import EngineConfig
from llmserve.server.protocol import (APIError, ChatCompletionRequest, ChatMessage, ToolDefinition, check_value,
                                      parse_json)
from llmserve.tool_parsers import (ArgumentsPiece, CallStart, Event, JsonScanner, Parsed, ToolParser,
                                   ToolParserFactory, collect)

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}
"""A function declared without parameters takes none: its arguments are `{}`."""


def tool_parser(config: EngineConfig) -> ToolParserFactory:
    """The factory of `server.tool_call_parser` among the registered parsers; a ValueError naming
    the ones there are if it is not registered (checked at start-up)."""
    from llmserve.plugin_manager import Plugins

    parsers = Plugins.from_config(config.plugins).tool_parsers()
    name = config.server.tool_call_parser
    if name not in parsers:
        raise ValueError(f"server.tool_call_parser {name!r} is not available; registered parsers: {sorted(parsers)}")
    return parsers[name]


# ---- the request ----------------------------------------------------------------------------------

MAX_TOOLS = 128
"""OpenAI's limit on a request's functions."""


def template_tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    """The tools as the chat template gets them (transformers' `tools`: one JSON-schema dict per
    function), after the checks OpenAI makes: at most MAX_TOOLS; a name of letters, digits, `_`
    or `-` (at most 64), unique; parameters an object schema."""
    if tools is None:
        return None
    if not tools:
        raise APIError("tools must not be empty (leave it out for no tools)", param="tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(f"tools: at most {MAX_TOOLS} functions, got {len(tools)}", param="tools")
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        fn = tool.function
        where = f"tools[{i}].function"
        if not _NAME.fullmatch(fn.name):
            raise APIError(f"{where}.name must be 1 to 64 letters, digits, underscores or dashes, got {fn.name!r}",
                           param=f"{where}.name")
        if fn.name in seen:
            raise APIError(f"{where}.name: {fn.name!r} is also the name of tools[{seen[fn.name]}]",
                           param=f"{where}.name")
        seen[fn.name] = i
        if fn.parameters is not None and (problem := _schema_problem(fn.parameters)):
            raise APIError(f"{where}.parameters: {problem}", param=f"{where}.parameters")
    return [tool.model_dump(exclude_none=True) for tool in tools]


def _schema_problem(schema: dict[str, Any]) -> str | None:
    """Why `schema` cannot describe a function's arguments (always a JSON object), or None. The
    schema is compiled only where it constrains the output (required, named)."""
    if schema.get("type", "object") != "object":
        return f"the arguments are a JSON object: type must be \"object\", got {schema['type']!r}"
    properties = schema.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, (dict, bool)) for p in properties.values()):
        return "properties must map each argument's name to a schema"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "required must be a list of argument names"
    return None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as transformers' chat templates take them. An assistant message's calls keep their
    id and type, with `function.arguments` as an object (the templates write it out with `tojson`;
    the API sends JSON text); a missing content is the empty string; a tool message keeps its
    `tool_call_id` (and `name`); an assistant message's thinking is both `reasoning` and
    `reasoning_content` (Qwen3's template reads the latter)."""
    out = []
    for i, m in enumerate(messages):
        msg: dict[str, Any] = {"role": m.role, "content": m.text(f"messages[{i}]")}
        thinking = m.reasoning if m.reasoning is not None else m.reasoning_content
        if thinking is not None and m.role == "assistant":  # (templates read either name)
            msg["reasoning"] = msg["reasoning_content"] = thinking
        if m.tool_calls is not None:
            if m.role != "assistant":
                raise APIError(f"messages[{i}]: only assistant messages carry tool_calls, not {m.role!r}",
                               param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = [{"id": call.id, "type": call.type,
                                  "function": {"name": call.function.name,
                                               "arguments": json_arguments(
                                                   call.function.arguments,
                                                   f"messages[{i}].tool_calls[{j}].function.arguments")}}
                                 for j, call in enumerate(m.tool_calls)]
        if m.role == "tool":
            if m.tool_call_id is None:
                raise APIError(f"messages[{i}]: a tool message needs the tool_call_id of the call it answers",
                               param=f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                msg["name"] = m.name
        elif m.tool_call_id is not None:
            raise APIError(f"messages[{i}]: only tool messages carry a tool_call_id", param=f"messages[{i}].tool_call_id")
        out.append(msg)
    return out


def json_arguments(arguments: str | dict[str, Any], param: str) -> dict[str, Any]:
    """A call's arguments as a chat template takes them, a JSON object; a 400 naming `param` (the
    field's path) if they are not one, or not JSON a body may hold (decode_body's limits: the
    template renders them)."""
    if isinstance(arguments, dict):  # (part of the body: checked with it)
        return arguments
    value, suspect = parse_json(arguments, param)
    if suspect:
        check_value(value, param)
    if not isinstance(value, dict):
        raise APIError(f"{param} must be a JSON object, got {arguments!r}", param=param)
    return value


def plan(body: ChatCompletionRequest, tools: list[dict[str, Any]] | None,
         parser: ToolParserFactory) -> ToolPlan | None:
    """How the request's choices are read for tool calls; None where they are not (no tools, or
    tool_choice none). `tools` are the request's, checked (template_tools)."""
    choice = body.tool_choice
    if tools is None:
        if choice is not None:
            raise APIError("tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    choice = choice or "auto"
    if choice == "none":
        return None
    single = body.parallel_tool_calls is False
    functions = [t["function"] for t in tools]
    if choice == "auto":
        return ToolPlan("auto", tools, lambda: parser(tools), single)
    if body.structure() is not None:
        raise APIError(f"tool_choice {_describe(choice)} constrains the output to tool calls: it cannot be combined "
                       "with response_format or structured_outputs (use tool_choice \"auto\")", param="tool_choice")
    if choice == "required":
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": fn["name"]}, "parameters": _parameters(fn)},
             "required": ["name", "parameters"], "additionalProperties": False} for fn in functions]}}
        if single:
            array["maxItems"] = 1
        return ToolPlan("required", tools, _CallArray, single, {"json": array}, list(range(len(tools))))
    name = choice.function.name
    at = next((i for i, fn in enumerate(functions) if fn["name"] == name), None)
    if at is None:
        raise APIError(f"tool_choice names the function {name!r}, which is not among the tools "
                       f"({', '.join(fn['name'] for fn in functions)})", param="tool_choice")
    return ToolPlan("named", tools, lambda: _Arguments(name), single, {"json": _parameters(functions[at])}, [at])


def _describe(choice: Any) -> str:
    return f'"{choice}"' if isinstance(choice, str) else f"naming {choice.function.name!r}"


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    schema = function.get("parameters")
    if schema is None:
        return _EMPTY_PARAMETERS
    return schema if "type" in schema else {"type": "object", **schema}


# ---- the choices ----------------------------------------------------------------------------------

@dataclass(slots=True)
class ToolPlan:
    """A request's tool calling: its mode, its tools, how to parse a choice, and the output
    constraint (`structured_outputs`) of required and named choices, with the tools it holds."""
    mode: str  # "auto" | "required" | "named"
    tools: list[dict[str, Any]]
    parser: Callable[[], ToolParser]
    """A fresh parser for one choice."""
    single: bool
    """parallel_tool_calls false: only a choice's first call is reported."""
    constraint: dict[str, Any] | None = None
    constrained: list[int] = field(default_factory=list)

    def start(self) -> ChoiceCalls:
        return ChoiceCalls(self.parser(), self.single)

    def schema_error(self, error: APIError) -> APIError:
        """The 400 for a constraint the grammar compiler refused, naming the tool whose parameters
        it is (each one compiled alone until one fails)."""
        from llmserve.plugins.structured_outputs import json_schema_grammar

        for i in self.constrained:
            try:
                json_schema_grammar(_parameters(self.tools[i]["function"]))
            except Exception as exc:  # (what the compiler raises for a schema it refuses varies)
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                return APIError(f"tools[{i}].function.parameters: {reason}", param=f"tools[{i}].function.parameters")
        return APIError(str(error).replace("structured_outputs.json", "tools", 1), param="tools")


class ChoiceCalls:
    """One choice's text as content and tool calls: stream deltas as it grows, or the message."""

    def __init__(self, parser: ToolParser, single: bool) -> None:
        self.parser = parser
        self.single = single
        self.calls = 0

    def _kept(self, events: list[Event]) -> list[Event]:
        if self.single:  # a call after the first is dropped, as parallel_tool_calls false promises
            events = [e for e in events if isinstance(e, str) or e.index == 0]
        self.calls += sum(isinstance(e, CallStart) for e in events)
        return events

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The stream deltas for `text`, the choice's text since the last call (`final`: it ended).

        OpenAI's delta form: `content` pieces; `tool_calls` entries keyed by the call's `index`, the
        first one of a call carrying its `id`, `type` and `function.name` with `arguments` "" (the
        clients add up every string they get for an index, so an id sent twice would double), the
        next ones `function.arguments` pieces. A piece of a call whose first entry is in the delta
        being built starts another delta: a step can give several."""
        events = self._kept(self.parser.feed(text) + (self.parser.finish() if final else []))
        out: list[dict[str, Any]] = []
        delta: dict[str, Any] = {}
        for event in events:
            if isinstance(event, str):
                if event:
                    delta["content"] = delta.get("content", "") + event
                continue
            calls = delta.setdefault("tool_calls", [])
            same = next((c for c in calls if c["index"] == event.index), None)
            if isinstance(event, CallStart):
                calls.append({"index": event.index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": event.name, "arguments": ""}})
            elif not event.text:
                continue
            elif same is None:
                calls.append({"index": event.index, "function": {"arguments": event.text}})
            elif "id" in same:
                out.append(delta)
                delta = {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
            else:
                same["function"]["arguments"] += event.text
        if delta.get("tool_calls") == []:
            del delta["tool_calls"]
        if delta or not out:
            out.append(delta)
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The whole choice's message: content null where it wrote none (calls or not: the stream's
        deltas, which open with content null, then add up to it)."""
        parsed: Parsed = collect(self._kept(self.parser.feed(text) + self.parser.finish()))
        if not parsed.calls:
            return {"role": "assistant", "content": parsed.content or None}
        return {"role": "assistant", "content": parsed.content or None,
                "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]}

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason


class _Arguments:
    """A named tool_choice: the output is the function's arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def _start(self) -> list[Event]:
        if self.started:
            return []
        self.started = True
        return [CallStart(0, self.name)]

    def feed(self, text: str) -> list[Event]:
        return self._start() + ([ArgumentsPiece(0, text)] if text else [])

    def finish(self) -> list[Event]:
        return self._start()


_ITEM_NAME = re.compile(r'[^{]*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ITEM_PARAMETERS = re.compile(r'\s*,\s*"parameters"\s*:\s*(?=\{)')


class _CallArray:
    """tool_choice required: the output is `[{"name": NAME, "parameters": ARGS}, ...]` (the
    constraint's schema fixes the keys' order); each item's call starts once its name is written
    and its parameters stream as its arguments. An output cut short keeps the calls begun (a call
    cut before its parameters has arguments "")."""

    def __init__(self) -> None:
        self.buf = ""
        self.calls = 0
        self.named = False  # an item's name is read, its parameters not yet begun
        self.scanner: JsonScanner | None = None  # set while inside an item's parameters

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while self.buf:
            if self.scanner is None:
                m = (_ITEM_PARAMETERS if self.named else _ITEM_NAME).match(self.buf)
                if m is None:
                    break
                self.buf = self.buf[m.end():]
                if not self.named:
                    events.append(CallStart(self.calls, json.loads(f'"{m.group(1)}"')))
                    self.calls += 1
                    self.named = True
                    continue
                self.named, self.scanner = False, JsonScanner()
            consumed, ended = self.scanner.advance(self.buf)
            events.append(ArgumentsPiece(self.calls - 1, self.buf[:consumed]))
            self.buf = self.buf[consumed:]
            if ended:
                self.scanner = None
        return events

    def finish(self) -> list[Event]:
        return []
