"""The benchmark tools: workloads exactly as WORKLOADS.md defines them, the roofline, and the
serving client against a real server."""

import json
import os
import time

import pytest
import torch
from test_server import running_server

from llmserve import LLM, SamplingParams
from llmserve.bench.throughput import roofline_seconds, startup_summary
from llmserve.bench.workloads import Workload, w_large, w_small
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


def test_moe_roofline_reads_the_experts_a_batch_picks():
    """Qwen3-30B-A3B: 3.35B parameters a token (2.73B in its layers), 30.5B in all; a step of one
    token reads its 8 experts a layer, a step of 256 nearly all 128; a token's FLOPs count its 8."""
    from llmserve.bench.throughput import layer_params
    from llmserve.bench.workloads import w_large_moe, w_small_moe
    w = w_small_moe()
    spec = ModelSpec.from_dict(w.model_config)
    per_layer, resident, expert, active = layer_params(spec)
    outer = spec.vocab_size * spec.hidden_size * 2
    assert abs(per_layer.sum() + outer - 3.35e9) < 0.01e9 and abs(resident + 48 * 128 * expert + outer - 30.53e9) < 0.01e9
    assert active(1) == pytest.approx(48 * 8) and active(256) == pytest.approx(48 * 128, rel=1e-6)
    one = roofline_seconds(Workload("one", w.model_config, [[1] * 10], [SamplingParams(max_tokens=2)]), spec,
                           bandwidth=1.0, flops=1.0)
    assert one["decode_s"] == pytest.approx(2 * ((resident + 48 * 8 * expert) * 2 + outer * 2)
                                            + 21 * spec.kv_bytes_per_token(torch.bfloat16))
    big = roofline_seconds(w_large_moe(), spec, bandwidth=3.0e12, flops=785e12)
    dense = roofline_seconds(w_large(), ModelSpec.from_dict(w_large().model_config), bandwidth=3.0e12, flops=785e12)
    assert big["compute_s"] < 0.5 * dense["compute_s"]


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
        for rate, processes in (("inf", "1"), ("40", "1"), ("40", "2")):
            main(["bench", "serve", "--url", server.url, "--workload", "random", "--num-requests", "6",
                  "--random-input-len", "12", "--random-output-len", "8", "--rate", rate, "--json", str(out),
                  "--client-processes", processes])
            result = json.loads(out.read_text())
            assert result["completed"] == 6 and result["failed"] == 0 and result["output_tokens"] == 48
            assert result["client_processes"] == int(processes)
            assert 0 < result["ttft_ms"]["median"] <= result["e2e_ms"]["median"]
            assert result["itl_ms"]["mean"] > 0 and result["tpot_ms"]["p99"] > 0
            assert result["client_cpu_share"] > 0  # (the server runs in this process too: not compared with 1)
    printed = capsys.readouterr().out
    assert "ttft_ms" in printed and "output tok/s" in printed
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--url", "http://127.0.0.1:1", "--client-processes", "0"])
    assert "--client-processes must be >= 1, got 0" in capsys.readouterr().err
    assert main(["bench", "nope"]) == 2


