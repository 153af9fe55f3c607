"""Messages between the actors: small, explicit, one per step per hop.

    request actor --NewRequests / FinishRequests--> scheduler --StepProposal--> KV manager
    KV manager --StepPlan--> executor                 KV manager --StepFeedback--> scheduler
    executor --StepResult--> scheduler --EngineOutputs--> request actor

No message carries another actor's internal objects: ids, token lists, arrays and parameters only.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmserve.sampling_params import SamplingParams


PLACEHOLDER = -1
"""Stands for a token still being sampled by the step in flight; the executor fills it in."""


# ---- request actor -> scheduler -------------------------------------------------------------

@dataclass(slots=True)
class NewRequest:
    req_id: str
    prompt_token_ids: array
    """int64, the engine's copy of the prompt (the scheduler copies it again per request)."""
    params: SamplingParams
    """Per-sample parameters (n == 1); `seed` None: unseeded (the executor derives the sample's
    random stream from the engine's seed and its id)."""
    priority: int = 0
    arrival: float = 0.0
    group: str | None = None
    """The parent request of one of n > 1 samples: siblings share prompt blocks."""
    prepared: dict[str, Any] = field(default_factory=dict)
    """Decoding strategy name -> what it prepared for this request (llmserve/decoding.py)."""


@dataclass(slots=True)
class NewRequests:
    """Requests admitted together (a slice of an offline batch holding two steps' prompt tokens,
    the n samples of one request): the scheduler takes them all before it plans, so a batch's
    first steps are as full as their budget allows."""
    requests: list[NewRequest]


@dataclass(slots=True)
class FinishRequests:
    """Requests the request actor ended: client abort, or a stop string found in the text."""
    req_ids: list[str]
    reason: str  # "abort" | "stop"


# ---- scheduler -> KV manager ----------------------------------------------------------------

@dataclass(slots=True)
class ScheduledRequest:
    req_id: str
    num_tokens: int
    """Tokens the scheduler wants computed this step; a prefix-cache hit may shrink it."""
    new_token_ids: array
    """(int64) Tokens the KV manager has not been sent yet: the prompt in the request's first proposal,
    then those sampled since (a re-admitted request's earlier tokens are kept there); replaces a
    trailing PLACEHOLDER the KV manager holds, and may end in a new one."""
    priority_key: tuple[int, float, int]
    admitted: "Admission | None" = None
    """Set when the request (re)enters the running set this step."""
    retract: int = 0
    """Tokens at the end of those computed to take back first: a token jump-forward replaced after
    a step had computed it (the KV manager's trailing PLACEHOLDER), or the drafts the last step
    rejected. Never in a hashed block."""
    drafts: int = 0
    """The last `drafts` of new_token_ids are proposed, not known (speculative decoding): this step
    computes them to check them; the KV manager drops them when the request's next tokens come."""
    propose: int = 0
    """Most drafts to propose for the request once this step's token is known (0: none)."""
    tentative: bool = False
    """A new request proposed after the step's budget was spent, charged nothing: admitted only
    with the budget that prefix-cache hits of the entries before it leave (StepProposal.token_budget)."""


@dataclass(slots=True)
class Admission:
    prompt_len: int
    params: SamplingParams
    use_prefix_cache: bool
    cache_salt: str | None = None
    """Scopes prefix-cache sharing to requests with the same salt (siblings when caching is off)."""
    prepared: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StepProposal:
    step_id: int
    entries: list[ScheduledRequest]
    """In policy order: earlier entries have higher priority; preemption takes from the tail."""
    freed: list[str] = field(default_factory=list)
    """Finished or aborted requests whose blocks go back to the pool."""
    token_budget: int = 0
    """Tokens the step may compute in all (the tentative entries' limit)."""


# ---- KV manager -> executor -----------------------------------------------------------------

