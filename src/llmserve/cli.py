"""Command line.

    llmserve serve [MODEL] [--config FILE] [--ENGINE-FLAG ...]   serve the OpenAI-compatible API
    llmserve --config FILE [--ENGINE-FLAG ...]                    the same (the form before `serve`)
    llmserve serve [MODEL] ... --prompt "..." [--prompt ...]      generate offline, one JSON line each
    llmserve bench throughput --workload w-small [--peer hf]     offline throughput vs the roofline
    llmserve bench serve --url URL --workload w-small --rate inf online serving metrics (a client)
    llmserve bench quality [--shapes w-small,w-large]            perplexity / logits of quantized variants
    llmserve plugins [--config config.toml] [--json]             the plugins found, what each registers
    llmserve --version

Every config key is an engine flag (cli_flags.py): `--max-model-len 8192`, `--no-enable-prefix-caching`.
Values come from the defaults, then the --config file, then the flags. Start-up failures found before
the model loads (a bad value, a missing model directory, a port in use) are one line on stderr:
exit status 2 for a bad command line or config, 1 for the others.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tomllib
from pathlib import Path

from llmserve import __version__
from llmserve.cli_flags import add_config_flags, flags, json_object, overrides
from llmserve.config import EngineConfig

COMMANDS = {
    "serve": "serve the OpenAI-compatible API: llmserve serve [MODEL] [--config FILE] [engine flags]",
    "bench": "benchmarks: throughput (offline, vs the roofline), serve (an HTTP client), quality",
    "plugins": "list the plugins found, built-in and installed, and what each registers",
}

TOP_HELP = f"""usage: llmserve <command> [options]

llmserve {__version__}: OpenAI-compatible LLM inference server

commands:
{chr(10).join(f"  {name:<9}{line}" for name, line in COMMANDS.items())}

  llmserve --config FILE [engine flags]   the same as `llmserve serve --config FILE [engine flags]`
  llmserve --version                      print the version
  llmserve <command> --help               the command's options (serve: every config key as a flag)
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    head = argv[0] if argv else None
    if head == "bench":
        return _bench(argv[1:])
    if head == "plugins":
        return _plugins(argv[1:])
    if head == "serve":
        return _serve(argv[1:], "llmserve serve", positional=True)
    if head in ("--version", "-V"):
        print(f"llmserve {__version__}")
        return 0
    if head in (None, "-h", "--help"):
        print(TOP_HELP, end="", file=sys.stdout if head else sys.stderr)
        return 0 if head else 2
    if head.startswith("-"):  # `llmserve --config FILE ...`, the form from before subcommands
        return _serve(argv, "llmserve", positional=False)
    return _fail("llmserve", f"unknown command {head!r}; commands: {', '.join(COMMANDS)} (llmserve --help)", 2)


def serve_parser(prog: str = "llmserve serve", positional: bool = True) -> argparse.ArgumentParser:
    """The parser of `llmserve serve` (and of the bare `llmserve --config` form, without MODEL)."""
    usage = f"{prog} {'[MODEL] ' if positional else ''}[--config FILE] [--prompt TEXT ...] [engine flags]"
    ap = argparse.ArgumentParser(prog=prog, usage=usage, description="Serve the OpenAI-compatible API (or generate offline "
                                 "with --prompt). Every config key is a flag; flags override the --config file.")
    if positional:
        ap.add_argument("model_arg", nargs="?", metavar="MODEL",
                        help='checkpoint directory or "builtin" (the same as --model)')
    ap.add_argument("--config", metavar="FILE", help="TOML file (see config.example.toml); flags override its values")
    ap.add_argument("--version", action="version", version=f"llmserve {__version__}")
    ap.add_argument("--speculative-config", metavar="JSON", type=json_object,
                    help='the [speculative] section as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                         '(the --speculative-* flags override its keys)')
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='accepted as vLLM takes it; tool_choice "auto" is always on here')
    vllm = ap.add_argument_group("vLLM's flags that ask for what llmserve always does (others are refused, saying why)")
    for flag, why in VLLM_ACCEPTED.items():
        vllm.add_argument(flag, action="store_true", help=f"accepted: {why}")
    vllm.add_argument("--disable-log-stats", action="store_true", help="the same as --log-interval-s 0")
    for flag, why in VLLM_ACCEPTED_VALUES.items():
        vllm.add_argument(flag, metavar="VALUE", help=f"accepted: {why}")
    for flag in VLLM_REFUSED:
        if flag in VLLM_REFUSED_BUT:  # one value may be taken (a MODEL after it stays MODEL)
            vllm.add_argument(flag, nargs="?", const=True, help=argparse.SUPPRESS)
        else:  # refused with any values (--lora-modules takes several)
            vllm.add_argument(flag, nargs="*", help=argparse.SUPPRESS)
    offline = ap.add_argument_group("offline generation (instead of serving)")
    offline.add_argument("--prompt", action="append", help="generate for this prompt, print one JSON line (repeatable)")
    offline.add_argument("--max-tokens", type=int, default=32, help="with --prompt (default 32)")
    offline.add_argument("--temperature", type=float, default=0.0, help="with --prompt (default 0: greedy)")
    add_config_flags(ap)  # --seed among them: with --prompt it also seeds the prompts' sampling
    return ap


