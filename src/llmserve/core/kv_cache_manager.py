"""KV-cache manager: block tables, prefix-cache lookups, and fitting a step proposal into the pool.

A request's blocks cover its tokens in order; block i holds positions [i*B, (i+1)*B):

    tokens      | t0 .. t15 | t16 .. t31 | t32 .. t40 ___ |
    block_ids   |    b7     |    b2      |      b9        |   (B = 16)
                 full, hashed  full, hashed  partial: not in the prefix cache yet

A full block's hash chains its parent's hash with its own tokens, so equal hashes mean equal
prefixes. Blocks are hashed as soon as a step is planned to fill them: a later request in the same
step can already share them, since each layer writes the step's K/V before any attention reads.

Admission keeps room for growth (`reserve_growth`): a new request is admitted only if, once its
blocks are taken, the pool still holds the blocks the requests ahead of it (and itself) are
expected to take before they finish. A request may grow to its budget (prompt + max_tokens, at
most max_model_len), looked at no more than RESERVE_HORIZON tokens ahead; it is expected to use
the share of its budget that finished requests used (a running mean, 1 until one finishes). Without
it, a full cache is found out later, as preemption: the request recomputes its prompt.

Sliding windows (`window`: every layer attends to at most W latest keys): the leading blocks no
query of a request will read again go back to the pool as it advances (`_release_passed`), their
ids left in its table; hashed ones stay in the prefix cache. A request then holds about its
window's blocks however long it runs. Where only some layers are windowed (Gemma), the others read
every key and nothing is given back.

Plain synchronous code: no event loop, no device.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from llmserve.core.block_pool import BlockPool
from llmserve.messages import (PLACEHOLDER, NewSequence, PrefixGroups, ScheduledRequest, StepFeedback, StepPlan,
                               StepProposal)

_ROOT_HASH = 0x5EED_C0DE
RESERVE_HORIZON = 4096
"""Tokens ahead of a request's current length that admission reserves room for, at most."""
_SHARE_WEIGHT = 0.05
"""Weight of each finished request in the running mean of the budget share used."""
WAIT = -1
"""admit's answer when the request's blocks fit but the room for growth does not: it waits."""


MAX_PREFIX_GROUPS = 32
"""Groups a plan reports at most (the cascade kernel's graphs are captured for this many)."""


def chain_hash(parent: int, tokens: array) -> int:
    return hash((parent, tokens.tobytes()))


def find_prefix_groups(tables: np.ndarray, ctx_blocks: np.ndarray, block_size: int,
                       max_groups: int = MAX_PREFIX_GROUPS) -> PrefixGroups | None:
    """Rows of a step whose block tables begin with the same blocks, for cascade attention.

    tables [S, W] int32 (the plan's block tables), ctx_blocks [S]: each row's whole blocks before
    its first query (a shared prefix must end there: every query must lie past it). Level 0: rows
    grouped by their first block (equal block ids hold equal tokens: the prefix cache shares them),
    the group's prefix running to the first column where a member differs or its context ends.
    Level 1: inside each level-0 group, the members whose context goes on grouped the same way by
    the block after the prefix. Groups of one are no groups. The max_groups that save the most
    key reads (rows x prefix blocks) are kept, a level-1 group only with its level-0 group.
    One argsort, then numpy over each group's rows: no pass over blocks in Python."""
    found: list[tuple[int, int, int, int, np.ndarray]] = []  # (saved, level, lo, hi, rows)

    def runs(rows: np.ndarray, col: int):  # rows sharing their block at `col`, in runs of two or more
        keys = tables[rows, col]
        order = np.argsort(keys, kind="stable")
        rows, keys = rows[order], keys[order]
        edges = np.flatnonzero(np.diff(keys)) + 1
        lo, hi = np.concatenate([[0], edges]), np.concatenate([edges, [len(keys)]])
        for a, b in zip(lo[hi - lo > 1].tolist(), hi[hi - lo > 1].tolist()):
            yield rows[a:b]

    def common(rows: np.ndarray, col: int) -> int:  # the end of the blocks all rows share from col on
        end = int(ctx_blocks[rows].min())
        same = (tables[rows, col:end] == tables[rows[0], col:end]).all(0)
        return col + (int(np.argmin(same)) if not same.all() else len(same))

    for rows in runs(np.flatnonzero(ctx_blocks >= 1), 0):
        hi = common(rows, 0)
        found.append(((len(rows) - 1) * hi, 0, 0, hi, rows))
        deeper = rows[ctx_blocks[rows] > hi]
        if len(deeper) > 1:
            for sub in runs(deeper, hi):
                hi1 = common(sub, hi)
                found.append(((len(sub) - 1) * (hi1 - hi), 1, hi, hi1, sub))
    if not found:
        return None
    top = sorted((f for f in found if f[1] == 0), key=lambda f: -f[0])[:max_groups]
    kept_rows = np.zeros(len(tables), dtype=bool)
    for f in top:
        kept_rows[f[4]] = True
    # (a level-1 group's rows all lie in one level-0 group: its first row tells which)
    nested = sorted((f for f in found if f[1] == 1 and kept_rows[f[4][0]]), key=lambda f: -f[0])
    chosen = top + nested[:max_groups - len(top)]
    sizes = np.array([len(f[4]) for f in chosen], dtype=np.int32)
    starts = np.zeros(len(chosen) + 1, dtype=np.int32)
    np.cumsum(sizes, out=starts[1:])
    return PrefixGroups(starts, np.concatenate([f[4] for f in chosen]).astype(np.int32),
                        np.array([f[2] for f in chosen], dtype=np.int32) * block_size,
                        np.array([f[3] for f in chosen], dtype=np.int32) * block_size,
                        np.array([f[1] for f in chosen], dtype=np.int32))


