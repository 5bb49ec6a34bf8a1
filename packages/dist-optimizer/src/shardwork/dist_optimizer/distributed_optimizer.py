"""``DistributedOptimizer``: ZeRO-1 — each data-parallel rank updates only its shard.

- Works on the buffers of one or more :class:`DistributedDataParallel` chunks built with
  ``use_distributed_optimizer=True``: either their dense buffers (sharded over dp×cp) or
  their expert buffers (sharded over edp, ``expert=True``).
- For every (parameter ∩ this rank's shard) piece (see :class:`ParamIndexMap`) it keeps an
  fp32 master: for fp32 parameters the master *is* the shard view of the parameter buffer
  (no copy), for bf16/fp16 parameters it is an fp32 copy. The master's ``.grad`` is the
  shard view of the gradient buffer when that is fp32 (no copy). Any per-element torch
  optimizer (``torch.optim.AdamW``, :class:`shardwork.dist_optimizer.AdamW` with bf16
  moments, SGD...) is built by ``optimizer_factory`` over these masters only, so optimizer
  state exists for this rank's shard only: 12 bytes/param/DP for fp32 masters + Adam.
- :meth:`step`: finish the reduce-scatter, unscale, check for inf/nan on every rank, global
  norm and clipping, local step, write masters back into the parameter buffer, all-gather
  each bucket (asynchronously, waited for by forward pre-hooks when ``overlap_param_gather``).
- State for checkpoints: :meth:`sharded_state_dict` (global coordinates, see
  :mod:`shardwork.dist_optimizer.sharded_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardwork.dist_optimizer.ddp import DistributedDataParallel
from shardwork.dist_optimizer.grad_stats import grad_stats
from shardwork.dist_optimizer.layout import BufferKey, ShardPiece
from shardwork.dist_optimizer.optimizer_groups import resolve_optimizer_groups
from shardwork.dist_optimizer.step_flow import StepResult, run_step
from shardwork.parallel_state import ProcessGroups, get_param_meta, group_rank

__all__ = ["DistributedOptimizer", "MasterPiece", "OptimizerConfig", "group_ranks"]

OptimizerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


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
        if not self.clip_grad >= 0:
            raise ValueError(f"OptimizerConfig.clip_grad={self.clip_grad}; valid: >= 0 (0 = off)")


@dataclass
class MasterPiece:
    """One parameter's slice of this rank's shard, with its fp32 master."""

    name: str
    param: torch.nn.Parameter
    key: BufferKey
    piece: ShardPiece
    master: torch.Tensor
    """1-D master weights (fp32, or the parameter's own fp32/fp64 buffer view)."""
    grad_view: torch.Tensor
    """1-D view of the reduced gradient in the gradient buffer."""
    param_view: torch.Tensor
    """1-D view of the same range in the parameter buffer."""
    counted: bool
    """Counts toward the global norm (not a TP replica / second embedding copy)."""

    @property
    def master_is_view(self) -> bool:
        return self.master.data_ptr() == self.param_view.data_ptr()


def group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of ``group`` (``(this rank,)`` or ``(0,)`` for None)."""
    if group is None:
        return (dist.get_rank(),) if dist.is_initialized() else (0,)
    return tuple(dist.get_process_group_ranks(group))


def _as_models(model: Any) -> list[DistributedDataParallel]:
    models = list(model) if isinstance(model, (list, tuple)) else [model]
    seen: set[int] = set()
    for i, m in enumerate(models):
        if not isinstance(m, DistributedDataParallel):
            raise ValueError(
                f"model[{i}] is a {type(m).__name__}; valid: a DistributedDataParallel "
                "(or a list of them, one per virtual pipeline chunk)"
            )
        if id(m) in seen:
            raise ValueError(f"model[{i}] appears twice; valid: each model chunk once")
        seen.add(id(m))
    return models


class DistributedOptimizer:
    """ZeRO-1 optimizer over the dense (or expert) buffers of DDP model chunks.

    Args:
        model: a :class:`DistributedDataParallel` (``use_distributed_optimizer=True``) or a
            list of them (virtual pipeline chunks).
        optimizer_factory: builds the local optimizer from param-group dicts
            (``{"params": [masters], **overrides}``), e.g.
            ``lambda groups: torch.optim.AdamW(groups, lr=1e-3)``.
        expert: own the expert buffers (sharded over edp) instead of the dense ones.
        config: :class:`OptimizerConfig`.
        process_groups: bundle to take tp/etp, pp rank and stats groups from (and to check
            the model's data-parallel group against).
        tp_group: group over which TP-split parameters are split (``etp`` for experts); a
            parameter with ``tp_axis=None`` is counted in the norm on its rank 0 only.
        stats_groups: groups whose product spans every rank holding these parameters; the
            norm/inf/zero statistics are summed over each in turn. Default with a bundle:
            ``(dp_cp, mp)`` (dense) or ``(edp, expert_mp)`` (expert); without: ``(dp, tp)``.
        pp_rank: pipeline stage (shared embedding counted on stage 0 only).
        param_group_fn: ``(name, param) -> dict | None`` of per-parameter overrides (e.g.
            ``{"weight_decay": 0.0}``); parameters with equal overrides share a param group.
        loss_scaler: a :class:`DynamicLossScaler` / :class:`ConstantLossScaler` (fp16), or None.
    """

    def __init__(
        self,
        model: DistributedDataParallel | Sequence[DistributedDataParallel],
        optimizer_factory: OptimizerFactory,
        *,
        expert: bool = False,
        config: OptimizerConfig | None = None,
        process_groups: ProcessGroups | None = None,
        tp_group: Any = None,
        stats_groups: Sequence[Any] | None = None,
        pp_rank: int | None = None,
        param_group_fn: Callable[[str, torch.nn.Parameter], Mapping[str, Any] | None] | None = None,
        loss_scaler: Any = None,
    ) -> None:
        self.models = _as_models(model)
        self.config = config or OptimizerConfig()
        self.expert = expert
        for i, m in enumerate(self.models):
            if not m.config.use_distributed_optimizer:
                raise ValueError(
                    f"model[{i}] was built with DDPConfig(use_distributed_optimizer=False); "
                    "valid: True, so gradients are reduce-scattered into shards"
                )
        resolved = resolve_optimizer_groups(
            self.models,
            expert=expert,
            process_groups=process_groups,
            tp_group=tp_group,
            stats_groups=stats_groups,
            pp_rank=pp_rank,
        )
        self.dp_group, tp_group = resolved.dp_group, resolved.tp_group
        self.tp_group = tp_group
        self.stats_groups = resolved.stats_groups
        self.pp_rank = resolved.pp_rank
        self.collision_axes = resolved.collision_axes
        """Parallel axes whose ranks hold different parameters under possibly equal local
        names: saving then needs ``param_rects`` with global keys."""
        self.loss_scaler = loss_scaler
        tp_rank = group_rank(tp_group)

        self.pieces: list[MasterPiece] = []
        for m in self.models:
            for key, buffer in m.buffers.items():
                if key.is_expert != expert:
                    continue
                dp_rank = group_rank(buffer.group)
                for piece in buffer.layout.shard_pieces(dp_rank):
                    p = buffer.params[piece.param_index]
                    meta = get_param_meta(p)
                    pv = buffer.param_data[piece.buffer_start : piece.buffer_end]
                    gv = buffer.grad_data[piece.buffer_start : piece.buffer_end]
                    if pv.dtype in (torch.float32, torch.float64):
                        master = pv
                    else:
                        master = pv.detach().to(torch.float32, copy=True)
                    if gv.dtype == master.dtype:
                        master.grad = gv
                    counted = (meta.tp_axis is not None or tp_rank == 0) and (
                        not meta.shared_embedding or self.pp_rank == 0
                    )
                    name = m.param_names[id(p)]
                    self.pieces.append(MasterPiece(name, p, key, piece, master, gv, pv, counted))

        grouped: dict[tuple, dict[str, Any]] = {}
        for mp in self.pieces:
            overrides = dict(param_group_fn(mp.name, mp.param) or {}) if param_group_fn else {}
            signature = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
            grouped.setdefault(signature, {"params": [], **overrides})["params"].append(mp.master)
        self.optimizer: torch.optim.Optimizer | None = None
        if self.pieces:
            self.optimizer = optimizer_factory(list(grouped.values()))
            owned = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
            if owned != {id(mp.master) for mp in self.pieces}:
                raise ValueError(
                    "optimizer_factory must build an optimizer over exactly the param groups it "
                    "is given (the master shards)"
                )
        self.last_result: StepResult | None = None

    # ------------------------------------------------------------------ step phases
    def prepare_grads(self, inv_scale: float) -> None:
        """Finish gradient reduction and fill fp32 master gradients divided by the loss scale."""
        for m in self.models:
            m.finish_param_sync()
            m.finish_grad_sync()
        for mp in self.pieces:
            if mp.master.grad is None or mp.master.grad.data_ptr() != mp.grad_view.data_ptr():
                mp.master.grad = mp.grad_view.to(mp.master.dtype, copy=True)
            if inv_scale != 1.0:
                mp.master.grad.mul_(inv_scale)

    def local_grad_stats(self, count_zeros: bool = True) -> torch.Tensor:
        """``[pieces with a non-finite value, Σg², zero count]`` over this rank's master grads
        (Σg² and zeros over counted pieces only; see :func:`grad_stats.grad_stats`)."""
        return grad_stats(
            [mp.master.grad for mp in self.pieces],
            [mp.counted for mp in self.pieces],
            count_zeros=count_zeros,
        )

    def scale_grads(self, factor: float) -> None:
        for mp in self.pieces:
            mp.master.grad.mul_(factor)

    def step_local(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

    def finish_step(self) -> None:
        """Write masters back into the parameter buffer and start the all-gather."""
        with torch.no_grad():
            for mp in self.pieces:
                if not mp.master_is_view:
                    mp.param_view.copy_(mp.master)
        for m in self.models:
            m.start_param_sync(overlap=self.config.overlap_param_gather, expert=self.expert)

    # ------------------------------------------------------------------ public API
    def step(self) -> StepResult:
        """Reduce, (clip,) update and gather; returns ``(update_successful, grad_norm, num_zeros)``."""
        self.last_result = run_step(
            [self],
            clip_grad=self.config.clip_grad,
            loss_scaler=self.loss_scaler,
            skip_nonfinite=self.config.skip_nonfinite,
            count_zeros=self.config.count_zeros,
        )
        return self.last_result

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the models' gradient buffers (and drop copied master grads)."""
        for m in self.models:
            m.zero_grad_buffer()
        for mp in self.pieces:
            if mp.master.grad is not None and mp.master.grad.data_ptr() != mp.grad_view.data_ptr():
                mp.master.grad = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The local optimizer's param groups (set ``"lr"`` here); empty on a rank with no shard."""
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
            if torch.is_tensor(v) and v.dim() > 0
        )

    def sharded_state_dict(self, **kwargs: Any) -> dict[str, Any]:
        """Optimizer state in global parameter coordinates (see :mod:`.sharded_state`)."""
        from shardwork.dist_optimizer.sharded_state import zero_sharded_state_dict

        return zero_sharded_state_dict(self, **kwargs)

    def load_sharded_state_dict(self, state: Mapping[str, Any], **kwargs: Any) -> None:
        """Restore from a state dict loaded from the template :meth:`sharded_state_dict` gave."""
        from shardwork.dist_optimizer.sharded_state import load_zero_sharded_state_dict

        load_zero_sharded_state_dict(self, state, **kwargs)
