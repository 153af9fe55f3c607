"""BENCHMARKS.md's tables, rendered from the result files under benchmarks/results/.

Each folder there is one device call: the JSON files the benchmarks wrote, and a run.toml that
says when, where, at which commit and with which command they were measured, and which of them are
the page's figures:

    time = 2026-11-24T21:45:00Z
    device = "NVIDIA H100 80GB HBM3"
    commit = "25af406"
    command = "SKIP_TESTS=1 bash scripts/gpu_suite.sh run peers"
    what = "W-small and W-large with vLLM 0.24.0 in the same call"

    [[figure]]
    name = "W-small"                  # the row; the newest run that has a figure of this name wins
    file = "w-small-vllm.json"
    baseline = "w-small-none.json"    # optional: the same call's unmodified run, for a ratio
    modes = ["verify"]                # spec_bench figures: optional, only these modes of the file
    offline = "w-small.json"          # W-serve rows: the same call's offline run it is a fraction of
    same_call = "..."                 # optional: what the same call measured beside it (from its log)
    section = "parallel"              # optional: the table, where not the file's kind (parallel: Several
    baseline_label = "TP = 1"         #   GPUs, each figure beside its `baseline`, so labelled)

A figure's kind follows from its file: `bench throughput` (offline), `bench serve`, the start-up
benchmark's rows, or `bench quality`.

    python scripts/bench_page.py [--check] [--page BENCHMARKS.md] [--results benchmarks/results]

rewrites the part of the page between the two marker lines; --check only says whether it is current.
"""

import argparse
import json
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- figures: rendered by scripts/bench_page.py from benchmarks/results/; do not edit by hand -->"
END = "<!-- end of figures -->"


def load_runs(results: Path) -> list[dict]:
    """Every run folder's run.toml, with its figures' data loaded, oldest first."""
    runs = []
    for path in sorted(results.glob("*/run.toml")):
        run = tomllib.loads(path.read_text())
        run["id"] = path.parent.name
        for fig in run.get("figure", []):
            for key in ("file", "baseline", "offline"):
                if key in fig:
                    fig[key + "_data"] = json.loads((path.parent / fig[key]).read_text())
        runs.append(run)
    return sorted(runs, key=lambda r: r["time"])


def kind(data) -> str:
    if isinstance(data, list):
        return "startup"
    if "perplexity" in data:
        return "quality"
    if "jump" in data or "tpot" in data or "latency" in data:
        return "structured"
    if "verify" in data or "ngram" in data or "load" in data or "pair" in data:
        return "speculative"
    if "rows" in data and all("cascade_us" in r for r in data["rows"]):
        return "cascade"
    if "rows" in data and all("fused_us" in r for r in data["rows"]):
        return "moe"
    return "serve" if "output_throughput" in data else "offline"


def latest_figures(runs: list[dict]) -> dict[str, list[tuple[dict, dict]]]:
    """Kind -> [(figure, its run)], one per figure name, from the newest run that has it, in the
    order the names first appear."""
    chosen: dict[str, tuple[dict, dict]] = {}
    for run in runs:
        for fig in run.get("figure", []):
            chosen[fig["name"]] = (fig, run)
    by_kind: dict[str, list] = {}
    for fig, run in chosen.values():
        by_kind.setdefault(fig.get("section") or kind(fig["file_data"]), []).append((fig, run))
    return by_kind


def link(run: dict) -> str:
    return f"[{run['id']}](benchmarks/results/{run['id']}/)"


def offline_rows(figs) -> list[str]:
    rows = ["| figure | wall s | output tok/s | of roofline | compared in the same call | run |",
            "|---|---|---|---|---|---|"]
    for fig, run in figs:
        d = fig["file_data"]
        roof = f"{100 * d['roofline_fraction']:.1f}% of {d['roofline_s']:.2f} s"
        if "roofline_sustained_fraction" in d:
            roof += f" ({100 * d['roofline_sustained_fraction']:.1f}% at the sustained matmul rate)"
        peers = []
        for p in d.get("peers", {}).values():
            if p.get("engine") == "vllm":
                peers.append(f"vLLM {p['vllm_version']}: {p['wall_s']:.2f} s, {p['output_tok_s']:,.0f} tok/s; "
                             f"llmserve **{p['speedup']:.2f}×**")
            elif "speedup" in p:
                peers.append(f"{p['peer']}: {p['output_tok_s']:,.0f} tok/s on {p['requests']} requests; "
                             f"llmserve {p['speedup']:.1f}×")
        if "baseline_data" in fig:
            b = fig["baseline_data"]
            peers.append(f"unquantized {b['wall_s']:.2f} s: **{b['wall_s'] / d['wall_s']:.2f}×**")
        if "same_call" in fig:  # figures of the same call whose files did not come back, as its log shows them
            peers.append(fig["same_call"])
        rows.append(f"| {fig['name']} | {d['wall_s']:.3f} | {d['output_tok_s']:,.0f} | {roof} | "
                    f"{'; '.join(peers) or '—'} | {link(run)} |")
    return rows


