"""The sampling kernels against their torch references (the interpreter on CPU, the GPU where there
is one): the inverse-transform draw and the filtered (top-k / top-p / min-p) draw."""

import pytest
import torch

from llmserve.kernels.sampling import SLICE, sample_filtered_rows, sample_rows
from llmserve.kernels.sampling_reference import row_keys, sample_filtered_rows_reference, sample_rows_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

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
    from llmserve.kernels.sampling_reference import _M1, _M2
    mask = 0xFFFFFFFF
    h ^= h >> 16
    h = (h * pow(_M2, -1, 2**32)) & mask
    h ^= (h >> 15) ^ (h >> 30)
    h = (h * pow(_M1, -1, 2**32)) & mask
    return h ^ (h >> 16)


def test_sample_rows_never_draws_a_token_of_zero_weight_at_either_end_of_u():
    """u at its largest (the salted key hashes to 0xFFFFFFFF) lands on the last token of nonzero
    weight, u at its smallest on the first, whatever the -inf logits around them."""
    from llmserve.kernels.sampling_reference import _U_SALT, hash32_reference, uniform_reference
    keys = torch.tensor([_unhash32(0xFFFFFFFF) ^ _U_SALT, _unhash32(0) ^ _U_SALT], device=DEVICE)
    assert hash32_reference(keys.cpu() ^ _U_SALT).tolist() == [0xFFFFFFFF, 0]
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
from llmserve.kernels import rejection  # speculative decoding's rejection sampler
types = {"logits_ptr": "*fp32", "key_ptr": "*i64", "draft_ptr": "*i64", "rkey_ptr": "*i64", "redrawn_ptr": "*i64",
         "out_ptr": "*i64"}
for fn in (rejection._residual_kernel, rejection._settle_kernel):
    names = list(fn.arg_names)
    signature = {n: "constexpr" if n in consts else types.get(n, "*fp32" if n.endswith("_ptr") else "i32")
                 for n in names}
    source = ASTSource(fn, signature, {(names.index(k),): v for k, v in consts.items() if k in names}, {})
    assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"]
"""


def test_filtered_sampler_kernels_compile_for_an_h100():
    """The interpreter runs the kernels as Python, not through Triton's compiler: a kernel it runs
    may still not compile (a loop-carried variable that started as a literal did not). Each kernel
    of the filtered sampler and of the rejection sampler, compiled for sm_90 with the launch's constants; no GPU needed (a fresh
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


