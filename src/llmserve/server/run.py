"""Serve: the engine's request actor and Hypercorn in one anyio task group on asyncio; the device side
(scheduler, KV manager, executor) in a child process (server.engine_process, the default) or on
the same loop.

Shutdown (SIGINT/SIGTERM, or `stop` set):
    1. stop accepting connections; new requests on open ones get 503, /health answers 503, idle
       WebSockets close (1001);
    2. requests in flight get server.shutdown_grace_s to finish; a second signal ends the grace now;
    3. those still running are ended: each SSE stream gets an error event (code "shutdown") and
       `data: [DONE]`, each WebSocket request `cancelled`; their sockets close;
    4. the engine stops (its child process exits, its socket file is removed); exit is clean.
"""

from __future__ import annotations

import signal
import socket

import anyio
import structlog
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.asyncio.run import worker_serve
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets

from llmserve.config import EngineConfig
from llmserve.distributed.replicas import ReplicatedEngine
from llmserve.engine import Engine, Frontend
from llmserve.engine_process import ProcessEngine
from llmserve.server.app import create_app, served_model_name

log = structlog.get_logger("llmserve.server")

FLUSH_S = 5.0
"""Seconds the streams ended at the grace's end get to send their last events before Hypercorn
closes their connections."""


async def serve(config: EngineConfig, *, stop: anyio.Event | None = None, handle_signals: bool = True,
                engine: Frontend | None = None, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
    """Run until `stop` is set or a signal arrives. Reports started, with the port it listens on
    (server.port, or the one the system chose for port 0), once it accepts connections."""
    if engine is None:
        if config.parallel.data_parallel_size > 1:
            engine = ReplicatedEngine(config)
        else:
            engine = ProcessEngine(config) if config.server.engine_process else Engine(config)
    draining = anyio.Event()
    app = create_app(engine, config, draining)
    stop = stop or anyio.Event()
    cut = anyio.Event()  # the grace period ends now
    grace = config.server.shutdown_grace_s
    hc = HypercornConfig()
    hc.graceful_timeout = grace + FLUSH_S
    hc.websocket_max_message_size = config.server.max_body_bytes
    # A burst of new connections (1,000 streams at once) overflowed Hypercorn's default listen
    # queue of 100 when the loop was slow to accept: the kernel dropped some of them.
    hc.backlog = 4096
    hc.accesslog = None
    hc.errorlog = "-"
    hc.certfile, hc.keyfile = config.server.ssl_certfile, config.server.ssl_keyfile

    async def watch_signals(scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                name = signal.Signals(signum).name
                if not started or cut.is_set():  # during start-up, or a third signal: stop waiting
                    log.info("stopping now", signal=name)
                    scope.cancel()
                elif not stop.is_set():
                    log.info("shutting down", signal=name, grace_s=grace)
                    stop.set()
                else:
                    log.info("second signal: ending the requests in flight now", signal=name)
                    cut.set()

    async def shut_down() -> None:
        await stop.wait()
        draining.set()
        with anyio.move_on_after(grace):
            await cut.wait()
        await engine.end_all("the server is shutting down")

    failure: list[Exception] = []
    started = False

    async def run_engine(*, task_status: anyio.abc.TaskStatus) -> None:
        # An engine that fails after start-up (its process died) stops the server the graceful way:
        # the requests in flight have already been answered with the error. Start-up errors propagate.
        try:
            await engine.run(task_status=task_status)
        except Exception as exc:
            if not started:
                raise
            failure.append(exc)
            log.error("engine failed; shutting down", error=str(exc))
            stop.set()

    # Bound now, so the port is claimed while the model loads; listened on once the engine runs.
    sock = bound_socket(config.server.host, config.server.port)
    port = sock.getsockname()[1]
    sockets = Sockets([sock], [], []) if hc.ssl_enabled else Sockets([], [sock], [])
    try:
        async with anyio.create_task_group() as tg:
            if handle_signals:  # from the start: a signal during start-up cancels it, cleaning up
                tg.start_soon(watch_signals, tg.cancel_scope)
            await tg.start(run_engine)
            started = True

            async def http() -> None:
                await worker_serve(ASGIWrapper(app), hc, sockets=sockets, shutdown_trigger=stop.wait)
                engine.stop()
                tg.cancel_scope.cancel()

            tg.start_soon(shut_down)
            tg.start_soon(http)
            host = config.server.host.replace("[", "").replace("]", "")
            await _until_listening(host, port)
            url = f"{'https' if hc.ssl_enabled else 'http'}://{f'[{host}]' if ':' in host else host}:{port}"
            log.info("serving", url=url, model=served_model_name(config), device=str(engine.device),
                     kv_tokens=engine.kv_tokens, max_model_len=engine.max_model_len)
            task_status.started(port)
    finally:
        sock.close()  # (Hypercorn closed it if it served; a start-up that failed leaves it here)
    if failure:
        raise failure[0]


def bound_socket(host: str, port: int) -> socket.socket:
    """The listening address, bound here rather than by Hypercorn so that port 0 takes a free port
    and the server can tell which (Hypercorn is handed the socket). Hypercorn's way: the family
    from the address, SO_REUSEADDR, and TCP_NODELAY, which the accepted connections inherit."""
    host = host.replace("[", "").replace("]", "")
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def _until_listening(host: str, port: int, timeout: float = 60.0) -> None:
    """Hypercorn binds after the app's startup hooks: readiness means the port accepts connections."""
    with anyio.fail_after(timeout):
        while True:
            try:
                stream = await anyio.connect_tcp(host, port)
            except OSError:
                await anyio.sleep(0.02)
                continue
            await stream.aclose()
            return
