"""The engine's device side in its own process.

The server's process keeps HTTP, tokenization, detokenization and the request actor; a child process
(`python -m llmserve.engine_process SOCKET`) runs the scheduler, the KV manager and the executor
(`Engine.run_core`). Streaming thousands of chunks a second then costs the step loop nothing: the
two processes share no interpreter lock, and a frontend that falls behind only sends fewer, larger
chunks (outputs are cumulative), while the device keeps stepping.

They talk over a Unix socket in length-prefixed pickles, one frame per burst:
    server -> core: the EngineConfig once, then lists of NewRequest / FinishRequests
    core -> server: ("ready", info) or ("error", is_value_error, message) once, then
                    ("outputs", [EngineOutputs...], EngineSnapshot) per step and
                    ("snapshot", EngineSnapshot) when the counters change between steps
The core exits when the socket closes; the server stops when the core dies.
"""

from __future__ import annotations

import math
import os
import pickle
import signal
import socket
import struct
import sys
import tempfile
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import structlog
from anyio.abc import ByteStream, ObjectReceiveStream

from llmserve.config import EngineConfig
from llmserve.engine import Engine, EngineSnapshot, Frontend, freeze_heap
from llmserve.messages import EngineOutputs
from llmserve.plugin_manager import Plugins

log = structlog.get_logger("llmserve.engine")

_LENGTH = struct.Struct("!Q")
SNAPSHOT_INTERVAL_S = 0.02
"""Between steps, changed counters (an abort's freed blocks, new arrivals) reach the server this fast."""
EXIT_TIMEOUT_S = 30.0


class EngineProcessError(RuntimeError):
    """The engine process failed to start or died."""


class SocketBytes(ByteStream):
    """A connected socket's bytes, waiting for it with anyio.wait_readable / wait_writable.

    (Not anyio's UNIX socket stream: on asyncio it wakes a waiting task by a callback that the
    selector may have queued in the same turn of the loop in which the task is cancelled; the
    callback then fails, and the loop logs its traceback. That is how a server stops: it cancels
    its reader as the engine's outputs arrive.) Owns the socket: aclose() closes it, once no task
    waits on it (a closed socket wakes no waiter; every user here cancels its waiters first)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock

    async def receive(self, max_bytes: int = 65536) -> bytes:
        await anyio.lowlevel.checkpoint()
        while True:
            try:
                data = self._io(self.sock.recv, max_bytes)
            except BlockingIOError:
                await anyio.wait_readable(self.sock)
                continue
            if not data:
                raise anyio.EndOfStream
            return data

    async def send(self, item: bytes) -> None:
        await anyio.lowlevel.checkpoint()
        view = memoryview(item)
        while view:
            try:
                view = view[self._io(self.sock.send, view):]
            except BlockingIOError:
                await anyio.wait_writable(self.sock)

    async def send_eof(self) -> None:
        self._io(self.sock.shutdown, socket.SHUT_WR)

    async def aclose(self) -> None:
        self.sock.close()
        await anyio.lowlevel.checkpoint()

    def _io(self, call, arg):
        """`call(arg)` on the socket, its errors as anyio's (BlockingIOError passes through)."""
        if self.sock.fileno() == -1:
            raise anyio.ClosedResourceError
        try:
            return call(arg)
        except BlockingIOError:
            raise
        except OSError as exc:
            raise anyio.BrokenResourceError from exc


def _socket_bytes(stream: anyio.abc.SocketStream) -> SocketBytes:
    """An accepted or connected anyio socket stream's socket, as SocketBytes."""
    return SocketBytes(stream.extra(anyio.abc.SocketAttribute.raw_socket))


class Wire:
    """Length-prefixed pickles over a byte stream. One task sends and one receives per side.

    A receiver that falls behind takes every frame that has arrived in one go (`receive_all`):
    the server's loop then absorbs all the steps made meanwhile per turn, instead of one step per
    turn of a loop busy with hundreds of HTTP streams, which would pace the engine to the loop."""

    def __init__(self, stream: ByteStream) -> None:
        self.stream = stream
        self._buf = bytearray()
        self._ready: deque = deque()

    async def send(self, obj: Any) -> None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        await self.stream.send(_LENGTH.pack(len(data)) + data)

    async def receive(self) -> Any:
        """The next object; EOFError once the other side has closed or gone."""
        while not self._ready:
            await self._fill()
        return self._ready.popleft()

    async def receive_all(self) -> list[Any]:
        """Every object that has arrived, at least one (waiting for it); EOFError as receive."""
        while not self._ready:
            await self._fill()
        objs = list(self._ready)
        self._ready.clear()
        return objs

    async def _fill(self) -> None:
        try:
            self._buf += await self.stream.receive(1 << 20)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
            raise EOFError from None
        pos, end = 0, len(self._buf)
        while end - pos >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._buf, pos)
            if end - pos - _LENGTH.size < size:
                break
            start = pos + _LENGTH.size
            self._ready.append(pickle.loads(self._buf[start:start + size]))
            pos = start + size
        del self._buf[:pos]


