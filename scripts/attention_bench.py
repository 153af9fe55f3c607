"""Decode attention with a bf16 vs an FP8 KV cache (GPU): time per call and KV bytes read per second.

    python scripts/attention_bench.py [--json out.json] [--sweep] [--splits] [--prefill] [--mixed] [--layout]
                                      [--ceiling] [--heads]

W-small's attention shape (16 query heads, 8 KV heads, head_dim 128, blocks of 16), a decode step
of `batch` requests with `context` cached tokens each, blocks scattered over the pool; each shape
also without split-KV (one pass per sequence). --splits instead times W-small's decode batches from the
middle of the run to its tail (ragged contexts, longest first) with 1 to 16 key slices per sequence
and several decode tiles, against the default choice.
--prefill times prefill steps (8 prompts of 1,024 tokens; W-small's and W-large's heads) for every
(BLOCK_M, BLOCK_N, warps, stages) (--quick: 8 of them), in TFLOP/s of causal attention. --mixed times a W-large mixed step
(8 prompts of 1,024 tokens plus 248 decoding requests with ~1,100 cached tokens) in one launch
against its prefill and decode rows launched apart. --layout times decode (every tile) and prefill
with the cache laid out as the engine allocates it, [blocks, block_size, kv_heads, dim], against
head-major blocks, [blocks, kv_heads, block_size, dim] (a block's keys of one head contiguous),
passed to the same kernel as a strided view. --ceiling measures what the device reads at best (a
copy, a plain streaming read, the decode kernel's gather without its arithmetic) and times decode
tiles on uniform batches and on W-small's real decode batches in request order and longest first.
--heads times that gather with 1, 2 or 4 adjacent KV heads a program (longer contiguous rows,
fewer programs) on a uniform batch and W-small's ragged ones, against the decode kernel.
--references times --prefill's shapes with the engine's kernel (its default tiles) against
torch's scaled_dot_product_attention on contiguous [8, heads, 1,024, 128] tensors with each of
its fused backends (FlashAttention-2, cuDNN, memory-efficient): what a prefill kernel reaches on
this device, in TFLOP/s of causal attention.
"""

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl

from graph_timing import graph_us
from llmserve.bench.report import report
from llmserve.kernels.paged_attention import paged_attention
from llmserve.kernels.reference import quantize_kv_reference


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--sweep", action="store_true", help="also time every (BLOCK_N, warps, stages)")
    ap.add_argument("--splits", action="store_true", help="mid-size batches at 1, 2, 4, 8 key slices")
    ap.add_argument("--prefill", action="store_true", help="prefill tile sweep")
    ap.add_argument("--quick", action="store_true", help="--prefill: 8 tile choices and the default, not 36")
    ap.add_argument("--fp8", action="store_true", help="--prefill: an FP8 cache")
    ap.add_argument("--mixed", action="store_true", help="a mixed step in one launch vs prefill and decode apart")
    ap.add_argument("--references", action="store_true", help="prefill: the engine's kernel vs torch's SDPA backends")
    ap.add_argument("--layout", action="store_true", help="token-major vs head-major cache blocks")
    ap.add_argument("--ceiling", action="store_true", help="read bandwidth ceiling and the decode tile sweep")
    ap.add_argument("--heads", action="store_true", help="the gather with 1, 2, 4 KV heads a program")
    args = ap.parse_args()
    if args.ceiling:
        return read_ceiling(args.json)
    if args.heads:
        return heads_per_program(args.json)
    if args.layout:
        return layout_compare(args.json)
    if args.splits:
        return split_sweep(args.json)
    if args.prefill:
        return prefill_sweep(args.json, args.quick, args.fp8)
    if args.references:
        return prefill_references(args.json)
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
    """Key slices x decode tiles on W-small's real decode batches (ragged contexts, longest first,
    as the engine orders them) from the middle of the run to its tail, timed as the engine runs
    them: inside a CUDA graph (launch costs hidden), over four copies of the cache (not L2-hot)."""
    from llmserve.kernels.paged_attention import decode_splits
    rows = []
    for step in (450, 650, 750, 800, 850, 900, 950, 990, 1010):
        ctx = sorted(w_small_contexts(step), reverse=True)
        sets = [decode_inputs_ragged(ctx) for _ in range(4)]
        order = torch.arange(len(ctx), device="cuda", dtype=torch.int32)
        kv_bytes = 2 * sum(ctx) * 8 * 128 * 2
        row = {"w_small_step": step, "running": len(ctx), "mean_context": sum(ctx) / len(ctx),
               "default_splits": decode_splits(len(ctx), 8, order.device)}

        def timed(**kw) -> float:
            return graph_us(lambda i: paged_attention(*sets[i], 0.088, 1, seq_order=order, **kw), len(sets))

        row["default_us"] = timed()
        row["default_tb_s"] = kv_bytes / row["default_us"] / 1e6
        for splits, tiles in itertools.product((1, 2, 4, 8, 16), ((32, 4, 3), (32, 4, 4), (64, 4, 3), (64, 4, 4),
                                                                 (128, 4, 3), (128, 8, 3), (256, 8, 3))):
            try:
                row[f"s{splits} {tiles}"] = kv_bytes / timed(num_splits=splits, tiles=tiles) / 1e6
            except Exception:  # out of resources
                continue
        best = max((key for key in row if key.startswith("s") and " " in key), key=row.get)
        row["best"], row["best_tb_s"] = best, row[best]
        rows.append(row)
        _print_summary(row)
    report(rows, json_path, echo=False)


