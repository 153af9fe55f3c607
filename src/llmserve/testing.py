"""Tiny random-weight checkpoints for tests and demos, built the way a user's checkpoint is saved
(transformers' save_pretrained) with a byte-level BPE tokenizer trained on the spot.

    python -m llmserve.testing OUT_DIR [--arch llama|qwen3|...]
"""

from __future__ import annotations

import argparse

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Continuous batching mixes prefill chunks with decode tokens in one step.",
    "The capital of France is Paris, and the capital of Japan is Tokyo.",
    "Café, naïve, jalapeño, 日本語のテキスト, and emoji 🚀🔥 are multi-byte in UTF-8.",
    "def hello(name):\n    return f'Hello, {name}!'",
    "Once upon a time there was a small model that learned to count: one two three four five.",
]

ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64}, "rope_theta": 500000.0}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "llama-mha-tied": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None}),
    # sliding windows shorter than most prompts: every layer (Mistral), the layers past the first (Qwen2)
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 6}),
    "qwen2-window": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 6,
                                                          "max_window_layers": 1}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 6, "layer_types": [
        "sliding_attention", "full_attention"], "query_pre_attn_scalar": 24, "attn_logit_softcapping": 2.0,
        "final_logit_softcapping": 3.0, "tie_word_embeddings": True}),
    # local (6-token window, its own rotary base) and global layers alternating
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 6, "layer_types": [
        "sliding_attention", "full_attention"], "query_pre_attn_scalar": 24, "tie_word_embeddings": True}),
    # mixtures of experts: 8 experts, 2 a token; Qwen3's renormalised, Qwen2's with a gated shared
    # expert and one dense layer, Mixtral's with a window
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2,
                                                            "moe_intermediate_size": 32, "norm_topk_prob": True}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "mlp_only_layers": [0]}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2,
                                                        "intermediate_size": 32, "sliding_window": 6}),
}
# LongRoPE: the factors of head_dim 16's eight frequencies, for a model pretrained on 32 positions
# and extended to 256; prompts past 32 positions take the long factors (tests/test_equivalence.py).
PHI3_LONGROPE = {"sliding_window": None, "original_max_position_embeddings": 32, "rope_scaling": {
    "type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0, 4.0],
    "long_factor": [1.0, 1.5, 2.0, 3.0, 4.5, 6.0, 8.0, 12.0]}}


def train_tokenizer(out_dir: str, vocab_size: int = 384, corpus: list[str] | None = None):
    """A byte-level BPE tokenizer trained on `corpus` (CORPUS), saved as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((corpus or CORPUS) * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(out_dir)
    return fast


def make_checkpoint(out_dir: str, arch: str = "llama", *, dtype: torch.dtype = torch.float32, seed: int = 0,
                    shard_size: str | None = None, corpus: list[str] | None = None, **overrides) -> str:
    """Save a tiny random model of `arch` (see ARCHS) with its tokenizer (trained on `corpus`) into
    out_dir; returns out_dir."""
    import transformers

    tok = train_tokenizer(out_dir, corpus=corpus)
    config_cls, model_cls, arch_kwargs = ARCHS[arch]
    kwargs = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                  initializer_range=0.15, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    kwargs.update(arch_kwargs)
    kwargs.update(overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(dtype)
    save_kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(out_dir, **save_kwargs)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a tiny random-weight checkpoint with its tokenizer.")
    ap.add_argument("out_dir")
    ap.add_argument("--arch", default="llama", choices=sorted(ARCHS))
    args = ap.parse_args()
    print(make_checkpoint(args.out_dir, args.arch))


if __name__ == "__main__":
    main()
