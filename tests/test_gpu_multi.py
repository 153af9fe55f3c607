"""Tensor parallelism on several CUDA devices, ranks joined by NCCL, their collectives captured in
the CUDA graphs: greedy tokens are transformers' (float32) at 2 and 4 ranks, bf16 tokens are
transformers' argmax given our prefix, and sampled requests equal one device's. An engine on the
second device (a data-parallel replica's) computes there. Skipped with fewer than two GPUs."""

import pytest
import torch
from conftest import hf_greedy
from test_equivalence import MAX_TOKENS
from test_gpu import assert_transformers_argmax, prompts_for, run

from llmserve import LLM, SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]


def needs(ranks: int) -> None:
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"needs {ranks} CUDA devices")


@pytest.mark.parametrize("ranks, arch", [(2, "llama"), (2, "qwen3"), (2, "gemma2"), (2, "qwen3-moe"),
                                         (4, "llama"), (4, "qwen2-moe")])
def test_cuda_ranks_match_transformers_through_their_graphs(checkpoint, ranks, arch):
    """Decode steps replay graphs holding the all-reduces; the repeat hits the prefix cache."""
    needs(ranks)
    path = checkpoint(arch)
    prompts = prompts_for(path)
    expected = hf_greedy(path, prompts, MAX_TOKENS, device="cuda")
    with LLM(path, dtype="float32", device="cuda", tensor_parallel_size=ranks, num_blocks=4096,
             log_interval_s=0) as llm:
        assert llm.engine.runner.graphs.sizes
        assert run(llm, prompts + prompts) == expected + expected
        assert llm.engine.kv.num_free_blocks() == llm.engine.kv.pool.num_blocks


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_cuda_two_ranks_in_bfloat16_take_transformers_argmax(checkpoint, arch):
    path = checkpoint(arch, dtype=torch.bfloat16)
    prompts = prompts_for(path)
    with LLM(path, dtype="bfloat16", device="cuda", tensor_parallel_size=2, num_blocks=4096,
             log_interval_s=0) as llm:
        got = run(llm, prompts, 8)
    assert_transformers_argmax(path, prompts, got, moe="moe" in arch)


def test_cuda_two_ranks_sample_as_one_device_does(checkpoint):
    """Seeded samples and n = 2 (float32: the ranks' sums differ from one device's by rounding only)."""
    path = checkpoint("llama")
    prompts = [{"prompt_token_ids": p} for p in prompts_for(path)]
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, n=2, seed=5)
    outs = []
    for ranks in (1, 2):
        with LLM(path, dtype="float32", device="cuda", tensor_parallel_size=ranks, num_blocks=4096,
                 log_interval_s=0) as llm:
            outs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[1] == outs[0]


def test_cuda_an_engine_on_the_second_device_computes_there(checkpoint):
    """Its steps run on worker threads whose current device is cuda:0: Triton's kernels must still
    launch on cuda:1, where the weights and the cache are."""
    path = checkpoint("llama")
    prompts = prompts_for(path)
    expected = hf_greedy(path, prompts, MAX_TOKENS, device="cuda")
    with LLM(path, dtype="float32", device="cuda:1", num_blocks=4096, log_interval_s=0) as llm:
        assert next(llm.engine.runner.model.parameters()).device == torch.device("cuda", 1)
        assert run(llm, prompts) == expected


