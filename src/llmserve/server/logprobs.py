"""Logprobs as the OpenAI API writes them: completions' parallel lists, chat's content items, and
vLLM's prompt_logprobs. A token is named by its text (the piece the engine decoded, else the
tokenizer's), or, with vLLM's return_tokens_as_token_ids, "token_id:N" (for clients that read ids,
where a token's text can be ambiguous)."""

from __future__ import annotations

from collections.abc import Callable

from llmserve.outputs import PositionLogprobs, RequestOutput


class LogprobsFormat:
    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text
        """A token's text where the engine decoded none."""

    def piece(self, token_id: int, entry: PositionLogprobs | None, as_id: bool = False) -> str:
        if as_id:
            return f"token_id:{token_id}"
        if entry is not None and token_id in entry and entry[token_id].decoded_token is not None:
            return entry[token_id].decoded_token
        return self.token_text(token_id)

    @staticmethod
    def top(entry: PositionLogprobs, k: int) -> list[tuple[int, float]]:
        """The k most likely (token id, logprob) at one position; the entry also holds the chosen token."""
        return [(t, lp.logprob) for lp, t in sorted(((lp, t) for t, lp in entry.items() if lp.rank <= k),
                                                     key=lambda x: x[0].rank)]

    def completion(self, token_ids: list[int], logprobs: list[PositionLogprobs | None], offset: int, k: int,
                   as_ids: bool = False) -> dict:
        """The completions API's lists; text offsets from `offset` on."""
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for tid, entry in zip(token_ids, logprobs):
            piece = self.piece(tid, entry, as_ids)
            tokens.append(piece)
            offsets.append(pos)
            pos += len(piece)
            if entry is None:  # the first prompt token has nothing before it
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(entry[tid].logprob)
            tops.append({self.piece(t, entry, as_ids): lp for t, lp in self.top(entry, k)})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def merged(prompt: dict, completion: dict, shift: int) -> dict:
        """An echoed prompt's lists, then the completion's, its offsets moved on by `shift`."""
        return {"tokens": prompt["tokens"] + completion["tokens"],
                "token_logprobs": prompt["token_logprobs"] + completion["token_logprobs"],
                "top_logprobs": prompt["top_logprobs"] + completion["top_logprobs"],
                "text_offset": prompt["text_offset"] + [o + shift for o in completion["text_offset"]]}

    def chat(self, token_ids: list[int], logprobs: list[PositionLogprobs], k: int, as_ids: bool = False) -> dict:
        """The chat API's content items (the chosen token's bytes: its text's, as vLLM gives them)."""
        def item(t: int, lp: float, entry: PositionLogprobs, chosen: bool = False) -> dict:
            piece = self.piece(t, entry, as_ids)
            text = self.piece(t, entry) if chosen and as_ids else piece
            return {"token": piece, "logprob": lp, "bytes": list(text.encode())}

        return {"content": [{**item(tid, entry[tid].logprob, entry, chosen=True),
                             "top_logprobs": [item(t, lp, entry) for t, lp in self.top(entry, k)]}
                            for tid, entry in zip(token_ids, logprobs)]}

    def prompt(self, out: RequestOutput, k: int) -> list[dict[str, dict] | None]:
        """vLLM's prompt_logprobs: per prompt position (None at the first), token id -> its logprob,
        rank and text, for the prompt's token and the k most likely there."""
        return [None if entry is None else
                {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": self.piece(t, entry)}
                 for t, lp in entry.items() if lp.rank <= k or t == tid}
                for tid, entry in zip(out.prompt_token_ids, out.prompt_logprobs or [])]
