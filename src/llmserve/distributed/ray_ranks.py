"""The ranks as Ray actors: tensor parallelism across the machines of a Ray cluster
(`parallel.distributed_executor_backend = "ray"`, `pip install llmserve[ray]`).

The engine connects to the cluster as `ray.init()` finds it (RAY_ADDRESS, or one started on this
machine with `ray start --head`; else a local one of its own), reserves one bundle a rank in a
placement group (a GPU each on CUDA, a CPU each otherwise; PACK: one machine where one has room),
and starts a `_Rank` actor in each. Rank 0 names a free port on its machine; every rank joins the
torch.distributed group there (NCCL on CUDA, gloo on CPU) and builds its ModelRunner as a local
rank process does (workers.build_rank). Each call is one remote method call per rank; the plan is
pickled and put in the object store once, and read by every rank.

A rank whose actor dies, or whose call raises, ends the engine as a local rank does: the others are
killed and the error names the rank.
"""

from __future__ import annotations

import dataclasses
import pickle
import socket
from typing import Any

from llmserve.config import EngineConfig
from llmserve.distributed.workers import RankFailed, RankRunner, build_rank, describe, dispatch

PLACEMENT_TIMEOUT_S = 120.0
"""How long to wait for the cluster to find room for every rank."""


class _Rank:
    """One rank in a Ray actor (wrapped by ray.remote in RayRanks)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size, self.runner = rank, size, None

    def address(self) -> str:
        """A tcp:// address on this actor's machine for the group to meet at."""
        import ray
        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return f"tcp://{host}:{s.getsockname()[1]}"

    def start(self, init_method: str, config: EngineConfig, max_model_len: int) -> tuple[str, Any]:
        # Ray gives a GPU actor its own device, which it sees as device 0; a cluster's actors may
        # be on several machines (no symmetric memory between them)
        try:
            self.runner, info = build_rank(self.rank, self.size, init_method, config, max_model_len, device_offset=0,
                                           one_host=False)
            return "ok", info
        except BaseException as exc:
            return "error", (isinstance(exc, ValueError), describe(exc))

    def call(self, method: str, message: bytes, everyone: bool) -> tuple[str, Any]:
        try:
            value = dispatch(self.runner, method, pickle.loads(message))
            return "ok", value if self.rank == 0 or everyone else None
        except BaseException as exc:
            return "error", (False, describe(exc))


class RayRanks(RankRunner):
    def __init__(self, config: EngineConfig, max_model_len: int, size: int) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ValueError("parallel.distributed_executor_backend 'ray' needs the ray package: "
                             "pip install 'llmserve[ray]'") from None
        super().__init__(size)
        self._ray, self._remove_group = ray, remove_placement_group
        if not ray.is_initialized():
            ray.init(log_to_driver=False)
        cuda = config.model.device.startswith("cuda") or (config.model.device == "auto" and _cluster_has_gpus(ray))
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        self._group = placement_group([bundle] * size, strategy="PACK")
        try:
            ray.get(self._group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            self._remove_group(self._group)
            raise ValueError(f"the Ray cluster has no room for {size} rank(s) of {bundle} within "
                             f"{PLACEMENT_TIMEOUT_S:.0f} s (ray status lists its resources)") from None
        actor = ray.remote(num_cpus=1, num_gpus=1 if cuda else 0)(_Rank)
        self._actors = [actor.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._group, placement_group_bundle_index=rank)).remote(rank, size)
            for rank in range(size)]
        try:
            init_method = ray.get(self._actors[0].address.remote())
            # each GPU actor sees its one device as cuda:0
            local = dataclasses.replace(config, model=dataclasses.replace(config.model, device="cuda" if cuda else "cpu"))
            config_ref = ray.put(local)
            info = self._gather([a.start.remote(init_method, config_ref, max_model_len) for a in self._actors], "start")
        except BaseException:
            self.release()
            raise
        self._started(info[0])

    def _exchange(self, method: str, args: tuple, everyone: bool) -> list[Any]:
        if not self._actors:
            raise RankFailed("the tensor-parallel ranks have stopped")
        # pickled once, whatever the number of ranks; as bytes, since the object store would hand
        # the ranks read-only arrays (a rank writes its plan's placeholders)
        message = self._ray.put(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
        return self._gather([a.call.remote(method, message, everyone) for a in self._actors], method)

    def _gather(self, refs: list, method: str) -> list[Any]:
        ray = self._ray
        values: list[Any] = [None] * self.size
        pending = {ref: rank for rank, ref in enumerate(refs)}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    status, value = ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    self._fail(rank, f"its actor died during {method!r} ({type(exc).__name__})")
                except ray.exceptions.RayError as exc:
                    self._fail(rank, f"{type(exc).__name__} during {method!r}: {exc}")
                if status == "error":
                    self._fail(rank, value[1], value_error=value[0])
                values[rank] = value
        return values

    def _stop_all(self) -> None:
        for actor in self._actors:
            self._ray.kill(actor)
        self._actors = []
        self._remove_group(self._group)

    def release(self) -> None:
        if self._actors:
            self._stop_all()


def _cluster_has_gpus(ray) -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0
