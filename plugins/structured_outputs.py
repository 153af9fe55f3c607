"""`structured_outputs`: output constrained to a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar, through xgrammar.

A request's grammar is compiled on the request side, on a worker thread, by one compiler per
tokenizer (xgrammar caches compiled grammars by their text, up to COMPILER_CACHE_BYTES, so a
schema many requests share is compiled once); each sample gets its own matcher on the executor's
side, which fills the mask of tokens allowed next and advances over each token produced. The
grammar's end admits only the end-of-sequence tokens, so a complete output stops there.

Where the executor runs in another process (the server's engine process), a compiled grammar
crosses as two files the request side writes once each into a private temporary folder: the
tokenizer's vocabulary (5 MB for 150k tokens) and the grammar; the request carries their paths,
and the executor's side reads each once. The grammar goes compiled (xgrammar's serialization, its
token masks: ~2 MB for JSON, read back in ~15 ms on a 152k vocabulary, where compiling takes 30-60
ms) while that is small (SERIALIZED_UP_TO, estimated); past it, as its source (EBNF or regex),
compiled again on the executor's side: xgrammar writes each rule's automaton over the whole
grammar's, so the serialization grows with the square of a wide grammar (32 tools' calls: 16 MB
written in 0.6 s and read in 0.23 s, compiled in 0.07 s; 128 tools': ~200 MB, 13 s to write).

Where the engine drives a GPU, matchers of requests that do not jump live in the grammar process
(grammar_process.py: a step's accepts and mask fills there, off the executor process's interpreter
lock), with a mirror here for what the process does not serve.

Jump-forward (`GrammarConstraint.jump`; by default for every kind but `json_object`, whose grammar
forces next to nothing: StructuredOutputsParams.jump_forward): after a sampled token t, where the
grammar admits exactly one continuation s (xgrammar's jump-forward string: a key, `": "`, `", "`),
t is replaced by the tokenizer's own encoding of text(t) + s, so a merge such as `"` + `,` -> `",`
stays canonical (where a step launched meanwhile computed t, that is taken back:
llmserve/decoding.py). The encoding's last token is dropped, as the model may extend it (`"na` +
`me` -> `"name`), and nothing is jumped unless the kept tokens decode to text(t) and more, and
re-encode to themselves. The executor's side needs the tokenizer itself for this: the request
side's own in one process; in another, loaded from its directory when the first jumping request
starts. Tokenizers that encode a leading space into a text's first token (SentencePiece's legacy
mode) never jump: a stretch encoded alone is not what the same text gets mid-sequence.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import weakref
from collections import Counter, OrderedDict, deque
from typing import Any

import structlog
import torch

from llmserve.hookspecs import hookimpl
from llmserve.sampling_params import SamplingParams

log = structlog.get_logger("llmserve.structured_outputs")


# xgrammar 0.2.8 writes a string with a length limit as `[^"\\\r\n]{lo,hi}`: raw control characters,
# which JSON forbids inside strings (a strict parser rejects the output), and no escapes. Its
# unbounded strings exclude them (`[^\0-\x1f"\\\r\n]`); bounded ones are given the same class.
_BOUNDED_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'
# Its negated classes also take UTF-16 surrogates (U+D800-DFFF) as characters, whose three-byte
# encodings (ED A0 80 ...) are no UTF-8: they decode to U+FFFD each, three characters where the
# grammar counted one (a maxLength broken). JSON grammars get them excluded from every such class.
_NOT_SURROGATE = r'[^\uD800-\uDFFF'


def _no_surrogates(ebnf: str) -> str:
    """`ebnf` with surrogates excluded from its negated character classes (a Regex(...) rule's text,
    a pattern of the schema's, is left as written)."""
    return "\n".join(line if "Regex(" in line else line.replace("[^", _NOT_SURROGATE)
                     for line in ebnf.split("\n"))


def mid_anchor(regex: str) -> int | None:
    """The position of a `^` or `$` anchor inside the regex (not at its start or end), which xgrammar
    0.2.8 ignores with only a warning; None if there is none. Escapes and character classes are
    skipped (`[^a]`, `\\$` are no anchors)."""
    i, last = 0, len(regex) - 1
    while i <= last:
        ch = regex[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            i += 2 if regex[i + 1:i + 2] == "^" else 1
            i += 1 if regex[i:i + 1] == "]" else 0  # a ] first in a class is a literal
            while i <= last and regex[i] != "]":
                i += 2 if regex[i] == "\\" else 1
        elif (ch == "^" and i != 0) or (ch == "$" and i != last):
            return i
        i += 1
    return None


def ignored_keywords(schema: Any, path: str = "$") -> list[str]:
    """The places where xgrammar 0.2.8 would ignore a keyword of the schema, with a warning on stderr
    or without one (an output could then break it): `multipleOf`; `minLength`/`maxLength` beside a
    `pattern` or a `format`; an anchor inside a `pattern`; `not`, `if`, `contains`,
    `dependentRequired`, `dependentSchemas`, `dependencies`; an `allOf` of several schemas (the whole
    schema then admits any JSON); a `$ref` to another document. (`uniqueItems`, also ignored, is let
    through: pydantic writes it for sets, which take duplicates and drop them.)"""
    found = []
    if isinstance(schema, dict):
        for key in ("multipleOf", "not", "if", "contains", "dependentRequired", "dependentSchemas", "dependencies"):
            if key in schema:
                found.append(f"{key} (at {path})")
        if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
            found.append(f"allOf of several schemas (at {path})")
        if isinstance(schema.get("$ref"), str) and not schema["$ref"].startswith("#"):
            found.append(f"$ref to another document, {schema['$ref']} (at {path})")
        lengths = [k for k in ("minLength", "maxLength") if k in schema]
        for other in ("pattern", "format"):
            if lengths and other in schema:
                found.append(f"{'/'.join(lengths)} together with {other} (at {path})")
        if isinstance(schema.get("pattern"), str) and (at := mid_anchor(schema["pattern"])) is not None:
            found.append(f"an anchor inside the pattern, at character {at} (at {path})")
        for key, value in schema.items():
            if key in ("properties", "$defs", "definitions", "patternProperties"):
                if isinstance(value, dict):
                    for name, sub in value.items():
                        found += ignored_keywords(sub, f"{path}.{key}.{name}")
            elif key in ("items", "additionalProperties", "not", "contains", "propertyNames"):
                found += ignored_keywords(value, f"{path}.{key}")
            elif key in ("anyOf", "oneOf", "allOf", "prefixItems") and isinstance(value, list):
                for i, sub in enumerate(value):
                    found += ignored_keywords(sub, f"{path}.{key}[{i}]")
    return found


def json_schema_grammar(schema: str | dict) -> str:
    """The EBNF grammar of a JSON schema's instances (compact: no whitespace between tokens); a
    ValueError names a keyword it would not enforce."""
    import xgrammar

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
    if ignored := ignored_keywords(schema):
        raise ValueError(f"not supported: {'; '.join(ignored)}")
    text = json.dumps(schema)
    grammar = str(xgrammar.Grammar.from_json_schema(text, any_whitespace=False))
    return _no_surrogates(grammar.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))


@functools.cache
def json_object_grammar() -> str:
    """Any JSON object (`json_object`: OpenAI's JSON mode answers with an object, which clients
    parse into a dict): xgrammar's JSON grammar with its root cut to the object branch (it also
    admits a top-level array), surrogates excluded."""
    import xgrammar

    rules = str(xgrammar.Grammar.builtin_json_grammar()).split("\n")
    root = next(i for i, rule in enumerate(rules) if rule.startswith("root ::= "))
    obj = re.match(r'root ::= \((\("\{"[^|]*\))', rules[root])
    if obj is None:  # a new xgrammar wrote its root differently: refuse rather than admit arrays
        raise RuntimeError(f"structured_outputs: unexpected JSON grammar root {rules[root]!r}")
    rules[root] = f"root ::= {obj.group(1)}"
    return _no_surrogates("\n".join(rules))


class PreparedGrammar:
    """A compiled grammar, and `paths`, its files for another process (_Files.write). `key` names
    its source and tokenizer."""

    checks_drafts = True  # its constraints advance over drafts and roll back (speculative decoding)

    def __init__(self, compiled: Any, key: str, paths: tuple[str, str], files: _Files, tokenizer: Any,
                 jump_forward: bool) -> None:
        self.compiled = compiled
        self.key = key
        self.paths = paths
        weakref.finalize(self, files.release, key)  # (write() held it: its request may start a constraint from it)
        self.tokenizer = tokenizer if jump_forward else None  # this process's: for jump-forward
        self.tokenizer_dir = getattr(tokenizer, "name_or_path", None) if jump_forward else None
        self.jump_forward = jump_forward and bool(self.tokenizer_dir)

    def __getstate__(self) -> dict:
        return {"paths": self.paths, "tokenizer_dir": self.tokenizer_dir, "jump_forward": self.jump_forward}

    def __setstate__(self, state: dict) -> None:
        self.compiled, self.tokenizer, self.key = None, None, None
        self.paths, self.tokenizer_dir, self.jump_forward = state["paths"], state["tokenizer_dir"], state["jump_forward"]


class _Files:
    """The request side's folder of serialized tokenizers and grammars, one file each, removed when
    the process exits. Of the grammars no live request holds (PreparedGrammar: its request may
    still start a constraint from the file, as it first runs or resumes), the `max_grammars`
    sent most recently are kept, at most `max_bytes` of them: a client sending ever new schemas
    must not fill the disk. A file is named by its content, so sources that compile alike share
    one; it goes with the last of them."""

    def __init__(self, max_grammars: int = 512, max_bytes: int = 1 << 30) -> None:
        self._dir: str | None = None
        self._written: OrderedDict[str, tuple[str, str]] = OrderedDict()  # key -> (tokenizer file, grammar file)
        self._sharing: Counter[str] = Counter()  # grammar file -> the keys in _written written to it
        self._sizes: dict[str, int] = {}  # grammar file -> its bytes
        self.bytes = 0  # of the grammar files
        self.max_bytes = max_bytes
        self._tokenizers: dict[str, str] = {}  # the compiler's key (tokenizer, vocabulary size, end ids) -> its file
        self.max_grammars = max_grammars
        self._lock = threading.Lock()
        self._held: Counter[str] = Counter()  # key -> its live PreparedGrammars
        self._released: deque[str] = deque()  # keys let go of, by finalizers (on any thread: no lock)

    def release(self, key: str) -> None:
        self._released.append(key)  # counted at the next hold or write

    def _count_released(self) -> None:
        while self._released:
            key = self._released.popleft()
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]

    def _file(self, data: bytes, suffix: str = ".json") -> str:
        path = os.path.join(self._dir, hashlib.sha256(data).hexdigest()[:32] + suffix)
        if not os.path.exists(path):
            with open(path + ".tmp", "wb") as f:  # (bytes: text mode would turn a regex's \r into \n)
                f.write(data)
            os.replace(path + ".tmp", path)
        return path

    def write(self, key: str, compiled: Any, source: tuple[str, str], tokenizer_key: str) -> tuple[str, str]:
        """The files of `compiled` (compiled from `source`, ("ebnf" or "regex", text)) and of its
        tokenizer, named by `tokenizer_key` (a new TokenizerInfo wrapper comes with each access);
        `key` is held until release(key)."""
        with self._lock:
            self._count_released()
            if key in self._written:
                self._written.move_to_end(key)
            else:
                if self._dir is None:
                    self._dir = tempfile.mkdtemp(prefix="llmserve-grammars-")
                    atexit.register(shutil.rmtree, self._dir, True)
                if tokenizer_key not in self._tokenizers:
                    self._tokenizers[tokenizer_key] = self._file(compiled.tokenizer_info.serialize_json().encode())
                if _serialized_bytes(compiled) <= SERIALIZED_UP_TO:
                    data, suffix = compiled.serialize_json().encode(), ".json"
                else:
                    kind, text = source
                    data, suffix = text.encode(), "." + kind
                self._written[key] = paths = (self._tokenizers[tokenizer_key], self._file(data, suffix))
                if not self._sharing[paths[1]]:
                    self._sizes[paths[1]] = len(data)
                    self.bytes += len(data)
                self._sharing[paths[1]] += 1
            # the oldest no request holds go, while there are too many or too large
            unheld = [k for k in self._written if k not in self._held and k != key]
            for old in unheld:
                if len(self._written) <= self.max_grammars and self.bytes <= self.max_bytes:
                    break
                path = self._written.pop(old)[1]
                self._sharing[path] -= 1
                if not self._sharing[path]:
                    del self._sharing[path]
                    self.bytes -= self._sizes.pop(path)
                    with contextlib.suppress(FileNotFoundError):  # (removed under us: gone either way)
                        os.remove(path)
            self._held[key] += 1
            return self._written[key]


