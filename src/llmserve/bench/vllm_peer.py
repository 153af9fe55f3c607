"""vLLM as a same-run peer of `bench throughput`: the same workload through vLLM's offline `LLM`, in
a process of its own (vLLM must not share our CUDA context, and its import is its own).

    ours (run_vllm_peer)                          the peer (this file, run as a script)
    DIR/request.json: workload + LLM settings ──▶ import vllm (from the --vllm-site tree), timed
    python -P vllm_peer.py DIR/request.json       DIR/model/config.json; LLM(dummy weights), timed
        DIR/result.json                           one warm-up request with the workload's sampling
    its output streamed to our stderr       ◀──── reset the prefix cache; the whole generate timed
    result.json read back                         DIR/result.json; "RESULT {...}" on stdout

As a script this file imports only the standard library and vLLM, never llmserve (`-P` keeps its
own folder, whose modules are named like top-level ones, off sys.path). The settings are those of
the shared peers/vllm/ measurements that WORKLOADS.md quotes: vLLM's defaults (torch.compile, CUDA
graphs, async scheduling, its attention backend) but our engine's batch limits and bf16 dummy
weights of the workload's model config.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmserve.bench.workloads import Workload

SITE_ENV = "LLMSERVE_VLLM_SITE"
"""Environment variable naming the folder vLLM and its packages are installed in (an unpacked vsite)."""

VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_HOST_IP": "127.0.0.1", "HF_HUB_OFFLINE": "1"}
"""Set for the peer unless already set: the environment the shared peers/vllm/README.md runs vLLM
in on the GPU box (no network there; the sampler without FlashInfer; its own address, local)."""


class VllmPeerError(RuntimeError):
    """The peer process failed, timed out or wrote no result; the message ends with its last lines."""


# ---- our side ---------------------------------------------------------------------------------


def find_vllm(site: str | None) -> str:
    """Where the peer will import vLLM from: `site`/vllm, or this interpreter's own vllm when no
    site is given. Raises VllmPeerError when there is none, before any benchmark time is spent."""
    if site:
        if not (Path(site) / "vllm" / "__init__.py").is_file():
            raise VllmPeerError(f"no vllm package in {site!r} (--vllm-site / {SITE_ENV}: an unpacked vsite.tar.xz)")
        return str(Path(site) / "vllm")
    import importlib.util
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        raise VllmPeerError(f"vllm is not importable here: pass --vllm-site or set {SITE_ENV}")
    return str(Path(spec.origin).parent)


def llm_settings(max_num_seqs: int, max_num_batched_tokens: int, tensor_parallel_size: int = 1) -> dict:
    """vLLM `LLM(...)` keyword arguments beside the model path: dummy bf16 weights, no tokenizer
    (token-id prompts, outputs not detokenized), our engine's batch limits and tensor parallelism,
    otherwise its defaults (gpu_memory_utilization as in the shared measurements; prefix caching
    on, reset before timing)."""
    return {"load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16",
            "gpu_memory_utilization": 0.9, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens, "enable_prefix_caching": True,
            "tensor_parallel_size": tensor_parallel_size}


def peer_env(site: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The peer's environment: ours with `site` first on PYTHONPATH and VLLM_ENV's defaults."""
    env = dict(os.environ if base is None else base)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    for k, v in VLLM_ENV.items():
        env.setdefault(k, v)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_vllm_peer(w: Workload, *, site: str | None, settings: dict, timeout_s: float = 900.0,
                  workdir: str | None = None, python: str = sys.executable) -> dict:
    """Run workload `w` through vLLM in a child process; return the peer's result (wall_s,
    output_tokens, output_tok_s, startup_s, import_s, vllm_version, settings, ...). The child's
    output goes to our stderr, each line prefixed "[vllm] ". Raises VllmPeerError on failure."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="llmserve-vllm-", dir=workdir) as tmp:
        request, result = Path(tmp) / "request.json", Path(tmp) / "result.json"
        request.write_text(json.dumps({"workload": w.to_dict(), "llm": settings}))
        cmd = [python, "-P", str(Path(__file__).resolve()), str(request), str(result)]
        rc, tail = _run_streaming(cmd, peer_env(site), timeout_s)
        if rc != 0 or not result.is_file():
            what = f"timed out after {timeout_s:.0f} s" if rc is None else f"exited with {rc}"
            raise VllmPeerError(f"vLLM peer {what}; its last lines:\n" + "\n".join(tail))
        return json.loads(result.read_text())


def _run_streaming(cmd: list[str], env: dict, timeout_s: float) -> tuple[int | None, list[str]]:
    """Run cmd in a session of its own, echoing its output to our stderr. After timeout_s, or when
    we are interrupted or sent SIGTERM (an outer `timeout`), the whole session goes: the peer and
    the engine-core process vLLM starts, which would otherwise hold the GPU after we are gone.
    Returns (exit status, None after a timeout; its last lines)."""
    tail: deque[str] = deque(maxlen=40)
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)

    def pump() -> None:
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            sys.stderr.write("[vllm] " + line)
        sys.stderr.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    on_term = None
    if threading.current_thread() is threading.main_thread():
        on_term = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    rc = None
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if rc is None:
            _kill_session(proc)
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
    reader.join(timeout=5)
    return rc, list(tail)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGTERM to the peer's whole session, then, 10 s on or once the peer is gone, SIGKILL to
    whatever of it is left."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ---- the peer process -------------------------------------------------------------------------


def _peer_main(request_path: str, result_path: str) -> None:
    with open(request_path) as f:
        request = json.load(f)
    wl, settings = request["workload"], dict(request["llm"])
    model_dir = os.path.join(os.path.dirname(request_path), "model")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(wl["model_config"], f)

    start = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams
    import_s = time.perf_counter() - start

    def sampling(p: dict, **override) -> SamplingParams:
        p = {**p, **override}
        if p.get("logit_bias"):
            p["logit_bias"] = {int(k): v for k, v in p["logit_bias"].items()}
        return SamplingParams(**p, detokenize=False)

    start = time.perf_counter()
    llm = LLM(model=model_dir, **settings)
    startup_s = time.perf_counter() - start
    info = {"engine": "vllm", "vllm_version": getattr(vllm, "__version__", None), "settings": settings,
            "import_s": import_s, "startup_s": startup_s,
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}, **_describe(llm)}
    print("vllm up:", json.dumps(info, default=str), flush=True)

    # The warm-up samples as the first request does: a sampler kernel vLLM compiles on first use
    # (top-k/top-p) is then built before the timed call.
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}], sampling(wl["params"][0], max_tokens=8, min_tokens=0),
                 use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in wl["prompts"]]
    params = [sampling(p) for p in wl["params"]]
    if hasattr(llm, "reset_prefix_cache"):
        llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    result = {**info, "workload": wl["name"], "requests": len(prompts), "wall_s": wall, "output_tokens": generated,
              "expected_output_tokens": sum(p["max_tokens"] * p.get("n", 1) for p in wl["params"]),
              "output_tok_s": generated / wall,
              "cached_prompt_tokens": sum(getattr(o, "num_cached_tokens", 0) or 0 for o in outs)}
    with open(result_path, "w") as f:
        json.dump(result, f, default=str)
    print("RESULT", json.dumps({k: result[k] for k in ("wall_s", "output_tok_s", "startup_s", "import_s")}),
          flush=True)
    try:  # vLLM's engine-core process; the child would otherwise wait for its atexit
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 (the result is written: shutting down is best effort)
        print("shutdown:", repr(exc), flush=True)


def _describe(llm) -> dict:
    """The settings vLLM resolved that explain its speed (descriptive only: never fails the run)."""
    try:
        cfg = llm.llm_engine.vllm_config
        cc = cfg.compilation_config
        return {"compilation_mode": str(cc.mode), "cudagraph_mode": str(cc.cudagraph_mode),
                "cudagraph_capture_sizes": len(cc.cudagraph_capture_sizes or []),
                "max_model_len": cfg.model_config.max_model_len,
                "async_scheduling": getattr(cfg.scheduler_config, "async_scheduling", None),
                "block_size": cfg.cache_config.block_size}
    except Exception as exc:  # noqa: BLE001
        return {"config_error": repr(exc)}


if __name__ == "__main__":  # vLLM may spawn its engine process, which re-imports this file
    if len(sys.argv) != 3:
        sys.exit("usage: python -P vllm_peer.py REQUEST.json RESULT.json")
    _peer_main(sys.argv[1], sys.argv[2])
