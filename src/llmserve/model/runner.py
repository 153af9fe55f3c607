"""The model runner: weights, KV cache and per-request sampling state on one device; turns a
StepPlan into a forward pass and sampled tokens.

Its parts: the KV cache's layout and size (model/kv_cache.py), a step's inputs and their way to the
device (model/step_inputs.py), CUDA graphs that replay whole steps (model/cuda_graphs.py), the
requests' sampling state (model/sampling_state.py), speculative decoding's proposals and checks
(model/drafting.py), a step's stages from launch to result (model/launched.py) and what a step
waits for (model/waits.py); here, the step pipeline that drives them.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import structlog
import torch

from llmserve.attention import AttentionBackend
from llmserve.config import EngineConfig
from llmserve.core.kv_cache_manager import MAX_PREFIX_GROUPS
from llmserve.distributed.parallel_state import tp
from llmserve.messages import PLACEHOLDER, PrefixGroups, StepPlan, StepResult
from llmserve.model.cuda_graphs import StepGraphs, eager_cascade_layouts
from llmserve.model.drafting import Drafting, check_drawn_drafts, keep_confirmed, spread
from llmserve.model.kv_cache import KVCacheLayout
from llmserve.model.launched import Forward, InFlight, Sampling
from llmserve.model.loader import load_model
from llmserve.model.sampler import draw, gather_logprobs, process_logits, prompt_logprobs, to_token_logprobs
from llmserve.model.sampling_state import SamplingState
from llmserve.model.spec import ModelSpec
from llmserve.model.step_inputs import Staging, StepInputs, fill_placeholders
from llmserve.model.step_timing import StepTiming
from llmserve.model.waits import Steps, is_done, run_waiting
from llmserve.quantization import QuantizationMethod
from llmserve.speculative import Proposer

log = structlog.get_logger("llmserve.runner")

MAX_CASCADE_QUERY = 8
"""In a step with prompt rows, a request joins its prefix group with at most this many tokens (a
decode token, drafts to check, a short jump): those are what cascade saves reads for. A longer
chunk's own query tiles each read the prefix once either way, and its partial results would take
memory the KV cache's sizing did not count."""
EAGER_LAYER_NS = 150_000.0
"""What a layer of a step with prompt rows loses running eagerly instead of replaying its graph
(which has no cascade): its ~9 launches from Python. An estimate of the H100 host's launch cost,
not yet measured against the graph."""

