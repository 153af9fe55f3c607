"""What the kernels' launch heuristics need to know about the device."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_sm_counts: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 1 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sm_counts[index]


_hopper: dict[int, bool] = {}
PDL_ENABLED = os.environ.get("LLMSERVE_PDL", "1") != "0"  # LLMSERVE_PDL=0: plain launches (for comparisons)


def hopper(device: torch.device) -> bool:
    """An NVIDIA GPU of compute capability 9.0 or later (a ROCm device reports type cuda too)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _hopper:
        _hopper[index] = torch.cuda.get_device_capability(index) >= (9, 0)
    return _hopper[index]


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch: Hopper and later,
    so that a kernel's programs are placed on the SMs while the kernel before it drains, instead
    of after. Such a kernel starts with pdl_start. Never off NVIDIA GPUs or with LLMSERVE_PDL=0."""
    return PDL_ENABLED and hopper(device)


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel's first step when launched with PDL: wait until the kernel before it has finished
    and its writes are visible (nothing may be read or written before this), then let the kernel
    after it be placed as soon as this one's programs have all started."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
