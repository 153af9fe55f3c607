"""The built-in reasoning parsers: the tags of the model families that write their thinking
before their answer (llmserve.server.reasoning splits a choice's text by them)."""

from __future__ import annotations

from llmserve.hookspecs import hookimpl
from llmserve.server.reasoning import ReasoningFormat


@hookimpl
def llmserve_register_reasoning_parsers(register) -> None:
    register("qwen3", ReasoningFormat(starts_inside=False))  # Qwen3, QwQ: "<think>...</think>" leads, or not at all
    register("deepseek_r1", ReasoningFormat(starts_inside=True))  # its template opens <think> in the prompt
