"""The engine's host time per step, on any machine: what a step costs the CPU when the device's work
takes no time.

    python scripts/host_bench.py [--batch 1,16,64,256] [--steps 300] [--runs 3] [--shared-prefix 0]
                                 [--json out.json]

A tiny model on the CPU backend, its forward pass, lm_head and sampler replaced by constants
(random token ids), so a step's wall time is the Python around them: the scheduler, the KV
manager, the executor's inputs and results, the request actor's detokenizing and publishing, and
the hand-offs between them. On the GPU this work runs beside the device's; once it takes longer
than a step's device time, it sets the pace (large batches of small models, cascade attention,
constrained decoding, a speculating engine waiting for its last step). B requests of 100 random
prompt tokens (after a shared prefix of --shared-prefix tokens, one of 8, as W-prefix has; cascade
attention as --cascade-attention says, whose groups the CPU's cost model never picks) each generate
--steps tokens at temperature 0.6, ignore_eos; the fastest of --runs generate calls
counts, ms per step = its wall time / --steps.
"""

import argparse
import random
import tempfile
import time

import torch

from llmserve import LLM, SamplingParams
from llmserve.bench.report import report
from llmserve.model.llama import LlamaForCausalLM
from llmserve.plugins.cpu import CPUBackend
from llmserve.testing import make_checkpoint

HIDDEN = 64


def no_device_work() -> None:
    """The model's forward pass and logits return zeros, the sampler random ids past the specials."""
    LlamaForCausalLM.forward = lambda self, ids, positions, meta: torch.zeros(ids.shape[0], HIDDEN)
    LlamaForCausalLM.compute_logits = lambda self, hidden: torch.zeros(hidden.shape[0], self.spec.vocab_size)
    CPUBackend.sample_rows = lambda self, logits, t, key: torch.randint(3, logits.shape[1], (logits.shape[0],))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--shared-prefix", type=int, default=0)
    ap.add_argument("--cascade-attention", default="auto", choices=["auto", "always", "never"])
    ap.add_argument("--json")
    args = ap.parse_args()
    no_device_work()
    batches = [int(b) for b in args.batch.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(tmp, "llama", hidden_size=HIDDEN, num_hidden_layers=1, max_position_embeddings=8192)
        llm = LLM(tmp, dtype="float32", max_model_len=8192, max_num_seqs=max(batches), cpu_kv_cache_gib=1.0,
                  cascade_attention=args.cascade_attention, log_interval_s=0)
        vocab = llm.engine.spec.vocab_size
        rng = random.Random(0)
        prefixes = [[rng.randrange(3, vocab) for _ in range(args.shared_prefix)] for _ in range(8)]
        params = SamplingParams(max_tokens=args.steps, ignore_eos=True, temperature=0.6, seed=1)
        for b in batches:
            prompts = [{"prompt_token_ids": prefixes[i % 8] + [rng.randrange(3, vocab) for _ in range(100)]}
                       for i in range(b)]
            llm.generate(prompts, params, use_tqdm=False)  # warm-up (and the prefixes cached)
            walls = []
            for _ in range(args.runs):
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                walls.append(time.perf_counter() - start)
            best = min(walls)
            rows.append({"batch": b, "steps": args.steps, "shared_prefix": args.shared_prefix,
                         "ms_per_step": 1e3 * best / args.steps, "us_per_request_step": 1e6 * best / args.steps / b,
                         "walls_s": walls})
            print(f"batch {b}: {rows[-1]['ms_per_step']:.3f} ms a step, "
                  f"{rows[-1]['us_per_request_step']:.1f} us a request-step", flush=True)
        llm.shutdown()
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
