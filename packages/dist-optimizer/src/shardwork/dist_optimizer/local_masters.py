"""What the two distributed optimizers share: a local optimizer over this rank's masters.

:class:`~shardwork.dist_optimizer.distributed_optimizer.DistributedOptimizer` (ZeRO-1
shards of flat buffers) and
:class:`~shardwork.dist_optimizer.layerwise.LayerWiseDistributedOptimizer` (whole
parameters on owner ranks) differ in which masters a rank holds, how its gradients arrive
and how updated values reach the other ranks. Everything else is here: checking the model
chunks, resolving the process groups, grouping the masters by ``param_group_fn`` for the
local optimizer, the gradient statistics and scaling :func:`~.step_flow.run_step` calls,
and the public step/inspection API.

A subclass provides ``masters`` (objects with ``.master`` — the fp32/fp64 tensor the local
optimizer updates, whose ``.grad`` holds the unscaled gradient after ``prepare_grads`` —
and ``.counted`` — whether it counts toward the global norm), and implements
``prepare_grads`` (gradients in, divided by the loss scale), ``finish_step`` (masters out
to the parameters of every rank, possibly asynchronously), ``finish_param_sync`` (wait for
that) and ``zero_grad``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwork.dist_optimizer.ddp import DistributedDataParallel
from shardwork.dist_optimizer.grad_stats import grad_stats
from shardwork.dist_optimizer.optimizer_groups import group_ranks, resolve_optimizer_groups
from shardwork.dist_optimizer.sharded_state import (
    load_optimizer_sharded_state_dict,
    optimizer_sharded_state_dict,
)
from shardwork.dist_optimizer.step_flow import StepResult, run_step
from shardwork.dist_optimizer.validation import (
    check_bool,
    check_loss_scaler,
    check_process_groups,
    check_real,
    check_type,
    short_repr,
    with_article,
)
from shardwork.parallel_state import ProcessGroups, group_rank

__all__ = [
    "LocalMastersOptimizer",
    "OptimizerConfig",
    "OptimizerFactory",
    "as_models",
    "check_optimizer_options",
    "group_ranks",
]

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
ParamGroupFn = Callable[[str, torch.nn.Parameter], Mapping[str, Any] | None]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Options shared by the distributed optimizers."""

    clip_grad: float = 0.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    overlap_param_gather: bool = False
    """All-gather parameters asynchronously, each module waiting in its forward pre-hook."""
    skip_nonfinite: bool = True
    """Skip the step on every rank when any gradient element is inf or nan."""
    count_zeros: bool = False
    """Count zero gradient elements (costs one comparison per element)."""

    def __post_init__(self) -> None:
        """Check every field: a bool given as ``"False"`` would silently act as True."""
        # Infinity is allowed: it never clips, like 0.
        check_real("OptimizerConfig.clip_grad", self.clip_grad, at_least=0, finite=False)
        for name in ("overlap_param_gather", "skip_nonfinite", "count_zeros"):
            check_bool(f"OptimizerConfig.{name}", getattr(self, name))


def as_models(model: Any, wrapper: type = DistributedDataParallel) -> list[Any]:
    """The model chunks an optimizer was given (one, or a list per virtual pipeline chunk) as a
    list, checked: each a ``wrapper`` (default `DistributedDataParallel`), none twice
    (ValueError naming the index). Shared by the optimizers and `build_optimizer`, which both
    take either form."""
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    seen: set[int] = set()
    for i, m in enumerate(models):
        if not isinstance(m, wrapper):
            raise ValueError(
                f"model[{i}] is a {type(m).__name__}; valid: a {wrapper.__name__} "
                "(or a list of them, one per virtual pipeline chunk)"
            )
        if id(m) in seen:
            raise ValueError(f"model[{i}] appears twice; valid: each model chunk once")
        seen.add(id(m))
    return models


def check_optimizer_options(owner: str, config: Any, loss_scaler: Any) -> None:
    """TypeError for a ``config`` that is not an :class:`OptimizerConfig` or a ``loss_scaler``
    that lacks what :func:`run_step` and the checkpoint methods call (both would otherwise
    fail only at the first step or save). Shared by the optimizers and the chain."""
    check_type(
        f"{owner}: config",
        config,
        OptimizerConfig,
        "e.g. OptimizerConfig(clip_grad=1.0), or OptimizerConfig(**d) for a dict d of its fields",
    )
    check_loss_scaler(f"{owner}: loss_scaler", loss_scaler)


