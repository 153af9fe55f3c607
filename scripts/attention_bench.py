"""Decode attention with a bf16 vs an FP8 KV cache (GPU): time per call and KV bytes read per second.

    python scripts/attention_bench.py [--json out.json] [--sweep] [--splits] [--prefill] [--mixed]

W-small's attention shape (16 query heads, 8 KV heads, head_dim 128, blocks of 16), a decode step
of `batch` requests with `context` cached tokens each, blocks scattered over the pool; each shape
also without split-KV (one pass per sequence). --splits instead times mid-size batches (W-small's
middle phase) with 1, 2, 4 and 8 key slices per sequence, against the split count chosen by default.
--prefill times prefill steps (8 prompts of 1,024 tokens; W-small's and W-large's heads) for every
(BLOCK_M, BLOCK_N, warps, stages), in TFLOP/s of causal attention. --mixed times a W-large mixed step
(8 prompts of 1,024 tokens plus 248 decoding requests with ~1,100 cached tokens) in one launch
against its prefill and decode rows launched apart. --layout times decode (every tile) and prefill
with the cache laid out as the engine allocates it, [blocks, block_size, kv_heads, dim], against
head-major blocks, [blocks, kv_heads, block_size, dim] (a block's keys of one head contiguous),
passed to the same kernel as a strided view.
"""

import argparse
import itertools
import json

import torch
import triton

