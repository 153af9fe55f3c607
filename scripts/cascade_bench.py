"""Cascade attention against the plain paged decode kernel, one attention layer, CUDA-graph timed.

    python scripts/cascade_bench.py [--json OUT]            # FlashInfer's setting: MHA and GQA 4:1
    python scripts/cascade_bench.py --sweep [--json OUT]    # the cost model's decisions against timings
    python scripts/cascade_bench.py --tune [--json OUT]     # the prefix kernel's tile configurations

FlashInfer's setting (its cascade blog post): one 32,768-token prefix shared by a batch of 128,
each request with 256 tokens of its own, 32 query heads of 128, bf16, one decode token a request.
The sweep runs decode batches over shapes and group layouts, with the plain kernel's and the
cascade's times and whether `worth_it` chose the faster.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch
from triton.testing import do_bench_cudagraph

from llmserve.attention import CascadeMetadata
from llmserve.kernels.cascade import cascade_attention, worth_it
from llmserve.kernels.hardware import sm_count
from llmserve.kernels.paged_attention import paged_attention
from llmserve.messages import PrefixGroups

BLOCK = 16


def layout(batch: int, groups: int, prefix: int, suffix: int, heads: int, kv_heads: int, dim: int = 128):
    """Tensors of one decode step: `groups` prefixes of `prefix` tokens, each shared by batch /
    groups requests, and `suffix` tokens of each request's own (its decode token the last)."""
    per = -(-prefix // BLOCK)
    own = -(-suffix // BLOCK)
    num_blocks = groups * per + batch * own
    tables = np.zeros((batch, per + own), dtype=np.int32)
    for i in range(batch):
        g = i % groups
        tables[i, :per] = np.arange(g * per, (g + 1) * per)
        tables[i, per:] = groups * per + i * own + np.arange(own)
    seq_lens = np.full(batch, per * BLOCK + suffix, dtype=np.int32)
    members = np.concatenate([np.arange(g, batch, groups) for g in range(groups)]).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum([len(range(g, batch, groups)) for g in range(groups)])]).astype(np.int32)
    pg = PrefixGroups(starts, members, np.zeros(groups, np.int32), np.full(groups, per * BLOCK, np.int32),
                      np.zeros(groups, np.int32))
    qsl = np.arange(batch + 1, dtype=np.int32)
    capacity = (groups, batch, batch, batch)
    packed = np.empty(CascadeMetadata.size(*capacity), np.int32)
    CascadeMetadata.pack(pg, qsl, packed, capacity)
    dev = torch.device("cuda")
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, dim, dtype=torch.bfloat16, device=dev)
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device=dev)
    to = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
    meta = CascadeMetadata.view(to(packed), capacity)
    return q, cache[0], cache[1], to(tables), to(qsl), to(seq_lens), meta, pg


def compare(batch: int, groups: int, prefix: int, suffix: int, heads: int, kv_heads: int, config=None) -> dict:
    q, k, v, tables, qsl, seq_lens, meta, pg = layout(batch, groups, prefix, suffix, heads, kv_heads)
    out = torch.empty_like(q)
    plain = lambda: paged_attention(q, k, v, tables, qsl, seq_lens, 0.088, 1, out=out)  # noqa: E731
    casc = lambda: cascade_attention(q, k, v, tables, qsl, seq_lens, 0.088, 1, meta, out=out,  # noqa: E731
                                     config=config)
    plain()
    ref = out.clone()
    casc()
    err = (out.float() - ref.float()).abs().max().item()
    t_plain, t_casc = do_bench_cudagraph(plain, rep=200), do_bench_cudagraph(casc, rep=200)
    sizes = np.diff(pg.starts)
    chosen = worth_it(sizes, pg.hi - pg.lo, heads, kv_heads, 128, sm_count(q.device))
    return {"config": config, "batch": batch, "groups": groups, "prefix": prefix, "suffix": suffix, "heads": heads,
            "kv_heads": kv_heads, "plain_us": 1e3 * t_plain, "cascade_us": 1e3 * t_casc,
            "speedup": t_plain / t_casc, "max_abs_diff": err, "cost_model_chooses_cascade": bool(chosen),
            "cost_model_right": bool(chosen) == (t_casc < t_plain)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--tune", action="store_true", help="the prefix kernel's configurations on a few layouts")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    if args.tune:
        layouts = [(128, 1, 32768, 256, 32, 32), (128, 1, 32768, 256, 32, 8), (256, 8, 4096, 128, 16, 8),
                   (256, 1, 8192, 256, 32, 8), (32, 8, 2048, 256, 32, 8), (8, 1, 8192, 256, 16, 8)]
        for lay in layouts:
            for bm, bn, warps, stages in ((64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 4, 2),
                                          (256, 32, 8, 2), (64, 128, 4, 2)):
                for splits in (2, 4, 8):
                    try:
                        rows.append(compare(*lay, config=(bm, bn, warps, stages, splits)))
                    except Exception as exc:  # out of shared memory or registers: not a candidate
                        rows.append({"config": (bm, bn, warps, stages, splits), "layout": lay, "error": repr(exc)[:200]})
                    print(json.dumps(rows[-1]), file=sys.stderr)
    elif args.sweep:
        for heads, kv_heads in ((16, 8), (32, 8)):  # Qwen3-0.6B's and Llama-3.1-8B's attention
            for batch in (2, 8, 32, 128, 256):
                for groups in (1, 8):
                    if groups > batch // 2:
                        continue
                    for prefix in (32, 128, 512, 2048, 8192):
                        rows.append(compare(batch, groups, prefix, 256, heads, kv_heads))
                        print(json.dumps(rows[-1]), file=sys.stderr)
    else:
        for heads, kv_heads in ((32, 32), (32, 8)):
            rows.append(compare(128, 1, 32768, 256, heads, kv_heads))
            print(json.dumps(rows[-1]), file=sys.stderr)
    result = {"device": torch.cuda.get_device_name(), "rows": rows}
    if args.sweep:
        result["cost_model_right"] = sum(r["cost_model_right"] for r in rows) / len(rows)
        result["worst_miss"] = min((min(r["speedup"], 1 / r["speedup"]) for r in rows if not r["cost_model_right"]),
                                   default=None)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
