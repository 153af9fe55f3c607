"""OpenAI wire format: request bodies (validated by pydantic, which also gives the OpenAPI schemas)
and the error object. A body's unknown fields are refused (_STRICT); known ones are taken strictly
as their type ("stream": "yes" is not a boolean, 2.0 is not a token count). The Responses API's
body is in responses.py."""

from __future__ import annotations

import dataclasses
import json
import re
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, create_model, model_validator

from llmserve.sampling_params import MAX_LOGPROBS, REQUEST_FIELDS, SamplingParams


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}
_UNION_FORMS = {"prompt": "a string, a list of strings, a list of token ids (integers) or a list of such lists",
                "stop": "a string or a list of strings",
                "tool_choice": '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'}


class APIError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_value_error(cls, exc: ValueError, default_param: str | None = None) -> APIError:
        """Our ValueErrors start with the offending field's name ("top_p must be in (0, 1]...")."""
        message = str(exc)
        first = message.split(" ", 1)[0].split(":", 1)[0].split(".", 1)[0]
        param = first if first.replace("_", "").isalnum() and first.islower() else default_param
        return cls(message, param=param)

    @classmethod
    def from_validation_error(cls, exc: ValidationError) -> APIError:
        err = exc.errors()[0]
        # A union field's location ends in the member type tried ("stop.str"): name the field only.
        # List items are named as in JavaScript, messages[0].role.
        param = ""
        for part in err["loc"]:
            if isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part[:1].isupper()):
                forms = f"; it takes {_UNION_FORMS[param]}" if param in _UNION_FORMS else ""
                return cls(f"{param}: {err['input']!r} is not a valid value{forms}", param=param)
            param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else str(part)
        param = param or None
        if err["type"] == "extra_forbidden":
            return cls(f"{param} is not a field of this request (an unknown field is refused, not ignored; "
                       "docs/server.md lists the fields)", param=param)
        return cls(f"{param}: {err['msg']}" if param else err["msg"], param=param)


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
MAX_DEPTH = 64
"""Nesting levels a body may have (json's own limit is the interpreter's recursion limit)."""


class _NotANumber(ValueError):
    """NaN, Infinity or -Infinity, which Python's json takes and JSON does not."""


def _refuse_constant(name: str) -> None:
    raise _NotANumber(name)


def decode_body(raw: bytes | str) -> Any:
    """The JSON value of a request body, or an APIError naming what is wrong: not UTF-8, not JSON
    (NaN and Infinity included), too deep, an integer of thousands of digits, or a string holding a
    lone UTF-16 surrogate ("\\ud800": JSON can spell it, UTF-8 and the tokenizer cannot take it)."""
    data, suspect = parse_json(raw)
    if suspect:
        check_value(data)
    return data


def parse_json(raw: bytes | str, where: str | None = None) -> tuple[Any, bool]:
    """(value, suspect): the JSON value, and whether it may hold a lone surrogate or nesting too deep
    for `check_value` to pass (only a \\uD800-\\uDFFF escape can put a surrogate in a string, and
    only many brackets can nest: the common body needs no walk). `where`: the field whose text it
    is (JSON inside a string: a call's arguments), named by the errors; the body where None."""
    what = where or "request body"
    if isinstance(raw, bytes):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise APIError(f"{what} is not valid UTF-8", param=where) from None
    else:
        text, raw = raw, raw.encode("utf-8", "surrogatepass")
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise APIError(f"{what} is not valid JSON: {exc.msg} at position {exc.pos}", param=where) from None
    except RecursionError:
        raise APIError(f"{what} is nested more than {MAX_DEPTH} levels deep", param=where) from None
    except _NotANumber as exc:
        raise APIError(f"{what} is not valid JSON: {exc} is not a JSON number", param=where) from None
    except ValueError as exc:  # an integer past the interpreter's digit limit
        raise APIError(f"{what} is not acceptable JSON: {exc}", param=where) from None
    return data, bool(_SURROGATE_ESCAPE.search(raw)) or text.count("[") + text.count("{") > MAX_DEPTH


