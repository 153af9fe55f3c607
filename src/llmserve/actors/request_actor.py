"""Request actor: the engine's front door.

Tokenizes and validates prompts, fans a request with n samples out into n sequences, turns the
scheduler's per-step token updates into text (incremental detokenization, stop strings) and
publishes each request's latest cumulative RequestOutput in its OutputSlot.
"""

from __future__ import annotations

import copy
import math
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import numpy as np
import structlog
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llmserve.decoding import NoTokenAllowed
from llmserve.detokenizer import Detokenizer
from llmserve.messages import EngineOutputs, FinishRequests, NewRequest, NewRequests, SequenceUpdate, TokenLogprobs
from llmserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from llmserve.sampling_params import SamplingParams

log = structlog.get_logger("llmserve.request")

# The event loop's idle moment between admitted slices of a large batch. A thread waiting for the
# GIL while the loop keeps running callbacks may wait until the loop is idle: each of the loop's
# polls releases and retakes the GIL before the waiter's 5 ms switch interval runs out.
_LAUNCH_WINDOW_S = 0.0005
LONG_PROMPT_CHARS = 1 << 14
"""Longer prompt texts are tokenized off the event loop (1 MB takes ~0.4 s)."""


class OutputSlot:
    """Holds a request's newest RequestOutput (or error). Outputs are cumulative, so a slow reader
    skips intermediate ones instead of making the engine buffer them: memory stays bounded.
    `notify`, if given, is called when a put fills the slot after a take (on the engine's loop):
    one reader can then serve many slots (an offline batch, a request's prompts) instead of a task
    per slot, woken once however many outputs came since it last took one."""

    def __init__(self, notify: Callable[[], None] | None = None) -> None:
        self._value: RequestOutput | BaseException | None = None
        self._ready: anyio.Event | None = None  # made by a waiting get() only (offline batches never wait)
        self._notify = notify

    def put(self, value: RequestOutput | BaseException) -> None:
        if isinstance(self._value, BaseException):
            return  # an error is the request's last word: no later output may hide it
        was_empty, self._value = self._value is None, value
        if self._ready is not None:
            self._ready.set()
        if self._notify is not None and was_empty:
            self._notify()

    async def get(self) -> RequestOutput:
        if self._value is None:
            self._ready = anyio.Event()
            await self._ready.wait()
        return self.take()

    def take(self) -> RequestOutput:
        """The output put since the last take (raising the error put instead); call once notified."""
        value, self._value, self._ready = self._value, None, None
        if isinstance(value, BaseException):
            raise value
        return value


class RequestFailed(RuntimeError):
    """The engine could not finish this request (its step failed); the request alone is ended."""


class ShuttingDown(RuntimeError):
    """The server ended the requests still in flight as it stops."""


@dataclass(slots=True)
class Submit:
    req_id: str
    prompt: str | list[int]
    params: SamplingParams
    slot: OutputSlot
    priority: int = 0
    add_special_tokens: bool = True
    strict_length: bool = False
    """Reject (rather than cut at max_model_len) a max_tokens the context cannot hold."""
    final_only: bool = False
    """Publish only the finished output (offline batches): no per-step snapshots or wake-ups."""


@dataclass(slots=True)
class Abort:
    req_id: str


@dataclass(slots=True)
class EndAll:
    """End every request in flight, and every later one, with ShuttingDown(reason)."""
    reason: str


@dataclass(slots=True, eq=False)
class _Request:
    req_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    slot: OutputSlot
    completions: list[CompletionOutput]
    detoks: list[Detokenizer]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    queue_time_s: float | None = None
    final_only: bool = False
    children: list[str] = field(default_factory=list)
    prepared: dict[str, Any] = field(default_factory=dict)
    """What the decoding strategies prepared for it, kept while it runs (a grammar's file for
    another process lives as long as this)."""

    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)


