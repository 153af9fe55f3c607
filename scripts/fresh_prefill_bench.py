"""A candidate prefill attention for prompts with nothing cached yet: their keys and values are
this step's own, contiguous in the step's k and v, so the kernel reads them through TMA
descriptors (no block table), one query head a program, 128-row query tiles, as FlashAttention
kernels on Hopper do. Timed against the engine's paged kernel and torch's SDPA backends on
--prefill's shapes (8 prompts of 1,024 tokens), TFLOP/s of causal attention; the largest
difference to the engine's kernel. GPU (TRITON_INTERPRET=1 with --check: a tiny case on the CPU).

    python scripts/fresh_prefill_bench.py [--json out.json] [--check]
"""

import argparse
import json

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from llmserve.bench.report import report
from llmserve.kernels.paged_attention import _find_query_tile, paged_attention


@triton.jit
def _fresh_prefill_kernel(q_desc, k_desc, v_desc, out_ptr, qsl_ptr, num_seqs, stride_ot, stride_oh, qk_scale,
                          GROUP: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          SEQS_P: tl.constexpr):
    seq, q_tile = _find_query_tile(qsl_ptr, num_seqs, tl.program_id(0), BLOCK_M, SEQS_P)
    if seq >= num_seqs:
        return
    head = tl.program_id(1)
    kv_col = (head // GROUP) * HEAD_D
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    m0 = q_tile * BLOCK_M
    q = q_desc.load([q_start + m0, head * HEAD_D])
    rows = m0 + tl.arange(0, BLOCK_M)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_D], dtype=tl.float32)
    for start in tl.range(0, m0, BLOCK_N):  # keys every row sees
        acc, m_i, l_i = _keys(acc, m_i, l_i, q, k_desc, v_desc, q_start, kv_col, start, rows, qk_scale,
                              BLOCK_N, CAUSAL=False)
    for start in tl.range(m0, tl.minimum(m0 + BLOCK_M, q_len), BLOCK_N):  # the diagonal
        acc, m_i, l_i = _keys(acc, m_i, l_i, q, k_desc, v_desc, q_start, kv_col, start, rows, qk_scale,
                              BLOCK_N, CAUSAL=True)
    acc = acc / l_i[:, None]
    d = tl.arange(0, HEAD_D)
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=(rows < q_len)[:, None])


@triton.jit
def _keys(acc, m_i, l_i, q, k_desc, v_desc, q_start, kv_col, start, rows, qk_scale, BLOCK_N: tl.constexpr,
          CAUSAL: tl.constexpr):
    """The online softmax (base 2) over the BLOCK_N keys from `start`; CAUSAL: each row sees only
    the keys at or before its own position."""
    k = k_desc.load([q_start + start, kv_col])
    s = tl.dot(q, k.T)
    if CAUSAL:
        s = tl.where(start + tl.arange(0, BLOCK_N)[None, :] <= rows[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([q_start + start, kv_col])
    return tl.dot(p.to(v.dtype), v, acc * alpha[:, None]), m_new, l_i


def fresh_prefill(q, k, v, qsl, scale, config=(64, 64, 4, 3)):
    """q [T, H, D], k and v [T, KVH, D] (unit stride on D, rows 16-byte aligned), qsl int32 [S+1];
    every sequence's keys are its own queries' (nothing cached before)."""
    bm, bn, warps, stages = config
    assert bm % bn == 0, "the unmasked loop ends at the query tile's first row: whole key tiles only"
    T, H, D = q.shape
    kvh = k.shape[1]
    out = torch.empty_like(q)
    descs = [TensorDescriptor(t, [T, t.shape[1] * D], [t.stride(0), 1], [rows, D])
             for t, rows in ((q, bm), (k, bn), (v, bn))]
    seqs = qsl.shape[0] - 1
    grid = (triton.cdiv(T, bm) + seqs, H)
    _fresh_prefill_kernel[grid](*descs, out, qsl, seqs, out.stride(0), out.stride(1), scale * 1.4426950408889634,
                                GROUP=H // kvh, HEAD_D=D, BLOCK_M=bm, BLOCK_N=bn,
                                SEQS_P=max(16, triton.next_power_of_2(seqs)), num_warps=warps, num_stages=stages)
    return out


def inputs(seqs, length, heads, kv_heads, dim, dtype, device, bs=16):
    T = seqs * length
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, device=device, dtype=dtype)  # the engine's layout
    q, k, v = qkv.view(T, -1, dim).split([heads, kv_heads, kv_heads], dim=1)
    blocks = T // bs
    tables = torch.randperm(blocks, device=device, dtype=torch.int32).view(seqs, -1)
    slots = (tables.view(-1)[:, None] * bs + torch.arange(bs, device=device)).view(-1).long()
    k_cache = torch.empty(blocks * bs, kv_heads, dim, device=device, dtype=dtype)
    v_cache = torch.empty_like(k_cache)
    k_cache[slots], v_cache[slots] = k, v
    qsl = torch.arange(0, T + 1, length, device=device, dtype=torch.int32)
    lens = torch.full((seqs,), length, device=device, dtype=torch.int32)
    paged = (q, k_cache.view(blocks, bs, kv_heads, dim), v_cache.view(blocks, bs, kv_heads, dim), tables, qsl, lens)
    return q, k, v, qsl, paged


def check() -> None:
    """Tiny and ragged-free, for the interpreter: the candidate against the engine's kernel."""
    torch.manual_seed(0)
    for heads, kv_heads in ((4, 2), (2, 2)):
        q, k, v, qsl, paged = inputs(2, 64, heads, kv_heads, 16, torch.float32, "cpu")
        want = paged_attention(*paged, 0.25, 64)
        got = fresh_prefill(q, k, v, qsl, 0.25, config=(32, 16, 4, 2))
        print(heads, kv_heads, (got - want).abs().max().item())
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    if args.check:
        return check()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    rows = []
    seqs, length, dim = 8, 1024, 128
    for name, heads, kv_heads in (("w-small", 16, 8), ("w-large", 32, 8)):
        flops = 4 * seqs * (length * (length + 1) / 2) * dim * heads
        q, k, v, qsl, paged = inputs(seqs, length, heads, kv_heads, dim, torch.bfloat16, "cuda")
        want = paged_attention(*paged, 0.088, length)
        row = {"shape": name, "engine": flops / triton.testing.do_bench(
            lambda: paged_attention(*paged, 0.088, length)) / 1e9}
        for config in [(128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2), (64, 64, 4, 3),
                       (128, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 4), (64, 64, 8, 3)]:
            key = "m{} n{} w{} s{}".format(*config)
            try:
                err = (fresh_prefill(q, k, v, qsl, 0.088, config).float() - want.float()).abs().max().item()
                row[key] = flops / triton.testing.do_bench(lambda: fresh_prefill(q, k, v, qsl, 0.088, config)) / 1e9
                row[key + " err"] = err
            except Exception as e:  # out of resources
                row[key] = f"{type(e).__name__}: {str(e)[:80]}"
        qc, kc, vc = (t.view(seqs, length, -1, dim).transpose(1, 2).contiguous() for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            row["cudnn"] = flops / triton.testing.do_bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                qc, kc, vc, is_causal=True, enable_gqa=True, scale=0.088)) / 1e9
        rows.append(row)
        print(json.dumps({key: round(val, 4 if "err" in key else None) if isinstance(val, float) else val
                          for key, val in row.items()}), flush=True)
    report(rows, args.json, echo=False)


if __name__ == "__main__":
    main()
