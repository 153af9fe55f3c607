"""What a Triton kernel compiles to on an H100, without a GPU: registers, stack (spills), shared
memory, and the machine instructions of each loop's iteration, per warp, by kind.

    python scripts/sass_stats.py [--base REV] [--json out.json] [VARIANT ...]

Each VARIANT is a paged-attention launch as `prefill|decode[,key=value...]` with keys group,
block_m, block_n, warps, stages, splits, fp8 (0/1), fp32 (0/1: float32 queries and cache, as the
GPU equivalence tests run) and maxnreg, e.g. `prefill,block_m=128,warps=8`;
none: the engine's default tiles for W-small's and W-large's heads. The kernel is compiled for
sm_90 by the installed Triton (ptxas and nvdisasm ship with it) with the argument alignment the
JIT would specialize on, then disassembled; `--base REV` compiles that revision's kernels/ too,
for a side-by-side. Compile with the GPU box's Triton (3.6: `pip install triton==3.6.0` into a
venv with torch==2.13.0 and numpy) to see what the box runs.

A kernel bound by issuing instructions (softmax arithmetic between tensor-core ops) gets faster
roughly as its loop gets shorter; one bound by memory or latency need not. Occupancy follows from
registers (65,536 per SM, allocated per warp in steps of 8 a thread) and shared memory (227 KB).
Timings only come from the GPU (attention_bench.py); this says why, and what a change did to the code.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parent.parent
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INT_POINTERS = {"block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr", "seq_order_ptr", "kv_start_ptr", "levels_ptr"}
F32_POINTERS = {"k_scale_ptr", "v_scale_ptr", "part_ptr", "ml_ptr"}


def load_kernels(kernels_dir: Path) -> types.ModuleType:
    """kernels_dir/paged_attention.py as llmserve.kernels.paged_attention, without importing the
    rest of llmserve (a fresh module each call, so two revisions can sit side by side)."""
    for name in [m for m in sys.modules if m == "llmserve" or m.startswith("llmserve.")]:
        del sys.modules[name]
    package, kernels = types.ModuleType("llmserve"), types.ModuleType("llmserve.kernels")
    package.__path__, kernels.__path__ = [], [str(kernels_dir)]
    sys.modules["llmserve"], sys.modules["llmserve.kernels"] = package, kernels
    return importlib.import_module("llmserve.kernels.paged_attention")


def variant(spec: str) -> dict:
    kind, *pairs = spec.split(",")
    assert kind in ("prefill", "decode"), spec
    v = {"decode": kind == "decode", "group": 2, "block_m": None, "block_n": None, "warps": None, "stages": None,
         "splits": 1, "fp8": 0, "fp32": 0, "maxnreg": None}
    for pair in pairs:
        key, value = pair.split("=")
        assert key in v, f"unknown key {key!r} in {spec!r}"
        v[key] = int(value)
    return v


def compile_paged_attention(module: types.ModuleType, v: dict):
    """The kernel compiled for sm_90 with the host wrapper's constants for variant v; (kernel, sass)."""
    fn = module._paged_attention_kernel
    fp8, fp32 = bool(v["fp8"]), bool(v["fp32"])
    act = "*fp32" if fp32 else "*bf16"
    if v["decode"]:
        tiles = module.decode_tiles(fp8)
    else:  # (revisions before prefill_tiles had one constant)
        tiles = module.prefill_tiles(fp32) if hasattr(module, "prefill_tiles") else module.PREFILL_TILES
    block_n, warps, stages = (v["block_n"] or tiles[0]), (v["warps"] or tiles[1]), (v["stages"] or tiles[2])
    default_m = ("DECODE_BLOCK_M", 16) if v["decode"] else ("PREFILL_BLOCK_M", 64)  # (revisions before the names)
    block_m = max(v["block_m"] or getattr(module, *default_m), v["group"])
    consts = dict(BLOCK_SIZE=16, GROUP=v["group"], GROUP_P=v["group"], HEAD_D=128, HEAD_P=128,
                  BLOCK_Q=block_m // v["group"], BLOCK_N=block_n, PRECISION="ieee" if fp32 else "tf32", FP8=fp8,
                  DOT_TY=tl.float32 if fp32 else tl.float16,
                  NUM_SPLITS=v["splits"], DECODE=v["decode"], ORDERED=v["decode"],
                  SEQS_P=0 if v["decode"] else 256, PDL=True,
                  CASCADE=False, NUM_SLOTS=v["splits"], SLOT0=0, PREFIX_SPLITS=0, WINDOW=0, SOFTCAP=0.0)  # (plain attention)
    names = list(fn.arg_names)
    consts = {k: c for k, c in consts.items() if k in names}
    unspecialized = {names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    signature = {}
    for n in names:
        if n in consts:
            signature[n] = "constexpr"
        elif n in ("k_cache_ptr", "v_cache_ptr"):
            signature[n] = "*fp8e4nv" if fp8 else act
        elif n.endswith("_ptr"):
            signature[n] = "*i32" if n in INT_POINTERS else "*fp32" if n in F32_POINTERS else act
        else:
            signature[n] = "fp32" if n == "scale" else "i32"
    # What the JIT assumes of a real launch: 16-byte aligned pointers, strides divisible by 16.
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n not in consts and n not in unspecialized and signature[n] != "fp32"}
    source = ASTSource(fn, signature, {(names.index(k),): c for k, c in consts.items()}, attrs)
    options = {"num_warps": warps, "num_stages": stages}
    if v["maxnreg"]:
        options["maxnreg"] = v["maxnreg"]
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(TOOLS / "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(TOOLS / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return {"block_m": block_m, "block_n": block_n, "warps": warps, "stages": stages, "regs": regs, "stack": stack,
            "shared": kernel.metadata.shared}, sass


