"""Decoding strategies: plugins that constrain what a request may sample next.

A strategy is registered by name (hook `llmserve_register_decoding_strategies`) and lives on both
sides of the engine:

    request actor (has the tokenizer)                 executor (has the logits)
    strategy.wants(params) ──yes──▶ strategy.prepare(params, tokenizer, vocab_size, eos_token_ids)
                                    on a worker thread (grammar compilation is slow);
                                    ValueError naming the field: the request's 400
        the prepared object travels with the request (NewRequest → Admission → NewSequence)
                                                      strategy.start(prepared) ─▶ Constraint
                                                      each step the request samples in:
                                                        constraint.fill_mask(bitmask, row)
                                                        (on the mask thread, after its last token
                                                        was accepted, while the device runs the
                                                        step's forward pass)
                                                      each token it produced (in a step
                                                      without drafts, first checked against the
                                                      mask it was drawn under):
                                                        constraint.accept(token), or for all
                                                        of a strategy's rows at once
                                                        strategy.accept_tokens(...)
                                                        constraint.jump(token, limit): tokens
                                                        that replace it, appended unsampled

The mask is packed: int32 words, bit t % 32 of word t // 32 set where token t may come next; the
backend's apply_token_mask sets every other token's logit to -inf on the device. A request with a
constraint reads its own last token on the host: the executor launches the next step's forward
pass first (that token goes in on the device), then waits for the token and advances the
constraint; the mask is filled on the mask thread while the step's result goes back, and the
next step's launch queues the sampler once it is. fill_mask is never called beside the same
constraint's accept, but beside the engine's other threads: a call of a few microseconds should
keep the interpreter lock (handing it to a busy thread costs far more than the call).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from llmserve.sampling_params import SamplingParams


class Constraint(Protocol):
    """One sample's state on the executor's side."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of `bitmask` (int32 [rows, ceil(V / 32)],
        host), the whole row: it is not cleared before."""

    def accept(self, token: int) -> None:
        """Advance past a token the request produced (one the mask allowed)."""

    # Optional (speculative decoding): a constraint that can check drafts defines
    #   advance(token: int) -> bool    past a draft, tentatively (False: it rejects it; unchanged)
    #   rollback(num_tokens: int)      undo the last advances
    # and its strategy's prepared object has `checks_drafts = True`: then its requests speculate,
    # each checked position masked as the constraint stands after the drafts before it.
    # Optional (jump-forward): a constraint that can force what follows defines
    #   jump(token: int, limit: int) -> list[int] | None
    # called right after accept(token): at most `limit` tokens that replace `token` (its text and
    # the forced text after it, as the tokenizer encodes them), the constraint left after them; or
    # None. The engine computes them in the request's next step, several at once; where `token`
    # was already an input of a step launched meanwhile, that step's sample is dropped and, if
    # `token` itself was replaced, its computation taken back.


class DecodingStrategy(Protocol):
    def wants(self, params: SamplingParams) -> bool:
        """Whether requests with these parameters use this strategy."""

    def prepare(self, params: SamplingParams, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
        """What the executor needs to start a request's constraints (e.g. a compiled grammar),
        made on a worker thread; raises ValueError naming the bad field. `eos_token_ids` end the
        request (the model's and the tokenizer's): a mask that allows one mid-output lets it stop there."""

    def start(self, prepared: Any) -> Constraint:
        """A fresh constraint for one sample, at the start of its output."""

    # Optional: a strategy that can fill many rows in one call (threads, one native call) defines
    #   fill_masks(constraints: list[Constraint], bitmask: torch.Tensor, rows: list[int]) -> None
    # which writes constraints[i]'s mask into row rows[i]; without it, each row's fill_mask is called.
    # Optional: a strategy that fills masks elsewhere (another process) defines
    #   fill_masks_async(constraints: list[Constraint], rows: list[int], width: int) -> pending | None
    # called where a step's masked rows are all its own and are filled while its forward pass runs:
    # the fill started, it returns at once a pending fill with `host` (int32 [len(rows), width],
    # row i for constraints[i], left unwritten until its next fill after the step's tokens are
    # checked), done()/query() and result()/synchronize() (result(): row -> error for rows that
    # failed, each allowing every token, or None where nothing was filled: the engine then fills
    # `host` from the constraints); None: the mask thread fills them.
    # Optional: close() -> None, called after the engine's last step (stop its threads, processes).
    # Optional: a strategy that can advance many constraints in one call defines
    #   accept_tokens(constraints: list[Constraint], tokens: list[int]) -> None
    # which advances constraints[i] past tokens[i], a token its mask allowed (the engine checked);
    # used in steps without drafts, for each constraint's one token; without it, each accept().


class NoTokenAllowed(ValueError):
    """A request whose constraints together allowed no token next (a grammar and allowed_token_ids
    or bad_words that exclude each other): it fails with this, a fault of its own parameters."""


def mask_width(vocab_size: int) -> int:
    """int32 words of a packed mask row."""
    return -(-vocab_size // 32)


def pack_mask(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """The packed mask row (int32 [mask_width(vocab_size)]) that allows exactly `token_ids`."""
    bits = torch.zeros(mask_width(vocab_size) * 32, dtype=torch.bool)
    bits[token_ids] = True
    weights = torch.tensor([1 << b for b in range(31)] + [-(1 << 31)], dtype=torch.int32)  # bit 31: the sign
    return (bits.view(-1, 32).int() * weights).sum(-1, dtype=torch.int32)
