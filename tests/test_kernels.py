"""Triton kernels against the torch reference (the interpreter on CPU, the GPU where there is one)."""

import pytest
import torch

from llmserve.kernels.cache_write import write_kv
from llmserve.kernels.paged_attention import paged_attention
from llmserve.kernels.reference import paged_attention_reference, write_kv_reference
from llmserve.kernels.sampling import (SLICE, row_keys, sample_filtered_rows, sample_filtered_rows_reference,
                                       sample_rows, sample_rows_reference)

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


# bfloat16 only on the GPU: the interpreter computes it wrongly.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_sample_rows_matches_reference(dtype):
    """Three slices of the vocabulary a row (SLICE entries each), greedy rows with ties across
    slices, temperatures from 0.5 to 2, a row whose weight sits in one token of the last slice."""
    g = torch.Generator().manual_seed(3)
    vocab = 2 * SLICE + 7000
    logits = (torch.randn(8, vocab, generator=g) * 3).to(dtype)
    logits[6] = -5.0
    logits[6, [2 * SLICE + 100, 40, SLICE + 9]] = 4.0  # a tie across slices: the smallest index wins, as in torch.argmax
    logits[7] = float("-inf")
    logits[7, vocab - 1] = 1.0  # the only token of nonzero weight
    logits = logits.to(DEVICE)
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 0.6, 0.0, 0.7], device=DEVICE)
    keys = row_keys(torch.tensor([1, 2, 3, 3, 2**62, 9, 4, 5], device=DEVICE),
                    torch.tensor([0, 0, 0, 1, 5, 0, 0, 2], device=DEVICE))
    out = sample_rows(logits, temperature, keys)
    assert out.tolist() == sample_rows_reference(logits, temperature, keys).tolist()
    assert out[0] == logits[0].float().argmax() and out[6] == 40 and out[7] == vocab - 1
    assert len(set(out[1:6].tolist())) >= 3  # different keys, different draws
    alone = sample_rows(logits[2:4].clone(), temperature[2:4].clone(), keys[2:4].clone())
    assert alone.tolist() == out[2:4].tolist()  # a row's draw is its own, whatever the batch


def _unhash32(h: int) -> int:
    """The input that kernels/sampling.py's 32-bit hash maps to h (the hash is a bijection)."""
    from llmserve.kernels.sampling import _M1, _M2
    mask = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * pow(_M2, -1, 2**32)) & mask
    h ^= (h >> 15) ^ (h >> 30)
    h = (h * pow(_M1, -1, 2**32)) & mask
    return h ^ (h >> 16)


def test_sample_rows_never_draws_a_token_of_zero_weight_at_either_end_of_u():
    """u at its largest (the salted key hashes to 0xFFFFFFFF) lands on the last token of nonzero
    weight, u at its smallest on the first, whatever the -inf logits around them."""
    from llmserve.kernels.sampling import _U_SALT, _hash32_torch, uniform_reference
    keys = torch.tensor([_unhash32(0xFFFFFFFF) ^ _U_SALT, _unhash32(0) ^ _U_SALT], device=DEVICE)
    assert _hash32_torch(keys.cpu() ^ _U_SALT).tolist() == [0xFFFFFFFF, 0]
    u = uniform_reference(keys)
    assert 0 < u[1] < u[0] < 1
    logits = torch.zeros(2, 64, device=DEVICE)
    logits[:, :3] = float("-inf")
    logits[:, 50:] = float("-inf")
    for pick in (sample_rows, sample_rows_reference):
        assert pick(logits, torch.ones(2, device=DEVICE), keys).tolist() == [49, 3]


def test_sample_rows_samples_the_softmax():
    """The mass in four tokens at the edges of two slices, temperature 0.5: frequencies over
    2,000 keys (the kernel on the GPU; the reference, which the CPU backend samples with, here:
    the interpreter would take minutes, and the kernel's draws match the reference's in the test below)."""
    n = 2000
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.full((n, SLICE + 50), float("-inf"))
    where = torch.tensor([5, SLICE - 1, SLICE, SLICE + 49])
    logits[:, where] = torch.log(probs)
    keys = row_keys(torch.arange(n), torch.zeros(n, dtype=torch.int64))
    pick = sample_rows if DEVICE == "cuda" else sample_rows_reference
    out = pick(logits.to(DEVICE), torch.full((n,), 0.5, device=DEVICE), keys.to(DEVICE)).cpu()
    freq = torch.stack([(out == w).float().mean() for w in where])
    want = probs ** 2 / (probs ** 2).sum()  # temperature 0.5 squares the probabilities
    assert torch.allclose(freq, want, atol=0.035) and freq.sum() == 1


