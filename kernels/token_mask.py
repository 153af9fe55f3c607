"""Packed token masks applied to logits in place: the decoding strategies' constraints.

A mask row is int32 words, bit t % 32 of word t // 32 set where token t may come next
(llmserve/decoding.py). Program (r, j) reads WORDS words of mask row r, spreads them to a
[WORDS, 32] tile of bits and writes -inf into logits row rows[r] wherever a bit is clear: the
logits are only written, never read, and no [R, V] boolean mask is built. A row's words past the
vocabulary (the last word's high bits) are ignored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_WORDS = 64  # 2,048 tokens a program


@triton.jit
def _token_mask_kernel(logits_ptr, stride, rows_ptr, mask_ptr, mask_stride, V, W, WORDS: tl.constexpr):
    r = tl.program_id(0)
    words = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
    row = tl.load(rows_ptr + r)
    packed = tl.load(mask_ptr + r * mask_stride + words, mask=words < W, other=-1)
    bits = tl.arange(0, 32)
    token = words[:, None] * 32 + bits[None, :]
    banned = ((packed[:, None] >> bits[None, :]) & 1) == 0
    tl.store(logits_ptr + row * stride + token, float("-inf"), mask=banned & (token < V))


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
    """logits float32 [B, V] (unit column stride), rows int64 [R] (row of `logits` per mask row),
    masks int32 [R, ceil(V / 32)]: logits[rows[r], t] = -inf where bit t of mask row r is clear."""
    R, W = masks.shape
    if R:
        _token_mask_kernel[(R, triton.cdiv(W, _WORDS))](logits, logits.stride(0), rows, masks, masks.stride(0),
                                                        logits.shape[1], W, WORDS=_WORDS, num_warps=4)


def unpack_mask(masks: torch.Tensor, vocab: int) -> torch.Tensor:
    """Packed int32 masks [R, W] -> bool [R, vocab]."""
    # shifts made on the device: a tensor built from a host list would be a blocking copy
    shifts = torch.arange(32, dtype=torch.int32, device=masks.device)
    return ((masks[:, :, None] >> shifts) & 1).bool().reshape(masks.shape[0], -1)[:, :vocab]


def apply_token_mask_reference(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
    """apply_token_mask in torch (the CPU backend's, and the kernel's test oracle)."""
    logits[rows] = logits[rows].masked_fill(~unpack_mask(masks, logits.shape[-1]), float("-inf"))
