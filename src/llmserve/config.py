"""Engine configuration: one tree of slotted dataclasses that validate themselves.

`EngineConfig.from_toml(path)` reads the same keys that `config.example.toml` documents;
`EngineConfig.from_kwargs(model=..., block_size=...)` is the flat form `LLM(...)` takes.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmserve.sampling_params import MODEL_DEFAULT_FIELDS, SamplingParams

_DTYPES = ("auto", "float32", "float16", "bfloat16")


def _check(ok: bool, section: str, name: str, limit: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{section}.{name} must be {limit}, got {value!r}")


@dataclass(slots=True)
class ModelConfig:
    model: str = "builtin"
    """Checkpoint directory (config.json, *.safetensors, tokenizer files), or "builtin" for the small
    model that ships with llmserve."""
    tokenizer: str | None = None
    """Tokenizer directory; the checkpoint directory when unset."""
    dtype: str = "auto"
    """auto (the checkpoint's torch_dtype; float32 on CPU when that is half precision) | float32 | float16 | bfloat16."""
    load_format: str = "auto"
    """auto (safetensors) | dummy (random weights in the checkpoint's shapes; config.json alone suffices)."""
    max_model_len: int | None = None
    """Longest prompt + output, in tokens; max_position_embeddings when unset."""
    device: str = "auto"
    """auto (cuda when available, else cpu) | cpu | cuda | cuda:N."""
    seed: int = 0
    """Seed for dummy weights and for requests that carry no seed of their own."""
    quantization: str | None = None
    """Name of a quantization method registered by a plugin; None for none."""
    enforce_eager: bool = False
    """Never use CUDA graphs (captured at start-up otherwise: decode steps by batch size, prefill and
    mixed steps by token count)."""
    generation_config: str = "auto"
    """auto: requests that leave temperature, top_p, top_k, min_p or repetition_penalty unset take the
    checkpoint's generation_config.json values (as transformers' generate and vLLM do) | none: the
    OpenAI API's defaults (temperature 1, no filters, no penalty)."""
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    """Sampling defaults set here, over generation_config's (vLLM's --override-generation-config
    '{"temperature": 0.6}'): any of temperature, top_p, top_k, min_p, repetition_penalty."""

    def __post_init__(self) -> None:
        _check(self.dtype in _DTYPES, "model", "dtype", f"one of {_DTYPES}", self.dtype)
        _check(self.load_format in ("auto", "dummy"), "model", "load_format", "'auto' or 'dummy'", self.load_format)
        _check(self.generation_config in ("auto", "none"), "model", "generation_config", "'auto' or 'none'",
               self.generation_config)
        overrides = self.override_generation_config
        _check(isinstance(overrides, dict) and set(overrides) <= set(MODEL_DEFAULT_FIELDS), "model",
               "override_generation_config", f"an object of {', '.join(MODEL_DEFAULT_FIELDS)} (no max_new_tokens: "
               "a request's max_tokens sets its length, a chat request without one runs to the context's end)",
               overrides)
        try:
            SamplingParams(**overrides)
        except ValueError as exc:
            raise ValueError(f"model.override_generation_config: {exc}") from None
        _check(self.max_model_len is None or self.max_model_len >= 2, "model", "max_model_len", ">= 2", self.max_model_len)
        _check(self.device == "auto" or self.device.split(":")[0] in ("cpu", "cuda"), "model", "device",
               "'auto', 'cpu', 'cuda' or 'cuda:N'", self.device)


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    gpu_memory_utilization: float = 0.90
    """Fraction of the GPU's memory the engine may use (weights, activations and KV cache)."""
    num_blocks: int | None = None
    """Fixed number of KV blocks; overrides sizing from memory (tests use it to force preemption)."""
    cpu_kv_cache_gib: float = 1.0
    """KV cache size on the CPU device."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of identical prompt prefixes across requests."""
    kv_cache_dtype: str = "auto"
    """auto (the model dtype) | fp8 / fp8_e4m3 (FP8-e4m3 values with a float32 scale per token and KV head)."""
    cascade_attention: str = "auto"
    """auto | always | never: attend a prefix that running requests share once for all of them
    (cascade attention); auto where its cost model says a step gains, always wherever requests
    share one."""

    def __post_init__(self) -> None:
        _check(self.cascade_attention in ("auto", "always", "never"), "cache", "cascade_attention",
               "'auto', 'always' or 'never'", self.cascade_attention)
        _check(self.kv_cache_dtype in ("auto", "fp8", "fp8_e4m3"), "cache", "kv_cache_dtype",
               "'auto', 'fp8' or 'fp8_e4m3'", self.kv_cache_dtype)
        _check(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128), "cache", "block_size", "a power of two in [1, 128]", self.block_size)
        _check(0.0 < self.gpu_memory_utilization <= 1.0, "cache", "gpu_memory_utilization", "in (0, 1]", self.gpu_memory_utilization)
        _check(self.num_blocks is None or self.num_blocks >= 1, "cache", "num_blocks", ">= 1", self.num_blocks)
        _check(self.cpu_kv_cache_gib > 0, "cache", "cpu_kv_cache_gib", "> 0", self.cpu_kv_cache_gib)


