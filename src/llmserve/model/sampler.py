"""Batched sampling on the device: one pass over [batch, vocab] tensors, no Python loop over the
vocabulary or the requests.

Order of operations on float32 logits (log-probabilities returned to users are taken before all
of them, from the raw model output):

    logit_bias -> min_tokens (stop ids masked) -> repetition penalty (prompt + output tokens)
    -> presence / frequency penalties (output tokens) -> greedy rows: argmax
    -> random rows: / temperature -> softmax -> min_p -> top_k -> top_p -> exponential race

Random rows draw u ~ U(0, 1) per vocabulary entry from a counter-based hash of (request seed,
output index, token id) and pick argmax(p / -log u), which is a sample from p. The draw depends
only on the request's own seed and position, never on the batch around it, so a seeded request
gives the same output whatever else runs, also after preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmserve.messages import TokenLogprobs


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters as device tensors ([B] unless stated)."""
    temperature: torch.Tensor  # float32; 0 for greedy rows
    top_k: torch.Tensor  # int64; vocab size when disabled
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    seeds: torch.Tensor  # int64
    out_index: torch.Tensor  # int64: output tokens the row already has
    all_greedy: bool
    needs_sort: bool  # some row uses top_k or top_p
    penalties: "Penalties | None" = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, token ids masked by min_tokens
    max_logprobs: int = -1  # most top-k logprobs any row wants; -1 for none


@dataclass(slots=True)
class Penalties:
    output_counts: torch.Tensor  # float32 [B, V]: occurrences of each token in the output
    prompt_mask: torch.Tensor  # bool [B, V]: token occurs in the prompt
    repetition: torch.Tensor  # float32 [B]
    presence: torch.Tensor  # float32 [B]
    frequency: torch.Tensor  # float32 [B]


_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
_M2 = -7723592293110705685  # 0x94D049BB133111EB as int64
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (wrapping arithmetic; arithmetic shifts masked to logical)."""
    z = (z ^ ((z >> 30) & 0x3FFFFFFFF)) * _M1
    z = (z ^ ((z >> 27) & 0x1FFFFFFFFF)) * _M2
    return z ^ ((z >> 31) & 0x1FFFFFFFF)


def uniform_noise(seeds: torch.Tensor, out_index: torch.Tensor, vocab: int) -> torch.Tensor:
    """float32 [B, V] in (0, 1), a pure function of (seed, output index, token id)."""
    row = _mix(seeds * _GOLDEN + out_index)
    z = _mix(row[:, None] + (torch.arange(vocab, device=seeds.device, dtype=torch.int64) + 1) * _GOLDEN)
    bits = (z >> 40) & 0xFFFFFF  # 24 random bits
    return (bits.float() + 0.5) * (1.0 / 16777216.0)


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    seen = pen.prompt_mask | (pen.output_counts > 0)
    rep = pen.repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - pen.frequency[:, None] * pen.output_counts - pen.presence[:, None] * (pen.output_counts > 0).float()


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Everything before the choice of token: bias, min_tokens, penalties (float32 [B, V])."""
    if batch.bias is not None:
        rows, ids, vals = batch.bias
        logits = logits.index_put((rows, ids), vals, accumulate=True)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.tensor(float("-inf"), device=logits.device))
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    return logits


def sampling_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Probabilities after temperature, min_p, top_k and top_p (rows renormalisation not needed)."""
    temp = torch.where(batch.temperature > 0, batch.temperature, 1.0)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    probs = probs.masked_fill(probs < batch.min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
    if batch.needs_sort:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
        # Keep a token if it is within top_k and the mass strictly before it is below top_p.
        before = sorted_p.cumsum(dim=-1) - sorted_p
        drop = (rank >= batch.top_k[:, None]) | (before >= batch.top_p[:, None] * sorted_p.sum(-1, keepdim=True))
        drop[:, 0] = False
        probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
    return probs


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 logits [B, V] -> int64 token ids [B]."""
    logits = process_logits(logits, batch)
    greedy = logits.argmax(dim=-1)
    if batch.all_greedy:
        return greedy
    probs = sampling_probs(logits, batch)
    noise = uniform_noise(batch.seeds, batch.out_index, logits.shape[-1])
    drawn = (probs / -torch.log(noise)).argmax(dim=-1)
    return torch.where(batch.temperature > 0, drawn, greedy)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
    """For rows of log-probabilities [N, V] and chosen tokens [N]: (chosen logprob, rank, top-k ids,
    top-k logprobs). Rank 1 is the most likely token."""
    chosen = logprobs.gather(-1, token_ids[:, None]).squeeze(-1)
    rank = (logprobs > chosen[:, None]).sum(-1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], token_ids[:, None][:, :0])
    return chosen, rank, top_ids, top_lp


def to_token_logprobs(token_ids: list[int], parts: tuple[torch.Tensor, ...], ks: list[int]) -> list[TokenLogprobs]:
    """Move gathered logprobs to the host as one TokenLogprobs per row, each cut to its own k."""
    chosen, rank, top_ids, top_lp = (t.tolist() for t in parts)
    return [TokenLogprobs(tok, lp, r, ids[:k], lps[:k])
            for tok, lp, r, ids, lps, k in zip(token_ids, chosen, rank, top_ids, top_lp, ks)]
