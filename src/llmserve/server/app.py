"""The Quart app: OpenAI-compatible routes, SSE and WebSocket streaming, auth, limits, errors.

Every error leaves as OpenAI's error object ({"error": {"message", "type", "param", "code"}}); no
traceback reaches a client, and no request can stop the engine.
"""

from __future__ import annotations

import hmac
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import structlog
from quart import Quart, Response, request, websocket
from werkzeug.exceptions import HTTPException

from llmserve import __version__
from llmserve.config import EngineConfig
from llmserve.engine import BUILTIN_MODEL_DIR, Frontend
from llmserve.server.metrics import Metrics
from llmserve.server.openapi import openapi_document
from llmserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                      TokenizeRequest, parse)
from llmserve.server.serving import OpenAIServing

log = structlog.get_logger("llmserve.server")

OPEN_PATHS = ("/health", "/metrics")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(body, ensure_ascii=False), status=status, headers=headers,
                    content_type="application/json")


def _sse(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n".encode()
        except APIError as exc:  # failed after the stream began: report in-band, as OpenAI does
            yield f"data: {json.dumps(exc.body())}\n\n".encode()
        yield b"data: [DONE]\n\n"
    return body()


async def _first(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """Pull the first chunk before answering, so errors found at admission still get a 4xx status."""
    first = await anext(chunks)

    async def rest() -> AsyncIterator[dict]:
        yield first
        async for chunk in chunks:
            yield chunk
    return rest()


def served_model_name(config: EngineConfig) -> str:
    if config.server.served_model_name:
        return config.server.served_model_name
    if config.model.model in ("builtin", str(BUILTIN_MODEL_DIR)):
        return "llmserve-builtin"
    return os.path.basename(os.path.normpath(config.model.model)) or "model"


def create_app(engine: Frontend, config: EngineConfig) -> Quart:
    cfg = config.server
    app = Quart("llmserve")
    app.config["MAX_CONTENT_LENGTH"] = cfg.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None  # a long generation streams for as long as it takes
    app.config["BODY_TIMEOUT"] = 60
    model_name = served_model_name(config)
    metrics = Metrics(engine)
    serving = OpenAIServing(engine, model_name, metrics)
    api_key = cfg.api_key or os.environ.get("LLMSERVE_API_KEY") or None
    app.extensions["llmserve"] = {"engine": engine, "metrics": metrics, "serving": serving}

    # ---- guards ----------------------------------------------------------------------------------

    def authorized(headers) -> bool:
        if api_key is None:
            return True
        given = headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())

    def guarded(path: str) -> bool:
        return api_key is not None and (cfg.protect_health_metrics or path not in OPEN_PATHS)

    @app.before_request
    async def check_key():
        if guarded(request.path) and not authorized(request.headers):
            raise APIError("Invalid or missing API key (Authorization: Bearer ...)", status=401,
                           type="authentication_error", code="invalid_api_key")

    @app.before_websocket
    async def check_ws_key():
        if guarded(websocket.path) and not authorized(websocket.headers):
            raise APIError("Invalid or missing API key (Authorization: Bearer ...)", status=401,
                           type="authentication_error", code="invalid_api_key")

    def admit() -> None:
        waiting = engine.snapshot().waiting
        if waiting >= cfg.max_waiting_requests:
            raise APIError(f"The server is busy: {waiting} requests are waiting (server.max_waiting_requests is "
                           f"{cfg.max_waiting_requests}); retry later", status=503, type="server_error",
                           code="overloaded", headers={"Retry-After": "1"})

    async def body_json() -> Any:
        raw = await request.get_data()
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise APIError("request body is not valid UTF-8") from None
        except json.JSONDecodeError as exc:
            raise APIError(f"request body is not valid JSON: {exc.msg} at position {exc.pos}") from None

    # ---- errors ----------------------------------------------------------------------------------

    @app.errorhandler(APIError)
    async def on_api_error(exc: APIError):
        return _json(exc.body(), exc.status, exc.headers)

    @app.errorhandler(HTTPException)
    async def on_http_error(exc: HTTPException):
        status = exc.code or 500
        if status == 404:
            err = APIError(f"no route {request.path}", status=404, type="not_found_error")
        elif status == 413:
            err = APIError(f"request body is larger than server.max_body_bytes ({cfg.max_body_bytes} bytes)",
                           status=413)
        else:
            err = APIError(exc.description or exc.name, status=status)
        return _json(err.body(), status)

    @app.errorhandler(Exception)
    async def on_error(exc: Exception):
        log.exception("request failed", path=request.path)
        return _json(APIError("internal error", status=500, type="server_error").body(), 500)

    # ---- OpenAI endpoints -------------------------------------------------------------------------

    async def respond(job) -> Response:
        admit()
        if job.body.stream:
            chunks = await _first(serving.stream(job))
            return Response(_sse(chunks), content_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return _json(await serving.full_response(job))

    @app.post("/v1/completions")
    async def completions():
        return await respond(serving.completion_job(parse(CompletionRequest, await body_json())))

    @app.post("/v1/chat/completions")
    async def chat_completions():
        return await respond(serving.chat_job(parse(ChatCompletionRequest, await body_json())))

    @app.websocket("/v1/ws")
    async def ws():
        """Several requests per socket, each tagged with the client's id; see docs/server.md."""
        await websocket.accept()
        lock = anyio.Lock()
        active: dict[str, anyio.CancelScope] = {}

        async def send(obj: dict) -> None:
            async with lock:
                await websocket.send(json.dumps(obj, ensure_ascii=False))

        async def run_one(rid: str, endpoint: str, body: Any, scope: anyio.CancelScope) -> None:
            with scope:  # a cancel that arrived before this task started takes effect here
                try:
                    if endpoint == "/v1/completions":
                        job = serving.completion_job(parse(CompletionRequest, body))
                    elif endpoint == "/v1/chat/completions":
                        job = serving.chat_job(parse(ChatCompletionRequest, body))
                    else:
                        raise APIError(f"endpoint must be /v1/completions or /v1/chat/completions, got {endpoint!r}",
                                       param="endpoint")
                    job.body.stream = True
                    admit()
                    async for chunk in serving.stream(job):
                        await send({"id": rid, "chunk": chunk})
                    await send({"id": rid, "done": True})
                except APIError as exc:
                    await send({"id": rid, **exc.body()})
                finally:
                    active.pop(rid, None)
            if scope.cancelled_caught:
                await send({"id": rid, "cancelled": True})

        async with anyio.create_task_group() as tg:
            while True:
                raw = await websocket.receive()
                try:
                    msg = json.loads(raw)
                    if not isinstance(msg, dict) or not isinstance(msg.get("id"), str):
                        raise ValueError
                except ValueError:
                    await send({"id": None, **APIError("each message must be a JSON object with a string id",
                                                        param="id").body()})
                    continue
                rid = msg["id"]
                if msg.get("cancel"):
                    if rid in active:
                        active[rid].cancel()
                    continue
                if rid in active:
                    await send({"id": rid, **APIError(f"id {rid!r} is already in flight on this socket",
                                                      param="id").body()})
                elif len(active) >= cfg.max_ws_requests:
                    await send({"id": rid, **APIError(f"too many requests in flight on this socket "
                                                      f"(server.max_ws_requests is {cfg.max_ws_requests})",
                                                      status=429, code="too_many_requests").body()})
                else:
                    active[rid] = scope = anyio.CancelScope()
                    tg.start_soon(run_one, rid, msg.get("endpoint", "/v1/completions"), msg.get("body"), scope)

    @app.get("/v1/models")
    async def models():
        return _json({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                                  "owned_by": "llmserve", "max_model_len": engine.max_model_len}]})

    # ---- operations --------------------------------------------------------------------------------

    @app.get("/health")
    async def health():
        if not engine.running:
            return _json(APIError("engine is not running", status=503, type="server_error").body(), 503)
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
        if engine.tokenizer is None:
            raise APIError("this model has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            text, special = serving.render_chat(body), False
        else:
            text, special = body.prompt, body.add_special_tokens
        tokens = engine.tokenizer.encode(text, add_special_tokens=special)
        return _json({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len})

    @app.post("/detokenize")
    async def detokenize():
        body = parse(DetokenizeRequest, await body_json())
        if engine.tokenizer is None:
            raise APIError("this model has no tokenizer")
        vocab = engine.spec.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(f"tokens must be in [0, {vocab}), got {bad[:5]}", param="tokens")
        return _json({"prompt": engine.tokenizer.decode(body.tokens)})

    @app.get("/openapi.json")
    async def openapi():
        return _json(openapi_document(app))

    return app