@dataclass(slots=True, frozen=True)
class CoreInfo:
    """What the core reports once its engine is built."""
    device: str
    kv_tokens: int


# ---- the server's side ---------------------------------------------------------------------------

class ProcessEngine(Frontend):
    """A Frontend whose device side runs in a child process, started by `run` and stopped with it."""

    def __init__(self, config: EngineConfig, tokenizer: Future | None = None) -> None:
        super().__init__(config, tokenizer=tokenizer)
        self.device = "starting"
        self.kv_tokens = 0
        self.pid: int | None = None
        self._snapshot = EngineSnapshot(0, 0, 0.0, 0, 0, 0, 0, 0)

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        with tempfile.TemporaryDirectory(prefix="llmserve-") as tmp:
            path = os.path.join(tmp, "core.sock")
            async with await anyio.create_unix_listener(path) as listener:
                process = await anyio.open_process([sys.executable, "-m", "llmserve.engine_process", path],
                                                   stdin=None, stdout=None, stderr=None, env=_child_env())
                self.pid = process.pid
                built = False
                try:
                    # the request actor prepares requests for the decoding strategies (compiles
                    # grammars) here, while the child builds its engine
                    self.strategies = await anyio.to_thread.run_sync(
                        lambda: Plugins.from_config(self.config.plugins).decoding_strategies())
                    wire = await self._start(listener, process)
                    built = True
                    async with wire.stream:
                        # the tokenizer loaded meanwhile (or raises its error now); the engine
                        # process, which has none, stops requests at its end-of-sequence id too
                        tokenizer = await anyio.to_thread.run_sync(lambda: self.tokenizer)
                        await wire.send(("eos", None if tokenizer is None else tokenizer.eos_token_id))
                        freeze_heap()
                        await self._run(wire, process, task_status)
                except anyio.get_cancelled_exc_class():
                    if not built:  # importing, or building its engine: it reads its socket only after
                        _end(process)
                    raise
                finally:
                    with anyio.CancelScope(shield=True):
                        await _reap(process)

    async def _start(self, listener: anyio.abc.SocketListener, process: anyio.abc.Process) -> Wire:
        """Accept the child's connection, send the config, wait until its engine is built."""
        stream = None
        async with anyio.create_task_group() as tg:
            async def accept() -> None:
                nonlocal stream
                stream = await listener.accept()
                tg.cancel_scope.cancel()
            tg.start_soon(accept)
            await process.wait()  # returns only if the child dies before connecting
            tg.cancel_scope.cancel()
        if stream is None:
            raise EngineProcessError(f"the engine process exited during start-up (exit code {process.returncode})")
        wire = Wire(_socket_bytes(stream))
        try:
            await wire.send(self.config)
            reply = await wire.receive()
        except (EOFError, anyio.BrokenResourceError):  # (a send to a child gone: the socket broke)
            await wire.stream.aclose()
            raise EngineProcessError(f"the engine process exited during start-up "
                                     f"(exit code {await process.wait()})") from None
        if reply[0] == "error":
            await wire.stream.aclose()
            _, is_value_error, message = reply
            raise (ValueError if is_value_error else EngineProcessError)(message)
        info: CoreInfo = reply[1]
        self.device, self.kv_tokens = info.device, info.kv_tokens
        return wire

    async def _run(self, wire: Wire, process: anyio.abc.Process, task_status: anyio.abc.TaskStatus) -> None:
        req_send, req_recv = anyio.create_memory_object_stream(64)
        to_core, from_requests = anyio.create_memory_object_stream(math.inf)
        requests = self._request_actor(req_recv, to_core)
        async with anyio.create_task_group() as tg:
            async def receive() -> None:
                async with req_send:
                    while True:
                        try:
                            frames = await wire.receive_all()
                        except EOFError:
                            error = EngineProcessError(f"the engine process died (exit code {await process.wait()})")
                            requests.fail_all(error)
                            raise error from None
                        # All the steps that arrived, as one batch for the request actor, in order.
                        updates = [u for f in frames if f[0] == "outputs" for outputs in f[1] for u in outputs.updates]
                        if updates:
                            await req_send.send(EngineOutputs(updates))
                        self._snapshot = frames[-1][-1]

            tg.start_soon(receive)
            tg.start_soon(_forward, from_requests, wire)
            await tg.start(requests.run)
            await self._accept_until_stopped(req_send.clone(), task_status)
            tg.cancel_scope.cancel()


