"""Plugins: built-ins and entry-point plugins load alike, can be blocked or allow-listed, fail
loudly naming the plugin, and every hook is documented and exercised."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pluggy
import pytest
import torch

from llmserve import hookspecs
from llmserve.config import EngineConfig
from llmserve.hookspecs import hookimpl
from llmserve.plugin_manager import DEFAULT_PLUGINS, PluginError, Plugins, _build, get_plugin_manager

HOOKS = [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("llmserve_")]
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "plugins" / "third_party_example"


def test_builtin_plugins_register_like_third_party_ones():
    pm = get_plugin_manager()
    assert set(DEFAULT_PLUGINS) <= {name for name, _ in pm.list_name_plugin()}
    assert all(pm.sources[name] == "built-in" for name in DEFAULT_PLUGINS)
    assert {"int8", "fp8", "compressed-tensors"} <= set(Plugins(pm).quantization_methods())


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    params = inspect.signature(getattr(hookspecs, hook)).parameters
    assert len(doc) > 40
    for p in params:
        assert f":param {p}:" in doc, f"{hook} does not document {p}"
    guide = (REPO / "docs" / "plugins.md").read_text()
    assert f"`{hook}(" in guide, f"docs/plugins.md does not document {hook}"


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


def test_llmserve_register_quantization_methods():
    class Reg:
        @hookimpl
        def llmserve_register_quantization_methods(self, register):
            register("toy-int8", object())

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
        pm.register(clash, name="clash")
        with pytest.raises(RuntimeError, match="'toy-int8' registered by both"):
            plugins.quantization_methods()
    finally:
        pm.unregister(reg)
        if pm.is_registered(clash):
            pm.unregister(clash)


def test_llmserve_register_decoding_strategies():
    class Reg:
        @hookimpl
        def llmserve_register_decoding_strategies(self, register):
            register("toy", object())

    pm = get_plugin_manager()
    reg, clash = Reg(), Reg()
    pm.register(reg, name="reg")
    try:
        plugins = Plugins()
        assert {"toy", "structured_outputs"} <= set(plugins.decoding_strategies())
        pm.register(clash, name="clash")
        with pytest.raises(RuntimeError, match="'toy' registered by both"):
            plugins.decoding_strategies()
    finally:
        for plugin in (reg, clash):
            if pm.is_registered(plugin):
                pm.unregister(plugin)


def test_llmserve_register_proposers():
    class Reg:
        @hookimpl
        def llmserve_register_proposers(self, register):
            register("toy", lambda config, context: None)

    pm = get_plugin_manager()
    reg, clash = Reg(), Reg()
    pm.register(reg, name="reg")
    try:
        assert {"toy", "ngram"} <= set(Plugins().proposers())
        assert {r["name"]: r["proposers"] for r in Plugins().describe()}["ngram"] == ["ngram"]
        pm.register(clash, name="clash")
        with pytest.raises(RuntimeError, match="'toy' registered by both"):
            Plugins().proposers()
    finally:
        for plugin in (reg, clash):
            if pm.is_registered(plugin):
                pm.unregister(plugin)


def test_llmserve_register_tool_parsers():
    class Reg:
        @hookimpl
        def llmserve_register_tool_parsers(self, register):
            register("toy", lambda tools: None)

    pm = get_plugin_manager()
    reg, clash = Reg(), Reg()
    pm.register(reg, name="reg")
    try:
        assert {"toy", "hermes"} <= set(Plugins().tool_parsers())
        pm.register(clash, name="clash")
        with pytest.raises(RuntimeError, match="'toy' registered by both"):
            Plugins().tool_parsers()
    finally:
        for plugin in (reg, clash):
            if pm.is_registered(plugin):
                pm.unregister(plugin)


def test_llmserve_register_reasoning_parsers():
    """A plugin's parser, by its tags, is what server.reasoning_parser selects: the server splits
    a choice by it (the output forced into its tags by a regex)."""
    from llmserve.server.reasoning import ReasoningFormat
    from servers import running_server

    class Reg:
        @hookimpl
        def llmserve_register_reasoning_parsers(self, register):
            register("seed", ReasoningFormat(starts_inside=False, open="<seed:think>", close="</seed:think>"))

    class Wrong:
        @hookimpl
        def llmserve_register_reasoning_parsers(self, register):
            register("mine", {"open": "<r>", "close": "</r>"})

    pm = get_plugin_manager()
    reg, clash = Reg(), Reg()
    pm.register(reg, name="reg")
    try:
        assert {"seed", "qwen3", "deepseek_r1"} <= set(Plugins().reasoning_parsers())
        assert {r["name"]: r["reasoning_parsers"] for r in Plugins().describe()}["reg"] == ["seed"]
        with running_server(reasoning_parser="seed") as s:
            out = s.client().chat.completions.create(
                model="llmserve-builtin", messages=[{"role": "user", "content": "A list"}], max_tokens=40,
                extra_body={"structured_outputs": {"regex": "<seed:think>[a-z]{3,8}</seed:think>[a-z]{2,6}"}})
            message = out.choices[0].message
            assert message.model_extra["reasoning"].isalpha() and message.content.isalpha()
        pm.register(clash, name="clash")
        with pytest.raises(RuntimeError, match="'seed' registered by both"):
            Plugins().reasoning_parsers()
        pm.unregister(clash)
        pm.register(Wrong(), name="wrong")
        with pytest.raises(PluginError, match="plugin 'wrong' registered the reasoning parser 'mine' as a dict"):
            Plugins().reasoning_parsers()
    finally:
        for name in ("reg", "clash", "wrong"):
            if pm.get_plugin(name) is not None:
                pm.unregister(name=name)


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
    with pytest.raises(ValueError, match=r"model.quantization 'nope' is not available; registered methods: "
                                         r"\['compressed-tensors', 'fp8', 'int8'\]"):
        LLM(checkpoint("llama"), device="cpu", quantization="nope")


def fake_distribution(root: Path, name: str, module_source: str) -> None:
    """An installed distribution `name` whose module `name` is an entry point of the llmserve group."""
    dist = root / f"{name}-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[llmserve]\n{name} = {name}\n")
    (root / f"{name}.py").write_text(module_source)


def test_a_plugin_that_fails_to_import_stops_start_up_naming_it(tmp_path, monkeypatch):
    fake_distribution(tmp_path, "brokenplug", "import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"plugin 'brokenplug' \(brokenplug 0.1, brokenplug\) failed to load: "
                                          r"ModuleNotFoundError"):
        _build.__wrapped__(frozenset(), None)
    assert "brokenplug" not in {n for n, _ in _build.__wrapped__(frozenset({"brokenplug"}), None).list_name_plugin()}


def test_a_misspelled_hook_in_an_installed_plugin_stops_start_up_naming_it(tmp_path, monkeypatch):
    fake_distribution(tmp_path, "typoplug", "from llmserve.hookspecs import hookimpl\n\n"
                                            "@hookimpl\ndef llmserve_register_quantisation_methods(register):\n"
                                            "    register('x', object)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match=r"plugin 'typoplug' \(typoplug 0.1\) is invalid: .*"
                                          r"llmserve_register_quantisation_methods"):
        _build.__wrapped__(frozenset(), None)


def test_block_and_allow_lists_from_config_and_environment(tmp_path, monkeypatch):
    fake_distribution(tmp_path, "extraplug", "from llmserve.hookspecs import hookimpl\n\n"
                                             "@hookimpl\ndef llmserve_register_quantization_methods(register):\n"
                                             "    register('extra', object)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    _build.cache_clear()
    try:
        names = lambda pm: {n for n, _ in pm.list_name_plugin()}  # noqa: E731
        assert "extraplug" in names(get_plugin_manager())
        pm = get_plugin_manager(allow=["someone-else"])
        assert "extraplug" not in names(pm) and set(DEFAULT_PLUGINS) <= names(pm)  # built-ins ignore allow
        assert pm.skipped == {"extraplug": "not in the allow list"}
        pm = get_plugin_manager(block=["extraplug", "int8"])
        assert names(pm) == set(DEFAULT_PLUGINS) - {"int8"}
        monkeypatch.setenv("LLMSERVE_PLUGINS_BLOCK", "fp8")
        assert "fp8" not in names(get_plugin_manager(block=["extraplug"]))
        monkeypatch.setenv("LLMSERVE_PLUGINS_ALLOW", "extraplug")
        assert "extraplug" in names(get_plugin_manager(allow=["someone-else"]))  # the environment wins
        config = EngineConfig.from_dict({"plugins": {"block": ["extraplug"]}})
        monkeypatch.delenv("LLMSERVE_PLUGINS_ALLOW")
        assert "extra" not in Plugins.from_config(config.plugins).quantization_methods()
    finally:
        _build.cache_clear()
    with pytest.raises(ValueError, match=r"plugins.block must be a list of plugin names, got 'int8'"):
        EngineConfig.from_dict({"plugins": {"block": "int8"}})


def test_llmserve_plugins_lists_plugins_and_what_they_register(capsys):
    from llmserve.cli import main
    assert main(["plugins", "--json"]) == 0
    rows = {r["name"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert rows["fp8"]["quantization_methods"] == ["compressed-tensors", "fp8"]
    assert rows["cuda"]["hooks"] == ["llmserve_select_backend"] and rows["cuda"]["source"] == "built-in"
    assert rows["hermes"]["tool_parsers"] == ["hermes"] and rows["cuda"]["tool_parsers"] == []
    assert main(["plugins"]) == 0
    assert "tool parsers: hermes" in capsys.readouterr().out


@pytest.fixture(scope="module")
def example_installed(tmp_path_factory):
    """The example plugin package, pip-installed (offline, no build isolation) into its own folder."""
    target = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--no-build-isolation", "--target", str(target), str(EXAMPLE)], check=True)
    return target


def run_with(site: Path, code: str, **env) -> subprocess.CompletedProcess:
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300)


def test_third_party_package_is_discovered_selectable_and_runs(example_installed, checkpoint):
    path = checkpoint("llama")
    listing = run_with(example_installed, "from llmserve.cli import main; main(['plugins', '--json'])")
    rows = {r["name"]: r for r in map(json.loads, listing.stdout.splitlines())}
    assert rows["int4_example"] == {
        "name": "int4_example", "source": "llmserve-int4-example 0.1.0", "status": "loaded",
        "hooks": ["llmserve_register_decoding_strategies", "llmserve_register_models",
                  "llmserve_register_quantization_methods"],
        "quantization_methods": ["int4-rtn"], "decoding_strategies": ["allowed_token_ids"], "tool_parsers": [],
        "reasoning_parsers": [], "proposers": [], "models": ["ExampleLlamaForCausalLM"]}
    generate = run_with(example_installed, f"""
