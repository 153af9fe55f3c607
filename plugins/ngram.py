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


_FEW = 16  # candidates (earlier places of the last token) compared one by one, not as one array


class NgramProposer:
    def __init__(self, config: SpeculativeConfig, context: ProposerContext | None = None) -> None:
        if config.model is not None:
            raise ValueError(f"speculative.model {config.model!r} is not used by method 'ngram' (a draft model is "
                             "method 'draft')")
        self.n_min = config.prompt_lookup_min or 1
        self.n_max = config.prompt_lookup_max or max(4, self.n_min)
        self._seen: dict[str, tuple[np.ndarray, int]] = {}  # request -> (its tokens' buffer, how many)

    def propose(self, req_ids: list[str], sequences: list[tuple[array, list[int]]],
                limits: list[int]) -> list[list[int]]:
        return [self.lookup(self._tokens(req_id, prompt, output), limit)
                for req_id, (prompt, output), limit in zip(req_ids, sequences, limits)]

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self._seen.pop(req_id, None)

    def _tokens(self, req_id: str, prompt: array, output: list[int]) -> np.ndarray:
        """prompt + output as int64: the request's buffer from its last call, extended by the tokens
        output gained since. Between calls output only grows, but for its last token then, which a
        jump-forward may rewrite: where the buffer's last token is no longer there, it is rebuilt."""
        p, n = len(prompt), len(prompt) + len(output)
        buf, have = self._seen.get(req_id, (None, 0))
        if buf is not None and p < have <= n and buf[have - 1] == output[have - 1 - p]:
            if n > len(buf):
                buf = np.concatenate([buf[:have], np.empty(n, dtype=np.int64)])
            buf[have:n] = output[have - p:]
        else:
            buf = np.empty(max(2 * n, 64), dtype=np.int64)
            buf[:p] = np.frombuffer(prompt, dtype=np.int64)
            buf[p:n] = output
        self._seen[req_id] = (buf, n)
        return buf[:n]

    def lookup(self, tokens: np.ndarray, limit: int) -> list[int]:
        """The drafts for the token ids `tokens` (int64), at most `limit` of them.

        One pass over the tokens finds where the last one occurred before (each such place is
        followed by a token); the candidates' runs of matching tokens are then extended backwards,
        up to n_max: as one [candidates, n_max - 1] comparison, or one by one where there are at
        most _FEW. The longest run wins, the latest of equals."""
        total = len(tokens)
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # candidate runs end here
        if not ends.size:
            return []
        longest = min(self.n_max, total - 1)  # a run's length at most
        if len(ends) <= _FEW:
            end, length = self._walk(tokens, ends, longest)
        else:
            lengths = np.ones(len(ends), dtype=np.int64)
            back = np.arange(1, longest)
            if back.size:
                before = ends[:, None] - back  # the positions a run of 1 + j would reach
                same = (before >= 0) & (tokens[np.maximum(before, 0)] == tokens[total - 1 - back])
                lengths += np.cumprod(same, axis=1).sum(axis=1)
            best = len(lengths) - 1 - int(np.argmax(lengths[::-1]))  # the latest of the longest
            end, length = int(ends[best]), int(lengths[best])
        if length < self.n_min:
            return []
        return tokens[end + 1:end + 1 + limit].tolist()

    @staticmethod
    def _walk(tokens: np.ndarray, ends: np.ndarray, longest: int) -> tuple[int, int]:
        """lookup's longest run for a few candidates, one at a time in Python (a dozen array
        operations on tiny arrays cost more): (where it ends, its length), the latest of equals."""
        tail = tokens[len(tokens) - longest:-1].tolist()  # the tokens a run extends back over
        best, best_length = -1, 0
        for end in reversed(ends.tolist()):
            before = tokens[max(end - longest + 1, 0):end].tolist()
            length = 1
            while length <= len(before) and before[-length] == tail[-length]:
                length += 1
            if length > best_length:
                best, best_length = end, length
                if length == longest:
                    break
        return best, best_length


@hookimpl
def llmserve_register_proposers(register) -> None:
    register("ngram", NgramProposer)