class RequestActor:
    def __init__(self, tokenizer: Any, *, vocab_size: int, max_model_len: int,
                 inbox: ObjectReceiveStream, to_scheduler: ObjectSendStream, step_tokens: int,
                 strategies: dict[str, Any] | None = None, eos_token_ids: tuple[int, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.strategies = strategies or {}
        """Decoding strategies by name (llmserve/decoding.py): those a request wants prepare it."""
        self.eos_token_ids = eos_token_ids
        """The ids that end a request (the model's and the tokenizer's): a grammar's end allows them alone."""
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.step_tokens = step_tokens  # the scheduler's token budget: a full step's prompt tokens
        self.inbox = inbox
        self.to_scheduler = to_scheduler
        self.requests: dict[str, _Request] = {}
        self.child_of: dict[str, tuple[_Request, int]] = {}
        self.ended: ShuttingDown | None = None
        self._preparing: dict[str, Submit] = {}  # on a worker thread (long prompt, a grammar), not admitted yet

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with self.inbox, anyio.create_task_group() as self._tasks:
            async for msg in self.inbox:
                # Each handler fails the one request whose input or output broke it; this catch is
                # the last line: whatever escapes is logged, and the engine keeps serving.
                try:
                    if isinstance(msg, EngineOutputs):
                        await self._on_outputs(msg)
                    elif isinstance(msg, list):  # Submits, handed in together
                        await self._on_submit(msg)
                    elif isinstance(msg, Abort):
                        await self._abort(msg.req_id)
                    elif isinstance(msg, EndAll):
                        await self._end_all(ShuttingDown(msg.reason))
                except Exception:
                    log.exception("request actor: message failed", message=type(msg).__name__)

    # ---- arrivals ------------------------------------------------------------------------------

    def _tokenize(self, sub: Submit, encoded: list[int] | None = None) -> tuple[str | None, list[int], array]:
        """(prompt text, the token ids outputs show, the engine's copy: int64 in one buffer, which
        the garbage collector does not scan as it scans a list's items). `encoded`: the text's ids,
        tokenized already. A prompt cut to its last truncate_prompt_tokens has no text: outputs
        decode what was kept."""
        keep = self._kept(sub.params)
        if isinstance(sub.prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids instead")
            ids = encoded if encoded is not None else self._encode(sub)
            if len(ids) <= keep:
                return sub.prompt, ids, array("q", ids)
            ids = ids[-keep:]
            return None, ids, array("q", ids)
        ids = sub.prompt if type(sub.prompt) is list else list(sub.prompt)
        if len(ids) > keep:
            ids = ids[-keep:]
        # C-level passes (a Python check per token, times a batch's prompts, delays its first
        # step); bools are ints to array() but not token ids.
        error = ValueError(f"prompt_token_ids must be integers in [0, {self.vocab_size})")
        if not set(map(type, ids)) <= {int}:
            raise error
        try:
            tokens = array("q", ids)
        except OverflowError:
            raise error from None
        values = np.frombuffer(tokens, dtype=np.int64)
        if values.size and (values.min() < 0 or values.max() >= self.vocab_size):
            raise error
        return None, ids, tokens

    def _kept(self, params: SamplingParams) -> float:
        """How many of a prompt's last tokens it keeps: truncate_prompt_tokens (-1: the most a
        prompt may have), else all."""
        keep, longest = params.truncate_prompt_tokens, self.max_model_len - 1
        if keep is None:
            return math.inf
        if keep > longest:
            raise ValueError(f"truncate_prompt_tokens is {keep}; max_model_len is {self.max_model_len}, so a "
                             f"prompt may keep at most {longest} tokens (-1 keeps that many)")
        return longest if keep == -1 else keep

    def _validate(self, ids: list[int], params: SamplingParams, strict_length: bool) -> None:
        if not ids:
            raise ValueError("prompt must not be empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens long; max_model_len is {self.max_model_len}, so a prompt "
                             f"may have at most {self.max_model_len - 1} tokens (truncate_prompt_tokens keeps its end)")
        if strict_length and params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens is {params.max_tokens} but the prompt has {len(ids)} tokens and "
                             f"max_model_len is {self.max_model_len}: at most {self.max_model_len - len(ids)} remain")
        if len(ids) + params.min_tokens > self.max_model_len:  # (it could never be met)
            raise ValueError(f"min_tokens is {params.min_tokens} but the prompt has {len(ids)} tokens and "
                             f"max_model_len is {self.max_model_len}: at most {self.max_model_len - len(ids)} remain")
        for name, token_ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            if bad := [t for t in token_ids if t >= self.vocab_size]:
                raise ValueError(f"{name} token ids must be < vocab size {self.vocab_size}, got {bad}")

    async def _on_submit(self, subs: list[Submit]) -> None:
        """Admit each valid submission (an invalid one gets its error in its slot). The scheduler
        hears of them two full steps' prompt tokens at a time (two: the step after the first one is
        planned at once, and must not find only the first one's leftovers), and of the rest at the
        end, so a large batch's first steps are planned and launched while the rest is admitted
        (a batch of a thousand prompts takes a while to admit: its first step need not wait).
        After each message the loop sleeps for a moment: a worker thread waiting for the GIL (the
        executor's, to launch the step) gets it only when the loop blocks, not while it spins."""
        arrivals: list[NewRequest] = []
        tokens = 0
        for sub in subs:
            wanted = [name for name, strategy in self.strategies.items() if strategy.wants(sub.params)]
            long = isinstance(sub.prompt, str) and len(sub.prompt) > LONG_PROMPT_CHARS and self.tokenizer is not None
            if (wanted or long) and sub.req_id not in self.requests and sub.req_id not in self._preparing:
                self._preparing[sub.req_id] = sub
                self._tasks.start_soon(self._submit_prepared, sub, wanted, long)
                continue
            tokens += self._accept(sub, arrivals)
            if tokens >= 2 * self.step_tokens:
                await self.to_scheduler.send(NewRequests(arrivals))
                await anyio.sleep(_LAUNCH_WINDOW_S)
                arrivals, tokens = [], 0
        if arrivals:
            await self.to_scheduler.send(NewRequests(arrivals))

    async def _submit_prepared(self, sub: Submit, wanted: list[str], long: bool) -> None:
        """A long text is tokenized, and the decoding strategies the request wants prepare it
        (compile its grammar), on a worker thread (both let go of the interpreter lock), so that
        the event loop and the other requests' outputs go on meanwhile."""
        def prepare() -> tuple[list[int] | None, dict[str, Any]]:
            return (self._encode(sub) if long else None,
                    {name: self.strategies[name].prepare(sub.params, self.tokenizer, self.vocab_size, self.eos_token_ids)
                     for name in wanted})
        try:
            encoded, prepared = await anyio.to_thread.run_sync(prepare)
        except Exception as exc:
            encoded, prepared, error = None, None, exc
        if self._preparing.pop(sub.req_id, None) is None:
            return  # aborted meanwhile (its slot says so)
        if prepared is None:
            if not isinstance(error, ValueError):
                log.exception("request failed while prepared", request_id=sub.req_id, exc_info=error)
            sub.slot.put(error)
            return
        arrivals: list[NewRequest] = []
        if self._accept(sub, arrivals, encoded, prepared):
            await self.to_scheduler.send(NewRequests(arrivals))

    def _encode(self, sub: Submit) -> list[int]:
        return self.tokenizer.encode(sub.prompt, add_special_tokens=sub.add_special_tokens)

    def _accept(self, sub: Submit, arrivals: list[NewRequest], encoded: list[int] | None = None,
                prepared: dict[str, Any] | None = None) -> int:
        """Admit one submission into `arrivals`; its prompt's length in tokens, or 0 when it is refused
        (its error then in its slot)."""
        if self.ended is not None:
            sub.slot.put(self.ended)
            return 0
        if sub.req_id in self.requests or sub.req_id in self._preparing:
            sub.slot.put(ValueError(f"request_id {sub.req_id!r} is already in use"))
            return 0
        try:
            prompt, ids, engine_ids = self._tokenize(sub, encoded)
            self._validate(ids, sub.params, sub.strict_length)
            if sub.params.structured_outputs is not None and not prepared:
                raise ValueError("structured_outputs: no decoding strategy of this engine serves it "
                                 "(is the structured_outputs plugin blocked?)")
            self._admit(sub, prompt, ids, engine_ids, arrivals, prepared or {})
        except Exception as exc:  # this request's input broke something: it alone fails
            if not isinstance(exc, ValueError):
                log.exception("request failed at admission", request_id=sub.req_id)
            self._forget_id(sub.req_id, arrivals)
            sub.slot.put(exc)
            return 0
        return len(ids)

    def _admit(self, sub: Submit, prompt: str | None, ids: list[int], engine_ids: array,
               arrivals: list[NewRequest], prepared: dict[str, Any]) -> None:
        p = sub.params
        req = _Request(sub.req_id, prompt, ids, p, sub.slot,
                       [CompletionOutput(i, logprobs=[] if p.logprobs is not None else None) for i in range(p.n)],
                       [Detokenizer(self.tokenizer, ids, p.skip_special_tokens, p.stop, p.include_stop_str_in_output,
                                    final_only=sub.final_only) for _ in range(p.n)],
                       prompt_logprobs=[None] if p.prompt_logprobs is not None else None, final_only=sub.final_only,
                       prepared=prepared)
        self.requests[sub.req_id] = req
        if not sub.final_only:
            self._publish(req)  # taken in: a reader learns it before the first token (no 4xx will follow)
        now = time.monotonic()
        for i in range(p.n):
            child_id = sub.req_id if p.n == 1 else f"{sub.req_id}#{i}"
            req.children.append(child_id)
            self.child_of[child_id] = (req, i)
            child_params = p if p.n == 1 else _child(p, i)
            arrivals.append(NewRequest(child_id, engine_ids, child_params, sub.priority, now,
                                       sub.req_id if p.n > 1 else None, prepared))

    async def _abort(self, req_id: str) -> None:
        if (sub := self._preparing.pop(req_id, None)) is not None:  # never admitted: nothing runs yet
            sub.slot.put(RequestFailed("aborted while it was prepared (its prompt tokenized, its grammar compiled)"))
            return
        req = self.requests.get(req_id)
        if req is None:
            return
        live = [c for c, comp in zip(req.children, req.completions) if comp.finish_reason is None]
        for child in live:
            req.completions[self.child_of[child][1]].finish_reason = "abort"
        if live:
            await self.to_scheduler.send(FinishRequests(live, "abort"))
        self._publish(req)

    # ---- per-step outputs -----------------------------------------------------------------------

    async def _on_outputs(self, msg: EngineOutputs) -> None:
        stopped: list[str] = []
        aborted: list[str] = []
        touched: dict[str, _Request] = {}
        for up in msg.updates:
            entry = self.child_of.get(up.req_id)
            if entry is None:
                continue
            req, i = entry
            comp = req.completions[i]
            if comp.finish_reason is not None:
                continue  # already ended by a stop string or an abort
            try:
                if up.error is not None:
                    kind, _, why = up.error.partition(": ")
                    if kind == NoTokenAllowed.__name__:  # (its parameters' fault: a 400)
                        raise NoTokenAllowed(why)
                    raise RequestFailed(f"the engine failed this request: {up.error}")
                self._apply(req, i, up)
                stop = _detokenize(req.detoks[i], comp, up)
            except Exception as exc:
                if not isinstance(exc, (RequestFailed, NoTokenAllowed)):
                    log.exception("request failed on its output", request_id=req.req_id)
                aborted += self._fail(req, exc)  # (the engine already ended a child its step failed)
                touched.pop(req.req_id, None)
                continue
            if stop is not None:
                comp.finish_reason, comp.stop_reason = "stop", stop
                if up.finish_reason is None:
                    stopped.append(up.req_id)
            if not req.final_only or comp.finish_reason is not None:  # (final_only: nothing to show before)
                touched[req.req_id] = req
        if stopped:
            await self.to_scheduler.send(FinishRequests(stopped, "stop"))
        if aborted:
            await self.to_scheduler.send(FinishRequests(aborted, "abort"))
        for req in touched.values():
            try:
                self._publish(req)
            except Exception as exc:
                log.exception("request failed on its output", request_id=req.req_id)
                if live := self._fail(req, exc):
                    await self.to_scheduler.send(FinishRequests(live, "abort"))

    def _fail(self, req: _Request, error: BaseException) -> list[str]:
        """End a request with `error` (its reader raises it); returns its children still running
        in the engine, for the caller to abort."""
        live = [c for c, comp in zip(req.children, req.completions) if comp.finish_reason is None]
        for comp in req.completions:
            comp.finish_reason = comp.finish_reason or "abort"
        req.slot.put(error)
        self._forget(req)
        return live

    def _apply(self, req: _Request, i: int, up: SequenceUpdate) -> None:
        comp = req.completions[i]
        comp.token_ids.extend(up.new_token_ids)
        req.num_cached_tokens = max(req.num_cached_tokens, up.num_cached_tokens)
        if req.queue_time_s is None:
            req.queue_time_s = up.queue_time_s
        if comp.logprobs is not None:
            for lp in up.logprobs:
                comp.logprobs.append(self._position(lp))
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + lp.logprob
        if req.prompt_logprobs is not None and i == 0:
            req.prompt_logprobs.extend(self._position(lp) for lp in up.prompt_logprobs)
        if up.finish_reason is not None:
            comp.finish_reason, comp.stop_reason = up.finish_reason, up.stop_reason

    def _position(self, lp: TokenLogprobs) -> PositionLogprobs:
        entry = {tid: Logprob(v, r + 1, self._piece(tid)) for r, (tid, v) in enumerate(zip(lp.top_ids, lp.top_logprobs))}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self._piece(lp.token_id))
        return entry

    def _piece(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    def _publish(self, req: _Request) -> None:
        finished = req.finished()
        if req.final_only and not finished:
            return
        for comp, detok in zip(req.completions, req.detoks):
            comp.text = detok.visible_text(comp.finish_reason is not None)
        req.slot.put(RequestOutput(
            request_id=req.req_id, prompt=req.prompt, prompt_token_ids=req.prompt_ids,
            outputs=[_copy(c) for c in req.completions],
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            finished=finished, num_cached_tokens=req.num_cached_tokens, queue_time_s=req.queue_time_s))
        if finished:
            self._forget(req)

    def fail_all(self, error: BaseException) -> None:
        """The engine behind this actor is gone: every request still waiting for output gets `error`."""
        for req in list(self.requests.values()):
            req.slot.put(error)
            self._forget(req)
        for sub in self._preparing.values():
            sub.slot.put(error)
        self._preparing.clear()

    async def _end_all(self, error: ShuttingDown) -> None:
        self.ended = error
        live = [child for req in list(self.requests.values()) for child in self._fail(req, error)]
        if live:
            await self.to_scheduler.send(FinishRequests(live, "abort"))

    def _forget_id(self, req_id: str, arrivals: list[NewRequest]) -> None:
        """Undo a partial admission: the request and any of its children not yet sent on."""
        if (req := self.requests.get(req_id)) is not None:
            self._forget(req)
            arrivals[:] = [a for a in arrivals if a.req_id not in req.children]

    def _forget(self, req: _Request) -> None:
        self.requests.pop(req.req_id, None)
        for child in req.children:
            self.child_of.pop(child, None)


def _copy(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.cumulative_logprob,
                            list(c.logprobs) if c.logprobs is not None else None, c.finish_reason, c.stop_reason)


def _child(params: SamplingParams, i: int) -> SamplingParams:
    """The parameters of sample i of an n > 1 request: n = 1, the seed moved on by i (an unseeded
    sample stays unseeded: the executor derives its stream from its id). A copy, not replace():
    the parameters are valid, and validating them again costs the event loop ~0.8 ms for each
    sample of a request with a thousand logit_bias entries."""
    child = copy.copy(params)
    child.n = 1
    child.seed = None if params.seed is None else (params.seed + i) % 2**63
    return child


def _detokenize(detok: Detokenizer, comp: CompletionOutput, up: SequenceUpdate) -> str | None:
    """Add an update's tokens to the text; returns the stop string found, if any. Where an update
    brings several tokens (speculative decoding, jump-forward), a stop string ends the output at
    the token that completes it, as it would one token at a time: those after it are dropped from
    the completion (already extended with them), their logprobs too."""
    new, final = up.new_token_ids, up.finish_reason is not None
    if len(new) == 1 or not detok.stop:
        return detok.add(new, final=final)
    for used, token in enumerate(new, 1):
        if (stop := detok.add([token], final=final and used == len(new))) is not None:
            drop = len(new) - used
            if drop:
                del comp.token_ids[-drop:]
                if comp.logprobs is not None and len(up.logprobs) == len(new):
                    del comp.logprobs[-drop:]
                    comp.cumulative_logprob -= sum(lp.logprob for lp in up.logprobs[used:])
            return stop
    return None
