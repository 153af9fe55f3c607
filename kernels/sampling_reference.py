"""The fused samplers of kernels/sampling.py in plain torch: the CPU backend's implementation and
the kernels' test oracle, bit for bit in the hashes and u, float64 in the sums (so a choice differs
from a kernel's only where u falls within float32 rounding of a boundary between two tokens'
cumulative weights). Also the row keys the engine hashes on the host.

The constants are the kernels' (the Triton code holds them as literals): a change here is a change
there.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B9
_M1, _M2 = 0x7FEB352D, 0x846CA68B
_MASK = 0xFFFFFFFF
_U_SALT = 0x5BD1E995  # a row's u hashes its key with this (the filtered sampler's rounds with _FILTER_SALT)
_FILTER_SALT = 0x2545F491
ACCEPT_SALT = 0x27D4EB2F  # a checked draft's acceptance u hashes the row key with this,
RESIDUAL_SALT = 0x165667B1  # its redraw's key with this
_LOG2E = 1.4426950408889634
PIVOTS, MAX_ROUNDS = 4, 64  # the filtered sampler's pivots a round and rounds at most (kernels/sampling.py)


def hash32_reference(x: torch.Tensor) -> torch.Tensor:
    """_hash32 in torch, on int64 values below 2**32 (tensors or numpy arrays): also derives a
    stream of its own from a key."""
    x = x ^ (x >> 16)
    x = (x * _M1) & _MASK
    x = x ^ (x >> 15)
    x = (x * _M2) & _MASK
    return x ^ (x >> 16)


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """float32 u in (0, 1) from the top 23 bits of a hash: (k + 0.5) / 2**23 is exact in float32
    for k < 2**23, so 0 < u <= 1 - 2**-24 (with 24 bits, k + 0.5 rounds up to 2**24 for the largest
    k: u = 1, a target at or past the last cumulative weight)."""
    return ((h >> 9).float() + 0.5) * (1.0 / 8388608.0)


def uniform_reference(key: torch.Tensor, salt: int = _U_SALT) -> torch.Tensor:
    """float32 [B]: the u in (0, 1) that sample_rows draws for each row key (with _FILTER_SALT: that
    a round of sample_filtered_rows draws for its stream)."""
    return _uniform(hash32_reference((key & _MASK) ^ salt))


def sample_rows_reference(logits: torch.Tensor, temperature: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """sample_rows in torch: the same weights 2^(y - max y), y = logits * (log2(e) / T) in float32,
    summed in float64, so the kernel's choice differs only where u falls within float32 rounding of
    a boundary between two tokens' cumulative weights."""
    x = logits.float()
    t = temperature.float()
    if not bool((t > 0).any()):  # greedy rows only: no draw to compute
        return x.argmax(-1)
    c = torch.tensor(_LOG2E, dtype=torch.float32, device=x.device) / torch.where(t > 0, t, 1.0)
    y = x * c[:, None]
    w = torch.exp2(y - y.max(-1, keepdim=True).values).double()
    cum = w.cumsum(-1)
    target = uniform_reference(key).double() * cum[:, -1]
    last = torch.where(w > 0, torch.arange(x.shape[1], device=x.device), 0).max(-1).values
    drawn = torch.minimum((cum <= target[:, None]).sum(-1), last)
    drawn = torch.where(cum[:, -1] > 0, drawn, 0)
    return torch.where(t > 0, drawn, x.argmax(-1))