@dataclass(slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    """Token budget of one step: decode tokens plus prefill chunks."""
    max_num_seqs: int = 256
    """Most requests running at once."""
    policy: str = "fcfs"
    """fcfs | priority (lower `priority` value runs first; ties by arrival)."""
    log_interval_s: float = 5.0
    """Seconds between engine statistics lines; 0 turns them off."""
    async_scheduling: bool = True
    """Plan the next step while the current one runs (a request that stops on EOS may compute one
    token more, which is discarded)."""
    reserve_growth: bool = True
    """Admit a request only while the KV cache keeps room for the tokens the running requests are
    expected to add (their max_tokens, scaled by the share finished requests used), so that a full
    cache holds requests back instead of preempting them; false admits whatever fits now."""
    jump_forward: bool = True
    """Decoding strategies may append what their constraint forces without sampling it, several
    tokens a step (structured outputs' jump-forward: a request can turn it off for itself, and on
    for json_object, where it is off by default)."""

    def __post_init__(self) -> None:
        _check(self.max_num_batched_tokens >= 1, "scheduler", "max_num_batched_tokens", ">= 1", self.max_num_batched_tokens)
        _check(self.max_num_seqs >= 1, "scheduler", "max_num_seqs", ">= 1", self.max_num_seqs)
        _check(self.policy in ("fcfs", "priority"), "scheduler", "policy", "'fcfs' or 'priority'", self.policy)
        _check(self.log_interval_s >= 0, "scheduler", "log_interval_s", ">= 0", self.log_interval_s)


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Devices one model is split over (Megatron-style), one process per rank; its attention heads
    (and KV heads, or the ranks their count), MLP width must divide evenly. On CUDA rank r uses
    device r (after model.device's index); on CPU the ranks share the cores (gloo collectives)."""
    data_parallel_size: int = 1
    """Replicas of the engine behind one server (`llmserve serve`), each with its own device side
    process and tensor_parallel_size devices (replica i from device i * tensor_parallel_size);
    requests go to the least loaded, or to the one that served their prefix."""
    distributed_executor_backend: str = "mp"
    """How the ranks start: mp (processes on this machine) | ray (Ray actors on the machines of a Ray
    cluster, placed by a placement group; `pip install 'llmserve[ray]'`; also with one rank)."""
    disable_custom_all_reduce: bool = False
    """CUDA: NCCL for every all-reduce, also the small ones of decode steps, which otherwise take a
    one-shot kernel over symmetric memory (distributed/parallel_state.py) where the devices allow."""

    def __post_init__(self) -> None:
        _check(self.tensor_parallel_size >= 1, "parallel", "tensor_parallel_size", ">= 1", self.tensor_parallel_size)
        _check(self.data_parallel_size >= 1, "parallel", "data_parallel_size", ">= 1", self.data_parallel_size)
        _check(self.distributed_executor_backend in ("mp", "ray"), "parallel", "distributed_executor_backend",
               "'mp' or 'ray'", self.distributed_executor_backend)


@dataclass(slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys (`LLM(speculative_config={...})`, `--speculative-config JSON`)."""
    method: str | None = None
    """Speculative decoding's proposer, by the name a plugin registered (built-in: ngram, which
    looks the last tokens up in the prompt and output so far; draft, a small model of the same
    tokenizer); None: no speculation."""
    model: str | None = None
    """draft: the draft checkpoint's directory."""
    num_speculative_tokens: int = 4
    """Most tokens proposed per request per step; each step checks them all in one forward pass."""
    prompt_lookup_max: int | None = None
    """ngram: the longest run of last tokens looked up (unset: 4, or prompt_lookup_min if larger)."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest run of last tokens looked up (unset: 1)."""
    disable_by_batch_size: int = 32
    """Running requests above which no request speculates (a large batch's steps are already
    compute-bound: checking proposals there costs more than it saves)."""

    def __post_init__(self) -> None:
        _check(self.method is None or (isinstance(self.method, str) and self.method != ""), "speculative", "method",
               "the name of a registered proposer", self.method)
        _check(self.model is None or self.method is not None, "speculative", "model",
               "unset without speculative.method (a draft model is used by method 'draft')", self.model)
        _check(1 <= self.num_speculative_tokens <= 16, "speculative", "num_speculative_tokens", "in [1, 16]",
               self.num_speculative_tokens)
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and value >= 1), "speculative", name, "an integer >= 1",
                   value)
        _check(self.prompt_lookup_max is None or self.prompt_lookup_max >= (self.prompt_lookup_min or 1), "speculative",
               "prompt_lookup_max", f">= prompt_lookup_min ({self.prompt_lookup_min or 1})", self.prompt_lookup_max)
        _check(self.disable_by_batch_size >= 1, "speculative", "disable_by_batch_size", ">= 1",
               self.disable_by_batch_size)


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    """Address to listen on (0.0.0.0: every IPv4 interface)."""
    port: int = 8000
    """TCP port to listen on."""
    served_model_name: str | list[str] | None = None
    """Name clients pass as `model`; the checkpoint directory's name when unset. Several names (a
    list): a request may use any of them, and its response reports that one; metrics carry the first."""
    chat_template: str | None = None
    """A Jinja chat template, or the path of a file holding one, used in place of the tokenizer's
    (a base checkpoint has none)."""
    metrics_prefix: str = "llmserve_"
    """How /metrics names its series: "llmserve_" (llmserve_num_requests_waiting) or "vllm:"
    (vllm:num_requests_waiting, vLLM's own names, for dashboards written for vLLM)."""
    api_key: str | list[str] | None = None
    """Required as `Authorization: Bearer KEY` when set (or when LLMSERVE_API_KEY, else vLLM's
    VLLM_API_KEY, is set). Several keys (a list): any of them is taken."""
    protect_health_metrics: bool = False
    """Also require the key for /health and /metrics."""
    allowed_hosts: list[str] = field(default_factory=list)
    """Host header values served (names or addresses; the port is not compared); others get 403,
    which keeps web pages from reaching the server through DNS rebinding. Empty: localhost and any
    IP address (a rebinding page's Host is a domain name); name the server's DNS names here to
    reach it by them; ["*"]: any."""
    allowed_origins: list[str] = field(default_factory=list)
    """Browser origins ("https://app.example:8443") allowed to call the API (CORS) and to open
    WebSockets; ["*"] allows all. A request whose Origin header is not listed gets 403. Empty:
    CORS off, no cross-origin browser access."""
    max_body_bytes: int = 1 << 20
    """Larger request bodies and WebSocket messages get 413 (a WebSocket is closed with 1009)."""
    max_waiting_requests: int = 1024
    """Sequences (prompts x n) admitted that have no first token yet (queued or in prefill), counted
    as they are admitted; a request that would pass it gets 503 and Retry-After."""
    max_choices: int = 256
    """Sequences one request may ask for: its prompts times n."""
    max_stop_sequences: int = 64
    """Entries in one request's `stop`, and separately in its `stop_token_ids`."""
    max_stop_chars: int = 4096
    """Characters of one request's stop strings together."""
    max_logit_bias: int = 1024
    """Tokens one request's logit_bias may name."""
    max_bad_words: int = 1024
    """Entries in one request's bad_words (each is checked at every step the request samples)."""
    max_ws_requests: int = 16
    """Requests in flight on one WebSocket."""
    max_ws_per_client: int = 32
    """Open WebSockets per client address; more are refused with 429."""
    ws_idle_timeout_s: float = 300.0
    """A WebSocket with no message and no request in flight for this long is closed."""
    shutdown_grace_s: float = 10.0
    """Seconds in-flight requests get to finish after SIGINT/SIGTERM (a second signal ends them at
    once); then each stream ends with an error event."""
    engine_process: bool = True
    """Run the scheduler, KV manager and executor in a child process, so HTTP and detokenization never
    take the step loop's time; false runs everything on the server's event loop."""
    tool_call_parser: str = "hermes"
    """How chat requests with tool_choice "auto" read tool calls from the output: the name of a
    registered tool-call parser (a plugin's; built-in: hermes, the Hermes/Qwen `<tool_call>` format)."""
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Chat template variables every chat request gets unless its chat_template_kwargs sets them
    (vLLM's --default-chat-template-kwargs '{"enable_thinking": false}')."""
    reasoning_parser: str | None = None
    """How chat choices' thinking is told from their answer (vLLM's --reasoning-parser): the name
    of a registered reasoning parser (a plugin's; built-in: "qwen3", `<think>...</think>` first;
    "deepseek_r1", the template opens `<think>` and the choice begins inside it); the thinking is reported as `reasoning`, not content. Unset: all is content."""
    enable_prompt_tokens_details: bool = False
    """Chat and completions usage also states prompt_tokens_details.cached_tokens, the prompt
    tokens the prefix cache held (off by default, as in vLLM: usage then does not depend on which
    requests ran before; the Responses API always states them)."""
    enable_force_include_usage: bool = False
    """Every streamed chat or completions request ends with a usage chunk, as if it had asked with
    stream_options.include_usage."""
    return_tokens_as_token_ids: bool = False
    """Logprobs name each token "token_id:N" unless a request says otherwise (its own field)."""
    enable_request_id_headers: bool = False
    """Each response carries X-Request-Id: the request's own header, else a new id."""
    ssl_certfile: str | None = None
    """Serve HTTPS (and WSS) with this certificate chain (PEM), with ssl_keyfile."""
    ssl_keyfile: str | None = None
    """The private key (PEM) of ssl_certfile."""

    def __post_init__(self) -> None:
        _check(0 <= self.port <= 65535, "server", "port", "in [0, 65535]", self.port)
        _check(self.metrics_prefix in ("llmserve_", "vllm:"), "server", "metrics_prefix", "'llmserve_' or 'vllm:'",
               self.metrics_prefix)
        _check(self.max_body_bytes >= 1024, "server", "max_body_bytes", ">= 1024", self.max_body_bytes)
        _check(self.max_waiting_requests >= 1, "server", "max_waiting_requests", ">= 1", self.max_waiting_requests)
        for name in ("max_choices", "max_stop_sequences", "max_stop_chars", "max_logit_bias", "max_bad_words",
                     "max_ws_requests", "max_ws_per_client"):
            _check(getattr(self, name) >= 1, "server", name, ">= 1", getattr(self, name))
        _check(self.ws_idle_timeout_s > 0, "server", "ws_idle_timeout_s", "> 0", self.ws_idle_timeout_s)
        _check(self.shutdown_grace_s >= 0, "server", "shutdown_grace_s", ">= 0", self.shutdown_grace_s)
        _check(isinstance(self.tool_call_parser, str) and self.tool_call_parser != "", "server", "tool_call_parser",
               "the name of a registered tool-call parser", self.tool_call_parser)
        _check(self.reasoning_parser is None or isinstance(self.reasoning_parser, str) and self.reasoning_parser != "",
               "server", "reasoning_parser", "the name of a registered reasoning parser", self.reasoning_parser)
        kwargs = self.default_chat_template_kwargs
        _check(isinstance(kwargs, dict), "server", "default_chat_template_kwargs", "an object", kwargs)
        if kwargs:
            from llmserve.server.chat_template import RENDER_ARGUMENTS
            _check(not kwargs.keys() & RENDER_ARGUMENTS, "server", "default_chat_template_kwargs",
                   "template variables, not arguments of the rendering", sorted(kwargs.keys() & RENDER_ARGUMENTS))
        _check((self.ssl_certfile is None) == (self.ssl_keyfile is None), "server", "ssl_keyfile",
               "set together with ssl_certfile", self.ssl_keyfile)
        for name in ("served_model_name", "api_key"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value != "") or (
                isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)), "server", name,
                "a non-empty string or a non-empty list of them", value)
        for name in ("allowed_hosts", "allowed_origins"):
            value = getattr(self, name)
            _check(isinstance(value, list) and all(isinstance(v, str) and v for v in value), "server", name,
                   "a list of non-empty strings", value)