VLLM_ACCEPTED = {
    "--trust-remote-code": "no code from a checkpoint runs here; its architecture must be one llmserve builds",
    "--enable-chunked-prefill": "prefill is always chunked (--max-num-batched-tokens is a step's token budget)",
    "--disable-log-requests": "requests are not logged",
    "--disable-uvicorn-access-log": "the server writes no access log",
}
"""vLLM's flags that ask for what llmserve does anyway: a command copied from vLLM's docs runs."""

VLLM_ACCEPTED_VALUES = {
    "--swap-space": "preempted requests are computed again, never swapped to the CPU (as vLLM's V1 engine)",
    "--max-log-len": "requests are not logged",
}
"""The same, for flags that take a value (any value)."""

_NO_HUB = "there is no model hub here: MODEL (and --tokenizer) is a local checkpoint folder"
_NO_LORA = "no LoRA adapters"
VLLM_REFUSED = {
    "--no-enable-chunked-prefill": "prefill is always chunked; --max-num-batched-tokens sets a step's token budget",
    "--revision": _NO_HUB, "--tokenizer-revision": _NO_HUB, "--code-revision": _NO_HUB, "--download-dir": _NO_HUB,
    "--hf-token": _NO_HUB,
    "--pipeline-parallel-size": "no pipeline parallelism: --tensor-parallel-size (GPUs of one host) or "
                                "--data-parallel-size (replicas)",
    "--enable-lora": _NO_LORA, "--lora-modules": _NO_LORA, "--max-loras": _NO_LORA, "--max-lora-rank": _NO_LORA,
    "--tokenizer-mode": "the tokenizer is the checkpoint's, through transformers (auto)",
    "--enable-log-requests": "requests are not logged",
    "--uvicorn-log-level": "the server is Hypercorn; LLMSERVE_LOG_LEVEL sets the log level",
    "--response-role": "the answer's role is always assistant",
    "--limit-mm-per-prompt": "text only: no image, audio or video inputs",
    "--cpu-offload-gb": "the weights stay on the GPU",
    "--enable-expert-parallel": "a mixture of experts is split by --tensor-parallel-size",
    "--rope-scaling": "the rope scaling is the checkpoint's config.json's",
    "--compilation-config": "CUDA graphs are llmserve's own (--enforce-eager turns them off); nothing is compiled",
    "--optimization-level": "CUDA graphs are llmserve's own (--enforce-eager turns them off); nothing is compiled",
    "--max-logprobs": "a request may ask for at most 20 logprobs a token (OpenAI's limit)",
    "--preemption-mode": "preempted requests are computed again (recompute), never swapped to the CPU",
    "--num-scheduler-steps": "a step is planned while the one before runs (async scheduling), one token a step",
    "--tokenizer-pool-size": "the server's tokenizer runs on worker threads, long prompts off the event loop",
    "--api-server-count": "one HTTP server process; --data-parallel-size replicas share it",
    "--chat-template-content-format": "a message's text parts reach the template joined, as one string",
    "--kv-transfer-config": "no disaggregated prefill: prefill and decode run on the same GPUs",
    "--hf-overrides": "the checkpoint's config.json is used as it is",
    "--max-seq-len-to-capture": "CUDA graphs hold decode steps whatever their context length",
    "--cuda-graph-sizes": "CUDA graphs are captured for a ladder of decode batch sizes (1, 2, 4, 8, then every 16) "
                          "up to --max-num-seqs, and of mixed steps' token counts",
    "--root-path": "the API is served at the root: a proxy in front strips its prefix",
    "--middleware": "no ASGI middleware is loaded; a plugin adds what the engine does",
    "--allowed-local-media-path": "text only: no image, audio or video inputs",
    "--ssl-ca-certs": "client certificates are not checked: use --api-key",
    "--enable-server-load-tracking": "/metrics reports the requests running and waiting",
}
"""vLLM's flags for what llmserve does not do: refused, saying so, rather than unrecognized."""

