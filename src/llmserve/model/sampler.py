"""Batched sampling on the device: no Python loop over the vocabulary or the requests.

Order of operations on the logits (log-probabilities returned to users are taken before all of
them, from the raw model output; the logits arrive in the model's dtype and are upcast to float32
for any of the steps below that change them, while the fused kernel upcasts as it reads):

    logit_bias -> min_tokens (stop ids masked) -> repetition penalty (prompt + output tokens)
    -> presence / frequency penalties (output tokens) -> constraints (tokens outside a decoding
    strategy's mask masked) -> greedy rows: argmax
    -> random rows: a draw from softmax(logits / temperature), after min_p, top_k and top_p where asked

Random draws come from a counter hash of (request seed, output index) (kernels/sampling_reference.py): they
depend only on the request's own seed and position, never on the batch around it, so a seeded
request gives the same output whatever else runs, also after preemption. Rows without
min_p/top_k/top_p take the backend's fused sampler (inverse transform at the row's u); rows with
them its filtered sampler (rejection against the filters' thresholds, no sort), chosen per row, so
batch composition never changes a draw.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from llmserve.kernels.sampling_reference import sample_filtered_rows_reference, sample_rows_reference
from llmserve.kernels.token_mask import apply_token_mask_reference
from llmserve.messages import StepPlan, TokenLogprobs

DrawFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
FilterFn = Callable[..., torch.Tensor]
MaskFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters as device tensors ([B] unless stated)."""
    temperature: torch.Tensor  # float32; 0 for greedy rows
    top_k: torch.Tensor  # int64; vocab size when disabled
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    keys: torch.Tensor  # int64: the row's random stream, row_keys(seed, output tokens it already has)
    filtered_rows: torch.Tensor | None = None  # int64 row indices that use min_p, top_k or top_p
    all_filtered: bool = False  # every row is one of them, with T > 0: no row takes the plain draw
    penalties: "Penalties | None" = None
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, token ids, values
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, token ids masked by min_tokens
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None
    """Rows with constraints, and their packed masks (int32 [rows, ceil(V / 32)]: bit t % 32 of
    word t // 32 set where token t may come next; llmserve/decoding.py)."""
    max_logprobs: int = -1  # most top-k logprobs any row wants; -1 for none


@dataclass(slots=True)
class Penalties:
    output_counts: torch.Tensor  # float32 [B, V]: occurrences of each token in the output
    prompt_mask: torch.Tensor  # bool [B, V]: token occurs in the prompt
    repetition: torch.Tensor  # float32 [B]
    presence: torch.Tensor  # float32 [B]
    frequency: torch.Tensor  # float32 [B]


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    seen = pen.prompt_mask | (pen.output_counts > 0)
    rep = pen.repetition[:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - pen.frequency[:, None] * pen.output_counts - pen.presence[:, None] * (pen.output_counts > 0).float()


def process_logits(logits: torch.Tensor, batch: SamplingBatch,
                   mask_fn: MaskFn = apply_token_mask_reference) -> torch.Tensor:
    """Everything before the choice of token: bias, min_tokens, penalties, constraints (a float32
    copy [B, V] where any applies: the raw logits stay as they are for logprobs; otherwise the
    logits themselves). `mask_fn` applies packed masks in place (the backend's apply_token_mask)."""
    if (batch.bias is not None or batch.banned is not None or batch.penalties is not None
            or batch.allowed is not None):
        logits = logits.to(torch.float32, copy=True)
    if batch.bias is not None:
        rows, ids, vals = batch.bias
        logits = logits.index_put((rows, ids), vals, accumulate=True)
    if batch.banned is not None:
        logits = logits.index_put(batch.banned, torch.full((), float("-inf"), device=logits.device))
    if batch.penalties is not None:
        logits = apply_penalties(logits, batch.penalties)
    if batch.allowed is not None:
        mask_fn(logits, *batch.allowed)
    return logits


def sample(logits: torch.Tensor, batch: SamplingBatch, draw_fn: DrawFn = sample_rows_reference,
           filter_fn: FilterFn = sample_filtered_rows_reference,
           mask_fn: MaskFn = apply_token_mask_reference) -> torch.Tensor:
    """logits [B, V] (model dtype or float32) -> int64 token ids [B]. `draw_fn`, `filter_fn` and
    `mask_fn` are the backend's (sample_rows, sample_filtered_rows, apply_token_mask)."""
    return draw(process_logits(logits, batch, mask_fn), batch, draw_fn, filter_fn)


def draw(logits: torch.Tensor, batch: SamplingBatch, draw_fn: DrawFn = sample_rows_reference,
         filter_fn: FilterFn = sample_filtered_rows_reference) -> torch.Tensor:
    """The choice of token for logits that process_logits() has processed: int64 [B]."""
    # Greedy rows (T == 0) are the backend's sample_rows' too, which takes their argmax; a batch of
    # them all is no exception: torch.argmax reduces a row in one thread block, the fused sampler
    # spreads it over slices of the vocabulary.
    if batch.all_filtered:  # the filtered sampler writes every row
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    else:
        tokens = draw_fn(logits, batch.temperature, batch.keys)
    if batch.filtered_rows is not None:  # rows with T > 0 only: greedy rows keep their argmax
        filter_fn(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.keys, batch.filtered_rows,
                  tokens)
    return tokens


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


def prompt_logprobs(plan: StepPlan, qsl: np.ndarray, hidden: torch.Tensor, seqs: dict,
                    compute_logits: Callable[[torch.Tensor], torch.Tensor],
                    to_device: Callable[[np.ndarray], torch.Tensor]) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """The logprobs of each prompt token given the ones before it, for the prompt positions a step
    computed (`hidden`, rows by `qsl`), per request of the plan that asked (`seqs`: their SeqStates):
    (the first of those positions, one entry a position)."""
    out = {}
    for i, req_id in enumerate(plan.req_ids):
        state = seqs[req_id]
        k = state.params.prompt_logprobs
        if k is None:
            continue
        start, n = int(plan.context_lens[i]), int(plan.query_lens[i])
        end = min(start + n, len(state.prompt_ids) - 1)  # positions that have a next prompt token
        if end > start:
            h = hidden[int(qsl[i]):int(qsl[i]) + end - start]
            logprobs = torch.log_softmax(compute_logits(h), -1, dtype=torch.float32)
            nxt = state.prompt_ids[start + 1:end + 1]
            parts = gather_logprobs(logprobs, to_device(np.array(nxt, dtype=np.int64)), k)
            out[req_id] = (start, to_token_logprobs(nxt, parts, [k] * len(nxt)))
    return out
