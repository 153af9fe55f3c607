"""A model architecture from a plugin: `ExampleLlamaForCausalLM`, a Llama checkpoint published under
another architecture name (as fine-tunes often are), served by the built-in decoder. A real plugin
subclasses or writes its own module tree the same way; `spec_from_config` reads its config."""

from __future__ import annotations

from llmserve.hookspecs import hookimpl
from llmserve.model.llama import LlamaForCausalLM
from llmserve.model.spec import ModelSpec

ARCHITECTURE = "ExampleLlamaForCausalLM"


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_from_config(cls, config: dict) -> ModelSpec:
        """The shape the engine sizes the KV cache by: this config is a Llama one."""
        return ModelSpec.from_dict({**config, "architectures": ["LlamaForCausalLM"]})


@hookimpl
def llmserve_register_models(register) -> None:
    register(ARCHITECTURE, ExampleLlamaForCausalLM)