@dataclass(slots=True, frozen=True)
class _KnownGroups:
    """The prefix groups of the last plan, and what keeps them valid (KVCacheManager._find_groups)."""
    req_ids: list[str]
    members: np.ndarray  # int32 [M]: the groups' rows
    ends: np.ndarray  # int32 [M]: each one's group's end, in blocks
    groups: PrefixGroups | None


@dataclass(slots=True, eq=False)
class KVRequest:
    req_id: str
    token_ids: array
    """int64, as the scheduler sends them; a PLACEHOLDER last while that token is being sampled."""
    priority_key: tuple
    use_prefix_cache: bool
    root_hash: int = _ROOT_HASH
    block_ids: array = field(default_factory=lambda: array("i"))
    """int32: the plan's block table is these buffers joined, with no pass over Python ints."""
    block_hashes: list[int] = field(default_factory=list)
    num_computed: int = 0
    prompt_len: int = 0
    max_len: int = 0
    """Tokens it may reach: prompt + max_tokens, at most max_model_len (0: unknown)."""
    num_drafts: int = 0
    """The last tokens of token_ids that are drafts being checked (speculative decoding): never
    hashed, dropped when the request's next tokens come (those kept come back among them)."""
    released: int = 0
    """Leading blocks given back because every layer's window has passed them (their ids stay in
    block_ids, where no kernel reads them again)."""
    last_start: int | None = None
    """The position the request's previous step's queries started at."""


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, *, max_model_len: int | None = None,
                 reserve_growth: bool = False, prefix_groups: bool = False, window: int = 0) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.window = window
        """Every layer attends to at most this many latest keys (0: some layer sees them all)."""
        self.max_model_len = max_model_len or num_blocks * block_size
        self.reserve_growth = reserve_growth
        self.prefix_groups = prefix_groups
        """Report the rows that share a prefix of blocks with each plan (for cascade attention)."""
        self._groups: _KnownGroups | None = None
        self.budget_share = 1.0
        """Running mean of the share of their budget (up to RESERVE_HORIZON tokens) finished requests used."""
        self.requests: dict[str, KVRequest] = {}
        self.parked: dict[str, array] = {}
        """Tokens of requests that hold no blocks (preempted, or left waiting): the scheduler sends a
        request's tokens once, and re-admitting it later sends only those sampled since."""
        self.released_blocks = 0  # blocks given back early: every layer's window had passed them
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, tokens found in the cache

    # ---- paired verbs ------------------------------------------------------------------------

    def find_cached_prefix(self, req: KVRequest) -> list[int]:
        """Block ids of the longest cached prefix, leaving at least the last token to compute."""
        if not req.use_prefix_cache:
            return []
        B = self.block_size
        hits: list[int] = []
        parent = req.root_hash
        for i in range((len(req.token_ids) - 1) // B):
            h = chain_hash(parent, req.token_ids[i * B:(i + 1) * B])
            block_id = self.pool.lookup(h)
            if block_id is None:
                break
            hits.append(block_id)
            req.block_hashes.append(h)
            parent = h
        return hits

    def _end_blocks(self, req: KVRequest) -> int:
        """Blocks the request holds at its budget's end, looked at most RESERVE_HORIZON tokens on;
        with windows, at most its window's (ceil(W / B) + 1 blocks) and the step's."""
        end = -(-min(req.max_len, len(req.token_ids) + RESERVE_HORIZON) // self.block_size)
        return min(end, -(-self.window // self.block_size) + 2) if self.window else end

    def growth(self, req: KVRequest) -> int:
        """Blocks the request may still take."""
        return max(0, self._end_blocks(req) - len(req.block_ids) + req.released)

    def admit(self, req: KVRequest, num_tokens: int, ahead: int | None = None) -> int | None:
        """Give a request with no blocks its cached prefix and blocks for up to `num_tokens` more.

        ahead: blocks the requests ahead of it may still take (None: reserve nothing). With
        reserve_growth, the expected share of that and of this request's own growth must stay free.
        Returns the tokens to compute this step, or (and no change) None if the pool is too small
        for its blocks, WAIT if it is too small for them and the room for growth.
        """
        hits = self.find_cached_prefix(req)
        num_computed = len(hits) * self.block_size
        n = min(num_tokens, len(req.token_ids) - num_computed)
        need_new = -(-(num_computed + n) // self.block_size) - len(hits)
        left = self.pool.num_free - need_new - self.pool.num_evictable_among(hits)
        keep = 0
        if ahead is not None and self.reserve_growth:
            own = max(0, self._end_blocks(req) - len(hits) - need_new)
            keep = int(self.budget_share * (ahead + own) + 0.5)
        if left < keep:
            req.block_hashes.clear()
            return None if left < 0 else WAIT
        self.pool.touch(hits)
        req.block_ids = array("i", hits + self.pool.allocate(need_new))
        req.num_computed = num_computed
        if req.use_prefix_cache and req.root_hash == _ROOT_HASH:
            self.prefix_queries += len(req.token_ids)
            self.prefix_hits += num_computed
        self._commit(req, n)
        return n

    def extend(self, req: KVRequest, num_tokens: int) -> int | None:
        """Blocks for up to `num_tokens` more tokens of a running request; None if they don't fit."""
        n = min(num_tokens, len(req.token_ids) - req.num_computed)
        need = -(-(req.num_computed + n) // self.block_size) - len(req.block_ids)
        if need > 0:
            new = self.pool.allocate(need)
            if new is None:
                return None
            req.block_ids.extend(new)
        self._commit(req, n)
        return n

    def _commit(self, req: KVRequest, n: int) -> None:
        """Count the step's tokens as computed and hash the full blocks whose tokens are all known
        (a block ending in a placeholder is hashed once the real token arrives)."""
        req.num_computed += n
        self._hash_full_blocks(req)

    def _hash_full_blocks(self, req: KVRequest) -> None:
        B = self.block_size
        if not req.use_prefix_cache or min(req.num_computed, len(req.token_ids)) // B <= len(req.block_hashes):
            return  # no block filled since (the common case: a step's one token)
        known = len(req.token_ids) - req.num_drafts - (len(req.token_ids) > 0 and req.token_ids[-1] == PLACEHOLDER)
        parent = req.block_hashes[-1] if req.block_hashes else req.root_hash
        for i in range(len(req.block_hashes), min(req.num_computed, known) // B):
            parent = chain_hash(parent, req.token_ids[i * B:(i + 1) * B])
            req.block_hashes.append(parent)
            self.pool.cache(req.block_ids[i], parent)

    def free(self, req_id: str) -> None:
        """A finished (or aborted) request's blocks back; what it used of its budget updates the mean."""
        self.parked.pop(req_id, None)
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        self.pool.free(req.block_ids[req.released:])
        budget = min(req.max_len - req.prompt_len, RESERVE_HORIZON)
        if budget > 0:
            used = min(1.0, max(0, len(req.token_ids) - req.prompt_len) / budget)
            self.budget_share += _SHARE_WEIGHT * (used - self.budget_share)

    def _preempt(self, req: KVRequest, preempted: list[str]) -> None:
        """Take a request's blocks back; it recomputes later (its full blocks stay cached)."""
        self.pool.free(req.block_ids[req.released:])
        self._park(req.req_id)
        preempted.append(req.req_id)

    def _park(self, req_id: str) -> None:
        """Keep the tokens of a request that gives up (or never got) its blocks (its drafts are not
        its tokens: those it keeps come back with its next ones)."""
        req = self.requests.pop(req_id)
        if req.num_drafts:
            del req.token_ids[-req.num_drafts:]
        self.parked[req_id] = req.token_ids

    def _fit(self, req: KVRequest, num_tokens: int, *, admitting: bool, preempted: list[str],
             ahead: int | None = None) -> int | None:
        """Blocks for the entry, preempting lower-priority holders while the pool is short of its
        blocks (never for the room for growth: then the answer is WAIT).

        Returns the tokens to compute, WAIT, or None when no holder ranks below `req`.
        """
        while True:
            n = self.admit(req, num_tokens, ahead) if admitting else self.extend(req, num_tokens)
            if n is not None:
                return n
            ahead = None  # taking blocks from lower-priority holders: for the request's own blocks only
            victim = max((r for r in self.requests.values() if r.block_ids), key=lambda r: r.priority_key,
                         default=None)
            if victim is None or victim is req or victim.priority_key < req.priority_key:
                return None
            self._preempt(victim, preempted)

    # ---- one step ----------------------------------------------------------------------------

    def process(self, proposal: StepProposal) -> tuple[StepPlan, StepFeedback]:
        """Fit a proposal into the pool: the step's plan for the executor and feedback for the scheduler.

        Entries are walked in policy order. When blocks run out for entry X, the lowest-priority
        request holding blocks (largest priority key, necessarily not yet walked) is preempted and X
        retried; if X is itself the lowest, X is preempted (if running) or left waiting, and so are
        all entries after it (they are new requests by then). With reserve_growth, a new request
        also needs the expected growth of the entries walked before it (all ranked above it) left
        free; lacking that room (and only that), it and the new requests after it wait, the running
        ones after it run: nothing is preempted for room.
        """
        for req_id in proposal.freed:
            self.free(req_id)
        # An entry that raises (a bug its data exposes) fails alone: its blocks go back, the
        # others are planned as if it had not been proposed.
        failed: dict[str, str] = {}
        for e in proposal.entries:
            try:
                self._take_tokens(e)
            except Exception as exc:
                self._fail(e.req_id, exc, failed)

        scheduled: list[tuple[KVRequest, int, int]] = []  # (request, computed before, new tokens)
        preempted: list[str] = []
        not_admitted: list[str] = []
        cached_tokens: dict[str, int] = {}
        entries = proposal.entries
        ahead: int | None = None  # growth of the requests scheduled so far, summed at the first admission
        waiting_for_room = False
        used = 0  # tokens scheduled so far
        for idx, e in enumerate(entries):
            if (preempted or failed) and (e.req_id in preempted or e.req_id in failed):
                continue
            req = self.requests[e.req_id]
            admitting = e.admitted is not None
            num_tokens = e.num_tokens
            if e.tentative:  # only with the budget the prefix-cache hits before it left
                num_tokens = min(num_tokens, proposal.token_budget - used)
                if num_tokens <= 0:
                    not_admitted.append(e.req_id)
                    self._park(e.req_id)
                    continue
            if ahead is None and admitting and scheduled and self.reserve_growth:
                ahead = sum(self.growth(r) for r, _, _ in scheduled)
            try:
                n = WAIT if admitting and waiting_for_room else self._fit(req, num_tokens, admitting=admitting,
                                                                            preempted=preempted, ahead=ahead)
            except Exception as exc:
                self._fail(e.req_id, exc, failed)
                continue
            if n == WAIT:  # an earlier new request waits for room: so do the ones after it
                not_admitted.append(e.req_id)
                self._park(e.req_id)
                waiting_for_room = True
                continue
            if n is None:
                # Nothing of lower priority is left to take from: this entry and all after it wait.
                for rest in entries[idx:]:
                    if rest.req_id in preempted or rest.req_id in failed:
                        continue
                    if rest.admitted is not None:
                        not_admitted.append(rest.req_id)
                        self._park(rest.req_id)
                    else:
                        self._preempt(self.requests[rest.req_id], preempted)
                break
            before = req.num_computed - n
            if admitting:
                cached_tokens[e.req_id] = before
            if self.window:
                self._release_passed(req, before)
            scheduled.append((req, before, n))
            used += n
            if ahead is not None:
                ahead += self.growth(req)

        plan = self._build_plan(proposal, scheduled)
        feedback = StepFeedback(
            step_id=proposal.step_id,
            scheduled={r.req_id: (before, n, before + n == len(r.token_ids)) for r, before, n in scheduled},
            preempted=preempted,
            not_admitted=not_admitted,
            cached_tokens=cached_tokens,
            kv_usage=self.pool.usage(),
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            failed=failed,
        )
        return plan, feedback

    def _release_passed(self, req: KVRequest, start: int) -> None:
        """Give back the leading blocks no query of the request will attend again: with windows of
        W keys, a query at position p reads keys (p - W, p]. This step's queries start at `start`;
        the step in flight started at last_start, and a step's result takes back at most its own
        tokens but its first (rejected drafts, a replaced token), so no later query starts before
        the lower of the two. Blocks wholly before that lower start - W + 1 are never read again:
        the kernels begin at each query's window, and a block given back and reused elsewhere
        is written only by steps that run after the ones planned so far.

            positions  0 ........ floor-W+1 ......... floor ...... start
            blocks     [released ][ kept (window) ...................... ]
        """
        floor = start if req.last_start is None else min(start, req.last_start)
        req.last_start = start
        passed = min(max(0, (floor - self.window + 1) // self.block_size), len(req.block_ids))
        if passed > req.released:
            self.pool.free(req.block_ids[req.released:passed])
            self.released_blocks += passed - req.released
            req.released = passed

    def _take_tokens(self, e: ScheduledRequest) -> None:
        """An admitted entry becomes a KVRequest (with its parked tokens if it had been admitted
        before); a running one appends the tokens sampled since. A PLACEHOLDER last stands for the
        token then in flight: the real one leads the next tokens sent."""
        adm = e.admitted
        if adm is not None:
            tokens = self.parked.pop(e.req_id, None)
            if tokens is None:
                tokens = array("q")
            elif tokens and tokens[-1] == PLACEHOLDER:
                tokens.pop()
            tokens.extend(e.new_token_ids)
            salt = adm.cache_salt
            budget = self.max_model_len if adm.params.max_tokens is None else adm.prompt_len + adm.params.max_tokens
            self.requests[e.req_id] = KVRequest(e.req_id, tokens, e.priority_key,
                                                adm.use_prefix_cache,
                                                _ROOT_HASH if salt is None else hash((_ROOT_HASH, salt)),
                                                prompt_len=adm.prompt_len,
                                                max_len=min(budget, self.max_model_len))
        else:
            req = self.requests[e.req_id]
            if req.num_drafts:  # the drafts it kept lead the new tokens; rejected ones are retracted
                del req.token_ids[-req.num_drafts:]
            elif req.token_ids[-1] == PLACEHOLDER:
                req.token_ids.pop()
            req.num_computed -= e.retract  # those slots are computed again, with the tokens replacing them
            req.token_ids.extend(e.new_token_ids)
            self._hash_full_blocks(req)
            req.num_drafts = e.drafts
            return
        self.requests[e.req_id].num_drafts = e.drafts

    def _fail(self, req_id: str, exc: Exception, failed: dict[str, str]) -> None:
        failed[req_id] = f"KV cache manager: {type(exc).__name__}: {exc}"
        self.parked.pop(req_id, None)
        if (req := self.requests.pop(req_id, None)) is not None:
            self.pool.free(req.block_ids[req.released:])

    def _build_plan(self, proposal: StepProposal, scheduled: list[tuple[KVRequest, int, int]]) -> StepPlan:
        """The step's arrays, built from the requests' int32/int64 buffers joined as bytes: a pass
        over each request, none over its blocks or tokens (a large batch holds tens of thousands of
        blocks: iterating them as Python ints would take the event loop's time every step)."""
        reqs = [r for r, _, _ in scheduled]
        query_lens = np.fromiter((n for _, _, n in scheduled), dtype=np.int32, count=len(reqs))
        context_lens = np.fromiter((before for _, before, _ in scheduled), dtype=np.int32, count=len(reqs))
        totals = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int32, count=len(reqs))
        num_blocks = np.fromiter((len(r.block_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        # Ragged block lists -> a zero-padded [num_reqs, max_blocks] table in one scatter.
        block_tables = np.zeros((len(reqs), max(int(num_blocks.max(initial=0)), 1)), dtype=np.int32)
        block_tables[np.arange(block_tables.shape[1]) < num_blocks[:, None]] = np.frombuffer(
            b"".join([r.block_ids for r in reqs]), dtype=np.int32)
        # a bytearray: writable, the runner fills in placeholders
        token_ids = np.frombuffer(bytearray().join([r.token_ids[b:b + n] for r, b, n in scheduled]), dtype=np.int64)
        new_sequences, drafts, propose = {}, {}, {}
        for e in proposal.entries:
            if (e.drafts or e.propose) and e.req_id in self.requests:
                if e.drafts:
                    drafts[e.req_id] = e.drafts
                if e.propose:
                    propose[e.req_id] = e.propose
            adm = e.admitted
            if adm is not None and e.req_id in self.requests:  # admitted and scheduled
                tokens = self.requests[e.req_id].token_ids
                new_sequences[e.req_id] = NewSequence(adm.params, tokens[:adm.prompt_len], tokens[adm.prompt_len:],
                                                      adm.prepared)
        req_ids = [r.req_id for r in reqs]
        return StepPlan(
            step_id=proposal.step_id,
            req_ids=req_ids,
            token_ids=token_ids,
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            sample=(context_lens + query_lens) == totals,
            new_sequences=new_sequences,
            freed=list(proposal.freed),
            drafts=drafts,
            propose=propose,
            prefix_groups=self._find_groups(req_ids, block_tables, context_lens // self.block_size)
            if self.prefix_groups and len(reqs) > 1 else None,
        )

    def _find_groups(self, req_ids: list[str], tables: np.ndarray, ctx_blocks: np.ndarray) -> PrefixGroups | None:
        """find_prefix_groups, or the last step's groups where they are still this step's: the same
        rows in the same order, and every member's context still past its group's prefix. A row's
        blocks only grow while it runs, so what the groups were found from (each row's blocks up to
        where the members differ, every context past it) is unchanged; a step of other rows, a
        context that a group's end depended on (or that reached none of its rows' first block), or
        groups left out for want of room (their rank could change) looks again."""
        known = self._groups
        if (known is not None and known.req_ids == req_ids and (ctx_blocks >= 1).all()
                and (ctx_blocks[known.members] > known.ends).all()):
            return known.groups
        groups = find_prefix_groups(tables, ctx_blocks, self.block_size)
        members = np.zeros(0, dtype=np.int32) if groups is None else groups.members
        ends = np.zeros(0, dtype=np.int32) if groups is None else \
            np.repeat(groups.hi // self.block_size, np.diff(groups.starts))
        still = ((groups is None or groups.num_groups < MAX_PREFIX_GROUPS)  # (none left out for room: no ranking to change)
                 and (ctx_blocks >= 1).all() and (ctx_blocks[members] > ends).all())
        self._groups = _KnownGroups(req_ids, members, ends, groups) if still else None
        return groups

    # ---- accounting --------------------------------------------------------------------------

    def num_free_blocks(self) -> int:
        return self.pool.num_free
