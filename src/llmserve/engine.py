"""The engine: builds the model runner and the pure logic, then runs the four actors in one anyio
task group. Offline (`LLM`) and online (the server) both drive it through `generate` and `abort`.

    API --Submit/Abort--> request actor --NewRequests/FinishRequests--> scheduler --StepProposal--> KV manager
          <-- OutputSlot --        ^                                   ^   ^                          |
                                   +------------ EngineOutputs --------+   +-- StepFeedback ----------+
                                                                       +-- StepResult <-- executor <-- StepPlan
"""

from __future__ import annotations

import abc
import atexit
import gc
import math
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
from anyio.abc import ObjectReceiveStream, ObjectSendStream

from llmserve.actors.executor_actor import ExecutorActor
from llmserve.actors.kv_actor import KVActor
from llmserve.actors.request_actor import Abort, EndAll, OutputSlot, RequestActor, Submit
from llmserve.actors.scheduler_actor import EngineStats, SchedulerActor
from llmserve.attention import AttentionBackend
from llmserve.config import EngineConfig, SpeculativeConfig
from llmserve.core.kv_cache_manager import KVCacheManager
from llmserve.core.scheduler import Scheduler
from llmserve.distributed.parallel_state import single_rank
from llmserve.distributed.workers import RankRunner, check_split, start_ranks
from llmserve.model.runner import ModelRunner
from llmserve.model.spec import ModelSpec, sampling_defaults
from llmserve.outputs import RequestOutput
from llmserve.plugin_manager import Plugins
from llmserve.quantization import QuantizationMethod, Unquantized
from llmserve.sampling_params import SamplingParams
from llmserve.speculative import Proposer, ProposerContext, Speculation

log = structlog.get_logger("llmserve.engine")


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """Counters and gauges for metrics and admission control, read on the engine's event loop."""
    running: int
    waiting: int
    kv_usage: float
    prefix_queries: int
    prefix_hits: int
    preemptions: int
    prompt_tokens: int
    generation_tokens: int
    jumped_tokens: int = 0
    """Of the generated tokens, those a decoding strategy forced in (jump-forward), not sampled."""
    iteration_tokens: tuple[int, ...] = ()
    """Steps by the tokens they computed, a count per bucket (Scheduler.iteration_tokens)."""
    iteration_tokens_sum: int = 0
    num_blocks: int = 0
    """KV-cache blocks of the device side (0 until it has allocated them)."""
    spec_drafts: int = 0
    """Speculative decoding: steps of a request that checked drafts, the drafts checked, those kept,
    and those kept at each draft position (empty without speculation)."""
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


def freeze_heap() -> None:
    """Hide everything alive now (imported libraries, the model's modules, the tokenizer) from the
    garbage collector: its full collections then scan per-request objects only, instead of pausing
    the step loop to scan everything the engine holds."""
    gc.unfreeze()  # what an earlier engine froze and has since dropped can go now
    gc.collect()
    gc.freeze()
    # At exit, the interpreter's last collection frees everything as usual (registered once).
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("model.device is 'cuda' but no CUDA device is available")
    return device


