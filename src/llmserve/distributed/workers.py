"""Tensor parallelism's processes: one per rank, each holding a ModelRunner over its slice of the
model, driven from the engine as one runner (`RankRunner`: `ProcessRanks` here, `RayRanks` in
ray_ranks.py).

Every rank runs every step in full: the same plan, the same forward pass (its layers' collectives
meet the other ranks'), the same logits (gathered), so the same sampled tokens, since the sampler
draws from each request's seed and position alone. Ranks therefore share no tokens, only the
plan, and rank 0's result is the step's result. Only rank 0 proposes drafts (speculative decoding):
its draft model is whole on its own device, and the drafts reach the others in the next plans.

    engine process                             rank processes (python -m llmserve.distributed)
    ExecutorActor -> ProcessRanks.step(plan)  
                      pickle once, send to all ─► rank 0: runner.step(plan) ─┐ all-reduce per layer,
                                               ─► rank 1: runner.step(plan) ─┤ all-gather of logits
                                               ─► ...                        ─┘ (NCCL on CUDA, gloo on CPU)
                      rank 0's StepResults ◄───── each rank's reply (rank 0: results; others: None)

A call waits for every rank's reply, watching the processes meanwhile: a rank that exits or raises
ends the engine with that rank's error (the others are killed: they may be waiting in a collective
for it). A step that fails therefore stops the engine under tensor parallelism, where one rank
alone retrying parts of a step would leave the others in collectives it no longer makes.
"""

from __future__ import annotations

import abc
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from multiprocessing.connection import Connection, wait
from types import SimpleNamespace
from typing import Any

import structlog

from llmserve.config import EngineConfig
from llmserve.distributed.parallel_state import TensorParallel
from llmserve.messages import StepPlan, StepResult
from llmserve.model.spec import ModelSpec
from llmserve.model.step_timing import StepTiming

log = structlog.get_logger("llmserve.workers")

