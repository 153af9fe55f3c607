"""Shared fixtures: tiny random-weight checkpoints (llmserve.testing) and the transformers reference."""

from __future__ import annotations

import os

import pytest
import torch

# Triton kernels run in the interpreter on machines without a GPU; set before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmserve.hookspecs import hookimpl  # noqa: E402
from llmserve.plugin_manager import get_plugin_manager  # noqa: E402
from llmserve.testing import ARCHS, make_checkpoint, train_tokenizer  # noqa: E402,F401


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(arch, **overrides) -> path, cached per session."""
    cache: dict[tuple, str] = {}

    def get(arch: str = "llama", **overrides) -> str:
        key = (arch, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            cache[key] = make_checkpoint(str(tmp_path_factory.mktemp(arch)), arch, **overrides)
        return cache[key]

    return get


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, device: str = "cpu",
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                               pad_token_id=model.config.pad_token_id)
            outs.append(y[0, len(ids):].tolist())
    return outs


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def record_calls(obj, name: str) -> list[tuple]:
    """Wrap obj.name (on the instance) so that each call's arguments are appended to the returned
    list: tests count what the engine did without counters in its classes."""
    calls, original = [], getattr(obj, name)

    def recorded(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)
    setattr(obj, name, recorded)
    return calls


class OracleProposer:
    """Proposes the plain engine's own continuation of each request (found by its prompt and output
    so far), with every `wrong`-th proposal's last draft changed: drafts kept whole, in part and not at all."""

    def __init__(self, reference: dict[tuple, list[int]], wrong: int = 3) -> None:
        self.reference, self.wrong, self.calls = reference, wrong, 0

    def propose(self, req_ids, sequences, limits):
        out = []
        for (prompt, output), limit in zip(sequences, limits):
            self.calls += 1
            ref = self.reference.get((tuple(prompt), tuple(output[:1])), [])
            drafts = list(ref[len(output):len(output) + limit]) if ref[:len(output)] == output else []
            if drafts and self.calls % self.wrong == 0:
                drafts[-1] ^= 1  # another token of the vocabulary
            out.append(drafts)
        return out


class Register:
    def __init__(self, name, factory):
        self.name, self.factory = name, factory

    @hookimpl
    def llmserve_register_proposers(self, register):
        register(self.name, self.factory)


@pytest.fixture
def oracle():
    """oracle(reference) -> the name of a proposer registered for this test."""
    pm, plugins = get_plugin_manager(), []

    def make(reference, wrong=3):
        name = f"oracle{len(plugins)}"
        plugin = Register(name, lambda config, context: OracleProposer(reference, wrong))
        pm.register(plugin, name=name)
        plugins.append(plugin)
        return name
    try:
        yield make
    finally:
        for plugin in plugins:
            pm.unregister(plugin)


def hold_speculation_on(llm):
    """Make every step of `llm` speculate: the controller's choice depends on measured times."""
    control = llm.engine.scheduler.spec_control
    control.active, control.wait = True, 0
    control.record = lambda *args, **kwargs: None
    return llm
