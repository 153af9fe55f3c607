"""The benchmark tools: workloads exactly as WORKLOADS.md defines them, the roofline, and the
serving client against a real server."""

import json

from test_server import running_server

from llmserve import LLM
from llmserve.bench.throughput import roofline_seconds, startup_summary
from llmserve.bench.workloads import w_large, w_small
from llmserve.cli import main
from llmserve.model.spec import ModelSpec


def test_workloads_match_their_definitions():
    w = w_small()
    assert (len(w.prompts), w.prompt_tokens, w.output_tokens) == (256, 142827, 133966)
    assert all(p.ignore_eos and p.temperature == 0.6 for p in w.params)
    big = w_large()
    assert (len(big.prompts), big.prompt_tokens, big.output_tokens) == (1000, 1024000, 128000)


def test_rooflines_on_an_h100_are_those_of_workloads_md():
    """W-small: its prompts' FLOPs, then its decode reads (5.23 s: 0.23 s + 5.00 s). W-large: compute
    bound, 1.885e16 FLOPs at the matmul rate (24.0 s), its decode reads (>= 6.0 s) beneath them."""
    w = w_small()
    roof = roofline_seconds(w, ModelSpec.from_dict(w.model_config), bandwidth=3.0e12, flops=785e12)
    assert 5.1 < roof["roofline_s"] < 5.4 and 0.2 < roof["prefill_s"] < 0.26
    assert roof["roofline_s"] == roof["prefill_s"] + roof["decode_s"]
    w = w_large()
    roof = roofline_seconds(w, ModelSpec.from_dict(w.model_config), bandwidth=3.0e12, flops=785e12)
    assert roof["bound"] == "compute" and abs(roof["compute_s"] * 785e12 - 1.885e16) < 0.001e16
    assert roof["roofline_s"] == roof["compute_s"] and 6.0 < roof["decode_s"] < roof["compute_s"]


def test_startup_reports_its_phases_and_the_slowest_kernel_variants(checkpoint):
    """Where a start-up went: the engine's phases in order (no graph capture on the CPU), and the
    benchmark's summary of the Triton variants first used meanwhile (one without a time counts)."""
    import time
    start = time.perf_counter()
    with LLM(checkpoint("llama"), device="cpu", log_interval_s=0) as llm:
        elapsed = time.perf_counter() - start
        phases = llm.engine.startup_phases
    assert list(phases) == ["config", "weights", "profile_step", "kv_cache", "tokenizer", "actors"]
    assert all(s >= 0 for s in phases.values()) and sum(phases.values()) <= elapsed
    kernels = [{"kernel": "a", "variant": "a[1]", "ms": 5.0}, {"kernel": "b", "variant": "b[1]", "ms": None},
               {"kernel": "a", "variant": "a[2]", "ms": 7.5}]
    summary = startup_summary(phases, kernels)
    assert summary["phases_s"] == phases
    assert (summary["kernels"]["count"], summary["kernels"]["ms"]) == (3, 12.5)
    assert [k["variant"] for k in summary["kernels"]["slowest"]] == ["a[2]", "a[1]"]
    assert startup_summary(phases, None) == {"phases_s": phases}  # a Triton without JIT hooks


def test_bench_serve_against_a_running_server(tmp_path, capsys):
    with running_server() as server:
        out = tmp_path / "serve.json"
        for rate in ("inf", "40"):
            main(["bench", "serve", "--url", server.url, "--workload", "random", "--num-requests", "6",
                  "--random-input-len", "12", "--random-output-len", "8", "--rate", rate, "--json", str(out)])
            result = json.loads(out.read_text())
            assert result["completed"] == 6 and result["failed"] == 0 and result["output_tokens"] == 48
            assert 0 < result["ttft_ms"]["median"] <= result["e2e_ms"]["median"]
            assert result["itl_ms"]["mean"] > 0 and result["tpot_ms"]["p99"] > 0
    printed = capsys.readouterr().out
    assert "ttft_ms" in printed and "output tok/s" in printed
    assert main(["bench", "nope"]) == 2


def test_step_timing_counts_idle_time_before_each_decode_step_only():
    from llmserve.model.step_timing import StepRecord, StepTiming
    t = StepTiming()
    # (requests, tokens, start, end): a prefill step, a decode step, a mixed step, a decode step.
    t.records = [StepRecord(4, 100, 0.0, 1.0, 1.0), StepRecord(4, 4, 1.5, 2.0, 2.0), StepRecord(4, 50, 2.1, 3.0, 3.0),
                 StepRecord(4, 4, 3.2, 3.5, 3.5)]
    s = t.summary()
    assert s["steps"] == 2 and round(s["execute_ms"]) == 400 and round(s["between_ms"]) == 350
    assert t.summary(decode_only=False)["steps"] == 3
    t.records.append(StepRecord(300, 300, 3.6, 4.5, 4.5))
    rows = {r["steps"]: (r["count"], round(r["total_s"], 6)) for r in t.by_batch(edges=(2, 8))}
    assert rows == {"mixed": (1, 1.0), "decode <= 8": (2, 1.5), "decode > 8": (1, 1.0)}
    assert [(s["step"], s["tokens"], round(s["ms"])) for s in t.slowest(3)] == [(1, 4, 1000), (2, 50, 1000),
                                                                                (4, 300, 1000)]
    first = t.slowest(1)[0]  # step 1: 500 ms before it started, 500 launching, none finishing
    assert (round(first["before_ms"]), round(first["launch_ms"]), round(first["finish_ms"])) == (500, 500, 0)


