"""Every script kept in scripts/ runs, each in a process of its own as a user starts it, so that a
refactor that breaks a script's imports or arguments fails here rather than on the GPU box.

Scripts whose work needs a GPU (CUDA graphs, kernels at an 8B model's shapes) or a whole workload
(tens of seconds on a CPU) show their --help: argparse runs after the module's top-level imports,
so a renamed kernel or engine function still fails the test. The others do a tiny real run.
"""

import json
import os
import random
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"

HELP_ONLY = [
    "allreduce_bench.py", "attention_bench.py", "cascade_bench.py", "decode_gemm_bench.py", "filtered_bench.py", "first_step_bench.py", "gated_gemm_bench.py",
    "gc_bench.py", "int8_sweep.py", "moe_bench.py", "sampler_bench.py", "sass_stats.py", "spec_bench.py", "startup_bench.py",
    "structured_bench.py",
]
RUN = ["bench_page.py", "bench_summary.py", "host_bench.py", "step_trace.py", "train_builtin_model.py"]
HELPERS = ["graph_timing.py"]  # imported by the GPU benchmarks above, so their --help imports it too
SHELL = ["gpu_suite.sh", "run.sh", "setup_venv.sh", "test.sh"]  # setup_venv.sh: sourced by both, and by CI


def start(name: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / name), *args], capture_output=True, text=True,
                          timeout=timeout)


def succeeded(proc: subprocess.CompletedProcess) -> str:
    """The process's stdout; fails the test with its stderr's tail if it exited non-zero."""
    assert proc.returncode == 0, f"{proc.args[1]} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout


def run_script(name: str, *args: str, timeout: float = 60) -> str:
    """stdout of `python scripts/NAME ARGS...`, which must exit 0."""
    return succeeded(start(name, *args, timeout=timeout))


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess]:
    """Every HELP_ONLY script's --help, as many at a time as there are CPUs: each spends ~2 s
    importing torch and llmserve, which one after another would be most of this file's time."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip(HELP_ONLY, pool.map(lambda name: start(name, "--help"), HELP_ONLY)))


def test_every_script_is_tested():
    assert sorted(p.name for p in SCRIPTS.iterdir() if p.is_file()) == sorted(HELP_ONLY + RUN + HELPERS + SHELL)


def test_the_gpu_suite_runs_only_scripts_that_exist():
    # scripts/NAME.py, and the bare names given to `script` and `ab-script` (not tests/NAME.py)
    named = set(re.findall(r"(?<![\w/.-])(?:scripts/)?([\w-]+\.py)\b", (SCRIPTS / "gpu_suite.sh").read_text()))
    assert named, "gpu_suite.sh names no script: the pattern above needs updating"
    assert {n for n in named if not (SCRIPTS / n).exists()} == set()


@pytest.mark.parametrize("name", SHELL)
def test_shell_script_parses(name):
    subprocess.run(["bash", "-n", str(SCRIPTS / name)], check=True)


@pytest.mark.parametrize("name", HELP_ONLY)
def test_script_help(helps, name):
    assert "usage:" in succeeded(helps[name])


def test_bench_summary_prints_a_result(tmp_path):
    result = {
        "wall_s": 6.5, "output_tok_s": 19000.0, "roofline_fraction": 0.8, "roofline_sustained_fraction": 0.85,
        "startup_s": 12.0, "stalls": {"gc": {"ms": 3.0}},
        "decode_steps": {
            "device_busy_s": 6.0, "device_busy_fraction": 0.99,
            "by_batch": [{"steps": "129-256", "count": 100, "total_s": 3.8, "device_s": 3.7, "idle_s": 0.01,
                          "launch_ms": 12.0}],
            "most_idle": [{"step": 7, "idle_ms": 1.25}],
        },
    }
    path = tmp_path / "w-small.json"
    path.write_text(json.dumps(result))
    out = run_script("bench_summary.py", "-v", str(path))
    assert "w-small.json: 6.500 s, 19000 tok/s, 80.0% of roofline (85.0% at the sustained matmul rate)" in out
    assert "129-256: 100 in 3.800 s" in out
    assert "idle before" in out


def test_host_bench_times_steps_without_device_work(tmp_path):
    out = tmp_path / "host.json"
    run_script("host_bench.py", "--batch", "1,4", "--steps", "8", "--runs", "1", "--shared-prefix", "16",
               "--json", str(out), timeout=120)
    rows = json.loads(out.read_text())
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["ms_per_step"] > 0 and len(r["walls_s"]) == 1 for r in rows)


def test_host_bench_with_a_simulated_device_takes_at_least_its_time_a_step(tmp_path):
    """With the device taking 20 ms a step, a step takes at least that, the steps run one after
    another (async scheduling off) or overlapping the host's work."""
    out = tmp_path / "host.json"
    for sync in ([], ["--sync"]):
        run_script("host_bench.py", "--batch", "2", "--steps", "6", "--runs", "1", "--device-ms", "20", *sync,
                   "--json", str(out), timeout=120)
        [row] = json.loads(out.read_text())
        assert row["sync"] == bool(sync) and row["device_ms"] == 20 and row["ms_per_step"] >= 20


