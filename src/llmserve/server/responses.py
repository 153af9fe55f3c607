"""OpenAI's Responses API (`POST /v1/responses`), stateless, on the chat-completions machinery.

A request becomes a chat request (`ResponsesRequest.chat_request`): `instructions` a system
message first, then `input`'s items in order (messages; `function_call` items as the tool_calls of
an assistant turn; `function_call_output` items as tool messages), `text.format` its
response_format, the flat function tools nested as chat has them. The chat job always streams
inside; `ResponseWriter` folds its chunks into the response's output items, and the same fold
gives the stream's events, so a streamed response ends in exactly the object the unstreamed
request returns:

    chat chunk                          the response
    delta.reasoning                     a reasoning item (server.reasoning_parser), reasoning_text deltas
    delta.content                       a message item (opened at its first text), output_text deltas
    delta.tool_calls[i] with its id     a function_call item (call_id: the chat call's id)
    delta.tool_calls[i].arguments       function_call_arguments deltas
    finish_reason "length"              status "incomplete", incomplete_details.reason "max_output_tokens"
    the usage chunk                     usage

A reasoning item sent back in `input` gives its text to the assistant turn that follows it (the
chat message's `reasoning`, which the template gets); followed by none (a response cut short in
its thinking), to an empty assistant turn of its own.

Nothing is stored, so what needs stored state (previous_response_id, conversation, item
references) is refused, as are built-in tools, non-text input and background runs.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError

from llmserve.sampling_params import MAX_LOGPROBS, SamplingParams
from llmserve.server.protocol import (_STRICT, APIError, ChatCompletionRequest, ChatMessage, FunctionCall,
                                      FunctionDefinition, FunctionName, JsonSchemaFormat, NamedToolChoice,
                                      ResponseFormat, StreamOptions, ToolCall, ToolDefinition, _AdvisoryFields,
                                      _Request)
from llmserve.server.tool_calls import json_arguments

LOGPROBS = "message.output_text.logprobs"
_NOTHING_TO_INCLUDE = frozenset({
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
    "reasoning.encrypted_content"})
"""`include` values about items this server never has (built-in tool calls, images, encrypted reasoning):
accepted, and there is nothing for them to add."""


# ---- the request ----------------------------------------------------------------------------------

class TextFormat(_Request):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Request):
    model_config = _STRICT
    format: TextFormat | None = None
    verbosity: Any = None
    """OpenAI's: refused when set (as chat's verbosity is)."""


class FunctionTool(_Request):
    """A Responses function tool: chat's FunctionDefinition, flat beside its type."""
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class MessageItem(_Request):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[dict[str, Any]]


class FunctionCallItem(_Request):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Request):
    call_id: str
    output: str | list[dict[str, Any]]


class ReasoningItem(_Request):
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None

    def text(self, where: str) -> str:
        """Its reasoning_text parts' text (or, with none, its summary's): what the model thought."""
        if self.encrypted_content is not None:
            raise APIError(f"{where}.encrypted_content: this server writes no encrypted reasoning and cannot read "
                           "it; send the reasoning as content", param=f"{where}.encrypted_content")
        parts, kind = (self.content, "reasoning_text") if self.content else (self.summary, "summary_text")
        texts = []
        for j, part in enumerate(parts):
            if part.get("type") != kind or not isinstance(part.get("text"), str):
                name = "content" if parts is self.content else "summary"
                raise APIError(f"{where}.{name}[{j}] must be a {kind} part with its text",
                               param=f"{where}.{name}[{j}]")
            texts.append(part["text"])
        return "".join(texts)


