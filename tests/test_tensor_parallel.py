"""Tensor parallelism on CPU: ranks are processes joined by gloo. Every architecture split over 2
ranks, and over 4 (more ranks than KV heads, tied embeddings, biases, experts), gives transformers'
greedy tokens (float32), as one rank does (test_equivalence.py); sampled tokens equal one rank's;
chunked prefill, prefix hits, preemption and n > 1 keep working; a rank that dies ends the engine
with its error at once; a model that does not divide over the ranks is refused before any starts."""

import threading
import time

import pytest
import torch
from test_equivalence import MAX_TOKENS, assert_pool_back_to_total, generate, reference

from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig
from llmserve.distributed.parallel_state import TensorParallel, all_gather_columns, all_reduce
from llmserve.testing import ARCHS


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_two_ranks_match_transformers(checkpoint, arch):
    prompts, expected = reference(checkpoint, arch)
    with LLM(checkpoint(arch), dtype="float32", device="cpu", tensor_parallel_size=2, log_interval_s=0) as llm:
        assert [o.outputs[0].token_ids for o in generate(llm, prompts)] == expected


@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-mha-tied", "qwen2-moe"])
def test_four_ranks_match_transformers(checkpoint, arch):
    """llama and qwen2 have 2 KV heads, each then on two ranks; llama-mha-tied has 4 and ties its
    lm_head to the embeddings (a vocabulary of 384 rows: 96 a rank); qwen2-moe's experts and
    shared expert are cut four ways."""
    prompts, expected = reference(checkpoint, arch)
    with LLM(checkpoint(arch), dtype="float32", device="cpu", tensor_parallel_size=4, log_interval_s=0) as llm:
        assert [o.outputs[0].token_ids for o in generate(llm, prompts)] == expected


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_ranks_keep_chunks_prefix_hits_preemption_and_sampled_n(checkpoint, arch):
    """A step budget of 7 tokens, a cache small enough to preempt, repeated prompts (prefix hits),
    and n=2 seeded samples: the tokens of one rank under the same settings."""
    prompts, expected = reference(checkpoint, arch)
    options = dict(dtype="float32", device="cpu", log_interval_s=0, max_num_batched_tokens=7, block_size=4,
                   num_blocks=40, max_model_len=96, reserve_growth=False)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, n=2, seed=7)
    with LLM(checkpoint(arch), **options) as one:
        want = tokens(one.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False))
    with LLM(checkpoint(arch), tensor_parallel_size=2, **options) as llm:
        greedy = generate(llm, prompts + prompts, n=2)
        assert tokens(greedy) == [[e, e] for e in expected + expected]
        assert llm.engine.kv.prefix_hits > 0
        assert llm.engine.scheduler.num_preemptions > 0
        assert tokens(llm.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False)) == want
        assert_pool_back_to_total(llm)


