"""OpenAI completions and chat completions over Engine.generate: whole responses and stream chunks.

Outputs from the engine are cumulative; a stream sends each choice's new text (and logprobs) since
the last chunk. A request with several prompts runs them concurrently; choice index is
prompt_index * n + sample_index, as OpenAI numbers them.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
import structlog

from llmserve.actors.request_actor import OutputSlot, ShuttingDown, Submit
from llmserve.beam_search import BeamSearchParams, beam_steps, step_params
from llmserve.config import ServerConfig
from llmserve.engine import Frontend
from llmserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from llmserve.sampling_params import REQUEST_FIELDS, SamplingParams
from llmserve.server.chat_template import ChatTemplate
from llmserve.server.logprobs import LogprobsFormat
from llmserve.server.metrics import Metrics
from llmserve.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                                      _SamplingFields)
from llmserve.server.reasoning import ReasoningFormat, ReasoningSplit, split_reasoning
from llmserve.server.tool_calls import ChoiceCalls, ToolPlan, plan, template_tools
from llmserve.tool_parsers import ToolParserFactory

log = structlog.get_logger("llmserve.server")



@dataclass(slots=True)
class _Sent:
    """How much of one choice a stream has sent."""
    started: bool = False
    text: int = 0
    tokens: int = 0
    logprobs: int = 0
    done: bool = False


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """A scored prompt's output: each choice without the token sampled after the prompt, ended by
    its length (max_tokens 0) unless aborted."""
    return dataclasses.replace(out, outputs=[
        CompletionOutput(c.index, logprobs=None if c.logprobs is None else [],
                         finish_reason=c.finish_reason if c.finish_reason in (None, "abort") else "length")
        for c in out.outputs])


@dataclass(slots=True)
class _Job:
    """One HTTP request in flight: its prompts, parameters and how it reports."""
    kind: str  # "completion" | "chat"
    id: str
    created: int
    prompts: list[str | list[int]]
    params: SamplingParams
    body: _SamplingFields
    model: str = ""
    """The served name the response reports: the request's, else the first."""
    key: str = ""
    """What its prompts' engine ids begin with: its id, unique unless the client named it
    (request_id), then with a suffix of its own: two requests under one name stay apart."""
    echo: bool = False
    echo_content: str = ""
    """chat's echo: the last message's content, which each choice's content begins with."""
    reasoning: ReasoningFormat | None = None
    """chat under server.reasoning_parser: how its choices' thinking is told from their answer."""
    include_reasoning: bool = True
    splits: dict[int, ReasoningSplit] = field(default_factory=dict)
    """Per streamed choice (by index), its reasoning split's state."""
    score_prompt: bool = False
    """echo with max_tokens 0: the response is the prompt (and its logprobs) alone."""
    add_special_tokens: bool = True
    tools: ToolPlan | None = None
    """How its choices are read for tool calls (chat with tools, tool_choice not none)."""
    calls: dict[int, ChoiceCalls] = field(default_factory=dict)
    """Per streamed choice (by index), its tool-call parser's state."""
    sent: dict[int, _Sent] = field(default_factory=dict)
    queued: list[int] = field(default_factory=list)
    """Per prompt, its sequences still counted in OpenAIServing.queued (n until its first output)."""
    beam: BeamSearchParams | None = None
    """use_beam_search: its parameters (max_tokens None: to the context's end, set per job)."""
    cached_in_usage: bool = False
    """usage also states prompt_tokens_details.cached_tokens, the prompt tokens the prefix cache
    held: the Responses API reports them; chat and completions leave them out (unless
    server.enable_prompt_tokens_details), so that their usage does not depend on which requests
    ran before."""


class _Filled:
    """The prompts whose output slots were filled since the reader last looked (a slot reports
    when a put fills it), and an event to wait for the next: one wake per turn of the reader,
    as cheap as a slot's own wait (a memory stream's cost five times as much a wake)."""

    def __init__(self) -> None:
        self._ready: list[int] = []
        self._event: anyio.Event | None = None

    def put(self, i: int) -> None:
        self._ready.append(i)
        if self._event is not None:
            self._event.set()

    async def take(self) -> list[int]:
        while not self._ready:
            self._event = anyio.Event()
            await self._event.wait()
            self._event = None
        ready, self._ready = self._ready, []
        return ready