def serve_rows(figs) -> list[str]:
    def ms(stat: dict) -> str:
        return f"{stat['median']:.1f} / {stat['p99']:.1f}"

    rows = ["| figure | output tok/s | arrivals | TTFT ms (median / p99) | TPOT ms | ITL ms | completed | run |",
            "|---|---|---|---|---|---|---|---|"]
    for fig, run in figs:
        d, off = fig["file_data"], fig["offline_data"]
        # at rate inf the server's throughput is a fraction of the offline engine's in the same call
        arrivals = (f"all at once: **{100 * d['output_throughput'] / off['output_tok_s']:.1f}%** of the offline "
                    f"{off['output_tok_s']:,.0f} tok/s" if d["rate"] == float("inf")
                    else f"Poisson, {d['rate']:.1f} requests/s")
        rows.append(f"| {fig['name']} | {d['output_throughput']:,.0f} | {arrivals} | "
                    f"{ms(d['ttft_ms'])} | {ms(d['tpot_ms'])} | {ms(d['itl_ms'])} | "
                    f"{d['completed']} of {d['requests']} | {link(run)} |")
    return rows


def startup_rows(figs) -> list[str]:
    rows = ["| figure | seconds to /health 200 | run |", "|---|---|---|"]
    for fig, run in figs:
        rows.append(f"| {fig['name']} | " + "; ".join(f"{r['ready_s']:.1f} ({'cold' if r['cold'] else 'warm'})"
                                                       for r in fig["file_data"]) + f" | {link(run)} |")
    return rows


def quality_rows(figs) -> list[str]:
    rows = ["| weights | built-in model's perplexity | W-small logits: cosine / top-1 agreement with bf16 | "
            "W-large logits | run |", "|---|---|---|---|---|"]
    for fig, run in figs:
        d = fig["file_data"]
        for method, p in d["perplexity"].items():
            agree = [f"{d['logits'][w][method]['cosine']:.4f} / {100 * d['logits'][w][method]['top1_agreement']:.1f}%"
                     if method in d["logits"][w] else "(the reference)" for w in ("w-small", "w-large")]
            rows.append(f"| {'bf16' if method == 'none' else method} | {p['perplexity']:.2f} | {' | '.join(agree)} | "
                        f"{link(run)} |")
    return rows


