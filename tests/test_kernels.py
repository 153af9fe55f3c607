"""Triton kernels against the torch reference (the interpreter on CPU, the GPU where there is one)."""

import pytest
import torch

from llmserve.kernels.cache_write import write_kv
from llmserve.kernels.fused import (rms_norm, rms_norm_reference, rotary, rotary_reference, silu_and_mul,
                                    silu_and_mul_reference)
from llmserve.kernels.paged_attention import paged_attention
from llmserve.kernels import reference
from llmserve.kernels.reference import paged_attention_reference, write_kv_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_batch(query_lens, context_lens, *, block_size, num_kv_heads, group, head_dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    perm = torch.randperm(num_blocks, generator=g)  # scattered, non-contiguous blocks
    tables = torch.zeros(len(seq_lens), max(blocks_needed), dtype=torch.int32)
    k = 0
    for i, n in enumerate(blocks_needed):
        tables[i, :n] = perm[k:k + n]
        k += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    q = torch.randn(sum(query_lens), num_kv_heads * group, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    return (to(q), to(k_cache), to(v_cache), to(tables), to(qsl), to(torch.tensor(seq_lens, dtype=torch.int32)))


CASES = {
    "prefill": ([7, 3], [0, 0]),
    "decode": ([1, 1, 1], [5, 16, 33]),
    "mixed": ([5, 1, 3, 1], [0, 7, 9, 20]),
    "chunk-after-context": ([6], [13]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_paged_attention_matches_reference(case, block_size, group, dtype):
    query_lens, context_lens = CASES[case]
    q, kc, vc, tables, qsl, seq_lens = make_batch(query_lens, context_lens, block_size=block_size, num_kv_heads=2,
                                                  group=group, head_dim=16, dtype=dtype)
    ref = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.25)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.25, max(query_lens), out=out)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_prefill_tiles_below_the_diagonal_skip_the_mask(group, fp8):
    """Query tiles that start past whole key tiles read those unmasked, then the tiles the causal
    diagonal crosses masked: chunks after contexts that do and do not end on a key tile, a query
    tile starting inside a key tile, decode rows and a chunk shorter than one query tile."""
    query_lens, context_lens = [37, 9, 1, 3, 16], [0, 29, 62, 2, 40]
    q, kc, vc, tables, qsl, seq_lens = make_batch(query_lens, context_lens, block_size=4, num_kv_heads=2, group=group,
                                                  head_dim=16, dtype=torch.float32, seed=11)
    scales = {}
    if fp8:
        kc, vc, ks, vs, kc_ref, vc_ref = fp8_cache(kc, vc)
        scales = {"k_scale": ks, "v_scale": vs}
    else:
        kc_ref, vc_ref = kc, vc
    ref = paged_attention_reference(q, kc_ref, vc_ref, tables, qsl, seq_lens, 0.3)
    for tiles, block_m in (((16, 4, 1), 4 * group), ((16, 4, 2), 8 * group), ((32, 4, 1), 4 * group)):
        out = torch.full_like(q, float("nan"))
        paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.3, max(query_lens), out=out, tiles=tiles,
                        block_m=block_m, **scales)
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_paged_attention_head_dim_not_power_of_two():
    q, kc, vc, tables, qsl, seq_lens = make_batch([3, 1], [2, 9], block_size=8, num_kv_heads=1, group=2,
                                                  head_dim=24, dtype=torch.float32)
    ref = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.2)
    out = paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.2, 3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_paged_attention_padded_like_a_cuda_graph():
    """A batch padded the way a captured mixed step is: token rows past the batch's queries and
    sequences with empty queries at the end. The real rows match the reference; nothing else is
    touched, so the padding rows keep whatever they held."""
    query_lens, context_lens = [5, 1, 3, 1], [0, 7, 9, 20]
    q, kc, vc, tables, qsl, seq_lens = make_batch(query_lens, context_lens, block_size=4, num_kv_heads=2,
                                                  group=2, head_dim=16, dtype=torch.float32)
    ref = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.25)
    n, pad_tokens, pad_seqs = q.shape[0], 6, 3
    q_pad = torch.cat([q, torch.randn(pad_tokens, *q.shape[1:], device=DEVICE)])
    qsl_pad = torch.cat([qsl, qsl[-1:].repeat(pad_seqs)])
    lens_pad = torch.cat([seq_lens, torch.ones(pad_seqs, dtype=torch.int32, device=DEVICE)])
    tables_pad = torch.cat([tables, torch.zeros(pad_seqs, tables.shape[1], dtype=torch.int32, device=DEVICE)])
    out = torch.full_like(q_pad, float("nan"))
    paged_attention(q_pad, kc, vc, tables_pad, qsl_pad, lens_pad, 0.25, n + pad_tokens, out=out, block_m=8)
    torch.testing.assert_close(out[:n], ref, atol=1e-5, rtol=1e-5)
    assert out[n:].isnan().all()


