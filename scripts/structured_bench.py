"""Structured outputs on the GPU: what a constraint costs, and what jump-forward saves.

    python scripts/structured_bench.py [--mode tpot|jump|latency|phases|all] [--json out.json]

Both on W-small's model (Qwen3-0.6B shape, dummy weights) with a tokenizer of its whole vocabulary
in the checkpoint directory (llmserve.bench.workloads.synthetic_tokenizer: grammars are compiled
against all 151,936 tokens, as with the real one).

tpot: W-small's 256 requests as defined, then the same prompts and lengths constrained to the
inside of a JSON string (`{"text": "` then any string characters: the mask json_object's strings
take, filled and applied every step; random weights close a real json_object within a few tokens,
so its batch never stays at 256), then with `json_object` itself (reported, not compared). TPOT at
batch 256 is the mean interval between the ends of consecutive decode steps that ran at least 240
requests (every request's time per output token there); the target is the constrained run within
10% of the plain one. The JSON string is also measured with jump-forward off, as json_object runs
by default (its checks each step are the difference: nothing inside the string jumps); that ratio
(tpot_ratio_no_jump) stands for json_object's.

jump: the key-heavy ORDER schema (long keys, enums, bounded numbers and strings, an array of
objects), W-small's first B prompts, temperature 0.6, seed i, max_tokens 512, at B = 1 and 64,
jump-forward on and off in turn: wall time, forward steps, output and jumped tokens; every output
must validate with jsonschema in both.

latency: one request at a time (batch 1), W-small's first LATENCY_REQUESTS prompts with
LATENCY_TOKENS tokens each: plain, then inside a JSON string without jump-forward with the matchers
in the grammar process (json_object's default on a GPU) and in the engine's process
(LLMSERVE_GRAMMAR_PROCESS=0 as its requests start; the process started before stays up, unused
by them), then with jump-forward (nothing inside the string jumps: its checks' cost); TPOT is the mean interval between the ends of consecutive single-token decode steps,
each case run twice in turn, the second kept.

phases (not part of `all`): tpot's plain and JSON-string runs (the latter also with jump-forward
off) and json_object, with the engine's parts timed (PHASES): per decode step, how long each thread
spent where (the per-row parts are inflated by their own timing).
"""

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

import jsonschema
import torch

from llmserve import LLM, SamplingParams, StructuredOutputsParams
from llmserve.bench.report import report
from llmserve.bench.workloads import JSON_STRING_REGEX, w_small

ORDER = {
    "type": "object",
    "properties": {
        "order_identifier": {"type": "integer", "minimum": 0, "maximum": 999999},
        "customer_full_name": {"type": "string", "maxLength": 16},
        "shipping_address_country_code": {"enum": ["FR", "DE", "IT", "ES", "NL"]},
        "is_express_delivery_requested": {"type": "boolean"},
        "payment_method_description": {"enum": ["credit_card", "bank_transfer", "paypal"]},
        "line_items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object",
            "properties": {"product_stock_keeping_unit": {"type": "string", "maxLength": 8},
                           "quantity_ordered": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["product_stock_keeping_unit", "quantity_ordered"], "additionalProperties": False}},
        "gift_wrapping_requested": {"type": "boolean"},
    },
    "required": ["order_identifier", "customer_full_name", "shipping_address_country_code",
                 "is_express_delivery_requested", "payment_method_description", "line_items",
                 "gift_wrapping_requested"],
    "additionalProperties": False,
}
TPOT_MIN_BATCH = 240


