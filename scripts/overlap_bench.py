"""Would a step run faster as two half batches ("nano-batches") on two CUDA streams? GPU only.

A decoder layer as the engine runs it (add + RMSNorm, qkv GEMM, rotary + KV write, paged attention,
o GEMM, add + RMSNorm, gate_up GEMM + SiLU·mul, down GEMM; the engine's kernels, every layer with
its own weights) on a real batch, captured in one CUDA graph three ways:

- full: the whole batch, one stream (what the engine does);
- halves, one stream: the batch as two halves one after the other (what splitting costs: every
  GEMM twice at half the rows, its weights read twice);
- halves, two streams: the halves forked onto two streams and joined, so that one half's GEMMs
  may run while the other half's attention streams the KV cache.

and, for W-large's mixed step (--w-large --carveouts 0,16,32), the decode rows' attention on its own
stream while the prompt rows' qkv GEMM and attention run on the main one ("split"; with "+o", the
o GEMM split too): the decode rows' qkv rows first (a small GEMM), the rest of each layer over all
rows in one GEMM, cuBLASLt told to leave N SMs to the other stream (torch's SM carveout switch);
"split, one stream" is the same work unforked (what the split itself costs).

Batches: W-small's decode step t (every running request's context, longest first; --steps), and
W-large's steady mixed step (--w-large: 8,192 tokens, 248 decoding requests with 1,024-1,151
cached tokens and 7,944 tokens of fresh prompt chunks, the shape the scheduler packs).

    python scripts/overlap_bench.py [--steps 50,250,450,650] [--w-large [--carveouts 0,16,32]] [--json out.json]
"""

import argparse
from types import SimpleNamespace

import torch

from attention_bench import w_small_contexts
from graph_timing import emit, graph_us
from llmserve.bench.report import report
from llmserve.bench.workloads import LLAMA31_8B, QWEN3_0_6B
from llmserve.kernels.fused import rms_norm, rotary_and_write_kv, silu_and_mul
from llmserve.kernels.paged_attention import paged_attention
from llmserve.model.layers import RotaryEmbedding
from llmserve.model.spec import ModelSpec
from llmserve.quantization import Unquantized

BS = 16


class Weights:
    """A model shape's decoder weights (random, every layer its own) as the engine's unquantized
    linear layers hold them, with unit norm weights and the model's rotary tables."""

    def __init__(self, s: ModelSpec) -> None:
        def w(n, k):
            return [SimpleNamespace(weight=torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02, bias=None)
                    for _ in range(s.num_layers)]
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.qkv, self.o = w(q + 2 * kv, s.hidden_size), w(s.hidden_size, q)
        self.gate_up, self.down = w(2 * s.intermediate_size, s.hidden_size), w(s.hidden_size, s.intermediate_size)
        self.g = torch.ones(s.hidden_size, device="cuda", dtype=torch.bfloat16)
        self.qk_g = torch.ones(s.head_dim, device="cuda", dtype=torch.bfloat16) if s.qk_norm else None
        rotary = RotaryEmbedding(s.head_dim, 4096, s.rope_theta, s.rope_scaling, backend=None)
        self.cos, self.sin = rotary.cos.cuda(), rotary.sin.cuda()