def prefill_sweep(json_path: str | None, quick: bool = False, fp8: bool = False) -> None:
    from llmserve.kernels import paged_attention as pa
    # revisions before prefill_tiles and PREFILL_BLOCK_M had a constant and 64 rows
    default = pa.prefill_tiles(False) if hasattr(pa, "prefill_tiles") else pa.PREFILL_TILES
    default_m = getattr(pa, "PREFILL_BLOCK_M", 64)
    rows = []
    seqs, length, dim, bs = 8, 1024, 128, 16
    for name, heads, kv_heads in (("w-small", 16, 8), ("w-large", 32, 8)):
        blocks = seqs * length // bs
        tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(seqs, -1)
        k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        scales = {}
        if fp8:
            (k, scales["k_scale"]), (v, scales["v_scale"]) = quantize_kv_reference(k), quantize_kv_reference(v)
        q = torch.randn(seqs * length, heads, dim, device="cuda", dtype=torch.bfloat16)
        qsl = torch.arange(0, seqs * length + 1, length, device="cuda", dtype=torch.int32)
        lens = torch.full((seqs,), length, device="cuda", dtype=torch.int32)
        flops = 4 * seqs * (length * (length + 1) / 2) * dim * heads
        row = {"shape": name, "fp8": fp8, "default": [default_m, *default]}
        choices = itertools.product((64, 128), itertools.product((32, 64), (4, 8), (3,)) if quick else
                                    itertools.product((32, 64, 128), (4, 8), (2, 3, 4)))
        for block_m, tiles in dict.fromkeys([(default_m, tuple(default)), *choices]):  # the default once
            try:
                ms = triton.testing.do_bench(lambda: paged_attention(q, k, v, tables, qsl, lens, 0.088, length,
                                                                     tiles=tiles, block_m=block_m, **scales))
            except Exception:  # out of resources
                continue
            row[f"m{block_m} {tiles}"] = flops / ms / 1e9
        best = max((key for key in row if key.startswith("m")), key=row.get)
        row["best"], row["best_tflop_s"] = best, row[best]
        row["default_tflop_s"] = row.get(f"m{default_m} {tuple(default)}")
        rows.append(row)
        print(json.dumps({key: row[key] for key in ("shape", "best", "best_tflop_s", "default_tflop_s")}), flush=True)
        print(json.dumps({key: round(val) for key, val in row.items() if key.startswith("m")}), flush=True)
    report(rows, json_path, echo=False)