@dataclass(slots=True)
class PluginsConfig:
    block: list[str] = field(default_factory=list)
    """Plugins never loaded, built-ins included (LLMSERVE_PLUGINS_BLOCK=a,b adds to it)."""
    allow: list[str] | None = None
    """When set, the only entry-point (third-party) plugins loaded; built-ins load unless blocked
    (LLMSERVE_PLUGINS_ALLOW=a,b replaces it)."""

    def __post_init__(self) -> None:
        for key, value in (("block", self.block), ("allow", self.allow)):
            if value is not None:
                _check(isinstance(value, list) and all(isinstance(n, str) for n in value),
                       "plugins", key, "a list of plugin names", value)


_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
             "parallel": ParallelConfig, "speculative": SpeculativeConfig, "server": ServerConfig,
             "plugins": PluginsConfig}


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)

    @classmethod
    def from_dict(cls, data: dict[str, dict[str, Any]]) -> EngineConfig:
        unknown = set(data) - set(_SECTIONS)
        if unknown:
            raise ValueError(f"unknown config section(s) {sorted(unknown)}; known: {sorted(_SECTIONS)}")
        sections = {}
        for name, klass in _SECTIONS.items():
            values = data.get(name, {})
            known = {f.name for f in dataclasses.fields(klass)}
            bad = set(values) - known
            if bad:
                raise ValueError(f"unknown key(s) {sorted(bad)} in [{name}]; known: {sorted(known)}")
            sections[name] = klass(**values)
        return cls(**sections)

    @classmethod
    def from_toml(cls, path: str | Path) -> EngineConfig:
        with open(path, "rb") as f:
            return cls.from_dict(tomllib.load(f))

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Flat keyword form: each key goes to the one section that has a field of that name;
        `speculative_config` is the [speculative] section as a dict (vLLM's spelling)."""
        data: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        if (speculative := kwargs.pop("speculative_config", None)) is not None:
            if not isinstance(speculative, dict):
                raise ValueError(f"speculative_config must be a dict of [speculative] keys, got {speculative!r}")
            data["speculative"] = dict(speculative)
        for key, value in kwargs.items():
            owners = [n for n, k in _SECTIONS.items() if n != "speculative" and key in {f.name for f in dataclasses.fields(k)}]
            if not owners:
                raise ValueError(f"unknown engine option {key!r}")
            data[owners[0]][key] = value
        return cls.from_dict(data)