COLLECTIVE_TIMEOUT_S = 1800.0
"""torch.distributed's own limit on a collective; a rank's death is noticed sooner, by its process."""


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or raised: the engine cannot go on."""


def check_split(spec: ModelSpec, size: int) -> None:
    """Raise ValueError, before any process starts, if the model does not divide over `size` ranks."""
    group = TensorParallel(size)
    group.split(spec.num_heads, "num_attention_heads")
    group.kv_split(spec.num_kv_heads)
    group.split(spec.intermediate_size, "intermediate_size")
    if spec.moe is not None:
        group.split(spec.moe.intermediate_size, "moe_intermediate_size")
        if spec.moe.shared_intermediate_size:
            group.split(spec.moe.shared_intermediate_size, "shared_expert_intermediate_size")


def start_ranks(config: EngineConfig, max_model_len: int) -> RankRunner:
    """The ranks of parallel.tensor_parallel_size, started by parallel.distributed_executor_backend."""
    size = config.parallel.tensor_parallel_size
    if config.parallel.distributed_executor_backend == "ray":
        from llmserve.distributed.ray_ranks import RayRanks
        return RayRanks(config, max_model_len, size)
    return ProcessRanks(config, max_model_len, size)


class RankRunner(abc.ABC):
    """What the engine calls on a ModelRunner (step, flush, busy, the KV cache's sizing and
    allocation, graph capture, prompt_logits, release), for `size` ranks. A transport (local
    processes, Ray actors) provides `_call`, `_stop_all` and `release`."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.timing = StepTiming()  # host time of each step call, here
        self.graphs: SimpleNamespace | None = None
        self.num_blocks = 0
        self._busy = False
        self._eos_token_ids: list[int] = []
        self._lock = threading.Lock()

    def _started(self, info: dict) -> None:
        """Rank 0's report once every rank has built its runner."""
        self.block_size, self.cascade = info["block_size"], info["cascade"]

    def _call(self, method: str, *args: Any, everyone: bool = False) -> Any:
        """runner.`method`(*args) on every rank; rank 0's return value (every rank's, in rank order,
        with everyone). A rank that fails meanwhile ends them all (`_fail`). One call at a time:
        the engine's thread steps while another (a benchmark, a test) may read a value, and the
        ranks must meet every call in the same order."""
        with self._lock:
            values = self._exchange(method, args, everyone)
        return values if everyone else values[0]

    @abc.abstractmethod
    def _exchange(self, method: str, args: tuple, everyone: bool) -> list[Any]:
        """Send the call to every rank and gather their replies, in rank order."""

    @abc.abstractmethod
    def _stop_all(self) -> None:
        """End every rank at once, whatever it is doing."""

    @abc.abstractmethod
    def release(self) -> None:
        """Stop the ranks (their device memory goes with them)."""

    def _fail(self, rank: int, why: str, value_error: bool = False) -> None:
        self._stop_all()  # the others may wait for it in a collective: nothing would wake them
        log.error("tensor-parallel rank failed; stopping the engine", rank=rank, error=why)
        raise (ValueError(why) if value_error else RankFailed(f"tensor-parallel rank {rank} failed: {why}"))

    # ---- the ModelRunner surface -----------------------------------------------------------------

    @property
    def busy(self) -> bool:
        return self._busy

    def step(self, plan: StepPlan) -> list[StepResult]:
        with self.timing.step(len(plan.req_ids), plan.num_tokens):
            return self._steps("step", plan)

    def flush(self) -> list[StepResult]:
        return self._steps("flush")

    def block_bytes(self) -> int:
        return self._call("block_bytes")

    def determine_num_blocks(self) -> int:
        """The fewest blocks any rank's memory holds: block tables are the same on every rank."""
        return min(self._call("determine_num_blocks", everyone=True))

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._call("allocate_kv_cache", num_blocks)
        self.num_blocks = num_blocks

    def capture_graphs(self, max_batch: int, max_tokens: int) -> None:
        sizes, token_sizes = self._call("capture_graphs", max_batch, max_tokens)
        self.graphs = SimpleNamespace(sizes=sizes, token_sizes=token_sizes)

    @property
    def eos_token_ids(self) -> list[int]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: list[int]) -> None:
        self._call("set", "eos_token_ids", ids)
        self._eos_token_ids = ids

    @property
    def cascade_steps(self) -> int:
        return self._call("get", "cascade_steps")

    def prompt_logits(self, token_ids: list[int]):
        return self._call("prompt_logits", token_ids)

    def rank_timing(self, action: str) -> dict | None:
        """Rank 0's own StepTiming: "clear", "time_device" (CUDA events around its steps), or
        "report" (its StepTiming.report(): the steps as the rank saw them, launch and wait)."""
        if action not in ("clear", "time_device", "report"):
            raise ValueError(f"rank_timing: unknown action {action!r}")
        return self._call("timing", action)

    def _steps(self, method: str, *args: Any) -> list[StepResult]:
        results, self._busy = self._call(method, *args)
        return results


class ProcessRanks(RankRunner):
    """The ranks as local processes, each on a socket to this one."""

    def __init__(self, config: EngineConfig, max_model_len: int, size: int) -> None:
        super().__init__(size)
        self._store = tempfile.mkdtemp(prefix="llmserve-tp-")
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        # Started as `python -m` (not multiprocessing's spawn, which would run the caller's script
        # again in each rank, as a script without a __main__ guard would notice).
        for rank in range(size):
            here, there = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "llmserve.distributed", str(there.fileno()),
                                     str(os.getpid())], pass_fds=(there.fileno(),))
            there.close()
            conn = Connection(here.detach())
            conn.send_bytes(pickle.dumps((rank, size, f"file://{self._store}/store", config, max_model_len)))
            self._conns.append(conn)
            self._procs.append(proc)
        try:
            info = self._gather("ready")
        except BaseException:
            self.release()
            raise
        self._started(info[0])

    def release(self) -> None:
        """Stop the rank processes (their device memory goes with them)."""
        for conn in self._conns:
            try:
                conn.send_bytes(pickle.dumps(("exit", (), False)))
            except OSError:
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass  # killed below
        self._stop_all()

    # ---- calls -----------------------------------------------------------------------------------

    def _exchange(self, method: str, args: tuple, everyone: bool) -> list[Any]:
        if not self._procs:
            raise RankFailed("the tensor-parallel ranks have stopped")
        message = pickle.dumps((method, args, everyone), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(message)
            except OSError:
                self._fail(rank, "its pipe closed")
        return self._gather(method)  # (the plan was pickled once, whatever the number of ranks)

    def _gather(self, method: str) -> list[Any]:
        """Every rank's reply to the call just sent; a rank that exits or raises meanwhile ends them all."""
        values: list[Any] = [None] * self.size
        pending = dict(enumerate(self._conns))
        while pending:
            ready = wait(list(pending.values()))
            for rank, conn in list(pending.items()):
                if conn not in ready:
                    continue
                try:
                    status, value = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):  # its process ended (its end of the socket closed with it)
                    try:
                        code = self._procs[rank].wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = "unknown (still running)"
                    self._fail(rank, f"its process exited with code {code} during {method!r}")
                if status == "error":
                    self._fail(rank, value[1], value_error=value[0])
                values[rank] = value
                del pending[rank]
        return values

    def _stop_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            proc.wait()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
        shutil.rmtree(self._store, ignore_errors=True)