class _Loaded:
    """The executor's side in another process: tokenizers and compiled grammars read from files
    (a grammar's source, `.ebnf` or `.regex`, compiled here). Thread-safe: a grammar-process
    constraint's mirror is made where it is first needed, the mask thread among them."""

    def __init__(self, max_grammars: int = 64, max_bytes: int | None = None) -> None:
        self.tokenizers: dict[str, Any] = {}
        self.compilers: dict[str, Any] = {}  # tokenizer file -> its compiler, made with its first source
        self.grammars: OrderedDict[tuple[str, str], Any] = OrderedDict()  # paths -> compiled
        self.bytes = 0  # of the grammars' token masks in memory
        self.max_grammars, self.max_bytes = max_grammars, COMPILER_CACHE_BYTES if max_bytes is None else max_bytes
        self._lock = threading.Lock()

    def get(self, paths: tuple[str, str]) -> Any:
        with self._lock:
            return self._get(paths)

    def _get(self, paths: tuple[str, str]) -> Any:
        import xgrammar

        tokenizer_path, grammar_path = paths  # (keyed by both: a source file may serve several tokenizers)
        if paths in self.grammars:
            self.grammars.move_to_end(paths)
            return self.grammars[paths]
        if tokenizer_path not in self.tokenizers:
            with open(tokenizer_path, "rb") as f:
                self.tokenizers[tokenizer_path] = xgrammar.TokenizerInfo.deserialize_json(f.read().decode())
        info = self.tokenizers[tokenizer_path]
        with open(grammar_path, "rb") as f:
            text = f.read().decode()
        if grammar_path.endswith(".json"):
            compiled = xgrammar.CompiledGrammar.deserialize_json(text, info)
        else:
            if tokenizer_path not in self.compilers:  # (no cache: compiled grammars are kept here)
                self.compilers[tokenizer_path] = xgrammar.GrammarCompiler(info, cache_enabled=False)
            compiler = self.compilers[tokenizer_path]
            compiled = (compiler.compile_regex(text) if grammar_path.endswith(".regex")
                        else compiler.compile_grammar(text))
        self.grammars[paths] = compiled
        self.bytes += compiled.memory_size_bytes
        while len(self.grammars) > 1 and (len(self.grammars) > self.max_grammars or self.bytes > self.max_bytes):
            self.bytes -= self.grammars.popitem(last=False)[1].memory_size_bytes
        return compiled


