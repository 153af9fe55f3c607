"""The WebSocket endpoint: several streamed requests over one socket, each under the client's id
(docs/server.md has the protocol).

A socket's requests are tasks of one task group. A message that cannot be read fails alone (an
error tagged with its id, or id null); an unexpected error in a request fails that request. The
socket closes when the client goes (its requests are aborted), after server.ws_idle_timeout_s
with nothing in flight, and, when the server shuts down, as soon as nothing is in flight (requests
still running at the end of the grace period are ended with `cancelled`).
"""

from __future__ import annotations

import json
from contextlib import aclosing
from typing import Any

import anyio
import structlog
from quart import websocket

from llmserve.config import ServerConfig
from llmserve.server.metrics import Metrics
from llmserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, check_value, parse, parse_json
from llmserve.server.serving import OpenAIServing

log = structlog.get_logger("llmserve.server")

GOING_AWAY = 1001
"""Close code for a socket closed because the server stops."""


class WebSocketSession:
    def __init__(self, serving: OpenAIServing, metrics: Metrics, cfg: ServerConfig, draining: anyio.Event) -> None:
        self.serving, self.metrics, self.cfg, self.draining = serving, metrics, cfg, draining
        self.lock = anyio.Lock()
        self.active: dict[str, anyio.CancelScope] = {}
        self.quiet = anyio.Event()  # set whenever nothing is in flight
        self.quiet.set()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._close_when_draining, tg)
            while True:
                with anyio.move_on_after(self.cfg.ws_idle_timeout_s) as idle:
                    raw = await websocket.receive()
                if not idle.cancelled_caught:
                    try:
                        await self._on_message(raw, tg)
                    except Exception:  # a bug a message exposed: that message fails, the socket goes on
                        log.exception("websocket message failed")
                        await self._error(None, APIError("internal error", status=500, type="server_error"))
                elif not self.active:
                    await websocket.close(1000, f"idle for {self.cfg.ws_idle_timeout_s:g} s")
                    tg.cancel_scope.cancel()
                    return

    async def _close_when_draining(self, tg: anyio.abc.TaskGroup) -> None:
        await self.draining.wait()
        await self.quiet.wait()
        await websocket.close(GOING_AWAY, "server shutting down")
        tg.cancel_scope.cancel()

    async def send(self, obj: dict) -> None:
        async with self.lock:
            await websocket.send(json.dumps(obj, ensure_ascii=False))

    async def _error(self, rid: str | None, exc: APIError) -> None:
        self.metrics.count_error(exc)
        await self.send({"id": rid, **exc.body()})

    async def _on_message(self, raw: str | bytes, tg: anyio.abc.TaskGroup) -> None:
        try:
            msg, suspect = parse_json(raw)
            if not isinstance(msg, dict) or not isinstance(msg.get("id"), str):
                raise APIError("each message must be a JSON object with a string id", param="id")
            if suspect:
                check_value(msg["id"])
        except APIError as exc:  # nothing to answer it under but id null
            await self._error(None, exc)
            return
        rid = msg["id"]
        if msg.get("cancel"):
            if rid in self.active:
                self.active[rid].cancel()
        elif self.draining.is_set():
            await self._error(rid, APIError("the server is shutting down", status=503, type="server_error",
                                            code="shutdown"))
        elif rid in self.active:
            await self._error(rid, APIError(f"id {rid!r} is already in flight on this socket", param="id"))
        elif len(self.active) >= self.cfg.max_ws_requests:
            await self._error(rid, APIError(f"too many requests in flight on this socket (server.max_ws_requests "
                                            f"is {self.cfg.max_ws_requests})", status=429, code="too_many_requests"))
        else:
            self.active[rid] = scope = anyio.CancelScope()
            self.quiet = anyio.Event()
            tg.start_soon(self._run_one, rid, msg.get("endpoint", "/v1/completions"), msg.get("body"), suspect, scope)

    async def _run_one(self, rid: str, endpoint: Any, body: Any, suspect: bool, scope: anyio.CancelScope) -> None:
        try:
            await self.send(await self._stream(rid, endpoint, body, suspect, scope))
        finally:  # only once its last message is out: a draining socket closes when quiet
            self.active.pop(rid, None)
            if not self.active:
                self.quiet.set()

    async def _stream(self, rid: str, endpoint: Any, body: Any, suspect: bool, scope: anyio.CancelScope) -> dict:
        """Send the request's chunks; return the message that ends it (done, error or cancelled)."""
        with scope:  # a cancel that arrived before this task started takes effect here
            try:
                serving = self.serving
                if suspect:
                    check_value(body)
                if endpoint == "/v1/completions":
                    job = serving.completion_job(parse(CompletionRequest, body))
                elif endpoint == "/v1/chat/completions":
                    job = serving.chat_job(parse(ChatCompletionRequest, body))
                else:
                    raise APIError(f"endpoint must be /v1/completions or /v1/chat/completions, got {endpoint!r}",
                                   param="endpoint")
                job.body.stream = True
                serving.admit(job)
                async with aclosing(serving.stream(job)) as chunks:  # closed in this task, also when cancelled
                    async for chunk in chunks:
                        await self.send({"id": rid, "chunk": chunk})
                return {"id": rid, "done": True}
            except APIError as exc:
                if exc.code == "shutdown":  # ended by the server's shutdown
                    return {"id": rid, "cancelled": True, "reason": "server shutting down"}
                error = exc
            except Exception:
                log.exception("websocket request failed", id=rid)
                error = APIError("internal error", status=500, type="server_error")
            self.metrics.count_error(error)
            return {"id": rid, **error.body()}
        return {"id": rid, "cancelled": True}  # by the client
