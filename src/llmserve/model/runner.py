"""The model runner: weights, KV cache and per-request sampling state on one device; turns a
StepPlan into a forward pass and sampled tokens.

Step inputs are derived from the plan with numpy vector ops (no Python loop over tokens):

    query_lens [2, 1, 3]  ->  query_start_loc [0, 2, 3, 6],  req_idx per token [0 0 1 2 2 2]
    positions  = context_len[req_idx] + (token index - query_start_loc[req_idx])
    slot       = block_table[req_idx, position // B] * B + position % B
"""

from __future__ import annotations

import gc
from array import array
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from llmserve.attention import AttentionBackend, AttentionMetadata, KVCache
from llmserve.config import EngineConfig
from llmserve.kernels.sampling import row_keys
from llmserve.messages import PLACEHOLDER, NewSequence, StepPlan, StepResult
from llmserve.model.cuda_graphs import StepGraphs
from llmserve.model.loader import load_model
from llmserve.model.pinned import PinnedRing
from llmserve.model.sampler import (Penalties, SamplingBatch, gather_logprobs, sample, to_token_logprobs)
from llmserve.model.spec import ModelSpec
from llmserve.model.step_timing import StepTiming
from llmserve.quantization import QuantizationMethod
from llmserve.sampling_params import SamplingParams

log = structlog.get_logger("llmserve.runner")

_DEVICE_ERRORS = (torch.AcceleratorError,) if hasattr(torch, "AcceleratorError") else ()
"""Errors of the device itself (a CUDA fault): every later launch fails too, so no part of a step
that raised one is retried."""


def _penalized(p: SamplingParams) -> bool:
    """Sampling that counts the request's own tokens (repetition, presence, frequency penalties)."""
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty) or bool(p.frequency_penalty)


@dataclass(slots=True)
class SeqState:
    params: SamplingParams
    prompt_ids: array  # int64
    output_ids: list[int]
    in_flight: int = 0  # tokens sampled by a launched step, not yet appended to output_ids
    bias: tuple[np.ndarray, np.ndarray] | None = None  # logit_bias as (int64 token ids, float32 values)

    @classmethod
    def of(cls, new: NewSequence) -> SeqState:
        bias = new.params.logit_bias
        arrays = None if not bias else (np.fromiter(bias.keys(), np.int64, len(bias)),
                                        np.fromiter(bias.values(), np.float32, len(bias)))
        return cls(new.params, new.prompt_token_ids, list(new.output_token_ids), bias=arrays)


