"""Every hook llmserve calls, grouped by lifecycle. Plugins implement them with `@hookimpl`.

Plugins register through the `llmserve` entry-point group (the built-in CPU and CUDA backends do
too); see plugin_manager.py for how they are loaded and called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import pluggy

if TYPE_CHECKING:
    import torch

    from llmserve.attention import AttentionBackend
    from llmserve.config import EngineConfig

hookspec = pluggy.HookspecMarker("llmserve")
hookimpl = pluggy.HookimplMarker("llmserve")


# ---- Hardware backends ------------------------------------------------------------------------

@hookspec(firstresult=True)
def llmserve_select_backend(device: "torch.device", config: "EngineConfig") -> "AttentionBackend | None":
    """Return the attention backend for `device`, or None if this plugin does not serve it.

    firstresult: the first non-None answer wins; later-registered plugins are asked first, so a
    third-party backend can take over a device from a built-in one.

    :param device: the torch device the engine runs on (``cpu``, ``cuda:0``...).
    :param config: the whole engine configuration.
    """


# ---- Quantization methods ---------------------------------------------------------------------

@hookspec
def llmserve_register_quantization_methods(register: Callable[[str, Any], None]) -> None:
    """Register quantization methods by calling ``register(name, method)``.

    Selected by ``model.quantization = "name"``. A method decides how linear layers create, load
    and apply their weights. Called for every plugin (not firstresult); a name registered twice is
    a start-up error naming both plugins.

    :param register: callback taking the method's name and its implementation object.
    """


# ---- Decoding strategies ----------------------------------------------------------------------

@hookspec
def llmserve_register_decoding_strategies(register: Callable[[str, Any], None]) -> None:
    """Register decoding strategies by calling ``register(name, strategy)``.

    A strategy (the `llmserve.decoding.DecodingStrategy` protocol) constrains what the requests it
    wants may sample next: it prepares each such request on the request side (on a worker thread:
    a grammar's compilation) and keeps a `Constraint` per sample on the executor's side, which
    fills the mask of tokens allowed next and accepts each token produced. Called for every plugin;
    a name registered twice is a start-up error naming both plugins.

    :param register: callback taking the strategy's name and its implementation object.
    """


@hookspec
def llmserve_register_proposers(register: Callable[[str, Any], None]) -> None:
    """Register speculative-decoding proposers by calling ``register(name, factory)``.

    Selected by ``speculative.method = "name"`` (``LLM(speculative_config={"method": "name"})``).
    ``factory(config, context)`` takes the [speculative] config section and what a proposer may
    need of the engine (`llmserve.speculative.ProposerContext`) and returns a proposer (the
    `llmserve.speculative.Proposer` protocol), whose ``propose`` guesses the tokens that follow
    each request's last one; the engine checks them all in the request's next step and keeps
    those the model itself would have produced. Built-in: ``ngram``, ``draft``. Called for every plugin; a
    name registered twice is a start-up error naming both plugins.

    :param register: callback taking the proposer's name and its factory.
    """


# ---- Model architectures --------------------------------------------------------------------

@hookspec
def llmserve_register_models(register: Callable[[str, Any], None]) -> None:
    """Register model architectures by calling ``register(architecture, model_class)``.

    ``architecture`` is the name a checkpoint's config.json lists under ``architectures``. The
    class is built as ``model_class(spec, backend, max_positions, quant)`` on the engine's device
    and dtype and provides what `llmserve.model.llama.LlamaForCausalLM` does: ``forward(input_ids,
    positions, meta)`` to hidden states, ``compute_logits(hidden)``, ``set_kv_caches(caches)``,
    ``load_weight(name, tensor)`` and ``checkpoint_names()``; its attention goes through
    ``backend.attention`` over the paged cache. An optional class method ``spec_from_config(config)``
    returns the `llmserve.model.spec.ModelSpec` the engine sizes the cache by (without it, the
    config is read as a Llama one). A built-in architecture cannot be replaced. Called for every
    plugin; a name registered twice is a start-up error naming both plugins.

    :param register: callback taking the architecture's name and the model class.
    """


# ---- Tool-call parsers (the chat API) ---------------------------------------------------------

@hookspec
def llmserve_register_tool_parsers(register: Callable[[str, Any], None]) -> None:
    """Register tool-call parsers by calling ``register(name, factory)``.

    A parser reads a model's own tool-call format out of a chat choice's text, for requests with
    ``tool_choice: "auto"`` (the `llmserve.tool_parsers.ToolParser` protocol): ``factory(tools)``
    makes one per choice, which is fed the text as it is produced and answers content, call starts
    and argument pieces. Selected by ``server.tool_call_parser = "name"`` (``--tool-call-parser``);
    built-in: ``hermes``. Called for every plugin; a name registered twice is a start-up error
    naming both plugins.

    :param register: callback taking the parser's name and its factory.
    """


# ---- Reasoning parsers (the chat API) ---------------------------------------------------------

@hookspec
def llmserve_register_reasoning_parsers(register: Callable[[str, Any], None]) -> None:
    """Register reasoning parsers by calling ``register(name, ReasoningFormat(...))``.

    A parser tells a chat choice's thinking from its answer by the tags the model writes around
    it (`llmserve.server.reasoning.ReasoningFormat`: ``open`` and ``close``, and ``starts_inside``
    where the chat template opens the tag in the prompt, so that a choice begins inside it); the
    thinking is reported as the message's ``reasoning``. Selected by
    ``server.reasoning_parser = "name"`` (``--reasoning-parser``); built-in: ``qwen3``,
    ``deepseek_r1``. The tags must reach the text: a tokenizer that marks them special drops them
    from it unless a request sends ``skip_special_tokens: false``. Called for every plugin; a name registered twice is a start-up
    error naming both plugins.

    :param register: callback taking the parser's name and its format.
    """
