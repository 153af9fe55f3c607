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