def check_drafts_reference(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor, drafts: torch.Tensor,
                           q: torch.Tensor, draw_fn=sample_rows_reference) -> torch.Tensor:
    """The token each of R rows produces where it checks a draft drawn from a distribution q
    (speculative decoding), by the rejection sampler of Leviathan et al. (arXiv 2211.17192): with
    p = softmax(logits / T), the row keeps its draft d with probability min(1, p(d) / q(d)), else it
    draws from max(p - q, 0) normalised. Either way the token is distributed as p. A rejected d
    has p(d) <= q(d), so the draw is never d: the row's token equals its draft exactly when the
    draft is kept, and the engine counts the drafts kept as it does for a fixed proposal. A row
    whose residual is all zero (p == q up to rounding) keeps its draft, as it would with
    probability 1 in exact arithmetic.

    p is computed as sample_rows weighs tokens: 2^(y - max y) / sum, y = logits * log2(e) / T, in
    float32. The draft is kept where u * q(d) < p(d), u from the row key salted with ACCEPT_SALT;
    the residual is drawn by `draw_fn` (the backend's sample_rows) from its logarithm at
    temperature 1, with the key hash32(key ^ RESIDUAL_SALT).

    logits [R, V] float32, processed (process_logits); temperature [R], all > 0; keys [R] the rows'
    keys; drafts [R] int64; q [R, V] float32. Returns int64 [R]."""
    c = torch.tensor(_LOG2E, dtype=torch.float32, device=logits.device) / temperature.float()  # as the kernels round it
    y = logits.float() * c[:, None]
    w = torch.exp2(y - y.max(-1, keepdim=True).values)
    p = w / w.sum(-1, keepdim=True)
    index = drafts[:, None]
    residual = (p - q).clamp_min_(0.0)
    accepted = ((uniform_reference(keys, ACCEPT_SALT) * q.gather(1, index)[:, 0] < p.gather(1, index)[:, 0])
                | (residual.sum(-1) == 0))
    redrawn = draw_fn(residual.log(), torch.ones_like(temperature), hash32_reference((keys & _MASK) ^ RESIDUAL_SALT))
    return torch.where(accepted, drafts, redrawn)


def order_key_reference(x: torch.Tensor) -> torch.Tensor:
    """int64 copies of the kernel's int32 order keys of float32 x."""
    bits = x.float().view(torch.int32).long()
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def sample_filtered_rows_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                                   top_p: torch.Tensor, min_p: torch.Tensor, key: torch.Tensor, rows: torch.Tensor,
                                   out: torch.Tensor) -> torch.Tensor:
    """sample_filtered_rows in torch, a row at a time: the same rounds, pivots and u, the weights
    in float32 and their sums in float64 (so a choice differs from the kernel's only within float32
    rounding of a boundary)."""
    for row in rows.tolist():
        t = float(temperature[row])
        if t <= 0:
            continue
        x = logits[row].float()
        c = torch.tensor(_LOG2E, dtype=torch.float32) / torch.tensor(t, dtype=torch.float32)
        y = x * c.to(x.device)
        top = y.max().clamp(min=-3.0e38)  # finite, as the kernel's running maximum starts
        mp = float(min_p[row])
        ythr = top + torch.log2(torch.tensor(mp, device=x.device)) if mp > 0 else torch.tensor(-3.0e38, device=x.device)
        w = torch.where(y >= ythr, torch.exp2(y - top), 0.0).double()
        keys = order_key_reference(x)
        kept_mass = w.sum()
        if kept_mass == 0:  # every logit -inf
            out[row] = 0
            continue
        k, p = int(top_k[row]), float(top_p[row])
        lo, hi, total = -2**31, int(keys.max()) + 1, kept_mass
        stream = int(key[row]) & _MASK
        pick = 0
        for _ in range(MAX_ROUNDS):
            u = float(uniform_reference(torch.tensor([stream]), _FILTER_SALT)[0])
            cand = torch.where(keys >= lo, w, 0.0)
            cum = cand.cumsum(0)
            hits = (cum > u * total).nonzero()
            pick = int(hits[0]) if hits.numel() else int((cand > 0).nonzero()[-1])
            q0 = int(keys[pick]) + 1
            q = torch.tensor([q0 + max(hi - q0, 0) * i // PIVOTS for i in range(PIVOTS)], device=x.device)
            ge = (keys[None, :] >= q[:, None]) & (w[None, :] > 0)
            count, mass = ge.sum(1), (ge * w[None, :]).sum(1)
            cut = (count >= k) | (mass >= p * kept_mass)
            if not cut.any():
                break
            lo, total = int(q[cut].max()), mass[cut].min()
            if (~cut).any():
                hi = int(q[~cut].min())
            stream = (stream + _GOLDEN) & _MASK
        out[row] = pick
    return out


def row_keys(seeds, out_index):
    """int64 [B] keys in [0, 2**32) from a request's seed (any int64) and its output position.
    Works alike on torch tensors and numpy int64 arrays (the runner hashes on the host: a few
    vector ops there instead of ~35 tiny kernel launches per step)."""
    lo, hi = seeds & _MASK, (seeds >> 32) & _MASK
    return hash32_reference(hash32_reference(lo ^ hash32_reference(hi)) ^ ((out_index * _GOLDEN) & _MASK))
