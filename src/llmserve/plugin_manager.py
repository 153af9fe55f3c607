"""Loading plugins, and the small typed facade the engine calls hooks through.

Built-in plugins (DEFAULT_PLUGINS) and third-party ones (the `llmserve` entry-point group) are
registered the same way and implement the same hooks (hookspecs.py). Which ones load:

    [plugins] block = ["name", ...]     never load these (built-ins included)
    [plugins] allow = ["name", ...]     load only these entry-point plugins (built-ins always load)
    LLMSERVE_PLUGINS_BLOCK=a,b          added to the block list
    LLMSERVE_PLUGINS_ALLOW=a,b          replaces the allow list

A plugin that fails to import, or implements a hook that does not exist (a misspelling), stops
start-up with an error naming it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable
from functools import cache
from importlib.metadata import entry_points
from typing import Any

import pluggy
import torch

from llmserve import hookspecs
from llmserve.attention import AttentionBackend
from llmserve.config import EngineConfig, PluginsConfig

ENTRY_POINT_GROUP = "llmserve"
DEFAULT_PLUGINS = {
    "cpu": "llmserve.plugins.cpu",
    "cuda": "llmserve.plugins.cuda",
    "int8": "llmserve.plugins.int8",
    "fp8": "llmserve.plugins.fp8",
    "structured_outputs": "llmserve.plugins.structured_outputs",
    "token_masks": "llmserve.plugins.token_masks",
    "hermes": "llmserve.plugins.hermes",
    "reasoning": "llmserve.plugins.reasoning",
    "ngram": "llmserve.plugins.ngram",
    "draft_model": "llmserve.plugins.draft_model",
}


class PluginError(RuntimeError):
    """A plugin could not be loaded or is invalid; the message names it."""


class PluginManager(pluggy.PluginManager):
    def __init__(self) -> None:
        super().__init__("llmserve")
        self.add_hookspecs(hookspecs)
        self.sources: dict[str, str] = {}  # plugin name -> "built-in" or "distribution version"
        self.skipped: dict[str, str] = {}  # plugin name -> why it was not loaded

    def add(self, plugin: Any, name: str, source: str) -> None:
        try:
            self.register(plugin, name=name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name!r} ({source}) is invalid: {exc}") from exc
        self.sources[name] = source


def _env_names(var: str) -> frozenset[str] | None:
    value = os.environ.get(var)
    return None if value is None else frozenset(n.strip() for n in value.split(",") if n.strip())


def get_plugin_manager(block: Iterable[str] = (), allow: Iterable[str] | None = None) -> PluginManager:
    """The plugin manager for this block/allow list (merged with the environment); one per distinct list."""
    blocked = frozenset(block) | (_env_names("LLMSERVE_PLUGINS_BLOCK") or frozenset())
    env_allow = _env_names("LLMSERVE_PLUGINS_ALLOW")
    allowed = env_allow if env_allow is not None else (None if allow is None else frozenset(allow))
    return _build(blocked, allowed)


@cache
def _build(blocked: frozenset[str], allowed: frozenset[str] | None) -> PluginManager:
    pm = PluginManager()
    for name, module in DEFAULT_PLUGINS.items():
        if name in blocked:
            pm.skipped[name] = "blocked"
        else:
            pm.add(importlib.import_module(module), name, "built-in")
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        source = f"{ep.dist.name} {ep.dist.version}" if ep.dist else ep.value
        if ep.name in blocked:
            pm.skipped[ep.name] = "blocked"
            continue
        if allowed is not None and ep.name not in allowed:
            pm.skipped[ep.name] = "not in the allow list"
            continue
        if ep.name in pm.sources:
            raise PluginError(f"plugin name {ep.name!r} of {source} is already taken by {pm.sources[ep.name]}")
        try:
            plugin = ep.load()
        except Exception as exc:
            raise PluginError(f"plugin {ep.name!r} ({source}, {ep.value}) failed to load: "
                              f"{type(exc).__name__}: {exc}") from exc
        pm.add(plugin, ep.name, source)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:
        name = pm.get_name(exc.plugin)
        raise PluginError(f"plugin {name!r} ({pm.sources.get(name)}) is invalid: {exc}") from exc
    return pm


class Plugins:
    """Typed facade over the hooks; the rest of the engine never touches `pm.hook` directly."""

    def __init__(self, pm: pluggy.PluginManager | None = None) -> None:
        self.pm = pm or get_plugin_manager()

    @classmethod
    def from_config(cls, config: PluginsConfig) -> Plugins:
        return cls(get_plugin_manager(config.block, config.allow))

    def select_backend(self, device: torch.device, config: EngineConfig) -> AttentionBackend:
        backend = self.pm.hook.llmserve_select_backend(device=device, config=config)
        if backend is None:
            names = sorted(name for name, _ in self.pm.list_name_plugin())
            raise RuntimeError(f"no backend plugin serves device {str(device)!r} (plugins loaded: {names})")
        return backend

    def _registry(self, hook: Any) -> dict[str, tuple[Any, str]]:
        found: dict[str, tuple[Any, str]] = {}
        for impl in hook.get_hookimpls():
            def register(name: str, obj: Any, _plugin: str = impl.plugin_name) -> None:
                if name in found:
                    raise RuntimeError(f"{name!r} registered by both {found[name][1]!r} and {_plugin!r}")
                found[name] = (obj, _plugin)
            impl.function(register=register)
        return found

    def quantization_methods(self) -> dict[str, Any]:
        """name -> factory(checkpoint_quantization_config) -> QuantizationMethod."""
        return {name: obj for name, (obj, _) in self._registry(self.pm.hook.llmserve_register_quantization_methods).items()}

    def decoding_strategies(self) -> dict[str, Any]:
        """name -> DecodingStrategy."""
        return {name: obj for name, (obj, _) in self._registry(self.pm.hook.llmserve_register_decoding_strategies).items()}

    def proposers(self) -> dict[str, Any]:
        """name -> factory(SpeculativeConfig) -> Proposer."""
        return {name: obj for name, (obj, _) in self._registry(self.pm.hook.llmserve_register_proposers).items()}

    def model_classes(self) -> dict[str, Any]:
        """architecture name -> model class (besides the built-in ones)."""
        return {name: obj for name, (obj, _) in self._registry(self.pm.hook.llmserve_register_models).items()}

    def tool_parsers(self) -> dict[str, Any]:
        """name -> factory(tools) -> ToolParser."""
        return {name: obj for name, (obj, _) in self._registry(self.pm.hook.llmserve_register_tool_parsers).items()}

    def reasoning_parsers(self) -> dict[str, Any]:
        """name -> ReasoningFormat; a PluginError naming the plugin that registered something else."""
        from llmserve.server.reasoning import ReasoningFormat

        found = self._registry(self.pm.hook.llmserve_register_reasoning_parsers)
        for name, (obj, plugin) in found.items():
            if not isinstance(obj, ReasoningFormat):
                raise PluginError(f"plugin {plugin!r} registered the reasoning parser {name!r} as a "
                                  f"{type(obj).__name__}, not a llmserve.server.reasoning.ReasoningFormat")
        return {name: obj for name, (obj, _) in found.items()}

    def describe(self) -> list[dict[str, Any]]:
        """One row per plugin, loaded or skipped: name, source, hooks, what it registers, status."""
        quant = self._registry(self.pm.hook.llmserve_register_quantization_methods)
        decoding = self._registry(self.pm.hook.llmserve_register_decoding_strategies)
        parsers = self._registry(self.pm.hook.llmserve_register_tool_parsers)
        reasoning = self._registry(self.pm.hook.llmserve_register_reasoning_parsers)
        proposers = self._registry(self.pm.hook.llmserve_register_proposers)
        models = self._registry(self.pm.hook.llmserve_register_models)
        sources = getattr(self.pm, "sources", {})
        rows = []
        for name, plugin in self.pm.list_name_plugin():
            hooks = sorted(h.name for h in self.pm.get_hookcallers(plugin) or [])
            rows.append({"name": name, "source": sources.get(name, "registered at run time"), "status": "loaded",
                         "hooks": hooks,
                         "quantization_methods": sorted(m for m, (_, p) in quant.items() if p == name),
                         "decoding_strategies": sorted(d for d, (_, p) in decoding.items() if p == name),
                         "tool_parsers": sorted(t for t, (_, p) in parsers.items() if p == name),
                         "reasoning_parsers": sorted(t for t, (_, p) in reasoning.items() if p == name),
                         "proposers": sorted(t for t, (_, p) in proposers.items() if p == name),
                         "models": sorted(t for t, (_, p) in models.items() if p == name)})
        for name, why in getattr(self.pm, "skipped", {}).items():
            rows.append({"name": name, "source": "", "status": why, "hooks": [], "quantization_methods": [],
                         "decoding_strategies": [], "tool_parsers": [], "reasoning_parsers": [], "proposers": [],
                         "models": []})
        return rows
