"""Speculative decoding on the GPU: what a verify step costs, and what n-gram proposals save.

    python scripts/spec_bench.py [--mode verify|ngram|load|all] [--json out.json]

Each mode runs one engine with speculation configured and measures its sides (off: the
scheduler's speculation unset, so nothing is proposed and steps overlap as without it) ROUNDS
times, the order turned round each round, prefix caching off; the best run of each side counts.

verify: the 8B shape (decode-b1's model, dummy weights, bf16), batch B in (1, 16), random
128-token prompts, 256 greedy tokens each, speculation held on: off; sync (every proposal empty:
each step waits for the one before, as speculation makes it, with nothing to check); on (the
plain run's next k = 4 tokens proposed at every step). Random weights in bf16 leave near-ties that
a verify step's sums split otherwise than a decode step's, so outputs part after a few tokens and
drafts are then rejected (each request still checks k: Acceptance held at k): what is measured
is a step's cost, ms per step against off (the target for on is at most 1.2; sync says how much of
it is the lost overlap); at full acceptance the speed-up would be (k + 1) / on's ratio.

ngram: the built-in model (trained: it can copy), float32, batch 1: copy-heavy prompts (a held-out
document's first 600 characters, two blank lines, then its first 150 again: the answer goes on
repeating it), four in turn, 256 greedy tokens each; n-gram proposals with k = 4, the controller
deciding (a fresh one each run). Reported: TPOT on and off, their ratio, and the tokens produced
per verify step (1 + drafts kept / verify steps).

pair (not in `all`; --target DIR [--draft DIR] [--k K] [--cases a,b]): a target trained by
`train_builtin_model.py --size target` on the built-in model's text and tokenizer, bf16, its draft
(k = 4 unless --k; by default the built-in model, or one distilled from the target with
`train_builtin_model.py --teacher`): eight held-out documents' first 400 characters, 256 tokens
each, one at a time greedy and sampled (temperature 0.7: seeded, so with the draft's greedy
choices; and unseeded, so with drafts drawn from the draft's distribution and kept with
probability min(1, p / q)), then all eight at once; then the target with n-gram proposals on
copy-heavy prompts as in `ngram`, and on prompts whose answer repeats them throughout (a
document's first 1,000 characters, then its first 100 again; 192 tokens, within the ~240 still to
repeat). --cases runs only those of draft_b1, draft_b1_sampled, draft_b1_drawn, draft_b8,
ngram_b1, ngram_b1_copy. Outputs may part in bf16 (agreeing_prefix says how far they agree).

load: W-small's model (Qwen3-0.6B shape, dummy weights) with W-small's first B prompts and
lengths, B in --batches (16, 64; 256 is all of W-small), n-gram proposals allowed up to batch 64: random prompts and weights, so
proposals are rare and wrong; throughput on / off (speculation must not lose: at least 0.97), and
`stopped` / off: speculation configured but its controller held stopped (no spell, no probe), so
what the controller's spells and probes cost is on / stopped.
"""

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import llmserve
from llmserve import LLM, SamplingParams
from llmserve.bench.workloads import decode_b1, w_small
from llmserve.hookspecs import hookimpl
from llmserve.plugin_manager import get_plugin_manager
from llmserve.speculative import Acceptance, SpecControl

ROUNDS = int(os.environ.get("SPEC_ROUNDS", 5))


class Oracle:
    """Proposes each request's continuation from `reference` (prompt -> plain output), `k` tokens
    at most (0: none, every proposal empty)."""

    reference: dict[tuple, list[int]] = {}
    k = 4

    def __init__(self, config, context) -> None:
        pass

    def propose(self, req_ids, sequences, limits):
        out = []
        for (prompt, output), limit in zip(sequences, limits):
            ref = self.reference.get(tuple(prompt), [])
            out.append(ref[len(output):len(output) + min(limit, Oracle.k)])
        return out


class OraclePlugin:
    @hookimpl
    def llmserve_register_proposers(self, register):
        register("oracle", Oracle)


def timed(llm, prompts, params, speculation, one_by_one: bool = False) -> dict:
    """One run (speculation None: off): wall time, steps, output tokens, drafts checked and kept.
    one_by_one: each prompt alone, in turn (batch 1)."""
    s = llm.engine.scheduler
    s.speculation = speculation
    steps0, drafts0, kept0, checks0 = sum(s.iteration_tokens), s.spec.draft_tokens, s.spec.accepted_tokens, s.spec.drafts
    batches = [[p] for p in prompts] if one_by_one else [prompts]
    t = time.perf_counter()
    outs = [o for b in batches for o in llm.generate([{"prompt_token_ids": p} for p in b], params, use_tqdm=False)]
    wall = time.perf_counter() - t
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"wall_s": wall, "steps": sum(s.iteration_tokens) - steps0, "output_tokens": sum(map(len, tokens)),
            "verify_steps": s.spec.drafts - checks0, "draft_tokens": s.spec.draft_tokens - drafts0,
            "kept_tokens": s.spec.accepted_tokens - kept0, "proposer_cost_steps": s.spec_control.cost, "tokens": tokens}


