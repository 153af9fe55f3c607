"""Plugins: built-ins come from the entry-point group, every hook is documented and exercised."""

import inspect

import pluggy
import pytest
import torch

from llmserve import hookspecs
from llmserve.config import EngineConfig
from llmserve.hookspecs import hookimpl
from llmserve.plugin_manager import Plugins, get_plugin_manager

HOOKS = [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("llmserve_")]


def test_builtin_backends_load_through_the_entry_point_group():
    from importlib.metadata import entry_points
    names = {ep.name for ep in entry_points(group="llmserve")}
    assert {"cpu", "cuda"} <= names
    assert {"cpu", "cuda"} <= {name for name, _ in get_plugin_manager().list_name_plugin()}


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    params = inspect.signature(getattr(hookspecs, hook)).parameters
    assert len(doc) > 40
    for p in params:
        assert f":param {p}:" in doc, f"{hook} does not document {p}"


def test_every_hook_has_a_test():
    source = inspect.getsource(inspect.getmodule(test_every_hook_has_a_test))
    for hook in HOOKS:
        assert source.count(hook) >= 2, f"{hook} has no test"


def test_llmserve_select_backend_picks_per_device_and_later_plugins_win():
    plugins = Plugins()
    assert plugins.select_backend(torch.device("cpu"), EngineConfig()).name == "cpu"

    class Mine:
        @hookimpl
        def llmserve_select_backend(self, device, config):
            from llmserve.plugins.cpu import CPUBackend
            b = CPUBackend()
            b.name = "mine"
            return b

    pm = get_plugin_manager()
    plugin = Mine()
    pm.register(plugin, name="mine")
    try:
        assert plugins.select_backend(torch.device("cpu"), EngineConfig()).name == "mine"
    finally:
        pm.unregister(plugin)
    with pytest.raises(RuntimeError, match="no backend plugin serves device 'meta'"):
        plugins.select_backend(torch.device("meta"), EngineConfig())


def test_llmserve_register_quantization_methods_and_llmserve_register_decoding_strategies():
    class Reg:
        @hookimpl
        def llmserve_register_quantization_methods(self, register):
            register("toy-int8", object())

        @hookimpl
        def llmserve_register_decoding_strategies(self, register):
            register("toy-spec", object())

    class Clash:
        @hookimpl
        def llmserve_register_quantization_methods(self, register):
            register("toy-int8", object())

    pm = get_plugin_manager()
    reg, clash = Reg(), Clash()
    pm.register(reg, name="reg")
    try:
        plugins = Plugins()
        assert "toy-int8" in plugins.quantization_methods()
        assert "toy-spec" in plugins.decoding_strategies()
        pm.register(clash, name="clash")
        with pytest.raises(RuntimeError, match="'toy-int8' registered by both"):
            plugins.quantization_methods()
    finally:
        pm.unregister(reg)
        if pm.is_registered(clash):
            pm.unregister(clash)


def test_misspelled_hook_implementation_fails_loudly():
    pm = pluggy.PluginManager("llmserve")
    pm.add_hookspecs(hookspecs)

    class Typo:
        @hookimpl
        def llmserve_select_backnd(self, device, config):
            return None

    pm.register(Typo())
    with pytest.raises(pluggy.PluginValidationError):
        pm.check_pending()


def test_unknown_quantization_lists_what_is_available(checkpoint):
    from llmserve import LLM
    with pytest.raises(ValueError, match=r"model.quantization 'nope' is not available; registered methods: none"):
        LLM(checkpoint("llama"), device="cpu", quantization="nope")
