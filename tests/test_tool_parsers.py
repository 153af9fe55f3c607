"""Tool-call parsers without a server: the hermes format's cases, streamed split at every character
boundary (the pieces add up to the unstreamed result), the required-array parser, and the deltas
and message a choice's events become."""

import json

import pytest

from llmserve.plugins.hermes import HermesToolParser
from llmserve.server.tool_calls import ChoiceCalls, _Arguments, _CallArray
from llmserve.tool_parsers import ArgumentsPiece, CallStart, JsonScanner, Parsed, ParsedCall, collect, held_tag_prefix, \
    parse_whole

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def call(name, arguments):
    return ParsedCall(name, arguments)


@pytest.mark.parametrize("text, content, calls", [
    ("Just text, no call.", "Just text, no call.", []),
    ("  spaced \n", "  spaced \n", []),  # without calls the text is the content, as written
    (WEATHER, "", [call("get_weather", '{"city": "Paris", "days": 2}')]),
    ("Let me check.\n\n" + WEATHER + "\n", "Let me check.", [call("get_weather", '{"city": "Paris", "days": 2}')]),
    (WEATHER + "\n" + WEATHER.replace("Paris", "Rome"), "",
     [call("get_weather", '{"city": "Paris", "days": 2}'), call("get_weather", '{"city": "Rome", "days": 2}')]),
    (WEATHER + "\nDone.", "Done.", [call("get_weather", '{"city": "Paris", "days": 2}')]),
    # braces, tags and escapes inside strings belong to the arguments
    ('<tool_call>{"name": "f", "arguments": {"s": "}</tool_call>{\\"", "n": [1, {"a": null}]}}</tool_call>', "",
     [call("f", '{"s": "}</tool_call>{\\"", "n": [1, {"a": null}]}')]),
    # other key orders and string arguments are parsed once the block closes (arguments re-serialized)
    ('<tool_call>{"arguments": {"q":  1}, "name": "g"}</tool_call>', "", [call("g", '{"q": 1}')]),
    ('<tool_call>{"name": "g", "arguments": "{\\"q\\": 1}"}</tool_call>', "", [call("g", '{"q": 1}')]),
    ('<tool_call>{"name": "g"}</tool_call>', "", [call("g", "{}")]),
    ('<tool_call>{"name": "na\\u00efve", "arguments": {}}</tool_call>', "", [call("naïve", "{}")]),
    # unparsable blocks stay in the content, tags and all
    ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ('<tool_call>{"arguments": 3, "name": "g"}</tool_call>', '<tool_call>{"arguments": 3, "name": "g"}</tool_call>', []),
    ("x <tool_call>{\"name\": ", "x <tool_call>{\"name\": ", []),  # never closed, never recognised
    ("x <tool_ca", "x <tool_ca", []),  # a tag's start at the end is content after all
    # cut short: the call begun is reported with what was written of it
    ('<tool_call>\n{"name": "f", "arguments": {"a": "b', "", [call("f", '{"a": "b')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1</tool_call>after', "after", [call("f", '{"a": 1')]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1 <b}}</tool_call>', "", [call("f", '{"a": 1 <b}')]),
    # text after the arguments other than `}` and the closing tag ends the call and is content
    ('<tool_call>{"name": "f", "arguments": {}, "x": 1}</tool_call>', ', "x": 1}</tool_call>', [call("f", "{}")]),
])
def test_hermes_cases_and_every_split(text, content, calls):
    whole = parse_whole(HermesToolParser(), text)
    assert whole == Parsed(content, calls)
    for cut in range(len(text) + 1):
        parser = HermesToolParser()
        assert collect(parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()) == whole, cut
    parser = HermesToolParser()  # one character at a time
    assert collect([e for ch in text for e in parser.feed(ch)] + parser.finish()) == whole


def test_hermes_streams_arguments_as_they_come_and_holds_back_a_tags_start():
    parser = HermesToolParser()
    assert parser.feed("Hi <tool_") == ["Hi"]  # the space waits: it may precede a call
    assert parser.feed('call>{"name": "f", ') == []
    assert parser.feed('"arguments": {"a"') == [CallStart(0, "f"), ArgumentsPiece(0, '{"a"')]
    assert parser.feed(': 1} <') == [ArgumentsPiece(0, ": 1}")]
    assert parser.feed("/tool_call> ok") == ["ok"]
    assert parser.finish() == []


def test_every_pair_of_cuts_on_a_mixed_output():
    text = 'Hm. <tool_call>\n{"name": "a", "arguments": {"x": "<t>"}}\n</tool_call>\n<tool_call>bad</tool_call> end <to'
    whole = parse_whole(HermesToolParser(), text)
    assert whole.content == "Hm.<tool_call>bad</tool_call> end <to" and [c.name for c in whole.calls] == ["a"]
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            parser = HermesToolParser()
            events = parser.feed(text[:i]) + parser.feed(text[i:j]) + parser.feed(text[j:]) + parser.finish()
            assert collect(events) == whole, (i, j)


def test_the_required_array_parser_streams_each_calls_parameters():
    text = '[{"name": "get_weather", "parameters": {"city": "a]}", "days": 1}}, {"name": "now", "parameters": {}}]'
    whole = parse_whole(_CallArray(), text)
    assert whole == Parsed("", [call("get_weather", '{"city": "a]}", "days": 1}'), call("now", "{}")])
    for cut in range(len(text) + 1):
        parser = _CallArray()
        assert collect(parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()) == whole
    assert parse_whole(_CallArray(), '[{"name": "no') == Parsed()  # cut before a call began
    assert parse_whole(_CallArray(), '[{"name": "now", "para') == Parsed("", [call("now", "")])  # named: begun
    assert parse_whole(_Arguments("f"), "") == Parsed("", [call("f", "")])


def test_choice_deltas_add_up_to_the_message_and_send_each_id_once():
    text = "Sure. " + WEATHER + "\n" + WEATHER.replace("Paris", "Oslo")
    for size in (1, 7, len(text)):
        calls = ChoiceCalls(HermesToolParser(), single=False)
        pieces = [text[k:k + size] for k in range(0, len(text), size)]
        deltas = [d for k, piece in enumerate(pieces) for d in calls.deltas(piece, final=k == len(pieces) - 1)]
        content, got = "", {}
        for d in deltas:
            content += d.get("content", "")
            for entry in d.get("tool_calls", []):
                if "id" in entry:  # a call's first entry: nothing else of the call in its delta
                    assert entry["function"]["arguments"] == "" and entry["index"] not in got
                    assert [e["index"] for e in d["tool_calls"]].count(entry["index"]) == 1
                    got[entry["index"]] = [entry["function"]["name"], ""]
                else:
                    got[entry["index"]][1] += entry["function"]["arguments"]
        message = ChoiceCalls(HermesToolParser(), single=False).message(text)
        assert content == message["content"] == "Sure."
        assert [got[i] for i in sorted(got)] == [[c["function"]["name"], c["function"]["arguments"]]
                                                 for c in message["tool_calls"]]
        assert json.loads(message["tool_calls"][1]["function"]["arguments"]) == {"city": "Oslo", "days": 2}
        assert calls.finish_reason("stop") == "tool_calls" and calls.finish_reason("length") == "length"
    single = ChoiceCalls(HermesToolParser(), single=True)
    assert [c["function"]["name"] for c in single.message(text)["tool_calls"]] == ["get_weather"]
    assert ChoiceCalls(HermesToolParser(), single=False).message("plain") == {"role": "assistant", "content": "plain"}
    empty = ChoiceCalls(_CallArray(), single=False)
    assert empty.deltas('[{"na', final=True) == [{}]  # (the stream opened with content null)
    assert empty.message('[{"na') == {"role": "assistant", "content": None}


def test_json_scanner_and_tag_prefixes():
    scanner = JsonScanner()
    assert scanner.advance('{"a": "}\\"') == (10, False)
    assert scanner.advance('x", "b": [1]} tail') == (13, True)
    assert JsonScanner().advance('{"a": <', stop="<") == (6, False)
    assert held_tag_prefix("text <tool", "<tool_call>") == 5
    assert held_tag_prefix("text <tool_call>", "<tool_call>") == 0 and held_tag_prefix("abc", "<t>") == 0