class ResponsesRequest(_AdvisoryFields):
    model_config = _STRICT
    model: str | None = None
    input: str | list[dict[str, Any]]
    """A user message's text, or items: messages, function_call, function_call_output and reasoning."""
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    """Function tools ({"type": "function", "name", "description", "parameters", "strict"})."""
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    include: list[str] | None = None
    # OpenAI's, changing nothing here: no stream obfuscation is sent, built-in tools (all that
    # max_tool_calls bounds) are refused, the prefix cache keeps what it can
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    prompt_cache_retention: str | None = None
    # OpenAI's, refused when set (unsupported())
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    reasoning: Any = None
    truncation: Literal["auto", "disabled"] | None = None

    def unsupported(self) -> None:
        """A 400 for an OpenAI field set that this server cannot honour."""
        for name in ("previous_response_id", "conversation"):
            if getattr(self, name) is not None:
                raise APIError(f"{name}: this server stores no responses: send the whole conversation as input "
                               "(function_call and function_call_output items included)", param=name)
        if self.background:
            raise APIError("background: true is not supported: a response runs while its request is open "
                           "(stream a long one)", param="background")
        if self.prompt is not None:
            raise APIError("prompt: stored prompt templates are not supported: send instructions and input",
                           param="prompt")
        if self.reasoning is not None and (not isinstance(self.reasoning, dict)
                                           or any(v is not None for v in self.reasoning.values())):
            # (clients that always send it send {"effort": null, "summary": null}: nothing asked)
            raise APIError("reasoning is not supported by this server", param="reasoning")
        if self.truncation == "auto":
            raise APIError('truncation "auto" is not supported: an input longer than the context is a 400 '
                           '("disabled")', param="truncation")
        if self.text is not None and self.text.verbosity is not None:
            raise APIError("text.verbosity is not supported by this server", param="text.verbosity")
        for value in self.include or []:
            if value != LOGPROBS and value not in _NOTHING_TO_INCLUDE:
                raise APIError(f"include: {value!r} is not a value OpenAI documents", param="include")

    def chat_request(self) -> ChatCompletionRequest:
        """The chat request that produces this response, streamed, with usage and cached tokens."""
        self.unsupported()
        fields: dict[str, Any] = {"messages": self.chat_messages(), "stream": True,
                                  "stream_options": StreamOptions(include_usage=True)}
        for name in ("model", "temperature", "top_p", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.max_output_tokens is not None:
            fields["max_completion_tokens"] = self.max_output_tokens
        if self.top_logprobs is not None or LOGPROBS in (self.include or []):
            fields.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if (fmt := self.response_format()) is not None:
            fields["response_format"] = fmt
        tools = self.chat_tools()
        if tools is not None:
            fields["tools"] = tools
        choice = self.chat_tool_choice()
        if choice is not None and (tools is not None or choice not in ("none", "auto")):
            fields["tool_choice"] = choice  # (without tools, only a choice that needs them is an error)
        return ChatCompletionRequest(**fields)

    def chat_messages(self) -> list[ChatMessage]:
        messages = [] if self.instructions is None else [ChatMessage(role="system", content=self.instructions)]
        if isinstance(self.input, str):
            return messages + [ChatMessage(role="user", content=self.input)]
        if not self.input:
            raise APIError("input must hold at least one item", param="input")
        calls: dict[str, str] = {}  # call_id -> function name, of the calls so far
        thought: str | None = None  # reasoning items' text, for the assistant turn they led to
        for i, raw in enumerate(self.input):
            where, kind = f"input[{i}]", raw.get("type", "message")
            if thought is not None and not (kind in ("function_call", "reasoning") or kind == "message"
                                            and raw.get("role") == "assistant"):
                # thinking that led to no answer (a response cut short in it): a turn of its own
                messages.append(ChatMessage(role="assistant", content="", reasoning=thought))
                thought = None
            if kind == "message":
                item = _validated(MessageItem, raw, where)
                messages.append(ChatMessage(role=item.role, content=_text(item.content, f"{where}.content")))
            elif kind == "function_call":
                item = _validated(FunctionCallItem, raw, where)
                arguments = json_arguments(item.arguments, f"{where}.arguments")
                call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name, arguments=arguments))
                calls[item.call_id] = item.name
                if messages and messages[-1].role == "assistant" and thought is None:  # the turn that wrote it
                    messages[-1].tool_calls = (messages[-1].tool_calls or []) + [call]
                else:
                    messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            elif kind == "reasoning":
                thought = (thought or "") + _validated(ReasoningItem, raw, where).text(where)
                continue
            elif kind == "function_call_output":
                item = _validated(FunctionCallOutputItem, raw, where)
                if item.call_id not in calls:
                    raise APIError(f"{where}.call_id: {item.call_id!r} answers no function_call item before it "
                                   "(this server stores no responses: send the call too)", param=f"{where}.call_id")
                messages.append(ChatMessage(role="tool", content=_text(item.output, f"{where}.output"),
                                            tool_call_id=item.call_id, name=calls[item.call_id]))
            elif kind == "item_reference":
                raise APIError(f"{where}: an item_reference names a stored item; this server stores none "
                               "(send the item itself)", param=where)
            else:
                raise APIError(f"{where}.type: items of type {kind!r} are not supported (message, function_call, "
                               "function_call_output and reasoning are)", param=f"{where}.type")
            if thought is not None:
                messages[-1].reasoning, thought = thought, None
        if thought is not None:
            messages.append(ChatMessage(role="assistant", content="", reasoning=thought))
        return messages

    def chat_tools(self) -> list[ToolDefinition] | None:
        if not self.tools:  # (OpenAI echoes no tools as [], so clients send it back)
            return None
        tools = []
        for i, raw in enumerate(self.tools):
            if raw.get("type") != "function":
                raise APIError(f"tools[{i}].type: {raw.get('type')!r} tools are not supported: this server runs no "
                               'built-in tools, only "function" ones (the client runs them)', param=f"tools[{i}].type")
            tool = _validated(FunctionTool, raw, f"tools[{i}]")
            tools.append(ToolDefinition(type="function", function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters, strict=tool.strict)))
        return tools

    def chat_tool_choice(self) -> str | NamedToolChoice | None:
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(f'tool_choice: {choice!r} is not supported; it takes "none", "auto", "required" or '
                           '{"type": "function", "name": ...}', param="tool_choice")
        return NamedToolChoice(type="function", function=FunctionName(name=choice["name"]))

    def response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        if fmt.schema_ is None:
            raise APIError("text.format.schema is required when type is json_schema", param="text.format.schema")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, schema=fmt.schema_, strict=fmt.strict, description=fmt.description))


