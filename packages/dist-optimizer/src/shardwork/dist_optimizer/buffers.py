"""Contiguous parameter/gradient buffers, their buckets, and the per-bucket collectives.

- :class:`ParamAndGradBuffer` owns one flat parameter tensor (parameter dtype) and one flat
  gradient tensor (gradient dtype) for the parameters of one :class:`BufferKey`; each
  parameter's ``.data`` becomes a view into the first and ``param.main_grad`` a view into
  the second.
- :class:`Bucket` reduces its slice of the gradient buffer (all-reduce, or reduce-scatter
  into this rank's shard when a distributed optimizer owns the shards) and all-gathers its
  slice of the parameter buffer after an optimizer step. Both can run asynchronously.
- Averaging: ``divisor`` is the number of data-parallel replicas of the loss (dp×cp). For a
  dense bucket it equals the group size and ``ReduceOp.AVG`` can do it in the collective; an
  expert bucket reduces over the expert-data-parallel group but still divides by dp×cp
  (its gradient collects tokens from all dp×cp ranks through the expert all-to-all), so
  the collective averages over edp and the gradient is pre-scaled by ``edp / (dp×cp)``.
- :class:`LaunchQueue` issues the buckets that share one process group in a fixed order
  (by when their last gradient is expected), so every rank issues collectives in the same
  order even when gradients arrive out of order or a parameter gets no gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardwork.dist_optimizer.layout import BufferKey, BufferLayout
from shardwork.parallel_state import group_rank, group_size

__all__ = ["Bucket", "LaunchQueue", "ParamAndGradBuffer"]


class Bucket:
    """A slice of one buffer whose gradients are reduced by one collective."""

    def __init__(
        self,
        *,
        key: BufferKey,
        index: int,
        params: Sequence[torch.nn.Parameter],
        param_data: torch.Tensor,
        grad_data: torch.Tensor,
        group: Any,
        divisor: int | None,
        average_in_collective: bool,
        reduce_scatter: bool,
    ) -> None:
        self.key = key
        self.index = index
        self.params = list(params)
        self.param_data = param_data
        """View of this bucket in the parameter buffer (padded length)."""
        self.grad_data = grad_data
        """View of this bucket in the gradient buffer (padded length)."""
        self.group = group
        self.reduce_scatter = reduce_scatter
        size = group_size(group)
        # The layout pads each bucket to a multiple of the group size, so the shards are equal.
        self.shard_numel = grad_data.numel() // size if reduce_scatter else grad_data.numel()
        rank = group_rank(group)
        self.shard_slice = (
            slice(rank * self.shard_numel, (rank + 1) * self.shard_numel)
            if reduce_scatter
            else slice(0, grad_data.numel())
        )
        # Scale and op: SUM of (grad * prescale), or AVG of (grad * prescale).
        if divisor is None:
            self.prescale, self.op = 1.0, dist.ReduceOp.SUM
        elif average_in_collective:
            # AVG divides by the group size; size / divisor turns that into a division by
            # ``divisor``.
            self.prescale, self.op = size / divisor, dist.ReduceOp.AVG
        else:
            self.prescale, self.op = 1.0 / divisor, dist.ReduceOp.SUM
        self._param_ids = {id(p) for p in self.params}
        self._pending: set[int] = set()
        self.grad_handle: Any = None
        self.grad_launched = False
        self.param_handle: Any = None
        self.reset()

    def reset(self) -> None:
        """Forget readiness and launches (called when gradients are zeroed)."""
        self._pending = set(self._param_ids)
        self.grad_handle = None
        self.grad_launched = False

    def mark_ready(self, param: torch.Tensor) -> bool:
        """Record that ``param``'s gradient is final; True when the whole bucket is ready."""
        self._pending.discard(id(param))
        return not self._pending

    @property
    def ready(self) -> bool:
        return not self._pending

    def marked_ready(self, param: torch.Tensor) -> bool:
        """True when ``param`` was already marked ready since the last :meth:`reset`."""
        return id(param) not in self._pending

    def start_grad_sync(self) -> None:
        """Launch this bucket's gradient reduction (asynchronous)."""
        assert not self.grad_launched, "bucket launched twice"
        self.grad_launched = True
        # No collective, but the division must still happen, as it would on a larger group.
        if self.group is None or group_size(self.group) == 1:
            if self.prescale != 1.0:
                self.grad_data.mul_(self.prescale)
            return
        if self.prescale != 1.0:
            self.grad_data.mul_(self.prescale)
        if self.reduce_scatter:
            # Output is this rank's slice of the same buffer: only that slice holds the reduced sum
            # afterwards; the rest keeps this rank's local gradient.
            out = self.grad_data[self.shard_slice]
            self.grad_handle = dist.reduce_scatter_tensor(
                out, self.grad_data, op=self.op, group=self.group, async_op=True
            )
        else:
            self.grad_handle = dist.all_reduce(
                self.grad_data, op=self.op, group=self.group, async_op=True
            )

    def finish_grad_sync(self) -> None:
        """Wait for the launched reduction."""
        if self.grad_handle is not None:
            self.grad_handle.wait()
            self.grad_handle = None

    def start_param_sync(self, *, async_op: bool) -> bool:
        """All-gather every rank's updated shard of the parameter buffer; True when an
        asynchronous gather was launched and is now pending."""
        if not self.reduce_scatter or self.group is None or group_size(self.group) == 1:
            return False
        shard = self.param_data[self.shard_slice]
        # In place: the input is this rank's slice of the output, and the parameters are views of
        # param_data, so they see every rank's update without a copy.
        handle = dist.all_gather_into_tensor(
            self.param_data, shard, group=self.group, async_op=async_op
        )
        self.param_handle = handle if async_op else None
        return async_op

    def finish_param_sync(self) -> bool:
        """Wait for a pending all-gather; True when there was one."""
        if self.param_handle is None:
            return False
        self.param_handle.wait()
        self.param_handle = None
        return True