def check_value(data: Any, where: str | None = None) -> None:
    """Raise an APIError naming the first string with a lone surrogate, or a nesting too deep;
    `where`: the field `data` was parsed from (parse_json), the `param` of either."""
    stack: list[tuple[Any, str, int]] = [(data, where or "", 0)]
    while stack:
        value, path, depth = stack.pop()
        field = where or path.split(".")[0].split("[")[0] or None  # the top-level field, for `param`
        if depth > MAX_DEPTH:
            raise APIError(f"{field or 'body'}: nested more than {MAX_DEPTH} levels deep", param=field)
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise APIError(f"{path or 'body'}: the string holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                               "which is not text", param=field) from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((key, path, depth + 1))
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """A null for a field that has a default other than null leaves the field unset, as OpenAI's
        API takes it (clients send its nullable fields as null: stream, n, temperature, echo...)."""
        if not isinstance(data, dict) or None not in data.values():
            return data
        fields = cls.model_fields
        return {key: value for key, value in data.items()
                if value is not None or key not in fields or fields[key].is_required() or fields[key].default is None}


_STRICT = ConfigDict(extra="forbid", strict=True)
"""A request body's own fields: an unknown one is a 400 naming it, as OpenAI's API answers, never a
200 that ignored what was asked. The objects inside a body (messages, tools) stay lenient: clients
send back the assistant messages they received, with fields such as `refusal` or `annotations`."""


class StreamOptions(_Request):
    model_config = _STRICT  # (options, not an object clients echo back: an unknown one is refused)
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: with include_usage, every chunk carries the usage so far."""


def _request_field(f: dataclasses.Field, hints: dict[str, Any]) -> tuple[Any, Any]:
    """(type, default) of a SamplingParams field as an HTTP body takes it: JSON object keys are
    strings, so logit_bias is keyed by the token id's digits."""
    kind = dict[str, float] | None if f.name == "logit_bias" else hints[f.name]
    if f.default_factory is not dataclasses.MISSING:
        return kind, Field(default_factory=f.default_factory)
    return kind, f.default


_hints = typing.get_type_hints(SamplingParams)
_SamplingParamsFields = create_model(
    "_SamplingParamsFields", __base__=_Request,
    **{f.name: _request_field(f, _hints) for f in dataclasses.fields(SamplingParams) if f.name in REQUEST_FIELDS})


class JsonSchemaFormat(_Request):
    model_config = _STRICT
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Request):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


REMOVED_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
"""vLLM's former structured-output fields: answered with a 400 that names their replacement, so a
client written for them does not silently get unconstrained output."""
REMOVED_GUIDED_OPTIONS = {
    "guided_decoding_backend": "the grammar engine is the server's, xgrammar (\"xgrammar\" and \"auto\" are taken)",
    "guided_whitespace_pattern": "a grammar's whitespace is its own (json_object and schemas: JSON's)",
}
"""vLLM's former options of those fields, sent beside them by older clients: a 400 saying why
(a backend that asks for what the server uses is taken)."""