@functools.cache
def _keep_the_interpreter_for_token_calls(handle_type: type) -> None:
    """xgrammar's calls (through tvm-ffi) release the interpreter lock by default. A matcher's
    per-token calls take a microsecond; releasing the lock there hands it to any busy thread (the
    event loop publishing outputs) and the executor waits to get it back, at every row of every
    step (a step's accepts and jump checks for 256 rows: ~100 times longer beside a busy thread).
    Only the batch fill, long and off the step's path (the mask thread), still releases it.
    `handle_type`: the type of a matcher's tvm-ffi handle (without one, nothing changes)."""
    for method in getattr(getattr(handle_type, "__tvm_ffi_type_info__", None), "methods", ()):
        if method.name in _TOKEN_CALLS and hasattr(method.func, "release_gil"):
            method.func.release_gil = False


_TOKEN_CALLS = frozenset({"accept_token", "accept_string", "find_jump_forward_string", "rollback", "is_terminated",
                          "is_completed", "fill_next_token_bitmask"})


def _batch_accept() -> Any:
    """xgrammar's batch accept as f(constraints, tokens), its results unread: the tvm-ffi call
    itself, where this xgrammar has it (its Python wrapper reads each row's result back, ~1 µs a
    row through tvm-ffi: as long as the row's accept), keeping the interpreter lock (256 rows take
    ~0.25 ms: releasing the lock there, the executor waits for a busy event loop to give it back,
    up to the 5 ms switch interval); else the wrapper."""
    import xgrammar

    core = getattr(getattr(xgrammar, "base", None), "_core", None)
    native = getattr(getattr(core, "BatchGrammarMatcher", None), "batch_accept_token", None)
    if native is not None:
        if hasattr(native, "release_gil"):
            native.release_gil = False
        return lambda constraints, tokens: native([c.handle for c in constraints], tokens, False)
    return lambda constraints, tokens: xgrammar.BatchGrammarMatcher.batch_accept_token(
        [c.matcher for c in constraints], tokens)


