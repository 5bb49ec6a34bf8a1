"""``DistributedDataParallel``: bucketed gradient reduction overlapped with backward.

- Wraps any ``nn.Module``. Trainable parameters move into contiguous buffers per
  (param dtype, grad dtype, expert/dense) — see :mod:`shardwork.dist_optimizer.layout`;
  ``param.main_grad`` is the gradient accumulator (fp32 for bf16/fp16 parameters unless
  ``grad_reduce_in_fp32=False``, in which case ``fp32_grad_params`` picks the parameters that
  still get fp32 accumulation). Frozen parameters (``requires_grad=False``) are left alone.
- A post-accumulate-grad hook adds each ``param.grad`` into ``main_grad`` and frees it; when
  the last gradient of a bucket arrives (and we are not inside :meth:`no_sync`), the
  bucket's collective is launched asynchronously while backward continues. A gradient
  that arrives for a bucket already launched (or for a parameter already marked ready) in
  the same iteration — a second backward outside :meth:`no_sync` — raises a RuntimeError
  instead of being added to a buffer that is reduced or being reduced.
- Dense parameters reduce over ``dp_group`` (the dp×cp group), expert parameters over
  ``expert_dp_group`` (edp); both are divided by dp×cp when averaging.
- With ``use_distributed_optimizer=True`` buckets are padded to a multiple of the group size
  and reduced with reduce-scatter: each rank gets the reduced gradient of its shard only;
  the optimizer then all-gathers updated parameters, optionally overlapped with the next
  forward through forward pre-hooks that wait for a module's buckets.
"""

from __future__ import annotations

import contextlib
import fnmatch
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwork.dist_optimizer.buffers import Bucket, LaunchQueue, ParamAndGradBuffer
from shardwork.dist_optimizer.layout import BufferKey, ParamIndexMap
from shardwork.dist_optimizer.validation import (
    check_bool,
    check_int,
    check_process_groups,
    check_type,
    short_repr,
    with_article,
)
from shardwork.parallel_state import ProcessGroups, group_size

__all__ = ["DDPConfig", "DistributedDataParallel"]


_BOOL_FIELDS = (
    "overlap_grad_reduce",
    "use_distributed_optimizer",
    "average_in_collective",
    "average_gradients",
    "grad_reduce_in_fp32",
)


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """Options of :class:`DistributedDataParallel`."""

    bucket_size: int | None = 40_000_000
    """Minimum elements per bucket (the last may be smaller); None: one bucket per buffer."""
    overlap_grad_reduce: bool = True
    """Launch each bucket's reduction from backward hooks as soon as it is complete."""
    use_distributed_optimizer: bool = False
    """Reduce-scatter into per-rank shards (padded buckets) instead of all-reduce."""
    average_in_collective: bool = False
    """Average with ``ReduceOp.AVG`` instead of pre-scaling gradients by ``1/(dp×cp)``."""
    average_gradients: bool = True
    """False: sum over replicas (for a loss already normalised by the global token count)."""
    grad_reduce_in_fp32: bool = True
    """Accumulate and reduce gradients of low-precision parameters in fp32."""
    fp32_grad_params: Sequence[str] | Callable[[str, torch.Tensor], bool] = ()
    """With ``grad_reduce_in_fp32=False``: fnmatch patterns of parameter names (or a predicate
    ``(name, param) -> bool``) whose gradients still accumulate in fp32."""
    pad_multiple: int = 64
    """Buckets are padded to a multiple of ``lcm(dp_size, pad_multiple)`` (distributed optimizer)."""

    def __post_init__(self) -> None:
        """Check every field: a bool given as ``"False"`` would silently act as True."""
        for name in _BOOL_FIELDS:
            check_bool(f"DDPConfig.{name}", getattr(self, name))
        check_int("DDPConfig.bucket_size", self.bucket_size, minimum=1, allow_none=True)
        check_int("DDPConfig.pad_multiple", self.pad_multiple, minimum=1)
        if not callable(self.fp32_grad_params) and isinstance(self.fp32_grad_params, str):
            raise ValueError(
                f"DDPConfig.fp32_grad_params={self.fp32_grad_params!r}; valid: a sequence of "
                "patterns (wrap a single pattern in a tuple) or a callable"
            )