class _AdvisoryFields(_Request):
    """OpenAI's advisory fields: accepted, and they change nothing here (docs/server.md)."""
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class _SamplingFields(_SamplingParamsFields, _AdvisoryFields):
    """Fields shared by both endpoints: SamplingParams' REQUEST_FIELDS (the engine's extras beyond
    OpenAI's among them) and the request's own."""
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    """vLLM's: exactly one of json (a schema), regex, choice, grammar (EBNF), json_object."""
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprobs name each token "token_id:N" instead of its text."""
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    """vLLM's: each prompt position's logprob and the k most likely there (not streamed)."""
    request_id: str | None = Field(default=None, min_length=1, max_length=256)
    """vLLM's: what the response's id is made of ("cmpl-ID", "chatcmpl-ID"), unless an X-Request-Id
    header names the request; without either, a new id. Requests may share one."""
    use_beam_search: bool = False
    """vLLM's: the n best beams of a beam search (llmserve/beam_search.py) as the choices."""
    length_penalty: float = 1.0
    """vLLM's, with use_beam_search: a finished beam scores sum(logprobs) / (its tokens ** length_penalty)."""

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None,
                        constraint: dict[str, Any] | None = None) -> SamplingParams:
        """`defaults` (the model's, e.g. from its generation_config.json) replace the fields this
        request did not set; a field it set, even to the OpenAI default, stays as sent.
        `constraint` (a tool_choice's) takes the place of the request's own structured output."""
        fields = {key: getattr(self, key) for key in REQUEST_FIELDS}
        fields.update((key, value) for key, value in (defaults or {}).items() if key not in self.model_fields_set)
        return SamplingParams(**fields, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              structured_outputs=self.structure() if constraint is None else constraint)

    def structure(self) -> dict[str, Any] | None:
        """The request's structured_outputs, from response_format or vLLM's field."""
        for name in REMOVED_GUIDED_FIELDS:
            if getattr(self, name) is not None:
                kind = name.removeprefix("guided_")
                raise APIError(f"{name} is no longer supported: send structured_outputs: {{\"{kind}\": ...}}"
                               + (" or response_format: {\"type\": \"json_schema\", ...}" if kind == "json" else ""),
                               param=name)
        for name, why in REMOVED_GUIDED_OPTIONS.items():
            value = getattr(self, name)
            if value is not None and not (name == "guided_decoding_backend" and value in ("xgrammar", "auto")):
                raise APIError(f"{name} is not supported: {why}", param=name)
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return self.structured_outputs
        if self.structured_outputs is not None:
            raise APIError("response_format and structured_outputs both constrain the output: send one",
                           param="structured_outputs")
        if fmt.type == "json_object":
            return {"json_object": True}
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError("response_format.json_schema.schema is required when type is json_schema",
                           param="response_format")
        return {"json": fmt.json_schema.schema_}

    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    model_config = _STRICT
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # token ids: no true, 2.0 or "2"
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True
    """vLLM's: the tokenizer's special tokens (a BOS) around each text prompt."""

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; left out, the function takes none."""
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any]
    """JSON text of an object, as the API returns it (an object is taken too)."""


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant message's calls (its content may then be null)."""
    tool_call_id: str | None = None
    """A tool message's: the call it answers."""
    reasoning: str | None = None
    """An assistant message's thinking, as a reasoning parser reported it (`reasoning_content`:
    its name before vLLM renamed it): the template gets it back (interleaved thinking)."""
    reasoning_content: str | None = None

    def text(self, where: str = "messages") -> str:
        """The content as one string; `where` names the message in a 400 (messages[i])."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for j, part in enumerate(self.content):
            if part.get("type") != "text":
                raise APIError(f"{where}.content[{j}]: content part type {part.get('type')!r} is not supported "
                               "(only 'text')", param=f"{where}.content[{j}].type")
            if not isinstance(part.get("text"), str):
                raise APIError(f"{where}.content[{j}].text must be a string, got {part.get('text')!r}",
                               param=f"{where}.content[{j}].text")
            parts.append(part["text"])
        return "".join(parts)


class _ChatTemplateFields(_Request):
    """How messages are rendered (vLLM's extras): `chat_template_kwargs` become the template's
    variables (Qwen3's `enable_thinking`, say); `continue_final_message` leaves the last message
    open for the model to continue, in place of a generation prompt."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    """vLLM's per-request template: refused (server.chat_template sets the server's)."""
    tools: list[ToolDefinition] | None = None
    """Passed to the template (transformers' `tools`), whatever tool_choice says."""


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    model_config = _STRICT
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    """Unset: "auto" with tools, none without (server/tool_calls.py has each mode)."""
    parallel_tool_calls: bool | None = None
    echo: bool = False
    """vLLM's: the answer's content begins with the last message's where that is the assistant's
    (with continue_final_message: the whole message, not only its continuation)."""
    include_reasoning: bool = True
    """vLLM's: false leaves the thinking a reasoning parser tells apart out of the answer."""
    add_special_tokens: bool = False
    """vLLM's: the tokenizer's special tokens around the rendered messages, on top of those the
    template writes (off, as the template writes its own BOS)."""
    # OpenAI fields this server does not implement: a 400 naming each when set (unsupported())
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None

    def unsupported(self) -> None:
        """A 400 for an OpenAI field set that this server cannot honour."""
        if self.functions is not None or self.function_call is not None:
            name = "functions" if self.functions is not None else "function_call"
            raise APIError(f"{name} is OpenAI's deprecated form of tools: send tools and tool_choice", param=name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise APIError(f"modalities: only [\"text\"] is supported, got {self.modalities}", param="modalities")
        for name in ("audio", "prediction", "web_search_options", "reasoning_effort", "verbosity"):
            if getattr(self, name) is not None:
                raise APIError(f"{name} is not supported by this server", param=name)


class TokenizeRequest(_ChatTemplateFields):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model_config = _STRICT
    model: str | None = None
    tokens: list[int]


def parse(model: type[BaseModel], data: Any) -> Any:
    if not isinstance(data, dict):
        raise APIError("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise APIError.from_validation_error(exc) from None