def structured_rows(figs) -> list[str]:
    """scripts/structured_bench.py: jump-forward on vs off per batch; TPOT at batch 256 and at batch 1,
    constrained vs plain."""
    rows = ["| figure | measured | run |", "|---|---|---|"]
    for fig, run in figs:
        d = fig["file_data"]
        parts = []
        for b in sorted({int(k[1:].split("_")[0]) for k in d.get("jump", {}) if k.endswith("_on")}):
            off, on = d["jump"][f"b{b}_off"], d["jump"][f"b{b}_on"]
            parts.append(f"batch {b}: off {off['wall_s']:.3f} s, {off['steps']} steps; on {on['wall_s']:.3f} s, "
                         f"{on['steps']} steps ({on['jumped_tokens']} of {on['output_tokens']} tokens jumped): "
                         f"**{off['steps'] / on['steps']:.1f}× fewer steps, {off['wall_s'] / on['wall_s']:.2f}× "
                         f"faster**")
        if "tpot" in d:
            r = d["tpot"]["runs"]
            plain = [r[k]["tpot_ms"] for k in ("plain", "plain_again")]
            no_jump = "tpot_ratio_no_jump" in d["tpot"]  # (then the target is that ratio's: json_object's)
            parts.append(f"TPOT at batch ≥ 240: plain {plain[0]:.2f} / {plain[1]:.2f} ms, constrained "
                         f"{'with jump-forward ' if no_jump else ''}{r['json_string']['tpot_ms']:.2f} ms: "
                         f"**{d['tpot']['tpot_ratio']:.2f}×**{'' if no_jump else ' (target ≤ 1.10)'}; "
                         f"step() call {r['plain']['step_call_ms']:.1f} vs {r['json_string']['step_call_ms']:.1f} ms "
                         f"(the constrained one waits there for the step before's tokens)")
            if rounds := tpot_rounds(d):
                parts.append(f"each round in the same process: {rounds}")
            if no_jump:  # the same string with jump-forward's checks off
                rounds = tpot_rounds(d, "tpot_ratio_no_jump")
                parts.append(f"jump-forward off (json_object's default): {r['json_string_no_jump']['tpot_ms']:.2f} ms, "
                             f"**{d['tpot']['tpot_ratio_no_jump']:.2f}×** (target ≤ 1.10)"
                             + (f"; its rounds: {rounds}" if rounds else "")
                             + f"; json_object's own decode steps {r['json_object']['tpot_ms']:.2f} ms")
            base = fig.get("baseline_data", {}).get("tpot")
            if base:  # the same call's run of the commit before
                b = base["runs"]
                parts.append(f"beside {fig.get('baseline_commit', 'the base')} in the same call: constrained "
                             f"{b['json_string']['tpot_ms']:.2f} ms, **{base['tpot_ratio']:.2f}×**; json_object's own decode steps "
                             f"{r['json_object']['tpot_ms']:.2f} ms against {b['json_object']['tpot_ms']:.2f} ms")
                if "tpot_ratio_no_jump" in base:
                    parts.append(f"{fig.get('baseline_commit', 'the base')} with jump-forward off: "
                                 f"{b['json_string_no_jump']['tpot_ms']:.2f} ms, **{base['tpot_ratio_no_jump']:.2f}×**")
                if rounds := tpot_rounds(fig["baseline_data"]):
                    parts.append(f"its rounds: {rounds}")
        if "latency" in d:
            lat = d["latency"]
            parts.append(f"batch 1, one request at a time: plain {lat['plain']['tpot_ms']:.2f} ms; inside a JSON string "
                         f"without jump-forward, the grammar process {lat['json_string_no_jump']['tpot_ms']:.2f} ms "
                         f"(**{lat['json_string_no_jump_ratio']:.2f}×**), in the engine's process "
                         f"{lat['json_string_no_jump_in_process']['tpot_ms']:.2f} ms "
                         f"({lat['json_string_no_jump_in_process_ratio']:.2f}×); with jump-forward "
                         f"{lat['json_string']['tpot_ms']:.2f} ms ({lat['json_string_ratio']:.2f}×)")
        rows.append(f"| {fig['name']} | {'<br>'.join(parts)} | {link(run)} |")
    return rows


def tpot_rounds(d: dict, ratio: str = "tpot_ratio") -> str:
    """The ratios (`ratio`) of a structured_bench run's tpot rounds (`--switch-intervals`: each
    measured again under a sys.setswitchinterval), with their mean at the default 5 ms; "" for a
    single round."""
    rounds = [(k, v[ratio]) for k, v in d.items() if k.startswith("tpot_switch_") and ratio in v]
    if not rounds:
        return ""
    default = [d["tpot"][ratio]] + [r for k, r in rounds if abs(float(k[12:]) - 0.005) < 1e-6]
    labelled = [f"{d['tpot'][ratio]:.2f}×"] + [f"{r:.2f}× ({float(k[12:]) * 1e3:.0f} ms interval)"
                                               for k, r in rounds]
    return f"{', '.join(labelled)}; mean at 5 ms {sum(default) / len(default):.2f}×"


