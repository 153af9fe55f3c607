import dataclasses
import re
from pathlib import Path

import pytest

from llmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

ROOT = Path(__file__).resolve().parent.parent


def test_example_config_loads_and_documents_every_key():
    config = EngineConfig.from_toml(ROOT / "config.example.toml")
    assert config.model.model == "builtin" and config.cache.block_size == 16
    text = (ROOT / "config.example.toml").read_text()
    for section in dataclasses.fields(EngineConfig):
        assert f"[{section.name}]" in text
        for f in dataclasses.fields(getattr(config, section.name)):
            assert re.search(rf"^#? ?{f.name} = ", text, re.M), f"{section.name}.{f.name} is not documented"


def test_from_kwargs_routes_each_key_to_its_section():
    c = EngineConfig.from_kwargs(model="m", block_size=8, max_num_seqs=3, policy="priority")
    assert (c.model.model, c.cache.block_size, c.scheduler.max_num_seqs, c.scheduler.policy) == ("m", 8, 3, "priority")
    with pytest.raises(ValueError, match="unknown engine option 'blok_size'"):
        EngineConfig.from_kwargs(model="m", blok_size=8)


def test_unknown_toml_keys_are_named(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[cache]\nblock_sise = 4\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['block_sise'\] in \[cache\]"):
        EngineConfig.from_toml(p)


@pytest.mark.parametrize("make,match", [
    (lambda: CacheConfig(block_size=3), r"cache.block_size must be a power of two in \[1, 128\], got 3"),
    (lambda: CacheConfig(gpu_memory_utilization=1.5), r"cache.gpu_memory_utilization must be in \(0, 1\]"),
    (lambda: CacheConfig(cascade_attention="on"), "cache.cascade_attention must be 'auto', 'always' or 'never', got 'on'"),
    (lambda: SchedulerConfig(max_num_seqs=0), "scheduler.max_num_seqs must be >= 1"),
    (lambda: SchedulerConfig(policy="lifo"), "scheduler.policy must be 'fcfs' or 'priority'"),
    (lambda: ModelConfig(dtype="int4"), "model.dtype must be one of"),
    (lambda: ModelConfig(device="tpu"), "model.device must be"),
    (lambda: ModelConfig(generation_config="vllm"), "model.generation_config must be 'auto' or 'none', got 'vllm'"),
])
def test_invalid_values_name_field_and_limit(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_cli_generates(checkpoint, tmp_path, capsys):
    from llmserve.cli import main
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[model]\nmodel = "{checkpoint("llama")}"\ndevice = "cpu"\n[scheduler]\nlog_interval_s = 0\n')
    assert main(["--config", str(cfg), "--prompt", "Hello", "--prompt", "The capital", "--max-tokens", "5"]) == 0
    import json
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "The capital"]
    assert all(len(line["token_ids"]) == 5 or line["finish_reason"] == "stop" for line in lines)
