"""The plugin manager and the small typed facade the engine calls hooks through."""

from __future__ import annotations

from functools import cache
from typing import Any

import pluggy
import torch

from llmserve import hookspecs
from llmserve.attention import AttentionBackend
from llmserve.config import EngineConfig

ENTRY_POINT_GROUP = "llmserve"


@cache
def get_plugin_manager() -> pluggy.PluginManager:
    """Hook specs plus every plugin of the `llmserve` entry-point group (built-ins included)."""
    pm = pluggy.PluginManager("llmserve")
    pm.add_hookspecs(hookspecs)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    pm.check_pending()
    return pm


class Plugins:
    """Typed facade over the hooks; the rest of the engine never touches `pm.hook` directly."""

    def __init__(self, pm: pluggy.PluginManager | None = None) -> None:
        self.pm = pm or get_plugin_manager()

    def select_backend(self, device: torch.device, config: EngineConfig) -> AttentionBackend:
        backend = self.pm.hook.llmserve_select_backend(device=device, config=config)
        if backend is None:
            names = sorted(name for name, _ in self.pm.list_name_plugin())
            raise RuntimeError(f"no backend plugin serves device {str(device)!r} (plugins loaded: {names})")
        return backend

    def _registry(self, hook: Any) -> dict[str, Any]:
        found: dict[str, tuple[Any, str]] = {}
        for impl in hook.get_hookimpls():
            def register(name: str, obj: Any, _plugin: str = impl.plugin_name) -> None:
                if name in found:
                    raise RuntimeError(f"{name!r} registered by both {found[name][1]!r} and {_plugin!r}")
                found[name] = (obj, _plugin)
            impl.function(register=register)
        return {name: obj for name, (obj, _) in found.items()}

    def quantization_methods(self) -> dict[str, Any]:
        return self._registry(self.pm.hook.llmserve_register_quantization_methods)

    def decoding_strategies(self) -> dict[str, Any]:
        return self._registry(self.pm.hook.llmserve_register_decoding_strategies)
