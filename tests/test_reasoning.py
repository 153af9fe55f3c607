"""Reasoning parsers: a choice's thinking told from its answer, whole or piece by piece."""

from __future__ import annotations

import itertools
from itertools import chain

import pytest

from llmserve.plugin_manager import Plugins
from llmserve.server.reasoning import ReasoningFormat, ReasoningSplit, split_reasoning

PARSERS = Plugins().reasoning_parsers()
BRACKETS = ReasoningFormat(starts_inside=False, open="[THINK]", close="[/THINK]")
"""A format of other tags: the same cases, in them."""

CASES = {  # text: (qwen3's (reasoning, content), deepseek_r1's)
    "<think>\nI reason\n</think>\n\nThe answer": (("I reason", "The answer"), ("I reason", "The answer")),
    "\n <think>\n\nR\n\n</think>\n\nC\n": (("R", "C\n"), ("R", "C\n")),
    "The answer\n": ((None, "The answer\n"), ("The answer\n", "")),
    "R\n</think>\nC": ((None, "R\n</think>\nC"), ("R", "C")),
    "<think></think>C": ((None, "C"), (None, "C")),
    "<think>cut short\n": (("cut short\n", ""), ("cut short\n", "")),
    "<think>R</thin": (("R</thin", ""), ("R</thin", "")),
    "<thi": ((None, "<thi"), ("<thi", "")),
    "": ((None, ""), (None, "")),
}


def in_tags(fmt: ReasoningFormat, text: str) -> str:
    """A case's text with <think> tags, and the tags' beginnings at its end, in fmt's tags."""
    text = text.replace("</think>", fmt.close).replace("<think>", fmt.open)
    for tag, other in (("</think>", fmt.close), ("<think>", fmt.open)):
        for n in range(len(tag) - 1, 0, -1):
            if text.endswith(tag[:n]):
                return text[:-n] + other[:n]
    return text


@pytest.mark.parametrize("text", CASES)
def test_a_choice_splits_alike_whole_and_in_any_pieces(text):
    """Every way of cutting the text into three pieces (tags cut anywhere) adds up to the split
    of the whole text."""
    for name, expected, fmt in chain(zip(("qwen3", "deepseek_r1"), CASES[text], map(PARSERS.get, ("qwen3", "deepseek_r1"))),
                                     [("brackets", CASES[text][0], BRACKETS)]):
        if fmt.open != "<think>":  # the same cases in the format's own tags
            text, expected = in_tags(fmt, text), tuple(None if e is None else in_tags(fmt, e) for e in expected)
        assert split_reasoning(fmt, text) == expected, name
        for a, b in itertools.combinations_with_replacement(range(len(text) + 1), 2):
            split, reasoning, content = ReasoningSplit(fmt), "", ""
            pieces = [text[:a], text[a:b], text[b:]]
            for i, piece in enumerate(pieces):
                r, c = split.feed(piece, final=i == len(pieces) - 1)
                reasoning, content = reasoning + r, content + c
            assert (reasoning or None, content) == expected, (name, pieces)


def test_the_prompt_says_where_a_choice_begins():
    """A prompt that left `<think>` open (a thinking-only template) starts the choice inside its
    reasoning; one that ends with a closed tag (thinking off) makes all of it content."""
    qwen3, r1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]
    assert qwen3.after("user: hi\nassistant: <think>\n") == r1
    assert split_reasoning(qwen3.after("assistant: <think>\n"), "R\n</think>\n\nC") == ("R", "C")
    assert qwen3.after("assistant: <think>\n\n</think>\n\n") is None
    assert r1.after("<think>a</think>b user: hi assistant:") == r1
    assert qwen3.after("<think>a</think>b user: hi assistant:") == qwen3
    assert BRACKETS.after("[INST]hi[/INST][THINK]") == BRACKETS.inside(True)
    assert BRACKETS.after("[INST]hi[/INST]<think>") == BRACKETS



def test_a_format_has_two_tags():
    with pytest.raises(ValueError, match="two different non-empty strings"):
        ReasoningFormat(starts_inside=False, open="", close="</x>")
