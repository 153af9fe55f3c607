"""The benchmark workloads, generated exactly as WORKLOADS.md specifies, and their model shapes."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, fields
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

LLAMA31_70B = {**LLAMA31_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
               "num_attention_heads": 64}  # 70.6B parameters, 141 GB in bf16: more than one GPU holds

QWEN3_30B_A3B = {  # 30.5B parameters, 3.3B a token: 48 layers of 128 experts, 8 a token
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
    "eos_token_id": 151645, "bos_token_id": 151643,
}

ALWAYS_WRITTEN = ("temperature", "top_p", "top_k", "max_tokens", "ignore_eos")
"""Sampling fields a serialized workload states even at their defaults: engines' defaults differ."""


@dataclass(slots=True)
class Workload:
    name: str
    model_config: dict
    prompts: list[list[int]]
    params: list[SamplingParams]
    # WORKLOADS.md's roofline for it: "bandwidth" (its prompts' FLOPs, then every decode step's
    # reads, as for W-small) or "compute" (every token's FLOPs, the decode reads beneath them, as for
    # W-large, whose decode tokens ride along with prefill chunks).
    bound: str = "bandwidth"
    shared_prefix: tuple[int, int] | None = None
    """(prefixes, tokens each) when the prompts begin with shared prefixes: the roofline computes
    each prefix once and reads it once a step (prefix caching and cascade attention)."""

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

    def write_tokenizer(self, path: str | Path) -> None:
        """Put a tokenizer covering the model's whole vocabulary into the checkpoint directory, so
        that a run detokenizes its outputs as it would with the real checkpoint's tokenizer."""
        from transformers import PreTrainedTokenizerFast

        cfg = self.model_config  # its end and start ids are special tokens, as in the real vocabulary
        tok = synthetic_tokenizer(cfg["vocab_size"], {cfg["eos_token_id"]: "<|eos|>", cfg["bos_token_id"]: "<|bos|>"})
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|eos|>", bos_token="<|bos|>").save_pretrained(str(path))

    def to_dict(self) -> dict:
        """The workload as plain JSON-ready data, for a peer engine in another process: each request's
        sampling as the fields that set the work (always) plus any other field off its default, under
        SamplingParams' names (vLLM's are the same)."""
        default = SamplingParams()
        names = [f.name for f in fields(SamplingParams)]
        params = [{k: getattr(p, k) for k in names if k in ALWAYS_WRITTEN or getattr(p, k) != getattr(default, k)}
                  for p in self.params]
        return {"name": self.name, "model_config": self.model_config, "prompts": self.prompts, "params": params,
                "bound": self.bound}

    @classmethod
    def from_dict(cls, data: dict) -> Workload:
        return cls(data["name"], data["model_config"], [list(p) for p in data["prompts"]],
                   [SamplingParams(**p) for p in data["params"]], data.get("bound", "bandwidth"))


def synthetic_tokenizer(vocab_size: int, specials: dict[int, str], seed: int = 0):
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` tokens, `specials` (id ->
    text, ids past the 256 bytes) special tokens at their ids, built without a corpus: each merge
    extends a token drawn at random by a letter, digit, space or punctuation mark, up to 10
    characters (a real vocabulary is mostly such pieces, and random weights sample its ids
    uniformly); ~1 s for 151,936 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if any(not len(alphabet) <= i < vocab_size for i in specials):
        raise ValueError(f"special token ids must be in [{len(alphabet)}, {vocab_size}), got {sorted(specials)}")
    vocab = {c: i for i, c in enumerate(alphabet)}
    chars = [chr(c) for c in range(33, 127)] + ["\u0120"] * 12  # printable ASCII; U+0120 is the space
    pool = list(chars)
    rng = random.Random(seed)
    merges = []
    while len(vocab) < vocab_size:
        if len(vocab) in specials:
            vocab[specials[len(vocab)]] = len(vocab)
            continue
        a, b = rng.choice(pool), rng.choice(chars)
        if len(a) >= 10 or a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        merges.append((a, b))
        pool.append(a + b)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials.values()))
    return tok


JSON_STRING_REGEX = r'\{"text": "[^"\\\x00-\x1f]*'
"""Structured outputs' benchmark constraint: the inside of a JSON string (the mask json_object's
strings take), which never closes, so a request keeps its mask to the end."""


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
    return Workload("w-large", LLAMA31_8B, prompts, params, bound="compute")


def decode_b1() -> Workload:
    """Single-request decode on the 8B shape (issue-defined, not in WORKLOADS.md): one random
    128-token prompt, 512 greedy output tokens; memory-bound, each step reads every weight."""
    random.seed(0)
    prompts = [[random.randint(0, 100000) for _ in range(128)]]
    return Workload("decode-b1", LLAMA31_8B, prompts, [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=512)])


def w_prefix() -> Workload:
    random.seed(3)
    prefixes = [[random.randint(0, 10000) for _ in range(4096)] for _ in range(8)]
    prompts = [prefixes[i % 8] + [random.randint(0, 10000) for _ in range(64)] for i in range(512)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=128) for _ in range(512)]
    return Workload("w-prefix", QWEN3_0_6B, prompts, params, shared_prefix=(8, 4096))


def w_small_moe() -> Workload:
    """W-small's requests on the Qwen3-30B-A3B shape (issue-defined, not in WORKLOADS.md)."""
    w = w_small()
    w.name, w.model_config = "w-small-moe", QWEN3_30B_A3B
    return w


def w_large_moe() -> Workload:
    """W-large's requests on the Qwen3-30B-A3B shape (issue-defined, not in WORKLOADS.md)."""
    w = w_large()
    w.name, w.model_config = "w-large-moe", QWEN3_30B_A3B
    return w


WORKLOADS = {"w-small": w_small, "w-large": w_large, "w-prefix": w_prefix, "decode-b1": decode_b1,
             "w-small-moe": w_small_moe, "w-large-moe": w_large_moe}