def test_step_trace_times_each_step_from_the_tokens_before(tmp_path):
    out = tmp_path / "trace.json"
    prof = tmp_path / "prof"
    run_script("step_trace.py", "--tokens", "12", "--dtype", "float32", "--sync", "--profile", str(prof),
               "--json", str(out), timeout=120)
    data = json.loads(out.read_text())
    marks = [r["mark"] for r in data["timeline"]]
    assert data["sync"] and {"schedule>#1", "kv>#1", "step>#1", "inputs>#1"} <= set(marks), marks
    assert marks.index("schedule>#1") < marks.index("kv>#1") < marks.index("step>#1")
    assert "process" in (tmp_path / "prof.loop.txt").read_text()


def test_step_trace_splits_the_device_timeline_at_each_copy_of_tokens_to_the_host():
    """--kernels' analysis (the GPU's profile, so on synthetic activities here): each step runs from
    the end of one copy of tokens to the host to the next; activities closer than the gap make one
    busy stretch; the steps shown whole keep each copy a run of its own."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("step_trace", SCRIPTS / "step_trace.py")
    trace = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trace)
    acts = []
    for start in range(0, 800, 100):  # a step every 100 us: forward 0-50, sampler 80-90, tokens' copy 91-93
        acts += [(start, start + 30, "fwd"), (start + 31, start + 50, "fwd2"), (start + 80, start + 82, "Memcpy HtoD"),
                 (start + 83, start + 90, "sample"), (start + 91, start + 93, "Memcpy DtoH")]
    got = trace.device_stretches(acts)
    assert (got["cycles"], got["cycle_us"], got["busy_us"]) == (7, 100, 63)
    assert [(r["start_us"], r["end_us"], r["activities"]) for r in got["stretches"]] == [(7, 57, 2), (87, 100, 3)]
    [step] = trace.some_cycles(acts, [(110, 120, "cudaGraphLaunch")], count=1)
    assert [row[2] for row in step] == ["host: cudaGraphLaunch", "device: 2 kernels: fwd .. fwd2",
                                        "device: Memcpy HtoD", "device: sample", "device: Memcpy DtoH"]


def test_step_trace_of_a_speculating_engine_times_the_proposal(tmp_path):
    out = tmp_path / "trace.json"
    run_script("step_trace.py", "--tokens", "12", "--dtype", "float32", "--sync", "--speculative",
               '{"method": "draft", "model": "builtin", "num_speculative_tokens": 3}', "--temperature", "0.5",
               "--seed", "3", "--json", str(out), timeout=180)
    data = json.loads(out.read_text())
    marks = [r["mark"] for r in data["timeline"]]
    assert data["speculative"]["model"].endswith("builtin_model") and 0 < data["steps"] < 12  # drafts kept
    assert (data["temperature"], data["seed"]) == (0.5, 3)
    assert marks.index("finish>#1") < marks.index("propose>#1") < marks.index("schedule>#1"), marks


def test_host_bench_constrained_samples_within_the_masks_of_a_synthetic_vocabulary(tmp_path):
    """(A token outside a request's mask fails the request, and the script with it.)"""
    out = tmp_path / "host.json"
    run_script("host_bench.py", "--batch", "4", "--steps", "12", "--runs", "1", "--constrained", "--vocab", "2048",
               "--json", str(out), timeout=120)
    [row] = json.loads(out.read_text())
    assert row["constrained"] and row["vocab"] == 2048 and row["ms_per_step"] > 0


def test_benchmarks_page_is_rendered_from_its_result_files():
    assert "is current" in run_script("bench_page.py", "--check")


def test_bench_page_takes_each_figure_from_its_newest_run(tmp_path):
    def offline(wall: float, **extra) -> dict:
        return {"wall_s": wall, "output_tok_s": 1000 / wall, "roofline_s": 5.0, "roofline_fraction": 5.0 / wall, **extra}

    def add_run(name: str, time: str, files: dict, figures: str) -> None:
        (tmp_path / "results" / name).mkdir(parents=True)
        for file, data in files.items():
            (tmp_path / "results" / name / file).write_text(json.dumps(data))
        (tmp_path / "results" / name / "run.toml").write_text(
            f'time = {time}\ndevice = "GPU"\ncommit = "abc{name[-1]}"\ncommand = "run {name}"\nwhat = "w"\n{figures}')

    vllm = {"engine": "vllm", "vllm_version": "0.24.0", "wall_s": 7.5, "output_tok_s": 133.0, "speedup": 1.25}
    add_run("run1", "2026-01-01T00:00:00Z", {"a.json": offline(8.0), "b.json": offline(9.0)},
            '[[figure]]\nname = "W-small"\nfile = "a.json"\n[[figure]]\nname = "W-large"\nfile = "b.json"\n')
    add_run("run2", "2026-01-02T00:00:00Z",
            {"a.json": offline(6.0, peers={"vllm": vllm}), "q.json": offline(3.0), "serve.json": {
                "rate": float("inf"), "output_throughput": 150.0, "requests": 4, "completed": 4,
                **{k: {"median": 1.0, "p99": 2.0} for k in ("ttft_ms", "tpot_ms", "itl_ms")}}},
            '[[figure]]\nname = "W-small"\nfile = "a.json"\n'
            '[[figure]]\nname = "W-small, int8"\nfile = "q.json"\nbaseline = "a.json"\n'
            '[[figure]]\nname = "W-serve"\nfile = "serve.json"\noffline = "a.json"\n')
    page = tmp_path / "page.md"
    page.write_text("# B\n\nintro\n\n<!-- figures: rendered by scripts/bench_page.py from benchmarks/results/; do not "
                    "edit by hand -->\nstale\n<!-- end of figures -->\n\ntail\n")
    args = ("--page", str(page), "--results", str(tmp_path / "results"))
    assert "is not current" in start("bench_page.py", *args, "--check").stderr
    run_script("bench_page.py", *args)
    text = page.read_text()
    rows = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| W-")}
    assert "| 6.000 | 167 | 83.3% of 5.00 s | vLLM 0.24.0: 7.50 s, 133 tok/s; llmserve **1.25×** | [run2]" in rows["W-small"]
    assert "| 9.000 |" in rows["W-large"] and "[run1]" in rows["W-large"]  # no newer run has it
    assert "unquantized 6.00 s: **2.00×**" in rows["W-small, int8"]
    assert "all at once: **90.0%** of the offline 167 tok/s" in rows["W-serve"]
    assert text.index("[run2](benchmarks/results/run2/) | 2026-01-02 00:00 | GPU | abc2 | `run run2`") < text.index("[run1](benchmarks/results/run1/) | 2026-01-01")
    assert "stale" not in text and text.startswith("# B\n\nintro") and text.endswith("tail\n")
    assert "is current" in run_script("bench_page.py", *args, "--check")


def test_bench_page_renders_structured_outputs_at_batch_256_and_1(tmp_path):
    run = tmp_path / "results" / "run1"
    run.mkdir(parents=True)
    tpot_runs = {name: {"tpot_ms": ms, "step_call_ms": 3.0} for name, ms in
                 (("plain", 6.0), ("plain_again", 6.2), ("json_string", 9.0), ("json_string_no_jump", 6.5),
                  ("json_object", 7.0))}
    (run / "tpot.json").write_text(json.dumps({"tpot": {"runs": tpot_runs, "tpot_ratio": 1.48,
                                                        "tpot_ratio_no_jump": 1.07}}))
    (run / "latency.json").write_text(json.dumps({"latency": {
        "plain": {"tpot_ms": 1.5}, "json_string_no_jump": {"tpot_ms": 2.0}, "json_string_no_jump_in_process": {"tpot_ms": 2.4},
        "json_string": {"tpot_ms": 2.5}, "json_string_no_jump_ratio": 1.33, "json_string_no_jump_in_process_ratio": 1.6,
        "json_string_ratio": 1.67}}))
    (run / "run.toml").write_text('time = 2026-01-01T00:00:00Z\ndevice = "GPU"\ncommit = "abc"\ncommand = "c"\n'
                                  'what = "w"\n[[figure]]\nname = "C256"\nfile = "tpot.json"\n'
                                  '[[figure]]\nname = "C1"\nfile = "latency.json"\n')
    page = tmp_path / "page.md"
    page.write_text("# B\n\n<!-- figures: rendered by scripts/bench_page.py from benchmarks/results/; do not "
                    "edit by hand -->\n<!-- end of figures -->\n")
    run_script("bench_page.py", "--page", str(page), "--results", str(tmp_path / "results"))
    rows = {line.split(" | ")[0][2:]: line for line in page.read_text().splitlines() if line.startswith("| C")}
    assert ("jump-forward off (json_object's default): 6.50 ms, **1.07×** (target ≤ 1.10); json_object's own "
            "decode steps 7.00 ms |") in rows["C256"]  # no rounds measured: none listed
    assert ("plain 1.50 ms; inside a JSON string without jump-forward, the grammar process 2.00 ms (**1.33×**), "
            "in the engine's process 2.40 ms (1.60×); with jump-forward 2.50 ms (1.67×)") in rows["C1"]


def test_train_builtin_model_on_a_tiny_corpus(tmp_path):
    """Both steps as the built-in model's README runs them: reST sources -> corpus -> one training
    step on the CPU with one sequence (every 50th document is held out, and needs a full window of
    256 tokens)."""
    rng = random.Random(0)
    words = ("the module function returns a value object class method argument list string file path "
             "error raises default keyword when called with each item").split()
    sources = tmp_path / "sources"
    sources.mkdir()
    for i in range(50):
        prose = "\n\n".join(" ".join(rng.choice(words) for _ in range(50)) + "." for _ in range(6))
        (sources / f"doc{i:02d}.txt").write_text(f"Title {i}\n========\n\n.. index:: x\n\n:func:`len` {prose}\n")
    corpus, out_dir = tmp_path / "corpus.txt", tmp_path / "model"
    assert "50 documents" in run_script("train_builtin_model.py", "corpus", str(sources), str(corpus))
    assert ":func:" not in corpus.read_text() and ".. index::" not in corpus.read_text()

    run_script("train_builtin_model.py", "train", str(corpus), str(out_dir), "--steps", "1", "--device", "cpu",
               "--batch", "1", timeout=120)
    training = json.loads((out_dir / "training.json").read_text())
    assert training["steps"] == 1 and training["batch"] == 1 and len(training["log"]) == 1
    assert (out_dir / "model.safetensors").exists() and (out_dir / "tokenizer.json").exists()
    # the target the first model drafts for: a larger shape on that model's own tokenizer
    target = tmp_path / "target"
    run_script("train_builtin_model.py", "train", str(corpus), str(target), "--steps", "1", "--device", "cpu",
               "--batch", "1", "--size", "target", "--tokenizer", str(out_dir), timeout=240)
    assert (target / "tokenizer.json").read_text() == (out_dir / "tokenizer.json").read_text()
    assert json.loads((target / "training.json").read_text())["parameters"] > 10 * training["parameters"]
    # a draft of two wide layers distilled from that target, on sequences that repeat a passage:
    # its log says how often its argmax is the target's, and how much of a repeated passage it copies
    draft = tmp_path / "draft"
    run_script("train_builtin_model.py", "train", str(corpus), str(draft), "--steps", "1", "--device", "cpu",
               "--batch", "1", "--size", "draft", "--copies", "1", "--tokenizer", str(out_dir), "--teacher", str(target),
               timeout=240)
    distilled = json.loads((draft / "training.json").read_text())
    assert distilled["teacher"] == str(target) and 0 <= distilled["log"][0]["heldout_argmax_agreement"] <= 1
    assert distilled["copies"] == 1 and 0 <= distilled["log"][0]["heldout_copied"] <= 1