def loops(sass: str) -> list[collections.Counter]:
    """Instruction kinds of each loop body (a backward branch's span), in program order."""
    code, labels, pending = [], {}, None
    for line in sass.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            pending = label.group(1)
            continue
        ins = re.search(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);", line)
        if ins:
            addr = int(ins.group(1), 16)
            if pending:
                labels[pending], pending = addr, None
            code.append((addr, ins.group(2).split(".")[0], ins.group(3)))
    bodies = []
    for addr, op, rest in code:
        target = re.search(r"`\(\.(L_x_\d+)\)", rest) if op == "BRA" else None
        start = labels.get(target.group(1)) if target else None
        if start is not None and start < addr:
            bodies.append(collections.Counter(o for a, o, _ in code if start <= a <= addr))
    return bodies


def programs_per_sm(row: dict) -> int:
    regs_per_warp = -(-row["regs"] // 8) * 8 * 32
    by_regs = 65536 // (regs_per_warp * row["warps"])
    by_shared = (227 * 1024) // max(row["shared"], 1)
    return min(by_regs, by_shared)


KINDS = ("HGMMA", "HMMA", "MUFU", "FFMA", "FMUL", "FADD", "FSEL", "FMNMX", "ISETP", "IMAD", "LDGSTS", "SHFL")


def describe(module: types.ModuleType, spec: str) -> dict:
    row, sass = compile_paged_attention(module, variant(spec))
    row["programs_per_sm"] = programs_per_sm(row)
    row["loops"] = [{"instructions": sum(body.values()), **{k: body[k] for k in KINDS if body[k]}} for body in loops(sass)
                    if sum(body.values()) > 1]
    return row


def base_kernels(rev: str, into: Path) -> Path:
    for name in ("paged_attention.py", "hardware.py"):
        text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:kernels/{name}"], capture_output=True,
                              text=True, check=True).stdout
        (into / name).write_text(text)
    return into


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="*")
    ap.add_argument("--base", help="also compile this git revision's kernels")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # the JIT's default on the box
    specs = args.variants or ["prefill,group=2", "prefill,group=4", "decode,group=2", "decode,group=2,splits=2"]
    sides = [("tree", ROOT / "kernels")]
    with tempfile.TemporaryDirectory() as tmp:
        if args.base:
            sides.append((args.base, base_kernels(args.base, Path(tmp))))
        rows = []
        for side, kernels_dir in sides:
            module = load_kernels(kernels_dir)
            for spec in specs:
                row = {"kernels": side, "variant": spec, "triton": triton.__version__, **describe(module, spec)}
                rows.append(row)
                loops_text = "; ".join(" ".join(f"{k}={n}" for k, n in loop.items()) for loop in row["loops"])
                print(f"{side:>10} {spec:<34} regs {row['regs']:>3} stack {row['stack']:>4} shared {row['shared']:>6} "
                      f"programs/SM {row['programs_per_sm']}  loops: {loops_text}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
