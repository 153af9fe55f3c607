"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_N = 128
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The fields a checkpoint's generation_config.json may default for requests that leave them unset."""
REQUEST_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "logit_bias", "stop", "stop_token_ids", "include_stop_str_in_output",
                  "ignore_eos", "min_tokens", "skip_special_tokens", "allowed_token_ids", "bad_words",
                  "truncate_prompt_tokens")
"""The fields an HTTP request sets under their own names, with these defaults and types (the
server's request bodies are derived from them). max_tokens, logprobs and prompt_logprobs are
each endpoint's own (named, defaulted or derived differently)."""
GREEDY_BELOW = 1e-5
"""Temperatures under this sample greedily: dividing logits by less overflows float32."""
_FLOAT32_TINY = 2.0 ** -126


@dataclass(slots=True, frozen=True)
class Range:
    """A closed interval, or one open at its low end."""
    lo: float
    hi: float
    open_lo: bool = False

    def __contains__(self, value: float) -> bool:
        return (self.lo < value if self.open_lo else self.lo <= value) and value <= self.hi

    def __str__(self) -> str:
        return f"{'(' if self.open_lo else '['}{_number(self.lo)}, {_number(self.hi)}]"


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


RANGES = {
    "n": Range(1, MAX_N),
    "temperature": Range(0, 100),
    "top_p": Range(0, 1, open_lo=True),
    "top_k": Range(-1, 2**31 - 1),
    "min_p": Range(0, 1),
    "presence_penalty": Range(-2, 2),
    "frequency_penalty": Range(-2, 2),
    # Below 0.01 the division of positive logits overflows float32 for large logits.
    "repetition_penalty": Range(0.01, 10),
    "logprobs": Range(0, MAX_LOGPROBS),
    "prompt_logprobs": Range(0, MAX_LOGPROBS),
}
"""Numeric limits of the sampling fields (the server's OpenAPI document states them too)."""
LOGIT_BIAS_RANGE = Range(-100, 100)


def _fail(name: str, limit: str, value: object) -> None:
    raise ValueError(f"{name} must be {limit}, got {value!r}")


def _check_range(name: str, value: object, integer: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)) or value not in RANGES[name]:
        _fail(name, f"{'an integer ' if integer else ''}in {RANGES[name]}", value)


