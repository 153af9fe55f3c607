"""Incremental detokenization and stop strings for one output sequence.

Decoding token by token breaks multi-byte characters (a UTF-8 character split over two byte-level
tokens) and loses the leading space that SentencePiece-style tokenizers attach to a word. So each
new piece is the difference between decoding a short window ending at the new token and decoding
the same window without it, and it is held back while it ends in U+FFFD (an incomplete character).

A fast (Rust) tokenizer does that in `tokenizers.decoders.DecodeStream`, started on the prompt's
last tokens: one call a token, several times cheaper than the two `PreTrainedTokenizer.decode`
calls of the window method, which other tokenizers still use; on a large batch detokenizing is
most of the event loop's work a step.

A sequence whose text nobody reads before it ends (an offline batch's: only the finished output is
published) and that has no stop strings to look for defers it all: its ids are kept, and the text
is decoded once, as the fast tokenizer decodes the prompt's last tokens and the output together
with the prompt's part cut off (which is what the stream adds up to).
"""

from __future__ import annotations

from typing import Any

_WINDOW = 5  # tokens of left context the window keeps


def rust_tokenizer(tokenizer: Any) -> Any | None:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer whose decode it reproduces
    (no space clean-up pass on top), else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


class Detokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop: bool, *, final_only: bool = False) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_WINDOW:])  # the left context of the first output token
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.skip_special = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self._rust = rust_tokenizer(tokenizer)
        self._deferred: list[int] | None = [] if final_only and not stop and self._rust is not None else None
        """The output ids not decoded yet, where the text is decoded once at the end."""
        if self._rust is not None and self._deferred is None:
            from tokenizers.decoders import DecodeStream

            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            emitted = 0
            for t in self.ids:  # the context: its text is not ours
                emitted += len(self._stream.step(self._rust, t) or "")
            # A context ending in a broken character leaves it held in the stream: its text (or what
            # the next tokens make of it) leads the first piece and is cut off there, as decoding
            # windows does.
            self._skip = len(self._rust.decode(self.ids, skip_special_tokens)) - emitted

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_ids: list[int], final: bool = False) -> str | None:
        """Append tokens; returns the stop string if one now appears in the text (text is cut there).

        `final` marks the sequence's last call: an incomplete character is then emitted as U+FFFD.
        """
        if self.tokenizer is None:
            return None
        if self._deferred is not None:
            self._deferred.extend(token_ids)
            if final:
                self._decode_deferred()
            return None
        old_len = len(self.text)
        if self._rust is not None:
            self._add_streamed(token_ids, final)
        else:
            self._add_windowed(token_ids, final)
        return self._find_stop(old_len) if len(self.text) > old_len else None

    def _add_streamed(self, token_ids: list[int], final: bool) -> None:
        # self.ids[prefix_offset:read_offset] is the context of the tokens after read_offset,
        # which the stream holds back (they end in an incomplete character).
        for t in token_ids:
            self.ids.append(t)
            piece = self._stream.step(self._rust, t)
            if piece is not None:
                if self._skip:
                    piece, self._skip = piece[self._skip:], max(0, self._skip - len(piece))
                self.text += piece
                self.read_offset = len(self.ids)
                self.prefix_offset = max(0, self.read_offset - _WINDOW)
        if final and self.read_offset < len(self.ids):
            prefix = self._rust.decode(self.ids[self.prefix_offset:self.read_offset], self.skip_special)
            self.text += self._rust.decode(self.ids[self.prefix_offset:], self.skip_special)[len(prefix):]
            self._skip = 0
        if len(self.ids) > 4 * _WINDOW:  # keep the list short: only the window is ever read
            drop = self.prefix_offset
            del self.ids[:drop]
            self.prefix_offset, self.read_offset = 0, self.read_offset - drop

    def _decode_deferred(self) -> None:
        context = self._rust.decode(self.ids, self.skip_special)
        self.text += self._rust.decode(self.ids + self._deferred, self.skip_special)[len(context):]
        self.ids += self._deferred
        self._deferred = []

    def _add_windowed(self, token_ids: list[int], final: bool) -> None:
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return
        self.text += full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _find_stop(self, old_len: int) -> str | None:
        # A match not found before ends in the new text, and may start in text emitted earlier:
        # each stop string is looked for from its own length back (linear in the new text and the
        # stop strings' length; one regex alternation of them all retried each string at every
        # held-back position, quadratic in a long one).
        best = None
        for s in self.stop:
            idx = self.text.find(s, max(0, old_len - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[:idx + len(s) if self.include_stop else idx]
        return s

    def visible_text(self, finished: bool) -> str:
        """Text safe to show: while running, the tail that could begin a stop string is held back."""
        if self._deferred:  # ended without its final tokens (an abort): what it has
            self._decode_deferred()
        if finished or not self.stop:
            return self.text
        return self.text[:len(self.text) - self.hold] if self.hold else self.text