_BEAM_TAKES = frozenset({"n", "ignore_eos", "temperature", "skip_special_tokens"})
"""Of SamplingParams' request fields, those beam search honours (temperature only at 0)."""
_BEAM_REFUSES = frozenset({"stream", "logprobs", "top_logprobs", "response_format", "structured_outputs", "tools",
                           "suffix", "prompt_logprobs"})
"""The request's own fields beam search cannot honour when set."""


def _rounds(choices: list[dict]) -> list[list[dict]]:
    """Stream chunks' choices, in order: a choice index at most once a chunk (a step may give a
    choice several deltas: its entries go to successive chunks)."""
    rounds: list[list[dict]] = []
    seen: dict[int, int] = {}
    for entry in choices:
        n = seen[entry["index"]] = seen.get(entry["index"], -1) + 1
        if n == len(rounds):
            rounds.append([])
        rounds[n].append(entry)
    return rounds


def _api_error(exc: BaseException) -> APIError:
    """What a request that failed in the engine is answered with."""
    while isinstance(exc, BaseExceptionGroup):  # several prompts ran as tasks: the first failure
        exc = exc.exceptions[0]
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):  # refused by the engine's checks (prompt length, token ids)
        return APIError.from_value_error(exc, default_param="prompt")
    if isinstance(exc, ShuttingDown):
        return APIError(str(exc), status=503, type="server_error", code="shutdown")
    if isinstance(exc, RuntimeError):  # the engine failed it (a failed step, a dead engine process)
        return APIError(str(exc), status=500, type="server_error")
    log.error("request failed", error=repr(exc))
    return APIError(f"internal error: {type(exc).__name__}", status=500, type="server_error")


