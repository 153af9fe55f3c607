"""Tool-call parsers: how the chat API finds tool calls in a model's own output format (the
`tool_choice: "auto"` path), registered by plugins through `llmserve_register_tool_parsers`.

A plugin registers a factory under a name; `server.tool_call_parser` picks one. The server makes
one parser per choice and feeds it the choice's text as it is produced:

    factory(tools) -> parser    tools: the request's tool definitions, as the chat template gets them
                                ({"type": "function", "function": {"name", "description", "parameters"}})
    parser.feed(text) -> events the text produced since the last feed
    parser.finish() -> events   the output ended: what the parser held back

An event is one of
    str                         content: text for the user, outside any tool call
    CallStart(index, name)      a tool call begins (calls are numbered 0, 1, ... in order)
    ArgumentsPiece(index, text) more of that call's arguments, JSON text

A call's arguments are the concatenation of its pieces. A parser may hold text back while it
cannot tell yet whether it is content or a call (the first characters of a call's opening tag);
what it returns, concatenated, must not depend on how the text was split into feeds: the
non-streamed response is the same parser fed the whole text at once (`parse_whole`), so a stream
reconstructs exactly the response it would have had.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


@dataclass(slots=True, frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(slots=True, frozen=True)
class ArgumentsPiece:
    index: int
    text: str


Event = str | CallStart | ArgumentsPiece


class ToolParser(Protocol):
    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


ToolParserFactory = Callable[[list[dict[str, Any]]], ToolParser]


@dataclass(slots=True)
class ParsedCall:
    name: str
    arguments: str = ""


@dataclass(slots=True)
class Parsed:
    """A whole output: its content (the text outside tool calls) and its calls, in order."""
    content: str = ""
    calls: list[ParsedCall] = field(default_factory=list)


def collect(events: list[Event], into: Parsed | None = None) -> Parsed:
    """Events gathered into content and calls."""
    parsed = into if into is not None else Parsed()
    for event in events:
        if isinstance(event, str):
            parsed.content += event
        elif isinstance(event, CallStart):
            parsed.calls.append(ParsedCall(event.name))
        else:
            parsed.calls[event.index].arguments += event.text
    return parsed


def parse_whole(parser: ToolParser, text: str) -> Parsed:
    return collect(parser.feed(text) + parser.finish())


def held_tag_prefix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper prefix of `tag` (0 if none): text
    that must wait for the next feed, since it may be the tag's first characters."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class JsonScanner:
    """Finds where a JSON object or array ends in text that arrives in pieces.

    It tracks the nesting depth of brackets outside strings (and whether it is inside a string,
    just after a backslash there); the value ends where the depth returns to 0. It does not
    validate: a malformed value ends wherever its brackets balance."""

    __slots__ = ("depth", "in_string", "escaped")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def advance(self, text: str, stop: str | None = None) -> tuple[int, bool]:
        """(consumed, ended): how many characters of `text` belong to the value, and whether it
        ended with them. With `stop`, scanning halts before that character where it stands outside
        a string (consumed is then its index, ended False) so the caller can look at what follows."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == stop:
                return i, False
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1, True
        return len(text), False