class GrammarConstraint:
    def __init__(self, compiled: Any) -> None:
        import xgrammar

        self.matcher = xgrammar.GrammarMatcher(compiled)
        self.handle = getattr(self.matcher, "_handle", self.matcher)  # its tvm-ffi object: calls skip the wrapper
        _keep_the_interpreter_for_token_calls(type(self.handle))
        self.terminated = self.handle.is_terminated

    # Past the end (the end-of-sequence token accepted), the request is finished: a token planned
    # meanwhile (steps are planned ahead) is computed and discarded, so any token will do.
    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.terminated():
            bitmask[row] = -1
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        if not self.matcher.accept_token(token) and not self.matcher.is_terminated():
            raise RuntimeError(f"structured_outputs: token {token} is not allowed by the grammar here")

    def advance(self, token: int) -> bool:
        """Past a draft, tentatively (False: the grammar rejects it here, and nothing moved)."""
        return self.matcher.accept_token(token)

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)


class JumpingGrammarConstraint(GrammarConstraint):
    """A grammar constraint that jumps forward (the tokenizer encodes what it forces)."""

    def __init__(self, compiled: Any, tokenizer: Any) -> None:
        super().__init__(compiled)
        self.tokenizer = tokenizer
        self._forced = self.handle.find_jump_forward_string

    def jump(self, token: int, limit: int) -> list[int] | None:
        """After `token` was accepted (not an end of sequence): at most `limit` tokens that replace
        it, its text and the text the grammar forces next, encoded by the tokenizer (the module's
        docstring says which); the matcher is left after them. None: nothing to jump."""
        forced = self._forced()  # first: it is "" almost always
        if not forced or limit < 2:
            return None
        tokenizer = self.tokenizer
        decode = lambda ids: tokenizer.decode(ids, clean_up_tokenization_spaces=False)  # noqa: E731
        last = decode([token])
        if "\ufffd" in last:  # part of a character: its bytes are not its text
            return None
        ids = tokenizer.encode(last + forced, add_special_tokens=False)[:-1][:limit]
        text = decode(ids)
        if (len(text) <= len(last) or not (last + forced).startswith(text)
                or tokenizer.encode(text, add_special_tokens=False) != ids):
            return None
        self.matcher.rollback(1)
        for i, t in enumerate(ids):
            if not self.matcher.accept_token(t):  # xgrammar's string and its tokens disagree: undo
                self.matcher.rollback(i)
                self.matcher.accept_token(token)
                return None
        return ids


