"""What a request's caller receives."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int
    """1 for the most likely token."""
    decoded_token: str | None = None


# One entry per position: candidate token id -> its log-probability (the sampled or prompt token
# and the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None
    """None while running; 'stop' (EOS, stop token or stop string), 'length' or 'abort'."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the output, if any."""

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finished: bool = False
    num_cached_tokens: int = 0
    queue_time_s: float | None = None
    """Seconds from arrival until the request was first scheduled."""
