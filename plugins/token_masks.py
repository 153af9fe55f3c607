"""`token_masks`: vLLM's `allowed_token_ids` and `bad_words` as a decoding strategy.

allowed_token_ids: one packed mask row, made once on the request side; each position starts from it.
bad_words: each word is encoded alone and after a space (as it may begin a word mid-text), giving
token sequences; a sequence's last token is masked where the output so far ends in the sequence's
other tokens (a one-token word: everywhere). The constraint keeps only as many of its last output
tokens as the longest sequence needs.
"""

from __future__ import annotations

from typing import Any

import torch

from llmserve.decoding import pack_mask
from llmserve.hookspecs import hookimpl
from llmserve.sampling_params import SamplingParams


class TokenMasks:
    """One sample's constraint."""

    def __init__(self, allowed: torch.Tensor | None, bad: tuple[tuple[int, ...], ...]) -> None:
        self.allowed = allowed
        self.bad = bad
        self.keep = max((len(seq) - 1 for seq in bad), default=0)
        self.tail: list[int] = []

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.allowed is None:
            bitmask[row] = -1
        else:
            bitmask[row] = self.allowed
        for seq in self.bad:
            if len(seq) == 1 or tuple(self.tail[len(self.tail) - len(seq) + 1:]) == seq[:-1]:
                word, bit = divmod(seq[-1], 32)
                bitmask[row, word] &= 0x7FFFFFFF if bit == 31 else ~(1 << bit)

    def accept(self, token: int) -> None:
        if self.keep:
            self.tail.append(token)
            del self.tail[:-self.keep]


class TokenMaskStrategy:
    def wants(self, params: SamplingParams) -> bool:
        return params.allowed_token_ids is not None or bool(params.bad_words)

    def prepare(self, params: SamplingParams, tokenizer: Any, vocab_size: int,
                eos_token_ids: tuple[int, ...]) -> tuple[torch.Tensor | None, tuple[tuple[int, ...], ...]]:
        allowed = None
        if params.allowed_token_ids is not None:
            if bad := [t for t in params.allowed_token_ids if t >= vocab_size]:
                raise ValueError(f"allowed_token_ids must be < vocab size {vocab_size}, got {bad}")
            if params.min_tokens and set(params.allowed_token_ids) <= set(params.held_back(eos_token_ids)):
                raise ValueError(f"allowed_token_ids: with min_tokens {params.min_tokens}, allow a token that does "
                                 f"not end the request (all of {sorted(params.allowed_token_ids)} do, and min_tokens "
                                 f"holds them back)")
            allowed = pack_mask(params.allowed_token_ids, vocab_size)
        sequences: set[tuple[int, ...]] = set()
        for word in params.bad_words or []:
            if tokenizer is None:
                raise ValueError("bad_words: this model has no tokenizer to encode them with")
            for text in (word, " " + word.lstrip()):
                ids = tuple(tokenizer.encode(text, add_special_tokens=False))
                if ids and all(t < vocab_size for t in ids):
                    sequences.add(ids)
        return allowed, tuple(sorted(sequences))

    def start(self, prepared: tuple[torch.Tensor | None, tuple[tuple[int, ...], ...]]) -> TokenMasks:
        return TokenMasks(*prepared)


@hookimpl
def llmserve_register_decoding_strategies(register) -> None:
    register("token_masks", TokenMaskStrategy())
