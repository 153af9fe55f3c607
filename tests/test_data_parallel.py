"""Data-parallel replicas behind one server: concurrent streams spread over two engine processes
and come back as one engine's would; the router balances by load and keeps a prefix where it
served it; /metrics adds the replicas up."""

import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from servers import MODEL, running_server

from llmserve import LLM, SamplingParams
from llmserve.actors.request_actor import OutputSlot, Submit
from llmserve.config import EngineConfig
from llmserve.distributed import replicas
from llmserve.distributed.replicas import ReplicatedEngine, replica_config
from llmserve.engine import EngineSnapshot

PROMPTS = [f"Item {i}: the list type" for i in range(8)]


@functools.cache
def one_engines_texts() -> list[str]:
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM("builtin", device="cpu", dtype="float32", log_interval_s=0) as llm:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_two_replicas_serve_concurrent_streams_as_one_engine():
    serve_through_two_replicas({"data_parallel_size": 2})


def test_two_replicas_place_their_ranks_on_a_local_ray_cluster(monkeypatch):
    """Each replica's engine process joins the cluster (RAY_ADDRESS) and runs its rank as an actor."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, object_store_memory=128 * 2**20, include_dashboard=False, log_to_driver=False)
    try:
        monkeypatch.setenv("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        serve_through_two_replicas({"data_parallel_size": 2, "distributed_executor_backend": "ray"},
                                   # two ranks' bundles of one CPU each are reserved in the cluster
                                   during=lambda: ray.available_resources().get("CPU") == 2)
    finally:
        ray.shutdown()


def serve_through_two_replicas(parallel: dict, during=lambda: True) -> None:
    want = one_engines_texts()
    with running_server(parallel=parallel) as server:
        assert during()
        engine = server.engine
        assert isinstance(engine, ReplicatedEngine) and len({r.pid for r in engine.replicas}) == 2
        client = server.client()

        def stream(prompt: str) -> str:
            chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            return "".join(c.choices[0].text for c in chunks)

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(stream, PROMPTS))
        assert got == want
        snaps = [r.snapshot() for r in engine.replicas]
        assert all(s.generation_tokens > 0 for s in snaps)  # both replicas took requests
        assert sum(s.generation_tokens for s in snaps) == 16 * len(PROMPTS)
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f'llmserve_generation_tokens_total{{model_name="{MODEL}"}} {16.0 * len(PROMPTS)}' in metrics


def _snap(running=0, waiting=0, usage=0.0):
    return EngineSnapshot(running, waiting, usage, 0, 0, 0, 0, 0, num_blocks=100)


def test_the_router_takes_the_least_loaded_unless_a_prefix_pays(monkeypatch):
    config = EngineConfig.from_kwargs(model="builtin", device="cpu", data_parallel_size=3)
    engine = ReplicatedEngine(config)
    snaps = [_snap(5), _snap(2), _snap(2, usage=0.5)]
    for replica, i in zip(engine.replicas, range(3)):
        monkeypatch.setattr(replica, "snapshot", lambda i=i: snaps[i])

    def sub(prompt):
        return [Submit("r", prompt, SamplingParams(), OutputSlot())]

    assert engine._choose(sub("a system prompt. Question 1")) == 1  # least loaded; ties: less KV in use
    engine._sent[1] += 1
    assert engine._choose(sub("another prompt")) == 2  # one sent to 1 since its snapshot: 2 is lighter now
    engine._sent[2] += 1
    snaps[1] = _snap(2 + replicas.AFFINITY_SLACK)  # a new snapshot: what was sent is counted in it
    assert engine._choose(sub("a system prompt. Question 1")) == 1  # its prefix is there: within the slack
    snaps[1] = _snap(4 + replicas.AFFINITY_SLACK)
    assert engine._choose(sub("a system prompt. Question 1")) == 2  # too busy: the prefix moves
    assert engine._choose(sub("a system prompt. Question 1")) == 2
    total = engine.snapshot()
    assert (total.running, total.num_blocks) == (5 + 4 + replicas.AFFINITY_SLACK + 2, 300)
    assert total.kv_usage == pytest.approx(0.5 / 3)


def test_replicas_take_their_own_devices_and_one_engine_refuses_several():
    config = EngineConfig.from_kwargs(model="builtin", device="cuda", data_parallel_size=2, tensor_parallel_size=2)
    assert [replica_config(config, i).model.device for i in range(2)] == ["cuda:0", "cuda:2"]
    assert replica_config(config, 1).parallel == dataclasses.replace(config.parallel, data_parallel_size=1)
    assert replica_config(EngineConfig.from_kwargs(device="cpu"), 1).model.device == "cpu"
    with pytest.raises(ValueError, match="parallel.data_parallel_size > 1 runs replicas behind the server"):
        LLM("builtin", device="cpu", data_parallel_size=2)
    with pytest.raises(ValueError, match="parallel.data_parallel_size must be >= 1"):
        EngineConfig.from_kwargs(data_parallel_size=0)
