"""What quantization costs in quality, measured through the engine's own model runner.

    llmserve bench quality [--shapes w-small,w-large] [--json out.json]

1. Perplexity of the built-in trained model on its held-out text (never seen in training), for
   each variant: the model dtype, int8, fp8 weights, fp8 KV cache.
2. On the dummy-weight shapes of the workloads (Qwen3-0.6B, Llama-3.1-8B; weights normal(0, 0.02)
   as a fresh transformers model has them): per-token cosine similarity of the logits and top-1
   agreement of each variant with the unquantized model, on random prompts.

Every variant runs the full prompt as one prefill, so an FP8 KV cache is written and read back
(the attention reads even the current prompt's keys from the cache).
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time

import torch

from llmserve.bench.report import report

VARIANTS = {
    "none": {},
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
}


def variants_for(device: str) -> dict[str, dict]:
    """FP8 weights need FP8 tensor cores on a GPU (the CPU emulates them)."""
    if device.startswith("cuda") and torch.cuda.get_device_capability() < (8, 9):
        return {k: v for k, v in VARIANTS.items() if k != "fp8"}
    return dict(VARIANTS)


def _engine(model: str, **kwargs):
    from llmserve import LLM
    return LLM(model, enforce_eager=True, log_interval_s=0, **kwargs)


def perplexity(model: str, text: str, *, ctx: int, max_chunks: int, **kwargs) -> dict:
    """exp(mean negative log-likelihood) of `text` in independent windows of `ctx` tokens."""
    llm = _engine(model, **kwargs)
    try:
        ids = llm.engine.tokenizer(text)["input_ids"]
        nll, count = 0.0, 0
        for start in range(0, min(len(ids) - 1, ctx * max_chunks), ctx):
            window = ids[start:start + ctx + 1]
            if len(window) < 2:
                break
            logits = llm.engine.runner.prompt_logits(window[:-1])
            target = torch.tensor(window[1:], device=logits.device)
            nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            count += len(window) - 1
    finally:
        llm.shutdown()
    return {"perplexity": math.exp(nll / count), "tokens": count}


def logits_agreement(model_config: dict, *, prompts: int, prompt_len: int, seed: int = 0, **common) -> dict:
    """Cosine similarity and top-1 agreement of each variant's logits with the unquantized model's."""
    rng = random.Random(seed)
    vocab = model_config["vocab_size"]
    token_ids = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(prompts)]
    results: dict[str, dict] = {}
    reference: list[torch.Tensor] = []
    with tempfile.TemporaryDirectory() as tmp:
        from llmserve.bench.workloads import Workload
        model_dir = Workload("shape", model_config, [], []).write_model_dir(tmp)
        for name, kwargs in variants_for(common.get("device", "auto")).items():
            llm = _engine(model_dir, load_format="dummy", max_model_len=prompt_len + 16, **common, **kwargs)
            try:
                cos, top1, n = 0.0, 0, 0
                for i, ids in enumerate(token_ids):
                    logits = llm.engine.runner.prompt_logits(ids)
                    if name == "none":
                        reference.append(logits)
                        continue
                    ref = reference[i]
                    cos += torch.nn.functional.cosine_similarity(logits, ref, dim=-1).sum().item()
                    top1 += (logits.argmax(-1) == ref.argmax(-1)).sum().item()
                    n += len(ids)
                if name != "none":
                    results[name] = {"cosine": cos / n, "top1_agreement": top1 / n, "tokens": n}
            finally:
                llm.shutdown()
    return results


def run(shapes: list[str], *, ctx: int = 512, max_chunks: int = 64, prompts: int = 4, prompt_len: int = 256,
        device: str = "auto", dtype: str = "auto") -> dict:
    from llmserve.bench.workloads import WORKLOADS
    from llmserve.engine import BUILTIN_MODEL_DIR
    text = (BUILTIN_MODEL_DIR / "heldout.txt").read_text()
    common = {"device": device, "dtype": dtype}
    result: dict = {"date": time.strftime("%Y-%m-%d"),
                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() and device != "cpu" else "cpu",
                    "perplexity": {}, "logits": {}}
    for name, kwargs in variants_for(device if device != "auto" else
                                     ("cuda" if torch.cuda.is_available() else "cpu")).items():
        result["perplexity"][name] = perplexity("builtin", text, ctx=ctx, max_chunks=max_chunks, **common, **kwargs)
    for shape in shapes:
        result["logits"][shape] = logits_agreement(WORKLOADS[shape]().model_config, prompts=prompts,
                                                   prompt_len=prompt_len, **common)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="llmserve bench quality", description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="w-small,w-large", help="workload model shapes for the logits comparison ('' for none)")
    ap.add_argument("--ctx", type=int, default=512, help="perplexity window, tokens")
    ap.add_argument("--max-chunks", type=int, default=64, help="perplexity windows at most")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: bfloat16 on the GPU for these models)")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    result = run(shapes, ctx=args.ctx, max_chunks=args.max_chunks, prompts=args.prompts, prompt_len=args.prompt_len,
                 device=args.device, dtype=args.dtype)
    report(result, args.json)


if __name__ == "__main__":
    main()
