"""The bf16 matmul rate as the roofline measures it (ten 8,192^3 products after three warm-up ones,
~15 ms) against the rate the device keeps up for many seconds, as a compute-bound run such as
W-large's mixed steps asks of it; with the SM clock and board power read by nvidia-smi around each
window. If the board slows down at its power limit, the short burst overstates what any engine
can sustain, and the roofline's compute part is that much out of reach.

    python scripts/sustained_matmul.py [--seconds 20] [--json out.json]
"""

import argparse
import subprocess
import time

import torch

from llmserve.bench.report import report
from llmserve.bench.throughput import measure_device


def smi() -> dict:
    fields = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
    out = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.strip().split(", ")
    return dict(zip(("sm_mhz", "watts", "celsius", "throttle"), out))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [{"window": "roofline's burst", "tflop_s": measure_device()["bf16_flop_per_s"] / 1e12, **smi()}]
    print(rows[-1], flush=True)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    flop = 2 * 8192**3
    begin = time.perf_counter()
    while time.perf_counter() - begin < args.seconds:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(500):  # ~0.75 s at ~750 TFLOP/s
            a @ b
        end.record()
        torch.cuda.synchronize()
        rows.append({"window": round(time.perf_counter() - begin, 2),
                     "tflop_s": 500 * flop / (start.elapsed_time(end) / 1e3) / 1e12, **smi()})
        print(rows[-1], flush=True)
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