class LaunchQueue:
    """Buckets of one process group, launched strictly in order."""

    def __init__(self, buckets: Sequence[Bucket]) -> None:
        self.buckets = list(buckets)
        self.cursor = 0
        self.launch_log: list[tuple[BufferKey, int]] | None = None

    def reset(self) -> None:
        self.cursor = 0

    def launch_ready(self) -> None:
        """Launch every bucket from the cursor on that is ready, stopping at the first that is not."""
        # Strict order: a later bucket waits for an earlier one, so every rank issues the same
        # collectives in the same sequence whatever order its gradients arrive in.
        while self.cursor < len(self.buckets) and self.buckets[self.cursor].ready:
            self._launch_next()

    def launch_all(self) -> None:
        """Launch every bucket not launched yet (in order), ready or not."""
        # Buckets with gradients still missing are launched too; a rank skipping one would leave the
        # other ranks waiting in that collective.
        while self.cursor < len(self.buckets):
            self._launch_next()

    def _launch_next(self) -> None:
        bucket = self.buckets[self.cursor]
        self.cursor += 1
        bucket.start_grad_sync()
        if self.launch_log is not None:
            self.launch_log.append((bucket.key, bucket.index))


class ParamAndGradBuffer:
    """Flat parameter and gradient storage for the parameters of one :class:`BufferKey`.

    ``params`` are in buffer (backward) order, matching ``layout``. On construction the
    parameters' values are copied into the parameter buffer and ``p.data`` is re-pointed to a
    view of it; ``p.main_grad`` is a view of the (zeroed) gradient buffer.
    """

    def __init__(
        self,
        *,
        key: BufferKey,
        layout: BufferLayout,
        params: Sequence[torch.nn.Parameter],
        group: Any,
        divisor: int | None,
        average_in_collective: bool,
        reduce_scatter: bool,
    ) -> None:
        self.key = key
        self.layout = layout
        self.params = list(params)
        self.group = group
        device = self.params[0].device if self.params else torch.device("cpu")
        self.param_data = torch.zeros(layout.numel, dtype=key.torch_param_dtype, device=device)
        self.grad_data = torch.zeros(layout.numel, dtype=key.torch_grad_dtype, device=device)
        for p, (start, end) in zip(self.params, layout.param_ranges):
            # The parameter becomes a view into the flat buffer (values copied first).
            view = self.param_data[start:end].view(p.shape)
            view.copy_(p.data)
            p.data = view
            p.main_grad = self.grad_data[start:end].view(p.shape)
        self.buckets = [
            Bucket(
                key=key,
                index=b.index,
                params=[self.params[i] for i in b.param_indices],
                param_data=self.param_data[b.start : b.end],
                grad_data=self.grad_data[b.start : b.end],
                group=group,
                divisor=divisor,
                average_in_collective=average_in_collective,
                reduce_scatter=reduce_scatter,
            )
            for b in layout.buckets
        ]

    def zero_grad(self) -> None:
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()