def compare(llm, sides: dict, prompts, params, label: str, exact: bool = True, one_by_one: bool = False,
            held: bool = False) -> dict:
    """Run each side (name -> a function that sets the engine up and returns its speculation, None
    for off) ROUNDS times, the order turned round each round; each side's median run counts. The
    first side is the baseline. exact: outputs must be equal on all sides (float32); in bf16 a
    verify step's sums may split a near-tie otherwise than a decode step's, so the share of output
    tokens that agree with the baseline is reported. Each run starts with a fresh speculation
    controller, unless `held` (the engine's, held on)."""
    speculation = llm.engine.scheduler.speculation
    runs = {side: [] for side in sides}
    for r in range(ROUNDS):
        for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
            if not held:
                llm.engine.scheduler.spec_control = SpecControl(speculation.num_tokens if speculation else 0)
            runs[side].append(timed(llm, prompts, params, sides[side](), one_by_one))
    llm.engine.scheduler.speculation = speculation
    base = list(sides)[0]
    reference = runs[base][0]["tokens"]
    if exact:
        assert all(r["tokens"] == reference for rs in runs.values() for r in rs), f"{label}: outputs differ"
    out = {}
    base_run = sorted(runs[base], key=lambda r: r["wall_s"])[len(runs[base]) // 2]
    for side, rs in runs.items():
        best = sorted(rs, key=lambda r: r["wall_s"])[len(rs) // 2]
        best = {k: v for k, v in best.items() if k != "tokens"}
        best["agreeing_prefix"] = sum(_common(a, b) for a, b in zip(rs[0]["tokens"], reference)) / sum(map(len, reference))
        best["ms_per_step"] = 1000 * best["wall_s"] / best["steps"]
        best["tok_s"] = best["output_tokens"] / best["wall_s"]
        best["tpot_ms"] = 1000 * best["wall_s"] * (1 if one_by_one else len(prompts)) / best["output_tokens"]
        if best["verify_steps"]:
            best["tokens_per_verify_step"] = 1 + best["kept_tokens"] / best["verify_steps"]
        best["step_cost_ratio"] = best["ms_per_step"] / (1000 * base_run["wall_s"] / base_run["steps"])
        best["speedup"] = best["tok_s"] / (base_run["output_tokens"] / base_run["wall_s"])
        out[side] = best
    print(label, json.dumps(out), flush=True)
    return out


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def verify(tmp: str) -> dict:
    w = decode_b1()
    pm, plugin = get_plugin_manager(), OraclePlugin()
    pm.register(plugin, name="oracle")
    results, limit = {}, Acceptance.limit
    try:
        with LLM(w.write_model_dir(tmp), load_format="dummy", log_interval_s=0, max_model_len=4096,
                 enable_prefix_caching=False, speculative_config={"method": "oracle", "num_speculative_tokens": 4}) as llm:
            speculation = llm.engine.scheduler.speculation
            control = llm.engine.scheduler.spec_control  # held on
            control.active, control.record = True, lambda *args, **kwargs: None
            Acceptance.limit = lambda self, most, batch, max_batch: most  # every request checks k: a step's cost at k

            def with_k(k):
                def setup():
                    Oracle.k = k
                    return speculation
                return setup
            for batch in (1, 16):
                random.seed(batch)
                prompts = [[random.randint(0, 100000) for _ in range(128)] for _ in range(batch)]
                params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256)
                plain = timed(llm, prompts, params, None)["tokens"]
                Oracle.reference = {tuple(p): t for p, t in zip(prompts, plain)}
                sides = {"off": lambda: None, "sync": with_k(0), "on": with_k(4)}
                results[f"b{batch}"] = compare(llm, sides, prompts, params, f"verify b{batch}", exact=False, held=True)
    finally:
        pm.unregister(plugin)
        Acceptance.limit = limit
    return results


def ngram() -> dict:
    text = (Path(llmserve.__file__).parent / "builtin_model" / "heldout.txt").read_text()
    docs = [d.strip() for d in text.split("<|doc|>") if len(d.strip()) > 600][:4]
    with LLM("builtin", dtype="float32", log_interval_s=0, enable_prefix_caching=False,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4}) as llm:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(d[:600] + "\n\n" + d[:150]) for d in docs]
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256)
        speculation = llm.engine.scheduler.speculation
        sides = {"off": lambda: None, "on": lambda: speculation}
        return {"b1": compare(llm, sides, prompts, params, "ngram b1", one_by_one=True)}


