"""A step's stages between its launch and its result, as the model runner keeps them: its forward
pass queued (Forward), its sampler ready to queue once its masks are filled (Sampling), and launched
whole, its tokens on their way to the host (InFlight)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmserve.messages import StepResult
from llmserve.model.sampler import SamplingBatch
from llmserve.model.sampling_state import MaskFill, SeqState


@dataclass(slots=True)
class InFlight:
    """A launched step: its result so far and, if it samples, the device tokens on their way to
    pinned host memory (`ready` is recorded after that copy)."""
    result: StepResult
    req_ids: list[str]  # every request of the plan (failed together if finishing fails)
    states: list[SeqState] = field(default_factory=list)
    tokens: torch.Tensor | None = None  # int64 [num sampled], on the device
    rows: dict[str, int] = field(default_factory=dict)  # req_id -> row of `tokens`
    tokens_host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    logprob_parts: tuple[torch.Tensor, ...] | None = None
    mask_errors: dict[int, str] = field(default_factory=dict)  # row -> why its constraint filled no mask
    masks: MaskFill | None = None  # the masks its tokens were drawn under
    drafts: list[list[int]] | None = None  # per sampling request, the drafts it checks (speculative decoding)
    offsets: list[int] | None = None  # with drafts: each sampling request's first row of `tokens`
    propose: dict[str, int] = field(default_factory=dict)  # StepPlan.propose


@dataclass(slots=True)
class Forward:
    """A step whose forward pass is queued: its result so far and the logits of its sampling rows."""
    result: StepResult
    req_ids: list[str]
    logits: torch.Tensor | None = None
    drafts: list[list[int]] | None = None
    """Per sampling request, the drafts it checks: its logits rows are their positions and the one
    before them (len + 1 rows)."""
    propose: dict[str, int] = field(default_factory=dict)
    draft_probs: list[torch.Tensor | None] | None = None
    """With drafts: per sampling request, the distribution its drafts were drawn from (float32
    [len(drafts), V]), or None for a fixed proposal."""


@dataclass(slots=True)
class Sampling:
    """A step whose forward pass is queued and whose sampler is ready to queue once its masks are."""
    result: StepResult
    req_ids: list[str]
    logits: torch.Tensor
    states: list[SeqState]
    batch: SamplingBatch
    masks: MaskFill | None
    drafts: list[list[int]] | None = None
    propose: dict[str, int] = field(default_factory=dict)
    draft_probs: list[torch.Tensor | None] | None = None