SERIALIZED_UP_TO = 4 << 20
"""A grammar whose serialization would write at most this (estimated: _serialized_bytes) crosses
to another process compiled; a larger one as its source (the module's docstring says why)."""

MAX_GRAMMAR_BYTES = 64 << 20
"""The largest compiled grammar served (its token masks in memory; past it the request is a 400):
each process that runs it holds a copy, and compiling it takes time on the engine's side too
(linear: an anyOf of 1,000 small objects is 25 MB, compiled in 0.4 s on a 152k vocabulary; 128
tools' calls 13 MB)."""

COMPILER_CACHE_BYTES = 512 << 20
"""The most the grammar compiler's cache of compiled grammars holds (per tokenizer), and the
executor's side's of grammars read from files; past it the least recently used go (compiled or
read again if sent again): unbounded, a client sending ever new schemas would grow the server's
memory without end."""


def _process_wanted() -> bool:
    """Whether matchers that do not jump live in the grammar process (grammar_process.py): where
    the engine drives a GPU, whose steps wait for the host (LLMSERVE_GRAMMAR_PROCESS=1 or 0 says
    so outright)."""
    setting = os.environ.get("LLMSERVE_GRAMMAR_PROCESS", "")
    return setting == "1" if setting in ("0", "1") else torch.cuda.is_available()