def test_step_timing_splits_device_time_into_busy_and_idle():
    from llmserve.model.step_timing import StepRecord, StepTiming

    class Event:  # what the CUDA events around a step report: device timestamps in ms
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, other):
            return other.ms - self.ms

        def synchronize(self):
            pass

    t = StepTiming()
    t.records = [StepRecord(4, 100, 0.0, 0.1, 0.1), StepRecord(4, 4, 0.1, 0.2, 0.3), StepRecord(4, 4, 0.3, 0.4, 0.5),
                 StepRecord(300, 300, 0.5, 0.6, 0.7)]
    # device: step 0 runs 0-100 ms, step 1 100-300 (queued while 0 ran), step 2 340-360 after 40 ms idle,
    # step 3 400-500 after 40 ms idle (its event pair recorded early, while the device was busy, counts 0)
    t.device_events = [(Event(0), Event(100)), (Event(100), Event(300)), (Event(340), Event(360)),
                       (Event(400), Event(500))]
    assert [(round(b, 3), round(i, 3)) for b, i in t.device_s()] == [(0.1, 0), (0.2, 0), (0.02, 0.04), (0.1, 0.04)]
    rows = {r["steps"]: (r["count"], round(r["device_s"], 3), round(r["idle_s"], 3)) for r in t.by_batch(edges=(8,))}
    assert rows == {"decode <= 8": (2, 0.22, 0.04), "decode > 8": (1, 0.1, 0.04)}
    assert [(r["step"], round(r["idle_ms"]), round(r["device_ms"])) for r in t.most_idle(2)] == [(2, 40, 20),
                                                                                                (3, 40, 100)]
    t.device_events = None  # not timing the device: no such columns
    assert "device_s" not in t.by_batch()[0] and "idle_ms" not in t.slowest(1)[0] and t.most_idle() == []


def test_step_timing_separates_launch_from_waiting():
    import time

    from llmserve.model.step_timing import StepTiming
    t = StepTiming()
    for launch_s in (0.03, 0.0, 0.03):
        with t.step(2, 2):
            time.sleep(launch_s)
            t.launched()
            time.sleep(0.01)
    with t.step(2, 2):  # a step that never marks its launch counts all of its host time as launch
        time.sleep(0.01)
    assert t.launch_s[0] >= 0.03 and t.launch_s[1] < 0.005 and t.launch_s[3] >= 0.01
    (row,) = t.by_batch()
    assert row["count"] == 3 and 10 <= row["launch_ms"] < row["mean_ms"]
    t.clear()
    assert not t.records and not t.launch_s


def test_step_timing_profiles_each_window(tmp_path):
    import torch

    from llmserve.model.step_timing import StepTiming
    t = StepTiming()
    t.profile_windows, t.profile_out = [(1, 2), (4, 1)], str(tmp_path / "p")
    for i in range(6):
        with t.step(3, 3 if i else 9):
            torch.ones(64, 64) @ torch.ones(64, 64)
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p-step1.trace.json", "p-step1.txt",
                                                         "p-step4.trace.json", "p-step4.txt"]
    assert (tmp_path / "p-step1.txt").read_text().startswith("steps 1..2: [(3, 3), (3, 3)]")


def test_watch_stalls_names_first_used_kernels_and_gc_pauses():
    import gc

    from triton import knobs

    from llmserve.bench.stalls import watch_stalls
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    with watch_stalls() as seen:
        # What Triton's JIT calls around compiling (or loading) a new specialization.
        assert knobs.runtime.jit_cache_hook(key=("sig", 1), repr="_paged_attention_kernel[num_warps=4](...)") is None
        knobs.runtime.jit_post_compile_hook(key=("sig", 1), repr="_paged_attention_kernel[num_warps=4](...)")
        gc.collect()
    assert [k["kernel"] for k in seen["kernels"]] == ["_paged_attention_kernel"] and seen["kernels"][0]["ms"] >= 0
    assert seen["gc"]["collections"] >= 1 and seen["gc"]["max_ms"] <= seen["gc"]["ms"]
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before


def test_synthetic_tokenizer_covers_the_vocabulary_and_the_engine_detokenizes_with_it(checkpoint, tmp_path):
    """`bench throughput --detokenize`: a tokenizer of exactly the model's vocabulary (its last id the
    end of sequence), past the 256 byte tokens every id a distinct printable piece; an engine loading it from the checkpoint's
    directory streams text equal to decoding each output's ids at once."""
    import shutil

    from transformers import AutoTokenizer

    from llmserve import SamplingParams
    from llmserve.bench.workloads import Workload

    src = checkpoint("llama")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{src}/{name}", model_dir / name)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    Workload("tiny", {"vocab_size": vocab}, [], []).write_tokenizer(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == vocab and tok.eos_token_id == vocab - 1
    pieces = [tok.decode([i]) for i in range(256, vocab - 1)]
    assert all(p.isprintable() for p in pieces) and len(set(pieces)) == len(pieces) > 0
    with LLM(str(model_dir), device="cpu", log_interval_s=0) as llm:
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9] * 20}],
                            SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=3), use_tqdm=False)
    for o in outs:
        assert len(o.outputs[0].token_ids) == 24
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids) != ""