VLLM_REFUSED_BUT = {"--pipeline-parallel-size": ("1",), "--tokenizer-mode": ("auto", "hf"),
                    "--response-role": ("assistant",), "--cpu-offload-gb": ("0",), "--max-logprobs": ("20",),
                    "--preemption-mode": ("recompute",), "--num-scheduler-steps": ("1",),
                    "--api-server-count": ("1",), "--chat-template-content-format": ("auto", "string")}
"""The values of a refused flag that ask for what llmserve does: taken."""

VLLM_VALUES = {"--dtype": {"half": "float16", "float": "float32"}, "--generation-config": {"vllm": "none"},
               "--load-format": {"safetensors": "auto"}}
"""vLLM's names for values llmserve spells otherwise."""

VLLM_NAMES = {"--scheduling-policy": "--policy", "-O": "--optimization-level", "-tp": "--tensor-parallel-size",
              "-dp": "--data-parallel-size", "-pp": "--pipeline-parallel-size", "-q": "--quantization",
              "--disable-frontend-multiprocessing": "--no-engine-process"}
"""vLLM's names for flags llmserve spells otherwise, its short forms among them."""


def vllm_spellings(argv: list[str]) -> list[str]:
    """argv with vLLM's other spellings of a flag made ours: underscores in its name
    (`--max_model_len`, `--max_model_len=512`), its other names (VLLM_NAMES: `-tp 2`, `-tp=2`,
    `-O3`) and its names for some values (VLLM_VALUES: `--dtype half`). Other values
    stay as typed: one with a space in it (argparse takes "--a b" as a value), and all after "--"."""
    out: list[str] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("-O") and len(arg) > 2 and arg[2] != "=" and not any(c.isspace() for c in arg):
            out += [VLLM_NAMES["-O"], arg[2:]]  # -O3: vLLM's -O and its value in one
            continue
        name, eq, value = arg.partition("=")
        if name.startswith("-") and not any(c.isspace() for c in name):
            if name.startswith("--"):
                name = "--" + name[2:].replace("_", "-")
            name = VLLM_NAMES.get(name, name)
        elif out and out[-1] in VLLM_VALUES and not eq:  # the value of the flag before
            name = VLLM_VALUES[out[-1]].get(name, name)
        if eq and name in VLLM_VALUES:
            value = VLLM_VALUES[name].get(value, value)
        out.append(name + eq + value)
    return out


def parse_serve(argv: list[str], prog: str = "llmserve serve",
                positional: bool = True) -> tuple[EngineConfig, argparse.Namespace]:
    """argv (after `serve`) -> the EngineConfig it names and the parsed arguments. Raises ValueError
    naming the file, the key or the flag for an unreadable file or a value out of range; exits 2
    (argparse) for a malformed command line."""
    args = serve_parser(prog, positional).parse_args(vllm_spellings(argv))
    data: dict = {}
    if args.config:
        try:
            with open(args.config, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"--config {args.config}: {exc}") from exc
    for flag, why in VLLM_REFUSED.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value not in VLLM_REFUSED_BUT.get(flag, ()):
            raise ValueError(f"{flag}: {why}")
    given = overrides(args)
    if args.disable_log_stats:
        if given.get("scheduler", {}).get("log_interval_s", 0) != 0:
            raise ValueError("--disable-log-stats and --log-interval-s disagree")
        given.setdefault("scheduler", {})["log_interval_s"] = 0.0
    if args.speculative_config is not None:
        given["speculative"] = {**args.speculative_config, **given.get("speculative", {})}
    model = getattr(args, "model_arg", None)
    if positional and model is None and "model" not in given.get("model", {}):
        for flag in flags():
            values = vars(args).get(f"{flag.section}.{flag.name}")
            if flag.several and isinstance(values, list) and len(values) > 1 and (
                    values[-1] == "builtin" or os.path.isdir(values[-1])):
                raise ValueError(f"{flag.option} took {values[-1]!r} as one of its values: give MODEL before the "
                                 f"flags (or end {flag.option}'s values with --)")
    if model is not None:
        if given.get("model", {}).get("model", model) != model:
            raise ValueError(f"the model is given twice: {model!r} and --model {given['model']['model']!r}")
        given.setdefault("model", {})["model"] = model
    for section, values in given.items():
        if not isinstance(data.get(section, {}), dict):
            raise ValueError(f"--config {args.config}: [{section}] is not a table")
        data[section] = {**data.get(section, {}), **values}
    return EngineConfig.from_dict(data), args


