"""Host time from `LLM.generate()` to the first step's launch, for a workload's real requests, on
any machine: a tiny model on the CPU backend stands in for the GPU (the time before the first step
is admission, planning and the hand-off to the executor's thread, none of which is device work).

    python scripts/first_step_bench.py [--workload w-small|w-large] [--runs 5] [--json out.json]

Prints, per run, the first step's launch time after generate() was called and the token counts
of the first steps (an offline batch's first steps should be full: max_num_batched_tokens each).
`llmserve bench throughput` reports the same `first_step_ms` for the real model on the GPU.
"""

import argparse
import statistics
import tempfile
import time

from llmserve import LLM, SamplingParams
from llmserve.bench.report import report
from llmserve.bench.workloads import WORKLOADS
from llmserve.testing import make_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="w-small", choices=["w-small", "w-large"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(tmp, "qwen3", vocab_size=100352, max_position_embeddings=4096, hidden_size=32,
                        intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        num_hidden_layers=1)
        # no prefix caching: every run repeats the same prompts, and the benchmark runs them once
        llm = LLM(tmp, max_num_seqs=256, cpu_kv_cache_gib=4.0, log_interval_s=0, enable_prefix_caching=False)
        params = [SamplingParams(max_tokens=1, ignore_eos=True, temperature=p.temperature) for p in w.params]
        llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)
        timing = llm.engine.runner.timing
        for run in range(args.runs):
            timing.clear()
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p} for p in w.prompts], params, use_tqdm=False)
            steps = [r for r in timing.records if r.requests and r.start >= start]
            rows.append({"workload": args.workload, "run": run, "first_step_ms": 1e3 * (steps[0].start - start),
                         "first_step_tokens": [r.tokens for r in steps[:6]]})
            print(rows[-1], flush=True)
        llm.shutdown()
    print(f"median first_step_ms {statistics.median(r['first_step_ms'] for r in rows):.1f}")
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
