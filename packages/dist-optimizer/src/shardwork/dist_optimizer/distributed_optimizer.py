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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwork.dist_optimizer.ddp import DistributedDataParallel
from shardwork.dist_optimizer.layout import BufferKey, ShardPiece
from shardwork.dist_optimizer.local_masters import (
    LocalMastersOptimizer,
    OptimizerConfig,
    OptimizerFactory,
    ParamGroupFn,
)
from shardwork.parallel_state import ProcessGroups, get_param_meta, group_rank

__all__ = ["DistributedOptimizer", "MasterPiece", "OptimizerConfig"]


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


class DistributedOptimizer(LocalMastersOptimizer):
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
        loss_scaler: a :class:`DynamicLossScaler` / :class:`ConstantLossScaler` (fp16), any
            object with a real ``.scale`` and ``update``, ``state_dict``, ``load_state_dict``
            methods, or None.

    Wrong argument types raise a TypeError naming the argument at construction.
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
        param_group_fn: ParamGroupFn | None = None,
        loss_scaler: Any = None,
    ) -> None:
        super().__init__(
            model,
            expert=expert,
            config=config,
            process_groups=process_groups,
            tp_group=tp_group,
            stats_groups=stats_groups,
            pp_rank=pp_rank,
            loss_scaler=loss_scaler,
            sharded_grads=True,
            why="gradients are reduce-scattered into shards",
        )
        self.pieces: list[MasterPiece] = []
        for m in self.models:
            for key, buffer in m.buffers.items():
                if key.is_expert != expert:
                    continue
                dp_rank = group_rank(buffer.group)
                for piece in buffer.layout.shard_pieces(dp_rank):
                    p = buffer.params[piece.param_index]
                    pv = buffer.param_data[piece.buffer_start : piece.buffer_end]
                    gv = buffer.grad_data[piece.buffer_start : piece.buffer_end]
                    if pv.dtype in (torch.float32, torch.float64):
                        # fp32/fp64 parameters: the master is the shard view itself; the update
                        # lands in place.
                        master = pv
                    else:
                        # bf16/fp16 parameters: an fp32 copy, so updates below the bf16/fp16 spacing
                        # accumulate instead of rounding away (mixed-precision master weights).
                        master = pv.detach().to(torch.float32, copy=True)
                    if gv.dtype == master.dtype:
                        # Gradient buffer already in the master's dtype: .grad aliases the reduced
                        # shard (no copy).
                        master.grad = gv
                    counted = self._counted(get_param_meta(p))
                    name = m.param_names[id(p)]
                    self.pieces.append(MasterPiece(name, p, key, piece, master, gv, pv, counted))
        self._build_optimizer(optimizer_factory, param_group_fn)

    @property
    def masters(self) -> list[MasterPiece]:
        return self.pieces

    def master_ranges(self):
        for mp in self.pieces:
            yield mp.name, mp.param, mp.master, mp.piece.param_start, mp.piece.param_end

    # ------------------------------------------------------------------ step phases
    def prepare_grads(self, inv_scale: float) -> None:
        """Finish gradient reduction and fill fp32 master gradients divided by the loss scale."""
        # The previous step's parameter all-gather writes the buffer the masters read and write.
        self.finish_param_sync()
        for m in self.models:
            m.finish_grad_sync()
        for mp in self.pieces:
            # Gradient buffer in another dtype (or the copy dropped by zero_grad): copy into the
            # master's.
            if mp.master.grad is None or mp.master.grad.data_ptr() != mp.grad_view.data_ptr():
                mp.master.grad = mp.grad_view.to(mp.master.dtype, copy=True)
            if inv_scale != 1.0:
                mp.master.grad.mul_(inv_scale)

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter all-gather of the model chunks."""
        for m in self.models:
            m.finish_param_sync()

    def finish_step(self) -> None:
        """Write masters back into the parameter buffer and start the all-gather."""
        with torch.no_grad():
            for mp in self.pieces:
                if not mp.master_is_view:
                    # Copies are rounded back into the parameter dtype before the shards are
                    # gathered.
                    mp.param_view.copy_(mp.master)
        for m in self.models:
            m.start_param_sync(overlap=self.config.overlap_param_gather, expert=self.expert)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the models' gradient buffers (and drop copied master grads)."""
        for m in self.models:
            m.zero_grad_buffer()
        for mp in self.pieces:
            # Only copies are dropped; an aliased .grad is the gradient buffer, zeroed above.
            if mp.master.grad is not None and mp.master.grad.data_ptr() != mp.grad_view.data_ptr():
                mp.master.grad = None
