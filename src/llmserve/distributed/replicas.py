"""Data parallelism: `data_parallel_size` engines behind one frontend (the server's).

Each replica is a ProcessEngine: its device side (scheduler, KV manager, executor, and its
tensor-parallel ranks) in a process of its own, on devices of its own (replica i's first device is
i * tensor_parallel_size), its request actor on the server's loop. A submission (one request's
prompts, kept together: their samples share prompt blocks) goes to one replica:

    load(i)   = running + waiting in replica i's latest snapshot (at most one step old), plus the
                requests sent to it since that snapshot arrived
    choice    = the replica that last served the submission's prefix (its first PREFIX_CHARS
                characters or PREFIX_TOKENS ids), where its prefix cache likely holds it, unless its
                load exceeds the least loaded one's by more than AFFINITY_SLACK; else the least
                loaded (ties: the least KV-cache usage)

Aborts go to every replica (an id a replica does not know is ignored there). The snapshot, and so
/metrics, sums the replicas' counters; KV usage is the share of all their blocks in use. A replica
whose process dies stops the whole frontend, as a single engine's would.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from concurrent.futures import Future

import anyio
import torch

from llmserve.actors.request_actor import Submit
from llmserve.config import EngineConfig
from llmserve.engine import EngineSnapshot, Frontend, load_in_background
from llmserve.engine_process import ProcessEngine

PREFIX_CHARS = 256
PREFIX_TOKENS = 64
AFFINITY_SLACK = 8
"""Requests a replica may be ahead of the least loaded one and still take a prefix it served."""
AFFINITY_ENTRIES = 1 << 16


def replica_config(config: EngineConfig, index: int) -> EngineConfig:
    """Replica `index`'s config: one replica (itself), on its own devices."""
    device = config.model.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        first = int(device.partition(":")[2] or 0)
        device = f"cuda:{first + index * config.parallel.tensor_parallel_size}"
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=device),
                               parallel=dataclasses.replace(config.parallel, data_parallel_size=1))


class ReplicatedEngine(Frontend):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        shared: Future = load_in_background(lambda: self.tokenizer)  # one tokenizer for every replica
        self.replicas = [ProcessEngine(replica_config(config, i), tokenizer=shared)
                         for i in range(config.parallel.data_parallel_size)]
        self.device = "starting"
        self.kv_tokens = 0
        self._sent = [0] * len(self.replicas)  # requests sent to each since its snapshot last changed
        self._seen: list[EngineSnapshot | None] = [None] * len(self.replicas)
        self._affinity: OrderedDict[object, int] = OrderedDict()

    async def run(self, *, task_status: anyio.abc.TaskStatus = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            async with anyio.create_task_group() as starting:  # the replicas start side by side
                for replica in self.replicas:
                    starting.start_soon(tg.start, replica.run)
            self.device = ", ".join(str(r.device) for r in self.replicas)
            self.kv_tokens = sum(r.kv_tokens for r in self.replicas)
            self._stop = anyio.Event()
            task_status.started()
            try:
                await self._stop.wait()
            finally:
                for replica in self.replicas:
                    replica.stop()

    @property
    def running(self) -> bool:
        return all(r.running for r in self.replicas)

    def stop(self) -> None:
        super().stop()
        for replica in self.replicas:
            replica.stop()

    async def submit(self, subs: list[Submit]) -> None:
        index = self._choose(subs)
        self._sent[index] += len(subs)
        await self.replicas[index].submit(subs)

    async def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            await replica.abort(request_id)

    async def end_all(self, reason: str) -> None:
        for replica in self.replicas:
            await replica.end_all(reason)

    def snapshot(self) -> EngineSnapshot:
        snaps = [r.snapshot() for r in self.replicas]
        blocks = sum(s.num_blocks for s in snaps)
        total = {f.name: _sum([getattr(s, f.name) for s in snaps]) for f in dataclasses.fields(EngineSnapshot)}
        total["kv_usage"] = sum(s.kv_usage * s.num_blocks for s in snaps) / blocks if blocks else 0.0
        return EngineSnapshot(**total)

    def loads(self) -> list[int]:
        """Each replica's running and waiting requests, and those sent since its last snapshot."""
        out = []
        for i, replica in enumerate(self.replicas):
            snap = replica.snapshot()
            if snap is not self._seen[i]:
                self._seen[i], self._sent[i] = snap, 0
            out.append(snap.running + snap.waiting + self._sent[i])
        return out

    def _choose(self, subs: list[Submit]) -> int:
        loads = self.loads()
        least = min(range(len(loads)), key=lambda i: (loads[i], self.replicas[i].snapshot().kv_usage))
        key = _prefix_key(subs[0].prompt) if subs else None
        index = least
        if key is not None:
            preferred = self._affinity.get(key)
            if preferred is not None and loads[preferred] - loads[least] <= AFFINITY_SLACK:
                index = preferred
            self._affinity[key] = index
            self._affinity.move_to_end(key)
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        return index


def _prefix_key(prompt: str | list[int]) -> object:
    return prompt[:PREFIX_CHARS] if isinstance(prompt, str) else tuple(prompt[:PREFIX_TOKENS])


def _sum(values: list):
    if isinstance(values[0], tuple):  # per-bucket or per-position counts: bucket by bucket
        width = max(map(len, values))
        return tuple(sum(v[j] for v in values if j < len(v)) for j in range(width))
    return sum(values)
