"""The OpenAPI 3.1 document of the HTTP API, built from the same pydantic models that validate
request bodies, so the document and the server cannot disagree on what is accepted."""

from __future__ import annotations

import re
from typing import Any

from pydantic.json_schema import models_json_schema

from llmserve import __version__
from llmserve.config import ServerConfig
from llmserve.sampling_params import LOGIT_BIAS_RANGE, MAX_N, RANGES, Range
from llmserve.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from llmserve.server.responses import ResponsesRequest

_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/v1/responses": ResponsesRequest, "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}

_DESCRIPTIONS = {
    "/v1/completions": "Text completion (OpenAI). With stream=true, Server-Sent Events ending in `data: [DONE]`.",
    "/v1/chat/completions": "Chat completion with the checkpoint's chat template (OpenAI). Streams like completions.",
    "/v1/responses": "OpenAI's Responses API, stateless: input items and instructions rendered as chat messages. "
                     "With stream=true, named Server-Sent Events (response.created ... response.completed).",
    "/v1/models": "The served model.",
    "/v1/models/{model_id}": "The served model's card, if model_id is its name (404 otherwise).",
    "/v1/ws": "WebSocket streaming. Send {\"id\": ..., \"endpoint\": \"/v1/completions\" | \"/v1/chat/completions\", "
              "\"body\": {...}} (several may be in flight), or {\"id\": ..., \"cancel\": true}. Receive "
              "{\"id\", \"chunk\"} objects (the SSE chunks), then {\"id\", \"done\": true}, or {\"id\", \"error\"} / "
              "{\"id\", \"cancelled\": true}. Closing the socket aborts its requests.",
    "/health": "200 while the engine runs.",
    "/version": "The server's version.",
    "/metrics": "Prometheus text format.",
    "/tokenize": "Token ids of a prompt, or of chat messages rendered with the chat template.",
    "/detokenize": "Text of token ids.",
    "/openapi.json": "This document.",
}


def _members(schema: dict, kind: str) -> list[dict]:
    """The schema itself or its anyOf members of JSON type `kind`."""
    return [m for m in schema.get("anyOf", [schema]) if m.get("type") == kind]


def _bound(schema: dict, r: Range) -> None:
    for m in _members(schema, "integer") + _members(schema, "number"):
        m["exclusiveMinimum" if r.open_lo else "minimum"] = r.lo
        m["maximum"] = r.hi


def _state_limits(schemas: dict[str, Any], cfg: ServerConfig) -> None:
    """Write the limits the server enforces beyond the fields' types into the body schemas: the
    sampling ranges and this server's per-request bounds (server.max_*)."""
    for body in (CompletionRequest, ChatCompletionRequest):
        props = schemas[body.__name__]["properties"]
        for name, r in RANGES.items():
            if name in props:
                _bound(props[name], r)
        _bound(props["n"], Range(1, min(MAX_N, cfg.max_choices)))
        _bound(props["seed"], Range(0, 2**63 - 1))
        for m in _members(props["logit_bias"], "object"):
            m["maxProperties"] = cfg.max_logit_bias
            _bound(m["additionalProperties"], LOGIT_BIAS_RANGE)
        for m in _members(props["stop"], "array"):
            m["maxItems"] = cfg.max_stop_sequences
            m["items"]["maxLength"] = cfg.max_stop_chars
        for m in _members(props["stop"], "string"):
            m["maxLength"] = cfg.max_stop_chars
        props["stop_token_ids"]["maxItems"] = cfg.max_stop_sequences
        for m in _members(props["bad_words"], "array"):
            m["maxItems"] = cfg.max_bad_words
    for m in _members(schemas["CompletionRequest"]["properties"]["prompt"], "array"):
        m["maxItems"] = cfg.max_choices
    _bound(schemas["ChatCompletionRequest"]["properties"]["top_logprobs"], RANGES["logprobs"])
    for name in ("temperature", "top_p"):
        _bound(schemas["ResponsesRequest"]["properties"][name], RANGES[name])


def openapi_document(app, cfg: ServerConfig) -> dict[str, Any]:
    keys, schema = models_json_schema([(m, "validation") for m in _BODIES.values()],
                                      ref_template="#/components/schemas/{model}")
    schemas = dict(schema.get("$defs", {}))
    _state_limits(schemas, cfg)
    schemas["Error"] = _ERROR
    paths: dict[str, Any] = {}
    for rule in app.url_map.iter_rules():
        path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)  # Quart's <path:name> is OpenAPI's {name}
        if path.startswith("/static"):
            continue
        methods = sorted((rule.methods or set()) - {"HEAD", "OPTIONS"}) or ["GET"]
        for method in methods:
            op: dict[str, Any] = {"summary": _DESCRIPTIONS.get(path, path), "responses": {
                "200": {"description": "OK"},
                "4XX": {"description": "OpenAI error object",
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}}}
            if path in _BODIES and method == "POST":
                ref = keys[(_BODIES[path], "validation")]
                op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
            paths.setdefault(path, {})[method.lower()] = op
    return {"openapi": "3.1.0", "info": {"title": "llmserve", "version": __version__}, "paths": paths,
            "components": {"schemas": schemas,
                           "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}}