def speculative_rows(figs) -> list[str]:
    """scripts/spec_bench.py: a verify step's cost, n-gram speed-up at batch 1, throughput under load."""
    rows = ["| figure | measured | run |", "|---|---|---|"]
    for fig, run in figs:
        d = fig["file_data"]
        if "modes" in fig:  # the figure shows only these of its file's modes (a later run has the others)
            d = {mode: d[mode] for mode in fig["modes"] if mode in d}
        parts = []
        for b, r in d.get("verify", {}).items():
            parts.append(f"8B shape, {b}: a step checking 4 drafts {r['on']['ms_per_step']:.2f} ms, one waiting for the "
                         f"step before with nothing to check {r['sync']['ms_per_step']:.2f} ms, a plain decode step "
                         f"{r['off']['ms_per_step']:.2f} ms: **{r['on']['step_cost_ratio']:.2f}×** (target ≤ 1.2), of "
                         f"which {r['sync']['step_cost_ratio']:.2f}× the lost overlap")
        for b, r in d.get("ngram", {}).items():
            on = r["on"]
            parts.append(f"built-in model, copy-heavy prompts, {b}: TPOT {r['off']['tpot_ms']:.2f} → {on['tpot_ms']:.2f} ms, "
                         f"**{on['speedup']:.2f}×**; {on['verify_steps']} of {on['steps']} steps checked drafts, "
                         f"{on.get('tokens_per_verify_step', 1):.2f} tokens each")
        pair = d.get("pair", {})
        if pair:
            t, dr = pair["target"], pair.get("draft")
            if dr and dr.get("teacher"):
                draft = (f"a {dr['parameters'] / 1e6:.0f}M draft distilled from it (held-out perplexity "
                         f"{dr['heldout_perplexity']:.1f}, its argmax the target's at "
                         f"{100 * dr['heldout_argmax_agreement']:.0f}% of held-out positions)")
            else:
                draft = "the built-in model as its draft"
            k = f", k = {pair['num_speculative_tokens']}" if "num_speculative_tokens" in pair else ""
            copies = (f", {100 * t['copies']:.0f}% of its training sequences repeating a passage (its argmax copies "
                      f"{100 * t['heldout_copied']:.0f}% of a repeated held-out passage)") if t.get("copies") else ""
            parts.append(f"trained target ({t['parameters'] / 1e6:.0f}M, held-out perplexity {t['heldout_perplexity']:.1f}{copies}), "
                         f"{draft}{k}:")
        for key, label in (("draft_b1", "draft, batch 1, greedy"), ("draft_b1_sampled", "draft, batch 1, T 0.7"),
                           ("draft_b1_drawn", "draft, batch 1, T 0.7 unseeded (drafts drawn)"),
                           ("draft_b8", "draft, batch 8"), ("ngram_b1", "n-gram, batch 1, copy-heavy"),
                           ("ngram_b1_copy", "n-gram, batch 1, the answer repeating the prompt")):
            if key in pair:
                on = pair[key]["on"]
                parts.append(f"{label}: TPOT {pair[key]['off']['tpot_ms']:.2f} → {on['tpot_ms']:.2f} ms, **{on['speedup']:.2f}×**; "
                             f"{on['verify_steps']} steps checked drafts, {on['kept_tokens']} of {on['draft_tokens']} kept")
        for b, r in d.get("load", {}).items():
            on = r["on"]
            stopped = (f"; configured, its controller held stopped: {r['stopped']['speedup']:.3f}"
                       if "stopped" in r else "")
            parts.append(f"W-small's model and requests, {b}, proposals allowed: throughput on / off **{on['speedup']:.3f}** "
                         f"({on['verify_steps']} steps checked drafts){stopped}")
        rows.append(f"| {fig['name']} | {'<br>'.join(parts)} | {link(run)} |")
    return rows


def cascade_rows(figs) -> list[str]:
    """scripts/cascade_bench.py: cascade against the plain decode kernel, one layer; with --sweep,
    how often the cost model picked the faster."""
    rows = ["| figure | measured | run |", "|---|---|---|"]
    for fig, run in figs:
        d = fig["file_data"]
        parts = [f"batch {r['batch']}, {r['groups']} group(s), {r['prefix']:,}-token prefix, {r['suffix']} own tokens, "
                 f"{r['heads']} query / {r['kv_heads']} KV heads: plain {r['plain_us']:.0f} µs, cascade "
                 f"{r['cascade_us']:.0f} µs: **{r['speedup']:.1f}×**" for r in d["rows"] if r["prefix"] >= 32768]
        if "cost_model_right" in d:
            wins = sum(r["speedup"] > 1 for r in d["rows"])
            parts.append(f"{len(d['rows'])} decode layouts (batch 2-256, 1 or 8 groups, prefixes 32-8,192, 16 and 32 "
                         f"query heads over 8 KV heads): cascade faster in {wins}; the cost model picked the faster "
                         f"path in **{100 * d['cost_model_right']:.0f}%**")
        rows.append(f"| {fig['name']} | {'<br>'.join(parts)} | {link(run)} |")
    return rows