from llmserve.bench.report import report
from llmserve.kernels.paged_attention import paged_attention
from llmserve.kernels.reference import quantize_kv_reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true", help="also time every (BLOCK_N, warps, stages)")
    ap.add_argument("--splits", action="store_true", help="mid-size batches at 1, 2, 4, 8 key slices")
    ap.add_argument("--prefill", action="store_true", help="prefill tile sweep")
    ap.add_argument("--mixed", action="store_true", help="a mixed step in one launch vs prefill and decode apart")
    ap.add_argument("--layout", action="store_true", help="token-major vs head-major cache blocks")
    args = ap.parse_args()
    if args.layout:
        return layout_compare(args.json)
    if args.splits:
        return split_sweep(args.json)
    if args.prefill:
        return prefill_sweep(args.json)
    if args.mixed:
        return mixed_step(args.json)
    rows = []
    heads, kv_heads, dim, bs = 16, 8, 128, 16
    for batch, context in [(256, 512), (256, 1024), (64, 2048), (8, 4096), (2, 2048), (1, 8192)]:
        blocks = batch * context // bs
        perm = torch.randperm(blocks, device="cuda", dtype=torch.int32)
        tables = perm.view(batch, context // bs)
        k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        (kq, ks), (vq, vs) = quantize_kv_reference(k), quantize_kv_reference(v)
        q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
        qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
        lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
        bf16 = triton.testing.do_bench(lambda: paged_attention(q, k, v, tables, qsl, lens, 0.088, 1))
        fp8 = triton.testing.do_bench(lambda: paged_attention(q, kq, vq, tables, qsl, lens, 0.088, 1,
                                                              k_scale=ks, v_scale=vs))
        # split-KV (on by default for small batches) against one pass over each sequence
        no_split = triton.testing.do_bench(lambda: paged_attention(q, k, v, tables, qsl, lens, 0.088, 1, num_splits=1))
        no_split_fp8 = triton.testing.do_bench(lambda: paged_attention(q, kq, vq, tables, qsl, lens, 0.088, 1,
                                                                       k_scale=ks, v_scale=vs, num_splits=1))
        sweep = {}
        if args.sweep:
            for tiles in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
                for name, kv in (("bf16", (k, v, None, None)), ("fp8", (kq, vq, ks, vs))):
                    try:
                        sweep[f"{name} {tiles}"] = triton.testing.do_bench(lambda: paged_attention(
                            q, kv[0], kv[1], tables, qsl, lens, 0.088, 1, k_scale=kv[2], v_scale=kv[3], tiles=tiles))
                    except Exception:  # out of resources
                        pass
        kv_bytes = 2 * batch * context * kv_heads * dim
        row = {"batch": batch, "context": context, "bf16_ms": bf16, "fp8_ms": fp8, "fp8_speedup": bf16 / fp8,
               "bf16_one_pass_ms": no_split, "fp8_one_pass_ms": no_split_fp8,
               "bf16_gb_s": 2 * kv_bytes / bf16 / 1e6, "fp8_gb_s": (kv_bytes + 2 * batch * context * kv_heads * 4) / fp8 / 1e6}
        for name in ("bf16", "fp8"):
            mine = {t: ms for t, ms in sweep.items() if t.startswith(name)}
            if mine:
                row[f"{name}_best"] = min(mine, key=mine.get)
                row[f"{name}_best_ms"] = min(mine.values())
        rows.append(row)
        print(json.dumps(row), flush=True)
    report(rows, args.json, echo=False)  # each row was printed as it came


def decode_inputs(batch: int, context: int, heads: int = 16, kv_heads: int = 8, dim: int = 128, bs: int = 16):
    blocks = batch * -(-context // bs)
    tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(batch, -1)
    k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return q, k, torch.randn_like(k), tables, qsl, lens


def split_sweep(json_path: str | None) -> None:
    from llmserve.kernels.paged_attention import decode_splits
    rows = []
    for batch, context in [(192, 1000), (128, 1200), (96, 1300), (64, 1400), (48, 1500), (32, 1600), (16, 1800)]:
        q, k, v, tables, qsl, lens = decode_inputs(batch, context)
        kv_bytes = 2 * batch * context * 8 * 128 * 2
        row = {"batch": batch, "context": context, "default_splits": decode_splits(batch, 8, q.device)}
        for splits in (1, 2, 4, 8):
            ms = triton.testing.do_bench(lambda: paged_attention(q, k, v, tables, qsl, lens, 0.088, 1, num_splits=splits))
            row[f"splits{splits}_us"], row[f"splits{splits}_gb_s"] = 1e3 * ms, kv_bytes / ms / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)
    report(rows, json_path, echo=False)


def prefill_sweep(json_path: str | None) -> None:
    from llmserve.kernels.paged_attention import PREFILL_TILES
    rows = []
    seqs, length, dim, bs = 8, 1024, 128, 16
    for name, heads, kv_heads in (("w-small", 16, 8), ("w-large", 32, 8)):
        blocks = seqs * length // bs
        tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(seqs, -1)
        k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(seqs * length, heads, dim, device="cuda", dtype=torch.bfloat16)
        qsl = torch.arange(0, seqs * length + 1, length, device="cuda", dtype=torch.int32)
        lens = torch.full((seqs,), length, device="cuda", dtype=torch.int32)
        flops = 4 * seqs * (length * (length + 1) / 2) * dim * heads
        row = {"shape": name, "default": list(PREFILL_TILES)}
        for block_m, tiles in itertools.product((64, 128), itertools.product((32, 64, 128), (4, 8), (2, 3, 4))):
            try:
                ms = triton.testing.do_bench(lambda: paged_attention(q, k, v, tables, qsl, lens, 0.088, length,
                                                                     tiles=tiles, block_m=block_m))
            except Exception:  # out of resources
                continue
            row[f"m{block_m} {tiles}"] = flops / ms / 1e9
        best = max((key for key in row if key.startswith("m")), key=row.get)
        row["best"], row["best_tflop_s"] = best, row[best]
        row["default_tflop_s"] = row.get(f"m64 {tuple(PREFILL_TILES)}")
        rows.append(row)
        print(json.dumps({key: row[key] for key in ("shape", "best", "best_tflop_s", "default_tflop_s")}), flush=True)
    report(rows, json_path, echo=False)


def head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values with each block's heads outermost in memory, viewed in the kernel's order."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def layout_compare(json_path: str | None) -> None:
    rows = []
    for batch, context in [(256, 1024), (128, 1200), (48, 1500), (16, 1800), (4, 2000)]:
        q, k, v, tables, qsl, lens = decode_inputs(batch, context)
        kh, vh = head_major(k), head_major(v)
        kv_bytes = 2 * batch * context * 8 * 128 * 2
        row = {"batch": batch, "context": context}
        for name, (kc, vc) in (("nhd", (k, v)), ("hnd", (kh, vh))):
            row[f"{name}_default_us"] = 1e3 * triton.testing.do_bench(
                lambda: paged_attention(q, kc, vc, tables, qsl, lens, 0.088, 1))
            for tiles in itertools.product((32, 64, 128), (4, 8), (3, 4)):
                try:
                    row[f"{name} {tiles}"] = 1e3 * triton.testing.do_bench(
                        lambda: paged_attention(q, kc, vc, tables, qsl, lens, 0.088, 1, tiles=tiles))
                except Exception:  # out of resources
                    pass
            best = min((key for key in row if key.startswith(f"{name} ")), key=row.get)
            row[f"{name}_best"], row[f"{name}_best_us"] = best, row[best]
            row[f"{name}_default_tb_s"] = kv_bytes / row[f"{name}_default_us"] / 1e6
        rows.append(row)
        print(json.dumps({key: (round(val, 2) if isinstance(val, float) else val) for key, val in row.items()
                          if not key.startswith(("nhd ", "hnd "))}), flush=True)
    seqs, length = 8, 1024
    for name, heads in (("w-small", 16), ("w-large", 32)):
        q, k, v, tables, _, _ = decode_inputs(seqs, length, heads=heads)
        q = torch.randn(seqs * length, heads, 128, device="cuda", dtype=torch.bfloat16)
        qsl = torch.arange(0, seqs * length + 1, length, device="cuda", dtype=torch.int32)
        lens = torch.full((seqs,), length, device="cuda", dtype=torch.int32)
        flops = 4 * seqs * (length * (length + 1) / 2) * 128 * heads
        row = {"prefill": name}
        for layout, (kc, vc) in (("nhd", (k, v)), ("hnd", (head_major(k), head_major(v)))):
            row[f"{layout}_tflop_s"] = flops / triton.testing.do_bench(
                lambda: paged_attention(q, kc, vc, tables, qsl, lens, 0.088, length)) / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    report(rows, json_path, echo=False)


def mixed_step(json_path: str | None) -> None:
    rows = []
    dim, bs = 128, 16
    for name, heads, kv_heads in (("w-small", 16, 8), ("w-large", 32, 8)):
        q_lens = [1024] * 8 + [1] * 248
        ctx = [0] * 8 + [1024 + (i * 7) % 128 for i in range(248)]
        seq_lens = [c + q for c, q in zip(ctx, q_lens)]
        width = max(-(-n // bs) for n in seq_lens)
        blocks = len(seq_lens) * width
        tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(len(seq_lens), width)
        k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(sum(q_lens), heads, dim, device="cuda", dtype=torch.bfloat16)
        qsl = torch.tensor([0, *itertools.accumulate(q_lens)], device="cuda", dtype=torch.int32)
        lens = torch.tensor(seq_lens, device="cuda", dtype=torch.int32)
        one = triton.testing.do_bench(lambda: paged_attention(q, k, v, tables, qsl, lens, 0.088, 1024))
        pre_q, dec_q = q[:8 * 1024], q[8 * 1024:]
        pre_qsl, dec_qsl = qsl[:9], qsl[8:] - 8 * 1024
        prefill = triton.testing.do_bench(lambda: paged_attention(pre_q, k, v, tables[:8], pre_qsl, lens[:8], 0.088,
                                                                  1024))
        decode = triton.testing.do_bench(lambda: paged_attention(dec_q, k, v, tables[8:], dec_qsl, lens[8:], 0.088, 1))
        decode_kv_gb = 2 * sum(ctx) * kv_heads * dim * 2 / 1e9
        row = {"shape": name, "one_launch_ms": one, "prefill_ms": prefill, "decode_ms": decode,
               "apart_ms": prefill + decode, "decode_kv_gb": decode_kv_gb, "decode_tb_s": decode_kv_gb / decode}
        rows.append(row)
        print(json.dumps(row), flush=True)
    report(rows, json_path, echo=False)


if __name__ == "__main__":
    main()
