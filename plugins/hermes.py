"""`hermes`: the tool-call format of Hermes and Qwen models (Qwen2.5, Qwen3, QwQ...), whose chat
templates ask for each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

several in a row for parallel calls, after any text for the user.

The parser (llmserve.tool_parsers has the protocol) reads the output as states:

    text    content, up to `<tool_call>`; an end of the text that may be the tag's start waits
    open    inside a block, until its header `{"name": "...", "arguments": {` is complete (the call
            starts there and its arguments stream as they come) or until `</tool_call>` (the block
            is then parsed whole: a JSON object with a string "name" and "arguments" an object, or
            its text as a string, is a call; anything else stays in the content, tags included)
    args    the arguments object, streamed, up to its closing bracket (found by JsonScanner), or up
            to a `</tool_call>` outside a string, which ends a call whose arguments never closed
    tail    after the arguments: whitespace, the outer `}` and `</tool_call>` are dropped; any
            other text ends the call and goes on as content

Whitespace next to a call (the newlines between blocks, before the first and after the last) is
not content: a run of whitespace is held until what follows it is known. Calls the output leaves
unfinished are reported with what it wrote of them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmserve.hookspecs import hookimpl
from llmserve.tool_parsers import ArgumentsPiece, CallStart, Event, JsonScanner, held_tag_prefix

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
_TAIL = re.compile(r"\s*\}?\s*")


class HermesToolParser:
    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.state = "text"
        self.buf = ""  # text fed and not yet decided
        self.calls = 0
        self.ws_held = ""  # trailing whitespace of the content so far
        self.after_call = False  # no content since the last call: leading whitespace is dropped
        self.scanner = JsonScanner()

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        events: list[Event] = []
        while self.buf and getattr(self, f"_{self.state}")(events):
            pass
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.state == "text":
            events += self._content(self.buf)
        elif self.state == "open":  # a block never closed and never recognised: content
            events += self._content(OPEN_TAG + self.buf)
        elif self.state == "args" and self.buf:  # a held `<` that was no closing tag
            events.append(ArgumentsPiece(self.calls - 1, self.buf))
        # (in the tail, what is held is whitespace, a brace or part of the closing tag: dropped)
        if self.ws_held and not self.after_call:
            events.append(self.ws_held)
        self.buf, self.ws_held, self.state = "", "", "text"
        return events

    # Each state's step consumes from self.buf and returns whether to go on (False: wait for more).

    def _text(self, events: list[Event]) -> bool:
        at = self.buf.find(OPEN_TAG)
        if at < 0:
            keep = held_tag_prefix(self.buf, OPEN_TAG)
            content, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
            events += self._content(content)
            return False
        events += self._content(self.buf[:at])
        self.buf, self.state = self.buf[at + len(OPEN_TAG):], "open"
        return True

    def _open(self, events: list[Event]) -> bool:
        close = self.buf.find(CLOSE_TAG)
        block = self.buf if close < 0 else self.buf[:close]
        if (m := _HEADER.match(block)) and (name := _json_string(m.group(1))) is not None:
            events.append(self._start(name))
            self.buf, self.state, self.scanner = self.buf[m.end():], "args", JsonScanner()
            return True
        if close < 0:
            return False
        self.buf = self.buf[close + len(CLOSE_TAG):]
        self.state = "text"
        call = _whole_call(block)
        if call is None:
            events += self._content(OPEN_TAG + block + CLOSE_TAG)
        else:
            events += [self._start(call[0]), ArgumentsPiece(self.calls - 1, call[1])]
        return True

    def _args(self, events: list[Event]) -> bool:
        consumed, ended = self.scanner.advance(self.buf, stop="<")
        piece, rest = self.buf[:consumed], self.buf[consumed:]
        if not ended and rest:  # stopped at a `<` outside a string
            if rest.startswith(CLOSE_TAG):
                rest, self.state = rest[len(CLOSE_TAG):], "text"
            elif CLOSE_TAG.startswith(rest):
                self.buf = rest
                if piece:
                    events.append(ArgumentsPiece(self.calls - 1, piece))
                return False
            else:  # not the tag: part of the (malformed) arguments
                self.scanner.advance("<")
                piece, rest = piece + "<", rest[1:]
        if piece:
            events.append(ArgumentsPiece(self.calls - 1, piece))
        if ended:
            self.state = "tail"
        self.buf = rest
        return bool(rest)

    def _tail(self, events: list[Event]) -> bool:
        rest = self.buf[_TAIL.match(self.buf).end():]
        if rest.startswith(CLOSE_TAG):
            self.buf, self.state = rest[len(CLOSE_TAG):], "text"
            return True
        if CLOSE_TAG.startswith(rest):  # (rest may be empty: whitespace so far)
            return False
        self.buf, self.state = rest, "text"
        return True

    def _start(self, name: str) -> CallStart:
        self.calls += 1
        self.ws_held, self.after_call = "", True
        return CallStart(self.calls - 1, name)

    def _content(self, text: str) -> list[Event]:
        text = self.ws_held + text
        body = text.rstrip()
        if not body:
            self.ws_held = text
            return []
        self.ws_held = text[len(body):]
        if self.after_call:
            body = body.lstrip()
            self.after_call = False
        return [body]


def _json_string(raw: str) -> str | None:
    """The value of a JSON string's inside (escapes decoded), or None if it is not valid."""
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return None


def _whole_call(block: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a complete block, or None if it is no call."""
    try:
        obj = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", {})
    if isinstance(arguments, dict):
        return obj["name"], json.dumps(arguments, ensure_ascii=False)
    if isinstance(arguments, str):  # already JSON text, as some fine-tunes write it
        return obj["name"], arguments
    return None


@hookimpl
def llmserve_register_tool_parsers(register) -> None:
    register("hermes", HermesToolParser)
