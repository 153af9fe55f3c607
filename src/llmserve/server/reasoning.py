"""Reasoning parsers (`server.reasoning_parser`, vLLM's `--reasoning-parser`): a chat choice's
thinking, written between tags before its answer, is reported as `reasoning` (and, for clients
written for vLLM before it renamed the field, `reasoning_content`) instead of content.

    parser        the choice's text                                   reasoning       content
    qwen3         "<think>R</think>C"  (Qwen3 with thinking on)      R               C
                  "C"                  (thinking off: no tag first)   none            C
    deepseek_r1   "R</think>C" or "<think>R</think>C" (its template   R               C
                  opens the tag in the prompt)

Where the prompt itself opened the tag, the choice begins inside its reasoning; where it ends with
a closed one (thinking switched off), all of it is content. An output a grammar constrains
(structured outputs, tool_choice required or named) begins as content whatever the parser: it
thinks only where the grammar lets it write the opening tag. Leading whitespace before
the opening tag, and the newlines the models put around the closing tag, are not part of either. A choice cut short inside its reasoning has reasoning and no
content. Text is split as it is produced (a stream's pieces may cut a tag anywhere): the tail
that could begin a tag is held back until the next piece tells, so the pieces of a stream add
up to exactly what the whole text gives.
"""

from __future__ import annotations

from dataclasses import dataclass

_OPEN, _CLOSE = "<think>", "</think>"


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    starts_inside: bool
    """The choice begins inside its reasoning (the template opened the tag in the prompt)."""

    def after(self, prompt: str) -> ReasoningFormat | None:
        """How a choice that follows `prompt` begins: inside its reasoning where the prompt left a
        tag open (Qwen3's thinking-only templates, a continued message), all content where the
        prompt closed one last (thinking switched off: `<think>\n\n</think>`), else as the
        parser says. None: nothing to split."""
        tail = prompt.rstrip()
        if tail.endswith(_CLOSE):
            return None
        if prompt.rfind(_OPEN) > prompt.rfind(_CLOSE):
            return ReasoningFormat(starts_inside=True)
        return self


REASONING_PARSERS = {"qwen3": ReasoningFormat(starts_inside=False), "deepseek_r1": ReasoningFormat(starts_inside=True)}
"""The built-in parsers by name."""


class ReasoningSplit:
    """One choice's text split into reasoning and content, piece by piece."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        # "start" (the opening tag may come) -> "reasoning" -> "content"; the newlines that open
        # the reasoning and the content are dropped as they come ("strip": not yet past them)
        self.state = "start"
        self.inside_first = fmt.starts_inside
        self.strip = False
        self.buf = ""  # text not given out yet: a possible tag's beginning, or newlines before one

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of `text`, the choice's text since the last call; `final`: it ended."""
        self.buf += text
        reasoning = ""
        if self.state == "start":
            stripped = self.buf.lstrip()
            if stripped.startswith(_OPEN):
                self.buf, self.state, self.strip = stripped[len(_OPEN):], "reasoning", True
            elif not final and _OPEN.startswith(stripped):  # nothing yet, or the tag's beginning: wait
                return "", ""
            else:
                self.state, self.strip = ("reasoning" if self.inside_first else "content"), self.inside_first
        if self.strip:
            self.buf = self.buf.lstrip("\n")
            self.strip = not self.buf and not final
        if self.state == "reasoning":
            at = self.buf.find(_CLOSE)
            if at < 0:
                keep = 0 if final else _partial_tail(self.buf, _CLOSE)
                body = self.buf[:len(self.buf) - keep]
                if not final:  # newlines that may come right before the tag
                    keep += len(body) - len(body.rstrip("\n"))
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning = self.buf[:at].rstrip("\n")
            self.buf, self.state = self.buf[at + len(_CLOSE):].lstrip("\n"), "content"
            self.strip = not self.buf and not final
        content, self.buf = self.buf, ""
        return reasoning, content


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a whole choice; reasoning None where it has none."""
    reasoning, content = ReasoningSplit(fmt).feed(text, final=True)
    return reasoning or None, content


def _partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the tag may follow)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