def prefill_references(json_path: str | None) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    seqs, length, dim, bs = 8, 1024, 128, 16
    for name, heads, kv_heads in (("w-small", 16, 8), ("w-large", 32, 8)):
        flops = 4 * seqs * (length * (length + 1) / 2) * dim * heads
        blocks = seqs * length // bs
        tables = torch.randperm(blocks, device="cuda", dtype=torch.int32).view(seqs, -1)
        k = torch.randn(blocks, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(seqs * length, heads, dim, device="cuda", dtype=torch.bfloat16)
        qsl = torch.arange(0, seqs * length + 1, length, device="cuda", dtype=torch.int32)
        lens = torch.full((seqs,), length, device="cuda", dtype=torch.int32)
        row = {"shape": name, "engine": flops / triton.testing.do_bench(
            lambda: paged_attention(q, k, v, tables, qsl, lens, 0.088, length)) / 1e9}
        qc = torch.randn(seqs, heads, length, dim, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(seqs, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        kx, vx = (t.repeat_interleave(heads // kv_heads, 1) for t in (kc, vc))  # for backends without GQA
        for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
            for gqa in (True, False):
                def run():
                    with sdpa_kernel(getattr(SDPBackend, backend)):
                        if gqa:
                            return torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, is_causal=True,
                                                                                    enable_gqa=True)
                        return torch.nn.functional.scaled_dot_product_attention(qc, kx, vx, is_causal=True)
                try:
                    row[f"{backend.lower()}{'_gqa' if gqa else ''}"] = flops / triton.testing.do_bench(run) / 1e9
                except Exception as e:  # a backend that does not take this shape or GQA
                    row[f"{backend.lower()}{'_gqa' if gqa else ''}"] = f"{type(e).__name__}: {str(e)[:80]}"
        rows.append(row)
        print(json.dumps({key: round(val) if isinstance(val, float) else val for key, val in row.items()}), flush=True)
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


def read_ceiling(json_path: str | None) -> None:
    """How fast this device reads: a copy (read + write, the roofline's bandwidth), a plain streaming
    read, and the decode kernel's own access pattern (each (sequence, KV head) program gathering its
    256-byte key and value rows through the block table) without the attention arithmetic. Then
    W-small's real decode batches (every running request's context at step t of the workload, in
    request order as the scheduler runs them) against the same batch longest-first: whether the
    kernel's time is lost to programs of unequal length finishing at different times."""
    rows = []
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    row = {"copy_tb_s": 2 * x.numel() / triton.testing.do_bench(lambda: y.copy_(x)) / 1e9}
    flat = x.view(torch.int32)
    per_program, block = 4, 2048  # int32s: each program reads 32 KB
    out = torch.empty(flat.numel() // (per_program * block), dtype=torch.int32, device="cuda")
    for warps, stages in itertools.product((4, 8), (1, 2, 3)):
        ms = triton.testing.do_bench(lambda: _stream_read[(out.numel(),)](flat, out, per_program, BLOCK=block,
                                                                           num_warps=warps, num_stages=stages))
        row[f"stream w{warps} s{stages}"] = x.numel() / ms / 1e9
    row["stream_best_tb_s"] = max(val for key, val in row.items() if key.startswith("stream "))
    rows.append(row)
    print(json.dumps({key: round(val, 3) for key, val in row.items()}), flush=True)
    del x, y, flat, out
    tile_grid = list(itertools.product((32, 64, 128), (4, 8), (2, 3, 4)))
    for batch, context in [(256, 1024), (128, 1250), (48, 1500), (15, 1800)]:
        q, k, v, tables, qsl, lens = decode_inputs(batch, context)
        kv_bytes = 2 * batch * context * 8 * 128 * 2
        sink = torch.empty(batch, 8, 128, device="cuda", dtype=torch.float32)
        row = {"batch": batch, "context": context}
        for block_n, warps, stages in itertools.product((64, 128), (4, 8), (2, 3)):
            ms = triton.testing.do_bench(lambda: _gather_read[(batch, 8)](
                k, v, tables, lens, sink, tables.stride(0), k.stride(0), k.stride(1), k.stride(2),
                BLOCK_SIZE=16, BLOCK_N=block_n, HEAD_D=128, num_warps=warps, num_stages=stages))
            row[f"gather {block_n},{warps},{stages}"] = kv_bytes / ms / 1e9
        _tile_times(row, "attn", kv_bytes, tile_grid, q, k, v, tables, qsl, lens)
        rows.append(row)
        _print_summary(row)
    for step in (50, 250, 450, 650, 850):
        ctx = w_small_contexts(step)
        for order in ("request", "longest_first"):
            batch_ctx = sorted(ctx, reverse=True) if order == "longest_first" else ctx
            q, k, v, tables, qsl, lens = decode_inputs_ragged(batch_ctx)
            kv_bytes = 2 * sum(batch_ctx) * 8 * 128 * 2
            row = {"w_small_step": step, "order": order, "running": len(ctx), "mean_context": sum(ctx) / len(ctx),
                   "max_context": max(ctx)}
            _tile_times(row, "attn", kv_bytes, tile_grid, q, k, v, tables, qsl, lens)
            rows.append(row)
            _print_summary(row)
    report(rows, json_path, echo=False)


def heads_per_program(json_path: str | None) -> None:
    """Would a decode program that reads several adjacent KV heads (longer contiguous rows, fewer
    and longer programs) read faster? The gather alone, 1, 2 and 4 heads a program, on a uniform
    batch and on W-small's real ragged ones (longest first), against the decode kernel."""
    rows = []
    batches = [("uniform 256x1024", [1024] * 256)] + [(f"w-small step {t}", sorted(w_small_contexts(t), reverse=True))
                                                       for t in (50, 250, 450, 650)]
    for name, ctx in batches:
        q, k, v, tables, qsl, lens = decode_inputs_ragged(ctx)
        kv_bytes = 2 * sum(ctx) * 8 * 128 * 2
        sink = torch.empty(len(ctx), 8, 128, device="cuda", dtype=torch.float32)
        row = {"batch": name, "running": len(ctx)}
        for heads, block_n, warps, stages in itertools.product((1, 2, 4), (32, 64, 128), (4, 8), (2, 3)):
            if heads * block_n > 256:
                continue
            try:
                ms = triton.testing.do_bench(lambda: _gather_read[(len(ctx), 8 // heads)](
                    k, v, tables, lens, sink, tables.stride(0), k.stride(0), k.stride(1), k.stride(2),
                    BLOCK_SIZE=16, BLOCK_N=block_n, HEAD_D=128, HEADS=heads, num_warps=warps, num_stages=stages))
            except Exception:  # out of resources
                continue
            row[f"gather h{heads} {block_n},{warps},{stages}"] = kv_bytes / ms / 1e9
        for heads in (1, 2, 4):
            timed = {key: val for key, val in row.items() if key.startswith(f"gather h{heads} ")}
            best = max(timed, key=timed.get)
            row[f"h{heads}_best"], row[f"h{heads}_tb_s"] = best, round(timed[best], 3)
        ms = triton.testing.do_bench(lambda: paged_attention(q, k, v, tables, qsl, lens, 0.088, 1))
        row["attn_default_tb_s"] = round(kv_bytes / ms / 1e9, 3)
        rows.append(row)
        _print_summary(row)
    report(rows, json_path, echo=False)


def _tile_times(row: dict, kind: str, kv_bytes: int, tile_grid, q, k, v, tables, qsl, lens) -> None:
    """row[f"{kind} {tiles}"] = TB/s for each tile choice, plus the default's and the best."""
    for tiles in tile_grid:
        try:
            ms = triton.testing.do_bench(lambda: paged_attention(q, k, v, tables, qsl, lens, 0.088, 1, tiles=tiles))
        except Exception:  # out of resources
            continue
        row[f"{kind} {tiles}"] = kv_bytes / ms / 1e9
    ms = triton.testing.do_bench(lambda: paged_attention(q, k, v, tables, qsl, lens, 0.088, 1))
    row[f"{kind}_default_us"], row[f"{kind}_default_tb_s"] = 1e3 * ms, kv_bytes / ms / 1e9
    for name in ("gather", kind):
        timed = [key for key in row if key.startswith(name + " ")]
        if timed:
            best = max(timed, key=row.get)
            row[f"{name}_best"], row[f"{name}_best_tb_s"] = best, row[best]


def _print_summary(row: dict) -> None:
    print(json.dumps({key: (round(val, 3) if isinstance(val, float) else val) for key, val in row.items()
                      if " " not in key}), flush=True)


def w_small_contexts(step: int) -> list[int]:
    """Context length of every request still decoding at decode step `step` of W-small, in request
    order (all prompts prefilled first, as the engine's run does within its first ~20 steps)."""
    from llmserve.bench.workloads import w_small
    work = w_small()
    return [len(p) + step for p, sp in zip(work.prompts, work.params) if sp.max_tokens > step]


def decode_inputs_ragged(contexts: list[int], heads: int = 16, kv_heads: int = 8, dim: int = 128, bs: int = 16):
    """decode_inputs with one context length per sequence (blocks scattered over the pool)."""
    width = max(-(-c // bs) for c in contexts)
    batch = len(contexts)
    tables = torch.randperm(batch * width, device="cuda", dtype=torch.int32).view(batch, width)
    k = torch.randn(batch * width, bs, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(batch, heads, dim, device="cuda", dtype=torch.bfloat16)
    qsl = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.tensor(contexts, device="cuda", dtype=torch.int32)
    return q, k, torch.randn_like(k), tables, qsl, lens


@triton.jit
def _stream_read(x_ptr, out_ptr, PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * PER_PROGRAM * BLOCK
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in tl.range(PER_PROGRAM):
        acc ^= tl.load(x_ptr + base + i * BLOCK + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.reduce(acc, 0, _xor))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _gather_read(k_ptr, v_ptr, tables_ptr, lens_ptr, sink_ptr, stride_bt, stride_cb, stride_ct, stride_ch,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, HEADS: tl.constexpr = 1):
    """Each (sequence, group of HEADS adjacent KV heads) program reads its keys' and values' rows
    through the block table (HEADS * HEAD_D contiguous elements a row) and sums them."""
    seq, head = tl.program_id(0), tl.program_id(1) * HEADS
    n = tl.load(lens_ptr + seq)
    d = tl.arange(0, HEADS * HEAD_D)
    acc = tl.zeros([HEADS * HEAD_D], dtype=tl.float32)
    for start in range(0, n, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        ok = pos < n
        blk = tl.load(tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        off = blk[:, None] * stride_cb + (pos % BLOCK_SIZE)[:, None] * stride_ct + head * stride_ch + d[None, :]
        kk = tl.load(k_ptr + off, mask=ok[:, None], other=0.0)
        vv = tl.load(v_ptr + off, mask=ok[:, None], other=0.0)
        acc += tl.sum(kk.to(tl.float32) + vv.to(tl.float32), 0)
    tl.store(sink_ptr + (seq * tl.num_programs(1) * HEADS + head) * HEAD_D + d, acc)


if __name__ == "__main__":
    main()
