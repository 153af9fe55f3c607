"""Garbage-collection pauses of the event loop's thread while a workload runs, on any machine: a
tiny model on the CPU backend stands in for the GPU (what the collector walks is the engine's
per-request state, the same whatever computes the steps).

    python scripts/gc_bench.py [--workload w-large|w-small] [--json out.json]

Prints, per generation, the collections and the CPU time they took in the thread that ran them
(thread time: on a 2-core machine the wall time of a pause also counts the OS running the step's
thread instead). Token ids are taken modulo the tiny model's vocabulary; the prompts are built
before the engine starts, so they are frozen with its start-up heap as `bench throughput`'s are.
"""

import argparse
import gc
import os
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the tiny model's matmuls: one thread, no spinning

from llmserve import LLM, SamplingParams  # noqa: E402
from llmserve.bench.report import report  # noqa: E402
from llmserve.bench.workloads import WORKLOADS  # noqa: E402
from llmserve.testing import make_checkpoint  # noqa: E402

VOCAB = 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="w-large", choices=["w-small", "w-large"])
    ap.add_argument("--json")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]()
    prompts = [{"prompt_token_ids": [t % VOCAB for t in p]} for p in w.prompts]
    params = [SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=p.temperature) for p in w.params]
    pauses: list[tuple[int, float]] = []
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            pauses.append((info["generation"], 1e3 * (time.thread_time() - started[0])))

    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(tmp, "qwen3", vocab_size=VOCAB, max_position_embeddings=4096, hidden_size=32,
                        intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        num_hidden_layers=1)
        llm = LLM(tmp, max_num_seqs=256, cpu_kv_cache_gib=0.5, log_interval_s=0)
        gc.callbacks.append(on_gc)
        try:
            llm.generate(prompts, params, use_tqdm=False)
        finally:
            gc.callbacks.remove(on_gc)
            llm.shutdown()
    by_gen = defaultdict(list)
    for gen, ms in pauses:
        by_gen[gen].append(ms)
    rows = [{"workload": args.workload, "generation": gen, "collections": len(v), "cpu_ms": sum(v),
             "max_ms": max(v)} for gen, v in sorted(by_gen.items())]
    for row in rows:
        print(f"generation {row['generation']}: {row['collections']} collections, {row['cpu_ms']:.1f} ms, "
              f"longest {row['max_ms']:.1f} ms")
    print(f"all: {sum(r['cpu_ms'] for r in rows):.1f} ms")
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
