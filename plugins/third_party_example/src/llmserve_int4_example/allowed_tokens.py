"""A decoding strategy: `allowed_token_ids`, sampling restricted to the token ids a request names in
`SamplingParams(extra_args={"allowed_token_ids": [...]})`.

The request side checks the ids and packs them into a mask once; each sample's constraint writes
that mask for every position (what came before does not change it).
"""

from __future__ import annotations

import torch

from llmserve.decoding import pack_mask
from llmserve.hookspecs import hookimpl
from llmserve.sampling_params import SamplingParams

KEY = "allowed_token_ids"


class FixedMask:
    def __init__(self, mask: torch.Tensor) -> None:
        self.mask = mask

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = self.mask

    def accept(self, token: int) -> None:
        pass


class AllowedTokenIds:
    def wants(self, params: SamplingParams) -> bool:
        return KEY in (params.extra_args or {})

    def prepare(self, params: SamplingParams, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> torch.Tensor:
        ids = params.extra_args[KEY]
        if not (isinstance(ids, list) and ids and all(type(t) is int and 0 <= t < vocab_size for t in ids)):
            raise ValueError(f"extra_args.{KEY} must be a non-empty list of token ids in [0, {vocab_size}), got {ids!r}")
        return pack_mask(ids, vocab_size)

    def start(self, prepared: torch.Tensor) -> FixedMask:
        return FixedMask(prepared)


@hookimpl
def llmserve_register_decoding_strategies(register) -> None:
    register(KEY, AllowedTokenIds())
