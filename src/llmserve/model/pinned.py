"""Host arrays to the device through one pinned ring buffer.

A step sends a handful of small arrays (sampling parameters, row indices). `tensor.pin_memory()`
per array asked PyTorch's pinned allocator for a block and the driver whether the source was
pinned, a host round trip per array: most of a small decode step's launch. Here each
array is written into the next free bytes of a ring of pinned memory and copied from there without
waiting for the device (non_blocking).

The ring has two halves. Leaving a half records an event after the copies queued from it; a half is
written again only once its event has passed, i.e. once the copies of its previous lap have run
(a half holds hundreds of decode steps' arrays, so that wait is practically never a wait).
"""

from __future__ import annotations

import numpy as np
import torch


class PinnedRing:
    def __init__(self, device: torch.device, nbytes: int = 1 << 22) -> None:
        self.device = device
        self.half = nbytes // 2
        self.buf = torch.empty(2 * self.half, dtype=torch.uint8, pin_memory=True)
        self.host = self.buf.numpy()
        self.side = 0  # the half being written
        self.pos = 0  # next free byte in it
        self.done: list[torch.cuda.Event | None] = [None, None]

    def to_device(self, array: np.ndarray) -> torch.Tensor:
        """`array` on the device, its copy queued behind the stream's work (the host does not wait)."""
        return self.stage(array).to(self.device, non_blocking=True)

    def stage(self, array: np.ndarray) -> torch.Tensor:
        """`array` in pinned memory, for one non-blocking copy to the device queued from it next
        (a fresh tensor, or a static buffer's `copy_`)."""
        array = np.ascontiguousarray(array)
        host, staged = self.empty(array.shape, array.dtype)
        host[...] = array
        return staged

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, torch.Tensor]:
        """Pinned memory for an array to be written in place (no copy of a host array first): its
        numpy view to fill, and the tensor to copy to the device from."""
        dtype = np.dtype(dtype)
        n = int(np.prod(shape)) * dtype.itemsize
        if n > self.half // 4:  # rare and large: a pinned block of its own
            staged = torch.empty(shape, dtype=_TORCH_DTYPES[dtype], pin_memory=True)
            return staged.numpy(), staged
        start = -(-self.pos // 16) * 16
        if start + n > self.half:
            self._switch()
            start = 0
        self.pos = start + n
        offset = self.side * self.half + start
        host = self.host[offset:offset + n].view(dtype).reshape(shape)
        return host, self.buf[offset:offset + n].view(_TORCH_DTYPES[dtype]).view(shape)

    def _switch(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self.done[self.side] = event
        self.side ^= 1
        self.pos = 0
        if self.done[self.side] is not None:
            self.done[self.side].synchronize()


_TORCH_DTYPES = {np.dtype(d): torch.from_numpy(np.zeros(1, dtype=d)).dtype
                 for d in (np.int64, np.int32, np.float32, np.float64, np.bool_, np.uint8, np.int8, np.int16)}
