"""The grammar process: xgrammar matchers advanced, and their masks filled, beside the engine.

A constrained decode step's grammar work (each row's accept, ~1 µs, then its next mask, ~30 µs on
a 152k vocabulary) would otherwise run in the executor's process, whose interpreter lock the event
loop holds for most of a step: a mask thread waits for the lock at each call's end, and the loop's
own work stretches while the thread has it. Here the work runs on another interpreter; the
executor's process only sends each step's tokens and, before it queues the sampler, reads that
the masks are in place:

    executor's process                                   grammar process
    accept_tokens: tokens appended to each       ops ─▶  batch accept (a token refused where the
      constraint's history, then sent                    grammar has not ended breaks its matcher)
    fill_masks_async: "fill buffer b, row i       ops ─▶  batch fill into buffer b: a file in
      from matcher ids[i]" -> PendingMasks               shared memory, also mapped (and pinned for
                                                         the device copy) in the executor's process
    MaskFill.send(): PendingMasks.result()    ◀─ filled  per broken row its error
      then the buffer's copy to the device

The process starts with the first fill asked of it; a constraint is opened there (its tokens so far
sent along) with the first fill that has it, and only then are its tokens sent as they come. Ops
are queued and go in one message when a step's accepts or fill are sent. Two buffers take turns:
the device copy of one step's masks is done before the next step's tokens reach the host, so a
buffer is never written while it is read. Every constraint keeps its tokens, so a mirror in the
executor's process (a plain constraint, made and caught up only when needed) serves what the
process does not: drafts to check (speculative decoding), steps that also hold a jumping
request's or another strategy's rows, engines without async scheduling (each mask is needed as its
step is launched), the seconds before the process is ready (no request waits for it), and the
steps after it died or hung (a send or an answer that takes TIMEOUT_S): then everything runs on
the mirrors, and it is not started again.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import structlog
import torch

log = structlog.get_logger("llmserve.grammar_process")

TIMEOUT_S = 10.0
"""A send that cannot go, or a fill not answered, by then: the process is taken for hung and stopped."""
READY_TIMEOUT_S = 120.0
"""A process not ready by then (it imports xgrammar and torch): taken for hung and stopped."""


class _Buffer:
    """int32 [rows, width] in a shared-memory file both processes map; pinned here where CUDA runs."""

    def __init__(self, rows: int, width: int) -> None:
        size = rows * width * 4
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, self.path = tempfile.mkstemp(prefix="llmserve-masks-", dir=folder)
        self._unlink_at_exit = weakref.finalize(self, _unlink, self.path)
        try:
            os.posix_fallocate(fd, 0, size)  # no room: an OSError here, not a SIGBUS at the first write
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.rows, self.width = rows, width
        self.tensor = torch.frombuffer(self._map, dtype=torch.int32).view(rows, width)
        self.pinned = _pin(self.tensor)
        self.first_fill = 0  # the fill that first writes it: once answered, the process has it mapped

    def unlink(self) -> None:
        """The file's name goes (the process has mapped it, or never will)."""
        self._unlink_at_exit()

    def close(self) -> None:
        """Unlinked and unpinned; the mapping goes with the last tensor viewing it (a step's
        MaskFill may still read its rows)."""
        self.unlink()
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = self._map = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _pin(tensor: torch.Tensor) -> bool:
    """Page-lock the tensor's memory where this process drives a CUDA device, so that its copy to
    the device is queued without waiting (as from torch's pinned memory)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    err = int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0))
    if err:
        log.warning("mask buffer not pinned: its copies to the device wait for the host", cuda_error=err)
    return err == 0


class PendingMasks:
    """A fill sent to the grammar process, its rows in `host`. Waits like a CUDA event (query(),
    synchronize()) and a future (done(), result(): row -> error for rows that failed, or None
    where the process died first and nothing was filled: the caller fills `host` itself)."""

    def __init__(self, process: GrammarProcess, seq: int, host: torch.Tensor) -> None:
        self.process, self.seq, self.host = process, seq, host
        self._answered = False
        self._failed: dict[int, str] | None = None

    def query(self) -> bool:
        return self._answered or self.process.answered(self.seq, block=False)

    done = query

    def synchronize(self) -> None:
        self.result()

    def result(self) -> dict[int, str] | None:
        if not self._answered:
            self._failed, self._answered = self.process.answer(self.seq), True
        return self._failed


class GrammarProcess:
    """The executor's side: the process, the ops queued for it, the mask buffers. Constraints get
    ids from open(); their finalizers close_matcher() them, on whatever thread drops a constraint
    (inside any call here, by the garbage collector): it only appends to a deque. Every other call
    comes from the executor, one at a time: its thread, or the worker thread it waits for a fill on
    (waits.block) while its own step is paused."""

    def __init__(self) -> None:
        self._closed: deque[int] = deque()  # matcher ids to close, from finalizers
        self._ops: list[tuple] = []
        self._accepts: tuple[list[int], list[int]] = ([], [])  # consecutive accepts, merged into one op
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._started = 0.0
        self.ready = False
        self.dead = False  # died, hung, failed or closed: never started again
        self._next_id = 0
        self._seq = 0
        self._answers: dict[int, dict[int, str]] = {}
        self._buffers: list[_Buffer | None] = [None, None]
        self._turn = 0

    def start(self) -> None:
        """Start the process (it reports ready once it has imported xgrammar), unless it was."""
        if self._proc is not None or self.dead:
            return
        here, there = socket.socketpair()
        # a send that cannot go in TIMEOUT_S (the process stopped reading) raises instead of blocking
        here.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", int(TIMEOUT_S), 0))
        try:
            command = [sys.executable, "-m", "llmserve.plugins.grammar_process", str(there.fileno())]
            self._proc = subprocess.Popen(command, pass_fds=(there.fileno(),))
        except OSError:
            log.exception("the grammar process did not start; grammars run in this process")
            here.close()
            self.dead = True
            return
        finally:
            there.close()
        self._conn = Connection(here.detach())
        self._started = time.monotonic()

    def serves(self) -> bool:
        """Whether fills can go to the process now: started (if it was not), ready, alive."""
        self.start()
        if self.dead:
            return False
        if not self.ready:
            try:
                while not self.ready and self._conn.poll(0):
                    self._receive()
            except (EOFError, OSError):
                self._died("it exited while starting")
                return False
            if not self.ready and time.monotonic() - self._started > READY_TIMEOUT_S:
                self._died(f"not ready in {READY_TIMEOUT_S:g} s")
        return self.ready

    # ---- ops -------------------------------------------------------------------------------------

    def open(self, paths: tuple[str, str], tokens: list[int]) -> int:
        """A new matcher of the grammar in `paths` (tokenizer file, grammar file), advanced past
        `tokens`: its id."""
        self._next_id += 1
        self._queue(("open", self._next_id, paths))
        if tokens:
            self.accept([self._next_id] * len(tokens), tokens)
        return self._next_id

    def accept(self, ids: list[int], tokens: list[int]) -> None:
        if self.dead:
            return
        self._accepts[0].extend(ids)
        self._accepts[1].extend(tokens)
        if len(self._accepts[0]) > 4096:  # steps with drafts send no fills: their accepts go on their own
            self.flush()

    def close_matcher(self, id_: int) -> None:
        if not self.dead:
            self._closed.append(id_)

    def _queue(self, op: tuple) -> None:
        """Queue op after the accepts queued before it; nothing once the process died."""
        if self.dead:
            return
        if self._accepts[0]:
            self._ops.append(("accept", *self._accepts))
            self._accepts = ([], [])
        self._ops.append(op)

    def flush(self) -> None:
        """Send the queued ops (only once the process is ready: opens come with the first fill)."""
        if not self.ready:
            return
        if self._accepts[0]:
            self._ops.append(("accept", *self._accepts))
            self._accepts = ([], [])
        while self._closed:  # (after the accepts: a matcher closed now had all its tokens before)
            self._ops.append(("close", self._closed.popleft()))
        ops, self._ops = self._ops, []
        if ops:
            self._send(ops)

    def _send(self, ops: list[tuple]) -> None:
        try:
            self._conn.send_bytes(pickle.dumps(ops, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as exc:  # (BlockingIOError: TIMEOUT_S passed)
            self._died(f"a send failed: {exc!r}")

    # ---- fills -----------------------------------------------------------------------------------

    def fill_async(self, ids: list[int], width: int) -> PendingMasks | None:
        """Masks of matchers `ids` into rows 0.. of the next buffer, filled in the process (ready:
        serves()); None if it died meanwhile (the caller fills them)."""
        buffer = self._buffers[self._turn]
        if buffer is None or buffer.rows < len(ids) or buffer.width != width:
            try:  # (rows doubled: a batch that grows row by row makes a few buffers, not one a row)
                new = _Buffer(max(64, 1 << (len(ids) - 1).bit_length()), width)
            except Exception as exc:
                self._died(f"no mask buffer: {exc!r}")
                return None
            if buffer is not None:
                buffer.close()  # (its last copy to the device was two steps ago: done)
            buffer = self._buffers[self._turn] = new
            buffer.first_fill = self._seq + 1
            self._queue(("buffer", self._turn, buffer.path, buffer.rows, width))
        self._seq += 1
        self._queue(("fill", self._seq, self._turn, ids))
        self._turn ^= 1
        self.flush()
        return PendingMasks(self, self._seq, buffer.tensor[:len(ids)])

    def answered(self, seq: int, block: bool) -> bool:
        """Whether fill `seq` is answered (or will never be: the process died)."""
        if seq in self._answers or self.dead:
            return True
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while self._conn.poll(max(0.0, deadline - time.monotonic()) if block else 0):
                self._receive()
                if seq in self._answers:
                    return True
        except (EOFError, OSError):
            self._died("its pipe closed")
            return True
        if block:
            self._died(f"no answer in {TIMEOUT_S:g} s")
            return True
        return False

    def answer(self, seq: int) -> dict[int, str] | None:
        """Fill `seq`'s failed rows once filled; None if the process died first."""
        self.answered(seq, block=True)
        return self._answers.pop(seq, None)

    def _receive(self) -> None:
        message = pickle.loads(self._conn.recv_bytes())
        if message[0] == "ready":
            self.ready = True
        elif message[0] == "filled":
            _, seq, failed = message
            self._answers[seq] = failed
            for old in [s for s in self._answers if s < seq - 8]:  # fills nobody waited for (a step that failed)
                del self._answers[old]
            for buffer in self._buffers:
                if buffer is not None and buffer.first_fill <= seq:  # mapped there by now
                    buffer.unlink()

    def _died(self, why: str) -> None:
        if not self.dead:
            log.error("the grammar process stopped; grammars run in this process from now on", reason=why)
        self.dead, self.ready = True, False
        self._ops, self._accepts = [], ([], [])
        self._closed.clear()
        self._stop()

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def close(self) -> None:
        """Stop the process and free the buffers (after the last step); it is not started again."""
        if self._conn is not None and self.ready:
            try:
                self._conn.send_bytes(pickle.dumps([("exit",)]))
                self._proc.wait(timeout=TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass  # killed below
        self._stop()
        self.dead, self.ready = True, False
        for i, buffer in enumerate(self._buffers):
            if buffer is not None:
                buffer.close()
                self._buffers[i] = None
        self._ops, self._accepts, self._answers = [], ([], []), {}
        self._closed.clear()


class SharedGrammarConstraint:
    """A grammar constraint whose matcher lives in the grammar process once a fill there has had
    it (open()), with a mirror here (a GrammarConstraint made by `make_mirror()`), caught up from
    `tokens` only when a step needs it here."""

    def __init__(self, process: GrammarProcess, paths: tuple[str, str], make_mirror: Callable[[], Any]) -> None:
        self.process = process
        self.paths = paths
        self.id: int | None = None  # in the process: from open()
        self.tokens: list[int] = []
        self._make_mirror = make_mirror
        self._mirror: Any = None
        self.mirrored = 0  # tokens the mirror has accepted

    def open(self) -> None:
        """Its matcher in the process, past its tokens so far (the process serves())."""
        self.id = self.process.open(self.paths, self.tokens)
        weakref.finalize(self, self.process.close_matcher, self.id)

    def one_behind(self) -> Any:
        """Its mirror if that lacks only the last token (to advance with others' in one call: then
        caught_up()), else None."""
        return self._mirror if self._mirror is not None and self.mirrored == len(self.tokens) - 1 else None

    def caught_up(self) -> None:
        self.mirrored = len(self.tokens)

    def mirror(self) -> Any:
        if self._mirror is None:
            self._mirror = self._make_mirror()
        while self.mirrored < len(self.tokens):
            self._mirror.accept(self.tokens[self.mirrored])
            self.mirrored += 1
        return self._mirror

    @property
    def matcher(self) -> Any:
        return self.mirror().matcher

    def terminated(self) -> bool:
        return self.mirror().terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.mirror().fill_mask(bitmask, row)

    def accept(self, token: int) -> None:
        self.tokens.append(token)
        if self.id is not None:
            self.process.accept([self.id], [token])

    def advance(self, token: int) -> bool:
        return self.mirror().advance(token)

    def rollback(self, num_tokens: int) -> None:  # (after advance(): the mirror's tentative tokens)
        self.mirror().rollback(num_tokens)


# ---- the process ---------------------------------------------------------------------------------

def serve(conn: Connection) -> None:
    """The grammar process's loop: ops in order, a fill answered as soon as it is done."""
    import xgrammar

    from llmserve.plugins.structured_outputs import _Loaded

    loaded = _Loaded()
    matchers: dict[int, Any] = {}
    broken: dict[int, str] = {}  # id -> why: its rows fail
    buffers: dict[int, tuple[mmap.mmap, torch.Tensor]] = {}
    batch = xgrammar.BatchGrammarMatcher()
    conn.send_bytes(pickle.dumps(("ready",)))
    while True:
        try:
            ops = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        for op in ops:
            kind = op[0]
            if kind == "open":
                _, id_, paths = op
                try:
                    matchers[id_] = xgrammar.GrammarMatcher(loaded.get(paths))
                except Exception as exc:
                    broken[id_] = f"structured_outputs: the grammar did not load in the grammar process: {exc}"
            elif kind == "accept":
                _accept(op[1], op[2], matchers, broken)
            elif kind == "close":
                matchers.pop(op[1], None)
                broken.pop(op[1], None)
            elif kind == "buffer":
                _, index, path, rows, width = op
                with open(path, "r+b") as f:
                    mapped = mmap.mmap(f.fileno(), rows * width * 4)
                buffers[index] = (mapped, torch.frombuffer(mapped, dtype=torch.int32).view(rows, width))
            elif kind == "fill":
                _, seq, index, ids = op
                failed = _fill(ids, buffers[index][1], matchers, broken, batch)
                conn.send_bytes(pickle.dumps(("filled", seq, failed)))
            elif kind == "exit":
                return


def _accept(ids: list[int], tokens: list[int], matchers: dict[int, Any], broken: dict[int, str]) -> None:
    import xgrammar

    live = [(i, t) for i, t in zip(ids, tokens) if i in matchers and i not in broken]
    if len({i for i, _ in live}) == len(live):  # one token a matcher: one call
        accepted = xgrammar.BatchGrammarMatcher.batch_accept_token([matchers[i] for i, _ in live], [t for _, t in live])
    else:  # a matcher catching up (a resumed request): in order
        accepted = [matchers[i].accept_token(t) for i, t in live]
    for (i, t), ok in zip(live, accepted):
        if not ok and not matchers[i].is_terminated():
            broken[i] = f"RuntimeError: structured_outputs: token {t} is not allowed by the grammar here"


def _fill(ids: list[int], bitmask: torch.Tensor, matchers: dict[int, Any], broken: dict[int, str],
          batch: Any) -> dict[int, str]:
    """Rows 0.. of `bitmask` from matchers `ids`; returns row -> error for broken ones (filled
    with every token allowed, as a row past its grammar's end)."""
    failed, live, rows = {}, [], []
    for row, id_ in enumerate(ids):
        matcher = matchers.get(id_)
        if id_ in broken or matcher is None:
            failed[row] = broken.get(id_, f"structured_outputs: matcher {id_} is unknown to the grammar process")
            bitmask[row] = -1
        elif matcher.is_terminated():
            bitmask[row] = -1
        else:
            live.append(matcher)
            rows.append(row)
    if len(live) == 1:
        live[0].fill_next_token_bitmask(bitmask, rows[0])
    elif live:
        batch.batch_fill_next_token_bitmask(live, bitmask, rows)
    return failed


if __name__ == "__main__":
    # Ctrl-C reaches the whole process group: the engine stops, and this process with its pipe
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve(Connection(int(sys.argv[1])))
    except OSError:  # the engine went first (a send into a closed pipe): nobody to answer
        pass
