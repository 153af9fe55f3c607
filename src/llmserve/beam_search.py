"""Beam search over the engine: `LLM.beam_search(prompts, BeamSearchParams(...))`.

Each step asks the engine for one token of every running beam with its top 2·W log-probabilities
(W = beam_width), as one batch for all prompts; beams are ordinary requests whose prompt is the
beam so far, so they share the KV blocks of their prompt and common prefix through the prefix
cache (only each beam's last, partial block is its own). The selection is transformers'
(`generate(num_beams=W, do_sample=False, early_stopping=False)`), per prompt and step:

    candidates: every running beam extended by each of its top 2·W tokens, scored by the sum of
    log-probabilities; the best 2·W of them, in order. A candidate ends its beam when its token
    is an end-of-sequence id (unless ignore_eos) or the beam reaches max_tokens.
    running: the first W candidates that do not end.
    finished: the candidates among the first W that end, scored sum / (generated length **
    length_penalty), merged with those kept before; the best W are kept.
    stop when no candidate continues, or when W beams are finished and the best running beam,
    scored at its current length, is not above the worst finished one (transformers' heuristic;
    finished beams are no longer added from then on).

The result is the finished beams, best first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Callable, Generator
from typing import Any

from llmserve.sampling_params import MAX_LOGPROBS, SamplingParams, _fail


MAX_LENGTH_PENALTY = 10
"""|length_penalty| at most: 2**20 tokens raised to it stays far inside a float's range (useful
values are 0 to 2)."""


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    """Only 0: beams are ranked by the model's own log-probabilities (as in vLLM)."""
    length_penalty: float = 1.0
    """A finished beam scores sum(logprobs) / (generated tokens ** length_penalty)."""
    include_stop_str_in_output: bool = False
    """Accepted for vLLM's signature; beam search has no stop strings."""

    def __post_init__(self) -> None:
        if (not isinstance(self.beam_width, int) or isinstance(self.beam_width, bool)
                or not 1 <= self.beam_width <= MAX_LOGPROBS // 2):
            _fail("beam_width", f"an integer in [1, {MAX_LOGPROBS // 2}] (each beam reads its top "
                  f"2·beam_width log-probabilities, at most {MAX_LOGPROBS})", self.beam_width)
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            _fail("max_tokens", "an integer >= 1", self.max_tokens)
        if self.temperature != 0:
            _fail("temperature", "0 (beam search ranks by the model's own log-probabilities)", self.temperature)
        if (not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool)
                or not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY):
            _fail("length_penalty", f"a number in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}] (a beam's length "
                  "raised to it must stay a float)", self.length_penalty)


@dataclass(slots=True)
class BeamSearchSequence:
    tokens: list[int]
    """The prompt's tokens, then the beam's."""
    cum_logprob: float
    score: float
    """cum_logprob / (generated tokens ** length_penalty): what the beams are ranked by."""
    finish_reason: str
    """'stop' (it ended with an end-of-sequence id) or 'length'."""
    text: str | None = None
    """The beam's generated text (None without a tokenizer)."""


@dataclass(slots=True)
class BeamSearchOutput:
    sequences: list[BeamSearchSequence]
    """Best first, at most beam_width."""


@dataclass(slots=True)
class _Search:
    """One prompt's search."""
    prompt: list[int]
    running: list[tuple[list[int], float]] = field(default_factory=lambda: [([], 0.0)])  # (tokens, cum logprob)
    finished: list[tuple[float, list[int], float]] = field(default_factory=list)  # (score, tokens, cum logprob)
    open: bool = True  # finished beams may still be added (transformers' early-stop heuristic)
    done: bool = False

    def advance(self, tops: list[dict[int, float]], params: BeamSearchParams, eos: frozenset[int]) -> None:
        """One step: `tops` holds each running beam's top 2·W next tokens -> log-probability."""
        width, length = params.beam_width, len(self.running[0][0]) + 1
        candidates = sorted(((cum + lp, tokens + [t]) for (tokens, cum), top in zip(self.running, tops)
                             for t, lp in top.items()), key=lambda c: -c[0])[:2 * width]
        ends = [length >= params.max_tokens or (not params.ignore_eos and c[1][-1] in eos) for c in candidates]
        self.running = [(tokens, cum) for (cum, tokens), end in zip(candidates, ends) if not end][:width]
        if self.open:
            penalty = length ** params.length_penalty
            self.finished += [(cum / penalty, tokens, cum) for (cum, tokens), end in
                              zip(candidates[:width], ends[:width]) if end]
            self.finished = sorted(self.finished, key=lambda f: -f[0])[:width]
            if len(self.finished) == width and self.running:
                self.open = self.running[0][1] / penalty > self.finished[-1][0]
        self.done = all(ends) or not self.open or not self.running


def beam_steps(prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: frozenset[int],
               decode: Callable[[list[int]], str] | None,
               max_model_len: int) -> Generator[list[list[int]], list[Any], list[BeamSearchOutput]]:
    """The search as a generator, for a synchronous or an asynchronous engine alike: it yields each
    step's batch of token-id prompts (to run with step_params(params)), is sent their
    RequestOutputs in order, and returns the beams of each prompt."""
    for i, prompt in enumerate(prompts):
        if len(prompt) + params.max_tokens > max_model_len:
            raise ValueError(f"prompt {i}: {len(prompt)} tokens + max_tokens {params.max_tokens} exceed "
                             f"max_model_len {max_model_len}")
    searches = [_Search(list(p)) for p in prompts]
    while live := [s for s in searches if not s.done]:
        outputs = iter((yield [s.prompt + tokens for s in live for tokens, _ in s.running]))
        for s in live:
            tops = [{t: lp.logprob for t, lp in next(outputs).outputs[0].logprobs[0].items()} for _ in s.running]
            s.advance(tops, params, eos_token_ids)
    return [BeamSearchOutput([
        BeamSearchSequence(s.prompt + tokens, cum, score,
                           "stop" if tokens and not params.ignore_eos and tokens[-1] in eos_token_ids else "length",
                           decode(tokens) if decode is not None else None)
        for score, tokens, cum in s.finished]) for s in searches]


def step_params(params: BeamSearchParams) -> SamplingParams:
    """What each step asks of every running beam: one token and its top 2·W log-probabilities."""
    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * params.beam_width, ignore_eos=True)


def beam_search(generate: Callable[[list[list[int]], SamplingParams], list[Any]], prompts: list[list[int]],
                params: BeamSearchParams, eos_token_ids: frozenset[int], decode: Callable[[list[int]], str] | None,
                max_model_len: int) -> list[BeamSearchOutput]:
    """Beam search for each prompt (token ids); `generate(prompts, params)` runs a batch on the
    engine and returns its RequestOutputs in order."""
    steps = beam_steps(prompts, params, eos_token_ids, decode, max_model_len)
    try:
        batch = next(steps)
        while True:
            batch = steps.send(generate(batch, step_params(params)))
    except StopIteration as done:
        return done.value