import json, torch
from llmserve import LLM, SamplingParams
with LLM({path!r}, device="cpu", quantization="int4-rtn", log_interval_s=0) as llm:
    qkv = llm.engine.runner.model.layers[0].self_attn.qkv_proj
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    print(json.dumps({{"method": llm.engine.quant.name, "qweight": str(qkv.qweight.dtype),
                      "shape": list(qkv.qweight.shape), "tokens": out}}))
""")
    assert generate.returncode == 0, generate.stderr
    result = json.loads(generate.stdout.splitlines()[-1])
    assert result["method"] == "int4-rtn" and result["qweight"] == "torch.uint8" and len(result["tokens"]) == 6
    assert result["shape"][1] == 32  # 64 input features, two 4-bit weights a byte
    constrained = run_with(example_installed, f"""
import json
from llmserve import LLM, SamplingParams
with LLM({path!r}, device="cpu", log_interval_s=0) as llm:
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s, extra_args={{"allowed_token_ids": [5, 77, 300]}})
              for s in range(4)]
    print(json.dumps([o.outputs[0].token_ids for o in llm.generate(["The quick brown fox"] * 4, params, use_tqdm=False)]))
    try:
        llm.generate(["x"], SamplingParams(extra_args={{"allowed_token_ids": [-1]}}), use_tqdm=False)
    except ValueError as exc:
        print(exc)
