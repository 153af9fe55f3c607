"""Engine flags for `llmserve serve`, generated from the config dataclasses so that they cannot drift.

Each field of each EngineConfig section becomes one flag, spelled as vLLM spells its engine
arguments: `max_model_len` in [model] is `--max-model-len N`. Types come from the annotations:

    bool                   --x / --no-x
    int, float, str        --x VALUE        (an `X | None` field takes a value of X; leaving the flag
                                             out keeps the file's value or the default)
    list[str]              --x a,b,c        (comma-separated, or a JSON list as vLLM takes it: '["a", "b"]';
                                             --x '' gives the empty list)
    str | list[str]        --x a [b ...]    (one value or several, each whole, as vLLM's
                                             --served-model-name and --api-key take them)
    dict[str, Any]         --x '{"k": 1}'   (a JSON object, as vLLM takes its dict flags)

A field name found in more than one section, or in a section of _PREFIXED, is spelled with its
section first: `--plugins-block`. The help of a flag is the docstring that follows the field in
config.py, then the TOML key and the default.

Parsed flags come back as overrides in `EngineConfig.from_dict`'s form ({section: {key: value}}),
only for the flags given, so that they override the file key by key.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import json
import sys
import types
import typing
from collections import Counter
from typing import Any

from llmserve.config import EngineConfig

_PREFIXED = {"plugins", "speculative"}
"""Sections whose keys alone would not say what they are about on a command line: `--block` would
read as a KV-cache option, `--method` as anything (`--speculative-method`, as vLLM spells its
`--speculative-config` keys)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    section: str
    name: str
    option: str
    """The flag as typed: "--max-model-len"."""
    kind: type
    """bool, int, float, str, list (of str) or dict (a JSON object)."""
    help: str
    several: bool = False
    """A list given as separate values (`str | list[str]`), not one comma-separated value."""


def sections() -> dict[str, type]:
    """EngineConfig's sections by name: {"model": ModelConfig, ...}."""
    return {f.name: typing.get_type_hints(EngineConfig)[f.name] for f in dataclasses.fields(EngineConfig)}


@functools.cache
def field_docs(klass: type) -> dict[str, str]:
    """{field name: its docstring, whitespace folded} for a dataclass whose fields are documented by a
    string literal right after them; {} when the source cannot be read (a frozen or zipped install)."""
    try:
        tree = ast.parse(inspect.getsource(sys.modules[klass.__module__]))
    except (OSError, TypeError):
        return {}
    docs = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == klass.__name__:
            for stmt, after in zip(node.body, node.body[1:]):
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                        and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                        and isinstance(after.value.value, str)):
                    docs[stmt.target.id] = " ".join(after.value.value.split())
    return docs


def _kind(annotation: Any) -> tuple[type, bool]:
    """The flag's value type from a field's annotation, `X | None` read as X; and whether it takes
    several values (`str | list[str]`, a list)."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if args == [str, list[str]]:
            return list, True
        if len(args) != 1:
            raise TypeError(f"no flag type for the annotation {annotation}")
        annotation = args[0]
    kind = typing.get_origin(annotation) or annotation
    if kind not in (bool, int, float, str, list, dict):
        raise TypeError(f"no flag type for the annotation {annotation}")
    return kind, False


def _default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


@functools.cache
def flags() -> tuple[Flag, ...]:
    """One Flag per EngineConfig field, in the sections' order."""
    return make_flags(sections())


def make_flags(secs: dict[str, type]) -> tuple[Flag, ...]:
    """One Flag per field of these section dataclasses ({section name: class})."""
    counts = Counter(f.name for section, klass in secs.items() if section not in _PREFIXED
                     for f in dataclasses.fields(klass))
    out = []
    for section, klass in secs.items():
        hints, docs = typing.get_type_hints(klass), field_docs(klass)
        for f in dataclasses.fields(klass):
            prefixed = section in _PREFIXED or counts[f.name] > 1
            option = "--" + (f"{section}_{f.name}" if prefixed else f.name).replace("_", "-")
            default = _default(f)
            shown = "unset" if default is None else (",".join(default) or "empty") if isinstance(default, list) \
                else str(default).lower() if isinstance(default, bool) else default
            text = f"{docs[f.name]} " if f.name in docs else ""  # tests require a docstring for each
            text += f"[{section}] {f.name}, default {shown}."
            kind, several = _kind(hints[f.name])
            out.append(Flag(section, f.name, option, kind, text, several))
    return tuple(out)


def _comma_list(text: str) -> list[str]:
    """"a,b" -> ["a", "b"]; a JSON list of strings as vLLM takes its list flags (`'["*"]'`) too
    (what does not parse as JSON is comma-separated: `[::1]`, a bracketed IPv6 address, is a host)."""
    try:
        value = json.loads(text) if text.lstrip().startswith("[") else None
    except json.JSONDecodeError:
        value = None
    if isinstance(value, list):
        if not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"must be a JSON list of strings, got {text!r}")
        return [v.strip() for v in value if v.strip()]
    return [item.strip() for item in text.split(",") if item.strip()]


def json_object(text: str) -> dict:
    """A flag's JSON object ('{"temperature": 0.6}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """Add every config flag, one argument group per section. Flags left out are absent from the
    namespace (argparse.SUPPRESS), which is how `overrides` tells them from defaults."""
    groups = {}
    for flag in flags():
        if flag.section not in groups:
            groups[flag.section] = parser.add_argument_group(f"[{flag.section}]")
        kw: dict[str, Any] = {"dest": f"{flag.section}.{flag.name}", "default": argparse.SUPPRESS,
                              "help": flag.help.replace("%", "%%")}
        if flag.kind is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif flag.several:
            kw.update(nargs="+", metavar=flag.name.upper())
        elif flag.kind is list:
            kw.update(type=_comma_list, metavar="A,B")
        elif flag.kind is dict:
            kw.update(type=json_object, metavar="JSON")
        else:
            kw.update(type=flag.kind, metavar=flag.name.upper())
        groups[flag.section].add_argument(flag.option, **kw)


def overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The config flags given on the command line, as {section: {key: value}}."""
    given = vars(args)
    out: dict[str, dict[str, Any]] = {}
    for flag in flags():
        dest = f"{flag.section}.{flag.name}"
        if dest in given:
            value = given[dest]
            out.setdefault(flag.section, {})[flag.name] = value[0] if flag.several and len(value) == 1 else value
    return out