def test_sample_rows_walks_to_the_token_inside_its_slice():
    """Small tiles (slices of 256, blocks of 64) so that the interpreter runs many rows: the kernel's
    token equals the reference's for every row, wherever u falls in the row's slices and blocks."""
    g = torch.Generator().manual_seed(5)
    n, vocab = 48, 1000
    logits = (torch.randn(n, vocab, generator=g) * 2).to(DEVICE)
    logits[::3, 300:700] = float("-inf")  # whole blocks and a whole slice of zero weight
    temperature = torch.full((n,), 0.8, device=DEVICE)
    keys = row_keys(torch.arange(n, device=DEVICE) * 7919, torch.zeros(n, dtype=torch.int64, device=DEVICE))
    out = sample_rows(logits, temperature, keys, tiles=(256, 64))
    assert out.tolist() == sample_rows_reference(logits, temperature, keys).tolist()
    assert len({int(t) // 256 for t in out}) == 4 and not ((out[::3] >= 300) & (out[::3] < 700)).any()


@pytest.mark.parametrize("dtype,tiles,split_rounds", [
    (torch.float32, None, 3), (torch.float16, None, 3), (torch.float32, (512, 128, 4), 1),
    (torch.float32, (512, 128, 4), 3)] + ([(torch.bfloat16, None, 3)] if DEVICE == "cuda" else []))
def test_sample_filtered_rows_matches_reference(dtype, tiles, split_rounds):
    """Flat rows (random weights: a small top_k takes several rounds), peaked rows (one round),
    min_p, ties at the threshold, negative and -inf logits, rows not asked for left alone; the
    kernels' token is the reference's in every row, and each is one the filters keep. With slices
    of 512 the rows are cut into five and the draw is made slice by slice; after one split round
    the flat rows finish in a program of their own."""
    g = torch.Generator().manual_seed(11)
    n, vocab = 31, 2500
    logits = torch.randn(n, vocab, generator=g)
    logits[3:6] *= 6  # peaked
    logits[6, :] = -3.0
    logits[6, [7, 1200, 2400]] = 2.0  # three tied top tokens: top_k 2 keeps all three
    logits[7, 1000:] = float("-inf")
    logits[8] = float("-inf")  # no token of nonzero weight: token 0
    logits[10:30] = -9.0
    logits[10:30, [3, 1500, 2000]] = torch.tensor([2.5, 2.25, 2.0])  # top_k 2 / top_p 0.5 cut a third of the mass
    logits = logits.to(dtype).to(DEVICE)
    f = lambda *v: torch.tensor(v, device=DEVICE)  # noqa: E731
    temperature = f(1.0, 0.6, 1.3, 1.0, 0.7, 1.0, 1.0, 0.9, 1.0, 0.0, *[1.0] * 21).float()
    top_k = f(5, vocab, 40, 20, vocab, 3, 2, 30, vocab, 5, *[2] * 10, *[vocab] * 11)
    top_p = f(1.0, 0.9, 0.95, 0.95, 0.5, 1.0, 1.0, 0.8, 1.0, 0.9, *[1.0] * 10, *[0.5] * 11).float()
    min_p = f(0.0, 0.0, 0.0, 0.0, 0.0, 0.1, 0.0, 0.0, 0.3, 0.0, *[0.0] * 21).float()
    keys = row_keys(torch.arange(n, device=DEVICE) * 31 + 7, torch.zeros(n, dtype=torch.int64, device=DEVICE))
    rows = f(*range(30))  # not 30; 9 is greedy
    out = sample_filtered_rows(logits, temperature, top_k, top_p, min_p, keys, rows, torch.full((n,), -1, device=DEVICE),
                               tiles=tiles, split_rounds=split_rounds)
    ref = sample_filtered_rows_reference(logits.cpu(), temperature.cpu(), top_k.cpu(), top_p.cpu(), min_p.cpu(),
                                         keys.cpu(), rows.cpu(), torch.full((n,), -1))
    assert out.tolist() == ref.tolist()
    assert out[30] == -1 and out[9] == -1 and out[8] == 0  # not asked for; greedy; all -inf
    from test_sampler import kept_by_sorting
    x = logits.float().cpu()
    keep = kept_by_sorting(x, temperature.cpu().clamp(min=0.1), top_k.cpu(), top_p.cpu(), min_p.cpu())
    for r in [*range(8), *range(10, 30)]:
        assert keep[r, out[r]], r
    assert out[6] in (7, 1200, 2400) and out[7] < 1000
    assert set(out[10:30].tolist()) == {3, 1500}


_COMPILE_FOR_H100 = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llmserve.kernels import sampling
types = {"logits_ptr": "*bf16", "rows_ptr": "*i64", "topk_ptr": "*i64", "key_ptr": "*i64", "out_ptr": "*i64",
         "kmax_ptr": "*i32", "istate_ptr": "*i32", "q_ptr": "*i32", "count_ptr": "*i32"}
consts = dict(SLICE=8192, BLOCK=2048, PDL=True, SLICES_P=32, PIVOTS=4, FIRST=True, MAX_ROUNDS=64)
for fn in (sampling._filter_top_kernel, sampling._filter_setup_kernel, sampling._in_play_kernel,
           sampling._candidate_kernel, sampling._pivot_count_kernel, sampling._decide_kernel, sampling._finish_kernel):
    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in consts else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
                 for n in names}
    source = ASTSource(fn, signature, {(names.index(k),): v for k, v in consts.items() if k in names}, {})
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["cubin"]
"""


def test_filtered_sampler_kernels_compile_for_an_h100():
    """The interpreter runs the kernels as Python, not through Triton's compiler: a kernel it runs
    may still not compile (a loop-carried variable that started as a literal did not). Each kernel
    of the filtered sampler, compiled for sm_90 with the launch's constants; no GPU needed (a fresh
    interpreter: this one's kernels are the interpreter's)."""
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_H100], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_sample_filtered_rows_samples_the_kept_distribution():
    """top_k 3 of a flat 20,000-token row plus top_p 0.5 of a peaked one: frequencies over 3,000
    keys (the kernel on the GPU, the reference elsewhere: the interpreter would take minutes)."""
    n, vocab = 3000, 20000
    g = torch.Generator().manual_seed(2)
    flat = torch.randn(vocab, generator=g) * 0.1
    flat[[5, 9000, 19999]] = 2.0 + torch.tensor([0.0, 0.3, 0.6])  # the top three
    peaked = torch.full((vocab,), -20.0)
    peaked[[1, 2, 3, 4]] = torch.tensor([3.0, 2.0, 1.0, 0.0])
    logits = torch.stack([flat, peaked]).repeat(n // 2, 1)
    temperature = torch.ones(n)
    top_k = torch.tensor([3, vocab]).repeat(n // 2)
    top_p = torch.tensor([1.0, 0.5]).repeat(n // 2)
    keys = row_keys(torch.arange(n), torch.zeros(n, dtype=torch.int64))
    pick = sample_filtered_rows if DEVICE == "cuda" else sample_filtered_rows_reference
    args = [t.to(DEVICE) for t in (logits, temperature, top_k, top_p, torch.zeros(n), keys, torch.arange(n))]
    out = pick(*args, torch.zeros(n, dtype=torch.int64, device=DEVICE)).cpu()
    top3 = torch.softmax(torch.tensor([2.0, 2.3, 2.6]), 0)
    freq = torch.stack([(out[0::2] == t).float().mean() for t in (5, 9000, 19999)])
    assert torch.allclose(freq, top3, atol=0.04) and freq.sum() == 1
    # p(1) = 0.64 of the peaked row's mass >= 0.5: top_p keeps token 1 alone
    assert (out[1::2] == 1).all()


from llmserve.kernels.fused import (rms_norm, rms_norm_reference, rotary, rotary_reference,  # noqa: E402
                                    silu_and_mul, silu_and_mul_reference)


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
def test_silu_and_mul_matches_reference(dtype):
    x = torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
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
    from llmserve.kernels.matmul import DECODE_MAX_M, dense_matmul, takes
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
    assert not takes(x, torch.zeros(4096, 4096, device="cuda", dtype=torch.bfloat16))  # 32 MB: an 8B model's


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
