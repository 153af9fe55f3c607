"""Reasoning parsers (`server.reasoning_parser`, vLLM's `--reasoning-parser`): a chat choice's
thinking, written between tags before its answer, is reported as `reasoning` (and, for clients
written for vLLM before it renamed the field, `reasoning_content`) instead of content. A parser
is a ReasoningFormat (its tags, and whether a choice begins inside them), registered by name
through the `llmserve_register_reasoning_parsers` hook; the built-in ones (plugins/reasoning.py):

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

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from llmserve.config import EngineConfig


@dataclass(frozen=True, slots=True)
class ReasoningFormat:
    starts_inside: bool
    """The choice begins inside its reasoning (the template opened the tag in the prompt)."""
    open: str = "<think>"
    close: str = "</think>"

    def __post_init__(self) -> None:
        if not (isinstance(self.open, str) and isinstance(self.close, str) and self.open and self.close
                and self.open != self.close):
            raise ValueError(f"a reasoning format's tags must be two different non-empty strings, "
                             f"got {self.open!r} and {self.close!r}")

    def after(self, prompt: str) -> ReasoningFormat | None:
        """How a choice that follows `prompt` begins: inside its reasoning where the prompt left a
        tag open (Qwen3's thinking-only templates, a continued message), all content where the
        prompt closed one last (thinking switched off: `<think>\n\n</think>`), else as the
        parser says. None: nothing to split."""
        tail = prompt.rstrip()
        if tail.endswith(self.close):
            return None
        if prompt.rfind(self.open) > prompt.rfind(self.close):
            return self.inside(True)
        return self

    def inside(self, starts_inside: bool) -> ReasoningFormat:
        """The same tags, a choice beginning inside them or not."""
        return self if starts_inside == self.starts_inside else dataclasses.replace(self, starts_inside=starts_inside)


def reasoning_format(config: EngineConfig) -> ReasoningFormat | None:
    """The format of `server.reasoning_parser` among the registered parsers (None: unset); a
    ValueError naming the ones there are if it is not registered (checked at start-up)."""
    from llmserve.plugin_manager import Plugins

    name = config.server.reasoning_parser
    if name is None:
        return None
    parsers = Plugins.from_config(config.plugins).reasoning_parsers()
    if name not in parsers:
        raise ValueError(f"server.reasoning_parser {name!r} is not available; registered parsers: {sorted(parsers)}")
    return parsers[name]


class ReasoningSplit:
    """One choice's text split into reasoning and content, piece by piece."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        # "start" (the opening tag may come) -> "reasoning" -> "content"; the newlines that open
        # the reasoning and the content are dropped as they come ("strip": not yet past them)
        self.state = "start"
        self.inside_first = fmt.starts_inside
        self.open, self.close = fmt.open, fmt.close
        self.strip = False
        self.buf = ""  # text not given out yet: a possible tag's beginning, or newlines before one

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of `text`, the choice's text since the last call; `final`: it ended."""
        self.buf += text
        reasoning = ""
        if self.state == "start":
            stripped = self.buf.lstrip()
            if stripped.startswith(self.open):
                self.buf, self.state, self.strip = stripped[len(self.open):], "reasoning", True
            elif not final and self.open.startswith(stripped):  # nothing yet, or the tag's beginning: wait
                return "", ""
            else:
                self.state, self.strip = ("reasoning" if self.inside_first else "content"), self.inside_first
        if self.strip:
            self.buf = self.buf.lstrip("\n")
            self.strip = not self.buf and not final
        if self.state == "reasoning":
            at = self.buf.find(self.close)
            if at < 0:
                keep = 0 if final else _partial_tail(self.buf, self.close)
                body = self.buf[:len(self.buf) - keep]
                if not final:  # newlines that may come right before the tag
                    keep += len(body) - len(body.rstrip("\n"))
                reasoning, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                return reasoning, ""
            reasoning = self.buf[:at].rstrip("\n")
            self.buf, self.state = self.buf[at + len(self.close):].lstrip("\n"), "content"
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
