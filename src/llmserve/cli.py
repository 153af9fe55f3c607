"""Command line.

    llmserve --config config.toml [--host H] [--port P] [--model DIR]   serve the OpenAI-compatible API
    llmserve --config config.toml --prompt "..." [--prompt ...]         generate offline, one JSON line each
    llmserve bench throughput --workload w-small [--peer hf]           offline throughput vs the roofline
    llmserve bench serve --url URL --workload w-small --rate inf       online serving metrics (a client)
    llmserve bench quality [--shapes w-small,w-large]                  perplexity / logits of quantized variants
    llmserve plugins [--config config.toml] [--json]                   the plugins found, what each registers
"""

from __future__ import annotations

import argparse
import json
import sys

from llmserve.config import EngineConfig


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    if argv[:1] == ["plugins"]:
        return _plugins(argv[1:])
    ap = argparse.ArgumentParser(prog="llmserve", description="llmserve: OpenAI-compatible LLM inference server")
    ap.add_argument("--config", required=True, help="TOML file (see config.example.toml)")
    ap.add_argument("--model", help='checkpoint directory or "builtin"; overrides [model] model')
    ap.add_argument("--host", help="overrides [server] host")
    ap.add_argument("--port", type=int, help="overrides [server] port")
    ap.add_argument("--tool-call-parser", metavar="NAME",
                    help='how tool_choice "auto" reads tool calls from the output (a registered parser, see '
                         '`llmserve plugins`); overrides [server] tool_call_parser (default hermes)')
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='accepted as vLLM takes it; tool_choice "auto" is always on here')
    ap.add_argument("--prompt", action="append", help="generate for this prompt offline instead of serving (repeatable)")
    ap.add_argument("--max-tokens", type=int, default=32, help="with --prompt")
    ap.add_argument("--temperature", type=float, default=0.0, help="with --prompt")
    ap.add_argument("--seed", type=int, default=None, help="with --prompt")
    args = ap.parse_args(argv)

    from llmserve.logging import configure_logging
    configure_logging()
    try:
        config = EngineConfig.from_toml(args.config)
    except (OSError, ValueError) as exc:
        ap.error(f"--config {args.config}: {exc}")
    if args.model:
        config.model.model = args.model
    if args.host:
        config.server.host = args.host
    if args.port is not None:
        config.server.port = args.port
    if args.tool_call_parser:
        config.server.tool_call_parser = args.tool_call_parser
    if args.prompt:
        return _generate(ap, config, args)
    import anyio

    from llmserve.plugin_manager import PluginError
    from llmserve.server.run import serve
    from llmserve.server.tool_calls import tool_parser
    try:  # before anything starts: an unknown parser is a usage error
        tool_parser(config)
    except (ValueError, PluginError) as exc:
        ap.error(str(exc))
    anyio.run(serve, config, backend="asyncio")
    return 0


def _bench(argv: list[str]) -> int:
    kinds = {"throughput": "llmserve.bench.throughput", "serve": "llmserve.bench.serve",
             "quality": "llmserve.bench.quality"}
    if not argv or argv[0] not in kinds:
        print(f"usage: llmserve bench {{{','.join(kinds)}}} [options]  (--help on either)", file=sys.stderr)
        return 2
    import importlib
    importlib.import_module(kinds[argv[0]]).main(argv[1:])
    return 0


def _plugins(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="llmserve plugins", description="List plugins: built-in, installed, skipped.")
    ap.add_argument("--config", help="TOML file whose [plugins] block/allow lists apply")
    ap.add_argument("--json", action="store_true", help="one JSON object per plugin")
    args = ap.parse_args(argv)
    from llmserve.plugin_manager import PluginError, Plugins
    try:
        config = EngineConfig.from_toml(args.config) if args.config else EngineConfig()
        rows = Plugins.from_config(config.plugins).describe()
    except (OSError, ValueError, PluginError) as exc:
        print(f"llmserve plugins: {exc}", file=sys.stderr)
        return 1
    for row in rows:
        if args.json:
            print(json.dumps(row))
            continue
        provides = [f"quantization: {', '.join(row['quantization_methods'])}"] if row["quantization_methods"] else []
        provides += [f"decoding: {', '.join(row['decoding_strategies'])}"] if row["decoding_strategies"] else []
        provides += [f"tool parsers: {', '.join(row['tool_parsers'])}"] if row["tool_parsers"] else []
        provides += [f"hooks: {', '.join(row['hooks'])}"]
        print(f"{row['name']:<16} {row['status']:<22} {row['source'] or '-':<28} {'; '.join(provides)}")
    return 0


def _generate(ap: argparse.ArgumentParser, config: EngineConfig, args: argparse.Namespace) -> int:
    from llmserve import LLM, SamplingParams
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
