"""`structured_outputs`: output constrained to a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar, through xgrammar.

A request's grammar is compiled on the request side, on a worker thread, by one compiler per
tokenizer (xgrammar caches compiled grammars by their text, so a schema many requests share is
compiled once); each sample gets its own matcher on the executor's side, which fills the mask of
tokens allowed next and advances over each token produced. The grammar's end admits only the
end-of-sequence tokens, so a complete output stops there.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch

from llmserve.hookspecs import hookimpl
from llmserve.sampling_params import SamplingParams


# xgrammar 0.2.8 writes a string with a length limit as `[^"\\\r\n]{lo,hi}`: raw control characters,
# which JSON forbids inside strings (a strict parser rejects the output), and no escapes. Its
# unbounded strings exclude them (`[^\0-\x1f"\\\r\n]`); bounded ones are given the same class.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def json_schema_grammar(schema: str | dict) -> str:
    """The EBNF grammar of a JSON schema's instances (compact: no whitespace between tokens)."""
    import xgrammar

    text = schema if isinstance(schema, str) else json.dumps(schema)
    return str(xgrammar.Grammar.from_json_schema(text, any_whitespace=False)).replace(_BOUNDED_STRING_CHAR,
                                                                                      _JSON_STRING_CHAR)


class GrammarConstraint:
    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)

    # Past the end (the end-of-sequence token accepted), the request is finished: a token planned
    # meanwhile (steps are planned ahead) is computed and discarded, so any token will do.
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            raise RuntimeError(f"structured_outputs: token {token} is not allowed by the grammar here")


class StructuredOutputs:
    def __init__(self) -> None:
        self._compilers: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()

    def wants(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None

    def _compiler(self, tokenizer: Any, vocab_size: int) -> Any:
        import xgrammar

        with self._lock:
            key = (id(tokenizer), vocab_size)
            if key not in self._compilers:
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
                self._compilers[key] = (xgrammar.GrammarCompiler(info), tokenizer)  # keeps id() valid
            return self._compilers[key][0]

    def prepare(self, params: SamplingParams, tokenizer: Any, vocab_size: int) -> Any:
        if tokenizer is None:
            raise ValueError("structured_outputs: this model has no tokenizer to build a grammar's token masks from")
        spec = params.structured_outputs
        compiler = self._compiler(tokenizer, vocab_size)
        kind = spec.kind
        try:
            if kind == "json":
                return compiler.compile_grammar(json_schema_grammar(spec.json))
            if kind == "json_object":
                return compiler.compile_builtin_json_grammar()
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except Exception as exc:  # xgrammar reports a bad schema, regex or grammar as a RuntimeError
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0])  # "[time] file.cc:line: "
            raise ValueError(f"structured_outputs.{kind}: {reason}") from None

    def start(self, prepared: Any) -> GrammarConstraint:
        return GrammarConstraint(prepared)


@hookimpl
def llmserve_register_decoding_strategies(register) -> None:
    register("structured_outputs", StructuredOutputs())
