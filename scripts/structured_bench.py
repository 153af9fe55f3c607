"""Structured outputs on the GPU: what a constraint costs, and what jump-forward saves.

    python scripts/structured_bench.py [--mode tpot|jump|all] [--json out.json]

Both on W-small's model (Qwen3-0.6B shape, dummy weights) with a tokenizer of its whole vocabulary
in the checkpoint directory (llmserve.bench.workloads.synthetic_tokenizer: grammars are compiled
against all 151,936 tokens, as with the real one).

tpot: W-small's 256 requests as defined, then the same prompts and lengths constrained to the
inside of a JSON string (`{"text": "` then any string characters: the mask json_object's strings
take, filled and applied every step; random weights close a real json_object within a few tokens,
so its batch never stays at 256), then with `json_object` itself (reported, not compared). TPOT at
batch 256 is the mean interval between the ends of consecutive decode steps that ran at least 240
requests (every request's time per output token there); the target is the constrained run within
10% of the plain one.

jump: the key-heavy ORDER schema (long keys, enums, bounded numbers and strings, an array of
objects), W-small's first B prompts, temperature 0.6, seed i, max_tokens 512, at B = 1 and 64,
jump-forward on and off in turn: wall time, forward steps, output and jumped tokens; every output
must validate with jsonschema in both.
"""

import argparse
import cProfile
import json
import pstats
import tempfile
import time

import jsonschema
import torch

from llmserve import LLM, SamplingParams, StructuredOutputsParams
from llmserve.bench.report import report
from llmserve.bench.workloads import w_small

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


def timed(llm, prompts, params, profile: list | None = None) -> tuple[float, list, list]:
    """(wall seconds, outputs, the runner's step records of the call). profile: a list to append
    the functions the runner's step() spent most time in to (cProfile, the executor's thread)."""
    timing = llm.engine.runner.timing
    timing.clear()
    runner, step, prof = llm.engine.runner, llm.engine.runner.step, cProfile.Profile()
    if profile is not None:
        def profiled(plan):
            prof.enable()
            try:
                return step(plan)
            finally:
                prof.disable()
        runner.step = profiled
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        runner.step = step
    wall = time.perf_counter() - start
    if profile is not None:
        stats = pstats.Stats(prof).stats
        top = sorted(stats.items(), key=lambda kv: -kv[1][3])[:40]
        profile += [{"function": f"{f}:{line}({name})", "calls": nc, "tottime_s": tt, "cumtime_s": ct}
                    for (f, line, name), (_, nc, tt, ct, _) in top]
    return wall, outs, list(timing.records)


def tpot_at_batch(records, min_batch: int) -> dict:
    """Mean interval between the ends of consecutive decode steps of >= min_batch requests."""
    gaps = [b.end - a.end for a, b in zip(records, records[1:]) if b.tokens == b.requests >= min_batch]
    return {"steps": len(gaps), "tpot_ms": 1e3 * sum(gaps) / len(gaps) if gaps else None}


JSON_STRING = r'\{"text": "[^"\\\x00-\x1f]*'


def decode_launch(records, min_batch: int) -> dict:
    """Mean host ms in step() launching, and in all, for decode steps of >= min_batch requests: a
    step() as long as the step's period means the host paces the device."""
    rows = [r for r in records if r.tokens == r.requests >= min_batch]
    n = max(len(rows), 1)
    return {"launch_ms": 1e3 * sum(r.launched - r.start for r in rows) / n,
            "step_call_ms": 1e3 * sum(r.end - r.start for r in rows) / n}


def tpot(llm, profile: bool = False) -> dict:
    w = w_small()
    runs = {}

    def constrained(**kind) -> list[SamplingParams]:
        return [SamplingParams(temperature=p.temperature, max_tokens=p.max_tokens, seed=i,
                               structured_outputs=StructuredOutputsParams(**kind)) for i, p in enumerate(w.params)]

    for name, params in (("plain", w.params), ("json_string", constrained(regex=JSON_STRING)),
                         ("plain_again", w.params), ("json_object", constrained(json_object=True))):
        wall, outs, records = timed(llm, w.prompts, params)
        runs[name] = {"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                      **tpot_at_batch(records, TPOT_MIN_BATCH), **decode_launch(records, TPOT_MIN_BATCH)}
        if name == "json_object":
            done = [o.outputs[0] for o in outs if o.outputs[0].finish_reason == "stop"]
            runs[name]["completed_json"] = len(done)
            runs[name]["valid_json"] = sum(isinstance(json.loads(o.text), (dict, list)) for o in done)
    plain = (runs["plain"]["tpot_ms"] + runs["plain_again"]["tpot_ms"]) / 2
    result = {"runs": runs, "tpot_ratio": runs["json_string"]["tpot_ms"] / plain}
    if profile:  # where the executor's host time goes, constrained (its timings are not the figures)
        result["profile"] = {}
        for name, params in (("plain", w.params), ("json_string", constrained(regex=JSON_STRING))):
            timed(llm, w.prompts, params, profile=result["profile"].setdefault(name, []))
    return result


def jump(llm) -> dict:
    w = w_small()
    result = {}
    for batch in (1, 64):
        for forward in (False, True, False, True):  # each twice, alternating: the second of each is kept
            params = [SamplingParams(temperature=0.6, seed=i, max_tokens=512, structured_outputs=StructuredOutputsParams(
                json=ORDER, jump_forward=forward)) for i in range(batch)]
            jumped0 = llm.engine.scheduler.jumped_tokens
            wall, outs, records = timed(llm, w.prompts[:batch], params)
            for o in outs:
                assert o.outputs[0].finish_reason == "stop", o.outputs[0].finish_reason
                jsonschema.validate(json.loads(o.outputs[0].text), ORDER)
            result[f"b{batch}_{'on' if forward else 'off'}"] = {
                "wall_s": wall, "steps": sum(1 for r in records if r.requests),
                "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                "jumped_tokens": llm.engine.scheduler.jumped_tokens - jumped0, "valid": len(outs)}
        on, off = result[f"b{batch}_on"], result[f"b{batch}_off"]
        result[f"b{batch}_fewer_steps"] = off["steps"] / on["steps"]
        result[f"b{batch}_speedup"] = off["wall_s"] / on["wall_s"]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["tpot", "jump", "all"], default="all")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--profile", action="store_true", help="tpot: then a cProfile of the executor's step(), plain and constrained")
    args = ap.parse_args()
    w = w_small()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = w.write_model_dir(tmp)
        w.write_tokenizer(model_dir)
        with LLM(model_dir, load_format="dummy", log_interval_s=0) as llm:
            llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
            result = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
            for mode, measure in (("jump", jump), ("tpot", lambda llm: tpot(llm, args.profile))):
                if args.mode in (mode, "all"):
                    result[mode] = measure(llm)
                    report(result, args.json, echo=False)  # what is measured so far, should a later part fail
    report(result, args.json)


if __name__ == "__main__":
    main()