class StructuredOutputs:
    def __init__(self) -> None:
        self._process: Any = None  # grammar_process.GrammarProcess, on first use (executor side)
        self._compilers: dict[tuple[int, int], Any] = {}
        self._lock = threading.Lock()
        self._files = _Files()
        self._loaded = _Loaded()
        self._batch: Any = None  # xgrammar.BatchGrammarMatcher, made on first use (executor side)
        self._accept: Any = None  # _batch_accept(), on first use (executor side)
        self._tokenizers: dict[str, Any] = {}  # directory -> tokenizer, for jump-forward (executor side)
        self._prefix_space: dict[int, bool] = {}  # id(tokenizer) -> _prefix_space(it); compilers keep them alive

    def wants(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None

    def _compiler(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...]) -> Any:
        import xgrammar

        with self._lock:
            key = (id(tokenizer), vocab_size, eos_token_ids)
            if key not in self._compilers:
                # every id that ends a request is a stop token: allowed at the grammar's end, and
                # nowhere before it (the model's own end ids may be ordinary pieces to the tokenizer)
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                               stop_token_ids=list(eos_token_ids) or None)
                compiler = xgrammar.GrammarCompiler(info, cache_limit_bytes=COMPILER_CACHE_BYTES)
                self._compilers[key] = (compiler, tokenizer)  # keeps id() valid
            return self._compilers[key][0]

    def prepare(self, params: SamplingParams, tokenizer: Any, vocab_size: int,
                eos_token_ids: tuple[int, ...]) -> PreparedGrammar:
        compiled, source = self._compile(params, tokenizer, vocab_size, eos_token_ids)
        tokenizer_key = f"{id(tokenizer)}:{vocab_size}:{eos_token_ids}"  # (the compiler keeps the tokenizer alive)
        key = hashlib.sha256(f"{tokenizer_key}:{source}".encode()).hexdigest()
        kind = params.structured_outputs.kind
        if compiled.memory_size_bytes > MAX_GRAMMAR_BYTES:
            raise ValueError(f"structured_outputs.{kind}: the grammar is too large to serve: its token masks take "
                             f"{compiled.memory_size_bytes / 2**20:.1f} MB, over the limit of {MAX_GRAMMAR_BYTES / 2**20:.1f} MB "
                             "(anyOf branches, enum values or tools: ~2,500 small objects)")
        if id(tokenizer) not in self._prefix_space:
            self._prefix_space[id(tokenizer)] = _prefix_space(tokenizer)
        jump = (params.structured_outputs.jumps and params.logprobs is None
                and not self._prefix_space[id(tokenizer)])
        _check_first_tokens(compiled, params, vocab_size)
        # Its files, written here (a worker thread; xgrammar lets go of the interpreter lock while it
        # writes) for an executor in another process or the grammar process, not on the event
        # loop as the request is pickled.
        paths = self._files.write(key, compiled, source, tokenizer_key)
        return PreparedGrammar(compiled, key, paths, self._files, tokenizer, jump)

    def _compile(self, params: SamplingParams, tokenizer: Any, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> tuple[Any, tuple[str, str]]:
        """(the compiled grammar, its source: ("ebnf" or "regex", the text it was compiled from))."""
        if tokenizer is None:
            raise ValueError("structured_outputs: this model has no tokenizer to build a grammar's token masks from")
        spec = params.structured_outputs
        compiler = self._compiler(tokenizer, vocab_size, eos_token_ids)
        kind = spec.kind
        try:
            if kind == "regex":
                if (at := mid_anchor(spec.regex)) is not None:
                    raise ValueError(f"not supported: an anchor ({spec.regex[at]}) inside the regex, at character {at}")
                return compiler.compile_regex(spec.regex), ("regex", spec.regex)
            ebnf = {"json_object": json_object_grammar,
                    "json": lambda: json_schema_grammar(spec.json),
                    "choice": lambda: "root ::= " + " | ".join(json.dumps(c) for c in spec.choice),
                    "grammar": lambda: spec.grammar}[kind]()
            return compiler.compile_grammar(ebnf), ("ebnf", ebnf)
        except Exception as exc:  # xgrammar reports a bad schema, regex or grammar as a RuntimeError
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            reason = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0])  # "[time] file.cc:line: "
            raise ValueError(f"structured_outputs.{kind}: {reason}") from None

    def fill_masks(self, constraints: list[GrammarConstraint], bitmask: torch.Tensor, rows: list[int]) -> None:
        """Every live matcher's row at once, on xgrammar's threads (a few dozen microseconds a row
        otherwise: at batch 256, longer than the forward pass it hides behind). Mirrors of grammar
        process constraints one token behind are first advanced in one call."""
        if self._process is not None:
            behind = [(c, m) for c in constraints if not isinstance(c, GrammarConstraint) and (m := c.one_behind())]
            if behind:
                if self._accept is None:
                    self._accept = _batch_accept()
                self._accept([m for _, m in behind], [c.tokens[-1] for c, _ in behind])
                for c, _ in behind:
                    c.caught_up()
        live = []
        for c, row in zip(constraints, rows):
            if c.terminated():
                bitmask[row] = -1
            else:
                live.append((c.matcher, row))
        if len(live) == 1:
            live[0][0].fill_next_token_bitmask(bitmask, live[0][1])
        elif live:
            if self._batch is None:
                import xgrammar

                self._batch = xgrammar.BatchGrammarMatcher()
            matchers, indices = zip(*live)
            self._batch.batch_fill_next_token_bitmask(list(matchers), bitmask, list(indices))

    def fill_masks_async(self, constraints: list[Any], rows: list[int], width: int) -> Any:
        """The masks of constraints that all can live in the grammar process, filled there into
        rows 0.. of a buffer of its own (grammar_process.PendingMasks); None where they are not (a
        jumping constraint among them, rows not 0.., the process not ready or dead): the caller
        fills them from the constraints here."""
        from llmserve.plugins.grammar_process import SharedGrammarConstraint

        if (self._process is None or rows != list(range(len(rows)))
                or not all(type(c) is SharedGrammarConstraint for c in constraints) or not self._process.serves()):
            return None
        for c in constraints:
            if c.id is None:
                c.open()
        return self._process.fill_async([c.id for c in constraints], width)

    def accept_tokens(self, constraints: list[Any], tokens: list[int]) -> None:
        """Each matcher past its token in one xgrammar call (not a Python call a row); those in the
        grammar process in one message (the others of the grammar process's kind keep the token
        for their mirror). The engine checked each token against the mask it was drawn under, so
        a matcher refuses one only past its end (a request already finished: nothing to advance);
        the call's results are not read."""
        if self._process is not None:
            here, ids, sent = [], [], []
            for c, token in zip(constraints, tokens):
                if isinstance(c, GrammarConstraint):
                    here.append((c, token))
                    continue
                c.tokens.append(token)
                if c.id is not None:
                    ids.append(c.id)
                    sent.append(token)
            if ids:
                self._process.accept(ids, sent)
                self._process.flush()  # accepted there while this step's batch is built here
            if not here:
                return
            constraints, tokens = [c for c, _ in here], [t for _, t in here]
        if self._accept is None:
            self._accept = _batch_accept()
        self._accept(constraints, tokens)

    def start(self, prepared: PreparedGrammar) -> Any:
        def load() -> Any:
            return prepared.compiled if prepared.compiled is not None else self._loaded.get(prepared.paths)

        if not prepared.jump_forward and _process_wanted():
            from llmserve.plugins.grammar_process import GrammarProcess, SharedGrammarConstraint

            if self._process is None:
                self._process = GrammarProcess()
            if not self._process.dead:  # its mirror here is read or compiled only when needed
                return SharedGrammarConstraint(self._process, prepared.paths, lambda: GrammarConstraint(load()))
        compiled = load()
        tokenizer = self._tokenizer(prepared) if prepared.jump_forward else None
        return GrammarConstraint(compiled) if tokenizer is None else JumpingGrammarConstraint(compiled, tokenizer)

    def close(self) -> None:
        """Stop the grammar process (the engine's last step is done)."""
        if self._process is not None:
            self._process.close()
            self._process = None

    def _tokenizer(self, prepared: PreparedGrammar) -> Any:
        """The tokenizer jumps are encoded with: the request side's, or in another process one
        loaded from its directory, once; the first jumping request waits for it (its outputs must
        not depend on how fast a tokenizer loads). None if it cannot be loaded: no jumps."""
        if prepared.tokenizer is not None:
            return prepared.tokenizer
        if prepared.tokenizer_dir not in self._tokenizers:
            from llmserve.engine import load_tokenizer
            try:
                self._tokenizers[prepared.tokenizer_dir] = load_tokenizer(prepared.tokenizer_dir)
            except Exception:
                log.exception("jump-forward: the tokenizer did not load; nothing jumps", path=prepared.tokenizer_dir)
                self._tokenizers[prepared.tokenizer_dir] = None
        return self._tokenizers[prepared.tokenizer_dir]