def test_bench_serve_reads_events_however_the_stream_splits_them():
    """A server that writes its events a few bytes at a time, cut inside the JSON and between the
    two newlines that end an event: every chunk is counted, and the usage."""
    import asyncio

    from llmserve.bench.serve import run

    events = [b'data: {"choices": [{"text": "ab"}]}\n\n', b": a comment\n\n", b'data: {"choices": [{"text": "c"}]}\n\n',
              b'data: {"choices": [], "usage": {"completion_tokens": 2}}\n\n', b"data: [DONE]\n\n"]
    body = b"".join(events)

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await reader.readexactly(length)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        for i in range(0, len(body), 7):
            writer.write(body[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0.002)
        writer.close()

    async def main() -> dict:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await run(f"http://127.0.0.1:{port}", [[1, 2]] * 3, [2] * 3, rate=float("inf"))

    result = asyncio.run(main())
    assert (result["completed"], result["failed"], result["output_tokens"]) == (3, 0, 6), result["errors"]
    assert result["ttft_ms"]["median"] > 0 and result["itl_ms"]["mean"] > 0


class FakeEvent:
    """What a CUDA event around a step reports: a device timestamp in ms."""

    def __init__(self, ms):
        self.ms = ms

    def elapsed_time(self, other):
        return other.ms - self.ms

    def synchronize(self):
        pass


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
    t = StepTiming()
    t.time_device()
    # device: step 0 runs 0-100 ms, step 1 100-300 (queued while 0 ran), step 2 340-360 after 40 ms idle,
    # step 3 400-500 after 40 ms idle (its event pair recorded early, while the device was busy, counts 0)
    t.records = [StepRecord(4, 100, 0.0, 0.1, 0.1, (FakeEvent(0), FakeEvent(100))),
                 StepRecord(4, 4, 0.1, 0.2, 0.3, (FakeEvent(100), FakeEvent(300))),
                 StepRecord(4, 4, 0.3, 0.4, 0.5, (FakeEvent(340), FakeEvent(360))),
                 StepRecord(300, 300, 0.5, 0.6, 0.7, (FakeEvent(400), FakeEvent(500)))]
    assert [(round(b, 3), round(i, 3)) for b, i in t.device_s()] == [(0.1, 0), (0.2, 0), (0.02, 0.04), (0.1, 0.04)]
    assert round(t.report()["device_busy_s"], 3) == 0.42
    # a step begun before timing started has no events: it counts no device time, the others keep theirs
    t.records.insert(0, StepRecord(4, 4, -0.1, -0.1, 0.0))
    assert [(round(b, 3), round(i, 3)) for b, i in t.device_s()] == [(0, 0), (0.1, 0), (0.2, 0), (0.02, 0.04),
                                                                       (0.1, 0.04)]
    t.records.pop(0)
    rows = {r["steps"]: (r["count"], round(r["device_s"], 3), round(r["idle_s"], 3)) for r in t.by_batch(edges=(8,))}
    assert rows == {"decode <= 8": (2, 0.22, 0.04), "decode > 8": (1, 0.1, 0.04)}
    assert [(r["step"], round(r["idle_ms"]), round(r["device_ms"])) for r in t.most_idle(2)] == [(2, 40, 20),
                                                                                                (3, 40, 100)]
    t.timing_device = False  # not timing the device: no such columns
    assert "device_s" not in t.by_batch()[0] and "idle_ms" not in t.slowest(1)[0] and t.most_idle() == []


def test_step_timing_reports_the_steps_recorded_when_asked_while_the_engine_steps_on(monkeypatch):
    """The engine's thread may make a last step (for requests already returned) while the benchmark
    reads the timing: the report covers the steps recorded when it was asked, consistently."""
    from llmserve.model.step_timing import StepRecord, StepTiming
    live = StepTiming()
    live.time_device()
    live.records = [StepRecord(4, 4, 0.1 * i, 0.1 * i, 0.1 * i + 0.05, (FakeEvent(100 * i), FakeEvent(100 * i + 50)))
                    for i in range(5)]
    periods = StepTiming.periods

    def stepping(self):  # a step lands between the device's times and the periods being read
        live.records.append(StepRecord(4, 4, 9.0, 9.0, 9.1, (FakeEvent(9000), FakeEvent(9050))))
        return periods(self)
    monkeypatch.setattr(StepTiming, "periods", stepping)
    report = live.report()
    assert report["steps"] == 4 and report["by_batch"][0]["count"] == 4 and round(report["device_busy_s"], 3) == 0.25


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
    """`bench throughput --detokenize`: a tokenizer of exactly the model's vocabulary (its end and
    start ids special tokens at the config's ids), past the 256 byte tokens every other id a
    distinct printable piece; an engine loading it from the checkpoint's directory streams text
    equal to decoding each output's ids at once."""
    import shutil

    from transformers import AutoTokenizer

    from llmserve import SamplingParams
    from llmserve.bench.workloads import Workload

    src = checkpoint("llama")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{src}/{name}", model_dir / name)
    config = json.loads((model_dir / "config.json").read_text())
    vocab = config["vocab_size"]
    Workload("tiny", {"vocab_size": vocab, "eos_token_id": vocab - 1, "bos_token_id": 300}, [], []).write_tokenizer(model_dir)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert len(tok) == vocab and (tok.eos_token_id, tok.bos_token_id) == (vocab - 1, 300)
    specials = {tok.eos_token_id, tok.bos_token_id}
    pieces = [tok.decode([i]) for i in range(256, vocab) if i not in specials]
    assert all(p.isprintable() for p in pieces) and len(set(pieces)) == len(pieces) > 0
    with LLM(str(model_dir), device="cpu", log_interval_s=0) as llm:
        outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9] * 20}],
                            SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=3), use_tqdm=False)
    for o in outs:
        assert len(o.outputs[0].token_ids) == 24
        assert o.outputs[0].text == tok.decode(o.outputs[0].token_ids) != ""


