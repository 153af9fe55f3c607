"""A workload through `bench throughput --detokenize` (a tokenizer covering the model's vocabulary in
its directory, so every output token is detokenized as with a real checkpoint), with the
detokenizer's streaming path (tokenizers' DecodeStream) or, with --windowed, the two-decode window
method that tokenizers without a Rust backend still use: the same engine otherwise, so one call
compares the two.

    python scripts/detok_bench.py [--workload w-small] [--windowed] [--json out.json]
"""

import argparse

from llmserve import detokenizer
from llmserve.bench import throughput
from llmserve.bench.report import report


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="w-small")
    ap.add_argument("--windowed", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.windowed:
        detokenizer.rust_tokenizer = lambda tokenizer: None
    result = throughput.run(args.workload, detokenize=True, log_interval_s=10.0)
    result["detokenizer"] = "windowed" if args.windowed else "streamed"
    report(result, args.json)


if __name__ == "__main__":
    main()