_DEVICE_ERRORS = (torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()
"""Errors of the device itself (a CUDA fault): every later launch fails too, so no part of a step
that raised one is retried."""


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, quant: QuantizationMethod | None = None,
                 strategies: dict[str, Any] | None = None, proposer: Proposer | None = None,
                 model_class: type | None = None, isolate_failures: bool = True) -> None:
        self.config, self.spec, self.backend, self.device, self.dtype = config, spec, backend, device, dtype
        # Triton launches on the calling thread's current device, and steps run on worker threads
        # whose current device is cuda:0 unless set: each entry point makes the runner's current
        self._cuda_index = (device.index or 0) if device.type == "cuda" else None
        self._make_current()
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.model = load_model(config.model.model, spec, backend, dtype=dtype, device=device,
                                max_positions=max_model_len, quant=quant, load_format=config.model.load_format,
                                seed=config.model.seed, model_class=model_class)
        kv_dtype = dtype if config.cache.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        self.kv = KVCacheLayout(spec, self.block_size, kv_dtype, device)
        self.staging = Staging(device)
        self.sampling = SamplingState(list(spec.eos_token_ids), self.staging, strategies,
                                      jump_forward=config.scheduler.jump_forward, seed=config.model.seed)
        self.drafting = Drafting(proposer, spec.vocab_size)
        self.num_blocks = 0
        self.graphs: StepGraphs | None = None
        self.timing = StepTiming()
        self.cascade = (config.cache.cascade_attention != "never" and backend.supports_cascade
                        and spec.cascade_exact)
        """Cascade attention may serve steps (the mode allows it, the backend has it, the model's
        attention is plain enough for it): the KV manager looks for prefix groups only then."""
        self.cascade_steps = 0  # steps that attended shared prefixes once per group
        self.in_flight: InFlight | None = None
        self.waiting: Sampling | None = None
        """The step launched last when its sampler waits for masks filling on the mask thread."""
        self.failed: set[str] = set()  # requests that failed a step, left out of the plans made before that was known
        self.isolate_failures = isolate_failures
        """A failed step fails its failing requests alone (re-run in parts); False: it raises (a
        tensor-parallel rank: re-running parts alone would desert the other ranks' collectives)."""
        self.dropped: set[str] = set()
        """Requests that jumped forward after the step being launched was planned: they sample nothing in it."""

    @property
    def proposer(self) -> Proposer | None:
        """Speculative decoding's proposer (llmserve/speculative.py); None: no speculation."""
        return self.drafting.proposer

    def _make_current(self) -> None:
        if self._cuda_index is not None:
            torch.cuda.set_device(self._cuda_index)

    @property
    def eos_token_ids(self) -> list[int]:
        return self.sampling.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        self.sampling.eos_token_ids = ids

    # ---- KV cache ------------------------------------------------------------------------------

    def block_bytes(self) -> int:
        return self.kv.block_bytes()

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.model.set_kv_caches(self.kv.allocate(num_blocks))
        self.num_blocks = num_blocks

    def determine_num_blocks(self) -> int:
        self._make_current()
        return self.kv.num_blocks(self.config, self.model, self.backend, self.staging, self.max_model_len)

    def release(self) -> None:
        """Drop weights and KV cache so their device memory returns to the system."""
        self.model.set_kv_caches([None] * self.spec.num_layers)
        self.model = None
        self.graphs = None
        self.staging = None
        self.sampling.clear()
        self.sampling.close()
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of one prompt run as a single prefill in KV blocks
        0, 1, ... (overwriting them: only while no request is running). For quality measurements."""
        self._make_current()
        n = len(token_ids)
        blocks = -(-n // self.block_size)
        if blocks > self.num_blocks or n > self.max_model_len:
            raise ValueError(f"a prompt of {n} tokens needs {blocks} KV blocks and max_model_len >= {n}")
        inputs = StepInputs.build(np.array(token_ids, dtype=np.int64), np.array([n], dtype=np.int32),
                                  np.zeros(1, dtype=np.int32), np.arange(blocks, dtype=np.int32)[None], self.block_size)
        return self.model.compute_logits(self.model(*self.staging.forward_inputs(inputs))).float()

    def capture_graphs(self, max_batch: int, max_tokens: int, emulate: bool = False) -> None:
        """Capture CUDA graphs of decode steps up to `max_batch` requests and of mixed steps up to
        `max_tokens` tokens (after the KV cache is allocated: they bake in its address); with
        cascade on, then run the eager passes no graph serves (cuda_graphs.eager_cascade_layouts).
        emulate: no capture; steps run eagerly over the graphs' padded buffers (tests without CUDA)."""
        self._make_current()
        max_blocks = -(-self.max_model_len // self.block_size)
        spec = self.config.speculative
        self.graphs = StepGraphs(self.model, self.staging, max_batch, max_tokens, max_blocks, emulate=emulate,
                                 cascade_groups=MAX_PREFIX_GROUPS if self.cascade else 0,
                                 verify_queries=spec.num_speculative_tokens + 1 if spec.method else 0,
                                 verify_batch=min(spec.disable_by_batch_size, max_batch))
        self.graphs.capture()
        if self.cascade:  # the eager passes of steps with prompt rows and cascade: their kernels compiled now
            with torch.inference_mode():
                for inputs, groups in eager_cascade_layouts(max_batch, max_tokens, self.block_size, self.num_blocks,
                                                            MAX_PREFIX_GROUPS, MAX_CASCADE_QUERY, self.max_model_len):
                    self.model(*self.staging.forward_inputs(inputs, groups))
        if hasattr(self.proposer, "capture_graphs"):  # a draft model's passes (plugins/draft_model.py)
            self.proposer.capture_graphs(emulate=emulate)

    # Steps are launched, then finished. launch() queues the forward pass and the sampler on the
    # device and starts a non-blocking copy of the sampled tokens to pinned memory; finish() waits
    # for that copy alone and builds the StepResult. step(N + 1) launches N + 1 *before* finishing
    # N, so the device does not wait for the host between two steps:
    #
    #     host:    launch N+1 | finish N (wait) | launch N+2 | finish N+1 (wait) | ...
    #     device:  ... N ........| N+1 .........................| N+2 ...
    #
    # N+1's inputs that are N's sampled tokens (PLACEHOLDER) are copied device to device from N's
    # token tensor. A request whose sampling needs N's token on the host (penalties, min_tokens, a
    # constraint's mask) splits the launch: N+1's forward pass is queued, N is finished while it
    # runs, then N+1's sampling is built. Its masks are filled on the mask thread while N's result
    # goes back and N+2 is planned; the next call (or flush()) queues N+1's sampler, once they are,
    # before N+2's forward pass. (Queued from a thread of its own as soon as they are filled, it
    # would run beside the event loop's chain, which holds the interpreter lock it needs: on a
    # host-bound step that wait and hand-off cost more than the device gains.)
    #
    #     host:    forward N+1 | finish N (wait) | (masks on their thread) | sample N+1 | forward N+2 | finish N+1 ...
    #     device:  ... N ..........| N+1 forward ...............................| sample | N+2 ...

    @property
    def busy(self) -> bool:
        """A launched step is still to finish."""
        return self.in_flight is not None or self.waiting is not None

    @property
    def launches_async(self) -> bool:
        """A launch only queues the step's work (CUDA), so stepping() returns to its caller at once
        and yields what it waits for; a CPU runner computes the whole step as it launches it."""
        return self.device.type == "cuda"

    def step(self, plan: StepPlan) -> list[StepResult]:
        """Launch `plan`; return the results finished meanwhile (the step before it), in order."""
        return run_waiting(self.stepping(plan))

    def flush(self) -> list[StepResult]:
        """Finish the step in flight, if any."""
        return run_waiting(self.flushing())

    def stepping(self, plan: StepPlan) -> Steps:
        """step() as a generator that yields what it is about to wait for (Waits says what) and
        returns the results: its caller waits its own way (the executor: between the event loop's
        other work, not on a thread that must win the interpreter lock back)."""
        self._make_current()
        with self.timing.step(len(plan.req_ids), plan.num_tokens):
            yield from self._masks_filled()
            done = self._queue_waiting()
            previous, self.in_flight = self.in_flight, None
            wait = previous is not None and self.sampling.needs_host_tokens(plan.req_ids, previous.rows)
            if self.failed:
                plan = self._without_failed(plan)
            holes = np.flatnonzero(plan.token_ids < 0)
            try:
                forward = self._forward(plan, previous, holes)
                if wait:  # its requests' tokens are inputs of the forward pass just queued
                    yield from self._landing(previous)
                    done.append(self._finish_or_fail(previous, previous.rows.keys() & set(plan.req_ids)))
                    previous = None
                launched = self._sample(forward, background=wait)
                if isinstance(launched, Sampling):
                    self.waiting = launched
                else:
                    self.in_flight = launched
                self.timing.launched()
            except Exception:  # a failed step fails the requests that fail it alone, not the engine
                if not self.isolate_failures:
                    raise
                log.exception("step failed; running it again to find its failing requests", step=plan.step_id,
                              num_reqs=len(plan.req_ids))
                plan.token_ids[holes] = PLACEHOLDER  # as planned: the retries fill them in again
                if previous is not None:
                    done.append(self._finish_or_fail(previous))
                    previous = None
                done.append(self._isolate(plan))
            if previous is not None:
                yield from self._landing(previous)
                done.append(self._finish_or_fail(previous))
            self.dropped.clear()
            return done

    def flushing(self) -> Steps:
        """flush() as stepping() is step()."""
        self._make_current()
        yield from self._masks_filled()
        done = self._queue_waiting()
        previous, self.in_flight = self.in_flight, None
        if previous is not None:
            yield from self._landing(previous)
            done.append(self._finish_or_fail(previous))
        return done

    def _masks_filled(self) -> Steps:
        """Waits for the masks of the step waiting for them, if still filling."""
        job = None if self.waiting is None else self.waiting.masks.job
        if job is not None and not job.done():
            yield job

    @staticmethod
    def _landing(flight: InFlight) -> Steps:
        """Waits for a launched step's tokens to reach the host, if they have not."""
        if flight.ready is not None and not is_done(flight.ready):
            yield flight.ready

    def _isolate(self, plan: StepPlan) -> StepResult:
        """The result of a step whose launch failed, computed again in parts, each launched and
        finished at once: a part that fails is halved until single requests fail alone; those end
        with their error, the rest get the tokens the whole step would have given them (sampling
        depends only on a request's own seed and position). Recomputing K/V rewrites the same
        values in the same slots. An accelerator error (the device itself failed) fails all."""
        merged = StepResult(plan.step_id, [], [])
        parts = [np.arange(len(plan.req_ids))]
        while parts:
            rows = parts.pop()
            part = plan.subset(rows)
            try:
                result = self._run_now(part)
            except Exception as exc:
                if len(rows) == 1 or isinstance(exc, _DEVICE_ERRORS):
                    log.error("request failed its step", step=plan.step_id, request_ids=part.req_ids[:8],
                              error=repr(exc))
                    self.failed.update(part.req_ids)
                    merged.failed.update((r, f"{type(exc).__name__}: {exc}") for r in part.req_ids)
                else:
                    half = len(rows) // 2
                    parts += [rows[half:], rows[:half]]  # the first half runs first: plan order
                continue
            merged.req_ids += result.req_ids
            merged.token_ids += result.token_ids
            merged.logprobs.update(result.logprobs)
            merged.prompt_logprobs.update(result.prompt_logprobs)
            merged.jumps.update(result.jumps)
            merged.accepted.update(result.accepted)
            merged.drafts.update(result.drafts)
        return merged

    def _run_now(self, plan: StepPlan) -> StepResult:
        flight = self._launch(plan, None, np.flatnonzero(plan.token_ids < 0))
        try:
            return self._finish(flight)
        except Exception:
            for state in flight.states:
                state.in_flight -= 1
            raise

    def _without_failed(self, plan: StepPlan) -> StepPlan:
        """`plan` less the requests that failed a step (planned again before their failure was known)."""
        self.failed.difference_update(plan.freed)
        if self.failed.isdisjoint(plan.req_ids):
            return plan
        return plan.subset(np.array([i for i, r in enumerate(plan.req_ids) if r not in self.failed], dtype=np.int64))

    def _queue_waiting(self) -> list[StepResult]:
        """Queue the sampler of the step waiting for its masks, now in flight; if that fails, the
        step's requests end with the error (its result)."""
        waiting, self.waiting = self.waiting, None
        if waiting is None:
            return []
        try:
            self.in_flight = self._queue(waiting)
            return []
        except Exception as exc:
            if not self.isolate_failures:
                raise
            log.exception("step failed", step=waiting.result.step_id, num_reqs=len(waiting.req_ids))
            self.failed.update(waiting.req_ids)
            return [StepResult(waiting.result.step_id, [], [],
                               failed={r: f"{type(exc).__name__}: {exc}" for r in waiting.req_ids})]

    def _launch(self, plan: StepPlan, previous: InFlight | None, holes: np.ndarray) -> InFlight:
        return self._sample(self._forward(plan, previous, holes))

    @torch.inference_mode()
    def _forward(self, plan: StepPlan, previous: InFlight | None, holes: np.ndarray) -> Forward:
        """Queue the step's forward pass and its logits (rows that sample, in plan order)."""
        for req_id in plan.freed:
            self.sampling.drop(req_id)
        self.drafting.forget(plan.freed)
        for req_id, new in plan.new_sequences.items():
            self.sampling.add(req_id, new)
        result = StepResult(plan.step_id, [], [])
        if not plan.req_ids:
            return Forward(result, [])
        inputs = StepInputs.build(plan.token_ids, plan.query_lens, plan.context_lens, plan.block_tables,
                                  self.block_size)
        qsl = inputs.query_start_loc
        from_device = fill_placeholders(plan, qsl, holes, None if previous is None else (previous.rows, previous.tokens),
                                        self.sampling.seqs, self.staging)
        decode = plan.num_tokens == len(plan.req_ids)
        graphed = self.graphs is not None and self.graphs.fits(len(plan.req_ids)) and decode
        mixed_graphed = (self.graphs is not None and not decode
                         and self.graphs.fits_tokens(plan.num_tokens, len(plan.req_ids), inputs.max_query_len))
        cascade = self._cascade(plan, inputs, mixed_graphed)
        if cascade is not None and graphed and not self.graphs.fits_cascade(len(plan.req_ids), cascade):
            cascade = None
        mixed_graphed = mixed_graphed and cascade is None  # (mixed and verify graphs have no cascade: it runs eagerly)
        self.cascade_steps += cascade is not None
        if graphed:  # hidden has the captured size's rows; those past the batch are padding
            hidden = self.graphs.run(inputs, from_device, cascade)
        elif mixed_graphed:
            hidden = self.graphs.run_tokens(inputs, from_device)
        else:
            input_ids, positions, meta = self.staging.forward_inputs(inputs, cascade)
            if from_device is not None:
                input_ids[from_device[0]] = from_device[1]
            hidden = self.model(input_ids, positions, meta)
        self.drafting.observe(plan.req_ids, plan.context_lens, qsl, hidden)

        rows = np.flatnonzero(plan.sample)
        result.req_ids = [plan.req_ids[i] for i in rows]
        result.prompt_logprobs = prompt_logprobs(plan, qsl, hidden, self.sampling.seqs, self.model.compute_logits,
                                                 self.staging.to_device)
        if not result.req_ids:
            return Forward(result, list(plan.req_ids))
        drafts = None
        if graphed and len(rows) == len(plan.req_ids):  # every row samples: lm_head at the captured size
            logits = self.model.compute_logits(hidden)[:len(rows)]
        else:
            last = qsl[1:][rows] - 1
            if plan.drafts:  # a request checking k drafts samples at its last k + 1 positions
                ks = np.array([plan.drafts.get(r, 0) for r in result.req_ids], dtype=np.int64)
                drafts = [plan.token_ids[end - k + 1:end + 1].tolist() for end, k in zip(last.tolist(), ks.tolist())]
                last = spread(last, ks)
            num = len(last)
            if mixed_graphed and self.graphs.fits(num):  # padded to a captured batch size: a shape cuBLAS has met
                last = np.pad(last, (0, self.graphs.batch_size(num) - num), mode="edge")
            logits = self.model.compute_logits(hidden[self.staging.to_device(last)])[:num]
        draft_probs = self.drafting.checked_against(result.req_ids, drafts)  # drafts drawn from a distribution
        return Forward(result, list(plan.req_ids), logits, drafts, plan.propose, draft_probs)

    def _cascade(self, plan: StepPlan, inputs: StepInputs, graphed: bool) -> PrefixGroups | None:
        """The plan's prefix groups if this step attends them once per group (cascade attention):
        always where cache.cascade_attention says so, by the backend's cost model for "auto". In a
        step with prompt rows, only requests of at most MAX_CASCADE_QUERY tokens join their groups
        (at most twice max_num_seqs rows in all), and where the step has a graph (`graphed`: one
        without cascade) the model weighs running it eagerly too."""
        groups = plan.prefix_groups
        if groups is None or not self.cascade:
            return None
        query_lens = np.diff(inputs.query_start_loc)
        if inputs.max_query_len > 1:
            groups = groups.only(query_lens <= MAX_CASCADE_QUERY)
            if groups is None:
                return None
            covered = np.zeros(len(query_lens), dtype=bool)
            covered[groups.members] = True
            if int(query_lens[covered].sum()) > 2 * self.config.scheduler.max_num_seqs:
                return None  # their partial results (float32, row x head x slot) are memory the KV sizing left out
        if self.config.cache.cascade_attention == "auto":
            sizes = np.add.reduceat(query_lens[groups.members], groups.starts[:-1])
            heads = self.spec.num_heads // tp().size  # this rank's
            if not self.backend.cascade_pays(sizes, groups.hi - groups.lo, heads, self.kv.kv_heads, self.spec.head_dim,
                                             self.device, eager_ns=EAGER_LAYER_NS if graphed else 0.0):
                return None
        return groups

    @torch.inference_mode()
    def _sample(self, forward: Forward, background: bool = False) -> InFlight | Sampling:
        """Queue the sampling of a step whose forward pass is queued, and the copy of its tokens to
        the host. background: a step with masks to fill has them filled on the mask thread and
        comes back as Sampling, for _queue() (its constraints must not move before)."""
        result, logits, drafts, draft_probs = forward.result, forward.logits, forward.drafts, forward.draft_probs
        if logits is None:
            return InFlight(result, forward.req_ids)
        if ((self.failed and not self.failed.isdisjoint(result.req_ids))  # failed by the step finished meanwhile
                or (self.dropped and not self.dropped.isdisjoint(result.req_ids))):  # or jumped there
            keep = [i for i, r in enumerate(result.req_ids) if r not in self.failed and r not in self.dropped]
            result.req_ids = [result.req_ids[i] for i in keep]
            if not keep:
                return InFlight(result, forward.req_ids)
            rows = np.array(keep, dtype=np.int64)
            if drafts is not None:
                spans = np.array([len(d) + 1 for d in drafts], dtype=np.int64)
                rows = spread(np.cumsum(spans)[rows] - 1, spans[rows] - 1)
                drafts = [drafts[i] for i in keep]
                draft_probs = None if draft_probs is None else [draft_probs[i] for i in keep]
            logits = logits[self.staging.to_device(rows)]
        states = [self.sampling.seqs[r] for r in result.req_ids]
        batch = self.sampling.batch(states, logits.shape[-1], drafts)
        masks = self.sampling.masks(states, logits.shape[-1], background=background, drafts=drafts)
        sampling = Sampling(result, forward.req_ids, logits, states, batch, masks, drafts, forward.propose,
                             draft_probs)
        # waiting for masks the mask thread fills (with drafts they were filled here: queued now)
        return sampling if masks is not None and masks.job is not None else self._queue(sampling)

    @torch.inference_mode()
    def _queue(self, sampling: Sampling) -> InFlight:
        """Queue a step's sampler (its masks filled) and the copy of its tokens to the host."""
        result, logits, states, batch = sampling.result, sampling.logits, sampling.states, sampling.batch
        mask_errors = {}
        if sampling.masks is not None:
            batch.allowed = sampling.masks.send()
            mask_errors = sampling.masks.errors()
        processed = process_logits(logits, batch, self.backend.apply_token_mask)
        tokens = draw(processed, batch, self.backend.sample_rows, self.backend.sample_filtered_rows)
        offsets = None if sampling.drafts is None else \
            np.concatenate([[0], np.cumsum([len(d) + 1 for d in sampling.drafts])[:-1]]).tolist()
        if sampling.draft_probs is not None and any(q is not None for q in sampling.draft_probs):
            check_drawn_drafts(processed, batch, tokens, offsets, sampling.drafts, sampling.draft_probs, self.staging,
                               self.backend.check_drafts)
        flight = InFlight(result, sampling.req_ids, states, tokens,
                          {r: i for i, r in enumerate(result.req_ids)} if offsets is None else dict(zip(result.req_ids, offsets)),
                          mask_errors=mask_errors, drafts=sampling.drafts, offsets=offsets, propose=sampling.propose,
                          masks=sampling.masks)
        if batch.max_logprobs >= 0:
            flight.logprob_parts = gather_logprobs(torch.log_softmax(logits, -1, dtype=torch.float32), tokens,
                                                   batch.max_logprobs)
        if tokens.is_cuda:
            flight.tokens_host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            flight.tokens_host.copy_(tokens, non_blocking=True)
            flight.ready = torch.cuda.Event()
            flight.ready.record()
        else:
            flight.tokens_host = tokens
        for state in states:
            state.in_flight += 1
        return flight

    def _finish_or_fail(self, flight: InFlight, ahead: set[str] | frozenset = frozenset()) -> StepResult:
        """The launched step's result; if finishing it fails (its sampled tokens are lost), its
        requests end with the error."""
        try:
            return self._finish(flight, ahead)
        except Exception as exc:
            if not self.isolate_failures:
                raise
            log.exception("step failed", step=flight.result.step_id, num_reqs=len(flight.req_ids))
            self.failed.update(flight.req_ids)
            return StepResult(flight.result.step_id, [], [],
                              failed={r: f"{type(exc).__name__}: {exc}" for r in flight.req_ids})

    def _finish(self, flight: InFlight, ahead: set[str] | frozenset = frozenset()) -> StepResult:
        """The step's tokens on the host, accepted by their requests' constraints. `ahead`: requests
        whose token is an input of the step launched meanwhile; one that jumps forward is dropped
        from that step's sampling (`dropped_next`), and the token's computation there is taken back
        where the jump replaces it."""
        result = flight.result
        if flight.tokens is None:
            return result
        if flight.ready is not None:
            flight.ready.synchronize()
        drawn = flight.tokens_host.tolist()
        if flight.drafts is None:
            result.token_ids = drawn
        else:
            keep_confirmed(result, drawn, flight.offsets, flight.drafts)
        if flight.logprob_parts is not None:  # one entry per token produced (drafts kept: several)
            want = [i for i, s in enumerate(flight.states) if s.params.logprobs is not None]
            produced = [result.accepted.get(result.req_ids[i], [result.token_ids[i]]) for i in want]
            first = want if flight.offsets is None else [flight.offsets[i] for i in want]
            rows = [row + j for row, tokens in zip(first, produced) for j in range(len(tokens))]
            parts = tuple(p[rows] for p in flight.logprob_parts)
            lps = iter(to_token_logprobs([t for tokens in produced for t in tokens], parts,
                                         [flight.states[i].params.logprobs for i, tokens in zip(want, produced)
                                          for _ in tokens]))
            for i, tokens in zip(want, produced):
                result.logprobs[result.req_ids[i]] = [next(lps) for _ in tokens]
        eos = frozenset(self.sampling.eos_token_ids) if self.sampling.host_sampled else ()
        # a step without drafts: its masked requests' tokens checked and accepted at once
        masked = flight.masks is not None and flight.drafts is None
        refused = self.sampling.accept_masked(flight.states, result.token_ids, flight.masks) if masked else {}
        for i, (req_id, state, token) in enumerate(zip(result.req_ids, flight.states, result.token_ids)):
            if i in flight.mask_errors:  # its constraint filled no mask: sampled from all, it fails alone
                log.error("constraint failed to fill its mask", request_id=req_id, error=flight.mask_errors[i])
                self._fail(result, req_id, flight.mask_errors[i])
                continue
            if i in refused:
                log.error("constraint failed", request_id=req_id, error=refused[i])
                self._fail(result, req_id, refused[i])
                continue
            produced = None
            try:  # harmless for a request freed meanwhile: its state is gone
                if not (masked and state.constraints):
                    produced = result.accepted.get(req_id) if result.accepted else None
                    state.accept(produced or [token])
                if not state.constraints:
                    continue
                token = state.output_ids[-1]  # (with drafts kept: what a jump would follow)
                if token in eos:  # it ends here (ignore_eos is refused with constraints, min_tokens bans it
                    if req_id in ahead:  # before): the step launched meanwhile need not sample it
                        self.dropped.add(req_id)
                elif state.jumper is not None and (jumped := state.jump(token, self.max_model_len)):
                    result.jumps[req_id] = jumped
                    if req_id in ahead:
                        result.dropped_next.add(req_id)
                        self.dropped.add(req_id)
            except Exception as exc:  # a constraint that cannot take its own token: this request fails alone
                drawn_under = len(produced or [token])  # its rows whose draws it kept
                if flight.masks is not None and flight.masks.empty_rows().get(i, drawn_under) < drawn_under:
                    self._fail(result, req_id, state.nothing_allowed())  # drawn where its mask allowed nothing
                    continue
                log.exception("constraint failed", request_id=req_id)
                self._fail(result, req_id, f"{type(exc).__name__}: {exc}")
        self.drafting.finished(result, flight.propose, self.sampling.seqs)
        return result

    def _fail(self, result: StepResult, req_id: str, error: str) -> None:
        """`req_id` fails alone in this step: its constraint failed."""
        result.failed[req_id] = error
        self.failed.add(req_id)

