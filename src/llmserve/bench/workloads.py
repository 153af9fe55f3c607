"""The benchmark workloads, generated exactly as WORKLOADS.md specifies, and their model shapes."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from llmserve.sampling_params import SamplingParams

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "tie_word_embeddings": True, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "eos_token_id": 151645, "bos_token_id": 151643,
}

LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "tie_word_embeddings": False, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "max_position_embeddings": 131072, "torch_dtype": "bfloat16", "eos_token_id": 128001, "bos_token_id": 128000,
}


@dataclass(slots=True)
class Workload:
    name: str
    model_config: dict
    prompts: list[list[int]]
    params: list[SamplingParams]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(p.max_tokens for p in self.params)

    def write_model_dir(self, path: str | Path) -> str:
        """A checkpoint directory with config.json only, for load_format='dummy'."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.model_config))
        return str(path)


def w_small() -> Workload:
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 1024))] for _ in range(256)]
    max_tokens = [random.randint(100, 1024) for _ in range(256)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=m) for m in max_tokens]
    return Workload("w-small", QWEN3_0_6B, prompts, params)


def w_large() -> Workload:
    random.seed(0)
    prompts = [[random.randint(0, 100000) for _ in range(1024)] for _ in range(1000)]
    params = [SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=128) for _ in range(1000)]
    return Workload("w-large", LLAMA31_8B, prompts, params)


def decode_b1() -> Workload:
    """Single-request decode on the 8B shape (issue-defined, not in WORKLOADS.md): one random
    128-token prompt, 512 greedy output tokens; memory-bound, each step reads every weight."""
    random.seed(0)
    prompts = [[random.randint(0, 100000) for _ in range(128)]]
    return Workload("decode-b1", LLAMA31_8B, prompts, [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=512)])


WORKLOADS = {"w-small": w_small, "w-large": w_large, "decode-b1": decode_b1}
