"""The runner's side of speculative decoding (llmserve/speculative.py has the proposers and the
controller): proposals made once a step's tokens are known, the proposer's own distributions kept
for the drafts it drew until the step that checks them, and where a checking step samples.

A request checking k drafts samples at its last k + 1 positions: the k drafts' positions and the
one before them. Greedy rows and fixed proposals keep a draft while the target's own draw equals
it (kept_drafts); drafts drawn from a distribution q are checked against it by rejection sampling
(the backend's check_drafts: kernels/rejection.py on CUDA), which is exact in distribution. Under
tensor parallelism only rank 0 proposes, and only fixed proposals: the other ranks could not check
a q they never saw.
"""

from __future__ import annotations

import time

import numpy as np
import structlog
import torch

from llmserve.distributed.parallel_state import tp
from llmserve.messages import StepResult
from llmserve.model.sampler import SamplingBatch
from llmserve.model.sampling_state import SeqState
from llmserve.model.step_inputs import Staging
from llmserve.speculative import Proposer, draft_keys, draws_drafts, kept_drafts

log = structlog.get_logger("llmserve.runner")


class Drafting:
    """A runner's proposer, the distributions of the drafts it drew (per request, until checked),
    and a running mean of the time between finished steps (what a proposal's cost is measured
    against)."""

    def __init__(self, proposer: Proposer | None, vocab_size: int) -> None:
        self.proposer = proposer
        self.vocab_size = vocab_size
        self.draft_probs: dict[str, tuple[list[int], torch.Tensor]] = {}
        """Requests whose last proposals were drawn from a distribution: (the drafts, their q rows),
        until the request's next step (the one that checks them)."""
        # running mean of the seconds from the end of one finished step (its proposals made) to the
        # next one's result: a step's time without proposing
        self._period: float | None = None
        self._finished_at = 0.0
        self._result_at = 0.0

    def forget(self, freed: list[str]) -> None:
        """Requests that ended: their kept distributions and the proposer's state of them go."""
        for req_id in freed:
            self.draft_probs.pop(req_id, None)
        if freed and hasattr(self.proposer, "forget"):
            self.proposer.forget(freed)

    def observe(self, req_ids: list[str], starts: np.ndarray, query_start_loc: np.ndarray,
                hidden: torch.Tensor) -> None:
        """Hand a step's final hidden states to a proposer that reads them (Proposer.observe), as
        soon as its forward pass is queued. A proposer that fails here is logged and goes on: its
        proposals are only ever proposals."""
        observe = getattr(self.proposer, "observe", None)
        if observe is None:
            return
        try:
            observe(req_ids, starts, query_start_loc, hidden[:int(query_start_loc[-1])])
        except Exception:
            log.exception("proposer failed to observe a step's hidden states", request_ids=req_ids[:8])

    def checked_against(self, req_ids: list[str], drafts: list[list[int]] | None) -> list[torch.Tensor | None] | None:
        """Per request of a step (in order), the q rows its drafts were drawn from, or None for a
        fixed proposal; None if none was drawn. Each request's kept distribution is used up here."""
        if not self.draft_probs:
            return None
        proposed = [self.draft_probs.pop(r, None) for r in req_ids]
        if drafts is None:
            return None
        return [_drawn_from(d, entry) for d, entry in zip(drafts, proposed)]

    def finished(self, result: StepResult, limits: dict[str, int], seqs: dict[str, SeqState]) -> None:
        """A step's result is known: propose for the requests it asked for (`limits`), and report
        what proposing cost against the step's period (result.propose_cost) and the time since the
        step before's result (result.interval)."""
        if self.proposer is None:
            return
        now = time.perf_counter()
        if 0 < (dt := now - self._finished_at) < 0.5:  # (longer: the engine was idle, not stepping)
            self._period = dt if self._period is None else self._period + 0.1 * (dt - self._period)
        if 0 < (dt := now - self._result_at) < 0.5:
            result.interval = dt
        self._result_at = now
        if limits:
            self._propose(result, limits, seqs)
            took = time.perf_counter() - now
            if self._period is not None:  # (the first step's cost is not known: none reported)
                result.propose_cost = took / self._period
        self._finished_at = time.perf_counter()

    def _propose(self, result: StepResult, limits: dict[str, int], seqs: dict[str, SeqState]) -> None:
        """Drafts for the requests of the step that asked (speculative decoding), now that their
        tokens are known (the scheduler uses them where no step launched meanwhile computes the
        request: otherwise they only tell it that proposals would be found). A proposer that fails
        proposes nothing; drafts past a request's limit or from the first id outside the
        vocabulary on are dropped."""
        asked = [r for r in result.req_ids if r in limits and r not in result.failed]
        if not asked:
            return
        states = [seqs[r] for r in asked]
        sequences, wanted = [(s.prompt_ids, s.output_ids) for s in states], [limits[r] for r in asked]
        probs = None
        try:
            # draws from the proposer's distribution: one rank alone proposes, and the others
            # could not check against a distribution they never saw
            sampled = [draws_drafts(s.params) for s in states] if tp().size == 1 else []
            if any(sampled) and hasattr(self.proposer, "propose_sampled"):
                temperatures = [s.params.temperature if on else 0.0 for s, on in zip(states, sampled)]
                keys = [draft_keys(s.seed, len(s.output_ids), n) if on else None
                        for s, n, on in zip(states, wanted, sampled)]
                proposed, probs = self.proposer.propose_sampled(asked, sequences, wanted, temperatures, keys)
            else:
                proposed = self.proposer.propose(asked, sequences, wanted)
            proposed = [[int(t) for t in drafts[:limits[r]]] for r, drafts in zip(asked, proposed, strict=True)]
        except Exception:
            log.exception("proposer failed; these requests go on without drafts", request_ids=asked[:8])
            proposed, probs = [[] for _ in asked], None
        for i, (req_id, drafts) in enumerate(zip(asked, proposed)):
            bad = next((j for j, t in enumerate(drafts) if not 0 <= t < self.vocab_size), None)
            result.drafts[req_id] = drafts = drafts if bad is None else drafts[:bad]
            if probs is not None and probs[i] is not None and drafts:
                self.draft_probs[req_id] = (drafts, probs[i])