@dataclass(slots=True)
class NewSequence:
    """What the executor needs to sample for a request it has not seen (or that resumed)."""
    params: SamplingParams
    prompt_token_ids: array
    output_token_ids: array
    """int64, slices of the KV manager's copy."""
    prepared: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class PrefixGroups:
    """Running requests whose block tables begin with the same blocks (for cascade attention,
    kernels/cascade.py). Group g is the plan rows members[starts[g]:starts[g + 1]] (two or more),
    which share the keys [lo[g], hi[g]) (whole blocks, all in every member's context before the
    step). level[g] 0: lo is 0; level 1: the group lies inside a level-0 group whose hi is its lo."""
    starts: np.ndarray
    """int32 [G + 1]"""
    members: np.ndarray
    """int32 [M]"""
    lo: np.ndarray
    """int32 [G], tokens"""
    hi: np.ndarray
    """int32 [G], tokens"""
    level: np.ndarray
    """int32 [G]"""

    @property
    def num_groups(self) -> int:
        return len(self.lo)

    def only(self, keep: np.ndarray) -> PrefixGroups | None:
        """These groups with their members limited to the plan rows where `keep` (bool [rows]) is
        set; groups left with fewer than two are dropped (a level-1 group's members lie in its
        level-0 group's, so it never outlives that group). None if no group is left."""
        kept = keep[self.members]
        sizes = np.add.reduceat(kept.astype(np.int32), self.starts[:-1]) if len(self.lo) else np.zeros(0, np.int32)
        alive = sizes >= 2
        if not alive.any():
            return None
        member_alive = np.repeat(alive, np.diff(self.starts)) & kept
        starts = np.zeros(int(alive.sum()) + 1, dtype=np.int32)
        np.cumsum(sizes[alive], out=starts[1:])
        return PrefixGroups(starts, self.members[member_alive], self.lo[alive], self.hi[alive], self.level[alive])


@dataclass(slots=True)
class StepPlan:
    step_id: int
    req_ids: list[str]
    token_ids: np.ndarray
    """int64 [num_tokens]: the batch's tokens, request after request."""
    query_lens: np.ndarray
    """int32 [num_reqs]: tokens computed this step per request."""
    context_lens: np.ndarray
    """int32 [num_reqs]: tokens already in the KV cache per request before this step."""
    block_tables: np.ndarray
    """int32 [num_reqs, max_blocks]: KV block ids per request, padded with 0."""
    sample: np.ndarray
    """bool [num_reqs]: the request's last token this step is the last known one, so it samples."""
    new_sequences: dict[str, NewSequence] = field(default_factory=dict)
    freed: list[str] = field(default_factory=list)
    """Requests the executor can forget."""
    drafts: dict[str, int] = field(default_factory=dict)
    """Requests whose last tokens this step are drafts to check, and how many (speculative decoding):
    they sample at each of their last drafts + 1 positions."""
    propose: dict[str, int] = field(default_factory=dict)
    """Requests to propose drafts for once this step's token is known, and at most how many."""
    prefix_groups: PrefixGroups | None = None
    """Rows sharing a prefix of blocks (None: not looked for)."""

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @classmethod
    def empty(cls, step_id: int, freed: list[str]) -> StepPlan:
        """A step that computes nothing (it still tells the executor what to forget)."""
        return cls(step_id, [], np.empty(0, np.int64), np.empty(0, np.int32), np.empty(0, np.int32),
                   np.zeros((0, 1), np.int32), np.empty(0, bool), freed=list(freed))

    def subset(self, rows: np.ndarray) -> StepPlan:
        """The step for the requests at `rows` (sorted plan indices) alone: their tokens, lengths,
        block tables and new sequences; every freed request (forgetting twice is harmless)."""
        starts = np.zeros(len(self.req_ids) + 1, dtype=np.int64)
        np.cumsum(self.query_lens, out=starts[1:])
        req_ids = [self.req_ids[r] for r in rows.tolist()]
        tokens = np.concatenate([self.token_ids[starts[r]:starts[r + 1]] for r in rows.tolist()] or
                                [np.empty(0, np.int64)])
        return StepPlan(self.step_id, req_ids, tokens, self.query_lens[rows], self.context_lens[rows],
                        self.block_tables[rows], self.sample[rows],
                        {r: self.new_sequences[r] for r in req_ids if r in self.new_sequences}, list(self.freed),
                        {r: self.drafts[r] for r in req_ids if r in self.drafts},
                        {r: self.propose[r] for r in req_ids if r in self.propose})