def _serve(argv: list[str], prog: str, positional: bool) -> int:
    try:
        config, args = parse_serve(argv, prog, positional)
    except ValueError as exc:
        return _fail(prog, str(exc), 2)
    problem = _missing_model(config)
    if problem:
        return _fail(prog, problem, 1)
    from llmserve.logging import configure_logging
    configure_logging()
    if args.prompt:
        return _generate(prog, config, args)
    problem = _port_in_use(config.server.host, config.server.port) or _unusable_certificate(config)
    if problem:
        return _fail(prog, problem, 1)
    import anyio

    from llmserve.plugin_manager import PluginError
    from llmserve.server.run import serve
    from llmserve.server.reasoning import reasoning_format
    from llmserve.server.tool_calls import tool_parser
    try:  # before anything starts: an unknown parser is a usage error
        tool_parser(config)
        reasoning_format(config)
    except (ValueError, PluginError) as exc:
        return _fail(prog, str(exc), 2)
    anyio.run(serve, config, backend="asyncio")
    return 0


def _fail(prog: str, message: str, status: int) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


def _missing_model(config: EngineConfig) -> str | None:
    """The engine reads these directories only once it loads; a typo should not wait for that."""
    for key, path in (("model", config.model.model), ("tokenizer", config.model.tokenizer)):
        if path is not None and not (key == "model" and path == "builtin") and not Path(path).is_dir():
            return f"{key} directory {path!r} does not exist"
    return None


def _port_in_use(host: str, port: int) -> str | None:
    """Bind host:port the way the server will, and let go at once: the server binds it once its
    plugins and configuration are read, after the heavy imports. Another process may still take
    the port in between; this catches the common case before any of that."""
    if port == 0:
        return None
    from llmserve.server.run import bound_socket
    try:
        bound_socket(host, port).close()
    except OSError as exc:
        return f"cannot listen on {host.replace('[', '').replace(']', '')} port {port}: {exc.strerror or exc}"
    return None


def _unusable_certificate(config: EngineConfig) -> str | None:
    """server.ssl_certfile and ssl_keyfile, loaded as the server will load them once the model is
    ready: a wrong path or a key of another certificate is found now, in one line."""
    cfg = config.server
    if cfg.ssl_certfile is None:
        return None
    import ssl
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cfg.ssl_certfile, cfg.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        return f"cannot use --ssl-certfile {cfg.ssl_certfile} with --ssl-keyfile {cfg.ssl_keyfile}: {exc}"
    return None


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
        provides += [f"reasoning parsers: {', '.join(row['reasoning_parsers'])}"] if row["reasoning_parsers"] else []
        provides += [f"proposers: {', '.join(row['proposers'])}"] if row["proposers"] else []
        provides += [f"models: {', '.join(row['models'])}"] if row["models"] else []
        provides += [f"hooks: {', '.join(row['hooks'])}"]
        print(f"{row['name']:<16} {row['status']:<22} {row['source'] or '-':<28} {'; '.join(provides)}")
    return 0


def _generate(prog: str, config: EngineConfig, args: argparse.Namespace) -> int:
    from llmserve import LLM, SamplingParams
    # --seed sets [model] seed; as before subcommands, it also seeds each prompt's sampling.
    seed = config.model.seed if "model.seed" in vars(args) else None
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=seed)
    except ValueError as exc:
        return _fail(prog, str(exc), 2)
    with LLM(config=config) as llm:
        for out in llm.generate(args.prompt, params, use_tqdm=False):
            c = out.outputs[0]
            print(json.dumps({"prompt": out.prompt, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
