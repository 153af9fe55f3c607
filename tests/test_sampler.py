import math

import torch

from llmserve.kernels.sampling_reference import row_keys
from llmserve.model.sampler import Penalties, SamplingBatch, apply_penalties, gather_logprobs, sample


def kept_by_sorting(logits, temperature, top_k, top_p, min_p):
    """bool [B, V]: what min_p, top_k and top_p keep, by their textbook definition over a sort (a
    token is kept if its probability is at least min_p times the top one, fewer than top_k tokens
    rank before it, and less than top_p of the min_p-kept mass comes before it)."""
    probs = torch.softmax(logits.float() / temperature[:, None], dim=-1)
    probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1])[None, :]
    before = sorted_p.cumsum(dim=-1) - sorted_p
    keep = (rank < top_k[:, None]) & (before < top_p[:, None] * sorted_p.sum(-1, keepdim=True)) & (sorted_p > 0)
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter(-1, order, keep)


def batch(n, *, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0, seeds=None, out_index=None, vocab=8, **kw):
    f = lambda v: torch.full((n,), float(v))  # noqa: E731
    return SamplingBatch(
        temperature=f(temperature), top_k=torch.full((n,), top_k or vocab, dtype=torch.int64), top_p=f(top_p),
        min_p=f(min_p), keys=row_keys(torch.tensor(seeds if seeds is not None else list(range(n)), dtype=torch.int64),
                                      torch.tensor(out_index if out_index is not None else [0] * n, dtype=torch.int64)),
        filtered_rows=torch.arange(n) if (top_k is not None or top_p < 1.0 or min_p > 0) else None, **kw)


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 0.0, 4.9]])
    assert sample(logits, batch(2, temperature=0, vocab=3)).tolist() == [1, 0]


def test_same_seed_same_token_whatever_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(1, 1000)
    alone = sample(logits, batch(1, seeds=[1234], out_index=[5], vocab=1000))
    crowd = torch.cat([torch.randn(3, 1000), logits, torch.randn(4, 1000)])
    together = sample(crowd, batch(8, seeds=[9, 8, 7, 1234, 6, 5, 4, 3], out_index=[0, 1, 2, 5, 3, 4, 5, 6], vocab=1000))
    assert together[3] == alone[0]
    other_step = sample(logits, batch(1, seeds=[1234], out_index=[6], vocab=1000))
    other_seed = [sample(logits, batch(1, seeds=[s], out_index=[5], vocab=1000)).item() for s in range(20)]
    assert len(set(other_seed)) > 5 or other_step != alone


def test_row_keys_differ():
    keys = row_keys(torch.tensor([5, 5, 6, -3]), torch.tensor([0, 1, 0, 0]))
    assert len(set(keys.tolist())) == 4 and all(0 <= k < 2**32 for k in keys.tolist())


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    n = 4000
    logits = probs.log().repeat(n, 1)
    tokens = sample(logits, batch(n, seeds=list(range(n)), vocab=3))
    freq = torch.bincount(tokens, minlength=3).float() / n
    assert torch.allclose(freq, probs, atol=0.03)


def test_a_batch_filtered_in_every_row_skips_the_plain_draw():
    """When every row has a filter (a server whose clients all sample as the model card asks), the
    filtered sampler writes every token: the unfiltered draw over all rows is not run, and the
    tokens are the same as with it."""
    torch.manual_seed(3)
    logits = torch.randn(6, 50)
    drawn = []

    def draw(*args):
        drawn.append(1)
        from llmserve.kernels.sampling_reference import sample_rows_reference
        return sample_rows_reference(*args)

    both = sample(logits, batch(6, top_k=5, top_p=0.9, vocab=50), draw)
    assert drawn == [1]
    alone = sample(logits, batch(6, top_k=5, top_p=0.9, vocab=50, all_filtered=True), draw)
    assert drawn == [1] and alone.tolist() == both.tolist()


def test_top_k_top_p_min_p_keep_what_their_definition_keeps():
    """Over 3,000 keys a row, the filtered sampler draws every token its filters keep and nothing
    else, for each filter alone and together."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).log_softmax(-1)  # probs p0 > p1 > ...
    p = torch.softmax(logits, -1)[0]
    n = 3000
    cases = [dict(top_k=2), dict(top_p=float(p[0] + p[1] * 0.5)), dict(top_p=0.01),
             dict(min_p=float(p[2] / p[0]) * 1.001), dict(top_k=4, top_p=float(p[0] + p[1] + p[2] * 0.5)),
             dict(top_k=3, min_p=float(p[1] / p[0]) * 0.999, top_p=0.99)]
    for case in cases:
        b = batch(n, seeds=list(range(n)), vocab=5, **case)
        want = kept_by_sorting(logits, b.temperature[:1], b.top_k[:1], b.top_p[:1], b.min_p[:1])[0]
        drawn = torch.bincount(sample(logits.repeat(n, 1), b), minlength=5) > 0
        assert drawn.tolist() == want.tolist(), case
    assert want.tolist() == [True, True, False, False, False]


def test_filtered_draws_follow_the_kept_distribution():
    """top_k 6 and top_p 0.9 at temperature 0.8 on 40 tokens: frequencies over 6,000 keys are the
    kept tokens' probabilities renormalised."""
    torch.manual_seed(4)
    logits = torch.randn(1, 40) * 2
    n = 6000
    b = batch(n, temperature=0.8, top_k=6, top_p=0.9, seeds=list(range(n)), vocab=40)
    keep = kept_by_sorting(logits, b.temperature[:1], b.top_k[:1], b.top_p[:1], b.min_p[:1])[0]
    want = torch.softmax(logits[0] / 0.8, -1) * keep
    want /= want.sum()
    freq = torch.bincount(sample(logits.repeat(n, 1), b), minlength=40).float() / n
    assert 2 < int(keep.sum()) <= 6 and torch.allclose(freq, want, atol=0.02)


