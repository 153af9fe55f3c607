"""The Quart app: OpenAI-compatible routes, SSE and WebSocket streaming, auth, limits, errors.

Every error leaves as OpenAI's error object ({"error": {"message", "type", "param", "code"}}); no
traceback reaches a client, and no request can stop the engine. A stream that fails after it began
ends with an error event, then `data: [DONE]` (a Responses stream: its `error` and `response.failed`
events).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections import Counter
from functools import partial
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
import structlog
from quart import Quart, Response, has_request_context, request, websocket
from werkzeug.exceptions import HTTPException

from llmserve import __version__
from llmserve.actors.request_actor import LONG_PROMPT_CHARS
from llmserve.config import EngineConfig
from llmserve.engine import BUILTIN_MODEL_DIR, Frontend, resolve_model_dir
from llmserve.server.metrics import Metrics
from llmserve.server.openapi import openapi_document
from llmserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest, decode_body, parse)
from llmserve.server.reasoning import reasoning_format
from llmserve.server.responses import ResponsesRequest, ResponseWriter, responses_error
from llmserve.server.security import Gate
from llmserve.server.serving import OpenAIServing
from llmserve.server.tool_calls import tool_parser
from llmserve.server.websocket import WebSocketSession

log = structlog.get_logger("llmserve.server")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status=status, headers=headers,
                    content_type="application/json")


def _sse(chunks: AsyncIterator[dict], metrics: Metrics) -> AsyncIterator[bytes]:
    async def body() -> AsyncIterator[bytes]:
        try:
            async with aclosing(chunks):  # closed here, in this task, whenever the stream ends
                async for chunk in chunks:
                    yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
        except Exception as exc:  # failed after the stream began: report in-band, as OpenAI does
            if not isinstance(exc, APIError):
                log.exception("stream failed")  # (no request context left while a body streams)
                exc = APIError("internal error", status=500, type="server_error")
            metrics.count_error(exc)
            yield f"data: {json.dumps(exc.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"
    return body()


def _response_events(writer: ResponseWriter, chunks: AsyncIterator[dict], metrics: Metrics) -> AsyncIterator[bytes]:
    """A Responses stream as OpenAI sends it: each event under its type's name, nothing after the
    last (no `[DONE]`); a failure after it began ends it with the writer's error events."""
    def frame(event: dict) -> bytes:
        return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()

    async def body() -> AsyncIterator[bytes]:
        try:
            async with aclosing(writer.events(chunks)) as events:
                async for event in events:
                    yield frame(event)
        except Exception as exc:
            if not isinstance(exc, APIError):
                log.exception("stream failed")
                exc = APIError("internal error", status=500, type="server_error")
            metrics.count_error(exc)
            for event in writer.fail(responses_error(exc)):
                yield frame(event)
    return body()