def test_ranks_keep_structured_outputs_and_speculation(checkpoint):
    """Every rank fills the grammar's masks and samples alike, and rank 0 alone proposes (ngram):
    seeded constrained samples and speculated greedy outputs are one rank's, drafts checked."""
    from conftest import hold_speculation_on
    from test_structured_outputs import SCHEMAS

    from llmserve import StructuredOutputsParams as Structured
    prompts = ["one two three one two three one two", "The quick brown fox"]
    constrained = [SamplingParams(max_tokens=40, temperature=0.7, seed=s, n=2,
                                  structured_outputs=Structured(json=SCHEMAS[0])) for s in (1, 2)]
    free = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    options = dict(dtype="float32", device="cpu", log_interval_s=0,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    results = []
    for ranks in (1, 2):
        with LLM(checkpoint("llama"), tensor_parallel_size=ranks, **options) as llm:
            hold_speculation_on(llm)
            results.append((tokens(llm.generate(prompts, constrained, use_tqdm=False)),
                            tokens(llm.generate(prompts, free, use_tqdm=False)), llm.engine.scheduler.spec.draft_tokens))
    assert results[1] == results[0]
    assert results[1][2] > 0


def test_values_read_from_another_thread_while_the_engine_steps(checkpoint):
    """A benchmark reading a rank's counter while the engine's thread steps: the calls take turns
    on the ranks' pipes (interleaved, their messages would corrupt each other). Rank 0 reports the
    steps it ran."""
    prompts, expected = reference(checkpoint, "llama")
    with LLM(checkpoint("llama"), dtype="float32", device="cpu", tensor_parallel_size=2, log_interval_s=0) as llm:
        stop, reads = threading.Event(), []

        def read():
            while not stop.is_set():
                reads.append(llm.engine.runner.cascade_steps)
        reader = threading.Thread(target=read)
        reader.start()
        llm.engine.runner.timing.clear()
        llm.engine.runner.rank_timing("clear")
        try:
            outs = generate(llm, prompts)
        finally:
            stop.set()
            reader.join()
        assert [o.outputs[0].token_ids for o in outs] == expected
        assert len(reads) > 10 and set(reads) == {0}
        # rank 0's own timing saw the steps the engine sent it (the benchmark's view of a rank), give
        # or take a last step the engine thread makes between the two sides' clears or reads
        report, here = llm.engine.runner.rank_timing("report"), llm.engine.runner.timing.summary()
        assert here["steps"] > 2 and abs(report["steps"] - here["steps"]) <= 2 and report["by_batch"]
        with pytest.raises(ValueError, match="unknown action"):
            llm.engine.runner.rank_timing("records")


def test_int8_splits_like_the_model(checkpoint):
    """int8 quantizes each rank's slice as it loads (row-parallel layers: per-row scales of the
    rank's columns); the logits stay those of one int8 rank within quantization's own error."""
    path = checkpoint("llama")
    ids = reference(checkpoint, "llama")[0][1]
    with LLM(path, dtype="float32", device="cpu", quantization="int8", log_interval_s=0) as one:
        want = one.engine.runner.prompt_logits(ids)
    with LLM(path, dtype="float32", device="cpu", quantization="int8", tensor_parallel_size=2,
             log_interval_s=0) as llm:
        got = llm.engine.runner.prompt_logits(ids)
    assert got.shape == want.shape
    assert torch.nn.functional.cosine_similarity(got, want, dim=-1).min() > 0.999
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


def test_a_rank_that_dies_ends_the_engine_at_once(checkpoint):
    llm = LLM(checkpoint("llama"), dtype="float32", device="cpu", tensor_parallel_size=2, log_interval_s=0)
    try:
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        assert len(llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0].token_ids) == MAX_TOKENS
        llm.engine.runner._procs[1].kill()
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 failed: its process exited with code -9"):
            llm.generate(["The quick brown fox", "Hi"], params, use_tqdm=False)
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 failed"):  # and so does every later call
            llm.generate(["Hi"], params, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        llm.shutdown()
    assert llm.engine.runner._procs == []  # rank 0 was stopped with it


@pytest.mark.skipif(not hasattr(__import__("os"), "pidfd_open"), reason="the rank watcher is Linux's")
def test_ranks_end_with_an_engine_process_that_is_killed(checkpoint):
    """Whatever ends the engine process (SIGKILL here: no clean-up of its own), its ranks follow,
    also one waiting for a peer that no longer answers (stopped here): while they start, in the
    rendezvous, where it would wait for half an hour; and once they serve, in a collective, or for
    its socket (it reads it only between calls)."""
    import os
    import signal
    import subprocess
    import sys
    script = (f"from llmserve import LLM\n"
              f"llm = LLM({checkpoint('llama')!r}, dtype='float32', device='cpu', tensor_parallel_size=2, "
              f"log_interval_s=0)\nprint('ready', flush=True)\nimport time; time.sleep(600)\n")

    def children(pid: int) -> list[int]:
        return [p for p in map(int, filter(str.isdigit, os.listdir("/proc"))) if _parent(p) == pid]

    for starting in (True, False):
        engine = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            if not starting:
                assert engine.stdout.readline().strip() == "ready"
            ranks, deadline = [], time.monotonic() + 60
            while len(ranks) < 2 or not all(children(rank) for rank in ranks):  # each past its imports, watched
                assert time.monotonic() < deadline, "no rank is watched"
                ranks = children(engine.pid)
                time.sleep(0.01)
            os.kill(max(ranks), signal.SIGSTOP)  # (rank 1) rank 0 waits for it
            engine.send_signal(signal.SIGKILL)
            engine.wait()
            deadline = time.monotonic() + 5
            while any(_alive(pid) for pid in ranks):
                assert time.monotonic() < deadline, f"a rank outlived its engine (starting: {starting})"
                time.sleep(0.05)
        finally:
            engine.kill()
            for pid in ranks:  # (only a rank left behind: a pid of another process is not ours to kill)
                if _alive(pid) and _parent(pid) in (engine.pid, 1):
                    os.kill(pid, signal.SIGKILL)


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_model_that_does_not_divide_is_refused_before_ranks_start(checkpoint):
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must divide evenly over tensor_parallel_size 3"):
        LLM(checkpoint("llama"), dtype="float32", device="cpu", tensor_parallel_size=3)
    with pytest.raises(ValueError, match="parallel.distributed_executor_backend must be 'mp' or 'ray'"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="parallel.tensor_parallel_size must be >= 1"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)


def test_kv_heads_split_or_repeat_over_the_ranks():
    """Ranks outnumbering the KV heads share them: rank r reads KV head r * heads // ranks."""
    assert [TensorParallel(4, r).kv_split(2) for r in range(4)] == [(2, 0), (2, 0), (2, 1), (2, 1)]
    assert [TensorParallel(2, r).kv_split(8) for r in range(2)] == [(2, 0), (2, 1)]
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) and tensor_parallel_size \(2\)"):
        TensorParallel(2, 0).kv_split(3)
    x = torch.ones(2, 3)  # one rank: the collectives hand back their input
    assert all_reduce(x) is x and all_gather_columns(x) is x


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray cluster in this process (the engine's ray.init() finds it), small."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=4, object_store_memory=128 * 2**20, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


def test_ranks_as_ray_actors_match_transformers_and_a_dead_actor_ends_the_engine(checkpoint, ray_cluster):
    prompts, expected = reference(checkpoint, "qwen2")
    llm = LLM(checkpoint("qwen2"), dtype="float32", device="cpu", tensor_parallel_size=2,
              distributed_executor_backend="ray", log_interval_s=0)
    try:
        assert [o.outputs[0].token_ids for o in generate(llm, prompts)] == expected
        ray_cluster.kill(llm.engine.runner._actors[1])
        with pytest.raises(RuntimeError, match="tensor-parallel rank 1 failed: its actor died"):
            generate(llm, prompts)
    finally:
        llm.shutdown()
    assert llm.engine.runner._actors == []


def test_ranks_stop_when_start_up_fails_after_they_started(checkpoint, monkeypatch):
    """A cache too small for max_model_len is found once the ranks have sized it: they stop too."""
    import llmserve.distributed.workers as workers
    started, real = [], workers.ProcessRanks.__init__
    monkeypatch.setattr(workers.ProcessRanks, "__init__", lambda self, *a: started.append(self) or real(self, *a))
    with pytest.raises(ValueError, match="max_model_len 256 needs 16 KV blocks of 16 tokens, but only 4 fit"):
        LLM(checkpoint("llama"), dtype="float32", device="cpu", tensor_parallel_size=2, num_blocks=4)
    assert started and started[0]._procs == []


@pytest.mark.parametrize("arch, dense, sandwich", [("llama", True, False), ("gemma2", True, True),
                                                 ("qwen3-moe", False, False)])
def test_row_parallel_outputs_are_summed_by_the_norm_after_them(checkpoint, monkeypatch, arch, dense, sandwich):
    """With several ranks each o_proj and dense down_proj hands its partial sums to the norm that
    takes them next (parallel_state.all_reduce_rms_norm sums and normalises in one kernel on CUDA);
    a mixture of experts sums its own output. One rank, or a single such pair, changes nothing."""
    from llmserve.distributed import parallel_state
    from llmserve.model.layers import RMSNorm, RowParallelLinear, reduce_into
    from llmserve.model.llama import LlamaForCausalLM
    from llmserve.model.moe import MoeForCausalLM
    from llmserve.model.spec import ModelSpec
    from llmserve.quantization import Unquantized
    from plugins.cpu import CPUBackend

    spec = ModelSpec.from_dir(checkpoint(arch))
    cls = MoeForCausalLM if spec.moe is not None else LlamaForCausalLM
    for size in (1, 2):
        monkeypatch.setattr(parallel_state, "_tp", TensorParallel(size, 0))
        model = cls(spec, CPUBackend(), 64, Unquantized())
        norms = [m for m in model.modules() if isinstance(m, RMSNorm) and m.reduce_group is not None]
        unsummed = [m for m in model.modules() if isinstance(m, RowParallelLinear) and not m.reduce]
        if size == 1:
            assert not norms and not unsummed
            continue
        assert len(unsummed) == len(norms) == len(model.layers) * (2 if dense else 1)
        assert all(layer.post_attention_layernorm.reduce_group is not None for layer in model.layers)
        assert all(not layer.self_attn.o_proj.reduce for layer in model.layers)
        assert (model.norm.reduce_group is not None) == (dense and not sandwich)
        if sandwich:
            assert all(layer.post_feedforward_layernorm.reduce_group is not None for layer in model.layers)
        if not dense:
            assert all(layer.input_layernorm.reduce_group is None and layer.mlp.experts.tp.size == 2
                       for layer in model.layers)
    pair = (RowParallelLinear(8, 8), RMSNorm(8, 1e-6, CPUBackend()))
    reduce_into([pair])  # a single pair: its all-reduce stays where it is
    assert pair[0].reduce and pair[1].reduce_group is None
    reduce_into([pair, (RowParallelLinear(8, 8), RMSNorm(8, 1e-6, CPUBackend()))])
    assert not pair[0].reduce and pair[1].reduce_group is parallel_state.tp()


def test_the_norms_all_reduces_take_the_kernel_where_they_fit_slot_2_first_in_a_pass(monkeypatch):
    """all_reduce_rms_norm's dispatch (the kernel itself needs two GPUs: test_gpu_multi.py): rows
    that fit the buffer and the row limit go to the kernel in slots 2, 0, 1, 0, ... from the pass's
    opening all-reduce; others are all-reduced, then normalised."""
    from llmserve.distributed import parallel_state
    from llmserve.distributed.parallel_state import NORM_REDUCE_MAX_ROWS, NormReduce

    group = TensorParallel(2, 1, norm_reduce=NormReduce(torch.empty(3, 2, 4096), torch.zeros(2), 4096))
    slots, reduced = [], []
    monkeypatch.setattr(parallel_state, "summed_rms_norm",
                        lambda x, res, w, eps, bufs, rank, ranks, place, slot: slots.append((rank, ranks, slot)))
    monkeypatch.setattr(parallel_state, "all_reduce",
                        lambda x, g, opens_pass=False: reduced.append(x.shape) or x)

    def norm(rows: int, width: int = 4, dtype=torch.float32):
        parallel_state.all_reduce_rms_norm(torch.zeros(rows, width, dtype=dtype), None, torch.ones(width), 1e-6,
                                           lambda x, w, eps, res: x, group)

    for rows in (1, 256, 3, 1):
        norm(rows)
    norm(2, dtype=torch.float16)  # another dtype than the buffer's
    norm(257)  # more rows than the kernel runs at once (fitting the buffer)
    norm(2, width=4096)  # more than the buffer holds
    assert slots == [(1, 2, 2), (1, 2, 0), (1, 2, 1), (1, 2, 0)] and reduced == [(2, 4), (257, 4), (2, 4096)]
    assert NORM_REDUCE_MAX_ROWS == 256
    group.norm_reduce.calls = 0  # what the embeddings' all-reduce does as a pass opens
    norm(1)
    assert slots[-1] == (1, 2, 2)