def _norm_reduce_rank(rank: int, size: int, store: str, dtype: torch.dtype, failures) -> None:
    import torch.distributed as dist

    from llmserve.distributed import parallel_state
    from llmserve.kernels.fused import rms_norm
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    parallel_state.init_tensor_parallel(rank, size, "nccl", f"file://{store}", 120.0)
    try:
        assert parallel_state.enable_one_shot(device, dtype) is None
        g = parallel_state.tp()
        assert g.norm_reduce is not None
        gen = torch.Generator(device).manual_seed(rank)
        hidden = 512
        weight = torch.rand(hidden, dtype=dtype, device=device, generator=gen) + 0.5

        def inputs(rows: int):
            x = torch.randn(rows, hidden, dtype=dtype, device=device, generator=gen)
            x[0, : hidden // 2] = -0.0  # zeros of both signs (negative zero marks an empty place)
            x[-1, : hidden // 4] = 0.0
            return x, torch.randn(rows, hidden, dtype=dtype, device=device, generator=gen)

        def expected(x, residual):
            summed = x.clone()
            dist.all_reduce(summed)
            return rms_norm(summed, weight, 1e-6, residual)

        # two ranks add a + b as NCCL does: the same bits; more add in another order than NCCL's ring
        same = {"rtol": 0, "atol": 0} if size == 2 else {"rtol": 2e-2, "atol": 2e-2}
        near = {} if size == 2 else same  # (the norm: rounded alike, its sum of squares perhaps not)

        def check(got, want) -> None:
            torch.testing.assert_close(got[1], want[1], **same)
            torch.testing.assert_close(got[0], want[0], **near)

        def opens_pass(rows: int) -> None:
            parallel_state.all_reduce(torch.zeros(rows, hidden, dtype=dtype, device=device), opens_pass=True)

        # passes of different sizes, eagerly, with and without the residual
        for rows in (1, 7, parallel_state.NORM_REDUCE_MAX_ROWS, 3, 1):
            opens_pass(rows)
            for call in range(5):
                x, residual = inputs(rows)
                if call == 2:
                    got = parallel_state.all_reduce_rms_norm(x, None, weight, 1e-6, rms_norm)
                    torch.testing.assert_close(got, expected(x, None), **near)
                    continue
                check(parallel_state.all_reduce_rms_norm(x, residual, weight, 1e-6, rms_norm), expected(x, residual))
        # calls back to back, nothing between them to hold a rank back, rank 0 late to each: the
        # others run a call ahead, writing the next slot while rank 0 still reads the last
        opens_pass(2)
        pairs = [inputs(2) for _ in range(8)]
        outs = []
        for x, residual in pairs:
            if rank == 0:
                torch.cuda._sleep(2_000_000)
            outs.append(parallel_state.all_reduce_rms_norm(x, residual, weight, 1e-6, rms_norm))
        for (x, residual), got in zip(pairs, outs):
            check(got, expected(x, residual))
        # a pass captured in a CUDA graph, replayed on new inputs
        rows = 4
        xs = [torch.zeros(rows, hidden, dtype=dtype, device=device) for _ in range(4)]
        residual = torch.zeros(rows, hidden, dtype=dtype, device=device)
        outs = []

        def step():
            opens_pass(rows)
            outs.clear()
            for x in xs:
                outs.append(parallel_state.all_reduce_rms_norm(x, residual, weight, 1e-6, rms_norm))

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            step()
        for _ in range(3):
            for x in xs:
                x.copy_(inputs(rows)[0])
            residual.copy_(inputs(rows)[1])
            graph.replay()
            for x, got in zip(xs, outs):
                check(got, expected(x, residual))
        torch.cuda.synchronize()
    except BaseException as exc:
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("ranks, dtype", [(2, torch.bfloat16), (2, torch.float32), (4, torch.bfloat16)])
def test_the_norms_all_reduce_sums_as_nccl_does_eagerly_and_in_a_graph(tmp_path, ranks, dtype):
    """all_reduce_rms_norm's kernel (no barrier: each rank writes its rows into every peer's buffer
    and waits for theirs) against NCCL's sum normalised by the norm kernel: the sum bit for bit at
    two ranks; passes of 1 row to the kernel's limit, with and without a residual, zeros of both
    signs, calls back to back with one rank late, eagerly and replayed from a CUDA graph."""
    needs(ranks)
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    failures = ctx.SimpleQueue()
    procs = [ctx.Process(target=_norm_reduce_rank, args=(r, ranks, str(tmp_path / "store"), dtype, failures))
             for r in range(ranks)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert not alive and not errors and all(p.exitcode == 0 for p in procs), (errors, [p.exitcode for p in procs])