def resolve_dtype(name: str, spec: ModelSpec, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu" and spec.torch_dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return spec.torch_dtype


def resolve_max_model_len(config: EngineConfig, spec: ModelSpec) -> int:
    limit = spec.max_position_embeddings
    wanted = config.model.max_model_len
    if wanted is not None and wanted > limit:
        raise ValueError(f"model.max_model_len is {wanted} but the model supports at most {limit} positions")
    return wanted or limit


def load_tokenizer(path: str):
    """The checkpoint's tokenizer, or None where the directory has none (transformers not imported)."""
    if not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


def load_in_background(fn, *args) -> Future:
    """fn(*args) on a thread of its own, started now; the Future's result() waits for it."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=getattr(fn, "__name__", "background"))
    try:
        return pool.submit(fn, *args)
    finally:
        pool.shutdown(wait=False)  # the thread ends with its one task


BUILTIN_MODEL_DIR = Path(__file__).parent / "builtin_model"


def resolve_model_dir(name: str) -> str:
    """"builtin" names the ~6M-parameter model shipped in the package; anything else is a directory."""
    return str(BUILTIN_MODEL_DIR) if name == "builtin" else name


def resolve_sampling_defaults(config: EngineConfig) -> dict[str, float | int]:
    """What requests leaving a sampling value unset take instead of the OpenAI default (the
    checkpoint's generation_config.json under model.generation_config = "auto", then
    model.override_generation_config over it), checked once here."""
    defaults = {}
    if config.model.generation_config == "auto":
        try:
            defaults = sampling_defaults(config.model.model)
            SamplingParams(**defaults)
        except ValueError as exc:
            raise ValueError(f"{config.model.model}/generation_config.json: {exc}") from None
    return {**defaults, **config.model.override_generation_config}


def resolve_quantization(name: str | None, spec: ModelSpec, plugins: Plugins) -> QuantizationMethod:
    """The method named by model.quantization, or the one that reads a pre-quantized checkpoint's
    quantization_config (its quant_method is a registered name), or none."""
    methods = plugins.quantization_methods()
    ckpt = spec.quantization_config
    ckpt_method = ckpt.get("quant_method") if ckpt else None
    if name is None and ckpt_method is None:
        return Unquantized()
    if name is not None and ckpt_method is not None and name != ckpt_method:
        raise ValueError(f"model.quantization {name!r} conflicts with the checkpoint, which is quantized with "
                         f"{ckpt_method!r} (config.json quantization_config); leave model.quantization unset")
    name = name or ckpt_method
    if name not in methods:
        where = "model.quantization" if ckpt_method is None else "the checkpoint's quantization_config.quant_method"
        raise ValueError(f"{where} {name!r} is not available; registered methods: {sorted(methods) or 'none'}")
    return methods[name](ckpt)


def resolve_proposer(config: SpeculativeConfig, plugins: Plugins, context: ProposerContext) -> Proposer | None:
    """The proposer speculative.method names (None: no speculation)."""
    if config.method is None:
        return None
    proposers = plugins.proposers()
    if config.method not in proposers:
        raise ValueError(f"speculative.method {config.method!r} is not available; registered proposers: "
                         f"{sorted(proposers) or 'none'}")
    return proposers[config.method](config, context)


def build_runner(config: EngineConfig, plugins: Plugins, spec: ModelSpec, max_model_len: int, *,
                 device: torch.device, dtype: torch.dtype, quant: QuantizationMethod, backend: AttentionBackend,
                 strategies: dict[str, Any], proposer: bool = True, isolate_failures: bool = True) -> ModelRunner:
    """The model runner of this process (of one tensor-parallel rank under tensor parallelism);
    proposer: with speculative decoding's proposer, if configured (its draft model is whole on
    this rank)."""
    context = ProposerContext(device, dtype, backend, spec.vocab_size, max_model_len, config.scheduler.max_num_seqs,
                              config.cache.block_size)
    with single_rank():
        drafts = resolve_proposer(config.speculative, plugins, context) if proposer else None
    return ModelRunner(config, spec, backend, device, dtype, max_model_len, quant, strategies, drafts,
                       plugins.model_classes().get(spec.architecture), isolate_failures=isolate_failures)


class Frontend(abc.ABC):
    """What the APIs drive: `generate`, `abort`, `stop` and `snapshot`, through a request actor on
    this event loop. `Engine` runs the device side on the same loop; `ProcessEngine`
    (engine_process.py) runs it in a child process, so HTTP work never delays a step."""

    config: EngineConfig
    spec: ModelSpec
    max_model_len: int
    device: torch.device | str
    kv_tokens: int
    """Tokens the KV cache holds."""
    sampling_defaults: dict[str, float | int]
    """Sampling values for requests that leave them unset (resolve_sampling_defaults)."""

    def __init__(self, config: EngineConfig, plugins: Plugins | None = None, *, with_tokenizer: bool = True,
                 tokenizer: Future | None = None) -> None:
        """What both sides need: the plugins, the checkpoint's shape, the context limit, the
        tokenizer. The tokenizer loads on a thread meanwhile (importing transformers alone takes
        seconds): it overlaps the device side's start-up, which waits for the GPU and Triton's
        compiler. `tokenizer`: one already loading (shared by data-parallel replicas)."""
        config.model.model = resolve_model_dir(config.model.model)
        self.config = config
        self.plugins = plugins or Plugins.from_config(config.plugins)
        self.spec = ModelSpec.from_dir(config.model.model, self.plugins.model_classes())
        self.max_model_len = resolve_max_model_len(config, self.spec)
        self.sampling_defaults = resolve_sampling_defaults(config)
        if tokenizer is not None:
            self._tokenizer = tokenizer
        elif with_tokenizer:
            self._tokenizer = load_in_background(load_tokenizer, config.model.tokenizer or config.model.model)
        else:
            self._tokenizer = Future()
            self._tokenizer.set_result(None)
        self._requests_in: ObjectSendStream | None = None
        self._stop: anyio.Event | None = None
        self.failure: Exception | None = None
        """Why the device side stopped, if it failed after start-up."""
        self.strategies: dict[str, Any] = {}
        """Decoding strategies (llmserve/decoding.py) the request actor prepares requests for."""

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (None if it has none), once loaded; its loading error, if any."""
        return self._tokenizer.result()

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The ids that end a request: the checkpoint's and its tokenizer's."""
        eos = set(self.spec.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        return frozenset(eos)

    def _request_actor(self, inbox: ObjectReceiveStream, to_scheduler: ObjectSendStream) -> RequestActor:
        return RequestActor(self.tokenizer, vocab_size=self.spec.vocab_size, max_model_len=self.max_model_len,
                            inbox=inbox, to_scheduler=to_scheduler,
                            step_tokens=self.config.scheduler.max_num_batched_tokens, strategies=self.strategies,
                            eos_token_ids=tuple(sorted(self.eos_token_ids)))

    @abc.abstractmethod
    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Run until `stop()`; reports started once requests are accepted."""

    @abc.abstractmethod
    def snapshot(self) -> EngineSnapshot:
        """The device side's counters and gauges (for metrics and admission control)."""

    def release(self) -> None:
        """Give device memory back after `run` returned (a no-op where the device side exits with run)."""

    async def _accept_until_stopped(self, requests_in: ObjectSendStream, task_status: anyio.abc.TaskStatus) -> None:
        self._stop = anyio.Event()
        self._requests_in = requests_in
        task_status.started()
        try:
            await self._stop.wait()
        finally:
            self._requests_in = None

    @property
    def running(self) -> bool:
        return self._requests_in is not None

    def stop(self) -> None:
        if self._stop is not None:
            self._stop.set()

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None, *,
                       request_id: str | None = None, priority: int = 0, add_special_tokens: bool = True,
                       strict_length: bool = False, final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Submit one request; yields its cumulative output as it grows, the last one finished.

        With final_only, only the finished output is yielded (cheapest for batch use).
        Raises ValueError for a bad prompt or parameters (this request only). Leaving the loop
        early (break, cancellation, client gone) aborts the request and frees its blocks.
        """
        sub = Submit(request_id or uuid.uuid4().hex, prompt, params or SamplingParams(), OutputSlot(), priority,
                     add_special_tokens, strict_length, final_only)
        submitted = False
        try:
            await self.submit([sub])
            submitted = True
        finally:
            if not submitted:  # cancelled while the inbox was full: the submission may have gone through
                await self._abort_shielded(sub.req_id)
        async for out in self.outputs(sub):
            yield out

    async def submit(self, subs: list[Submit]) -> None:
        """Hand requests to the engine in one message: the scheduler takes them all before it plans
        (an offline batch's first step is then full). Read each one's outputs with `outputs`."""
        if self._requests_in is None:
            raise RuntimeError("engine is not running" if self.failure is None else str(self.failure))
        await self._requests_in.send(subs)

    async def outputs(self, sub: Submit) -> AsyncIterator[RequestOutput]:
        """A submitted request's cumulative outputs as `generate` yields them; leaving the loop
        early aborts the request."""
        finished = False
        try:
            while not finished:
                out = await sub.slot.get()
                finished = out.finished
                yield out
        except Exception:
            finished = True  # rejected or failed: the request actor has already ended it
            raise
        finally:
            if not finished:
                await self._abort_shielded(sub.req_id)

    async def abort(self, request_id: str) -> None:
        if self._requests_in is not None:
            await self._requests_in.send(Abort(request_id))

    async def end_all(self, reason: str) -> None:
        """End every request in flight, and refuse later ones, with ShuttingDown(reason): each
        reader raises it (the server's streams end with it as their error)."""
        if self._requests_in is not None:
            with anyio.CancelScope(shield=True):
                await self._requests_in.send(EndAll(reason))

    async def _abort_shielded(self, request_id: str) -> None:
        """Abort from a cancelled task (a client gone); aborting an unknown id does nothing."""
        with anyio.CancelScope(shield=True):
            await self.abort(request_id)


class EngineFailed(RuntimeError):
    """The device side failed after start-up; the engine has stopped."""


def _root(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio's task groups wrap what their tasks raise)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


class _Laps:
    """lap(name) -> the seconds since the previous lap (or creation), also kept in .seconds[name]."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def __call__(self, name: str) -> float:
        now = time.perf_counter()
        self.seconds[name], self._last = now - self._last, now
        return self.seconds[name]


class Engine(Frontend):
    """Everything in this process: the request actor and the device side on one event loop."""

    def __init__(self, config: EngineConfig, plugins: Plugins | None = None, *, with_tokenizer: bool = True) -> None:
        """with_tokenizer=False: a device side only (the engine process), told the tokenizer's
        end-of-sequence id later through `add_eos_token_id`."""
        lap = _Laps()
        if config.parallel.data_parallel_size > 1:
            raise ValueError("parallel.data_parallel_size > 1 runs replicas behind the server (llmserve serve); "
                             "one engine in this process is one replica")
        super().__init__(config, plugins, with_tokenizer=with_tokenizer)
        m = config.model
        self.quant = resolve_quantization(m.quantization, self.spec, self.plugins)
        self.device = resolve_device(m.device)
        self.dtype = resolve_dtype(m.dtype, self.spec, self.device)
        self.backend = self.plugins.select_backend(self.device, config)
        lap("config")
        self.strategies = self.plugins.decoding_strategies()
        p = config.parallel
        if p.tensor_parallel_size > 1 or p.distributed_executor_backend == "ray":
            check_split(self.spec, p.tensor_parallel_size)  # the ranks build their runners (distributed/workers.py)
            self.runner = start_ranks(config, self.max_model_len)
        else:
            self.runner = build_runner(config, self.plugins, self.spec, self.max_model_len, device=self.device,
                                       dtype=self.dtype, quant=self.quant, backend=self.backend,
                                       strategies=self.strategies)
        lap("weights")
        try:
            num_blocks = self._allocate_cache(lap)
        except BaseException:
            self.runner.release()  # its device memory (a tensor-parallel runner: its processes) goes back first
            raise
        s = config.scheduler
        self.kv = KVCacheManager(num_blocks, config.cache.block_size, max_model_len=self.max_model_len,
                                 reserve_growth=s.reserve_growth, prefix_groups=self.runner.cascade,
                                 window=self.spec.kv_window)
        self.scheduler = Scheduler(max_num_batched_tokens=s.max_num_batched_tokens, max_num_seqs=s.max_num_seqs,
                                   max_model_len=self.max_model_len, policy=s.policy,
                                   eos_token_ids=frozenset(self.spec.eos_token_ids),
                                   enable_prefix_caching=config.cache.enable_prefix_caching,
                                   speculation=Speculation.of(config.speculative))
        self.add_eos_token_id(None if self.tokenizer is None else self.tokenizer.eos_token_id)
        lap("tokenizer")  # what was left of its loading: the wait for its thread
        self.stats = EngineStats(s.log_interval_s)
        freeze_heap()
        lap("actors")
        # seconds of each start-up phase, in order (a cold start's Triton compiles fall in the
        # profiling step and the graph capture; the tokenizer loads on a thread from the start)
        self.startup_phases = lap.seconds
        log.info("engine ready", model=m.model, architecture=self.spec.architecture, device=str(self.device),
                 dtype=str(self.dtype).removeprefix("torch."), backend=self.backend.name, max_model_len=self.max_model_len,
                 kv_blocks=num_blocks, kv_tokens=self.kv_tokens,
                 kv_gib=round(num_blocks * self.runner.block_bytes() / 2**30, 3),
                 sampling_defaults=self.sampling_defaults or "openai",
                 startup_s={k: round(v, 2) for k, v in self.startup_phases.items()})

    def _allocate_cache(self, lap: _Laps) -> int:
        """Size the KV cache, allocate it, capture the CUDA graphs (which bake in its address); its blocks."""
        config, m = self.config, self.config.model
        num_blocks = self.runner.determine_num_blocks()
        lap("profile_step")
        bs = config.cache.block_size
        if num_blocks * bs < self.max_model_len:
            raise ValueError(
                f"max_model_len {self.max_model_len} needs {-(-self.max_model_len // bs)} KV blocks of {bs} tokens, "
                f"but only {num_blocks} fit ({num_blocks * self.runner.block_bytes() / 2**30:.2f} GiB); lower "
                f"model.max_model_len or give the cache more memory (cache.gpu_memory_utilization / cache.cpu_kv_cache_gib)")
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_tokens = num_blocks * bs
        lap("kv_cache")
        if self.device.type == "cuda" and not m.enforce_eager:
            s = config.scheduler
            self.runner.capture_graphs(s.max_num_seqs, s.max_num_batched_tokens)
            graphs = self.runner.graphs
            log.info("captured CUDA graphs", decode_sizes=len(graphs.sizes), max_batch=s.max_num_seqs,
                     mixed_sizes=len(graphs.token_sizes), max_tokens=s.max_num_batched_tokens,
                     seconds=round(lap("cuda_graphs"), 2))
        return num_blocks

    def add_eos_token_id(self, token_id: int | None) -> None:
        """The tokenizer's end-of-sequence id ends requests (unless ignore_eos) besides the
        checkpoint's own, and min_tokens holds it back like them."""
        if token_id is not None:
            self.scheduler.eos_token_ids |= {token_id}
            self.runner.eos_token_ids = sorted(self.scheduler.eos_token_ids)

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """Run the actors until `stop()`; reports started once they accept requests. If the device
        side fails (a tensor-parallel rank died), every request in flight ends with that error and
        run raises it."""
        req_send, req_recv = anyio.create_memory_object_stream(64)
        requests: list[RequestActor] = []

        async def core(*, task_status: anyio.abc.TaskStatus) -> None:
            try:
                await self.run_core(req_send.clone(), task_status=task_status)
            except Exception as exc:
                self.failure = error = EngineFailed(f"the engine failed: {_root(exc)}")
                for actor in requests:
                    actor.fail_all(error)
                raise error from exc

        async with anyio.create_task_group() as tg:
            to_scheduler = await tg.start(core)
            requests.append(self._request_actor(req_recv, to_scheduler))
            await tg.start(requests[0].run)
            await self._accept_until_stopped(req_send, task_status)
            tg.cancel_scope.cancel()

    async def run_core(self, to_requests: ObjectSendStream, *,
                       task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        """The device side alone: the scheduler, the KV manager and the executor, until cancelled.
        Reports started with the scheduler's inbox (send NewRequests / FinishRequests there);
        EngineOutputs go to `to_requests`."""
        # The step's path (scheduler -> KV manager -> executor -> scheduler) sends without waiting:
        # a send that waits is a checkpoint, where the request actor's work would run between a
        # step's result and the launch of the next. What the streams hold is bounded all the same:
        # the scheduler's inbox by the requests in the engine (arrivals, finishes) plus one feedback
        # and one result, the KV manager's and the executor's by the scheduler's steps in flight
        # (two) and one FinishInFlight.
        sched_send, sched_recv = anyio.create_memory_object_stream(math.inf)
        kv_send, kv_recv = anyio.create_memory_object_stream(math.inf)
        exec_send, exec_recv = anyio.create_memory_object_stream(math.inf)
        actors = [
            SchedulerActor(self.scheduler, self.stats, inbox=sched_recv, to_kv=kv_send, to_requests=to_requests,
                           async_scheduling=self.config.scheduler.async_scheduling),
            KVActor(self.kv, inbox=kv_recv, to_executor=exec_send, to_scheduler=sched_send.clone()),
            ExecutorActor(self.runner, inbox=exec_recv, to_scheduler=sched_send.clone(),
                          launch_here=not isinstance(self.runner, RankRunner) and self.runner.launches_async),
        ]
        async with anyio.create_task_group() as tg:
            for actor in actors:
                await tg.start(actor.run)
            task_status.started(sched_send)

    def snapshot(self) -> EngineSnapshot:
        s, kv = self.scheduler, self.kv
        return EngineSnapshot(s.num_running, s.num_waiting, kv.pool.usage(), kv.prefix_queries, kv.prefix_hits,
                              s.num_preemptions, s.prompt_tokens, s.generation_tokens, s.jumped_tokens,
                              tuple(s.iteration_tokens), s.iteration_tokens_sum, kv.pool.num_blocks,
                              s.spec.drafts, s.spec.draft_tokens, s.spec.accepted_tokens,
                              tuple(s.spec.accepted_per_pos))

    def release(self) -> None:
        """Give the device memory (weights, KV cache) back; the engine cannot run afterwards."""
        gc.unfreeze()  # the engine's objects become collectable again
        self.runner.release()
