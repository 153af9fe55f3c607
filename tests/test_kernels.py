"""Triton kernels against the torch reference (the interpreter on CPU, the GPU where there is one)."""

import pytest
import torch

from llmserve.kernels.cache_write import write_kv
from llmserve.kernels.paged_attention import paged_attention
from llmserve.kernels.reference import paged_attention_reference, write_kv_reference
from llmserve.kernels.sampling import gumbel_argmax, gumbel_argmax_reference, row_keys

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


def test_paged_attention_head_dim_not_power_of_two():
    q, kc, vc, tables, qsl, seq_lens = make_batch([3, 1], [2, 9], block_size=8, num_kv_heads=1, group=2,
                                                  head_dim=24, dtype=torch.float32)
    ref = paged_attention_reference(q, kc, vc, tables, qsl, seq_lens, 0.2)
    out = paged_attention(q, kc, vc, tables, qsl, seq_lens, 0.2, 3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gumbel_argmax_matches_reference(dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, 3000, generator=g) * 3).to(dtype).to(DEVICE)
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.0, 2.0, 0.0], device=DEVICE)
    keys = row_keys(torch.tensor([1, 2, 3, 3, 2**62, 9], device=DEVICE), torch.tensor([0, 0, 0, 1, 5, 0], device=DEVICE))
    out = gumbel_argmax(logits, temperature, keys)
    assert out.tolist() == gumbel_argmax_reference(logits, temperature, keys).tolist()
    assert out[0] == logits[0].float().argmax() and out[5] == logits[5].float().argmax()
    assert out[2] != out[3] or out[1] != out[2]  # different keys, different draws


def test_gumbel_argmax_samples_the_softmax():
    n, v = 2000, 4
    logits = torch.log(torch.tensor([0.1, 0.2, 0.3, 0.4])).repeat(n, 1).to(DEVICE)
    keys = row_keys(torch.arange(n, device=DEVICE), torch.zeros(n, dtype=torch.int64, device=DEVICE))
    out = gumbel_argmax(logits, torch.ones(n, device=DEVICE), keys)
    freq = torch.bincount(out.cpu(), minlength=v).float() / n
    assert torch.allclose(freq, torch.tensor([0.1, 0.2, 0.3, 0.4]), atol=0.035)


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
def test_rotary_matches_reference_in_place_on_strided_views(dtype):
    g = torch.Generator().manual_seed(5)
    T, hq, hk, d = 5, 4, 2, 16
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEVICE)
    angles = torch.arange(64).float()[:, None] * torch.rand(d // 2, generator=g)[None, :]
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(DEVICE), torch.cat([angles.sin()] * 2, -1).to(DEVICE)
    positions = torch.tensor([0, 3, 9, 10, 63], device=DEVICE)
    views = lambda t: (t[:, :hq * d].view(T, hq, d), t[:, hq * d:(hq + hk) * d].view(T, hk, d))  # noqa: E731
    a, b = qkv.clone(), qkv.clone()
    rotary(*views(a), positions, cos, sin)
    rotary_reference(*views(b), positions, cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    assert torch.equal(a[:, (hq + hk) * d:], qkv[:, (hq + hk) * d:])  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul_matches_reference(dtype):
    x = torch.randn(6, 2 * 40, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul_reference(x), atol=tol, rtol=tol)