def test_token_mask_kernel_matches_reference():
    """Packed masks (bit t % 32 of word t // 32) on a subset of rows, a vocabulary that ends inside
    a word and spans two programs' words; rows not named and allowed tokens keep their logits."""
    from llmserve.kernels.token_mask import apply_token_mask, apply_token_mask_reference, unpack_mask
    g = torch.Generator().manual_seed(5)
    vocab = 65 * 32 + 77
    logits = torch.randn(5, vocab, generator=g).to(DEVICE)
    rows = torch.tensor([3, 0, 4], device=DEVICE)
    masks = torch.randint(-2**31, 2**31 - 1, (3, -(-vocab // 32)), generator=g, dtype=torch.int32).to(DEVICE)
    masks[2] = 0
    masks[2, 66] = -2**31  # one token allowed: bit 31 (the sign bit) of a word
    ours, want = logits.clone(), logits.clone()
    apply_token_mask(ours, rows, masks)
    apply_token_mask_reference(want, rows, masks)
    assert torch.equal(ours, want)
    allowed = unpack_mask(masks, vocab)
    assert torch.equal(ours[1], logits[1]) and torch.equal(ours[2], logits[2])
    assert torch.equal(ours[3][allowed[0]], logits[3][allowed[0]]) and ours[3][~allowed[0]].eq(float("-inf")).all()
    assert torch.isfinite(ours[4]).sum() == 1 and ours[4].argmax() == 66 * 32 + 31


def test_sample_rows_never_draws_a_token_of_zero_weight_past_a_block_whose_sums_disagree():
    """A block's weights summed two ways (its running sum and its total) round apart when one
    heavy token is followed by many light ones; a target between the two used to leave a negative
    remainder for the next block, whose first token was then drawn even at zero weight (a masked
    token: a constrained request's output broke its grammar). Targets swept across that gap: every
    draw has nonzero weight."""
    from llmserve.kernels.sampling_reference import _U_SALT
    ks = range(4194304 - 8, 4194304 + 24)  # u = (k + 0.5) / 2**23 around 1/2: targets around 1.0
    keys = torch.tensor([_unhash32(k << 9) ^ _U_SALT for k in ks], device=DEVICE)
    logits = torch.full((len(ks), 128), float("-inf"))
    logits[:, 0] = 0.0  # weight 1, then 63 tokens of weight 1e-8 (their running sum stays 1.0)
    logits[:, 1:64] = torch.log(torch.tensor(1e-8))
    logits[:, 65] = 0.0  # past the block boundary: token 64 has zero weight, token 65 weight 1
    out = sample_rows(logits.to(DEVICE), torch.ones(len(ks), device=DEVICE), keys, tiles=(128, 64))
    assert not torch.isinf(logits[torch.arange(len(ks)), out.cpu()]).any(), str(out.tolist())


@pytest.mark.parametrize("tiles", [(64, 32), (SLICE, 4096)])
def test_check_drafts_matches_reference(tiles):
    """Speculative decoding's rejection sampler (kernels/rejection.py) against its torch reference:
    rows whose q agrees with p and rows whose q does not, temperatures 0.5 to 2, several slices a
    row, q's rows apart in memory; the same tokens, some drafts kept and some redrawn. And a q of
    twice p leaves no residual: every draft is kept, whatever u says."""
    from llmserve.kernels.rejection import check_drafts
    from llmserve.kernels.sampling_reference import ACCEPT_SALT, check_drafts_reference, uniform_reference
    g = torch.Generator().manual_seed(5)
    rows, vocab = 48, (200 if tiles[0] == 64 else SLICE + 300)
    logits = torch.randn(rows, vocab, generator=g) * 2
    q_logits = torch.where(torch.arange(rows)[:, None] % 3 == 0, logits, torch.randn(rows, vocab, generator=g) * 2)
    temperature = torch.tensor([0.5, 0.7, 1.0, 2.0] * 12)
    q = torch.softmax(q_logits / temperature[:, None], -1)
    drafts = torch.multinomial(q, 1, generator=g)[:, 0]
    keys = row_keys(torch.arange(rows) * 31 + 7, torch.arange(rows))
    spaced = torch.zeros(2 * rows, vocab)  # q's rows apart in memory, as a proposer's buffer holds them
    spaced[::2] = q
    args = [t.to(DEVICE) for t in (logits, temperature, keys, drafts, spaced[::2])]
    out = check_drafts(*args, tiles=tiles)
    expected = check_drafts_reference(*args, sample_rows_reference)
    assert out.tolist() == expected.tolist()
    kept = out.cpu() == drafts
    assert kept.any() and not kept.all()
    few = [t[:12] for t in args]  # (the interpreter's time: a dozen rows for the two cases below)
    transposed = q[:12].t().contiguous().t()  # another layout (column stride 12): copied, not misread
    assert check_drafts(*few[:4], transposed.to(DEVICE), tiles=tiles).tolist() == expected[:12].tolist()
    # q = 2p: no residual anywhere, so every draft stays, also where u * q(d) >= p(d)
    few[4] = 2 * torch.softmax(logits[:12] / temperature[:12, None], -1).to(DEVICE)
    assert (uniform_reference(keys[:12], ACCEPT_SALT) >= 0.5).any()
    assert check_drafts(*few, tiles=tiles).tolist() == drafts[:12].tolist()
    assert check_drafts_reference(*few).tolist() == drafts[:12].tolist()


def test_check_drafts_reference_keeps_a_draft_whose_residual_is_all_zero():
    """q == p as computed: every draft is kept, as with probability 1 in exact arithmetic (the
    residual max(p - q, 0) has nothing to draw from)."""
    from llmserve.kernels.sampling_reference import _LOG2E, check_drafts_reference
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(1))
    temperature = torch.full((64,), 0.8)
    y = logits * (_LOG2E / temperature)[:, None]
    w = torch.exp2(y - y.max(-1, keepdim=True).values)
    q = w / w.sum(-1, keepdim=True)
    drafts = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(2))[:, 0]
    keys = row_keys(torch.arange(64), torch.zeros(64, dtype=torch.int64))
    assert check_drafts_reference(logits, temperature, keys, drafts, q).tolist() == drafts.tolist()
