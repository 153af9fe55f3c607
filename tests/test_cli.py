"""The `llmserve` command: engine flags generated from the config dataclasses, `--version`, `--help`,
start-up failures as one line before the model loads, and `llmserve serve builtin` serving."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import llmserve
from llmserve.cli import parse_serve, serve_parser
from llmserve.cli_flags import field_docs, flags, make_flags, overrides, sections
from llmserve.config import EngineConfig
from servers import launched

SAMPLES = {bool: None, int: ("7", 7), float: ("0.5", 0.5), str: ("x", "x"), list: ("a.example, b", ["a.example", "b"]),
           dict: ('{"temperature": 0.5}', {"temperature": 0.5})}
"""Per flag type: what is typed and the value it must give (bool: --x or --no-x, below)."""


def llmserve_cli(*args: str, timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "llmserve.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **env})


# ---- flags from the config dataclasses -------------------------------------------------------------

def test_every_config_field_has_a_documented_flag_that_sets_it():
    by_field = {(f.section, f.name): f for f in flags()}
    parser = serve_parser()
    for section, klass in sections().items():
        docs = field_docs(klass)
        for field in dataclasses.fields(klass):
            flag = by_field.pop((section, field.name))  # KeyError: a field without a flag
            assert field.name in docs, f"{section}.{field.name} has no docstring in config.py"
            assert flag.help.startswith(docs[field.name]) and f"[{section}] {field.name}" in flag.help
            if flag.kind is bool:
                default = getattr(klass(), field.name)
                argv, value = [flag.option.replace("--", "--no-", 1) if default else flag.option], not default
            elif flag.several:
                argv, value = [flag.option, "a, b", "c"], ["a, b", "c"]
            else:
                typed, value = SAMPLES[flag.kind]
                argv = [flag.option, typed]
            assert overrides(parser.parse_args(argv)) == {section: {field.name: value}}, argv
    assert not by_field, f"flags for no field: {sorted(by_field)}"
    assert len({f.option for f in flags()}) == len(flags())


def test_flag_spelling_is_vllms_and_plugins_keys_carry_their_section():
    options = {f.option for f in flags()}
    assert {"--max-model-len", "--gpu-memory-utilization", "--max-num-seqs", "--max-num-batched-tokens", "--dtype",
            "--quantization", "--kv-cache-dtype", "--enable-prefix-caching", "--served-model-name", "--api-key",
            "--tensor-parallel-size", "--host", "--port", "--tool-call-parser", "--model", "--seed"} <= options
    assert {"--plugins-block", "--plugins-allow"} <= options and "--block" not in options


@dataclasses.dataclass
class _Left:
    size: int = 1
    """Left size."""
    name: str | None = None


@dataclasses.dataclass
class _Right:
    size: float = 2.0


def test_a_field_name_two_sections_share_carries_the_section():
    made = {f.option: (f.section, f.name, f.kind, f.help) for f in make_flags({"left": _Left, "right": _Right})}
    assert made == {"--left-size": ("left", "size", int, "Left size. [left] size, default 1."),
                    "--name": ("left", "name", str, "[left] name, default unset."),
                    "--right-size": ("right", "size", float, "[right] size, default 2.0.")}


def test_flags_override_the_config_file_key_by_key(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[model]\nmodel = "from-file"\nmax_model_len = 1024\ndtype = "float32"\n'
                   '[cache]\nenable_prefix_caching = true\nblock_size = 8\n[server]\nport = 9000\napi_key = "file"\n')
    config, args = parse_serve(["m", "--max-model-len", "512", "--no-enable-prefix-caching",
                                "--gpu-memory-utilization", "0.5", "--served-model-name", "m", "--api-key", "k",
                                "--allowed-hosts", "a.example,b.example", "--config", str(cfg)])
    assert config == EngineConfig.from_dict({
        "model": {"model": "m", "max_model_len": 512, "dtype": "float32"},
        "cache": {"enable_prefix_caching": False, "block_size": 8, "gpu_memory_utilization": 0.5},
        "server": {"port": 9000, "api_key": "k", "served_model_name": "m", "allowed_hosts": ["a.example", "b.example"]},
    })
    assert not args.prompt
    # Without file or flags: the defaults; the form without `serve` takes --model and no MODEL.
    assert parse_serve([])[0] == EngineConfig()
    assert parse_serve(["--config", str(cfg), "--model", "d"], prog="llmserve", positional=False)[0].model.model == "d"
    assert parse_serve(["--allowed-hosts", ""])[0].server.allowed_hosts == []


@pytest.mark.parametrize("argv, match", [
    (["--gpu-memory-utilization", "1.5"], r"cache.gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    (["a", "--model", "b"], "the model is given twice: 'a' and --model 'b'"),
    (["--config", "/no/such.toml"], "--config /no/such.toml: .*No such file"),
])
def test_bad_values_raise_one_clear_error(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_serve(argv)


def test_vllms_flags_for_what_llmserve_always_does_are_accepted_and_the_others_refused_saying_why():
    """A command copied from vLLM's docs runs where its flags ask for what llmserve does anyway;
    one that asks for what it does not do fails naming the flag and why (not "unrecognized")."""
    from llmserve.cli import VLLM_ACCEPTED, VLLM_ACCEPTED_VALUES, VLLM_REFUSED, VLLM_REFUSED_BUT

    plain = parse_serve(["m"])[0]
    assert parse_serve(["m", *VLLM_ACCEPTED, *(a for flag in VLLM_ACCEPTED_VALUES for a in (flag, "4")),
                        *(a for flag, values in VLLM_REFUSED_BUT.items() for a in (flag, values[0]))])[0] == plain
    for flag, values in VLLM_REFUSED_BUT.items():
        for value in values:
            assert parse_serve(["m", flag, value])[0] == plain
    quiet = parse_serve(["m", "--disable-log-stats"])[0]
    assert quiet.scheduler.log_interval_s == 0 and dataclasses.replace(quiet.scheduler, log_interval_s=5.0) == plain.scheduler
    assert parse_serve(["m", "--disable-log-stats", "--log-interval-s", "0"])[0] == quiet
    with pytest.raises(ValueError, match="--disable-log-stats and --log-interval-s disagree"):
        parse_serve(["m", "--disable-log-stats", "--log-interval-s", "2"])
    for flag, why in VLLM_REFUSED.items():
        for argv in ([flag], [flag, "2"]) + (([flag, "a=b", "c=d"],) if flag not in VLLM_REFUSED_BUT else ()):
            with pytest.raises(ValueError, match="^" + re.escape(f"{flag}: {why}") + "$"):
                parse_serve(["m", *argv])
    help_text = serve_parser().format_help()
    assert all(flag in help_text for flag in VLLM_ACCEPTED) and "--revision" not in help_text


def test_vllms_other_spellings_of_a_flag_are_taken():
    """Underscores in a flag's name and vLLM's short forms mean the flag; a list flag also takes a
    JSON list (vLLM's `--allowed-origins '["*"]'`)."""
    ours = parse_serve(["m", "--max-model-len", "512", "--gpu-memory-utilization", "0.5", "--tensor-parallel-size", "2",
                        "--data-parallel-size", "2", "--quantization", "fp8", "--allowed-origins", "*"])[0]
    assert parse_serve(["m", "--max_model_len", "512", "--gpu_memory_utilization=0.5", "-tp", "2", "-dp=2",
                        "-q", "fp8", "--allowed_origins", '["*"]'])[0] == ours
    assert parse_serve(["--allowed-hosts", '["a.example", "b.example"]'])[0].server.allowed_hosts == ["a.example",
                                                                                                      "b.example"]
    assert parse_serve(["--chat-template=my_template.jinja"])[0].server.chat_template == "my_template.jinja"
    assert parse_serve(["--allowed-hosts", "[::1],api.example"])[0].server.allowed_hosts == ["[::1]", "api.example"]
    with pytest.raises(SystemExit):
        parse_serve(["--allowed-hosts", '["a", 1]'])
    # values stay as typed: after "=", with a space in them, after "--"
    assert parse_serve(["--prompt", "--what_is x_y?"])[1].prompt == ["--what_is x_y?"]
    assert parse_serve(["--served-model-name=my_model"])[0].server.served_model_name == "my_model"
    several = parse_serve(["m", "--served-model-name", "a", "org/b", "--api-key", "k,1", "k2"])[0].server
    assert (several.served_model_name, several.api_key) == (["a", "org/b"], ["k,1", "k2"])  # each value whole
    with pytest.raises(ValueError, match="--api-key took 'builtin' as one of its values: give MODEL before"):
        parse_serve(["--api-key", "k1", "k2", "builtin"])  # (vLLM's nargs: MODEL after them is one of them)
    assert parse_serve(["--api-key", "k1", "k2", "--", "builtin"])[0].server.api_key == ["k1", "k2"]
    assert parse_serve(["--model", "builtin", "--served-model-name", "a", "builtin"])[0].server.served_model_name == \
        ["a", "builtin"]  # MODEL given as --model: the names are names
    assert parse_serve(["--", "-q_dir"])[0].model.model == "-q_dir"
    with pytest.raises(ValueError, match="^--pipeline-parallel-size: "):
        parse_serve(["m", "-pp", "2"])
    # vLLM's other names of flags and values
    config = parse_serve(["m", "--dtype", "half", "--generation-config=vllm", "--load-format", "safetensors",
                          "--scheduling-policy", "priority"])[0]
    assert (config.model.dtype, config.model.generation_config, config.model.load_format,
            config.scheduler.policy) == ("float16", "none", "auto", "priority")
    assert parse_serve(["m", "--dtype=float"])[0].model.dtype == "float32"
    for argv in (["-O", "3"], ["-O3"], ["-O=3"], ["-Odecode"]):
        with pytest.raises(ValueError, match="^--optimization-level: "):
            parse_serve(["m", *argv])


# ---- the command in a process of its own ------------------------------------------------------------

def test_version_and_help_list_the_subcommands():
    version = llmserve_cli("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"llmserve {llmserve.__version__}"
    top = llmserve_cli("--help")
    assert top.returncode == 0
    commands = {line.split()[0] for line in top.stdout.splitlines() if line.startswith("  ") and len(line.split()) > 2}
    assert {"serve", "bench", "plugins"} <= commands
    serve_help = llmserve_cli("serve", "--help").stdout
    assert "--no-enable-prefix-caching" in serve_help and "Longest prompt + output, in tokens" in serve_help


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    return proc.stderr.strip()


def test_a_port_in_use_fails_in_one_line_before_the_model_loads(tmp_path):
    # An empty checkpoint directory passes the directory check but would fail with a traceback
    # once loaded: the one line about the port shows nothing was loaded.
    (tmp_path / "ckpt").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = llmserve_cli("serve", str(tmp_path / "ckpt"), "--port", str(port), timeout=30)
        elapsed = time.monotonic() - start
    assert proc.returncode == 1
    assert one_line(proc) == f"llmserve serve: error: cannot listen on 127.0.0.1 port {port}: Address already in use"
    assert elapsed < 20


@pytest.mark.parametrize("argv, status, message", [
    (["serve", "/no/such/checkpoint"], 1, "llmserve serve: error: model directory '/no/such/checkpoint' does not exist"),
    (["--model", "/no/such/checkpoint"], 1, "llmserve: error: model directory '/no/such/checkpoint' does not exist"),
    (["serve", "--max-num-seqs", "0"], 2, "llmserve serve: error: scheduler.max_num_seqs must be >= 1, got 0"),
    (["serv"], 2, "llmserve: error: unknown command 'serv'; commands: serve, bench, plugins (llmserve --help)"),
    (["serve", "builtin", "--ssl-certfile", "/no/cert.pem", "--ssl-keyfile", "/no/key.pem"], 1,
     "llmserve serve: error: cannot use --ssl-certfile /no/cert.pem with --ssl-keyfile /no/key.pem: "
     "[Errno 2] No such file or directory"),
])
def test_start_up_failures_are_one_line(argv, status, message):
    proc = llmserve_cli(*argv)
    assert proc.returncode == status and one_line(proc) == message


def test_llmserve_serve_builtin_serves_with_the_flags(tmp_path):
    proc, url, _ = launched([sys.executable, "-m", "llmserve.cli", "serve", "builtin", "--device", "cpu",
                             "--log-interval-s", "0", "--served-model-name", "m", "--api-key", "k",
                             "--max-model-len", "256"], env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert httpx.get(f"{url}/v1/models").status_code == 401  # --api-key reached the server
        models = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer k"}).json()
        assert [(m["id"], m.get("max_model_len")) for m in models["data"]] == [("m", 256)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_every_subpackage_ships_in_the_wheel():
    """pyproject.toml lists the packages by hand (kernels/ and plugins/ live outside src/): a new
    subpackage left off the list would be missing from every install but an editable one."""
    import tomllib
    from pathlib import Path
    root = Path(__file__).parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(("llmserve",) + p.parent.relative_to(root / "src" / "llmserve").parts)
             for p in (root / "src" / "llmserve").rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