def _check_first_tokens(compiled: Any, params: SamplingParams, vocab_size: int) -> None:
    """A ValueError where no output can begin: the grammar admits none (`root ::= root`), or none of
    allowed_token_ids can begin one (each step's masks are ANDed: its first would allow nothing)."""
    import xgrammar

    from llmserve.decoding import mask_width

    kind = params.structured_outputs.kind
    mask = torch.empty(1, mask_width(vocab_size), dtype=torch.int32)
    xgrammar.GrammarMatcher(compiled).fill_next_token_bitmask(mask, 0)
    if not mask.any():
        raise ValueError(f"structured_outputs.{kind}: the grammar admits no output (no token can begin one)")
    allowed = params.allowed_token_ids
    if allowed:
        ids = torch.tensor([t for t in allowed if t < vocab_size], dtype=torch.int64)
        if not ((mask[0, ids >> 5] >> (ids & 31)) & 1).any():
            raise ValueError(f"allowed_token_ids: none of them can begin an output that structured_outputs.{kind} "
                             "allows")


def _serialized_bytes(compiled: Any) -> int:
    """About what `compiled.serialize_json()` writes, without writing it (a few percent of its time):
    xgrammar 0.2 writes each rule's automaton over the whole grammar's (~2 bytes a character of
    the grammar's text), and its token mask cache (~2 bytes a byte in memory). Within 0.7-2.6
    times what is written on the grammars measured (JSON, schemas, tools, wide anyOfs and enums)."""
    text = str(compiled.grammar)
    return 2 * text.count("::=") * len(text) + 2 * compiled.memory_size_bytes


def _prefix_space(tokenizer: Any) -> bool:
    """Whether the tokenizer puts a space marker into a text's first token (SentencePiece's legacy
    mode): then a text encoded alone is not encoded as it is mid-sequence."""
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode('"a', add_special_tokens=False))
    return bool(pieces) and str(pieces[0]).startswith("\u2581")


@hookimpl
def llmserve_register_decoding_strategies(register) -> None:
    register("structured_outputs", StructuredOutputs())