def _queued(stream: ObjectReceiveStream, batch: list) -> list:
    """`batch` with everything already queued on `stream` appended, without waiting."""
    while True:
        try:
            batch.append(stream.receive_nowait())
        except anyio.WouldBlock:
            return batch


async def _forward(inbox: ObjectReceiveStream, wire: Wire) -> None:
    """Everything queued goes in one frame."""
    async with inbox:
        async for msg in inbox:
            await wire.send(_queued(inbox, [msg]))


def _end(process: anyio.abc.Process) -> None:
    """Stop a child that has no engine yet: nothing of its work is worth waiting for."""
    try:
        process.terminate()
    except ProcessLookupError:  # it exited already
        pass


async def _reap(process: anyio.abc.Process) -> None:
    """The child exits once its socket closes; kill it if it does not within EXIT_TIMEOUT_S."""
    with anyio.move_on_after(EXIT_TIMEOUT_S):
        await process.wait()
        return
    log.warning("engine process did not exit; killing it", pid=process.pid)
    process.kill()
    await process.wait()


def _child_env() -> dict[str, str]:
    """The child imports what this process can: same sys.path (plugins installed in odd places)."""
    paths = [p or os.getcwd() for p in sys.path]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


# ---- the core's side -----------------------------------------------------------------------------

async def serve_core(path: str) -> None:
    """Connect to the server at `path`, build the engine from the config it sends, run its device side
    until the server closes the socket."""
    wire = Wire(_socket_bytes(await anyio.connect_unix(path)))
    async with wire.stream:
        try:
            config = await wire.receive()
        except EOFError:
            return
        try:
            # no tokenizer here: the server's process loads it meanwhile (transformers' import
            # alone takes seconds) and sends its end-of-sequence id once this engine is ready
            engine = Engine(config, with_tokenizer=False)
        except Exception as exc:  # reported to the server, which raises it
            log.error("engine start-up failed", error=str(exc))
            await wire.send(("error", isinstance(exc, ValueError), str(exc)))
            return
        await wire.send(("ready", CoreInfo(str(engine.device), engine.kv_tokens)))
        try:
            _, eos = await wire.receive()
        except EOFError:
            return
        engine.add_eos_token_id(eos)
        out_send, out_recv = anyio.create_memory_object_stream(64)
        async with anyio.create_task_group() as tg:
            to_scheduler = await tg.start(engine.run_core, out_send)
            tg.start_soon(_send_outputs, engine, out_recv, wire, tg.cancel_scope)
            async with to_scheduler:
                while True:
                    try:
                        batches = await wire.receive_all()
                    except EOFError:
                        break
                    for msg in (m for batch in batches for m in batch):
                        await to_scheduler.send(msg)
            tg.cancel_scope.cancel()


async def _send_outputs(engine: Engine, outputs: ObjectReceiveStream, wire: Wire, core: anyio.CancelScope) -> None:
    """Each step's outputs with the counters after it; between steps, the counters when they change.
    A server gone meanwhile (the socket closed under a send) ends the core: nobody reads on."""
    sent = None
    async with outputs:
        while True:
            batch: list[EngineOutputs] = []
            with anyio.move_on_after(SNAPSHOT_INTERVAL_S):
                batch.append(await outputs.receive())
            _queued(outputs, batch)
            snap = engine.snapshot()
            try:
                if batch:
                    await wire.send(("outputs", batch, snap))
                elif snap != sent:
                    await wire.send(("snapshot", snap))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                core.cancel()
                return
            sent = snap


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Ctrl-C reaches the whole process group: the server handles it and closes the socket.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from llmserve.logging import configure_logging
    configure_logging()
    anyio.run(serve_core, argv[0], backend="asyncio")


if __name__ == "__main__":
    # Run the module's own copy, not __main__'s: frames must pickle as llmserve.engine_process.*.
    from llmserve.engine_process import main as _main
    _main()

