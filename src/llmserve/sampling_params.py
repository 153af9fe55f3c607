"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_N = 128
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The fields a checkpoint's generation_config.json may default for requests that leave them unset."""


def _fail(name: str, limit: str, value: object) -> None:
    raise ValueError(f"{name} must be {limit}, got {value!r}")


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

    def __post_init__(self) -> None:
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            _fail("n", f"an integer in [1, {MAX_N}]", self.n)
        if not 0.0 <= self.temperature <= 100.0:
            _fail("temperature", "in [0, 100]", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            _fail("top_p", "in (0, 1]", self.top_p)
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            _fail("top_k", "-1, 0 (disabled) or a positive integer", self.top_k)
        if not 0.0 <= self.min_p <= 1.0:
            _fail("min_p", "in [0, 1]", self.min_p)
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            _fail("seed", "an integer in [0, 2**63)", self.seed)
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                _fail(name, "in [-2, 2]", getattr(self, name))
        if not 0.0 < self.repetition_penalty <= 10.0:
            _fail("repetition_penalty", "in (0, 10]", self.repetition_penalty)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                _fail("logit_bias", "a mapping of token id to bias", self.logit_bias)
            bias = {}
            for tok, b in self.logit_bias.items():
                try:
                    tok_id = int(tok)
                except (TypeError, ValueError):
                    _fail("logit_bias", "keyed by integer token ids", tok)
                if tok_id < 0 or not -100.0 <= float(b) <= 100.0:
                    _fail("logit_bias", "token ids >= 0 with biases in [-100, 100]", {tok: b})
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
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_LOGPROBS):
                _fail(name, f"None or an integer in [0, {MAX_LOGPROBS}]", v)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