def test_filters_are_chosen_per_row_so_batches_do_not_change_draws():
    torch.manual_seed(1)
    logits = torch.randn(4, 300)
    plain = batch(4, seeds=[1, 2, 3, 4], vocab=300)
    mixed = batch(4, seeds=[1, 2, 3, 4], vocab=300)
    mixed.top_p = torch.tensor([1.0, 0.5, 1.0, 0.3])
    mixed.filtered_rows = torch.tensor([1, 3])
    a, b = sample(logits, plain), sample(logits, mixed)
    assert a[0] == b[0] and a[2] == b[2]  # unfiltered rows draw the same whatever their neighbours ask
    probs = torch.softmax(logits, -1)
    for row, p in ((1, 0.5), (3, 0.3)):  # filtered rows stay inside their nucleus
        order = probs[row].argsort(descending=True)
        mass_before = probs[row][order].cumsum(0) - probs[row][order]
        assert mass_before[(order == b[row]).nonzero()].item() < p


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    counts = torch.tensor([[0.0, 0.0, 2.0, 0.0]])
    prompt = torch.tensor([[True, True, False, False]])
    pen = Penalties(counts, prompt, repetition=torch.tensor([2.0]), presence=torch.tensor([0.5]),
                    frequency=torch.tensor([0.25]))
    out = apply_penalties(logits, pen)
    # token 0: positive, seen in prompt -> /2; token 1: negative -> *2; token 2: output twice ->
    # /2 then -0.25*2 - 0.5; token 3: unseen.
    assert out.tolist() == [[1.0, -4.0, 0.5 - 0.5 - 0.5, 1.0]]


def test_logit_bias_and_banned_tokens():
    logits = torch.zeros(2, 4)
    b = batch(2, temperature=0, vocab=4, bias=(torch.tensor([0, 1]), torch.tensor([2, 3]), torch.tensor([5.0, 1.0])),
              banned=(torch.tensor([1]), torch.tensor([3])))
    assert sample(logits, b).tolist() == [2, 0]


def test_logprobs_match_log_softmax_with_ranks():
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    lp = torch.log_softmax(logits, -1)
    chosen = torch.tensor([int(lp[0].argmax()), int(lp[1].argsort(descending=True)[4]), 7])
    val, rank, top_ids, top_lp = gather_logprobs(lp, chosen, 3)
    ref = torch.log_softmax(logits.double(), -1)
    assert torch.allclose(val.double(), ref[torch.arange(3), chosen], atol=1e-6)
    assert rank[0] == 1 and rank[1] == 5 and rank[2] == int((ref[2] > ref[2, 7]).sum()) + 1
    assert top_ids.tolist() == ref.topk(3).indices.tolist()
    assert math.isclose(top_lp[0, 0].item(), ref[0].max().item(), abs_tol=1e-6)


def test_logits_in_the_model_dtype_sample_as_their_float32_copy():
    # The runner hands bf16 logits over as they come from the lm_head; every path upcasts them.
    torch.manual_seed(3)
    logits = (torch.randn(6, 300) * 4).to(torch.bfloat16)
    vocab = 300
    n = 6
    pen = Penalties(output_counts=torch.zeros(n, vocab).index_fill_(1, torch.tensor([5, 7]), 2.0),
                    prompt_mask=torch.zeros(n, vocab, dtype=torch.bool), repetition=torch.full((n,), 1.3),
                    presence=torch.full((n,), 0.5), frequency=torch.full((n,), 0.2))
    bias = (torch.tensor([0, 3]), torch.tensor([11, 12]), torch.tensor([9.0, -9.0]))
    for b in (batch(n, vocab=vocab), batch(n, temperature=0, vocab=vocab), batch(n, top_k=20, top_p=0.8, vocab=vocab),
              batch(n, temperature=0.7, vocab=vocab, penalties=pen, bias=bias)):
        assert sample(logits, b).tolist() == sample(logits.float(), b).tolist()


