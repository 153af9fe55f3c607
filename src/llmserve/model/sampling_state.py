"""Per-request sampling state on the executor's side, and the step's SamplingBatch built from it.

Each request the executor runs has a SeqState: its parameters, prompt and output tokens (as far as
the host knows them; `in_flight` counts tokens sampled by a launched step, not yet back) and its
logit_bias as arrays. A step's batch gathers the rows that sample into device tensors (model/
sampler.py says what each one does), with no blocking copy: it would wait for the forward pass
queued before it. Here is where per-request constraints on the next token plug in.
"""

from __future__ import annotations

import hashlib
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import torch

from llmserve.decoding import Constraint, NoTokenAllowed, mask_width
from llmserve.kernels.sampling_reference import row_keys
from llmserve.messages import NewSequence
from llmserve.model.sampler import Penalties, SamplingBatch
from llmserve.model.step_inputs import Staging
from llmserve.sampling_params import SamplingParams

log = structlog.get_logger("llmserve.sampling")


def drawn_seed(engine_seed: int, req_id: str) -> int:
    """An unseeded request's seed: a hash of the engine's seed and the request's id, the same on
    every tensor-parallel rank and after preemption, in [0, 2**63)."""
    digest = hashlib.blake2b(f"{engine_seed}:{req_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def penalized(p: SamplingParams) -> bool:
    """Sampling that counts the request's own tokens (repetition, presence, frequency penalties)."""
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


@dataclass(slots=True)
class SeqState:
    params: SamplingParams
    prompt_ids: array  # int64
    output_ids: list[int]
    seed: int  # the request's, or drawn_seed() for an unseeded one
    in_flight: int = 0  # tokens sampled by a launched step, not yet appended to output_ids
    bias: tuple[np.ndarray, np.ndarray] | None = None  # logit_bias as (int64 token ids, float32 values)
    constraints: dict[str, Constraint] = field(default_factory=dict)
    """Strategy name -> its constraint on what the request samples next (llmserve/decoding.py)."""
    jumper: Constraint | None = None
    """Its constraint when it is the only one and can jump forward."""

    @classmethod
    def of(cls, new: NewSequence, strategies: dict[str, Any], seed: int, jump_forward: bool = True) -> SeqState:
        bias = new.params.logit_bias
        arrays = None if not bias else (np.fromiter(bias.keys(), np.int64, len(bias)),
                                        np.fromiter(bias.values(), np.float32, len(bias)))
        state = cls(new.params, new.prompt_token_ids, list(new.output_token_ids), seed, bias=arrays)
        for name, prepared in new.prepared.items():
            constraint = strategies[name].start(prepared)
            for token in state.output_ids:  # a resumed request: its constraint catches up
                constraint.accept(token)
            state.constraints[name] = constraint
        if jump_forward and len(state.constraints) == 1 and hasattr(constraint, "jump"):
            state.jumper = constraint
        return state

    def accept(self, tokens: list[int]) -> None:
        """The tokens a step produced for it (one, or drafts kept and the one after), now on the host."""
        self.landed(tokens)
        for constraint in self.constraints.values():
            for token in tokens:
                constraint.accept(token)

    def landed(self, tokens) -> None:
        """The tokens of a step that sampled for it (accept() less its constraints' advance) are
        its output now."""
        self.output_ids += tokens
        self.in_flight -= 1

    def jump(self, token: int, max_model_len: int) -> list[int] | None:
        """After accept(token), `token` not an end of sequence: the tokens its jumper forces in
        place of `token`, within max_tokens and max_model_len; output_ids end with them."""
        limit = max_model_len - len(self.prompt_ids) - len(self.output_ids) + 1
        if self.params.max_tokens is not None:
            limit = min(limit, self.params.max_tokens - len(self.output_ids) + 1)
        tokens = self.jumper.jump(token, limit)
        if tokens:
            self.output_ids[-1:] = tokens
        return tokens or None

    def nothing_allowed(self) -> str:
        """The error of a request whose mask allowed no token (its constraints exclude each other),
        naming its fields that constrain: a fault of its parameters (NoTokenAllowed: a 400)."""
        p = self.params
        fields = ["structured_outputs"] if p.structured_outputs is not None else []
        fields += [name for name in ("allowed_token_ids", "bad_words") if getattr(p, name)]
        fields += [name for name in self.constraints if name not in ("structured_outputs", "token_masks")]
        named = f"{' and '.join(fields)} {'together exclude' if len(fields) > 1 else 'excludes'}" if fields \
            else "its constraints exclude"
        return (f"{NoTokenAllowed.__name__}: {fields[0] if fields else 'constraints'}: no token may come next: "
                f"{named} every token")

    def reads_own_tokens(self) -> bool:
        """Its next draw depends on its last token on the host: penalties count the output,
        min_tokens bans stop tokens until it is reached, a constraint's mask follows the output."""
        return penalized(self.params) or len(self.output_ids) < self.params.min_tokens or bool(self.constraints)


class SamplingState:
    """The SeqStates of the requests the executor runs, by request id."""

    def __init__(self, eos_token_ids: list[int], staging: Staging, strategies: dict[str, Any] | None = None, *,
                 jump_forward: bool = True, seed: int = 0) -> None:
        self.eos_token_ids = eos_token_ids
        self.staging = staging
        self.strategies = strategies or {}
        """Decoding strategies by name: a request's prepared ones start its constraints."""
        self.jump_forward = jump_forward  # scheduler.jump_forward: constraints may jump forward
        self.seed = seed  # the engine's (model.seed): unseeded requests' streams derive from it
        self.seqs: dict[str, SeqState] = {}
        self.host_sampled: set[str] = set()
        """Requests whose sampling may read their tokens on the host (penalties, min_tokens, constraints)."""
        self._mask_thread: ThreadPoolExecutor | None = None
        self._rows: _Rows | None = None  # the last batch's per-request part
        self._layout: _MaskLayout | None = None  # the last masked step's rows and constraints

    def add(self, req_id: str, new: NewSequence) -> None:
        """A request that (re)enters the running set: its state is built anew from the plan."""
        seed = new.params.seed if new.params.seed is not None else drawn_seed(self.seed, req_id)
        self.seqs[req_id] = state = SeqState.of(new, self.strategies, seed, self.jump_forward)
        if penalized(state.params) or state.params.min_tokens > 0 or state.constraints:
            self.host_sampled.add(req_id)

    def drop(self, req_id: str) -> None:
        self.seqs.pop(req_id, None)
        self.host_sampled.discard(req_id)

    def clear(self) -> None:
        self.seqs.clear()
        self.host_sampled.clear()
        self._rows = None
        self._layout = None

    def needs_host_tokens(self, req_ids: list[str], in_flight: dict[str, int]) -> bool:
        """Whether a request of `req_ids` with a token in flight (`in_flight`: its row) samples
        with that token on the host: the step in flight must finish first."""
        if not self.host_sampled:  # the common case: no such request at all
            return False
        planned = set(req_ids)
        return any(r in planned and r in in_flight and self.seqs[r].reads_own_tokens() for r in self.host_sampled)

    def batch(self, states: list[SeqState], vocab: int, drafts: list[list[int]] | None = None) -> SamplingBatch:
        """The sampling parameters of `states` as device tensors: one row each, or with `drafts`
        (speculative decoding: per state, the drafts it checks), one row per position checked,
        drafts + 1 of them: row i of a state draws as if its output went on with drafts[:i].
        What depends on the requests alone (their parameters) is kept for the next step, which
        usually samples the same requests in the same order; their positions are each step's."""
        to_device = self.staging.to_device
        lengths = None if not drafts else [len(d) for d in drafts]
        cached = self._rows
        if (cached is not None and cached.lengths == lengths and len(cached.states) == len(states)
                and all(a is b for a, b in zip(cached.states, states))):
            rows = cached
        else:
            self._rows = rows = _Rows.of(states, lengths, vocab, self.staging)
        states = rows.expanded
        ahead = None  # with drafts: per row, the drafts its draw follows
        produced = np.array([len(s.output_ids) for s in states], dtype=np.int64)  # before each row's draw
        if drafts:
            ahead = [d[:i] for d in drafts for i in range(len(d) + 1)]
            produced += rows.ahead_counts
        batch = SamplingBatch(
            temperature=rows.temperature, top_k=rows.top_k, top_p=rows.top_p, min_p=rows.min_p,
            keys=to_device(row_keys(rows.seeds, produced + np.array([s.in_flight for s in states], dtype=np.int64))),
            max_logprobs=rows.max_logprobs, filtered_rows=rows.filtered_rows,
            all_filtered=rows.all_filtered, bias=rows.bias,
        )
        if rows.penalties is not None:
            batch.penalties = Penalties(
                output_counts=_scatter_rows([s.output_ids for s in states] if ahead is None else
                                            [s.output_ids + a for s, a in zip(states, ahead)],
                                            vocab, torch.float32, True, self.staging),
                **rows.penalties)
        if rows.min_tokens:
            banned = [(i, tok) for i, (s, n) in enumerate(zip(states, produced.tolist())) if n < s.params.min_tokens
                      for tok in s.params.held_back(self.eos_token_ids)]
            if banned:
                index, toks = zip(*banned)
                batch.banned = (to_device(np.array(index, dtype=np.int64)), to_device(np.array(toks, dtype=np.int64)))
        return batch

    def accept_masked(self, states: list[SeqState], tokens: list[int], fill: MaskFill) -> dict[int, str]:
        """A step's tokens (one a state: no drafts), for the states `fill` masked: each token
        checked against the mask it was drawn under, appended to its state's output, and accepted
        by each strategy's constraints in one accept_tokens call where the strategy has one (else
        one accept a constraint). Returns index -> error for each request that fails: its token
        was not allowed by its mask, or its constraint failed (alone; where a strategy's
        accept_tokens raises, every request it was given). Rows whose mask was not filled
        (`fill.failed`) are left to the caller."""
        owners = fill.layout.owners
        drawn = np.array(tokens, dtype=np.int64)[owners]
        host = fill.host.numpy()
        allowed = (host[np.arange(len(owners)), drawn >> 5] >> (drawn & 31)) & 1
        errors: dict[int, str] = {}
        skip = set(fill.failed)
        if not allowed.all():
            for row in np.flatnonzero(allowed == 0).tolist():
                if row not in skip:
                    skip.add(row)
                    errors[owners[row]] = (
                        f"RuntimeError: token {drawn[row]} is not allowed by its constraints' mask" if host[row].any()
                        else states[owners[row]].nothing_allowed())
        drawn = drawn.tolist()
        for row, (i, token) in enumerate(zip(owners, drawn)):
            if not skip or row not in skip:
                states[i].landed((token,))  # (its constraints advance below, a strategy at a time)
        for strategy, constraints, rows in fill.layout.work:
            if skip:
                kept = [k for k, row in enumerate(rows) if row not in skip]
                constraints, rows = [constraints[k] for k in kept], [rows[k] for k in kept]
            toks = [drawn[row] for row in rows]
            accept_tokens = getattr(strategy, "accept_tokens", None)
            if accept_tokens is not None:
                try:
                    accept_tokens(constraints, toks)
                except Exception as exc:  # which of them moved is unknown: they all fail
                    log.exception("a strategy's accept_tokens failed")
                    errors.update((owners[row], f"{type(exc).__name__}: {exc}") for row in rows)
                continue
            for constraint, token, row in zip(constraints, toks, rows):
                try:
                    constraint.accept(token)
                except Exception as exc:
                    errors[owners[row]] = f"{type(exc).__name__}: {exc}"
        return errors

    def masks(self, states: list[SeqState], vocab: int, *, background: bool = False,
              drafts: list[list[int]] | None = None) -> MaskFill | None:
        """The packed masks of the rows of `states` that have constraints (None: no such row),
        written into pinned host memory for one copy to the device: 5 MB a step for 256 rows of a
        152k vocabulary. Each strategy fills its constraints' rows in one call where it can
        (fill_masks: a grammar engine's threads), else one fill_mask a row; a row under two
        strategies gets both ANDed. background: filled on the mask thread while the caller goes
        on (the constraints must not move until MaskFill.send() returned), or, where one strategy
        has every masked row and its fill_masks_async takes them, elsewhere into its own host
        buffer (structured outputs: its grammar process); else here.

        With `drafts` (speculative decoding: per state, the drafts it checks in len + 1 rows), a
        constrained state's row j is masked as its constraint stands after the first j drafts
        (advanced tentatively, then rolled back, here); a draft it rejects leaves the rows after it
        allowing every token: the row before masks that draft out, so the drafts kept end there."""
        if not any(s.constraints for s in states):
            return None
        layout = self._layout
        if drafts or layout is None or len(layout.states) != len(states) or \
                any(a is not b for a, b in zip(layout.states, states)):
            layout = _MaskLayout.of(states, drafts, self.strategies, self.staging)
            if not drafts:  # decode steps mostly sample the requests of the step before, in order
                self._layout = layout
        work, ahead = layout.work, layout.ahead
        if background and not ahead and len(work) == 1:
            strategy, constraints, rows = work[0]
            fill_async = getattr(strategy, "fill_masks_async", None)
            pending = None if fill_async is None else fill_async(constraints, rows, mask_width(vocab))
            if pending is not None:  # filled elsewhere (another process), into its own host buffer
                return MaskFill(layout, pending.host, self.staging, job=pending)
        host = torch.empty((len(layout.owners), mask_width(vocab)), dtype=torch.int32,
                           pin_memory=self.staging.device.type == "cuda")
        fill = MaskFill(layout, host, self.staging)
        if background and not ahead:
            if self._mask_thread is None:
                self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="llmserve-masks")
            fill.job = self._mask_thread.submit(_fill_masks, work, host, fill.failed)
        else:
            _fill_masks(work, host, fill.failed)
            for constraint, first, checked in ahead:
                _fill_ahead(constraint, host, first, checked, fill.failed)
        return fill

    def close(self) -> None:
        """Stop the mask thread, and what the strategies run beside the engine (after the last step)."""
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=False)
            self._mask_thread = None
        for strategy in self.strategies.values():
            close = getattr(strategy, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:
                    log.exception("a decoding strategy failed to close")


@dataclass(slots=True, eq=False)
class _Rows:
    """The part of a step's SamplingBatch that depends on its requests alone, for `states` (one
    row each, or with draft `lengths`, drafts + 1 rows each: `expanded`)."""
    states: list[SeqState]
    lengths: list[int] | None
    expanded: list[SeqState]
    ahead_counts: np.ndarray | None  # with drafts: per row, the drafts its draw follows
    seeds: np.ndarray
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    max_logprobs: int
    filtered_rows: torch.Tensor | None
    all_filtered: bool
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    penalties: dict[str, torch.Tensor] | None  # Penalties' fields but output_counts
    min_tokens: bool  # some row may have stop tokens banned

    @classmethod
    def of(cls, states: list[SeqState], lengths: list[int] | None, vocab: int, staging: Staging) -> _Rows:
        expanded, ahead = states, None
        if lengths:
            expanded = [s for s, n in zip(states, lengths) for _ in range(n + 1)]
            ahead = np.concatenate([np.arange(n + 1) for n in lengths]).astype(np.int64)
        params = [s.params for s in expanded]
        t = lambda xs, dtype: staging.to_device(np.array(xs, dtype=dtype))  # noqa: E731
        filtered = [i for i, p in enumerate(params) if p.temperature > 0 and (p.top_k or p.top_p < 1.0 or p.min_p > 0)]
        penalties = None
        if any(penalized(p) for p in params):
            penalties = dict(prompt_mask=_scatter_rows([s.prompt_ids for s in expanded], vocab, torch.bool, False, staging),
                             repetition=t([p.repetition_penalty for p in params], np.float32),
                             presence=t([p.presence_penalty for p in params], np.float32),
                             frequency=t([p.frequency_penalty for p in params], np.float32))
        bias = None
        biased = [(i, s.bias) for i, s in enumerate(expanded) if s.bias is not None]
        if biased:
            index = np.repeat(np.array([i for i, _ in biased], dtype=np.int64), [len(b[0]) for _, b in biased])
            bias = (staging.to_device(index), staging.to_device(np.concatenate([b[0] for _, b in biased])),
                    staging.to_device(np.concatenate([b[1] for _, b in biased])))
        return cls(
            list(states), lengths, expanded, ahead, np.array([s.seed for s in expanded], dtype=np.int64),
            temperature=t([p.temperature for p in params], np.float32),
            top_k=t([min(p.top_k or vocab, vocab) for p in params], np.int64),
            top_p=t([p.top_p for p in params], np.float32),
            min_p=t([p.min_p for p in params], np.float32),
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
            filtered_rows=t(filtered, np.int64) if filtered else None,
            all_filtered=bool(filtered) and len(filtered) == len(params),
            bias=bias, penalties=penalties, min_tokens=any(p.min_tokens > 0 for p in params))


@dataclass(slots=True, eq=False)
class _MaskLayout:
    """Where a step's masks go, for `states` (with drafts: len + 1 rows each): per masked row, its
    state's index (`owners`) and its row of the batch (`rows`, on the device); per strategy, its
    constraints and their masked rows (`work`); per state checking drafts, (its constraint, its
    first masked row, its drafts) (`ahead`)."""
    states: list[SeqState]
    owners: list[int]
    rows: torch.Tensor
    work: list[tuple[Any, list[Constraint], list[int]]]
    ahead: list[tuple[Constraint, int, list[int]]]

    @classmethod
    def of(cls, states: list[SeqState], drafts: list[list[int]] | None, strategies: dict[str, Any],
           staging: Staging) -> _MaskLayout:
        counts = [len(d) + 1 for d in drafts] if drafts else [1] * len(states)
        firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        owners = [i for i, s in enumerate(states) if s.constraints for _ in range(counts[i])]
        batch_rows = [firsts[i] + j for i, s in enumerate(states) if s.constraints for j in range(counts[i])]
        groups: dict[str, tuple[list[Constraint], list[int]]] = {}
        ahead: list[tuple[Constraint, int, list[int]]] = []
        row = 0
        for i, state in enumerate(states):
            if not state.constraints:
                continue
            for name, constraint in state.constraints.items():
                constraints, rows = groups.setdefault(name, ([], []))
                constraints.append(constraint)
                rows.append(row)
            if counts[i] > 1:  # (Speculation.serves: one constraint, which can check drafts)
                ahead.append((next(iter(state.constraints.values())), row, drafts[i]))
            row += counts[i]
        work = [(strategies[name], constraints, rows) for name, (constraints, rows) in groups.items()]
        return cls(list(states), owners, staging.to_device(np.array(batch_rows, dtype=np.int64)), work, ahead)


@dataclass(slots=True)
class MaskFill:
    """A step's packed masks (int32 [rows, ceil(V / 32)], pinned host memory): one row per masked
    batch row, as `layout` places them, being filled unless `job` is done."""
    layout: _MaskLayout
    host: torch.Tensor
    staging: Staging
    job: Any = None
    """Filling: the mask thread's Future, or a strategy's pending fill (fill_masks_async); the
    result of either is row -> error for the rows that failed, or None where nothing was filled."""
    failed: dict[int, str] = field(default_factory=dict)
    """Row of `host` -> the error its constraint raised filling its mask (the row allows every
    token: the request fails when the step finishes)."""

    def send(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, masks) on the device, once filled (the copy is queued after the fill)."""
        if self.job is not None:
            failed = self.job.result()
            if failed is None:  # a strategy's own fill that could not be made (its process died): here
                _fill_masks(self.layout.work, self.host, self.failed)
            else:
                self.failed.update(failed)  # (the mask thread's is this dict itself)
            self.job = None
        return self.layout.rows, self.staging.send(self.host)

    def errors(self) -> dict[int, str]:
        """Sampling request -> the error its constraint raised filling a mask (after send())."""
        return {self.layout.owners[row]: error for row, error in self.failed.items()}

    def empty_rows(self) -> dict[int, int]:
        """Sampling request -> the first of its rows (0: the one before its drafts, j: after j of
        them) that allows no token (after send(), until the step has finished)."""
        owners, first = self.layout.owners, {}
        for row, owner in enumerate(owners):
            first.setdefault(owner, row)
        empty: dict[int, int] = {}
        for row in np.flatnonzero(~self.host.numpy().any(axis=1)).tolist():
            empty.setdefault(owners[row], row - first[owners[row]])
        return empty


@torch.inference_mode()  # on the mask thread too: `host` was made in inference mode
def _fill_masks(work: list[tuple[Any, list[Constraint], list[int]]], host: torch.Tensor,
                failed: dict[int, str]) -> dict[int, str]:
    """Fill `host`'s rows: `work` is (strategy, its constraints, their rows) per strategy. Where a
    strategy's one call for all its rows fails, its rows are filled one by one: a row that fails
    alone allows every token and is recorded in `failed` (row of `host` -> error), returned."""
    alone = len(work) == 1  # the common case: its strategy writes every row whole
    if not alone:
        host.fill_(-1)
    for strategy, constraints, rows in work:
        target = host if alone else torch.full_like(host, -1)  # several: each ANDed in
        if not _fill_all(strategy, constraints, target, rows):
            for constraint, row in zip(constraints, rows):
                try:
                    constraint.fill_mask(target, row)
                except Exception as exc:
                    failed[row] = f"{type(exc).__name__}: {exc}"
                    target[row] = -1
        if not alone:
            host &= target
    return failed


def _fill_ahead(constraint: Constraint, host: torch.Tensor, first: int, drafts: list[int],
                failed: dict[int, str]) -> None:
    """Rows first + 1 .. first + len(drafts) of `host`: the constraint's masks after one, two ...
    of the drafts (row `first`, after none, is filled with the others), the constraint advanced
    over them tentatively and rolled back; past a draft it rejects, rows that allow every token."""
    advanced = 0
    try:
        for j, token in enumerate(drafts, 1):
            if not constraint.advance(token):
                host[first + j:first + len(drafts) + 1] = -1
                break
            advanced += 1
            constraint.fill_mask(host, first + j)
    except Exception as exc:
        failed[first] = f"{type(exc).__name__}: {exc}"
        host[first:first + len(drafts) + 1] = -1
    finally:
        if advanced:
            constraint.rollback(advanced)


def _fill_all(strategy: Any, constraints: list[Constraint], target: torch.Tensor, rows: list[int]) -> bool:
    """Whether the strategy filled all its rows in one call (it has fill_masks, and it succeeded)."""
    fill_masks = getattr(strategy, "fill_masks", None)
    if fill_masks is None:
        return False
    try:
        fill_masks(constraints, target, rows)
        return True
    except Exception:
        log.exception("a strategy's fill_masks failed; filling its rows one by one")
        return False


def _scatter_rows(rows: list, vocab: int, dtype: torch.dtype, count: bool, staging: Staging) -> torch.Tensor:
    """[len(rows), vocab] tensor: per-row token counts (count=True) or presence."""
    out = torch.zeros(len(rows), vocab, dtype=dtype, device=staging.device)
    lens = np.array([len(r) for r in rows])
    if lens.sum() == 0:
        return out
    row_idx = staging.to_device(np.repeat(np.arange(len(rows)), lens))
    tok_idx = staging.to_device(np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]))
    ones = torch.ones(len(tok_idx), dtype=dtype, device=staging.device)
    return out.index_put_((row_idx, tok_idx), ones, accumulate=count)
