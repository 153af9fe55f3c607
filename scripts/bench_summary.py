"""One run's JSON from `llmserve bench throughput`, summarised in two lines (a third for rank 0's
own steps under tensor parallelism; three more with -v: the steps the device waited longest for).

    python scripts/bench_summary.py [-v] RESULT.json ...
"""

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser(description="Summarise `llmserve bench throughput` results, two lines each.")
    ap.add_argument("-v", "--verbose", action="store_true", help="also the steps the device waited longest for")
    ap.add_argument("results", nargs="+", metavar="RESULT.json")
    args = ap.parse_args()
    for path in args.results:
        r = json.load(open(path))
        d = r["decode_steps"]
        held = (f" ({100 * r['roofline_sustained_fraction']:.1f}% at the sustained matmul rate)"
                if "roofline_sustained_fraction" in r else "")
        busy = (f", device busy {d['device_busy_s']:.3f} s ({100 * d['device_busy_fraction']:.1f}%)"
                if "device_busy_s" in d else "")
        print(f"{path.rsplit('/', 1)[-1]}: {r['wall_s']:.3f} s, {r['output_tok_s']:.0f} tok/s, "
              f"{100 * r.get('roofline_fraction', 0):.1f}% of roofline{held}{busy}, start-up {r['startup_s']:.1f} s, "
              f"GC {r['stalls']['gc']['ms']:.0f} ms" + (f", cascade steps {r['cascade_steps']}" if r.get('cascade_steps') else ""))
        for who, steps in [("", d), ("rank 0 ", d.get("rank0"))]:
            if not steps:
                continue
            print(f"   {who}" + "; ".join(f"{b['steps']}: {b['count']} in {b['total_s']:.3f} s"
                                      + (f" (device {b['device_s']:.3f}, idle {b['idle_s']:.3f})" if "device_s" in b else "")
                                      + f" launch {b['launch_ms']:.1f} ms" for b in steps["by_batch"])
                  + (f"; between steps {steps['between_ms']:.2f} ms" if "between_ms" in steps else ""))
        for row in d.get("most_idle", [])[:3] if args.verbose else []:
            print("    idle before", {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})


if __name__ == "__main__":
    main()
