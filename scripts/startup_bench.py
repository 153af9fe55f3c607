"""The server's start-up as a user meets it: seconds from launching `llmserve --config` to a 200
from /health, on W-large's model (Llama-3.1-8B shape, dummy weights) with a tokenizer in the
checkpoint directory as a real one has (the built-in model's), CUDA graphs captured.

    python scripts/startup_bench.py [--workload w-large] [--runs 3] [--cold] [--json out.json]

--cold gives the first run an empty Triton cache (a fresh machine: every kernel compiled), which
the others then find filled, as restarts do. Per run: seconds to ready, and the engine's start-up
phases from its "engine ready" log line.
"""

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from llmserve.bench.report import report
from llmserve.bench.workloads import WORKLOADS
from llmserve.engine import BUILTIN_MODEL_DIR

PORT = 8011


def until_ready(proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited during start-up (exit code {proc.returncode})")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"not ready after {timeout} s")


def one_run(config: str, log_path: str, env: dict) -> dict:
    with open(log_path, "w") as log:
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "llmserve.cli", "--config", config], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            until_ready(proc, timeout=300)
            ready = time.perf_counter() - start
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    text = open(log_path).read()
    phases = re.search(r"startup_s=(\{[^}]*\})", text)
    return {"ready_s": round(ready, 2), "engine_phases_s": ast.literal_eval(phases.group(1)) if phases else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="w-large", choices=sorted(WORKLOADS))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="the first run on an empty Triton cache")
    ap.add_argument("--engine-process", default="true", choices=["true", "false"])
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = WORKLOADS[args.workload]().write_model_dir(os.path.join(tmp, "model"))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(BUILTIN_MODEL_DIR / name, model)
        config = os.path.join(tmp, "config.toml")
        with open(config, "w") as f:
            f.write(f'[model]\nmodel = "{model}"\nload_format = "dummy"\n'
                    f'[server]\nport = {PORT}\nengine_process = {args.engine_process}\n')
        for i in range(args.runs):
            env = dict(os.environ)
            if args.cold:  # empty for the first run, which fills it for the others
                env["TRITON_CACHE_DIR"] = os.path.join(tmp, "triton-cache")
            row = {"run": i + 1, "cold": bool(args.cold and i == 0), "engine_process": args.engine_process,
                   **one_run(config, os.path.join(tmp, f"server-{i}.log"), env)}
            rows.append(row)
            print(row, flush=True)
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