async def _first(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """Pull the first chunk before answering, so errors found at admission still get a 4xx status."""
    try:
        first = await anext(chunks)
    except BaseException:
        await chunks.aclose()
        raise

    async def rest() -> AsyncIterator[dict]:
        async with aclosing(chunks):
            yield first
            async for chunk in chunks:
                yield chunk
    return rest()


def served_model_names(config: EngineConfig) -> list[str]:
    """The names a request's `model` may give; responses and metrics report the first."""
    names = config.server.served_model_name
    if names:
        return [names] if isinstance(names, str) else list(names)
    if config.model.model in ("builtin", str(BUILTIN_MODEL_DIR)):
        return ["llmserve-builtin"]
    return [os.path.basename(os.path.normpath(config.model.model)) or "model"]


def served_model_name(config: EngineConfig) -> str:
    return served_model_names(config)[0]


def api_keys(config: EngineConfig) -> list[str]:
    """server.api_key, or else LLMSERVE_API_KEY, or else VLLM_API_KEY (a deployment moved from vLLM
    must not come up without its key); none: the API is open."""
    keys = config.server.api_key or os.environ.get("LLMSERVE_API_KEY") or os.environ.get("VLLM_API_KEY")
    return [keys] if isinstance(keys, str) else list(keys or [])


def create_app(engine: Frontend, config: EngineConfig, draining: anyio.Event | None = None) -> Quart:
    """`draining`, once set, means the server is stopping: new requests get 503, idle WebSockets close."""
    cfg = config.server
    app = Quart("llmserve")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # a long generation streams for as long as it takes
    app.config["BODY_TIMEOUT"] = 60
    draining = draining or anyio.Event()
    names = served_model_names(config)
    model_name = names[0]
    metrics = Metrics(engine, model_name, cfg.metrics_prefix, config)
    # an unknown tool-call or reasoning parser: a start-up error
    serving = OpenAIServing(engine, names, metrics, cfg, tool_parser(config), reasoning_format(config))
    gate = Gate(cfg, api_keys(config))
    sockets_of: Counter[str] = Counter()  # open WebSockets per client address
    app.extensions["llmserve"] = {"engine": engine, "metrics": metrics, "serving": serving}

    # ---- guards ----------------------------------------------------------------------------------

    @app.before_request
    async def check_request():
        if request.method == "OPTIONS" and "Access-Control-Request-Method" in request.headers:  # CORS preflight
            gate.check_source(request.headers)
            return Response(status=204, headers=gate.cors_headers(request.headers.get("Origin"), preflight=True))
        gate.check(request.path, request.headers)
        if request.method == "POST":
            if draining.is_set():
                raise APIError("the server is shutting down", status=503, type="server_error", code="shutdown")
            gate.check_json(request.mimetype, request.headers.get("Content-Encoding"))

    @app.before_websocket
    async def check_websocket():
        gate.check(websocket.path, websocket.headers, websocket.requested_subprotocols)

    @app.after_request
    async def add_headers(response: Response) -> Response:
        response.headers.update(gate.cors_headers(request.headers.get("Origin")))
        if cfg.enable_request_id_headers:
            response.headers["X-Request-Id"] = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        return response

    async def body_json() -> Any:
        return decode_body(await request.get_data())

    # ---- errors ----------------------------------------------------------------------------------

    @app.errorhandler(APIError)
    async def on_api_error(exc: APIError):
        metrics.count_error(exc)
        return _json(exc.body(), exc.status, exc.headers)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException):
        status = exc.code or 500
        headers = {}
        if status == 404:
            err = APIError(f"no route {request.path}", status=404, type="not_found_error")
        elif status == 405:
            allowed = ", ".join(sorted(getattr(exc, "valid_methods", None) or []))
            err = APIError(f"{request.method} is not allowed on {request.path} (allowed: {allowed})", status=405)
            headers["Allow"] = allowed
        elif status == 413:
            err = APIError(f"request body is larger than server.max_body_bytes ({cfg.max_body_bytes} bytes)",
                           status=413)
        else:
            err = APIError(exc.description or exc.name, status=status)
        metrics.count_error(err)
        return _json(err.body(), status, headers)

    @app.errorhandler(Exception)
    async def on_error(exc: Exception):
        log.exception("request failed", path=(request if has_request_context() else websocket).path)
        err = APIError("internal error", status=500, type="server_error")
        metrics.count_error(err)
        return _json(err.body(), 500)

    # ---- OpenAI endpoints -------------------------------------------------------------------------

    async def respond(job) -> Response:
        if job.body.stream_options is not None and not job.body.stream:  # as OpenAI answers it
            raise APIError("stream_options is only allowed when stream is true", param="stream_options")
        serving.admit(job)
        if job.body.stream:
            chunks = await _first(serving.stream(job))
            return Response(_sse(chunks, metrics), content_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
        return _json(await serving.full_response(job))

    def with_request_id(body):
        """vLLM's: the X-Request-Id header, where there is one, names the request (over its request_id)."""
        if header := request.headers.get("X-Request-Id"):
            body.request_id = header[:256]
        return body

    @app.post("/v1/completions")
    async def completions():
        return await respond(serving.completion_job(with_request_id(parse(CompletionRequest, await body_json()))))

    @app.post("/v1/chat/completions")
    async def chat_completions():
        return await respond(serving.chat_job(with_request_id(parse(ChatCompletionRequest, await body_json()))))

    @app.post("/v1/responses")
    async def responses():
        body = parse(ResponsesRequest, await body_json())
        chat = body.chat_request()
        try:  # the chat job names the fields as chat has them: the client is told the Responses names
            job = serving.chat_job(chat)
            job.cached_in_usage = True
            serving.admit(job)
            writer = ResponseWriter(body, job.model, job.params,
                                    lambda text: len(engine.tokenizer.encode(text, add_special_tokens=False)))
            if body.stream:
                chunks = await _first(serving.stream(job))
                return Response(_response_events(writer, chunks, metrics), content_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
            return _json(await writer.complete(serving.stream(job)))
        except APIError as exc:
            raise responses_error(exc) from None

    @app.websocket("/v1/ws")
    async def ws():
        """Several requests per socket, each tagged with the client's id; see docs/server.md."""
        client = websocket.remote_addr or ""
        if sockets_of[client] >= cfg.max_ws_per_client:
            raise APIError(f"too many WebSockets open from {client} (server.max_ws_per_client is "
                           f"{cfg.max_ws_per_client})", status=429, code="too_many_connections")
        if draining.is_set():
            raise APIError("the server is shutting down", status=503, type="server_error", code="shutdown")
        sockets_of[client] += 1
        try:
            await websocket.accept(subprotocol=gate.ws_subprotocol(websocket.requested_subprotocols))
            await WebSocketSession(serving, metrics, cfg, draining).run()
        finally:
            sockets_of[client] -= 1
            if not sockets_of[client]:
                del sockets_of[client]

    # `root` is the checkpoint's path, as vLLM reports it: clients that load the tokenizer by what
    # the server says (lm-eval, guidellm) find it there
    created = int(time.time())

    def card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "llmserve",
                "root": resolve_model_dir(config.model.model), "parent": None, "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return _json({"object": "list", "data": [card(name) for name in names]})

    @app.get("/v1/models/<path:model_id>")  # a path: served names often hold a slash ("org/name")
    async def model(model_id: str):
        if model_id not in names:
            served = ", ".join(f"'{n}'" for n in names)
            raise APIError(f"The model '{model_id}' does not exist: this server serves {served}", status=404,
                           param="model", code="model_not_found")
        return _json(card(model_id))

    # ---- operations --------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not engine.running or draining.is_set():
            reason = "the server is shutting down" if draining.is_set() else "engine is not running"
            return _json(APIError(reason, status=503, type="server_error").body(), 503)
        return _json({"status": "ok"})

    @app.get("/version")
    async def version():
        return _json({"version": __version__})

    @app.get("/metrics")
    async def metrics_route():
        return Response(metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize():
        body = parse(TokenizeRequest, await body_json())
        serving.check_model(body)
        if engine.tokenizer is None:
            raise APIError("this model has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            text, special = serving.render_chat(body), False
        else:
            text, special = body.prompt, body.add_special_tokens
        encode = partial(engine.tokenizer.encode, text, add_special_tokens=special)
        # a long text on a worker thread, as the engine tokenizes prompts: the loop serves on meanwhile
        tokens = await anyio.to_thread.run_sync(encode) if len(text) > LONG_PROMPT_CHARS else encode()
        return _json({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize():
        body = parse(DetokenizeRequest, await body_json())
        serving.check_model(body)
        if engine.tokenizer is None:
            raise APIError("this model has no tokenizer")
        vocab = engine.spec.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return _json({"prompt": engine.tokenizer.decode(body.tokens)})

    @app.get("/openapi.json")
    async def openapi():
        return _json(openapi_document(app, cfg))

    return app