def timed(llm, prompts, params, profile: list | None = None) -> tuple[float, list, list, float]:
    """(wall seconds, outputs, the runner's step records of the call, each with the CPU seconds
    the executor spent in that step's call (its generator's turns between waits: less than its
    wall time by what it waited for), the CPU seconds of the whole process). profile: a list to
    append the functions the runner's step spent most time in to (cProfile, those turns)."""
    timing = llm.engine.runner.timing
    timing.clear()
    runner, stepping, prof, cpu = llm.engine.runner, llm.engine.runner.stepping, cProfile.Profile(), []

    def turn(steps, value):
        start = time.thread_time()
        if profile is not None:
            prof.enable()
        try:
            return steps.send(value)
        finally:
            if profile is not None:
                prof.disable()
            cpu[-1] += time.thread_time() - start

    def measured(plan):
        cpu.append(0.0)
        steps = stepping(plan)
        try:
            wait = turn(steps, None)
            while True:
                wait = turn(steps, (yield wait))
        except StopIteration as stop:
            return stop.value
    runner.stepping = measured
    torch.cuda.synchronize()
    start, process_cpu = time.perf_counter(), time.process_time()
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        runner.stepping = stepping
    wall, process_cpu = time.perf_counter() - start, time.process_time() - process_cpu
    if profile is not None:
        stats = pstats.Stats(prof).stats
        top = sorted(stats.items(), key=lambda kv: -kv[1][3])[:40]
        profile += [{"function": f"{f}:{line}({name})", "calls": nc, "tottime_s": tt, "cumtime_s": ct}
                    for (f, line, name), (_, nc, tt, ct, _) in top]
    return wall, outs, list(zip(timing.records, cpu)), process_cpu


def tpot_at_batch(records, min_batch: int) -> dict:
    """Mean interval between the ends of consecutive decode steps of >= min_batch requests."""
    records = [r for r, _ in records]
    gaps = [b.end - a.end for a, b in zip(records, records[1:]) if b.tokens == b.requests >= min_batch]
    return {"steps": len(gaps), "tpot_ms": 1e3 * sum(gaps) / len(gaps) if gaps else None}


def decode_launch(records, min_batch: int) -> dict:
    """Mean host ms in step() launching, and in all, for decode steps of >= min_batch requests: a
    step() as long as the step's period means the host paces the device."""
    rows = [(r, cpu) for r, cpu in records if r.tokens == r.requests >= min_batch]
    n = max(len(rows), 1)
    return {"launch_ms": 1e3 * sum(r.launched - r.start for r, _ in rows) / n,
            "step_call_ms": 1e3 * sum(r.end - r.start for r, _ in rows) / n,
            "step_cpu_ms": 1e3 * sum(cpu for _, cpu in rows) / n}


def constrained(w, **kind) -> list[SamplingParams]:
    """Workload w's sampling parameters, each request with the structured output `kind` and seed i."""
    return [SamplingParams(temperature=p.temperature, max_tokens=p.max_tokens, seed=i,
                           structured_outputs=StructuredOutputsParams(**kind)) for i, p in enumerate(w.params)]


