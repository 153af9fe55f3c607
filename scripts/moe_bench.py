"""One mixture-of-experts layer of the Qwen3-30B-A3B shape (128 experts, 8 a token, hidden 2048,
expert width 768, bf16) at decode and prefill token counts: the fused kernel (kernels/moe.py,
replayed from a CUDA graph as the engine runs it) against a per-expert loop of GEMMs
(`fused_moe_reference`, as transformers' eager experts: route, then gate_up, SiLU·mul and down for
each expert its tokens picked) and
transformers' grouped_mm experts where this transformers has them, with the layer's roofline:
the picked experts' weights read once, or its FLOPs, whichever takes longer.

    python scripts/moe_bench.py [--tokens 1,8,...] [--tune] [--json out.json]

--tune times each tile configuration of kernels/moe.py's `_tiles` per token count instead. Up to
4 tokens the layer is also timed a program per pair and sorted, whatever DIRECT_PAIRS says.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
import triton

from llmserve.kernels import moe
from graph_timing import events_us

E, K, H, I = 128, 8, 2048, 768
BANDWIDTH, FLOPS = 3.0e12, 785e12  # the H100's measured copy bandwidth and bf16 matmul rate (WORKLOADS.md)
TILES = [(16, 64, 128, 4, 3), (16, 32, 128, 4, 4), (16, 32, 256, 4, 3), (16, 64, 64, 4, 5), (16, 128, 64, 4, 4),
         (32, 64, 128, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 4), (128, 128, 64, 8, 3),
         (128, 128, 64, 4, 4), (128, 128, 32, 8, 5), (128, 256, 64, 8, 2), (256, 128, 64, 8, 3)]


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def hf_block(w13, w2, implementation: str):
    """transformers' Qwen3-MoE block with these experts, or None where this version lacks it."""
    try:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        config = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                                norm_topk_prob=True)
        config._experts_implementation = implementation
        block = Qwen3MoeSparseMoeBlock(config).to("cuda", torch.bfloat16).eval()
        block.experts.gate_up_proj.data.copy_(w13)
        block.experts.down_proj.data.copy_(w2)
        return block
    except Exception as e:  # noqa: BLE001 (another transformers layout: reported, not fatal)
        print(f"transformers {implementation} experts unavailable: {e!r}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,2,4,8,32,64,256,1024,4096,8192")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.02
    blocks = {} if args.tune else {name: hf_block(w13, w2, name) for name in ("eager", "grouped_mm")}
    rows = []
    for T in map(int, args.tokens.split(",")):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        router = torch.randn(E, H, device="cuda", dtype=torch.bfloat16) * 0.02
        logits = F.linear(x, router)
        picked = int(moe.route_reference(logits, K, True)[1].unique().numel())
        roof_us = 1e6 * max(picked * 3 * H * I * 2 / BANDWIDTH, 2 * T * K * 3 * H * I / FLOPS)
        row = {"tokens": T, "experts_picked": picked, "roofline_us": roof_us}
        if args.tune:
            real = moe._tiles
            for tiles in TILES:
                moe._tiles = lambda pairs, e, tiles=tiles: tiles
                try:
                    row[str(tiles)] = events_us(graphed(lambda: moe.fused_moe(x, logits, K, True, w13, w2)))
                except triton.runtime.errors.OutOfResources:  # too much shared memory for these tiles
                    row[str(tiles)] = None
                finally:
                    moe._tiles = real
            best = min((k for k in row if k.startswith("(") and row[k] is not None), key=row.get)
            print(f"T={T:5d}  best {best} {row[best]:8.1f} us  default {real(T * K, E)}  roofline {roof_us:.1f} us")
        else:
            fused = events_us(graphed(lambda: moe.fused_moe(x, logits, K, True, w13, w2)))
            loop = events_us(lambda: moe.fused_moe_reference(x, logits, K, True, w13, w2), iters=10)
            row.update(fused_us=fused, per_expert_loop_us=loop, roofline_fraction=roof_us / fused,
                       speedup_over_loop=loop / fused)
            if T <= 4:  # a program per pair against the sorted path, for moe.DIRECT_PAIRS
                real = moe.DIRECT_PAIRS
                for name, limit in (("direct_us", T * K), ("sorted_us", 0)):
                    moe.DIRECT_PAIRS = limit
                    try:
                        row[name] = events_us(graphed(lambda: moe.fused_moe(x, logits, K, True, w13, w2)))
                    finally:
                        moe.DIRECT_PAIRS = real
            with torch.no_grad():
                for name, block in blocks.items():
                    if block is not None:
                        block.gate.weight.data.copy_(router)
                        row[f"hf_{name}_us"] = events_us(lambda: block(x[None]), iters=10)
            hf = "  ".join(f"{k} {v:9.1f}" for k, v in row.items() if k.startswith(("hf_", "direct", "sorted")))
            print(f"T={T:5d} experts {picked:3d}  fused {fused:8.1f} us  loop {loop:9.1f} us  ({loop / fused:5.1f}x)  "
                  f"roofline {roof_us:7.1f} us ({roof_us / fused:.2f})  {hf}")
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shape": {"experts": E, "top_k": K, "hidden": H,
                                                                       "inter": I}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
