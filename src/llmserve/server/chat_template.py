"""Chat messages rendered into a prompt: through the tokenizer's chat template, or the one
server.chat_template gives, with the request's template variables over the server's defaults."""

from __future__ import annotations

import inspect
import os
from typing import Any

from transformers import PreTrainedTokenizerBase

from llmserve.config import ServerConfig
from llmserve.server.protocol import APIError, ChatCompletionRequest, TokenizeRequest
from llmserve.server.tool_calls import template_messages, template_tools

RENDER_ARGUMENTS = (frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}
                    | {"messages"})
"""apply_chat_template's own arguments, and `messages` (the conversation as the template sees it):
not template variables (chat_template_kwargs cannot set them)."""


def load_chat_template(value: str | None) -> str | None:
    """server.chat_template as template text: a file's content where it names an existing file,
    else the value itself if it is Jinja; a ValueError at start-up otherwise."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"server.chat_template: {value!r} is neither a file nor a Jinja template")


class ChatTemplate:
    def __init__(self, limits: ServerConfig) -> None:
        self.text = load_chat_template(limits.chat_template)
        """server.chat_template's text (None: the tokenizer's own)."""
        self.defaults = limits.default_chat_template_kwargs

    def render(self, tokenizer: Any, body: ChatCompletionRequest | TokenizeRequest,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of a chat request; `tools` are its tools already checked (else they are
        checked here)."""
        if body.continue_final_message and body.add_generation_prompt:
            raise APIError("continue_final_message needs add_generation_prompt false (the last message is "
                           "continued, no new one begins)", param="continue_final_message")
        variables = {**self.defaults, **(body.chat_template_kwargs or {})}
        if reserved := sorted(variables.keys() & RENDER_ARGUMENTS):
            raise APIError(f"chat_template_kwargs: {', '.join(reserved)} cannot be set there (arguments of the "
                           "rendering, not template variables)", param="chat_template_kwargs")
        if body.chat_template is not None:
            # a template is code the server runs (a loop in one holds the event loop): not taken
            # from a request, as vLLM does unless told to trust them
            raise APIError("chat_template cannot be set per request: the server's is server.chat_template "
                           "(--chat-template)", param="chat_template")
        if self.text is None and not getattr(tokenizer, "chat_template", None):
            raise APIError("this model's tokenizer has no chat template (a base checkpoint): start the server with "
                           "server.chat_template (--chat-template), or use /v1/completions", param="messages")
        messages = template_messages(body.messages)
        tools = tools if tools is not None else template_tools(body.tools)
        try:
            return tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.text,
                                                 add_generation_prompt=body.add_generation_prompt,
                                                 continue_final_message=body.continue_final_message,
                                                 tokenize=False, **variables)
        except Exception as exc:  # a template error is the request's fault (roles, order...)
            raise APIError(f"messages: the chat template rejected them: {exc}", param="messages") from None