def check_member(group: Any, field: str) -> None:
    """ValueError if this process is not a member of ``group``."""
    if group is not None and dist.get_rank(group) < 0:
        raise ValueError(
            f"{field}: this rank ({dist.get_rank()}) is not a member of the given group; "
            "valid: a group containing this rank, or None"
        )


def data_parallel_groups(
    process_groups: ProcessGroups | None, dp_group: Any, expert_dp_group: Any
) -> tuple[Any, Any]:
    """``(dp_group, expert_dp_group)`` of a data-parallel wrapper: the explicit groups, else
    ``process_groups``' ``dp_cp`` and ``edp`` groups; the expert group defaults to the dense
    one. ValueError if this rank is not in one of them (None, one replica, is accepted here)."""
    if process_groups is not None:
        dp_group = dp_group if dp_group is not None else process_groups.group("dp_cp")
        if expert_dp_group is None:
            expert_dp_group = process_groups.group("edp")
    if expert_dp_group is None:
        expert_dp_group = dp_group
    check_member(dp_group, "dp_group")
    check_member(expert_dp_group, "expert_dp_group")
    return dp_group, expert_dp_group


def check_arguments(module: Any, config: Any, process_groups: Any, grad_divisor: Any) -> None:
    """TypeError/ValueError for a :class:`DistributedDataParallel` argument of the wrong kind
    (each would otherwise fail later with an AttributeError that names nothing)."""
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"DistributedDataParallel: module={short_repr(module)} is "
            f"{with_article(type(module).__name__)}; valid: the nn.Module to wrap"
        )
    check_type(
        "DistributedDataParallel: config",
        config,
        DDPConfig,
        "e.g. DDPConfig(bucket_size=10), or DDPConfig(**d) for a dict d of its fields",
    )
    check_process_groups("DistributedDataParallel: process_groups", process_groups)
    check_int("DistributedDataParallel: grad_divisor", grad_divisor, minimum=1, allow_none=True)