""")
    assert constrained.returncode == 0, constrained.stderr
    tokens = json.loads(constrained.stdout.splitlines()[-2])
    assert all(set(t) <= {5, 77, 300} and t for t in tokens) and len({tuple(t) for t in tokens}) > 1
    assert "extra_args.allowed_token_ids must be a non-empty list of token ids" in constrained.stdout.splitlines()[-1]
    blocked = run_with(example_installed, f"""
from llmserve import LLM
LLM({path!r}, device="cpu", quantization="int4-rtn")
""", LLMSERVE_PLUGINS_BLOCK="int4_example")
    assert "model.quantization 'int4-rtn' is not available" in blocked.stderr


def test_llmserve_register_models_serves_an_architecture_the_engine_lacks(checkpoint, tmp_path):
    """A Llama checkpoint under another architecture name: refused with the list of supported
    ones, then served by a plugin's model class (its spec_from_config read), token for token as
    the Llama checkpoint itself."""
    import shutil

    from llmserve import LLM, SamplingParams
    from llmserve.model.llama import LlamaForCausalLM
    from llmserve.model.spec import ModelSpec
    source = checkpoint("llama")
    renamed = tmp_path / "renamed"
    shutil.copytree(source, renamed)
    config = json.loads((renamed / "config.json").read_text())
    (renamed / "config.json").write_text(json.dumps({**config, "architectures": ["RenamedForCausalLM"]}))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    with pytest.raises(ValueError, match="unsupported model architecture.*RenamedForCausalLM"):
        LLM(str(renamed), device="cpu", log_interval_s=0)

    class Renamed(LlamaForCausalLM):
        specs = []

        @classmethod
        def spec_from_config(cls, cfg):
            cls.specs.append(ModelSpec.from_dict({**cfg, "architectures": ["LlamaForCausalLM"]}))
            return cls.specs[-1]

    class Models:
        @hookimpl
        def llmserve_register_models(self, register):
            register("RenamedForCausalLM", Renamed)

    pm, plugin = get_plugin_manager(), Models()
    pm.register(plugin, name="renamed-models")
    try:
        assert [r["models"] for r in Plugins().describe() if r["name"] == "renamed-models"] == [["RenamedForCausalLM"]]
        with LLM(str(renamed), device="cpu", log_interval_s=0) as llm:
            assert type(llm.engine.runner.model) is Renamed and Renamed.specs
            got = llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        pm.unregister(plugin)
    with LLM(source, device="cpu", log_interval_s=0) as llm:
        assert got == llm.generate(["The quick brown fox"], params, use_tqdm=False)[0].outputs[0].token_ids