def test_a_constraint_masks_only_its_rows_and_leaves_the_logits_for_logprobs():
    """Packed masks on two of three rows; float32 logits (the model's dtype on CPU) are masked in a
    copy: the raw logits, from which logprobs are taken, stay as they were."""
    logits = torch.zeros(3, 40)
    logits[:, 39] = 5.0
    masks = torch.zeros(2, 2, dtype=torch.int32)
    masks[0, 0] = 1 << 3
    masks[1, 1] = 1 << 1  # token 33
    before = logits.clone()
    b = batch(3, temperature=0, vocab=40)
    b.allowed = (torch.tensor([0, 2]), masks)
    assert sample(logits, b).tolist() == [3, 39, 33]
    assert torch.equal(logits, before)


def test_a_steps_sampling_batch_reuses_its_requests_parameters_and_recomputes_their_positions():
    """SamplingState.batch keeps what depends on the requests alone for the next step with the
    same requests in the same order; what depends on their positions (the random streams, banned
    stop tokens, penalties' counts) is each step's; another set of requests, or drafts, rebuild it.
    Each batch equals one built from scratch."""
    from array import array

    import numpy as np

    from llmserve.messages import NewSequence
    from llmserve.model.sampling_state import SamplingState
    from llmserve.model.step_inputs import Staging
    from llmserve.sampling_params import SamplingParams

    def fresh_state():
        state = SamplingState([2], Staging(torch.device("cpu")))
        for i, p in enumerate(params):
            state.add(f"r{i}", NewSequence(p, array("q", [5, 6, 7]), array("q")))
        return state

    params = [SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=0, min_tokens=2),
              SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.2, logit_bias={3: 1.0}),
              SamplingParams(temperature=0.5)]  # (unseeded: its stream from its id)
    state, other = fresh_state(), fresh_state()

    def fields(b):
        out = {name: getattr(b, name) for name in ("temperature", "top_k", "top_p", "min_p", "keys",
                                                   "max_logprobs", "filtered_rows", "all_filtered", "bias", "banned")}
        out["counts"] = b.penalties.output_counts if b.penalties is not None else None
        return out

    def same(a, b):
        for name, value in fields(a).items():
            expected = fields(b)[name]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, expected), name
            elif isinstance(value, tuple):
                assert all(torch.equal(x, y) for x, y in zip(value, expected)), name
            else:
                assert value == expected, name

    seqs = [state.seqs[f"r{i}"] for i in range(4)]
    first = state.batch(seqs, 16)
    for token in (9, 4):  # two steps: positions move, the requests stay
        for s, t in zip(seqs + [other.seqs[f"r{i}"] for i in range(4)], [token] * 8):
            s.output_ids.append(t)
        again = state.batch(list(seqs), 16)
        assert again.temperature is first.temperature and again.bias is first.bias  # reused
        assert not torch.equal(again.keys, first.keys)
        same(again, other.batch([other.seqs[f"r{i}"] for i in range(4)], 16))
        other._rows = None  # (the reference builds from scratch every time)
    assert first.banned is not None and again.banned is None  # min_tokens reached
    fewer = state.batch(seqs[1:], 16)
    assert fewer.temperature is not first.temperature and fewer.temperature.tolist() == [0.0, 1.0, 0.5]
    drafted = state.batch(seqs[1:], 16, drafts=[[1], [], [2, 3]])
    assert drafted.temperature.tolist() == [0.0, 0.0, 1.0, 0.5, 0.5, 0.5]
    assert np.unique(drafted.keys.numpy()).size == 6  # every checked position its own stream


def test_a_steps_mask_layout_is_kept_for_the_same_requests_and_rebuilt_for_drafts_or_others():
    """SamplingState.masks keeps where each masked row goes while a step samples the requests of
    the step before, in order; a step with drafts (len + 1 rows a request), another set of
    requests, or one with no constraint at all gets its own."""
    from array import array

    from llmserve.model.sampling_state import SamplingState, SeqState
    from llmserve.model.step_inputs import Staging
    from llmserve.sampling_params import SamplingParams

    class AllowAll:  # a constraint that checks drafts and rejects none
        def fill_mask(self, bitmask, row):
            bitmask[row] = -1

        def advance(self, token):
            return True

        def rollback(self, num_tokens):
            pass

    def seq(constrained: bool) -> SeqState:
        return SeqState(SamplingParams(), array("q", [5]), [], 0, constraints={"allow": AllowAll()} if constrained else {})

    state = SamplingState([2], Staging(torch.device("cpu")), {"allow": object()})
    seqs = [seq(True), seq(False), seq(True)]
    plain = state.masks(seqs, 64).layout
    assert plain.owners == [0, 2] and plain.rows.tolist() == [0, 2] and not plain.ahead
    assert state.masks(list(seqs), 64).layout is plain
    drafted = state.masks(seqs, 64, drafts=[[7, 8], [9], [3, 4, 5]]).layout
    assert drafted.owners == [0, 0, 0, 2, 2, 2, 2] and drafted.rows.tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert [(first, drafts) for _, first, drafts in drafted.ahead] == [(0, [7, 8]), (3, [3, 4, 5])]
    assert state.masks(seqs, 64).layout is plain  # (a draft step's layout is its own)
    others = [seqs[2], seqs[0]]
    assert state.masks(others, 64).layout.rows.tolist() == [0, 1]
    assert state.masks([seq(False)], 64) is None