class LocalMastersOptimizer(ABC):
    """Base of the distributed optimizers (see the module docstring).

    ``sharded_grads``: whether the DDP chunks must reduce-scatter their gradients
    (``DDPConfig.use_distributed_optimizer=True``) or all-reduce them (False); ``why`` ends
    the error raised for a chunk built the other way. ``wrapper``: the class the chunks must
    be (a subclass for FSDP chunks passes ``sharded_grads=None``: they have no DDP config).
    Other arguments as documented on the subclasses.
    """

    wrapper: type = DistributedDataParallel

    @property
    @abstractmethod
    def masters(self) -> Sequence[Any]:
        """This rank's master records (``.name``, ``.param``, ``.master``, ``.counted``)."""

    @abstractmethod
    def prepare_grads(self, inv_scale: float) -> None:
        """Finish gradient reduction; master grads hold the gradient times ``inv_scale``."""

    @abstractmethod
    def finish_step(self) -> None:
        """Write masters back into the parameters and start publishing them to every rank."""

    @abstractmethod
    def finish_param_sync(self) -> None:
        """Wait until the parameters published by :meth:`finish_step` have arrived."""

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the models' gradient buffers and drop master grads that are copies."""

    @abstractmethod
    def master_ranges(self) -> Iterator[tuple[str, torch.nn.Parameter, torch.Tensor, int, int]]:
        """``(name, param, master, a, b)`` per master: it holds elements ``[a, b)`` of the
        row-major flattening of the (TP-local) parameter (what checkpoints place)."""

    def __init__(
        self,
        model: DistributedDataParallel | Sequence[DistributedDataParallel],
        *,
        expert: bool,
        config: OptimizerConfig | None,
        process_groups: ProcessGroups | None,
        tp_group: Any,
        stats_groups: Sequence[Any] | None,
        pp_rank: int | None,
        loss_scaler: Any,
        sharded_grads: bool | None,
        why: str,
    ) -> None:
        check_optimizer_options(type(self).__name__, config, loss_scaler)
        check_process_groups(f"{type(self).__name__}: process_groups", process_groups)
        self.models = as_models(model, self.wrapper)
        self.config = config or OptimizerConfig()
        self.expert = expert
        for i, m in enumerate(self.models):
            if sharded_grads is not None and m.config.use_distributed_optimizer != sharded_grads:
                raise ValueError(
                    f"model[{i}] was built with DDPConfig(use_distributed_optimizer="
                    f"{m.config.use_distributed_optimizer}); valid: {sharded_grads} ({why})"
                )
        resolved = resolve_optimizer_groups(
            self.models,
            expert=expert,
            process_groups=process_groups,
            tp_group=tp_group,
            stats_groups=stats_groups,
            pp_rank=pp_rank,
        )
        self.dp_group = resolved.dp_group
        self.tp_group = resolved.tp_group
        self.stats_groups = resolved.stats_groups
        self.pp_rank = resolved.pp_rank
        self.collision_axes = resolved.collision_axes
        """Parallel axes whose ranks hold different parameters under possibly equal local
        names: saving then needs ``param_rects`` with global keys."""
        self.loss_scaler = loss_scaler
        self._tp_rank = group_rank(self.tp_group)
        self.optimizer: torch.optim.Optimizer | None = None
        self.last_result: StepResult | None = None

    def _counted(self, meta: Any) -> bool:
        """Whether a parameter with ``meta`` counts toward the global norm on this rank: TP
        replicas on TP rank 0 only, the shared embedding on the first pipeline stage only."""
        # Each TP rank holds a replica of an unsplit parameter and each of the two stages a copy of
        # the shared embedding; the norm counts one of them.
        return (meta.tp_axis is not None or self._tp_rank == 0) and (
            not meta.shared_embedding or self.pp_rank == 0
        )

    def _build_optimizer(
        self, optimizer_factory: OptimizerFactory, param_group_fn: ParamGroupFn | None
    ) -> None:
        """The local optimizer over ``self.masters`` (None when this rank holds none), one
        param group per distinct ``param_group_fn`` override dict. TypeError for a factory
        that is not callable (on every rank) or that returns no torch optimizer (on a rank
        with masters: one without never calls it)."""
        if not callable(optimizer_factory):
            raise TypeError(
                f"{type(self).__name__}: optimizer_factory={short_repr(optimizer_factory, 60)} "
                f"is {with_article(type(optimizer_factory).__name__)}, not callable; valid: a "
                "function from a list of param-group dicts to the optimizer over them, e.g. "
                "lambda groups: torch.optim.AdamW(groups, lr=1e-3) (not an optimizer itself)"
            )
        if not self.masters:
            return
        grouped: dict[tuple, dict[str, Any]] = {}
        for owned in self.masters:
            overrides = (
                dict(param_group_fn(owned.name, owned.param) or {}) if param_group_fn else {}
            )
            # repr: override values need not be hashable (e.g. a list of betas).
            signature = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
            grouped.setdefault(signature, {"params": [], **overrides})["params"].append(
                owned.master
            )
        optimizer = optimizer_factory(list(grouped.values()))
        self._check_built(optimizer)
        self.optimizer = optimizer

    def _check_built(self, optimizer: Any) -> None:
        """TypeError unless the factory returned a torch optimizer, ValueError unless it covers
        exactly this rank's masters (a master left out would never be updated)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"{type(self).__name__}: optimizer_factory returned {short_repr(optimizer, 60)} "
                f"({with_article(type(optimizer).__name__)}); valid: a torch.optim.Optimizer "
                "built over the param groups it is given (did the function forget to return it?)"
            )
        built = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if built != {id(owned.master) for owned in self.masters}:
            raise ValueError(
                "optimizer_factory must build an optimizer over exactly the param groups it "
                "is given (this rank's masters)"
            )

    # ------------------------------------------------------------------ step phases
    def local_grad_stats(self, count_zeros: bool = True) -> torch.Tensor:
        """``[pieces with a non-finite value, Σg², zero count]`` over this rank's master grads
        (Σg² and zeros over counted masters only; see :func:`grad_stats.grad_stats`)."""
        return grad_stats(
            [owned.master.grad for owned in self.masters],
            [owned.counted for owned in self.masters],
            count_zeros=count_zeros,
        )

    def scale_grads(self, factor: float) -> None:
        for owned in self.masters:
            owned.master.grad.mul_(factor)

    def step_local(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    # ------------------------------------------------------------------ public API
    def step(self) -> StepResult:
        """Reduce, (clip,) update and publish; returns ``(update_successful, grad_norm,
        num_zeros)``."""
        self.last_result = run_step(
            [self],
            clip_grad=self.config.clip_grad,
            loss_scaler=self.loss_scaler,
            skip_nonfinite=self.config.skip_nonfinite,
            count_zeros=self.config.count_zeros,
        )
        return self.last_result

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The local optimizer's param groups (set ``"lr"`` here); empty on a rank with no
        masters."""
        return self.optimizer.param_groups if self.optimizer is not None else []

    @property
    def loss_scale(self) -> float:
        """Multiply the loss by this before backward (1.0 without a loss scaler)."""
        return 1.0 if self.loss_scaler is None else float(self.loss_scaler.scale)

    def get_grad_norm(self) -> float | None:
        """Global gradient norm of the last step (None before a step or after a skipped one)."""
        return None if self.last_result is None else self.last_result.grad_norm

    def state_numel(self) -> int:
        """Elements of optimizer state tensors held by this rank (for memory accounting)."""
        if self.optimizer is None:
            return 0
        return sum(
            v.numel()
            for s in self.optimizer.state.values()
            for v in s.values()
            # dim() > 0 leaves out scalar state such as a step counter.
            if torch.is_tensor(v) and v.dim() > 0
        )

    def sharded_state_dict(self, **kwargs: Any) -> dict[str, Any]:
        """Optimizer state (masters and per-element states) in global parameter coordinates,
        as dist-checkpoint ``ShardedTensor`` s; ``kwargs``: ``prefix``, ``param_rects`` (see
        :mod:`.sharded_state`)."""
        return optimizer_sharded_state_dict(self, **kwargs)

    def load_sharded_state_dict(self, state: Mapping[str, Any], **kwargs: Any) -> None:
        """Restore from a state dict loaded from the template :meth:`sharded_state_dict` gave,
        and publish the restored masters to the model parameters."""
        load_optimizer_sharded_state_dict(self, state, **kwargs)
