"""Command line: `llmserve --config config.toml --prompt "..."` generates offline with the configured
engine and prints one JSON object per prompt."""

from __future__ import annotations

import argparse
import json
import sys

from llmserve.config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmserve", description="llmserve inference engine")
    ap.add_argument("--config", required=True, help="TOML file (see config.example.toml)")
    ap.add_argument("--model", help="checkpoint directory; overrides [model] model")
    ap.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)

    from llmserve import LLM, SamplingParams

    config = EngineConfig.from_toml(args.config)
    if args.model:
        config.model.model = args.model
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    except ValueError as exc:
        ap.error(str(exc))
    with LLM(config=config) as llm:
        for out in llm.generate(args.prompt, params, use_tqdm=False):
            c = out.outputs[0]
            print(json.dumps({"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