@pytest.mark.parametrize("splits", [1, 2])
def test_decode_in_a_given_sequence_order_matches_reference(splits):
    q, kc, vc, tables, qsl, seq_lens = make_batch([1] * 5, [3, 40, 0, 17, 9], block_size=4, num_kv_heads=2, group=2,
                                                  head_dim=16, dtype=torch.float32, seed=4)
    ref = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.3)
    order = torch.argsort(seq_lens, descending=True).to(torch.int32)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.3, 1, out=out, tiles=(16, 4, 1), num_splits=splits,
                    seq_order=order)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_reference_attention_is_causal_softmax():
    """The oracle itself against a dense computation."""
    q, kc, vc, tables, qsl, seq_lens = make_batch([4], [0], block_size=4, num_kv_heads=1, group=1, head_dim=8,
                                                  dtype=torch.float32)
    out = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.5)
    k = kc[tables[0, 0].long()][:, 0].cpu()
    v = vc[tables[0, 0].long()][:, 0].cpu()
    s = (q[:, 0].cpu() @ k.T) * 0.5
    s = s.masked_fill(torch.triu(torch.ones(4, 4, dtype=torch.bool), 1), float("-inf"))
    torch.testing.assert_close(out[:, 0].cpu(), torch.softmax(s, -1) @ v)