def pair(target: str, draft: str | None = None, k: int = 4, cases: set[str] | None = None) -> dict:
    """The trained target (train_builtin_model.py --size target) with its draft (by default the
    built-in model), then with n-gram proposals on copy-heavy prompts; bf16. k: drafts a step at
    most; cases: those of the result's keys to run (default: all)."""
    want = lambda case: cases is None or case in cases  # noqa: E731
    draft = draft or str(Path(llmserve.__file__).parent / "builtin_model")
    docs = [d.strip() for d in (Path(target) / "heldout.txt").read_text().split("<|doc|>") if len(d.strip()) > 600]
    out = {}
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=256)
    drafting = [(case, params, batched) for case, params, batched in (
        ("draft_b1", greedy, False),
        ("draft_b1_sampled", SamplingParams(temperature=0.7, seed=1, ignore_eos=True, max_tokens=256), False),
        ("draft_b1_drawn", SamplingParams(temperature=0.7, ignore_eos=True, max_tokens=256), False),  # unseeded: drafts drawn
        ("draft_b8", greedy, True)) if want(case)]
    if drafting:
        with LLM(target, dtype="bfloat16", log_interval_s=0, enable_prefix_caching=False,
                 speculative_config={"method": "draft", "model": draft, "num_speculative_tokens": k}) as llm:
            tok = llm.get_tokenizer()
            prompts = [tok.encode(d[:400]) for d in docs[:8]]
            speculation = llm.engine.scheduler.speculation
            sides = {"off": lambda: None, "on": lambda: speculation}
            for case, params, batched in drafting:
                out[case] = compare(llm, sides, prompts, params, case.replace("_", " "), exact=False,
                                    one_by_one=not batched)
    if want("ngram_b1") or want("ngram_b1_copy"):
        with LLM(target, dtype="bfloat16", log_interval_s=0, enable_prefix_caching=False,
                 speculative_config={"method": "ngram", "num_speculative_tokens": k}) as llm:
            tok = llm.get_tokenizer()
            speculation = llm.engine.scheduler.speculation
            sides = {"off": lambda: None, "on": lambda: speculation}
            if want("ngram_b1"):
                prompts = [tok.encode(d[:600] + "\n\n" + d[:150]) for d in docs[:4]]
                out["ngram_b1"] = compare(llm, sides, prompts, greedy, "target ngram b1", exact=False, one_by_one=True)
            if want("ngram_b1_copy"):
                # an answer that repeats the prompt throughout (editing a given text): the output
                # stays within the text the prompt's second copy has yet to repeat (~240 tokens)
                prompts = [tok.encode(d[:1000] + "\n\n" + d[:100]) for d in docs if len(d) >= 1000][:4]
                copy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=192)
                out["ngram_b1_copy"] = compare(llm, sides, prompts, copy, "target ngram b1 copy", exact=False,
                                               one_by_one=True)
    out["num_speculative_tokens"] = k
    for name, path in (("target", target), ("draft", draft)):
        training = json.loads((Path(path) / "training.json").read_text())
        last = training["log"][-1]
        out[name] = {"parameters": training["parameters"], "steps": training["steps"],
                     "heldout_perplexity": math.exp(last["heldout_loss"]), "teacher": training.get("teacher"),
                     "heldout_argmax_agreement": last.get("heldout_argmax_agreement"),
                     "copies": training.get("copies", 0.0), "heldout_copied": last.get("heldout_copied")}
    return out


def load(tmp: str, batches: tuple[int, ...] = (16, 64)) -> dict:
    w = w_small()
    with LLM(w.write_model_dir(tmp), load_format="dummy", log_interval_s=0, enable_prefix_caching=False,
             speculative_config={"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64}) as llm:
        s = llm.engine.scheduler
        speculation = s.speculation

        def control(stopped: bool):
            def setup():
                s.spec_control = SpecControl(speculation.num_tokens)
                if stopped:  # never speculates nor probes: what speculation costs apart from the controller's work
                    s.spec_control.active, s.spec_control.wait = False, 1 << 30
                return speculation
            return setup
        sides = {"off": lambda: None, "on": control(False), "stopped": control(True)}
        return {f"b{b}": compare(llm, sides, w.prompts[:b], w.params[:b], f"load b{b}", exact=False, held=True)
                for b in batches}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="all", choices=["verify", "ngram", "load", "pair", "all"])
    ap.add_argument("--target", help="pair: the trained target's directory")
    ap.add_argument("--draft", help="pair: its draft's directory (default: the built-in model)")
    ap.add_argument("--k", type=int, default=4, help="pair: num_speculative_tokens")
    ap.add_argument("--cases", help="pair: a comma-separated subset of draft_b1, draft_b1_sampled, draft_b1_drawn, "
                                    "draft_b8, ngram_b1, ngram_b1_copy")
    ap.add_argument("--batches", default="16,64", help="load: batch sizes (256: all of W-small)")
    ap.add_argument("--json")
    args = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.mode in ("verify", "all"):
            results["verify"] = verify(tmp + "/8b")
        if args.mode in ("ngram", "all"):
            results["ngram"] = ngram()
        if args.mode in ("load", "all"):
            results["load"] = load(tmp + "/small", tuple(int(b) for b in args.batches.split(",")))
        if args.mode == "pair":
            results["pair"] = pair(args.target, args.draft, args.k, set(args.cases.split(",")) if args.cases else None)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    json.dump(results, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