def tpot(llm, profile: bool = False) -> dict:
    w = w_small()
    runs = {}

    for name, params in (("plain", w.params), ("json_string", constrained(w, regex=JSON_STRING_REGEX)),
                         ("plain_again", w.params),
                         ("json_string_no_jump", constrained(w, regex=JSON_STRING_REGEX, jump_forward=False)),
                         ("json_object", constrained(w, json_object=True))):
        wall, outs, records, process_cpu = timed(llm, w.prompts, params)
        runs[name] = {"wall_s": wall, "process_cpu_s": process_cpu,
                      "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                      **tpot_at_batch(records, TPOT_MIN_BATCH), **decode_launch(records, TPOT_MIN_BATCH)}
        process = getattr(llm.engine.runner.sampling.strategies["structured_outputs"], "_process", None)
        runs[name]["grammar_process_ready"] = bool(process is not None and process.ready)
        print(f"{name}: TPOT {runs[name]['tpot_ms']} ms, wall {wall:.2f} s", file=sys.stderr, flush=True)
        if name == "json_object":
            done = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
            runs[name]["completed_json"] = len(done)
            runs[name]["valid_json"] = sum(isinstance(json.loads(o.text), (dict, list)) for o in done)
    plain = (runs["plain"]["tpot_ms"] + runs["plain_again"]["tpot_ms"]) / 2
    result = {"runs": runs, "tpot_ratio": runs["json_string"]["tpot_ms"] / plain,
              "tpot_ratio_no_jump": runs["json_string_no_jump"]["tpot_ms"] / plain}
    if profile:  # where the executor's host time goes, constrained (its timings are not the figures)
        result["profile"] = {}
        for name, params in (("plain", w.params),
                             ("json_string_no_jump", constrained(w, regex=JSON_STRING_REGEX, jump_forward=False)),
                             ("json_string", constrained(w, regex=JSON_STRING_REGEX)),
                             ("json_object", constrained(w, json_object=True))):
            timed(llm, w.prompts, params, profile=result["profile"].setdefault(name, []))
    return result


PHASES = {  # where each runs: the executor's thread, the mask thread, the event loop
    "executor: queue the sampler waiting for masks": ("llmserve.model.runner", "ModelRunner", "_queue_waiting"),
    "executor: queue the forward pass": ("llmserve.model.runner", "ModelRunner", "_forward"),
    "executor: finish the step before (wait, accept, jump)":
        ("llmserve.model.runner", "ModelRunner", "_finish_or_fail"),
    "executor: wait for the device": ("torch.cuda", "Event", "synchronize"),
    "executor: accept a token (a row)": ("llmserve.model.sampling_state", "SeqState", "accept"),
    "executor: accept the masked rows' tokens (one call)": ("llmserve.model.sampling_state", "SamplingState",
                                                            "accept_masked"),
    "executor: jump check (a row)": ("llmserve.model.sampling_state", "SeqState", "jump"),
    "executor: build the sampling batch, start the masks": ("llmserve.model.runner", "ModelRunner", "_sample"),
    "executor: the batch's parameters": ("llmserve.model.sampling_state", "SamplingState", "batch"),
    "executor: start the masks": ("llmserve.model.sampling_state", "SamplingState", "masks"),
    "executor: queue the sampler": ("llmserve.model.runner", None, "draw"),
    "executor: wait for the masks": ("llmserve.model.sampling_state", "MaskFill", "send"),
    "masks: fill": ("llmserve.model.sampling_state", None, "_fill_masks"),
    "loop: scheduler applies results": ("llmserve.actors.scheduler_actor", "SchedulerActor", "_apply"),
    "loop: scheduler plans": ("llmserve.actors.scheduler_actor", "SchedulerActor", "_schedule"),
    "loop: request actor publishes outputs": ("llmserve.actors.request_actor", "RequestActor", "_on_outputs"),
}


def phases(llm) -> dict:
    """Mean ms a decode step (>= TPOT_MIN_BATCH requests) spends in each of PHASES, plain and
    constrained to a JSON string: where the constrained step's time goes, thread by thread."""
    import importlib
    import inspect

    spans: list[tuple[str, float, float]] = []

    def wrapped(fn, name):
        if inspect.iscoroutinefunction(fn):
            async def timed_async(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return await fn(*args, **kwargs)
                finally:
                    spans.append((name, start, time.perf_counter()))
            return timed_async

        def timed_sync(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((name, start, time.perf_counter()))
        return timed_sync

    originals = []
    for name, (module, cls, attr) in PHASES.items():
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        originals.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, wrapped(getattr(owner, attr), name))
    w, result = w_small(), {}

    try:
        for run, params in (("plain", w.params), ("json_string", constrained(w, regex=JSON_STRING_REGEX)),
                            ("json_string_no_jump", constrained(w, regex=JSON_STRING_REGEX, jump_forward=False)),
                            ("json_object", constrained(w, json_object=True))):
            spans.clear()
            _, _, records, _ = timed(llm, w.prompts, params)
            rows = [r for r, _ in records if r.tokens == r.requests >= TPOT_MIN_BATCH]
            t0, t1 = rows[0].start, rows[-1].end
            result[run] = {"steps": len(rows), "period_ms": 1e3 * (t1 - t0) / len(rows)}
            for name in PHASES:
                inside = sum(min(e, t1) - max(s, t0) for n, s, e in spans if n == name and e > t0 and s < t1)
                result[run][name] = 1e3 * inside / len(rows)
    finally:
        for owner, attr, original in originals:
            setattr(owner, attr, original)
    return result


LATENCY_REQUESTS, LATENCY_TOKENS = 8, 256


def latency(llm) -> dict:
    w = w_small()
    prompts = w.prompts[:LATENCY_REQUESTS]

    def string(jump_forward: bool) -> SamplingParams:
        return SamplingParams(max_tokens=LATENCY_TOKENS, structured_outputs=StructuredOutputsParams(
            regex=JSON_STRING_REGEX, jump_forward=jump_forward))
    cases = {"plain": (SamplingParams(max_tokens=LATENCY_TOKENS, ignore_eos=True), None),
             "json_string_no_jump": (string(False), None),
             "json_string_no_jump_in_process": (string(False), "0"),
             "json_string": (string(True), None)}
    result, setting = {}, os.environ.get("LLMSERVE_GRAMMAR_PROCESS")
    try:
        for _ in range(2):
            for name, (params, process) in cases.items():
                if process is None:
                    os.environ.pop("LLMSERVE_GRAMMAR_PROCESS", None)
                else:  # read as each request's constraint starts
                    os.environ["LLMSERVE_GRAMMAR_PROCESS"] = process
                gaps, tokens = [], 0
                for prompt in prompts:
                    _, outs, records, _ = timed(llm, [prompt], params)
                    tokens += len(outs[0].outputs[0].token_ids)
                    records = [r for r, _ in records]
                    gaps += [b.end - a.end for a, b in zip(records, records[1:]) if b.tokens == b.requests == 1]
                result[name] = {"steps": len(gaps), "tpot_ms": 1e3 * sum(gaps) / len(gaps) if gaps else None,
                                "output_tokens": tokens}
    finally:
        if setting is None:
            os.environ.pop("LLMSERVE_GRAMMAR_PROCESS", None)
        else:
            os.environ["LLMSERVE_GRAMMAR_PROCESS"] = setting
    plain = result["plain"]["tpot_ms"]
    for name in cases:
        if name != "plain" and plain and result[name]["tpot_ms"]:
            result[f"{name}_ratio"] = result[name]["tpot_ms"] / plain
    return result


def jump(llm) -> dict:
    w = w_small()
    result = {}
    for batch in (1, 64):
        for forward in (False, True, False, True):  # each twice, alternating: the second of each is kept
            params = [SamplingParams(temperature=0.6, seed=i, max_tokens=512, structured_outputs=StructuredOutputsParams(
                json=ORDER, jump_forward=forward)) for i in range(batch)]
            jumped0 = llm.engine.scheduler.jumped_tokens
            wall, outs, records, _ = timed(llm, w.prompts[:batch], params)
            for o in outs:
                assert o.outputs[0].finish_reason == "stop", o.outputs[0].finish_reason
                jsonschema.validate(json.loads(o.outputs[0].text), ORDER)
            result[f"b{batch}_{'on' if forward else 'off'}"] = {
                "wall_s": wall, "steps": sum(1 for r, _ in records if r.requests),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "jumped_tokens": llm.engine.scheduler.jumped_tokens - jumped0, "valid": len(outs)}
        on, off = result[f"b{batch}_on"], result[f"b{batch}_off"]
        result[f"b{batch}_fewer_steps"] = off["steps"] / on["steps"]
        result[f"b{batch}_speedup"] = off["wall_s"] / on["wall_s"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["tpot", "jump", "latency", "phases", "all"], default="all")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--profile", action="store_true",
                    help="tpot: then a cProfile of the executor's step(): plain, the JSON string without "
                         "jump-forward (the grammar process's) and with it, and json_object")
    ap.add_argument("--switch-intervals", type=lambda s: [float(x) for x in s.split(",")], default=[],
                    help="tpot: measured again under each sys.setswitchinterval (seconds, comma-separated)")
    args = ap.parse_args()
    w = w_small()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = w.write_model_dir(tmp)
        w.write_tokenizer(model_dir)
        with LLM(model_dir, load_format="dummy", log_interval_s=0) as llm:
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
            # the constrained path's first use (the mask kernel's compilation, the mask thread,
            # xgrammar's batch matcher) would otherwise land in the first measured run's steps
            for jumps in (True, False):  # (without jump-forward: the grammar process starts, ready by the runs)
                llm.generate([{"prompt_token_ids": [1, 2, i]} for i in range(8)],
                             SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
                                 regex=JSON_STRING_REGEX, jump_forward=jumps)), use_tqdm=False)
            result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
            for mode, measure in (("jump", jump), ("tpot", lambda llm: tpot(llm, args.profile)),
                                  ("latency", latency), ("phases", phases)):
                if args.mode == mode or (args.mode == "all" and mode != "phases"):
                    result[mode] = measure(llm)
                    report(result, args.json, echo=False)  # what is measured so far, should a later part fail
            default = sys.getswitchinterval()
            for interval in args.switch_intervals if args.mode in ("tpot", "all") else ():
                sys.setswitchinterval(interval)
                result[f"tpot_switch_{interval:g}"] = tpot(llm)
                sys.setswitchinterval(default)
                report(result, args.json, echo=False)
    report(result, args.json)


if __name__ == "__main__":
    main()