# ---- peers: the workload handed to vLLM in a process of its own ---------------------------------

FAKE_VLLM = '''
"""A stand-in for vLLM's offline API: records what it was given to $FAKE_VLLM_LOG (one JSON line a call)."""
import json, os, subprocess, sys, time
from types import SimpleNamespace

__version__ = "0.0-fake"


def _log(**record):
    with open(os.environ["FAKE_VLLM_LOG"], "a") as f:
        f.write(json.dumps(record) + "\\n")


class SamplingParams:
    def __init__(self, **kw):
        self.kw = kw


class LLM:
    def __init__(self, model, **settings):
        if os.environ.get("FAKE_VLLM_SLEEP"):  # a start-up that hangs, its engine-core process beside it
            core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            _log(call="engine_core", pid=core.pid)
            time.sleep(float(os.environ["FAKE_VLLM_SLEEP"]))
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        _log(call="init", config=config, settings=settings, pythonpath=os.environ.get("PYTHONPATH", ""),
             host_ip=os.environ.get("VLLM_HOST_IP"), llmserve_imported="llmserve" in sys.modules)

    def reset_prefix_cache(self):
        _log(call="reset_prefix_cache")
        return True

    def generate(self, prompts, params, use_tqdm=True):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError(os.environ["FAKE_VLLM_FAIL"])
        params = params if isinstance(params, list) else [params] * len(prompts)
        _log(call="generate", prompts=[p["prompt_token_ids"] for p in prompts], params=[q.kw for q in params])
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * q.kw["max_tokens"])], num_cached_tokens=0)
                for q in params]
'''

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 16, "vocab_size": 300, "tie_word_embeddings": False, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "torch_dtype": "float32",
              "eos_token_id": 2, "bos_token_id": 1}


def make_tiny_workload():
    from llmserve import SamplingParams
    from llmserve.bench.workloads import Workload
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=5),
              SamplingParams(temperature=1.0, top_p=0.9, top_k=20, ignore_eos=True, max_tokens=3, seed=11),
              SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4)]
    return Workload("tiny", TINY_LLAMA, [[5, 6, 7, 8], [9] * 12, [3, 4]], params)


def make_fake_vllm_site(tmp_path, monkeypatch):
    site = tmp_path / "vsite"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    log = tmp_path / "fake_vllm.jsonl"
    monkeypatch.setenv("FAKE_VLLM_LOG", str(log))
    return str(site), log