def _validated(model: type[BaseModel], raw: dict[str, Any], where: str) -> Any:
    """`raw` as `model`, or a 400 naming the field under `where` (an item of a list)."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        error = APIError.from_validation_error(exc)
        if error.param is None:
            raise APIError(f"{where}: {error.message}", param=where) from None
        raise APIError(f"{where}.{error.message}", param=f"{where}.{error.param}") from None


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in ("input_text", "output_text"):
            raise APIError(f"{where}[{j}]: content parts of type {part.get('type')!r} are not supported: this "
                           "server takes text (input_text, output_text)", param=f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise APIError(f"{where}[{j}].text must be a string", param=f"{where}[{j}].text")
        texts.append(part["text"])
    return "".join(texts)


_CHAT_NAMES = [(re.compile(r"\bmax_(?:completion_)?tokens\b"), "max_output_tokens"),
               (re.compile(r"\bresponse_format(?:\.json_schema)?(?: or structured_outputs)?"), "text.format"),
               (re.compile(r"\b(tools\[\d+\])\.function\b"), r"\1"),
               (re.compile(r"^(?:messages|prompt)\b"), "input")]
"""Chat's names of the fields a Responses request set, and theirs (the prompt and the messages
are its input)."""


def responses_error(error: APIError) -> APIError:
    """An error of the chat job as the Responses request names its fields."""
    message, param = error.message, error.param
    for pattern, name in _CHAT_NAMES:
        message = pattern.sub(name, message)
        param = param and pattern.sub(name, param)
    return APIError(message, status=error.status, type=error.type, param=param, code=error.code,
                    headers=error.headers)


# ---- the response ---------------------------------------------------------------------------------

def _answer_logprobs(entries: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """Of the logprob entries of the tokens since the last text, those that wrote `text`, the
    answer's first text after the thinking: the longest run at their end whose bytes end it (the
    ones before were the closing tag's, or the thinking's)."""
    want, have, n = text.encode(), b"", 0
    for entry in reversed(entries):
        piece = bytes(entry["bytes"]) if entry.get("bytes") is not None else entry["token"].encode()
        if len(have) + len(piece) > len(want) or not want.endswith(piece + have):
            break
        have, n = piece + have, n + 1
    return entries[len(entries) - n:]


@dataclass(slots=True, eq=False)  # an item is itself: output_index is found by identity
class _Message:
    """A message item with one output_text part."""
    id: str
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"

    def part(self) -> dict[str, Any]:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": list(self.logprobs)}

    def item(self, content: bool = True) -> dict[str, Any]:
        return {"type": "message", "id": self.id, "role": "assistant", "status": self.status,
                "content": [self.part()] if content else []}


@dataclass(slots=True, eq=False)
class _Reasoning:
    """A reasoning item with one reasoning_text part (no summary: the model writes none)."""
    id: str
    text: str = ""
    status: str = "in_progress"

    def part(self) -> dict[str, Any]:
        return {"type": "reasoning_text", "text": self.text}

    def item(self, content: bool = True) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.id, "summary": [], "content": [self.part()] if content else [],
                "status": self.status}


@dataclass(slots=True, eq=False)
class _FunctionCall:
    id: str
    call_id: str
    name: str
    arguments: str = ""
    status: str = "in_progress"

    def item(self) -> dict[str, Any]:
        return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": self.arguments, "status": self.status}


class ResponseWriter:
    """One response, built from its chat job's chunks: the response object and the stream's
    events. Every event is a new dict (what an event shows stays as it was when sent)."""

    def __init__(self, body: ResponsesRequest, model: str, params: SamplingParams,
                 count_tokens: Callable[[str], int] = lambda text: 0) -> None:
        self.body, self.model, self.params = body, model, params
        self.count_tokens = count_tokens
        """Tokens of a text as the tokenizer encodes it: usage's reasoning_tokens, of the reasoning items."""
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.items: list[_Message | _Reasoning | _FunctionCall] = []
        self.open: _Message | _Reasoning | _FunctionCall | None = None
        """The item being written: the last one, until the output moves on or ends."""
        self.calls: dict[int, _FunctionCall] = {}
        """The chat stream's tool-call index -> its item."""
        self.logprobs: list[dict[str, Any]] = []
        """Logprobs of tokens whose text has not come yet (held by the detokenizer or the tool-call
        parser): they go with the next text, and are dropped where a call starts or the output ends
        first (they were the call's, or an end token's: output_text has no text of theirs)."""
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.error: dict[str, Any] | None = None
        self.sequence = 0

    async def events(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        """The stream's events, in order, ending with response.completed or response.incomplete."""
        async with aclosing(chunks):
            yield self._event("response.created", response=self.response("in_progress"))
            yield self._event("response.in_progress", response=self.response("in_progress"))
            async for chunk in chunks:
                for event in self.feed(chunk):
                    yield event
        for event in self.finish():
            yield event

    async def complete(self, chunks: AsyncIterator[dict[str, Any]]) -> dict[str, Any]:
        """The whole response object, once the job is done."""
        async with aclosing(chunks):
            async for chunk in chunks:
                self.feed(chunk)
        self.finish()
        return self.response(self.status())

    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def response(self, status: str) -> dict[str, Any]:
        """The response object as it stands (its output so far), with the request's settings as
        OpenAI echoes them (temperature and top_p as sampled: the model's defaults where unset)."""
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": self.error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": [item.item() for item in self.items], "usage": self.usage,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "temperature": self.params.temperature, "top_p": self.params.top_p,
                "top_logprobs": body.top_logprobs, "parallel_tool_calls": body.parallel_tool_calls is not False,
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
                "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
                "truncation": "disabled", "background": False, "previous_response_id": None,
                "metadata": body.metadata or {}, "user": body.user}

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events of one chat chunk (n is 1: a chunk has at most one choice)."""
        events: list[dict[str, Any]] = []
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
            reasoning = sum(self.count_tokens(item.text) for item in self.items if isinstance(item, _Reasoning))
            self.usage = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                          "total_tokens": usage["total_tokens"],
                          "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                                   "cache_write_tokens": 0},
                          "output_tokens_details": {"reasoning_tokens": min(reasoning, usage["completion_tokens"])}}
        for choice in chunk["choices"]:
            delta = choice["delta"]
            if choice.get("logprobs"):
                self.logprobs += choice["logprobs"]["content"]
            if delta.get("reasoning"):
                events += self._reasoning(delta["reasoning"])
            if delta.get("content"):
                if isinstance(self.open, _Reasoning):  # the answer begins after the thinking
                    self.logprobs = _answer_logprobs(self.logprobs, delta["content"])
                events += self._text(delta["content"])
            elif delta.get("reasoning"):
                self.logprobs = []  # the thinking's tokens: output_text has no text of theirs
            for call in delta.get("tool_calls") or []:
                events += self._call(call)
            self.finish_reason = choice["finish_reason"] or self.finish_reason
        return events

    def finish(self) -> list[dict[str, Any]]:
        """The events that end the response: the last item's, and response.completed (or
        response.incomplete). An output with no item at all still has its (empty) message."""
        events = [] if self.items else self._open(_Message(f"msg_{uuid.uuid4().hex}"))
        status = self.status()
        events += self._close(status)
        return events + [self._event(f"response.{status}", response=self.response(status))]

    def fail(self, error: APIError) -> list[dict[str, Any]]:
        """The events that end a stream the job failed: an error event (our code: "shutdown"...),
        then response.failed, whose error code is one of OpenAI's."""
        self.error = {"code": "server_error" if error.status >= 500 else "invalid_prompt", "message": error.message}
        events = self._close("incomplete")
        events.append(self._event("error", code=error.code or error.type, message=error.message, param=error.param))
        return events + [self._event("response.failed", response=self.response("failed"))]

    # ---- items -------------------------------------------------------------------------------------

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _where(self, item: _Message | _Reasoning | _FunctionCall) -> dict[str, Any]:
        return {"item_id": item.id, "output_index": self.items.index(item)}

    def _open(self, item: _Message | _Reasoning | _FunctionCall) -> list[dict[str, Any]]:
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        if isinstance(item, _FunctionCall):
            return events + [self._event("response.output_item.added", output_index=len(self.items) - 1,
                                         item=item.item())]
        return events + [self._event("response.output_item.added", output_index=len(self.items) - 1,
                                     item=item.item(content=False)),
                         self._event("response.content_part.added", **self._where(item), content_index=0,
                                     part=item.part())]

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        where = self._where(item)
        if isinstance(item, _FunctionCall):
            return [self._event("response.function_call_arguments.done", **where, arguments=item.arguments),
                    self._event("response.output_item.done", output_index=where["output_index"], item=item.item())]
        if isinstance(item, _Reasoning):
            done = self._event("response.reasoning_text.done", **where, content_index=0, text=item.text)
        else:
            done = self._event("response.output_text.done", **where, content_index=0, text=item.text,
                               logprobs=list(item.logprobs))
        return [done, self._event("response.content_part.done", **where, content_index=0, part=item.part()),
                self._event("response.output_item.done", output_index=where["output_index"], item=item.item())]

    def _current(self, kind: type[_Message] | type[_Reasoning], prefix: str) -> tuple[Any, list[dict[str, Any]]]:
        """The item of this kind being written, and the events that opened it (where it is new)."""
        if isinstance(self.open, kind):
            return self.open, []
        item = kind(f"{prefix}_{uuid.uuid4().hex}")
        return item, self._open(item)

    def _text(self, text: str) -> list[dict[str, Any]]:
        message, events = self._current(_Message, "msg")
        logprobs, self.logprobs = self.logprobs, []
        message.text += text
        message.logprobs += logprobs
        return events + [self._event("response.output_text.delta", **self._where(message), content_index=0,
                                     delta=text, logprobs=logprobs)]

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        item, events = self._current(_Reasoning, "rs")
        item.text += text
        return events + [self._event("response.reasoning_text.delta", **self._where(item), content_index=0,
                                     delta=text)]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if "id" in call:  # a call's first delta: its id and name
            item = self.calls[call["index"]] = _FunctionCall(f"fc_{uuid.uuid4().hex}", call["id"],
                                                             call["function"]["name"])
            self.logprobs = []
            events += self._open(item)
        item = self.calls[call["index"]]
        if pieces := call["function"].get("arguments"):
            item.arguments += pieces
            events.append(self._event("response.function_call_arguments.delta", **self._where(item), delta=pieces))
        return events