@pytest.mark.parametrize("gather", [None, 1])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 5.0)])
def test_reference_decode_rows_are_dense_attention(window, softcap, gather, monkeypatch):
    """The oracle's batched decode rows, beside a prefill row, against one dense computation per
    row; every cache slot no row may read is NaN. gather 1: a pass per row (its memory bound)."""
    if gather is not None:
        monkeypatch.setattr(reference, "_DECODE_GATHER", gather)
    query_lens, context_lens = [1, 3, 1, 1], [4, 5, 16, 21]
    q, kc, vc, tables, qsl, seq_lens = make_batch(query_lens, context_lens, block_size=4, num_kv_heads=2, group=2,
                                                  head_dim=8, dtype=torch.float32)
    q, kc, vc, tables, qsl, seq_lens = (t.cpu() for t in (q, kc, vc, tables, qsl, seq_lens))
    readable = torch.zeros(kc.shape[0] * kc.shape[1], dtype=torch.bool)
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        readable[tables[i, pos // 4].long() * 4 + pos % 4] = True
    for cache in (kc, vc):
        cache.view(-1, 2, 8)[~readable] = float("nan")
    out = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.3, window=window, softcap=softcap)
    for i, n in enumerate(seq_lens.tolist()):
        if query_lens[i] != 1:
            continue
        pos = torch.arange(n)
        slots = tables[i, pos // 4].long() * 4 + pos % 4
        k = kc.view(-1, 2, 8)[slots].repeat_interleave(2, dim=1)
        v = vc.view(-1, 2, 8)[slots].repeat_interleave(2, dim=1)
        s = torch.einsum("hd,khd->hk", q[qsl[i]], k) * 0.3
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if window is not None:
            s[:, pos <= n - 1 - window] = float("-inf")
        torch.testing.assert_close(out[qsl[i]], torch.einsum("hk,khd->hd", torch.softmax(s, -1), v))
    assert not out.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference_and_skips_padding(dtype):
    g = torch.Generator().manual_seed(1)
    key = torch.randn(6, 2, 16, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(6, 2, 16, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 9, 31], device=DEVICE)
    caches = [torch.full((4, 8, 2, 16), 7.0, dtype=dtype, device=DEVICE) for _ in range(4)]
    write_kv_reference(key, value, caches[0], caches[1], slots)
    write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    assert torch.equal(caches[2].view(-1, 2, 16)[17], key[2])
    assert (caches[2].view(-1, 2, 16)[1] == 7.0).all()  # untouched slot


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, with_residual):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(7, 48, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(48, generator=g).to(dtype).to(DEVICE)
    r = torch.randn(7, 48, generator=g).to(dtype).to(DEVICE) if with_residual else None
    got, ref = rms_norm(x, w, 1e-6, r), rms_norm_reference(x, w, 1e-6, r)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    if with_residual:
        torch.testing.assert_close(got[1], ref[1], atol=0, rtol=0)  # the residual sum rounds like transformers
        got, ref = got[0], ref[0]
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotary_matches_reference_in_place_on_strided_views(dtype, qk_norm):
    g = torch.Generator().manual_seed(5)
    T, hq, hk, d = 5, 4, 2, 16
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEVICE)
    angles = torch.arange(64).float()[:, None] * torch.rand(d // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(DEVICE), torch.cat([angles.sin()] * 2, -1).to(DEVICE)
    positions = torch.tensor([0, 3, 9, 10, 63], device=DEVICE)
    views = lambda t: (t[:, :hq * d].view(T, hq, d), t[:, hq * d:(hq + hk) * d].view(T, hk, d))  # noqa: E731
    norms = (torch.randn(d, generator=g).to(dtype).to(DEVICE), torch.randn(d, generator=g).to(dtype).to(DEVICE),
             1e-6) if qk_norm else ()
    a, b = qkv.clone(), qkv.clone()
    rotary(*views(a), positions, cos, sin, *norms)
    rotary_reference(*views(b), positions, cos, sin, *norms)
    tol = (1e-5 if qk_norm else 1e-6) if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    if qk_norm:  # one pass == the rms_norm kernel on each head, then rotary
        c = qkv.clone()
        q, k = views(c)
        q.copy_(rms_norm(q, norms[0], 1e-6))
        k.copy_(rms_norm(k, norms[1], 1e-6))
        rotary(q, k, positions, cos, sin)
        torch.testing.assert_close(a, c, atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=0)
    assert torch.equal(a[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [40, 2 * 1024 + 40])  # one column block; three, the last partial
def test_silu_and_mul_matches_reference(dtype, width):
    x = torch.randn(3, 2 * width, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=tol, rtol=tol)


def assert_fp8_equal(a, b):
    """Bit-equal on the GPU. Triton's interpreter (3.9) converts some float32 values to e4m3 wrongly
    when rounding carries into the exponent (124.5 -> 64 instead of 128), so on the CPU a few
    elements may differ; the GPU run of this test is the exact check."""
    diff = (a.view(torch.uint8) != b.view(torch.uint8)).sum().item()
    assert diff == 0 if DEVICE == "cuda" else diff <= max(2, a.numel() // 50), f"{diff} of {a.numel()} differ"


def fp8_cache(k_cache, v_cache):
    """The same cache contents quantized as the FP8 write would store them, plus the dequantized copy."""
    from llmserve.kernels.reference import quantize_kv_reference
    (kq, ks), (vq, vs) = quantize_kv_reference(k_cache), quantize_kv_reference(v_cache)
    deq = lambda q, s: (q.float() * s[..., None]).to(k_cache.dtype)  # noqa: E731
    return kq, vq, ks, vs, deq(kq, ks), deq(vq, vs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["mixed", "decode"])
def test_paged_attention_fp8_cache_matches_dequantized_reference(case, dtype):
    q, kc, vc, tables, qsl, seq_lens = make_batch(*CASES[case], block_size=4, num_kv_heads=2, group=2,
                                                  head_dim=16, dtype=dtype, seed=5)
    kq, vq, ks, vs, k_deq, v_deq = fp8_cache(kc * 3, vc)
    ref = paged_attention_reference(q, k_deq, v_deq, tables, qsl, seq_lens, 0.25)
    assert torch.allclose(paged_attention_reference(q, kq, vq, tables, qsl, seq_lens, 0.25, ks, vs), ref,
                          atol=1e-5 if dtype == torch.float32 else 2e-3)
    out = paged_attention(q, kq, vq, tables, qsl, seq_lens, 0.25, max(CASES[case][0]), k_scale=ks, v_scale=vs)
    atol = 1e-4 if dtype == torch.float32 else 2e-2  # fp16 kernels feed fp16 probabilities to the dot
    assert torch.allclose(out.float(), ref.float(), atol=atol)
    # FP8 is close to the unquantized cache, not equal: e4m3 keeps 3 mantissa bits.
    exact = paged_attention_reference(q, kc * 3, vc, tables, qsl, seq_lens, 0.25)
    assert 0 < (out.float() - exact.float()).abs().max() < 0.25


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
def test_rotary_and_write_kv_is_rotary_then_write_kv(dtype, qk_norm, fp8):
    from llmserve.kernels.fused import rotary_and_write_kv
    g = torch.Generator().manual_seed(8)
    T, hq, hk, d = 5, 4, 2, 16
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEVICE) * 2
    angles = torch.arange(64).float()[:, None] * torch.rand(d // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(DEVICE), torch.cat([angles.sin()] * 2, -1).to(DEVICE)
    positions = torch.tensor([0, 3, 9, 10, 63], device=DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 30], device=DEVICE)  # -1: padding, stores nothing
    views = lambda t: (t[:, :hq * d].view(T, hq, d), t[:, hq * d:(hq + hk) * d].view(T, hk, d),  # noqa: E731
                       t[:, (hq + hk) * d:].view(T, hk, d))
    norms = (torch.randn(d, generator=g).to(dtype).to(DEVICE), torch.randn(d, generator=g).to(dtype).to(DEVICE),
             1e-6) if qk_norm else ()
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    caches = [torch.zeros((4, 8, hk, d), dtype=cache_dtype, device=DEVICE) for _ in range(4)]
    scales = [torch.full((4, 8, hk), -1.0, device=DEVICE) if fp8 else None for _ in range(4)]
    a, b = qkv.clone(), qkv.clone()
    q, k, v = views(a)
    rotary(q, k, positions, cos, sin, *norms)
    write_kv(k, v, caches[0], caches[1], slots, scales[0], scales[1])
    q, k, v = views(b)
    rotary_and_write_kv(q, k, v, positions, cos, sin, caches[2], caches[3], slots, scales[2], scales[3], *norms)
    assert torch.equal(a[:, :hq * d], b[:, :hq * d])  # the same rotated queries, bit for bit
    assert torch.equal(b[:, hq * d:], qkv[:, hq * d:])  # k and v themselves untouched
    for x, y in ((0, 2), (1, 3)):
        if fp8:
            assert_fp8_equal(caches[x], caches[y])
            assert torch.equal(scales[x], scales[y])
        else:
            assert torch.equal(caches[x], caches[y])
    assert not caches[2].view(-1, hk, d)[[1, 2, 31]].float().any()  # slots nobody wrote (padding included)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_fp8_quantizes_per_token_and_head_like_the_reference(dtype):
    g = torch.Generator().manual_seed(2)
    key = (torch.randn(5, 2, 16, generator=g) * torch.tensor([0.01, 300.0])[None, :, None]).to(dtype).to(DEVICE)
    value = torch.randn(5, 2, 16, generator=g).to(dtype).to(DEVICE)
    slots = torch.tensor([3, -1, 17, 0, 30], device=DEVICE)
    caches = [torch.zeros((4, 8, 2, 16), dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(4)]
    scales = [torch.full((4, 8, 2), -1.0, device=DEVICE) for _ in range(4)]
    write_kv_reference(key, value, caches[0], caches[1], slots, scales[0], scales[1])
    write_kv(key, value, caches[2], caches[3], slots, scales[2], scales[3])
    for a, b in ((0, 2), (1, 3)):
        assert_fp8_equal(caches[a], caches[b])
        assert torch.allclose(scales[a], scales[b], rtol=1e-6)
    assert scales[2].view(-1, 2)[1].tolist() == [-1.0, -1.0]  # padding token wrote nothing
    restored = caches[2].view(-1, 2, 16)[17].float() * scales[2].view(-1, 2)[17][:, None]
    # per-head scales: the tiny head (0.01) keeps its relative precision next to the huge one (300)
    assert torch.allclose(restored, key[2].float(), rtol=0.07, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_dense_matmul_matches_reference(gated, dtype):
    """Plain (with a bias) and gated (silu(gate) * up from the merged [gate; up] weight), over masked
    M, N and K edges, one and several N tiles, and split-K whose counters must reset between calls."""
    from llmserve.kernels.matmul import dense_matmul, dense_matmul_reference
    g = torch.Generator().manual_seed(7)
    w = (torch.randn(2 * 40 if gated else 40, 96, generator=g) / 8).to(dtype).to(DEVICE)
    bias = None if gated else torch.randn(40, generator=g).to(dtype).to(DEVICE)
    for M, config, split_k in [(1, (16, 32, 64, 4, 1), 1), (5, None, None), (19, (16, 16, 32, 4, 1), 3),
                               (19, (16, 16, 32, 4, 1), 3)]:
        x = torch.randn(M, 96, generator=g).to(dtype).to(DEVICE)
        ref = dense_matmul_reference(x.float(), w.float(), None if bias is None else bias.float(), gated)
        out = dense_matmul(x, w, bias, gated, config=config, split_k=split_k)
        assert out.dtype == dtype and out.shape == (M, 40)
        assert torch.allclose(out.float(), ref, rtol=1e-2 if dtype == torch.float16 else 1e-5, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gated_matmul_matches_reference(dtype):
    """The TMA gate_up kernel: ragged M and N edges (the last gate tile reaches into the up rows,
    the last up tile past the weight: neither may show), several K steps, a persistent grid with
    fewer programs than tiles (the interpreter's one "SM") and one program per tile."""
    from llmserve.kernels.matmul import dense_matmul_reference, gated_matmul
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(2 * 40, 96, generator=g) / 8).to(dtype).to(DEVICE)
    for M, config, persistent in [(1, (16, 16, 32, 4, 2, 2), True), (37, (16, 32, 32, 4, 2, 2), True),
                                  (37, (32, 16, 16, 4, 3, 1), False)]:
        x = torch.randn(M, 96, generator=g).to(dtype).to(DEVICE)
        out = gated_matmul(x, w, config, persistent)
        ref = dense_matmul_reference(x.float(), w.float(), gated=True)
        assert out.dtype == dtype and out.shape == (M, 40)
        assert torch.allclose(out.float(), ref, rtol=1e-2 if dtype == torch.float16 else 1e-5, atol=1e-2)


@pytest.mark.gpu
def test_gated_matmul_takes_prefill_batches_and_matches_cublas():
    """bf16 at the rows the engine hands it, W-small's and a wider layer: within bf16 rounding of
    cuBLAS + SiLU·mul (the same roundings, only the sums' order differs)."""
    from llmserve.kernels.fused import silu_and_mul
    from llmserve.kernels.matmul import gated_matmul, gated_takes
    g = torch.Generator(device="cuda").manual_seed(12)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    for N, K in ((3072, 1024), (5000, 2048)):
        w = torch.randn(2 * N, K, device="cuda", generator=g).bfloat16() * 0.02
        for M in (2048, 3001):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            assert gated_takes(x, w) == hopper
            torch.testing.assert_close(gated_matmul(x, w), silu_and_mul(torch.nn.functional.linear(x, w)),
                                       rtol=1.6e-2, atol=1e-2)
    assert not gated_takes(x[:128], w)  # the decode kernel's rows
    assert gated_takes(x[:1024], w) == hopper  # 8 x 40 tiles: two waves of an H100's 132 SMs
    assert not gated_takes(x[:1024], w[:2 * 3072])  # 8 x 24 tiles: fewer
    assert not gated_takes(x.float(), w.float())
    odd = torch.zeros(2 * 5004, K, device="cuda", dtype=torch.bfloat16)
    assert not gated_takes(x, odd)  # output rows of 5,004 bf16: not a multiple of 16 bytes
    assert not gated_takes(x[:, :K - 8], w[:, :K - 8])  # rows not contiguous: a TMA descriptor needs them so
    assert not gated_takes(x.view(-1)[4:4 + 2048 * (K - 8)].view(2048, K - 8), w[:, :K - 8].contiguous())  # 8-byte aligned


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("M", [1, 5, 70])
def test_int8_matmul_matches_reference(M, dtype):
    from llmserve.kernels.int8_matmul import int8_matmul, int8_matmul_reference, quantize_int8_rows
    g = torch.Generator().manual_seed(M)
    w, scale = quantize_int8_rows(torch.randn(48, 96, generator=g))
    x = torch.randn(M, 96, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    w, scale, x, bias = w.to(DEVICE), scale.to(DEVICE), x.to(DEVICE), bias.to(DEVICE)
    ref = int8_matmul_reference(x, w, scale, bias)
    # small tiles so the interpreter also walks several K steps and N tiles with masked edges
    for config, split_k in [((16, 32, 64, 4, 1), None), (None, None), ((16, 32, 32, 4, 1), 3)]:
        if split_k and M > 16:
            continue
        out = int8_matmul(x, w, scale, bias, config=config, split_k=split_k)  # split-K twice: counters reset
        out = int8_matmul(x, w, scale, bias, config=config, split_k=split_k)
        assert out.dtype == dtype and out.shape == (M, 48)
        assert torch.allclose(out.float(), ref.float(), rtol=1e-3 if dtype == torch.float16 else 1e-5, atol=1e-2)


@pytest.mark.gpu
def test_decode_matmul_takes_hopper_decode_batches_and_matches_cublas():
    """W-small's layer shapes at the decode batches the kernel takes, bf16: within bf16 rounding of
    F.linear (+ SiLU·mul), with the default tiles and split-K (the o and down projections)."""
    from llmserve.kernels.fused import silu_and_mul
    from llmserve.kernels.matmul import DECODE_MAX_M, GATED_MAX_M, SMALL_M, dense_matmul, takes
    g = torch.Generator(device="cuda").manual_seed(8)
    for (N, K), gated in [((4096, 1024), False), ((1024, 2048), False), ((6144, 1024), True), ((1024, 3072), False)]:
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16() * 0.02
        for M in (1, 16, 48, DECODE_MAX_M):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            assert takes(x, w) == (torch.cuda.get_device_capability() >= (9, 0))
            ref = torch.nn.functional.linear(x, w)
            ref = silu_and_mul(ref) if gated else ref
            for _ in range(2):  # split-K counters reset
                out = dense_matmul(x, w, gated=gated)
                torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1e-2)
    x = torch.zeros(4, 4096, device="cuda", dtype=torch.bfloat16)
    assert not takes(torch.zeros(DECODE_MAX_M + 1, 1024, device="cuda", dtype=torch.bfloat16), w)
    assert not takes(x.float(), w.float())  # float32: cuBLAS
    # 32 MB (an 8B model's o): cuBLAS past SMALL_M rows
    assert not takes(torch.zeros(SMALL_M + 1, 4096, device="cuda", dtype=torch.bfloat16),
                     torch.zeros(4096, 4096, device="cuda", dtype=torch.bfloat16))
    # at small batches, an 8B model's larger matrices: qkv at TP = 2 (25 MB) and down (59 MB), split
    # in K; gate_up at TP = 2 (117 MB) gated; not down whole (117 MB) nor gate_up whole (235 MB)
    hopper = torch.cuda.get_device_capability() >= (9, 0)
    for (N, K), gated in [((3072, 4096), False), ((4096, 7168), False), ((2 * 7168, 4096), True)]:
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16() * 0.02
        most = GATED_MAX_M if gated else SMALL_M
        for M in (1, most):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            assert takes(x, w, gated=gated) == hopper
            ref = torch.nn.functional.linear(x, w)
            for _ in range(2):  # split-K counters reset
                torch.testing.assert_close(dense_matmul(x, w, gated=gated), silu_and_mul(ref) if gated else ref,
                                           rtol=1.6e-2, atol=1e-2)
        assert not takes(torch.zeros(most + 1, K, device="cuda", dtype=torch.bfloat16), w, gated=gated)
    assert not takes(x, torch.zeros(4096, 14336, device="cuda", dtype=torch.bfloat16))
    one_row = torch.zeros(1, 9728, device="cuda", dtype=torch.bfloat16)  # a 4B model's down (50 MB, 2560 outputs)
    assert not takes(one_row, torch.zeros(2560, 9728, device="cuda", dtype=torch.bfloat16))
    assert not takes(x, torch.zeros(2 * 14336, 4096, device="cuda", dtype=torch.bfloat16), gated=True)


@pytest.mark.gpu
def test_fp8_matmul_on_tensor_cores_matches_the_float32_emulation():
    from llmserve.kernels.fp8 import fp8_matmul, fp8_matmul_reference, quantize_fp8_rows
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("no FP8 tensor cores")
    g = torch.Generator().manual_seed(6)
    wq, ws = quantize_fp8_rows(torch.randn(256, 512, generator=g).cuda())
    bias = torch.randn(256, generator=g).cuda().bfloat16()
    for M in (1, 7, 300):
        x = torch.randn(M, 512, generator=g).cuda().bfloat16()
        ref = fp8_matmul_reference(x, wq, ws, bias).float()
        out = fp8_matmul(x, wq, ws, bias).float()
        assert torch.allclose(out, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.gpu
def test_fp8_weight_quantization_is_the_same_on_cpu_and_gpu():
    from llmserve.kernels.fp8 import quantize_fp8_rows
    w = torch.randn(512, 1024, generator=torch.Generator().manual_seed(7)).bfloat16() * 0.02
    (qc, sc), (qg, sg) = quantize_fp8_rows(w), quantize_fp8_rows(w.cuda())
    assert torch.equal(sc, sg.cpu())
    differ = (qc.view(torch.uint8) != qg.cpu().view(torch.uint8))
    assert differ.sum() == 0, (differ.sum().item(), qc[differ][:5].float().tolist(), qg.cpu()[differ][:5].float().tolist(),
                               (w.float() / sc[:, None])[differ][:5].tolist())


def test_quantize_int8_rows_round_trips_within_half_a_step():
    from llmserve.kernels.int8_matmul import quantize_int8_rows
    w = torch.randn(8, 64) * torch.logspace(-3, 2, 8)[:, None]
    q, scale = quantize_int8_rows(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_per_token_fp8_matches_reference(dtype):
    from llmserve.kernels.fp8 import per_token_fp8, per_token_fp8_reference
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(5, 40, generator=g) * torch.tensor([1e-3, 1.0, 50.0, 0.0, 3.0])[:, None]).to(dtype).to(DEVICE)
    q, s = per_token_fp8(x)
    q_ref, s_ref = per_token_fp8_reference(x)
    assert s.shape == (5, 1) and torch.allclose(s, s_ref, rtol=1e-6)
    assert_fp8_equal(q, q_ref)
    assert q.float().abs().amax(1)[[0, 1, 2, 4]].eq(448).all() and q[3].float().eq(0).all()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("splits", [2, 4])
def test_split_kv_decode_matches_reference(splits, fp8):
    """Decode steps cut into key slices merged by log-sum-exp: same result as one pass, also when
    some slices of short sequences hold no keys."""
    q, kc, vc, tables, qsl, seq_lens = make_batch([1, 1, 1, 1], [40, 3, 0, 77], block_size=4, num_kv_heads=2, group=2,
                                                  head_dim=16, dtype=torch.float32, seed=9)
    k_scale = v_scale = None
    if fp8:
        kc, vc, k_scale, v_scale, k_deq, v_deq = fp8_cache(kc, vc)
        ref = paged_attention_reference(q, k_deq, v_deq, tables, qsl, seq_lens, 0.3)
    else:
        ref = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.3)
    out = paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.3, 1, k_scale=k_scale, v_scale=v_scale,
                          tiles=(16, 4, 1), num_splits=splits)
    assert torch.allclose(out, ref, atol=1e-4 if not fp8 else 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("case", ["decode", "mixed", "chunk-after-context", "long"])
def test_sliding_window_attention_matches_reference(case, window, group, dtype):
    """Each query sees its `window` latest keys: prefill tiles whose first rows see nothing of a
    tile, decode steps (split or not) from the window's first key."""
    query_lens, context_lens = CASES[case] if case != "long" else ([40, 1, 1], [0, 70, 3])
    q, kc, vc, tables, qsl, seq_lens = make_batch(query_lens, context_lens, block_size=4, num_kv_heads=2,
                                                  group=group, head_dim=16, dtype=dtype)
    ref = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.25, window=window)
    full = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.25)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    for splits in ([None, 4] if max(query_lens) == 1 else [None]):
        out = torch.full_like(q, float("nan"))
        paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.25, max(query_lens), out=out, window=window,
                        num_splits=splits, block_m=16)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    if max(s for s in seq_lens.tolist()) > window:
        assert not torch.allclose(ref.float(), full.float(), atol=1e-3)  # the window does cut keys here


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("case", ["decode", "mixed", "prefill"])
def test_soft_capped_scores_match_reference(case, window):
    """Gemma 2's logit soft-capping (scaled scores through 2 * tanh(x / 2) here, so the cap bites)."""
    query_lens, context_lens = CASES[case]
    q, kc, vc, tables, qsl, seq_lens = make_batch(query_lens, context_lens, block_size=4, num_kv_heads=2,
                                                  group=2, head_dim=16, dtype=torch.float32)
    q = q * 4  # scores well past the cap
    ref = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.25, window=window, softcap=2.0)
    assert not torch.allclose(ref, paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.25, window=window))
    for splits in ([None, 4] if max(query_lens) == 1 else [None]):
        out = paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.25, max(query_lens), window=window, softcap=2.0,
                              num_splits=splits)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("splits", [None, 2, 4])
@pytest.mark.parametrize("group", [1, 4])
def test_short_queries_take_a_program_per_sequence_in_key_slices(group, splits, window):
    """A step checking drafts (each sequence a few queries after its context) runs like a decode
    step: a program per sequence, its keys in slices. The last slice of the 50-key sequence holds
    keys 48 and 49 alone, which its first query (position 45) must not see: a slice without a key
    for a row weighs nothing. Padding sequences with empty queries (as a captured step has) are left
    alone."""
    query_lens, context_lens = [5, 1, 3, 2, 0], [45, 7, 70, 0, 0]
    q, kc, vc, tables, qsl, seq_lens = make_batch(query_lens, context_lens, block_size=4, num_kv_heads=2, group=group,
                                                  head_dim=16, dtype=torch.float32, seed=5)
    seq_lens[-1] = 1
    ref = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.3, window=window)
    out = torch.full_like(q, float("nan"))
    paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.3, max(query_lens), out=out, tiles=(16, 4, 1),
                    num_splits=splits, window=window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
