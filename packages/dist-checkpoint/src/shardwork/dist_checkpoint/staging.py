"""Host staging for async saves: copies of this rank's write pieces, taken on the training
thread so the caller may modify its state as soon as `save` returns.

- Tensors are copied to contiguous host tensors (pinned when the source is on CUDA, with
  non-blocking copies and one synchronize at the end); objects are pickled now.
- `StagingBuffers` keeps the host tensors between saves, keyed by (key, offsets), so later
  stagings copy into memory that is already allocated, faulted in and pinned.
"""

from __future__ import annotations

import io
from typing import Any

import torch

__all__ = ["StagingBuffers", "stage"]


class StagingBuffers:
    """Host buffers kept between async saves, so staging is a copy into memory that is
    already allocated and faulted in (and pinned, for CUDA sources) instead of a fresh
    allocation each time. An async save holds them until it is finalized (`holder`), and
    `save` refuses buffers that are held, so a background write never reads buffers that the
    next staging overwrites. Costs one host copy of this rank's write set."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, Any], torch.Tensor] = {}
        #: the unfinalized async save whose background write reads these buffers, if any
        self.holder: Any = None

    def hold(self, save: Any) -> None:
        self.holder = save

    def release(self, save: Any) -> None:
        if self.holder is save:
            self.holder = None

    def get(self, key: tuple[str, Any], like: torch.Tensor) -> torch.Tensor:
        """A contiguous host tensor shaped like ``like`` for ``key`` (reused when it fits)."""
        buf = self._buffers.get(key)
        # Pinned host memory lets the device-to-host copy run asynchronously.
        pin = like.is_cuda
        if (
            buf is None
            or buf.shape != like.shape
            or buf.dtype != like.dtype
            or (pin and not buf.is_pinned())
        ):
            buf = torch.empty(like.shape, dtype=like.dtype, pin_memory=pin)
            self._buffers[key] = buf
        return buf

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def tensors(self) -> list[torch.Tensor]:
        """The host buffers currently kept (to inspect: size, pinning)."""
        return list(self._buffers.values())


def stage(
    data: dict[tuple[str, Any], Any], buffers: StagingBuffers | None
) -> dict[tuple[str, Any], Any]:
    """Host copies of tensors (pinned when on CUDA) and serialised objects."""
    staged: dict[tuple[str, Any], Any] = {}
    cuda_devices: set[torch.device] = set()
    for key, value in data.items():
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if buffers is not None:
                host = buffers.get(key, value)
                host.copy_(value, non_blocking=value.is_cuda)
            elif value.is_cuda:
                host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
                host.copy_(value, non_blocking=True)
            else:
                # A copy now: the caller may modify its tensor as soon as save returns.
                host = value.clone(memory_format=torch.contiguous_format)
            if value.is_cuda:
                cuda_devices.add(value.device)
            staged[key] = host
        else:
            buffer = io.BytesIO()
            # Pickled now, so later changes to the object do not reach the checkpoint.
            torch.save(value, buffer)
            staged[key] = buffer.getvalue()
    # the copies are queued on each device's current stream: wait for all of them before the
    # caller may modify its tensors and the writer thread reads the host copies
    for device in cuda_devices:
        torch.cuda.synchronize(device)
    return staged
