"""Device memory the CUDA graphs take, shape by shape: W-large's (or W-small's) model with dummy
weights, built eagerly, then its step graphs captured with the memory read before every forward.

    python scripts/graph_memory.py [--workload w-large] [--max-num-seqs 256 1024] [--json out.json]
"""

import argparse
import json
import tempfile

import torch

from llmserve import LLM
from llmserve.bench.workloads import WORKLOADS
from llmserve.model import cuda_graphs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="w-large")
    ap.add_argument("--max-num-seqs", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--json")
    args = ap.parse_args()
    w = WORKLOADS[args.workload]()
    model_dir = w.write_model_dir(tempfile.mkdtemp())
    gib = 2**30
    results = []
    real_forward = cuda_graphs.StepGraphs._forward
    for seqs in args.max_num_seqs:
        log = []

        def forward(self, kind, b):
            log.append((kind, b, torch.cuda.memory_reserved() / gib, torch.cuda.memory_allocated() / gib))
            return real_forward(self, kind, b)

        cuda_graphs.StepGraphs._forward = forward
        with LLM(model_dir, load_format="dummy", max_num_seqs=seqs, enforce_eager=True, log_interval_s=0) as llm:
            runner = llm.engine.runner
            torch.cuda.synchronize()
            before = torch.cuda.memory_reserved() / gib, torch.cuda.memory_allocated() / gib
            try:
                runner.capture_graphs(seqs, llm.config.scheduler.max_num_batched_tokens)
            except RuntimeError as e:  # out of memory: the shapes captured until then
                print(f"max_num_seqs {seqs}: capture failed after {len(log)} forwards: {str(e)[:200]}")
            torch.cuda.synchronize()
            after = torch.cuda.memory_reserved() / gib, torch.cuda.memory_allocated() / gib
            free = torch.cuda.mem_get_info()[0] / gib
            pools: dict = {}
            for seg in torch.cuda.memory_snapshot():
                key = str(seg.get("segment_pool_id"))
                total, used = pools.get(key, (0, 0))
                pools[key] = (total + seg["total_size"] / gib, used + seg["allocated_size"] / gib)
            print(f"max_num_seqs {seqs}: segments by pool (GiB reserved, allocated):",
                  {k: (round(t, 2), round(u, 2)) for k, (t, u) in pools.items()})
            n = len(log) // 2  # warm-up calls, then the captures in the same order
            captures = [dict(kind=k, size=b, reserved_gib=r - before[0], allocated_gib=a - before[1])
                        for k, b, r, a in log[n:]]
            row = dict(max_num_seqs=seqs, reserved_before=before[0], allocated_before=before[1],
                       pool_reserved_gib=after[0] - before[0], pool_allocated_gib=after[1] - before[1],
                       free_after_gib=free, captures=captures)
            print(f"max_num_seqs {seqs}: graphs reserve {row['pool_reserved_gib']:.2f} GiB "
                  f"({row['pool_allocated_gib']:.2f} allocated), {free:.2f} GiB free after")
            for c in captures[:: max(1, len(captures) // 24)]:
                print(f"   before {c['kind']} {c['size']}: +{c['reserved_gib']:.2f} reserved, +{c['allocated_gib']:.2f} allocated")
            runner.graphs = None
            results.append(row)
        cuda_graphs.StepGraphs._forward = real_forward
        torch.cuda.empty_cache()
    if args.json:
        json.dump(results, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