class Batch:
    """One batch's inputs and KV cache (blocks scattered over the pool): sequences with `cached`
    tokens in the cache computing `new` tokens each (1 for a decode)."""

    def __init__(self, s: ModelSpec, cached: list[int], new: list[int]) -> None:
        self.s = s
        width = max(-(-(c + n) // BS) for c, n in zip(cached, new))
        B, T = len(cached), sum(new)
        self.T = T
        self.tables = torch.randperm(B * width, device="cuda", dtype=torch.int32).view(B, width)
        self.k = torch.randn(B * width, BS, s.num_kv_heads, s.head_dim, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn_like(self.k)
        seq = torch.repeat_interleave(torch.arange(B, device="cuda"), torch.tensor(new, device="cuda"))
        starts = torch.tensor([0, *new], device="cuda").cumsum(0)
        pos = torch.tensor(cached, device="cuda")[seq] + torch.arange(T, device="cuda") - starts[seq]
        self.positions = pos
        self.slots = self.tables[seq, pos // BS].long() * BS + pos % BS
        self.lens = torch.tensor([c + n for c, n in zip(cached, new)], device="cuda", dtype=torch.int32)
        self.qsl = starts.to(torch.int32)
        self.max_query_len = max(new)
        self.order = torch.argsort(self.lens, descending=True).to(torch.int32) if self.max_query_len == 1 else None
        self.x = torch.randn(T, s.hidden_size, device="cuda", dtype=torch.bfloat16)
        self.r = torch.randn(T, s.hidden_size, device="cuda", dtype=torch.bfloat16)

    def step(self, w: Weights) -> torch.Tensor:
        """The decoder layers over this batch, each linear layer multiplied as Unquantized does
        (the decode GEMM or cuBLAS, whichever the engine would pick for these rows)."""
        s, T, lin = self.s, self.T, Unquantized()
        heads, kv_heads, dim, eps = s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps
        x, r = self.x, self.r
        for i in range(s.num_layers):
            h, r = rms_norm(x, w.g, eps, r)
            q, k, v = lin.apply(w.qkv[i], h).split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
            q, k, v = q.view(T, heads, dim), k.view(T, kv_heads, dim), v.view(T, kv_heads, dim)
            rotary_and_write_kv(q, k, v, self.positions, w.cos, w.sin, self.k, self.v, self.slots,
                                q_weight=w.qk_g, k_weight=w.qk_g, eps=eps)
            a = paged_attention(q, self.k, self.v, self.tables, self.qsl, self.lens, dim ** -0.5,
                                self.max_query_len, seq_order=self.order)
            h, r = rms_norm(lin.apply(w.o[i], a.view(T, heads * dim)), w.g, eps, r)
            x = lin.apply(w.down[i], lin.apply_gated(w.gate_up[i], h, silu_and_mul))
        return x + r


def split_step(full: Batch, p: Batch, d: Batch, w: Weights, side, sms: int | None, split_o: bool) -> torch.Tensor:
    """`full`'s layers with its first p.T rows (the prompts, batch p's metadata) and the last d.T
    (the decodes, batch d's) attended apart: d's on the `side` stream (None: in line) while the
    main stream's GEMM on p's rows leaves `sms` SMs free."""
    s, T, tp, lin = full.s, full.T, p.T, Unquantized()
    heads, kv_heads, dim, eps = s.num_heads, s.num_kv_heads, s.head_dim, s.rms_norm_eps
    sizes = [heads * dim, kv_heads * dim, kv_heads * dim]
    main = torch.cuda.current_stream()
    x, r = full.x, full.r
    for i in range(s.num_layers):
        h, r = rms_norm(x, w.g, eps, r)
        qkv = torch.empty(T, sum(sizes), device="cuda", dtype=torch.bfloat16)
        a = torch.empty(T, heads, dim, device="cuda", dtype=torch.bfloat16)
        o = torch.empty(T, s.hidden_size, device="cuda", dtype=torch.bfloat16)
        torch.mm(h[tp:], w.qkv[i].weight.t(), out=qkv[tp:])

        def attend(b: Batch, rows: slice) -> None:
            q, k, v = qkv[rows].split(sizes, -1)
            n = q.shape[0]
            q, k, v = q.view(n, heads, dim), k.view(n, kv_heads, dim), v.view(n, kv_heads, dim)
            rotary_and_write_kv(q, k, v, b.positions, w.cos, w.sin, b.k, b.v, b.slots,
                                q_weight=w.qk_g, k_weight=w.qk_g, eps=eps)
            paged_attention(q, b.k, b.v, b.tables, b.qsl, b.lens, dim ** -0.5, b.max_query_len,
                            out=a[rows], seq_order=b.order)
            if split_o:
                torch.mm(a[rows].view(n, heads * dim), w.o[i].weight.t(), out=o[rows])

        if side is not None:
            side.wait_stream(main)
            with torch.cuda.stream(side):
                attend(d, slice(tp, T))
        else:
            attend(d, slice(tp, T))
        if sms:
            carveout(sms)
        torch.mm(h[:tp], w.qkv[i].weight.t(), out=qkv[:tp])
        attend(p, slice(0, tp))
        if sms:
            carveout(None)
        if side is not None:
            main.wait_stream(side)
        if not split_o:
            o = lin.apply(w.o[i], a.view(T, heads * dim))
        h, r = rms_norm(o, w.g, eps, r)
        x = lin.apply(w.down[i], lin.apply_gated(w.gate_up[i], h, silu_and_mul))
    return x + r


def carveout(sms: int | None) -> None:
    torch._C._set_sm_carveout_experimental(sms)


def compare_split(rows: list, s: ModelSpec, w: Weights, prompts: list[int], decodes: list[int],
                  carveouts: list[int]) -> None:
    """W-large's mixed step whole against the decode rows' attention split off (module docstring)."""
    cached, new = [0] * len(prompts) + decodes, prompts + [1] * len(decodes)
    full = Batch(s, cached, new)
    p, d = Batch(s, [0] * len(prompts), prompts), Batch(s, decodes, [1] * len(decodes))
    side = torch.cuda.Stream()
    torch.backends.cuda.preferred_blas_library("cublaslt")  # the carveout is cuBLASLt's
    try:
        row = {"batch": "w-large mixed step", "tokens": full.T, "full_cublaslt_ms": graph_us(lambda i: full.step(w), reps=10) / 1e3}
        row["split_one_stream_ms"] = graph_us(lambda i: split_step(full, p, d, w, None, None, False), reps=10) / 1e3
        for split_o in (False, True):
            for sms in carveouts:
                key = f"split{'+o' if split_o else ''}_carveout{sms}_ms"
                row[key] = graph_us(lambda i: split_step(full, p, d, w, side, sms, split_o), reps=10) / 1e3
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    row["full_cublas_ms"] = graph_us(lambda i: full.step(w), reps=10) / 1e3
    emit(rows, row)


def two_streams(a: Batch, b: Batch, w: Weights, streams) -> None:
    main = torch.cuda.current_stream()
    for s in streams:
        s.wait_stream(main)
    for s, half in zip(streams, (a, b)):
        with torch.cuda.stream(s):
            half.step(w)
    for s in streams:
        main.wait_stream(s)


def compare(rows: list, row: dict, s: ModelSpec, w: Weights, cached: list[int], new: list[int]) -> None:
    """Full batch against its halves (alternate sequences) on one and on two streams."""
    full = Batch(s, cached, new)
    a, b = Batch(s, cached[0::2], new[0::2]), Batch(s, cached[1::2], new[1::2])
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    row["full_ms"] = graph_us(lambda i: full.step(w), reps=10) / 1e3
    row["halves_one_stream_ms"] = graph_us(lambda i: (a.step(w), b.step(w)), reps=10) / 1e3
    row["halves_two_streams_ms"] = graph_us(lambda i: two_streams(a, b, w, streams), reps=10) / 1e3
    row["two_streams_gain"] = 1 - row["halves_two_streams_ms"] / row["full_ms"]
    emit(rows, row)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="50,250,450,650")
    ap.add_argument("--w-large", action="store_true")
    ap.add_argument("--carveouts", help="--w-large: time the split step (module docstring) with these carveouts")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    if args.w_large:
        spec = ModelSpec.from_dict(LLAMA31_8B)
        w = Weights(spec)
        decodes = [1024 + i % 128 for i in range(248)]
        prompts = [1024] * 7 + [776]  # 7,944 tokens of fresh prompt chunks
        if args.carveouts:
            compare_split(rows, spec, w, prompts, decodes, [int(c) for c in args.carveouts.split(",")])
            report(rows, args.json, echo=False)
            return
        compare(rows, {"batch": "w-large mixed step", "tokens": 8192}, spec, w,
                [0] * len(prompts) + decodes, prompts + [1] * len(decodes))
    else:
        spec = ModelSpec.from_dict(QWEN3_0_6B)
        w = Weights(spec)
        for step in map(int, args.steps.split(",")):
            ctx = sorted(w_small_contexts(step), reverse=True)
            compare(rows, {"w_small_step": step, "running": len(ctx)}, spec, w, ctx, [1] * len(ctx))
            torch.cuda.empty_cache()
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
