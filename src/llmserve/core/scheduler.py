"""Scheduling policy: who runs next step, and how many tokens each gets.

Plain synchronous code: no event loop, no blocks, no device. The KV manager decides what fits.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import operator
import time
from array import array
from dataclasses import dataclass, field
from enum import IntEnum

from llmserve.messages import (PLACEHOLDER, Admission, EngineOutputs, NewRequest, ScheduledRequest,
                               SequenceUpdate, StepFeedback, StepProposal, StepResult)
from llmserve.sampling_params import SamplingParams
from llmserve.speculative import Acceptance, SpecControl, SpecCounters, Speculation


_PLACEHOLDER = array("q", [PLACEHOLDER])  # times the tokens in flight
_policy_key = operator.attrgetter("key")
MAX_TENTATIVE = 128
"""New requests a step proposes past its spent budget at most (see Scheduler.schedule)."""


class RequestStatus(IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is final."""
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5


@dataclass(slots=True, eq=False)
class Request:
    req_id: str
    num_tokens: int
    """Prompt and sampled tokens known here."""
    unsent: array
    """Known tokens the KV manager has not been sent yet (int64: a buffer the garbage collector does
    not scan): the prompt until the first proposal, then the tokens sampled since the last one. The
    KV manager keeps every token it was sent, across preemption too, so none is sent twice."""
    prompt_len: int
    params: SamplingParams
    key: tuple[int, float, int]
    """Policy order: (priority, arrival, sequence number); smaller runs first."""
    end: int
    """num_tokens at which it ends by length (max_tokens, max_model_len)."""
    status: RequestStatus = RequestStatus.WAITING
    num_computed: int = 0
    pending: int = 0
    """Tokens sampled by steps in flight, not yet known here."""
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    queue_time_s: float | None = None
    group: str | None = None
    held_prompt_logprobs: list = field(default_factory=list)
    prompt_logprobs_had: int = 0
    """Prompt positions whose logprobs came (a preempted request computes them again: not twice)."""
    prepared: dict = field(default_factory=dict)
    retract: int = 0
    """Computed tokens the KV manager is to take back with the next proposal (jump-forward
    replaced a token a step had already computed, or the drafts a step rejected)."""
    drafts: list[int] | None = None
    """Tokens proposed to follow its last one, to check in its next step (speculative decoding)."""
    checking: int = 0
    """Drafts the step in flight checks for it."""
    proposing: bool = False
    """Drafts are to be proposed for it once the step in flight has finished."""
    missed: bool = False
    """Its last step asked for proposals and none came (speculative decoding)."""
    acceptance: Acceptance | None = None
    """How often its drafts are kept (from its first check on): how many it is given."""

    @property
    def num_output(self) -> int:
        return self.num_tokens - self.prompt_len


ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""Upper bounds of the tokens-per-step histogram (vLLM's iteration_tokens_total)."""


class Scheduler:
    def __init__(self, *, max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int,
                 policy: str = "fcfs", eos_token_ids: frozenset[int] = frozenset(),
                 enable_prefix_caching: bool = True, speculation: Speculation | None = None) -> None:
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.eos_token_ids = eos_token_ids
        self.enable_prefix_caching = enable_prefix_caching
        self.cache_hits = False
        """The latest admissions found cached prompt tokens: new requests past a spent budget may too."""
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by key
        self.running: list[Request] = []  # sorted by key
        self._to_free: list[str] = []
        self._seq = itertools.count()
        self._step = itertools.count()
        self.num_preemptions = 0
        self.prompt_tokens = 0  # prompt tokens computed (recomputation after preemption included)
        self.generation_tokens = 0  # tokens sampled or jumped
        self.jumped_tokens = 0  # tokens jump-forward appended beyond the sampled ones
        self.iteration_tokens = [0] * (len(ITERATION_TOKEN_BUCKETS) + 1)
        """Steps by the tokens they computed: a count per bucket of ITERATION_TOKEN_BUCKETS (a step
        counts in the first bucket at or above it), then those above the last."""
        self.iteration_tokens_sum = 0
        self.speculation = speculation
        self.spec = SpecCounters(speculation.num_tokens if speculation else 0)
        self.spec_control = SpecControl(speculation.num_tokens if speculation else 0)

    # ---- requests in and out -------------------------------------------------------------------

    def add(self, new: NewRequest) -> None:
        priority = new.priority if self.policy == "priority" else 0
        prompt = array("q", new.prompt_token_ids)
        end = self.max_model_len if new.params.max_tokens is None else \
            min(self.max_model_len, len(prompt) + new.params.max_tokens)
        req = Request(new.req_id, len(prompt), prompt, len(prompt), new.params,
                      (priority, new.arrival, next(self._seq)), end, group=new.group, prepared=new.prepared)
        self.requests[req.req_id] = req
        bisect.insort(self.waiting, req, key=_policy_key)

    def finish(self, req_ids: list[str], status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        """End requests from outside (abort, stop string); their blocks are freed next step."""
        for req_id in req_ids:
            req = self.requests.pop(req_id, None)
            if req is None:
                continue
            (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
            req.status = status
            self._to_free.append(req_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._to_free)

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> StepProposal:
        """Propose the next step.

        Walk running and waiting requests together in policy order (FCFS: arrival; priority: the
        request's priority, then arrival). Each gets min(tokens it still lacks, budget left) from
        the step's token budget: 1 for a decoding request, a chunk of its prompt for one being
        prefilled, so decodes and prefill chunks share one batch. A waiting request also needs a
        free seat under max_num_seqs. Stop when the budget is spent. The KV manager then admits,
        shrinks (prefix-cache hits) or preempts entries from the tail of this order to fit the pool.

        A new request is charged its whole uncomputed prompt here, but the prefix cache may hold
        most of it (a shared system prompt or document): so past the spent budget, up to
        MAX_TENTATIVE more new requests that may use the cache are proposed as tentative, charged
        nothing, and the KV manager admits them only with the budget the hits before them left
        (else they stay waiting); only while the latest admissions found cached tokens (a workload
        without shared prompts proposes none). Without that, requests behind a long cached prefix
        would be admitted a budget's worth of prompt at a time, two or three a step.

        With a step in flight (async scheduling), a request whose token is still being sampled is
        scheduled on a PLACEHOLDER for it, unless that token will be its last (max_tokens or
        max_model_len); a request with tokens in flight is not (re)admitted until they arrive.

        Speculative decoding, while its controller says it pays and in steps of at most
        disable_by_batch_size requests: a request with drafts gets them as extra tokens to compute,
        from the budget the step left, within what it may still produce, and proposals are asked
        for after the step. Drafts follow a request's last token, known only once its step has
        finished: so meanwhile the next step is not planned (`must_wait`).
        """
        budget = self.max_num_batched_tokens
        seats = self.max_num_seqs - len(self.running)
        tentative = MAX_TENTATIVE if self.cache_hits else 0
        entries: list[ScheduledRequest] = []
        running = RequestStatus.RUNNING
        queue = heapq.merge(self.running, self.waiting, key=_policy_key) if self.waiting else self.running
        for req in queue:
            admitting = req.status != running
            if budget == 0:  # only new requests go on, tentatively
                if not seats or not tentative:
                    break
                if not admitting:
                    continue
            if admitting:
                if seats == 0 or req.pending:
                    continue
            elif req.pending and req.num_tokens + req.pending >= req.end:  # its token in flight is its last
                continue
            admission = None
            if admitting:
                # Siblings of an n > 1 request share prompt blocks even with prefix caching off,
                # through a cache scoped to their group.
                shared = self.enable_prefix_caching or req.group is not None
                use_cache = shared and req.params.prompt_logprobs is None
                salt = None if self.enable_prefix_caching else req.group
                admission = Admission(req.prompt_len, req.params, use_cache, salt, req.prepared)
                if budget == 0 and not use_cache:  # (nothing it could find cached would leave budget)
                    continue
                seats -= 1
            lacking = req.num_tokens + req.pending - req.num_computed
            n = min(lacking, budget) if budget else lacking
            new_tokens = req.unsent
            if req.pending:
                new_tokens.extend(_PLACEHOLDER * req.pending)
            entries.append(ScheduledRequest(req.req_id, n, new_tokens, req.key, admission,
                                            0 if admitting else req.retract, tentative=budget == 0))
            req.unsent = array("q")
            req.retract = 0
            if budget:
                budget -= n
            else:
                tentative -= 1
        step_id = next(self._step)
        if self.speculation is not None:
            control = self.spec_control
            small = len(entries) <= self.speculation.max_batch
            if small and control.active:
                for entry in entries:  # drafts take what the budget has left
                    budget = self._speculate(self.requests[entry.req_id], entry, budget, len(entries))
            else:
                for entry in entries:  # its next token comes without them: they would no longer follow it
                    self.requests[entry.req_id].drafts = None
                if small and control.probe_due:
                    self._probe(entries, step_id)
            control.planned()
        freed, self._to_free = self._to_free, []
        return StepProposal(step_id, entries, freed, self.max_num_batched_tokens)

    # ---- speculative decoding ------------------------------------------------------------------

    def _speculate(self, req: Request, entry: ScheduledRequest, budget: int, batch: int) -> int:
        """Give a request's entry its drafts to check, and ask for proposals after it (as many as
        its Acceptance finds worth checking in a step of `batch` requests); returns the budget
        left. Only for a request with nothing in flight: its step's result is then the next one it
        gets, and carries what this step asked for."""
        if req.pending or not self.speculation.serves(req.params, req.prepared):
            req.drafts = None
            return budget
        room = self._room(req) - 1  # the step's own token comes first
        drafts, req.drafts = req.drafts, None
        if drafts and entry.num_tokens == 1:  # (not a prompt chunk)
            k = min(len(drafts), room, budget)
            if k > 0:
                entry.new_token_ids.extend(drafts[:k])
                entry.num_tokens += k
                entry.drafts = req.checking = k
                room -= k
                budget -= k
        if room > 0:
            most = self.speculation.num_tokens
            if req.acceptance is not None:
                most = req.acceptance.limit(most, batch, self.speculation.max_batch)
            entry.propose = min(room, most)
            req.proposing = True
        return budget

    def _probe(self, entries: list[ScheduledRequest], step_id: int) -> None:
        """Ask for proposals after this step for every request that may speculate, only to learn
        whether any would be found (SpecControl): the step overlaps as usual, its drafts unused."""
        for entry in entries:
            req = self.requests[entry.req_id]
            if self.speculation.serves(req.params, req.prepared) and self._room(req) > 1:
                entry.propose = self.speculation.num_tokens
        self.spec_control.probe_sent(step_id)

    def _room(self, req: Request) -> int:
        """Tokens it may still produce (max_tokens, max_model_len)."""
        return req.end - req.num_tokens

    def must_wait(self) -> bool:
        """The next step cannot be planned before the one in flight finishes: some request of it
        checks drafts or is to get proposals, or speculation is to start again and a request that
        may speculate has a token in flight (it needs its last token for proposals)."""
        s = self.speculation
        if s is None:
            return False
        if self.spec_control.active and len(self.running) <= s.max_batch:
            return any(req.pending and s.serves(req.params, req.prepared) for req in self.running)
        return any(req.pending and (req.checking or req.proposing) for req in self.running)

    def _followed(self, req: Request, tokens: list[int], proposed: list[int] | None) -> tuple[bool, int]:
        """Book a request's step under speculation: the drafts it checked (`tokens`: those it kept,
        then the token after them) and those proposed to follow. Returns whether the step counts
        for SpecControl, and the drafts it kept. It counts where it checked drafts, or where it
        waited for proposals that did not come (a synchronous step for nothing); not where it only
        asked for its first proposals, which the next step checks."""
        k, asked, req.checking, req.proposing = req.checking, req.proposing, 0, False
        kept = len(tokens) - 1 if k else 0
        if k:
            self.spec.record(k, kept)
            if req.acceptance is None:
                req.acceptance = Acceptance()
            req.acceptance.record(k, kept)
            if kept < k:  # the rejected drafts' slots are computed again
                req.num_computed -= k - kept
                req.retract += k - kept
        counted = k > 0 or req.missed
        req.missed = asked and not proposed
        req.drafts = proposed or None
        return counted, kept

    def on_feedback(self, fb: StepFeedback) -> EngineOutputs:
        """Follow what the KV manager did with the proposal; the requests it failed end here."""
        if tokens := sum(n for _, n, _ in fb.scheduled.values()):
            self.iteration_tokens[bisect.bisect_left(ITERATION_TOKEN_BUCKETS, tokens)] += 1
            self.iteration_tokens_sum += tokens
        if fb.cached_tokens:
            self.cache_hits = any(fb.cached_tokens.values())
        for req_id, (before, n, samples) in fb.scheduled.items():
            req = self.requests.get(req_id)
            if req is None:
                continue
            req.num_computed = before + n
            req.pending += samples
            self.prompt_tokens += max(0, min(before + n, req.prompt_len) - before)
            if req.status != RequestStatus.RUNNING:
                self.waiting.remove(req)
                req.status = RequestStatus.RUNNING
                bisect.insort(self.running, req, key=_policy_key)
                if req.num_preemptions == 0:
                    req.num_cached_tokens = fb.cached_tokens.get(req_id, 0)
                    req.queue_time_s = time.monotonic() - req.key[1]
        for req_id in fb.preempted:
            req = self.requests.get(req_id)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                bisect.insort(self.waiting, req, key=_policy_key)
            req.status = RequestStatus.PREEMPTED
            req.num_computed = 0
            req.checking, req.proposing, req.drafts, req.missed = 0, False, None, False  # the KV manager dropped the drafts
            req.num_preemptions += 1
            self.num_preemptions += 1
        return self.fail(fb.failed)

    def fail(self, errors: dict[str, str]) -> EngineOutputs:
        """End requests the engine could not serve, each with its error, and report them all (also
        those this scheduler never took in: their callers wait for an answer too)."""
        self.finish([r for r in errors if r in self.requests])
        return EngineOutputs([SequenceUpdate(r, [], "abort", error=error) for r, error in errors.items()])

    def on_result(self, result: StepResult) -> EngineOutputs:
        """Append sampled tokens, apply token-level stop conditions, and report to the request actor."""
        updates = self.fail(result.failed).updates if result.failed else []
        for req_id, (start, prompt_lps) in result.prompt_logprobs.items():
            req = self.requests.get(req_id)
            if req is not None and start + len(prompt_lps) > req.prompt_logprobs_had:
                req.held_prompt_logprobs.extend(prompt_lps[max(req.prompt_logprobs_had - start, 0):])
                req.prompt_logprobs_had = start + len(prompt_lps)
        probe = result.step_id == self.spec_control.probe_step
        if probe:
            self.spec_control.probed(len(result.drafts), sum(1 for d in result.drafts.values() if d))
        speculated = kept = 0  # requests of the step that proposed or checked drafts; drafts kept
        requests, eos = self.requests, self.eos_token_ids
        plain = not (result.logprobs or result.jumps or result.accepted or result.dropped_next)
        for req_id, token in zip(result.req_ids, result.token_ids):
            req = requests.get(req_id)
            if req is None:
                continue  # finished while the step ran: its token is discarded
            req.pending -= 1
            update = SequenceUpdate(req_id, [token], None, None, [], [], req.num_cached_tokens, req.queue_time_s)
            if req.held_prompt_logprobs:
                update.prompt_logprobs, req.held_prompt_logprobs = req.held_prompt_logprobs, []
            if plain and not (req.checking or req.proposing):  # one sampled token: the common case
                req.missed = False
                req.num_tokens += 1
                req.unsent.append(token)
                self.generation_tokens += 1
                if token in eos or token in req.params.stop_token_ids or req.num_tokens >= req.end:
                    self._check_stop(req, token, update)
                updates.append(update)
                continue
            update.new_token_ids = []
            if req_id in result.logprobs:
                update.logprobs += result.logprobs[req_id]
            # speculation: the drafts kept and the token after them; jump-forward: the tokens that
            # replace that last token; each counted and checked
            jumped = result.jumps.get(req_id) if result.jumps else None
            tokens = (token,)
            if req.checking or req.proposing:
                tokens = result.accepted.get(req_id, tokens)
                counted, n = self._followed(req, tokens, result.drafts.get(req_id))
                speculated += counted
                kept += n
            else:
                req.missed = False
            if jumped is not None:
                self.jumped_tokens += len(jumped) - 1
                tokens = [*tokens[:-1], *jumped]
            if req_id in result.dropped_next:  # the step after this one samples nothing for it
                req.pending -= 1
                if tokens[0] != token:  # and the token it computed is replaced: taken back
                    req.num_computed -= 1
                    req.retract += 1
            for t in tokens:
                req.num_tokens += 1
                req.unsent.append(t)
                self.generation_tokens += 1
                update.new_token_ids.append(t)
                if self._check_stop(req, t, update):
                    break
            updates.append(update)
        if speculated:
            self.spec_control.record(speculated, kept, result.propose_cost, result.interval, len(result.req_ids))
        elif not probe:  # (a probe's step also proposed)
            self.spec_control.plain(result.interval, len(result.req_ids))
        return EngineOutputs(updates)

    def _check_stop(self, req: Request, token: int, update: SequenceUpdate) -> bool:
        """Whether `token` ends the request (then it is finished, and `update` says why): only if it
        is an end-of-sequence or stop token, or the request reached its length."""
        p = req.params
        past_min = req.num_output >= p.min_tokens
        if past_min and not p.ignore_eos and token in self.eos_token_ids:
            status, update.finish_reason = RequestStatus.FINISHED_STOPPED, "stop"
        elif past_min and token in p.stop_token_ids:
            status, update.finish_reason, update.stop_reason = RequestStatus.FINISHED_STOPPED, "stop", token
        elif req.num_tokens >= req.end:
            status, update.finish_reason = RequestStatus.FINISHED_LENGTH, "length"
        else:
            return False
        self.finish([req.req_id], status)
        return True

    # ---- statistics ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)
