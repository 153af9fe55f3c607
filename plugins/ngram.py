"""`ngram`: speculative decoding's prompt-lookup proposer, no weights of its own.

The last n tokens of a request (n from prompt_lookup_max down to prompt_lookup_min) are looked up
in its prompt and output so far; at their latest earlier occurrence, the tokens that followed are
the drafts. It pays where the answer repeats its context: editing or summarising a given text,
code that restates its names, extraction.

    prompt + output   ... a b c d e ... x a b c |      last n = 3 tokens: a b c
    latest earlier  a b c  is followed by  d e ...   ->  drafts d e ...
"""

from __future__ import annotations

from array import array

import numpy as np

from llmserve.config import SpeculativeConfig
from llmserve.hookspecs import hookimpl
from llmserve.speculative import ProposerContext


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        if config.model is not None:
            raise ValueError(f"speculative.model {config.model!r} is not used by method 'ngram' (a draft model is "
                             "method 'draft')")
        self.n_min = config.prompt_lookup_min or 1
        self.n_max = config.prompt_lookup_max or max(4, self.n_min)

    def propose(self, req_ids: list[str], sequences: list[tuple[array, list[int]]],
                limits: list[int]) -> list[list[int]]:
        return [self.lookup(np.concatenate([np.frombuffer(prompt, dtype=np.int64), np.array(output, dtype=np.int64)]),
                            limit) for (prompt, output), limit in zip(sequences, limits)]

    def lookup(self, tokens: np.ndarray, limit: int) -> list[int]:
        """The drafts for the token ids `tokens` (int64), at most `limit` of them.

        One pass over the tokens finds where the last one occurred before (each such place is
        followed by a token); the candidates' runs of matching tokens are then extended backwards
        together, one comparison per length up to n_max. The longest run wins, the latest of equals."""
        total = len(tokens)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # candidate runs end here
        if not ends.size:
            return []
        lengths = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for j in range(1, min(self.n_max, total - 1)):
            alive &= (ends >= j) & (tokens[np.maximum(ends - j, 0)] == tokens[total - 1 - j])
            if not alive.any():
                break
            lengths += alive
        best = len(lengths) - 1 - int(np.argmax(lengths[::-1]))  # the latest of the longest
        if lengths[best] < self.n_min:
            return []
        start = int(ends[best]) + 1
        return tokens[start:start + limit].tolist()


@hookimpl
def llmserve_register_proposers(register) -> None:
    register("ngram", NgramProposer)