class DistributedDataParallel(nn.Module):
    """Data-parallel wrapper with bucketed, overlapped gradient reduction.

    Args:
        module: the model (moved to its device before wrapping).
        config: :class:`DDPConfig`.
        process_groups: take ``dp_cp`` (dense) and ``edp`` (expert) from this bundle.
        dp_group / expert_dp_group: explicit groups (override ``process_groups``); None with
            no bundle means one replica.
        grad_divisor: number of loss replicas to average over (an int >= 1); default
            ``size(dp_cp)``.

    Wrong argument types raise a TypeError naming the argument before anything is built.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        config: DDPConfig | None = None,
        process_groups: ProcessGroups | None = None,
        dp_group: Any = None,
        expert_dp_group: Any = None,
        grad_divisor: int | None = None,
    ) -> None:
        check_arguments(module, config, process_groups, grad_divisor)
        super().__init__()
        config = config or DDPConfig()
        dp_group, expert_dp_group = data_parallel_groups(process_groups, dp_group, expert_dp_group)
        divisor = grad_divisor if grad_divisor is not None else group_size(dp_group)
        self.module = module
        self.config = config
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group
        self.grad_divisor = divisor

        names: dict[int, str] = {}
        trainable: list[nn.Parameter] = []
        for name, p in module.named_parameters():
            if p.requires_grad:
                names[id(p)] = name
                trainable.append(p)
        self.param_names = names
        """``id(param) -> qualified name`` of every parameter in a buffer."""

        def grad_dtype(_: int, p: torch.Tensor) -> torch.dtype:
            if p.dtype == torch.float32 or p.dtype == torch.float64:
                return p.dtype
            # bf16/fp16: fp32 accumulation keeps small micro-batch gradients from rounding away.
            if config.grad_reduce_in_fp32 or self._fp32_rule(names[id(p)], p):
                return torch.float32
            return p.dtype

        self.index_map = ParamIndexMap.build(
            trainable,
            dp_size=group_size(dp_group),
            expert_dp_size=group_size(expert_dp_group),
            bucket_size=config.bucket_size,
            pad_for_dp=config.use_distributed_optimizer,
            grad_dtype=grad_dtype,
            pad_multiple=config.pad_multiple,
        )
        self.buffers: dict[BufferKey, ParamAndGradBuffer] = {}
        for key, layout in self.index_map.buffers.items():
            self.buffers[key] = ParamAndGradBuffer(
                key=key,
                layout=layout,
                params=self.index_map.params[key],
                group=expert_dp_group if key.is_expert else dp_group,
                divisor=divisor if config.average_gradients else None,
                average_in_collective=config.average_in_collective,
                reduce_scatter=config.use_distributed_optimizer,
            )
        self._bucket_of: dict[int, Bucket] = {}
        for buffer in self.buffers.values():
            for bucket in buffer.buckets:
                for p in bucket.params:
                    self._bucket_of[id(p)] = bucket
        self._queues = self._build_queues(trainable)
        self._sync_enabled = True
        self._grads_dirty = False
        self._param_gather_pending = False
        self.grad_sync_launch_log: list[tuple[BufferKey, int]] = []
        """(buffer key, bucket index) of each gradient reduction launched since the last
        :meth:`zero_grad_buffer`, in launch order (for tests and debugging)."""
        for q in self._queues:
            q.launch_log = self.grad_sync_launch_log
        self.param_gather_log: list[tuple[str, BufferKey, int]] = []
        """``("launch" | "wait", buffer key, bucket index)`` of each asynchronous parameter
        all-gather launched (:meth:`start_param_sync` with overlap) and each wait for one (a
        forward pre-hook, or :meth:`finish_param_sync`) since the last
        :meth:`zero_grad_buffer`, in order (for tests and debugging)."""
        hook = self._make_hook()
        self._hooks = [p.register_post_accumulate_grad_hook(hook) for p in trainable]
        if config.use_distributed_optimizer:
            for submodule in module.modules():
                if any(p.requires_grad for p in submodule.parameters(recurse=False)):
                    self._hooks.append(submodule.register_forward_pre_hook(self._wait_params))

    # ------------------------------------------------------------------ construction helpers
    def _fp32_rule(self, name: str, p: torch.Tensor) -> bool:
        rule = self.config.fp32_grad_params
        if callable(rule):
            return bool(rule(name, p))
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in rule)

    def _build_queues(self, trainable: list[nn.Parameter]) -> list[LaunchQueue]:
        order = {id(p): i for i, p in enumerate(trainable)}
        by_group: dict[int, list[Bucket]] = {}
        for key in sorted(self.buffers):
            for bucket in self.buffers[key].buckets:
                by_group.setdefault(id(bucket.group), []).append(bucket)
        queues = []
        for buckets in by_group.values():
            # A bucket is complete when its earliest-registered parameter gets its gradient.
            buckets.sort(key=lambda b: (-min(order[id(p)] for p in b.params), b.key, b.index))
            queues.append(LaunchQueue(buckets))
        return queues

    def _make_hook(self) -> Callable[[torch.Tensor], None]:
        """The post-accumulate-grad hook of every trainable parameter.

        Autograd keeps a parameter's hooks in its C++ metadata, where Python's collector cannot
        see them: a hook holding this wrapper (or the parameter, or a bucket listing it) would
        close a cycle the collector cannot break, and the model, its buffers and its process
        groups (each with its gloo sockets and threads) would live as long as the process. So
        the hook holds a weak reference to the wrapper only, and gets the parameter as its
        argument; once the wrapper is gone it does nothing."""
        wrapper = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            ddp = wrapper()
            if ddp is not None:
                ddp._gradient_ready(param)

        return hook

    def _gradient_ready(self, param: torch.Tensor) -> None:
        """Fold ``param.grad`` into its ``main_grad`` and, with overlap, launch the buckets
        that became complete."""
        bucket = self._bucket_of[id(param)]
        if bucket.grad_launched or bucket.marked_ready(param):
            raise RuntimeError(self._late_gradient_message(param, bucket.grad_launched))
        if param.grad is not None:
            # Fold into the flat accumulator and free p.grad: one gradient copy per parameter.
            param.main_grad.add_(param.grad)
            param.grad = None
        self._grads_dirty = True
        # Under no_sync nothing is marked ready; finish_grad_sync launches every bucket at the end.
        overlap = self._sync_enabled and self.config.overlap_grad_reduce
        if overlap and bucket.mark_ready(param):
            for q in self._queues:
                q.launch_ready()

    def _late_gradient_message(self, param: nn.Parameter, launched: bool) -> str:
        what = (
            "after its bucket's reduction was launched"
            if launched
            else "after it was already marked ready for reduction"
        )
        return (
            f"DistributedDataParallel: a gradient for parameter {self.param_names[id(param)]!r} "
            f"arrived {what} in this iteration (a second backward without no_sync()?); adding it "
            "now would make the reduced gradient wrong. Run every backward of an iteration but "
            "the last inside ddp.no_sync() (gradient accumulation), or finish the iteration "
            "first: finish_grad_sync() or the optimizer's step(), then zero_grad() "
            "(ddp.zero_grad_buffer()) before the next backward"
        )

    def _wait_params(self, module: nn.Module, _args: Any) -> None:
        if not self._param_gather_pending:
            return
        for p in module.parameters(recurse=False):
            bucket = self._bucket_of.get(id(p))
            if bucket is not None and bucket.finish_param_sync():
                self.param_gather_log.append(("wait", bucket.key, bucket.index))

    # ------------------------------------------------------------------ public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict (no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Load into the wrapped module (values are copied into the parameter buffers)."""
        return self.module.load_state_dict(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without reducing them (all micro-batches but the last)."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Launch every bucket reduction not yet launched, in the fixed order."""
        for q in self._queues:
            q.launch_all()

    def finish_grad_sync(self) -> None:
        """Launch what is left and wait for every reduction; afterwards ``main_grad`` holds the
        reduced gradient (all of it with all-reduce; this rank's shard with reduce-scatter)."""
        self.start_grad_sync()
        for buffer in self.buffers.values():
            for bucket in buffer.buckets:
                bucket.finish_grad_sync()
        self._grads_dirty = False

    @property
    def grads_need_sync(self) -> bool:
        """True when gradients were accumulated but :meth:`finish_grad_sync` has not run since."""
        return self._grads_dirty

    def remove_hooks(self) -> None:
        """Detach this wrapper from its module: gradients are no longer folded or reduced, and
        backward leaves plain ``p.grad`` as without the wrapper. (Dropping the wrapper and the
        module frees both without it: the hooks hold the wrapper weakly, see `_make_hook`.)"""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def zero_grad_buffer(self) -> None:
        """Zero every ``main_grad`` and reset bucket readiness (start of an iteration)."""
        for buffer in self.buffers.values():
            for bucket in buffer.buckets:
                # A reduction still in flight would write into the buffer after it is zeroed.
                bucket.finish_grad_sync()
            buffer.zero_grad()
        for q in self._queues:
            q.reset()
        for buffer in self.buffers.values():
            for p in buffer.params:
                p.grad = None
        self.grad_sync_launch_log.clear()
        self.param_gather_log.clear()
        self._grads_dirty = False

    def start_param_sync(self, *, overlap: bool, expert: bool | None = None) -> None:
        """All-gather updated parameter shards (distributed optimizer). With ``overlap`` the
        gathers are asynchronous, issued in forward order, and each module waits for its own
        buckets in a forward pre-hook; otherwise this returns when all are done.
        ``expert`` limits it to expert (True) or dense (False) buffers."""
        if not self.config.use_distributed_optimizer:
            return
        for q in self._queues:
            for bucket in reversed(q.buckets):  # forward order: first layers first
                if expert is not None and bucket.key.is_expert != expert:
                    continue
                if bucket.start_param_sync(async_op=overlap):
                    self.param_gather_log.append(("launch", bucket.key, bucket.index))
        self._param_gather_pending = self._param_gather_pending or overlap

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather."""
        for buffer in self.buffers.values():
            for bucket in buffer.buckets:
                if bucket.finish_param_sync():
                    self.param_gather_log.append(("wait", bucket.key, bucket.index))
        self._param_gather_pending = False

    def broadcast_params(self) -> None:
        """Copy every parameter from the first rank of its data-parallel group (call once
        after construction if ranks initialised their models differently)."""
        for buffer in self.buffers.values():
            if buffer.group is not None and group_size(buffer.group) > 1:
                # broadcast's src is a global rank, not a rank within the group.
                src = dist.get_global_rank(buffer.group, 0)
                dist.broadcast(buffer.param_data, src=src, group=buffer.group)

    def buffer_params(self) -> list[nn.Parameter]:
        """Every parameter in a buffer (trainable), in registration order."""
        return [p for p in self.module.parameters() if id(p) in self.param_names]