def check_drawn_drafts(processed: torch.Tensor, batch: SamplingBatch, tokens: torch.Tensor, offsets: list[int],
                       drafts: list[list[int]], draft_probs: list[torch.Tensor | None], staging: Staging,
                       check_drafts) -> None:
    """The rows that check drafts drawn from a distribution take the rejection sampler's token
    (the backend's check_drafts) in place of the plain draw; the rows after a request's drafts
    keep theirs, so kept drafts are counted as for any proposal."""
    rows, flat, qs = [], [], []
    for offset, d, q in zip(offsets, drafts, draft_probs):
        if q is not None:
            rows += range(offset, offset + len(d))
            flat += d
            qs.append(q)
    staged = staging.to_device(np.array(rows + flat, dtype=np.int64))  # one copy: the rows, then their drafts
    index = staged[:len(rows)]
    q = qs[0] if len(qs) == 1 else torch.cat(qs)
    tokens[index] = check_drafts(processed[index], batch.temperature[index], batch.keys[index], staged[len(rows):], q)


def keep_confirmed(result: StepResult, drawn: list[int], offsets: list[int], drafts: list[list[int]]) -> None:
    """A checking step's tokens: each request keeps the drafts its draws confirm, then the draw
    after them (result.accepted: all of them; result.token_ids: the first), from its rows at
    offsets[i] onward of `drawn`."""
    result.token_ids = []
    for req_id, offset, checked in zip(result.req_ids, offsets, drafts):
        if checked:
            tokens = drawn[offset:offset + kept_drafts(drawn[offset:], checked) + 1]
            result.accepted[req_id] = tokens
            result.token_ids.append(tokens[0])
        else:
            result.token_ids.append(drawn[offset])


def _drawn_from(drafts: list[int], proposed: tuple[list[int], torch.Tensor] | None) -> torch.Tensor | None:
    """The q rows of `drafts` where they are (a prefix of) drafts a proposer drew, else None."""
    if not drafts or proposed is None or proposed[0][:len(drafts)] != drafts:
        return None
    return proposed[1][:len(drafts)]


def spread(ends: np.ndarray, ks: np.ndarray) -> np.ndarray:
    """The positions ends[i] - ks[i] .. ends[i] of each i, in order (int64): where a request
    checking ks[i] drafts, its last position ends[i], samples."""
    counts = ks + 1
    first = np.repeat(ends - ks, counts)
    return first + np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
