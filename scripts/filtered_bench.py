"""A workload with every request sampled as a model card asks (top_k and top_p on top of the
workload's temperature; Qwen3's card: top_k 20, top_p 0.95), through `bench throughput`'s run: the
cost of the filtered sampler end to end. Runs against any llmserve (`gpu_suite.sh run ab-script
filtered_bench.py` compares two).

    python scripts/filtered_bench.py [--workload w-small] [--top-k 20] [--top-p 0.95] [--json out.json]
"""

import argparse
import dataclasses

from llmserve.bench import throughput
from llmserve.bench.report import report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="w-small")
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--json")
    args = ap.parse_args()
    plain = throughput.WORKLOADS[args.workload]

    def filtered():
        w = plain()
        w.params = [dataclasses.replace(p, top_k=args.top_k, top_p=args.top_p) for p in w.params]
        return w

    throughput.WORKLOADS[args.workload] = filtered
    result = throughput.run(args.workload, log_interval_s=10.0)
    result["sampling"] = {"top_k": args.top_k, "top_p": args.top_p}
    report(result, args.json)


if __name__ == "__main__":
    main()