@dataclass(slots=True)
class StructuredOutputsParams:
    """Output constrained to a language: exactly one of the fields (vLLM's names). `json` is a JSON
    schema (a dict or its text), `json_object` any JSON object, `regex` a regular expression,
    `choice` one of the strings, `grammar` an EBNF (GBNF) grammar whose start rule is `root`.
    `jump_forward`: where the language admits exactly one continuation (a key, punctuation), its
    tokens are appended without sampling and computed in one step (not for requests that ask for
    logprobs: a jumped token has none). Unset, it is on for all but `json_object`, whose grammar
    admits whitespace between any two tokens and so forces only the rest of a `true`, `false` or
    `null`: its checks (a grammar call a request each step) would cost every step and save next to
    none."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    jump_forward: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            _fail("structured_outputs", "exactly one of json, regex, choice, grammar, json_object",
                  given or "none of them")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            _fail("structured_outputs.json", "a JSON schema (an object or its text)", self.json)
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not (isinstance(getattr(self, name), str) and getattr(self, name)):
                _fail(f"structured_outputs.{name}", "a non-empty string", getattr(self, name))
        if self.jump_forward is not None and not isinstance(self.jump_forward, bool):
            _fail("structured_outputs.jump_forward", "true or false", self.jump_forward)
        if self.choice is not None and not (isinstance(self.choice, list) and self.choice
                                            and all(isinstance(c, str) and c for c in self.choice)):
            _fail("structured_outputs.choice", "a non-empty list of non-empty strings", self.choice)

    @property
    def jumps(self) -> bool:
        """Whether jump-forward is asked for: `jump_forward`, or where unset the kind's default."""
        return self.jump_forward if self.jump_forward is not None else not self.json_object

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    """Independent samples of the same prompt; they share the prompt's KV blocks."""
    temperature: float = 1.0
    """0 selects greedy decoding."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1 disables top-k."""
    min_p: float = 0.0
    seed: int | None = None
    """Same seed, same output, whatever else runs in the batch."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    """None generates until max_model_len."""
    min_tokens: int = 0
    logprobs: int | None = None
    """Top-k log-probabilities returned for each sampled token (plus the sampled one)."""
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    """Only these tokens may be sampled (decoding strategy `token_masks`)."""
    bad_words: list[str] | None = None
    """Words never generated: a word's last token is masked where the output ends in its other
    tokens (each word as it encodes alone and after a space; decoding strategy `token_masks`)."""
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar (decoding strategy
    `structured_outputs`)."""
    truncate_prompt_tokens: int | None = None
    """A longer prompt keeps only its last this many tokens (-1: as many as the context lets a prompt
    have, max_model_len - 1), where it would otherwise be refused; its usage counts those kept."""
    extra_args: dict | None = None
    """Parameters for plugins: a third-party decoding strategy selects its requests by them."""

    def __post_init__(self) -> None:
        _check_range("n", self.n, integer=True)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            _check_range(name, getattr(self, name))
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        # The device holds it in float32: a top_p that rounds to 0 there would keep no token at
        # all; the smallest normal float32 keeps the most likely one, as any tiny top_p does.
        self.top_p = max(self.top_p, _FLOAT32_TINY)
        _check_range("top_k", self.top_k, integer=True)
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            _fail("seed", "an integer in [0, 2**63)", self.seed)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", "a mapping of token id to bias", self.logit_bias)
            bias = {}
            for tok, b in self.logit_bias.items():
                try:
                    tok_id = int(tok)
                except (TypeError, ValueError):
                    _fail("logit_bias", "keyed by integer token ids", tok)
                if (tok_id < 0 or isinstance(b, bool) or not isinstance(b, (int, float))
                        or b not in LOGIT_BIAS_RANGE):
                    _fail("logit_bias", f"token ids >= 0 with biases in {LOGIT_BIAS_RANGE}", {tok: b})
                bias[tok_id] = float(b)
            self.logit_bias = bias
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            _fail("stop", "a string or a list of non-empty strings", self.stop)
        if not isinstance(self.stop_token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            _fail("stop_token_ids", "a list of token ids >= 0", self.stop_token_ids)
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            _fail("max_tokens", ">= 1", self.max_tokens)
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            _fail("min_tokens", ">= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            _fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_range(name, getattr(self, name), integer=True)
        if self.truncate_prompt_tokens is not None and (
                type(self.truncate_prompt_tokens) is not int or not (self.truncate_prompt_tokens >= 1
                                                                     or self.truncate_prompt_tokens == -1)):
            _fail("truncate_prompt_tokens", "an integer >= 1, or -1 (the longest prompt the context takes)",
                  self.truncate_prompt_tokens)
        if self.allowed_token_ids is not None and not (
                isinstance(self.allowed_token_ids, list) and self.allowed_token_ids
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.allowed_token_ids)):
            _fail("allowed_token_ids", "a non-empty list of token ids >= 0", self.allowed_token_ids)
        if self.bad_words is not None and not (isinstance(self.bad_words, list)
                                               and all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            _fail("bad_words", "a list of non-empty strings", self.bad_words)
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            _fail("extra_args", "a mapping", self.extra_args)
        if isinstance(self.structured_outputs, dict):
            if unknown := set(self.structured_outputs) - {"json", "regex", "choice", "grammar", "json_object",
                                                          "jump_forward"}:
                _fail("structured_outputs", "an object of json, regex, choice, grammar or json_object (and "
                      "jump_forward)", sorted(unknown))
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                _fail("structured_outputs", "a StructuredOutputsParams", self.structured_outputs)
            if self.ignore_eos:
                _fail("ignore_eos", "false with structured_outputs (a complete output ends at its end)",
                      self.ignore_eos)
            if self.min_tokens:
                _fail("min_tokens", "0 with structured_outputs (the grammar says where the output ends)",
                      self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def held_back(self, eos_token_ids) -> list[int]:
        """The tokens min_tokens holds back until it is reached: the request's stop tokens, and
        `eos_token_ids` (the model's and tokenizer's ends) unless ignore_eos."""
        return self.stop_token_ids + ([] if self.ignore_eos else list(eos_token_ids))
