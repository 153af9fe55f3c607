"""Speculative decoding: a proposer guesses the tokens that follow a request's last one, and one
forward pass checks them all.

    step N finishes: request r's output ends in t            (executor, host)
        proposer.propose(...) -> drafts d1..dk
    step N+1 computes [t, d1, ..., dk] for r (k + 1 positions, logits at each) and draws x0..xk,
        each exactly as the plain engine would draw at that position: the request's seed and
        output index, penalties and min_tokens counting d1..d(i-1) as output
        kept: the longest run with x(i-1) == d(i), a of them; r produces x0..xa
    the scheduler takes the k - a rejected drafts' KV slots back (ScheduledRequest.retract); the KV
    manager never hashes a block while drafts are in it

Why this is exact: the rejection sampler of Leviathan et al. (arXiv 2211.17192) accepts a draft d
drawn from q with probability min(1, p(d) / q(d)) and otherwise draws from max(p - q, 0),
normalised. For a fixed proposal (q puts all its mass on d: n-gram, a draft model's greedy
choice) d is accepted with probability p(d), and a rejection draws from p without d. Drawing x
from p and keeping d when x == d does exactly that, and x given x != d is the residual. Since x is
the plain sampler's own draw (its counter-hash stream, model/sampler.py), a seeded request produces
the same tokens with and without speculation, and greedy rows keep a draft while it is the argmax.

A proposer that can draw its drafts from a distribution (`propose_sampled`: the draft model)
does so for the requests that sample freely: temperature > 0, no top-k/top-p/min-p, and no seed
of their own (a seeded request must give the plain engine's tokens, whatever the engine's
speculation decisions). Their rows check with min(1, p / q) itself (the backend's
check_drafts, kernels/sampling_reference.py check_drafts_reference), which keeps a draft sampled
from a draft model close to the target far more often than p(d) keeps its greedy choice; the
tokens are still distributed as the plain engine's, and a row's token equals its draft exactly
when the draft is kept, so the engine counts and takes back drafts as it does for fixed proposals.

When it pays: a step that checks k drafts reads the weights once for up to k + 1 tokens, a gain
while the batch is small enough for the step to be bound by memory. Two costs are paid for it:
the checked positions' compute, and the overlap of planning with the device (a request's drafts
follow its last token, known only when its step has finished, so while the engine speculates,
steps are planned one at a time). So nobody speculates above `disable_by_batch_size` running
requests, and SpecControl turns speculation off for the whole engine while it keeps too few
drafts to pay for those costs, and on again where a probe (an overlapped step whose proposals
are only counted) finds proposals.

A proposer is registered by name (hook `llmserve_register_proposers`) as a factory taking the
[speculative] config and a ProposerContext; `speculative.method` selects it. Built in: `ngram`
(plugins/ngram.py) and `draft` (plugins/draft_model.py).
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from llmserve.config import SpeculativeConfig
from llmserve.kernels.sampling_reference import hash32_reference, row_keys
from llmserve.sampling_params import SamplingParams


class Proposer(Protocol):
    def propose(self, req_ids: list[str], sequences: list[tuple[array, list[int]]],
                limits: list[int]) -> list[list[int]]:
        """For each request (its id; prompt token ids as int64 array, output token ids so far): at
        most `limits[i]` tokens that may follow its last one ([] when it has no guess). Called on
        the executor's thread once a step's tokens are known, for the requests that asked; what
        it proposed before may be missing from the output (the model rejected it)."""

    # Optional: a proposer that can draw its drafts from a distribution defines
    #   propose_sampled(req_ids, sequences, limits, temperatures: list[float],
    #                   keys: list[np.ndarray | None]) -> tuple[list[list[int]], list[torch.Tensor | None]]
    # where request i with temperatures[i] > 0 gets drafts drawn from q = softmax(draft logits /
    # temperatures[i]), its j-th with the random stream keys[i][j] (int64, sample_rows' row keys),
    # and the second list holds their q rows (float32 [len(drafts), vocab] on the device); requests
    # with temperature 0 get greedy drafts, as from propose, and None there.
    # Optional: a proposer that keeps state per request defines
    #   forget(req_ids: list[str]) -> None
    # called when those requests end; one that runs a model on the device defines
    #   capture_graphs(emulate: bool) -> None
    # called once the engine's KV cache exists, where the engine captures CUDA graphs of its own
    # steps (not under enforce_eager; emulate: tests without CUDA). A proposer that reads the
    # model's hidden states (EAGLE-style heads) defines
    #   observe(req_ids: list[str], starts: np.ndarray, query_start_loc: np.ndarray,
    #           hidden: torch.Tensor) -> None
    # called on the executor's thread once each step's forward pass is queued (every step, whether
    # or not it speculates; one rank only), before the step samples: request i's rows
    # query_start_loc[i]:query_start_loc[i + 1] of hidden ([num_tokens, hidden_size], the final
    # hidden states after the model's last norm, on the device) are its positions starts[i]
    # onward. They are valid only during the call (a CUDA graph's buffers are replayed over by
    # the next step): queue device work on them on the current stream, or copy what it keeps.
    # Rows of drafts a step checks come whether or not the drafts are kept; the request's next
    # propose call shows which were (its output), and a later step computes the others again.


@dataclass(slots=True, frozen=True)
class ProposerContext:
    """What a proposer may need of the engine it serves (a draft model runs on the same device)."""
    device: Any  # torch.device
    dtype: Any  # torch.dtype of the model
    backend: Any  # the AttentionBackend
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    block_size: int


class ProposerFactory(Protocol):
    def __call__(self, config: SpeculativeConfig, context: ProposerContext) -> Proposer: ...


@dataclass(slots=True, frozen=True)
class Speculation:
    """What the scheduler needs of the [speculative] config."""
    num_tokens: int
    """Most drafts per request per step."""
    max_batch: int
    """Running requests above which nobody speculates."""

    @classmethod
    def of(cls, config: SpeculativeConfig) -> Speculation | None:
        if config.method is None:
            return None
        return cls(config.num_speculative_tokens, config.disable_by_batch_size)

    @staticmethod
    def serves(params: SamplingParams, prepared: dict[str, Any]) -> bool:
        """Whether a request speculates: with at most one decoding strategy's constraint, one that
        can check drafts (its prepared object's `checks_drafts`: the executor masks each checked
        position as the constraint stands after the drafts before it, llmserve/decoding.py)."""
        return not prepared or (len(prepared) == 1 and getattr(next(iter(prepared.values())), "checks_drafts", False))


class SpecControl:
    """Whether the engine speculates now, from the drafts speculation keeps and what its steps cost.

    Speculating, its measure is the drafts kept per speculating request per step: over a spell's
    first 1 / ALPHA steps their plain mean, after them a running mean (weight ALPHA), with a
    variance kept the same way; a step that waited for proposals that did not come counts as zero
    (a request's first proposals are judged by the step that checks them). A spell is judged by
    its own steps, never by a prior (a draft model taking most of a fast step could not climb from
    one in time): once it has SETTLE steps it stops where even the mean plus one standard error
    (of ~2 / ALPHA steps) is below the bar, so a spell whose drafts pay on average is not stopped
    by a run of rejections (each stop costs a synchronous restart and probes).

    The bar is what a speculating step costs over a plain one, in steps, less one: a request must
    keep that many drafts a step to pay. Measured where it can be: the median interval between
    the spell's steps' results (proposals, the checked positions and the lost overlap of planning
    with the device all inside it) over the median of the last PLAIN_SAMPLES plain steps' (taken
    while speculation was stopped), both of steps of about the step's size (the same power of two
    of requests: a plain step of 16 is no measure of a speculating step of 1). Before both are
    known, a model: a step that checks drafts costs
    1.2-1.4 plain steps (measured on an H100 from a 6M to an 8B model: 1.19-1.25 for the lost
    overlap, the rest for the checked positions; BENCHMARKS.md), so MIN_GAIN = 0.4, plus what the
    proposer takes of a step (a running mean of the executor's measure, StepResult.propose_cost:
    n-gram lookups nearly nothing, a draft model a large share of a small model's step). A proposer
    that costs more than it could ever gain stops at once and is not probed again.

    Stopped, it waits `gap` planned steps, then probes: one step, overlapped as usual, asks for
    proposals for every request that may speculate, only to count those found. Where at least
    PROBE_SHARE of them found some, a new spell starts (its mean from its own steps); else the gap
    doubles (up to MAX_GAP). A spell that ends within SHORT steps doubles the gap too, a longer one
    resets it. So a load the proposer cannot guess costs a proposal per request every 256 steps
    or so and never a synchronous step; one it guesses but rarely right costs a few synchronous
    steps per probe; one it guesses well speculates.
    """

    MIN_GAIN = 0.4
    SETTLE = 4
    ALPHA = 0.1
    PLAIN_SAMPLES = 16
    PROBE_SHARE = 0.5
    FIRST_GAP, MAX_GAP, SHORT = 8, 256, 32

    def __init__(self, max_gain: int = 0) -> None:
        self.max_gain = max_gain  # drafts a step at most (num_speculative_tokens)
        self.cost: float | None = None  # running mean of the proposer's cost, in steps (from its first measure)
        self.active = True
        self.gain = 0.0
        self.spread = 0.0  # the running variance of the spell's steps' drafts kept per request
        # seconds between results, by the steps' size class (_size_class): the spell's, and plain steps'
        self.intervals: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=2 * self.PLAIN_SAMPLES))
        self.plain_intervals: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=self.PLAIN_SAMPLES))
        self.gap = self.FIRST_GAP
        self.wait = 0  # planned steps before the next probe
        self.steps = 0  # steps of the current spell
        self.probe_step: int | None = None  # the probe in flight
        self.probe_age = 0  # steps planned since it went out

    @property
    def probe_due(self) -> bool:
        return (not self.active and self.wait <= 0 and self.probe_step is None
                and (not self.max_gain or self.MIN_GAIN + (self.cost or 0.0) < self.max_gain))

    def planned(self) -> None:
        """A step was planned."""
        if not self.active and self.wait > 0:
            self.wait -= 1
        elif self.probe_step is not None:
            self.probe_age += 1
            if self.probe_age > 2 * self.FIRST_GAP:  # its result never came (the engine failed it): a miss
                self.probed(0, 0)

    def probe_sent(self, step_id: int) -> None:
        self.probe_step, self.probe_age = step_id, 0

    def probed(self, asked: int, found: int) -> None:
        """The probe's result: `found` of the `asked` requests got proposals."""
        self.probe_step = None
        if asked and found >= self.PROBE_SHARE * asked:
            self.active, self.gain, self.spread, self.steps = True, 0.0, 0.0, 0
            self.intervals.clear()
        else:
            self._stop()

    def bar(self, batch: int = 1) -> float:
        """Drafts a speculating request must keep a step, in steps of `batch` requests, to pay."""
        size = _size_class(batch)
        spell, plain = self.intervals.get(size, ()), self.plain_intervals.get(size, ())
        if len(spell) >= self.SETTLE and len(plain) >= self.SETTLE:
            return statistics.median(spell) / statistics.median(plain) - 1
        return self.MIN_GAIN + (self.cost or 0.0)

    def plain(self, interval: float, batch: int = 1) -> None:
        """A step of `batch` requests without speculation took `interval` seconds from the result
        before (0: not known)."""
        if not self.active and interval > 0:
            self.plain_intervals[_size_class(batch)].append(interval)

    def record(self, requests: int, kept: int, cost: float = 0.0, interval: float = 0.0, batch: int = 1) -> None:
        """A step's result: `requests` of it speculated (proposed or checked drafts), keeping `kept`
        drafts; the proposer took `cost` steps for its drafts, and the result came `interval`
        seconds after the one before (0: not known), for a step of `batch` requests."""
        if not self.active or not requests:
            return
        self.steps += 1
        weight = max(1 / self.steps, self.ALPHA)  # a plain mean over the spell's first steps
        delta = kept / requests - self.gain
        self.gain += weight * delta
        self.spread = (1 - weight) * (self.spread + weight * delta * delta)
        if interval > 0:
            self.intervals[_size_class(batch)].append(interval)
        self.cost = cost if self.cost is None else self.cost + self.ALPHA * (cost - self.cost)
        hopeless = self.max_gain > 0 and self.MIN_GAIN + self.cost >= self.max_gain  # even every draft kept
        error = math.sqrt(self.spread / min(self.steps, (2 - self.ALPHA) / self.ALPHA))
        if hopeless or (self.steps >= self.SETTLE and self.gain + error < self.bar(batch)):
            if self.steps > self.SHORT:
                self.gap = self.FIRST_GAP
            self._stop()

    def _stop(self) -> None:
        self.active, self.wait = False, self.gap
        self.gap = min(2 * self.gap, self.MAX_GAP)


def _size_class(batch: int) -> int:
    """Steps of 1, 2-3, 4-7, 8-15, ... requests: classes whose plain steps take about as long."""
    return max(batch, 1).bit_length()


@dataclass(slots=True)
class Acceptance:
    """How often a request's drafts are kept, and so how many it is given to check (per request,
    by its own record; per batch, by the batch's size).

    The chance that a draft is kept once the one before it was is estimated as kept / judged:
    drafts kept over drafts judged (those kept and the first rejected after them), each check's
    counts weighing DECAY times those of the check after it, from a prior of 2 kept of 3 judged.
    Draft i is kept with that chance to the power i. It is worth its row while that exceeds the
    batch's bar: nothing at one request (a step of one is bound by reading the weights; four
    checked rows add ~2% to it, BENCHMARKS.md), rising linearly to DRAFT_ODDS at the batch size
    above which nobody speculates (64 checked rows add 4-10% to a step of 16 requests). So a
    request alone always checks all it may (its checked rows cost nothing, and its drafts, kept in
    runs, would only come later), and in a batch one whose drafts are seldom kept checks fewer."""
    kept: float = 2.0
    judged: float = 3.0

    DECAY = 0.8
    DRAFT_ODDS = 0.2

    def record(self, checked: int, kept: int) -> None:
        """A check of `checked` drafts kept the first `kept`."""
        self.kept = self.DECAY * self.kept + kept
        self.judged = self.DECAY * self.judged + kept + (kept < checked)

    def limit(self, most: int, batch: int, max_batch: int) -> int:
        """Drafts to propose (1 .. most) in a step of `batch` requests, speculation stopping above `max_batch`."""
        bar = self.DRAFT_ODDS * (batch - 1) / max(max_batch - 1, 1)
        rate = self.kept / self.judged
        if bar <= 0 or rate >= 1:
            return most
        if rate <= bar:
            return 1
        return min(most, int(math.log(bar) / math.log(rate)))


_DRAFT_SALT = 0x61C88647


def draws_drafts(params: SamplingParams) -> bool:
    """Whether a request's drafts are drawn from the proposer's distribution (where the proposer
    can): it samples with temperature alone, and has no seed of its own."""
    return (params.temperature > 0 and params.seed is None and not params.top_k and params.top_p >= 1.0
            and params.min_p == 0)


def draft_keys(seed: int, first: int, count: int) -> np.ndarray:
    """The random streams (int64 [count]) a request's drafts are drawn with, for output positions
    first .. first + count - 1: its row keys there, hashed into a stream apart from the target's."""
    return hash32_reference(row_keys(np.full(count, seed, dtype=np.int64), np.arange(first, first + count)) ^ _DRAFT_SALT)


def kept_drafts(drawn: list[int], drafts: list[int]) -> int:
    """How many of `drafts` (d1..dk) the draws at their positions (x0..xk) keep: the longest run
    with x(i-1) == d(i)."""
    for i, d in enumerate(drafts):
        if drawn[i] != d:
            return i
    return len(drafts)


@dataclass(slots=True)
class SpecCounters:
    """Speculation since start, under vLLM's metric names (spec_decode_num_drafts, ...)."""
    num_positions: int
    drafts: int = 0
    """Steps of a request that checked drafts."""
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """Drafts kept at each draft position (1st, 2nd, ...)."""

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_positions

    def record(self, checked: int, kept: int) -> None:
        self.drafts += 1
        self.draft_tokens += checked
        self.accepted_tokens += kept
        for i in range(min(kept, self.num_positions)):
            self.accepted_per_pos[i] += 1
