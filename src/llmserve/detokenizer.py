"""Incremental detokenization and stop strings for one output sequence.

Decoding token by token breaks multi-byte characters (a UTF-8 character split over two byte-level
tokens) and loses the leading space that SentencePiece-style tokenizers attach to a word. So each
new piece is the difference between decoding a short window ending at the new token and decoding
the same window without it, and it is held back while it ends in U+FFFD (an incomplete character).
"""

from __future__ import annotations

from typing import Any

_WINDOW = 5  # tokens of left context the window keeps


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop: bool) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_WINDOW:])  # the left context of the first output token
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip_special = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_ids: list[int], final: bool = False) -> str | None:
        """Append tokens; returns the stop string if one now appears in the text (text is cut there).

        `final` marks the sequence's last call: an incomplete character is then emitted as U+FFFD.
        """
        if self.tokenizer is None:
            return None
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return None
        old_len = len(self.text)
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> str | None:
        # A stop string may start in text emitted earlier: look back far enough to catch it.
        start = max(0, old_len - self.hold)
        best = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[:idx + len(s) if self.include_stop else idx]
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, the tail that could begin a stop string is held back."""
        if finished or not self.stop:
            return self.text
        return self.text[:len(self.text) - self.hold] if self.hold else self.text
