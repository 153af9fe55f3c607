"""A live server on 127.0.0.1 for tests: the built-in model on the CPU, in-process or with its
engine process, stopped the way a signal stops it."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio
import openai
from anyio.from_thread import start_blocking_portal

from llmserve.config import EngineConfig
from llmserve.distributed.replicas import ReplicatedEngine
from llmserve.engine import BUILTIN_MODEL_DIR, Engine, Frontend
from llmserve.engine_process import ProcessEngine
from llmserve.server.run import serve

MODEL = "llmserve-builtin"


def launched(argv: list[str], env: dict | None = None) -> tuple[subprocess.Popen, str, str]:
    """`llmserve` in a child process with `--port 0`, appended to argv: the system picks a free port
    at bind time (a port picked here beforehand can be taken by then, by a Ray worker of a test in
    parallel, say). Returns the process, its URL from the "serving" line of its log, and the log
    up to that line; the caller stops the process."""
    proc = subprocess.Popen([*argv, "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"PYTHONUNBUFFERED": "1", **(env or os.environ)})
    log = []
    for line in proc.stdout:
        log.append(line)
        if found := re.search(r"\bserving\s.*\burl=(http://\S+)", line):
            return proc, found[1], "".join(log)
    proc.wait()
    raise AssertionError(f"exited ({proc.returncode}) before serving:\n{''.join(log)}")


def thinker(tmp_path: Path) -> Path:
    """The built-in model under a template that renders each message's reasoning_content in
    parentheses before its content (so a prompt's length shows whether the thinking reached it)."""
    model = tmp_path / "thinker"
    shutil.copytree(BUILTIN_MODEL_DIR, model)
    (model / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m.reasoning_content %}({{ m.reasoning_content }}){% endif %}"
        "{{ m['content'] }}\n\n{% endfor %}")
    return model


@dataclass
class Server:
    url: str
    engine: Frontend

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=kw.pop("api_key", "none"), max_retries=0, **kw)

    def idle(self) -> bool:
        snap = self.engine.snapshot()  # from the engine process: at most one step old
        return snap.kv_usage == 0 and snap.running == snap.waiting == 0


@contextmanager
def running_server(engine_process: bool = False, model: str = "builtin", model_opts: dict | None = None,
                   **server_opts):
    """server_opts: [server] keys, and the sections "cache", "scheduler", "speculative" and
    "parallel" as dicts; model_opts: [model] keys. With data_parallel_size > 1, replicas."""
    sections = {name: server_opts.pop(name, {}) for name in ("cache", "scheduler", "speculative", "parallel")}
    config = EngineConfig.from_dict({
        "model": {"model": model, "device": "cpu", "dtype": "float32", **(model_opts or {})},
        "cache": {"num_blocks": 256, "block_size": 16, **sections["cache"]},
        "scheduler": {"log_interval_s": 0, **sections["scheduler"]},
        "speculative": sections["speculative"],
        "parallel": sections["parallel"],
        "server": {"port": 0, **server_opts},  # the server takes a free port and reports it
    })
    if config.parallel.data_parallel_size > 1:
        engine = ReplicatedEngine(config)
    else:
        engine = ProcessEngine(config) if engine_process else Engine(config)
    with start_blocking_portal("asyncio") as portal:
        stop = portal.call(anyio.Event)
        future, port = portal.start_task(partial(serve, config, stop=stop, handle_signals=False, engine=engine))
        try:
            yield Server(f"http://127.0.0.1:{port}", engine)
        finally:
            portal.call(stop.set)
            future.result(timeout=30)


def wait_for(cond, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