class OpenAIServing:
    def __init__(self, engine: Frontend, model_names: list[str], metrics: Metrics, limits: ServerConfig,
                 tool_parser: ToolParserFactory, reasoning: ReasoningFormat | None = None) -> None:
        self.chat_template = ChatTemplate(limits)
        self.engine = engine
        self.model_names = model_names
        """The names a request may give as its model; a response reports the one its request gave
        (the first where it gave none), as vLLM's do."""
        self.metrics = metrics
        self.limits = limits
        self.tool_parser = tool_parser
        """server.tool_call_parser's factory: what tool_choice auto reads the model's calls with."""
        self.reasoning = reasoning
        """server.reasoning_parser's format: how chat choices' thinking is told from their answer."""
        self.logprobs = LogprobsFormat(
            lambda t: self._decode([t]) if self.tokenizer is not None else f"token_id:{t}")
        self.queued = 0
        """Sequences admitted that have no first output yet: what max_waiting_requests bounds,
        counted here, where requests are admitted, so that a burst cannot overshoot it."""

    @property
    def tokenizer(self):
        return self.engine.tokenizer  # read late: it may still be loading while the app is built

    # ---- preparing a request -------------------------------------------------------------------

    def check_model(self, body: Any) -> None:
        """A 404 for a model this server does not serve (`body.model`; unset: the first name)."""
        if body.model is not None and body.model not in self.model_names:
            raise APIError(f"The model `{body.model}` does not exist.", status=404, param="model",
                           code="model_not_found")

    def _check_limits(self, body: _SamplingFields, num_prompts: int) -> None:
        """The bounds on one request's work (server.max_*), checked before anything is built."""
        lim = self.limits
        if num_prompts * body.n > lim.max_choices:
            raise APIError(f"{'n' if num_prompts == 1 else 'prompt'}: {num_prompts} prompt(s) x n = {body.n} asks for "
                           f"{num_prompts * body.n} sequences; server.max_choices is {lim.max_choices}",
                           param="n" if num_prompts == 1 else "prompt")
        stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if len(stop) > lim.max_stop_sequences:
            raise APIError(f"stop: {len(stop)} strings; server.max_stop_sequences is {lim.max_stop_sequences}",
                           param="stop")
        if (chars := sum(map(len, stop))) > lim.max_stop_chars:
            raise APIError(f"stop: {chars} characters in all; server.max_stop_chars is {lim.max_stop_chars}",
                           param="stop")
        if len(body.stop_token_ids) > lim.max_stop_sequences:
            raise APIError(f"stop_token_ids: {len(body.stop_token_ids)} ids; server.max_stop_sequences is "
                           f"{lim.max_stop_sequences}", param="stop_token_ids")
        if body.logit_bias and len(body.logit_bias) > lim.max_logit_bias:
            raise APIError(f"logit_bias: {len(body.logit_bias)} tokens; server.max_logit_bias is {lim.max_logit_bias}",
                           param="logit_bias")
        if body.bad_words and len(body.bad_words) > lim.max_bad_words:
            raise APIError(f"bad_words: {len(body.bad_words)} words; server.max_bad_words is {lim.max_bad_words}",
                           param="bad_words")

    def _params(self, body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                prompt_logprobs: int | None = None, constraint: dict[str, Any] | None = None) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs, prompt_logprobs, self.engine.sampling_defaults,
                                        constraint)
        except ValueError as exc:
            raise APIError.from_value_error(exc) from None

    def completion_job(self, body: CompletionRequest) -> _Job:
        self.check_model(body)
        if body.suffix:
            raise APIError("suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError("best_of must equal n (use_beam_search takes the n best beams)", param="best_of")
        if body.max_tokens == 0 and not body.echo:
            raise APIError("max_tokens must be >= 1 (0 only with echo, to score the prompt), got 0",
                           param="max_tokens")
        prompts = body.prompts()
        self._check_limits(body, len(prompts))
        # echo with max_tokens 0 scores the prompt (lm-eval-harness's loglikelihood requests): the
        # engine samples its minimum of one token, which the response leaves out.
        score = body.echo and body.max_tokens == 0
        prompt_lp = body.logprobs if body.echo and body.logprobs is not None else None
        if body.prompt_logprobs is not None:
            prompt_lp = max(prompt_lp or 0, body.prompt_logprobs)
        params = self._params(body, 1 if score else body.max_tokens, body.logprobs, prompt_lp)
        job_id = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        return self._settled(_Job("completion", job_id, int(time.time()), prompts, params, body,
                                  echo=body.echo, score_prompt=score, add_special_tokens=body.add_special_tokens,
                                  beam=self._beam(body, body.max_tokens)))

    def chat_job(self, body: ChatCompletionRequest) -> _Job:
        self.check_model(body)
        body.unsupported()
        if self.tokenizer is None:
            raise APIError("this model has no tokenizer, so it cannot render chat messages", param="messages")
        self._check_limits(body, 1)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.top_logprobs is not None and not body.logprobs:  # (not silently without them)
            raise APIError("top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        tools = template_tools(body.tools)
        tool_plan = plan(body, tools, self.tool_parser)
        if body.echo and tool_plan is not None:  # (a choice may be calls alone: no content to begin)
            raise APIError("echo cannot be combined with tool calls: send tool_choice \"none\" or no tools",
                           param="echo")
        params = self._params(body, max_tokens, logprobs, body.prompt_logprobs,
                              constraint=tool_plan and tool_plan.constraint)
        prompt = self.render_chat(body, tools)
        last = body.messages[-1]
        return self._settled(_Job(
            "chat", f"chatcmpl-{body.request_id or uuid.uuid4().hex}", int(time.time()), [prompt], params, body,
            echo_content=last.text(f"messages[{len(body.messages) - 1}]") if body.echo and last.role == "assistant" else "",
            reasoning=self._reasoning(params, prompt), include_reasoning=body.include_reasoning,
            add_special_tokens=body.add_special_tokens, tools=tool_plan, beam=self._beam(body, max_tokens)))

    def _settled(self, job: _Job) -> _Job:
        """The job with the server's settings in place of what its request left out."""
        if self.limits.return_tokens_as_token_ids and "return_tokens_as_token_ids" not in job.body.model_fields_set:
            job.body.return_tokens_as_token_ids = True
        job.cached_in_usage = self.limits.enable_prompt_tokens_details
        job.model = job.body.model or self.model_names[0]
        job.key = job.id if job.body.request_id is None else f"{job.id}-{uuid.uuid4().hex[:12]}"
        return job

    def _reasoning(self, params: SamplingParams, prompt: str) -> ReasoningFormat | None:
        """How a chat request's choices are split into reasoning and content (server.reasoning_parser),
        as its prompt leaves off; an output a grammar writes (structured outputs, a required or
        named tool call) begins as content: it thinks only where it writes the opening tag itself."""
        fmt = None if self.reasoning is None else self.reasoning.after(prompt)
        return fmt if fmt is None or params.structured_outputs is None else fmt.inside(False)

    def _beam(self, body: _SamplingFields, max_tokens: int | None) -> BeamSearchParams | None:
        """use_beam_search's parameters, or a 400 naming a field beam search cannot honour."""
        if not body.use_beam_search:
            if "length_penalty" in body.model_fields_set:
                raise APIError("length_penalty applies to beam search only: send use_beam_search: true",
                               param="length_penalty")
            return None
        fields = type(body).model_fields
        asked = {name for name in body.model_fields_set
                 if getattr(body, name) != fields[name].get_default(call_default_factory=True)}
        unused = sorted(asked & (_BEAM_REFUSES | set(REQUEST_FIELDS) - _BEAM_TAKES))
        if unused:
            raise APIError(f"{unused[0]} does not apply to use_beam_search (it takes n, max_tokens, ignore_eos, "
                           "length_penalty, and temperature 0)", param=unused[0])
        try:
            return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens or 1, ignore_eos=body.ignore_eos,
                                    temperature=body.temperature if "temperature" in asked else 0.0,
                                    length_penalty=body.length_penalty)
        except ValueError as exc:
            error = APIError.from_value_error(exc)
            param = "n" if error.param == "beam_width" else error.param
            raise APIError(str(error).replace("beam_width", "n"), param=param) from None

    def render_chat(self, body: ChatCompletionRequest | TokenizeRequest,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of a chat request; `tools` are its tools already checked (else they are
        checked here)."""
        return self.chat_template.render(self.tokenizer, body, tools)

    # ---- running -------------------------------------------------------------------------------

    def admit(self, job: _Job) -> None:
        """Count the job's sequences as queued, or refuse it: a beam search asked to stream (400), or
        sequences that would pass server.max_waiting_requests (503; a job alone is always let in:
        it is within max_choices)."""
        if job.beam is not None and job.body.stream:  # (a WebSocket request always streams)
            raise APIError("use_beam_search answers once the search has ended: it cannot be streamed",
                           param="use_beam_search")
        if job.body.prompt_logprobs is not None and job.body.stream:
            raise APIError("prompt_logprobs are answered with the whole response: they cannot be streamed",
                           param="prompt_logprobs")
        size = len(job.prompts) * job.params.n
        limit = self.limits.max_waiting_requests
        if self.queued and self.queued + size > limit:
            raise APIError(f"The server is busy: {self.queued} sequences are waiting for their first token and this "
                           f"request adds {size} (server.max_waiting_requests is {limit}); retry later", status=503,
                           type="server_error", code="overloaded", headers={"Retry-After": "1"})
        self.queued += size
        job.queued = [job.params.n] * len(job.prompts)

    def _unqueue(self, job: _Job, i: int, out: RequestOutput | None = None) -> None:
        """Prompt i's sequences that have a first token (or ended) leave the queue; with no output,
        all of them (the prompt is done with)."""
        if not job.queued or not job.queued[i]:
            return
        left = 0 if out is None else sum(1 for c in out.outputs if not c.token_ids and c.finish_reason is None)
        self.queued -= job.queued[i] - left
        job.queued[i] = left

    async def outputs(self, job: _Job) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, cumulative output) as the engine produces them, all prompts at once.

        The prompts go to the engine in one submission; each output slot reports its index when it
        is filled, and one loop takes the outputs as they come (no task per prompt, so nothing is
        left to close in another task when the reader goes). The first output comes once the engine
        took every prompt in (each one's first output, empty, says so), so that a prompt it refuses
        still fails the whole request before anything is sent. Leaving early aborts the prompts
        that have not finished."""
        filled = _Filled()
        subs = [Submit(f"{job.key}-{i}", prompt, job.params, OutputSlot(partial(filled.put, i)),
                       job.body.priority, job.add_special_tokens, strict_length=True)
                for i, prompt in enumerate(job.prompts)]
        timers = [self.metrics.timer(job.params) for _ in subs]
        finished = [False] * len(subs)
        held: dict[int, RequestOutput] | None = {}  # the latest of each prompt until all are taken in
        try:
            await self.engine.submit(subs)
            while not all(finished):
                for i in await filled.take():
                    try:
                        out = subs[i].slot.take()  # the newest output since the last take
                    except Exception:  # refused or failed: the engine has ended it (and an id it refused
                        finished[i] = True  # as in use is another request's: not to be aborted)
                        raise
                    finished[i] = out.finished
                    self._unqueue(job, i, out)
                    timers[i].update(out)
                    out = _prompt_only(out) if job.score_prompt else out
                    if held is not None:
                        held[i] = out
                        if len(held) < len(subs):
                            continue
                        ready, held = sorted(held.items()), None
                    else:
                        ready = [(i, out)]
                    for item in ready:
                        yield item
        except Exception as exc:
            error = _api_error(exc)
            fmt = job.body.response_format
            if error.param == "structured_outputs" and job.tools is not None and job.tools.constraint is not None:
                error = job.tools.schema_error(error)  # the constraint is the tools' parameters
            elif error.param == "structured_outputs" and fmt is not None and fmt.type != "text":
                # the request said response_format: name it, not the field it was turned into
                error = APIError(str(error).replace("structured_outputs.json", "response_format.json_schema.schema", 1),
                                 status=error.status, param="response_format")
            raise error from None
        finally:  # (aborting one the engine already ended does nothing)
            with anyio.CancelScope(shield=True):
                for i, sub in enumerate(subs):
                    self._unqueue(job, i)
                    if not finished[i]:
                        await self.engine.abort(sub.req_id)

    async def full_response(self, job: _Job) -> dict[str, Any]:
        if job.beam is not None:
            return await self._beam_response(job)
        finals: dict[int, RequestOutput] = {}
        async with aclosing(self.outputs(job)) as outs:
            async for i, out in outs:
                finals[i] = out
        choices = []
        k = job.body.prompt_logprobs
        for i in sorted(finals):
            out = finals[i]
            prompt_lps = None if k is None or job.kind != "completion" else self.logprobs.prompt(out, k)
            for c in out.outputs:
                choices += self._choice(job, i, out, c, c.text, c.token_ids, c.logprobs or [], c.finish_reason,
                                        first=True)
                if prompt_lps is not None:  # (vLLM's places: each completion choice, a chat response)
                    choices[-1]["prompt_logprobs"] = prompt_lps
        response = {"id": job.id, "object": "text_completion" if job.kind == "completion" else "chat.completion",
                    "created": job.created, "model": job.model, "choices": choices,
                    "usage": self._usage(job, finals.values())}
        if k is not None and job.kind == "chat":
            response["prompt_logprobs"] = self.logprobs.prompt(finals[0], k)
        return response

    async def _beam_response(self, job: _Job) -> dict[str, Any]:
        """The n best beams of each prompt as its choices (llmserve/beam_search.py): each step's
        beams run as one batch of requests, one token each."""
        ids = [list(p) if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=job.add_special_tokens)
               for p in job.prompts]
        beam = job.beam
        if job.params.max_tokens is None:  # to the end of the context, as a sampled request goes
            beam = dataclasses.replace(beam, max_tokens=max(self.engine.max_model_len - max(map(len, ids)), 1))
        try:
            steps = beam_steps(ids, beam, self.engine.eos_token_ids, self._decode, self.engine.max_model_len)
            batch, step = next(steps), 0
            while True:
                outputs = await self._finals(job, batch, step_params(beam), step)
                for i in range(len(job.prompts)):  # its beams have their first tokens: no longer waiting
                    self._unqueue(job, i)
                batch = steps.send(outputs)
                step += 1
        except StopIteration as done:
            results = done.value
        except ValueError as exc:
            raise APIError(str(exc), param="max_tokens") from None
        finally:
            for i in range(len(job.prompts)):
                self._unqueue(job, i)
        finals, choices = [], []
        for i, (prompt, result) in enumerate(zip(job.prompts, results)):
            out = RequestOutput(f"{job.id}-{i}", prompt if isinstance(prompt, str) else None, ids[i], [
                CompletionOutput(j, s.text, s.tokens[len(ids[i]):], s.cum_logprob, finish_reason=s.finish_reason)
                for j, s in enumerate(result.sequences)], finished=True)
            finals.append(out)
            for c in out.outputs:
                choices += self._choice(job, i, out, c, c.text, c.token_ids, [], c.finish_reason, first=True)
        return {"id": job.id, "object": "text_completion" if job.kind == "completion" else "chat.completion",
                "created": job.created, "model": job.model, "choices": choices,
                "usage": self._usage(job, finals)}

    async def _finals(self, job: _Job, prompts: list[list[int]], params: SamplingParams,
                      step: int) -> list[RequestOutput]:
        """One beam-search step: the finished outputs of `prompts`, in order (aborted if left early)."""
        filled = _Filled()
        subs = [Submit(f"{job.key}-beam{step}-{i}", prompt, params, OutputSlot(partial(filled.put, i)),
                       job.body.priority, strict_length=True, final_only=True) for i, prompt in enumerate(prompts)]
        finals: list[RequestOutput | None] = [None] * len(subs)
        ended = [False] * len(subs)
        try:
            await self.engine.submit(subs)
            while None in finals:
                for i in await filled.take():
                    ended[i] = True  # finished, or refused or failed (then the engine ended it)
                    finals[i] = subs[i].slot.take()
        except Exception as exc:
            raise _api_error(exc) from None
        finally:
            with anyio.CancelScope(shield=True):
                for sub, done in zip(subs, ended):
                    if not done:
                        await self.engine.abort(sub.req_id)
        return finals

    async def stream(self, job: _Job) -> AsyncIterator[dict[str, Any]]:
        """Chunk objects, in order; the last one carries usage when stream_options.include_usage (or
        server.enable_force_include_usage), and every one the request's usage so far with vLLM's
        stream_options.continuous_usage_stats (all its prompts and choices together: a chunk may
        carry several choices)."""
        finals: dict[int, RequestOutput] = {}
        with_usage = job.body.include_usage_in_stream() or self.limits.enable_force_include_usage
        continuous = with_usage and bool(job.body.stream_options and job.body.stream_options.continuous_usage_stats)
        so_far = [0, 0]  # with continuous usage: the prompt tokens of the prompts begun, the completion tokens

        def counted(i: int, out: RequestOutput) -> None:  # (kept up to date: a chunk does not sum all outputs)
            before = finals.get(i)
            so_far[0] += len(out.prompt_token_ids) if before is None else 0
            so_far[1] += sum(len(c.token_ids) for c in out.outputs) - (
                0 if before is None else sum(len(c.token_ids) for c in before.outputs))

        def chunk_of(choices: list[dict]) -> dict[str, Any]:
            c = self._chunk(job, choices)
            if continuous:
                c["usage"] = {"prompt_tokens": so_far[0], "completion_tokens": so_far[1], "total_tokens": sum(so_far)}
            return c
        async with aclosing(self.outputs(job)) as outs:
            async for i, out in outs:
                opening = job.kind == "chat" and not finals
                if continuous:
                    counted(i, out)
                finals[i] = out
                if opening:
                    # The role opens the stream only once the engine took the request: a request it
                    # refuses (a prompt too long) is then still answered with its 4xx status.
                    # (content null where the output may be tool calls alone: added up, the deltas
                    # then give the message's null content, as OpenAI streams them)
                    content = None if job.tools is not None else job.echo_content
                    yield chunk_of([{"index": k, "delta": {"role": "assistant", "content": content},
                                     "logprobs": None, "finish_reason": None} for k in range(job.params.n)])
                for choices in _rounds(self._new_choices(job, i, out)):
                    yield chunk_of(choices)
        if with_usage:
            chunk = self._chunk(job, [])
            chunk["usage"] = self._usage(job, finals.values())
            yield chunk

    def _new_choices(self, job: _Job, i: int, out: RequestOutput) -> list[dict]:
        """What prompt i's choices have to send since the last chunk."""
        choices = []
        for c in out.outputs:
            sent = job.sent.setdefault(i * job.params.n + c.index, _Sent())
            if sent.done:
                continue
            first = not sent.started
            new_text = c.text[sent.text:]
            new_lps = (c.logprobs or [])[sent.logprobs:]
            finish = c.finish_reason
            if not (new_text or len(c.token_ids) > sent.tokens or finish is not None or (first and job.echo)):
                continue
            choices += self._choice(job, i, out, c, new_text, c.token_ids[sent.tokens:], new_lps, finish,
                                    first=first, offset=sent.text)
            sent.started, sent.done = True, finish is not None
            sent.text, sent.tokens, sent.logprobs = len(c.text), len(c.token_ids), len(c.logprobs or [])
        return choices

    # ---- wire format ---------------------------------------------------------------------------

    def _chunk(self, job: _Job, choices: list[dict]) -> dict[str, Any]:
        return {"id": job.id, "object": "text_completion" if job.kind == "completion" else "chat.completion.chunk",
                "created": job.created, "model": job.model, "choices": choices}

    def _usage(self, job: _Job, finals) -> dict[str, Any]:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
        usage: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
        if job.cached_in_usage:
            usage["prompt_tokens_details"] = {"cached_tokens": sum(o.num_cached_tokens for o in finals)}
        return usage

    def _choice(self, job: _Job, i: int, out: RequestOutput, c: CompletionOutput, text: str, token_ids: list[int],
                logprobs: list[PositionLogprobs], finish: str | None, *, first: bool, offset: int = 0) -> list[dict]:
        """The choice's entries for `text` (its text since the last chunk, or all of it): one, or
        for a streamed chat choice with tool calls one per delta its parser gives."""
        index = i * job.params.n + c.index
        if job.kind == "chat":
            k = job.params.logprobs or 0
            as_ids = job.body.return_tokens_as_token_ids
            entry = {"index": index,
                     "logprobs": None if c.logprobs is None else self.logprobs.chat(token_ids, logprobs, k, as_ids),
                     "finish_reason": finish}
            thinking, text = self._thinking(job, index, text, final=finish is not None)
            if job.tools is None and job.body.stream:
                entry["delta"] = {**thinking, **({"content": text} if text else {})}
                return [entry]
            if job.tools is None:  # (all thinking, no answer: content null, as vLLM gives it)
                content = job.echo_content + text
                entry["message"] = {"role": "assistant", "content": content or (None if thinking else ""), **thinking}
                return [entry]
            if not job.body.stream:
                calls = job.tools.start()
                entry["message"] = {**calls.message(text), **thinking}
                entry["finish_reason"] = calls.finish_reason(finish)
                return [entry]
            calls = job.calls.setdefault(index, job.tools.start())
            entries = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                       for delta in calls.deltas(text, final=finish is not None)]
            entries[0]["delta"] = {**thinking, **entries[0]["delta"]}
            entries[0]["logprobs"] = entry["logprobs"]
            entries[-1]["finish_reason"] = calls.finish_reason(finish)
            return entries
        k = job.params.logprobs or 0
        lps = None
        if c.logprobs is not None:
            lps = self.logprobs.completion(token_ids, logprobs, offset, k, job.body.return_tokens_as_token_ids)
        if job.echo and first:
            prompt_text = out.prompt if out.prompt is not None else self._decode(out.prompt_token_ids)
            text = prompt_text + text
            if lps is not None and out.prompt_logprobs is not None:
                as_ids = job.body.return_tokens_as_token_ids
                prompt_lps = self.logprobs.completion(out.prompt_token_ids, out.prompt_logprobs, 0, k, as_ids)
                # the completion's offsets go on from the prompt's: its text's, or its "token_id:N" names'
                shift = sum(map(len, prompt_lps["tokens"])) if as_ids else len(prompt_text)
                lps = self.logprobs.merged(prompt_lps, lps, shift)
        return [{"index": index, "text": text, "logprobs": lps, "finish_reason": finish}]

    @staticmethod
    def _thinking(job: _Job, index: int, text: str, final: bool) -> tuple[dict[str, str], str]:
        """A chat choice's reasoning fields (`reasoning`, and `reasoning_content` for clients of
        vLLM before it renamed it; none without a reasoning parser or with include_reasoning
        false) and `text` less its reasoning, to read as before; streamed, split as it comes."""
        if job.reasoning is None:
            return {}, text
        if job.body.stream:
            split = job.splits.setdefault(index, ReasoningSplit(job.reasoning))
            reasoning, text = split.feed(text, final=final)
        else:
            reasoning, text = split_reasoning(job.reasoning, text)
        if not reasoning or not job.include_reasoning:
            return {}, text
        return {"reasoning": reasoning, "reasoning_content": reasoning}, text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""