def fake_vllm_calls(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_workloads_round_trip_through_json():
    """What the peer process reads is the workload itself: every prompt, every request's sampling
    (the fields that set the work always written, any other only off its default)."""
    from dataclasses import replace

    from llmserve.bench.workloads import ALWAYS_WRITTEN, Workload
    for w in (w_small(), replace(make_tiny_workload(), bound="compute")):
        back = Workload.from_dict(json.loads(json.dumps(w.to_dict())))
        assert back == w
    data = make_tiny_workload().to_dict()
    assert [sorted(p) for p in data["params"]] == [sorted(ALWAYS_WRITTEN), sorted(ALWAYS_WRITTEN + ("seed",)),
                                                   sorted(ALWAYS_WRITTEN)]
    assert data["params"][1] == {"temperature": 1.0, "top_p": 0.9, "top_k": 20, "max_tokens": 3,
                                 "ignore_eos": True, "seed": 11}


def test_bench_throughput_command_line_names_its_peers(tmp_path, monkeypatch):
    import pytest

    from llmserve.bench.throughput import parse_args
    from llmserve.bench.vllm_peer import SITE_ENV
    site = tmp_path / "vsite"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text("")
    monkeypatch.delenv(SITE_ENV, raising=False)
    assert parse_args([]).peers == ()
    assert parse_args(["--peer", "hf"]).peers == ("hf",)
    args = parse_args(["--peer", "vllm,hf", "--vllm-site", str(site), "--vllm-timeout", "60"])
    assert (args.peers, args.vllm_site, args.vllm_timeout) == (("hf", "vllm"), str(site), 60.0)
    assert parse_args(["--peer", "vllm", "--peer", "hf", "--peer", "vllm", "--vllm-site", str(site)]).peers == \
        ("hf", "vllm")
    monkeypatch.setenv(SITE_ENV, str(site))
    assert parse_args(["--peer", "vllm"]).vllm_site == str(site)
    for bad in (["--peer", "sglang"], ["--peer", ","], ["--peer", "vllm", "--vllm-site", str(tmp_path)]):
        with pytest.raises(SystemExit):  # an unknown peer; a site without vllm: refused before any run
            parse_args(bad)


def test_vllm_peer_runs_the_workload_in_its_own_process(tmp_path, monkeypatch):
    """The peer process imports vllm from the site (never llmserve), builds one LLM on dummy weights
    of the workload's model config, warms up with the first request's sampling, resets the prefix
    cache, then generates every prompt with its own sampling; its timing comes back."""
    from llmserve.bench.vllm_peer import llm_settings, run_vllm_peer
    site, log = make_fake_vllm_site(tmp_path, monkeypatch)
    w = make_tiny_workload()
    settings = llm_settings(max_num_seqs=4, max_num_batched_tokens=64)
    result = run_vllm_peer(w, site=site, settings=settings, timeout_s=60, workdir=str(tmp_path))
    assert result["vllm_version"] == "0.0-fake" and result["workload"] == "tiny" and result["requests"] == 3
    assert result["output_tokens"] == result["expected_output_tokens"] == w.output_tokens == 12
    assert result["wall_s"] > 0 and result["output_tok_s"] == 12 / result["wall_s"]
    assert result["startup_s"] >= 0 and result["import_s"] >= 0 and result["settings"] == settings
    init, warmup, reset, timed = fake_vllm_calls(log)
    assert init["call"] == "init" and init["config"] == w.model_config and init["settings"] == settings
    assert init["pythonpath"].split(os.pathsep)[0] == site and init["host_ip"] == "127.0.0.1"
    assert not init["llmserve_imported"]
    assert warmup["call"] == "generate" and warmup["prompts"] == [[1, 2, 3, 4]]
    assert warmup["params"][0]["max_tokens"] == 8 and warmup["params"][0]["temperature"] == 0.6
    assert reset["call"] == "reset_prefix_cache"
    assert timed["prompts"] == w.prompts
    assert [(p["temperature"], p["top_p"], p["top_k"], p["max_tokens"], p["ignore_eos"], p.get("seed"),
             p["detokenize"]) for p in timed["params"]] == [(0.6, 1.0, 0, 5, True, None, False),
                                                            (1.0, 0.9, 20, 3, True, 11, False),
                                                            (0.0, 1.0, 0, 4, True, None, False)]
    assert not list(tmp_path.glob("llmserve-vllm-*"))  # its working folder is gone


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie nobody reaped is gone too
    except FileNotFoundError:
        return False


def test_vllm_peer_failures_and_timeouts_raise_with_its_last_lines(tmp_path, monkeypatch):
    """A failing peer raises with its last lines; a hanging one is killed after its timeout, with
    the engine-core process it started (which would otherwise keep the GPU)."""
    import pytest

    from llmserve.bench.vllm_peer import VllmPeerError, llm_settings, run_vllm_peer
    site, log = make_fake_vllm_site(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_VLLM_FAIL", "CUDA out of memory (fake)")
    with pytest.raises(VllmPeerError, match=r"(?s)exited with 1.*CUDA out of memory \(fake\)"):
        run_vllm_peer(make_tiny_workload(), site=site, settings=llm_settings(4, 64), timeout_s=60)
    monkeypatch.delenv("FAKE_VLLM_FAIL")
    monkeypatch.setenv("FAKE_VLLM_SLEEP", "30")
    start = time.perf_counter()
    with pytest.raises(VllmPeerError, match="timed out after 1 s"):
        run_vllm_peer(make_tiny_workload(), site=site, settings=llm_settings(4, 64), timeout_s=1)
    assert time.perf_counter() - start < 10
    (core,) = [c["pid"] for c in fake_vllm_calls(log) if c["call"] == "engine_core"]
    assert not process_alive(core)


def test_vllm_peer_goes_with_us_when_an_outer_timeout_ends_us(tmp_path, monkeypatch):
    """gpu_suite.sh runs the benchmark under `timeout`: its SIGTERM to us ends the peer's session too."""
    import signal
    import subprocess
    import sys

    site, log = make_fake_vllm_site(tmp_path, monkeypatch)
    monkeypatch.setenv("FAKE_VLLM_SLEEP", "30")
    code = ("import json, sys\n"
            "from llmserve.bench.vllm_peer import llm_settings, run_vllm_peer\n"
            "from llmserve.bench.workloads import Workload\n"
            "run_vllm_peer(Workload.from_dict(json.loads(sys.argv[1])), site=sys.argv[2],"
            " settings=llm_settings(4, 64), timeout_s=60)\n")
    bench = subprocess.Popen([sys.executable, "-c", code, json.dumps(make_tiny_workload().to_dict()), site],
                             stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not (log.exists() and "engine_core" in log.read_text()):
        assert time.monotonic() < deadline and bench.poll() is None
        time.sleep(0.05)
    (core,) = [c["pid"] for c in fake_vllm_calls(log) if c["call"] == "engine_core"]
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=20) == 128 + signal.SIGTERM
    assert not process_alive(core)


def test_bench_throughput_reports_the_vllm_peer_beside_our_engine(tmp_path, monkeypatch, capsys):
    """`bench throughput --peer vllm` end to end on the CPU: our engine on a tiny workload, then the
    (fake) peer on the same one; both figures and their ratio in the JSON and the printed lines."""
    from llmserve.bench import throughput
    from llmserve.bench.workloads import WORKLOADS
    site, log = make_fake_vllm_site(tmp_path, monkeypatch)
    monkeypatch.setitem(WORKLOADS, "tiny", make_tiny_workload)
    out = tmp_path / "result.json"
    throughput.main(["--workload", "tiny", "--peer", "vllm", "--vllm-site", site, "--max-num-seqs", "4",
                     "--max-num-batched-tokens", "64", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["output_tokens"] == 12
    peer = result["peers"]["vllm"]
    assert peer["peer"] == "vllm" and peer["output_tokens"] == 12 and peer["llmserve_wall_s"] == result["wall_s"]
    assert peer["llmserve_startup_s"] == result["startup_s"] and peer["startup_s"] >= 0
    assert peer["speedup"] == result["output_tok_s"] / peer["output_tok_s"]
    assert peer["settings"]["max_num_seqs"] == 4 and peer["settings"]["max_num_batched_tokens"] == 64
    assert fake_vllm_calls(log)[-1]["prompts"] == make_tiny_workload().prompts
    err = capsys.readouterr().err
    assert "peer vllm:" in err and "llmserve/vllm" in err and "[vllm] RESULT" in err


def test_bench_throughput_under_tensor_parallelism_reports_rank_zeros_steps(tmp_path, monkeypatch):
    """Under tensor parallelism the engine's step() calls wrap a round trip to the ranks: the result
    also holds rank 0's own view of the same steps (its launches and waits), to tell the host's
    share of a TP step from the device's."""
    from llmserve.bench import throughput
    from llmserve.bench.workloads import WORKLOADS
    monkeypatch.setitem(WORKLOADS, "tiny", make_tiny_workload)
    out = tmp_path / "result.json"
    throughput.main(["--workload", "tiny", "--tensor-parallel-size", "2", "--json", str(out)])
    steps = json.loads(out.read_text())["decode_steps"]
    # the same steps, give or take the engine's last step of the warm-up or of the run: the engine
    # thread may still step it while the benchmark clears or reads one side before the other
    assert steps["steps"] > 2 and abs(steps["rank0"]["steps"] - steps["steps"]) <= 2
    assert abs(sum(r["count"] for r in steps["rank0"]["by_batch"]) - sum(r["count"] for r in steps["by_batch"])) <= 2