def moe_rows(figs) -> list[str]:
    """scripts/moe_bench.py: one MoE layer by token count, the fused kernel against a per-expert
    loop of GEMMs and transformers' grouped_mm experts, with the layer's roofline."""
    rows = ["| figure | tokens | experts read | fused µs | of roofline | per-expert loop µs | transformers grouped_mm "
            "µs | run |", "|---|---|---|---|---|---|---|---|"]
    for fig, run in figs:
        for r in fig["file_data"]["rows"]:
            hf = r.get("hf_grouped_mm_us")
            hf_cell = "—" if hf is None else f"{hf:,.0f} (**{hf / r['fused_us']:.1f}×**)"
            fused = f"{r['fused_us']:.1f}"
            if "direct_us" in r:  # both paths of a few tokens
                fused += f" (a program per pair {r['direct_us']:.1f}, sorted {r['sorted_us']:.1f})"
            rows.append(f"| {fig['name']} | {r['tokens']:,} | {r['experts_picked']} | {fused} | "
                        f"{100 * r['roofline_fraction']:.0f}% of {r['roofline_us']:.1f} | "
                        f"{r['per_expert_loop_us']:,.0f} (**{r['speedup_over_loop']:.0f}×**) | {hf_cell} | {link(run)} |")
    return rows


def parallel_rows(figs) -> list[str]:
    """Several GPUs: each run beside its baseline of the same call (one GPU, one replica), as a
    ratio of output throughputs; offline runs (bench throughput) and served ones (bench serve) alike."""
    def tok_s(d: dict) -> float:
        return d["output_throughput"] if "output_throughput" in d else d["output_tok_s"]

    def measured(d: dict) -> str:
        if "output_throughput" in d:
            return f"{d['output_throughput']:,.0f} tok/s served, TPOT median {d['tpot_ms']['median']:.1f} ms"
        return (f"{d['wall_s']:.3f} s, {d['output_tok_s']:,.0f} tok/s "
                f"({1e3 * d['wall_s'] / d['output_tokens']:.2f} ms a token)")

    rows = ["| figure | measured | against, in the same call | run |", "|---|---|---|---|"]
    for fig, run in figs:
        d, b = fig["file_data"], fig.get("baseline_data")
        parts = [f"{fig['baseline_label']}: {measured(b)}: **{tok_s(d) / tok_s(b):.2f}×**"] if b else []
        if "same_call" in fig:
            parts.append(fig["same_call"])
        rows.append(f"| {fig['name']} | {measured(d)} | {'; '.join(parts) or '—'} | {link(run)} |")
    return rows


def render(runs: list[dict]) -> str:
    figs = latest_figures(runs)
    parts = []
    for title, key, rows in (("Offline throughput", "offline", offline_rows), ("Serving", "serve", serve_rows),
                             ("Start-up", "startup", startup_rows), ("Quantization quality", "quality", quality_rows),
                             ("Structured outputs", "structured", structured_rows),
                             ("Speculative decoding", "speculative", speculative_rows),
                             ("Cascade attention", "cascade", cascade_rows), ("Mixture of experts", "moe", moe_rows),
                             ("Several GPUs", "parallel", parallel_rows)):
        if key in figs:
            parts.append(f"### {title}\n\n" + "\n".join(rows(figs[key])))
    behind = {run["id"] for shown in figs.values() for _, run in shown}
    index = ["| run | time | device | commit | command | what |", "|---|---|---|---|---|---|"]
    for run in reversed(runs):
        if run["id"] in behind:
            index.append(f"| {link(run)} | {run['time']:%Y-%m-%d %H:%M} | {run['device']} | {run['commit']} | "
                         f"`{run['command']}` | {run['what']} |")
    parts.append("### Runs\n\nThe calls behind the figures above, newest first. Every other call's files and "
                 "run.toml stay in its folder under `benchmarks/results/`.\n\n" + "\n".join(index))
    return "\n\n".join(parts)


def replace_section(page: str, body: str) -> str:
    head, sep, rest = page.partition(BEGIN)
    if not sep or END not in rest:
        raise SystemExit(f"the page lacks the marker lines {BEGIN!r} and {END!r}")
    return f"{head}{BEGIN}\n\n{body}\n\n{END}{rest.split(END, 1)[1]}"


def main() -> None:
    ap = argparse.ArgumentParser(description="Render BENCHMARKS.md's tables from benchmarks/results/.")
    ap.add_argument("--page", type=Path, default=ROOT / "BENCHMARKS.md")
    ap.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--check", action="store_true", help="exit 1 if the page's tables differ from the files")
    args = ap.parse_args()
    page = args.page.read_text()
    new = replace_section(page, render(load_runs(args.results)))
    if args.check:
        if new != page:
            sys.exit(f"{args.page} is not current: run python scripts/bench_page.py")
        print(f"{args.page} is current")
    elif new != page:
        args.page.write_text(new)
        print(f"{args.page} rewritten")


if __name__ == "__main__":
    main()