# ---- KV manager -> scheduler ----------------------------------------------------------------

@dataclass(slots=True)
class StepFeedback:
    step_id: int
    scheduled: dict[str, tuple[int, int, bool]]
    """req_id -> (num_computed before the step, tokens computed this step, samples a token)."""
    preempted: list[str]
    """Requests whose blocks were taken back; they restart from their tokens (recompute)."""
    not_admitted: list[str]
    """Waiting requests that did not fit this step; they stay waiting."""
    cached_tokens: dict[str, int]
    """Admitted requests -> tokens served from the prefix cache."""
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    failed: dict[str, str] = field(default_factory=dict)
    """Requests of the proposal the KV manager could not place, by error: they end with it."""


# ---- executor -> scheduler ------------------------------------------------------------------

@dataclass(slots=True)
class TokenLogprobs:
    """Log-probabilities at one position: the chosen token's and the top-k."""
    token_id: int
    logprob: float
    rank: int
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class FinishInFlight:
    """Scheduler -> KV manager -> executor: no plan follows until results arrive, so finish the step
    in flight now instead of waiting for the next plan to launch first."""


@dataclass(slots=True)
class StepResult:
    step_id: int
    req_ids: list[str]
    """Requests that sampled this step, in plan order."""
    token_ids: list[int]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """req_id -> the logprobs of each token it produced this step (one; with drafts kept, one per
    token), for the requests that asked for them."""
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    """req_id -> (the first position, one entry per prompt position computed this step that has a
    next prompt token): a preempted request computes its prompt again, from position 0."""
    failed: dict[str, str] = field(default_factory=dict)
    """Requests the step could not compute or sample, by error: they end with it (the others of
    the step carry on)."""
    jumps: dict[str, list[int]] = field(default_factory=dict)
    """Requests whose constraint forced what follows their sampled token (jump-forward): the
    tokens that replace it (llmserve/decoding.py)."""
    accepted: dict[str, list[int]] = field(default_factory=dict)
    """Requests that checked drafts this step: the tokens each produced, the drafts it kept and the
    token sampled after them (the first is its entry in token_ids); its other drafts were rejected."""
    drafts: dict[str, list[int]] = field(default_factory=dict)
    """Tokens proposed to follow each request's last one (speculative decoding; empty: none found)."""
    propose_cost: float = 0.0
    """The proposer's time for these drafts, in steps: over the executor's running mean of the
    time from one finished step's end (its proposals made) to the next step's result."""
    interval: float = 0.0
    """Seconds from the executor's previous step result to this one (0: not measured, or the engine
    was idle between them): with speculation, what the controller weighs its steps' cost by."""
    dropped_next: set[str] = field(default_factory=set)
    """Of `jumps`, those whose next step was launched before this one finished, with the sampled
    token as its input: they sample nothing there, and where the jump replaced that token, its
    computation is taken back (ScheduledRequest.retract)."""


# ---- scheduler -> request actor -------------------------------------------------------------

@dataclass(slots=True)
class SequenceUpdate:
    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    num_cached_tokens: int = 0
    queue_time_s: float | None = None
    """Seconds from arrival to first being scheduled."""
    error: str | None = None
    """The step that should have produced this token failed; the sequence is ended."""

    def __reduce__(self):
        # One per running request per step crosses to the server process: positional fields pickle
        # in under half the time of the default slots state.
        return SequenceUpdate, (self.req_id, self.new_token_ids, self.finish_reason, self.stop_reason, self.logprobs,
                                self.prompt_logprobs, self.num_cached_tokens, self.queue_time_s, self.error)


@dataclass(slots=True)
class EngineOutputs:
    updates: list[SequenceUpdate]