@dataclass(slots=True)
class InFlight:
    """A launched step: its result so far and, if it samples, the device tokens on their way to
    pinned host memory (`ready` is recorded after that copy)."""
    result: StepResult
    req_ids: list[str]  # every request of the plan (failed together if finishing fails)
    states: list[SeqState] = field(default_factory=list)
    tokens: torch.Tensor | None = None  # int64 [num sampled], on the device
    rows: dict[str, int] = field(default_factory=dict)  # req_id -> row of `tokens`
    tokens_host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    logprob_parts: tuple[torch.Tensor, ...] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec, backend: AttentionBackend, device: torch.device,
                 dtype: torch.dtype, max_model_len: int, quant: QuantizationMethod | None = None) -> None:
        self.config, self.spec, self.backend, self.device, self.dtype = config, spec, backend, device, dtype
        self.block_size = config.cache.block_size
        self.kv_dtype = dtype if config.cache.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        self.max_model_len = max_model_len
        self.eos_token_ids = list(spec.eos_token_ids)
        self.model = load_model(config.model.model, spec, backend, dtype=dtype, device=device,
                                max_positions=max_model_len, quant=quant, load_format=config.model.load_format,
                                seed=config.model.seed)
        self.seqs: dict[str, SeqState] = {}
        self.num_blocks = 0
        self.graphs: StepGraphs | None = None
        self.timing = StepTiming()
        self.placeholders_filled = 0
        self.in_flight: InFlight | None = None
        self.host_sampled: set[str] = set()  # requests whose sampling reads their tokens on the host
        self.failed: set[str] = set()  # requests that failed a step, left out of the plans made before that was known
        self._pinned: PinnedRing | None = None

    # ---- KV cache ------------------------------------------------------------------------------

    def block_bytes(self) -> int:
        return self.block_size * self.spec.kv_bytes_per_token(self.kv_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.block_size, self.spec.num_kv_heads, self.spec.head_dim)

        def layer_cache() -> KVCache:
            cache = KVCache(torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
                            torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            if self.kv_dtype == torch.float8_e4m3fn:
                cache.k_scale = torch.zeros(shape[:3], dtype=torch.float32, device=self.device)
                cache.v_scale = torch.zeros(shape[:3], dtype=torch.float32, device=self.device)
            return cache

        self.model.set_kv_caches([layer_cache() for _ in range(self.spec.num_layers)])
        self.num_blocks = num_blocks

    def determine_num_blocks(self) -> int:
        """KV blocks that fit: fixed by config, from cpu_kv_cache_gib on CPU, or on CUDA what
        gpu_memory_utilization leaves after weights and the peak of a profiling step."""
        cache = self.config.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if self.device.type != "cuda":
            return int(cache.cpu_kv_cache_gib * 2**30) // self.block_bytes()
        peak_activations = self._profile_step()
        free, total = self.backend.memory_available(self.device)
        budget = total * cache.gpu_memory_utilization - (total - free) - peak_activations
        log.info("kv cache sizing", total_gib=round(total / 2**30, 2), used_gib=round((total - free) / 2**30, 2),
                 activation_peak_gib=round(peak_activations / 2**30, 2), kv_budget_gib=round(budget / 2**30, 2))
        return max(0, int(budget) // self.block_bytes())

    @torch.inference_mode()
    def _profile_step(self) -> int:
        """Run the largest step the scheduler can build; return its peak memory beyond the weights."""
        sched = self.config.scheduler
        num_tokens = min(sched.max_num_batched_tokens, sched.max_num_seqs * self.max_model_len)
        num_seqs = min(sched.max_num_seqs, num_tokens)
        lens = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
        lens[: num_tokens % num_seqs] += 1
        blocks_per_seq = -(-int(lens.max()) // self.block_size)
        self.allocate_kv_cache(num_seqs * blocks_per_seq)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        ids = torch.randint(0, self.spec.vocab_size, (num_tokens,), device=self.device)
        qsl = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        tables = np.arange(num_seqs * blocks_per_seq, dtype=np.int32).reshape(num_seqs, blocks_per_seq)
        meta, positions = self._metadata(lens.astype(np.int32), np.zeros(num_seqs, np.int32), tables, qsl)
        hidden = self.model(ids, positions, meta)
        rows = min(num_seqs, sched.max_num_seqs)
        logits = self.model.compute_logits(hidden[:rows])
        v = self.spec.vocab_size
        dev = self.device
        batch = SamplingBatch(temperature=torch.ones(rows, device=dev), top_k=torch.full((rows,), 50, device=dev),
                              top_p=torch.full((rows,), 0.9, device=dev), min_p=torch.zeros(rows, device=dev),
                              keys=torch.zeros(rows, dtype=torch.int64, device=dev), all_greedy=False,
                              filtered_rows=torch.arange(rows, device=dev), max_logprobs=min(20, v))
        sample(logits, batch, self.backend.sample_rows, self.backend.sample_filtered_rows)
        torch.log_softmax(logits, -1, dtype=torch.float32).topk(batch.max_logprobs, -1)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.model.set_kv_caches([None] * self.spec.num_layers)
        del hidden, logits, ids
        torch.cuda.empty_cache()
        return peak

    def release(self) -> None:
        """Drop weights and KV cache so their device memory returns to the system."""
        self.model.set_kv_caches([None] * self.spec.num_layers)
        self.model = None
        self.graphs = None
        self._pinned = None
        self.seqs.clear()
        self.host_sampled.clear()
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()

    # ---- one step ------------------------------------------------------------------------------

    def _positions_and_slots(self, query_lens: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray,
                             qsl: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        num_tokens = int(qsl[-1])
        req_idx = np.repeat(np.arange(len(query_lens)), query_lens)
        positions = context_lens[req_idx].astype(np.int64) + (np.arange(num_tokens) - qsl[:-1][req_idx])
        slots = block_tables[req_idx, positions // self.block_size].astype(np.int64) * self.block_size \
            + positions % self.block_size
        return positions, slots

    def _metadata(self, query_lens: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray,
                  qsl: np.ndarray) -> tuple[AttentionMetadata, torch.Tensor]:
        positions, slots = self._positions_and_slots(query_lens, context_lens, block_tables, qsl)
        to_dev = self._to_device
        meta = AttentionMetadata(
            slot_mapping=to_dev(slots),
            block_tables=to_dev(block_tables),
            query_start_loc=to_dev(qsl),
            seq_lens=to_dev((context_lens + query_lens).astype(np.int32)),
            max_query_len=int(query_lens.max()) if len(query_lens) else 0,
        )
        return meta, to_dev(positions)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A host array on the device, queued without waiting for the device: through pinned memory
        (model/pinned.py). From pageable memory the driver stages larger copies (a mixed step's
        64 KB of token ids) only after the stream's earlier work, so the host would wait for the
        step in flight before launching more."""
        if self.device.type != "cuda":
            return torch.from_numpy(array)
        if self._pinned is None:
            self._pinned = PinnedRing(self.device)
        return self._pinned.to_device(array)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """float32 logits [len(token_ids), vocab] of one prompt run as a single prefill in KV blocks
        0, 1, ... (overwriting them: only while no request is running). For quality measurements."""
        n = len(token_ids)
        blocks = -(-n // self.block_size)
        if blocks > self.num_blocks or n > self.max_model_len:
            raise ValueError(f"a prompt of {n} tokens needs {blocks} KV blocks and max_model_len >= {n}")
        qsl = np.array([0, n], dtype=np.int32)
        meta, positions = self._metadata(np.array([n], dtype=np.int32), np.zeros(1, dtype=np.int32),
                                         np.arange(blocks, dtype=np.int32)[None], qsl)
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        return self.model.compute_logits(self.model(ids, positions, meta)).float()

    def capture_graphs(self, max_batch: int, max_tokens: int, emulate: bool = False) -> None:
        """Capture CUDA graphs of decode steps up to `max_batch` requests and of mixed steps up to
        `max_tokens` tokens (after the KV cache is allocated: they bake in its address).
        emulate: no capture; steps run eagerly over the graphs' padded buffers (tests without CUDA)."""
        max_blocks = -(-self.max_model_len // self.block_size)
        self.graphs = StepGraphs(self.model, self.device, max_batch, max_tokens, max_blocks, emulate=emulate)
        self.graphs.capture()

    # Steps are launched, then finished. launch() queues the forward pass and the sampler on the
    # device and starts a non-blocking copy of the sampled tokens to pinned memory; finish() waits
    # for that copy alone and builds the StepResult. step(N + 1) launches N + 1 *before* finishing
    # N, so the device does not wait for the host between two steps:
    #
    #     host:    launch N+1 | finish N (wait) | launch N+2 | finish N+1 (wait) | ...
    #     device:  ... N ........| N+1 .........................| N+2 ...
    #
    # N+1's inputs that are N's sampled tokens (PLACEHOLDER) are copied device to device from N's
    # token tensor. A request whose sampling needs N's token on the host (penalties, min_tokens)
    # makes step() finish N first.

    def step(self, plan: StepPlan) -> list[StepResult]:
        """Launch `plan`; return the results finished meanwhile (the step before it), in order."""
        with self.timing.step(len(plan.req_ids), plan.num_tokens):
            done: list[StepResult] = []
            previous, self.in_flight = self.in_flight, None
            if previous is not None and self._needs_host_tokens(plan, previous):
                done.append(self._finish_or_fail(previous))
                previous = None
            if self.failed:
                plan = self._without_failed(plan)
            holes = np.flatnonzero(plan.token_ids < 0)
            try:
                self.in_flight = self._launch(plan, previous, holes)
                self.timing.launched()
            except Exception:  # a failed step fails the requests that fail it alone, not the engine
                log.exception("step failed; running it again to find its failing requests", step=plan.step_id,
                              num_reqs=len(plan.req_ids))
                plan.token_ids[holes] = PLACEHOLDER  # as planned: the retries fill them in again
                if previous is not None:
                    done.append(self._finish_or_fail(previous))
                    previous = None
                done.append(self._isolate(plan))
            if previous is not None:
                done.append(self._finish_or_fail(previous))
            return done

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

    def flush(self) -> list[StepResult]:
        """Finish the step in flight, if any."""
        previous, self.in_flight = self.in_flight, None
        return [] if previous is None else [self._finish_or_fail(previous)]

    def _needs_host_tokens(self, plan: StepPlan, previous: InFlight) -> bool:
        """Whether a request of `plan` samples with its previous token, still in flight, on the host:
        penalties count output tokens; min_tokens bans stop tokens until it is reached."""
        if not self.host_sampled:  # the common case: no such request at all
            return False
        planned = set(plan.req_ids)
        for req_id in self.host_sampled:
            if req_id in planned and req_id in previous.rows:
                state = self.seqs[req_id]
                if _penalized(state.params) or len(state.output_ids) < state.params.min_tokens:
                    return True
        return False

    @torch.inference_mode()
    def _launch(self, plan: StepPlan, previous: InFlight | None, holes: np.ndarray) -> InFlight:
        for req_id in plan.freed:
            self.seqs.pop(req_id, None)
            self.host_sampled.discard(req_id)
        for req_id, new in plan.new_sequences.items():
            self.seqs[req_id] = SeqState.of(new)
            if _penalized(new.params) or new.params.min_tokens > 0:
                self.host_sampled.add(req_id)
        result = StepResult(plan.step_id, [], [])
        if not plan.req_ids:
            return InFlight(result, [])
        qsl = np.zeros(len(plan.req_ids) + 1, dtype=np.int32)
        np.cumsum(plan.query_lens, out=qsl[1:])
        from_device = self._fill_placeholders(plan, qsl, previous, holes)
        decode = plan.num_tokens == len(plan.req_ids)
        graphed = self.graphs is not None and self.graphs.fits(len(plan.req_ids)) and decode
        mixed_graphed = (self.graphs is not None and not decode
                         and self.graphs.fits_mixed(plan.num_tokens, len(plan.req_ids)))
        if graphed or mixed_graphed:  # hidden has the captured size's rows; those past the batch are padding
            positions, slots = self._positions_and_slots(plan.query_lens, plan.context_lens, plan.block_tables, qsl)
            seq_lens = plan.context_lens + plan.query_lens
            if graphed:
                hidden = self.graphs.run(plan.token_ids, positions, slots, seq_lens, plan.block_tables, from_device)
            else:
                hidden = self.graphs.run_mixed(plan.token_ids, positions, slots, qsl, seq_lens, plan.block_tables,
                                               from_device)
        else:
            meta, positions = self._metadata(plan.query_lens, plan.context_lens, plan.block_tables, qsl)
            input_ids = self._to_device(plan.token_ids)
            if from_device is not None:
                input_ids[from_device[0]] = from_device[1]
            hidden = self.model(input_ids, positions, meta)

        rows = np.flatnonzero(plan.sample)
        result.req_ids = [plan.req_ids[i] for i in rows]
        self._prompt_logprobs(plan, qsl, hidden, result)
        if not result.req_ids:
            return InFlight(result, list(plan.req_ids))
        if graphed and len(rows) == len(plan.req_ids):  # every row samples: lm_head at the captured size
            logits = self.model.compute_logits(hidden)[:len(rows)]
        else:
            last = qsl[1:][rows] - 1
            if mixed_graphed:  # padded to a captured batch size, whose lm_head shape cuBLAS has met
                last = np.pad(last, (0, self.graphs.batch_size(len(last)) - len(last)), mode="edge")
            logits = self.model.compute_logits(hidden[self._to_device(last)])[:len(rows)]
        states = [self.seqs[r] for r in result.req_ids]
        batch = self._sampling_batch(states, logits.shape[-1])
        tokens = sample(logits, batch, self.backend.sample_rows, self.backend.sample_filtered_rows)
        flight = InFlight(result, list(plan.req_ids), states, tokens, {r: i for i, r in enumerate(result.req_ids)})
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

    def _finish_or_fail(self, flight: InFlight) -> StepResult:
        """The launched step's result; if finishing it fails (its sampled tokens are lost), its
        requests end with the error."""
        try:
            return self._finish(flight)
        except Exception as exc:
            log.exception("step failed", step=flight.result.step_id, num_reqs=len(flight.req_ids))
            self.failed.update(flight.req_ids)
            return StepResult(flight.result.step_id, [], [],
                              failed={r: f"{type(exc).__name__}: {exc}" for r in flight.req_ids})

    def _finish(self, flight: InFlight) -> StepResult:
        result = flight.result
        if flight.tokens is None:
            return result
        if flight.ready is not None:
            flight.ready.synchronize()
        result.token_ids = flight.tokens_host.tolist()
        if flight.logprob_parts is not None:
            want = [i for i, s in enumerate(flight.states) if s.params.logprobs is not None]
            parts = tuple(p[want] for p in flight.logprob_parts)
            for i, lp in zip(want, to_token_logprobs([result.token_ids[i] for i in want], parts,
                                                     [flight.states[i].params.logprobs for i in want])):
                result.logprobs[result.req_ids[i]] = lp
        for state, token in zip(flight.states, result.token_ids):
            state.output_ids.append(token)  # harmless for a request freed meanwhile: its state is gone
            state.in_flight -= 1
        return result

    def _fill_placeholders(self, plan: StepPlan, qsl: np.ndarray, previous: InFlight | None,
                           holes: np.ndarray) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A PLACEHOLDER input (at `holes`) is the token its request sampled in the step before
        (planned before that step had finished). Tokens already on the host go into plan.token_ids;
        those of the step still in flight come back as (positions, device tokens) to copy on the
        device."""
        if not holes.size:
            return None
        self.placeholders_filled += holes.size
        owners = [plan.req_ids[r] for r in np.searchsorted(qsl[1:], holes, side="right")]
        dst, src = [], []
        for hole, req_id in zip(holes.tolist(), owners):
            if previous is not None and req_id in previous.rows:
                dst.append(hole)
                src.append(previous.rows[req_id])
                plan.token_ids[hole] = 0  # overwritten on the device
            else:
                plan.token_ids[hole] = self.seqs[req_id].output_ids[-1]
        if not dst:
            return None
        to_dev = lambda xs: self._to_device(np.array(xs, dtype=np.int64))  # noqa: E731
        return to_dev(dst), previous.tokens[to_dev(src)]

    def _prompt_logprobs(self, plan: StepPlan, qsl: np.ndarray, hidden: torch.Tensor, result: StepResult) -> None:
        """Logprobs of each prompt token given the ones before it, for the prompt positions this step computed."""
        for i, req_id in enumerate(plan.req_ids):
            state = self.seqs[req_id]
            k = state.params.prompt_logprobs
            if k is None:
                continue
            start, n = int(plan.context_lens[i]), int(plan.query_lens[i])
            end = min(start + n, len(state.prompt_ids) - 1)  # positions that have a next prompt token
            if end > start:
                h = hidden[int(qsl[i]):int(qsl[i]) + end - start]
                logprobs = torch.log_softmax(self.model.compute_logits(h), -1, dtype=torch.float32)
                nxt = state.prompt_ids[start + 1:end + 1]
                parts = gather_logprobs(logprobs, self._to_device(np.array(nxt, dtype=np.int64)), k)
                result.prompt_logprobs[req_id] = to_token_logprobs(nxt, parts, [k] * len(nxt))

    def _sampling_batch(self, states: list[SeqState], vocab: int) -> SamplingBatch:
        params = [s.params for s in states]
        # never a blocking copy: it would wait for the forward pass queued before it
        t = lambda xs, dtype: self._to_device(np.array(xs, dtype=dtype))  # noqa: E731
        batch = SamplingBatch(
            temperature=t([p.temperature for p in params], np.float32),
            top_k=t([min(p.top_k or vocab, vocab) for p in params], np.int64),
            top_p=t([p.top_p for p in params], np.float32),
            min_p=t([p.min_p for p in params], np.float32),
            keys=self._to_device(row_keys(np.array([p.seed for p in params], dtype=np.int64),
                                          np.array([len(s.output_ids) + s.in_flight for s in states],
                                                   dtype=np.int64))),
            all_greedy=all(p.temperature == 0 for p in params),
            max_logprobs=max((p.logprobs for p in params if p.logprobs is not None), default=-1),
        )
        filtered = [i for i, p in enumerate(params) if p.temperature > 0 and (p.top_k or p.top_p < 1.0 or p.min_p > 0)]
        if filtered:
            batch.filtered_rows = t(filtered, np.int64)
            batch.all_filtered = len(filtered) == len(params)
        if any(_penalized(p) for p in params):
            batch.penalties = Penalties(
                output_counts=self._scatter_rows([s.output_ids for s in states], vocab, torch.float32, True),
                prompt_mask=self._scatter_rows([s.prompt_ids for s in states], vocab, torch.bool, False),
                repetition=t([p.repetition_penalty for p in params], np.float32),
                presence=t([p.presence_penalty for p in params], np.float32),
                frequency=t([p.frequency_penalty for p in params], np.float32),
            )
        biased = [(i, s.bias) for i, s in enumerate(states) if s.bias is not None]
        if biased:
            rows = np.repeat(np.array([i for i, _ in biased], dtype=np.int64), [len(b[0]) for _, b in biased])
            batch.bias = (self._to_device(rows), self._to_device(np.concatenate([b[0] for _, b in biased])),
                          self._to_device(np.concatenate([b[1] for _, b in biased])))
        banned = [(i, tok) for i, s in enumerate(states) if len(s.output_ids) < s.params.min_tokens
                  for tok in (s.params.stop_token_ids + ([] if s.params.ignore_eos else self.eos_token_ids))]
        if banned:
            rows, toks = zip(*banned)
            batch.banned = (t(rows, np.int64), t(toks, np.int64))
        return batch

    def _scatter_rows(self, rows: list[list[int]], vocab: int, dtype: torch.dtype, count: bool) -> torch.Tensor:
        """[len(rows), vocab] tensor: per-row token counts (count=True) or presence."""
        out = torch.zeros(len(rows), vocab, dtype=dtype, device=self.device)
        lens = np.array([len(r) for r in rows])
        if lens.sum() == 0:
            return out
        row_idx = self._to_device(np.repeat(np.arange(len(rows)), lens))
        tok_idx = self._to_device(np.concatenate([np.asarray(r, dtype=np.int64) for r in rows]))
        value = torch.ones(len(tok_idx), dtype=dtype, device=self.device)
        return out.index_put_((row_idx, tok_idx), value, accumulate=count)