def build_rank(rank: int, size: int, init_method: str, config: EngineConfig, max_model_len: int,
               device_offset: int, one_host: bool = True) -> tuple[Any, dict]:
    """Join the group as `rank` and build this rank's ModelRunner on model.device's index plus
    `device_offset` (CUDA) -> (runner, what the engine needs to know of it). one_host: the ranks
    share a machine, so small all-reduces may go through symmetric memory (else NCCL does all)."""
    import torch

    from llmserve.distributed import parallel_state
    from llmserve.engine import build_runner, resolve_device, resolve_dtype, resolve_quantization
    from llmserve.plugin_manager import Plugins

    device = resolve_device(config.model.device)
    if device.type == "cuda":
        device = torch.device("cuda", (device.index or 0) + device_offset)
        torch.cuda.set_device(device)
    else:  # ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    parallel_state.init_tensor_parallel(rank, size, "nccl" if device.type == "cuda" else "gloo", init_method,
                                        COLLECTIVE_TIMEOUT_S)
    plugins = Plugins.from_config(config.plugins)
    spec = ModelSpec.from_dir(config.model.model, plugins.model_classes())
    dtype = resolve_dtype(config.model.dtype, spec, device)
    if device.type == "cuda" and one_host and not config.parallel.disable_custom_all_reduce:
        why = parallel_state.enable_one_shot(device, dtype)
        if why is not None and rank == 0:
            log.warning("small all-reduces stay with NCCL: no symmetric memory", reason=why)
    runner = build_runner(config, plugins, spec, max_model_len, device=device, dtype=dtype,
                          quant=resolve_quantization(config.model.quantization, spec, plugins),
                          backend=plugins.select_backend(device, config), strategies=plugins.decoding_strategies(),
                          proposer=rank == 0, isolate_failures=False)
    return runner, {"block_size": runner.block_size, "cascade": runner.cascade}


def rank_main(conn: Connection) -> None:
    """A rank's process: join the group, build its runner, then answer calls until told to exit."""
    rank, size, init_method, config, max_model_len = pickle.loads(conn.recv_bytes())
    try:
        runner, info = build_rank(rank, size, init_method, config, max_model_len, device_offset=rank)
        conn.send_bytes(pickle.dumps(("ok", info)))
    except BaseException as exc:
        conn.send_bytes(pickle.dumps(("error", (isinstance(exc, ValueError), describe(exc)))))
        return
    while True:
        try:
            method, args, everyone = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the engine is gone
        if method == "exit":
            return
        try:
            value = dispatch(runner, method, args)
            reply = ("ok", value if rank == 0 or everyone else None)
        except BaseException as exc:
            reply = ("error", (False, describe(exc)))
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        if reply[0] == "error":
            return


def dispatch(runner, method: str, args: tuple) -> Any:
    """runner.`method`(*args), as a rank answers the engine's call."""
    if method in ("step", "flush"):
        return getattr(runner, method)(*args), runner.busy
    if method == "capture_graphs":
        runner.capture_graphs(*args)
        return list(runner.graphs.sizes), list(runner.graphs.token_sizes)
    if method == "get":
        return getattr(runner, args[0])
    if method == "set":
        return setattr(runner, *args)
    if method == "timing":
        return getattr(runner.timing, args[0])()
    if method == "prompt_logits":
        return runner.prompt_logits(*args).cpu()
    return getattr(runner, method)(*args)


def describe(exc: BaseException) -> str:
    if isinstance(exc, ValueError):
        return str(exc)
    return "".join(traceback.format_exception_only(exc)).strip() + "\n" + "".join(traceback.format_tb(exc.__traceback__)[-3:])
