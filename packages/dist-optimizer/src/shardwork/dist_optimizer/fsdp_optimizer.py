"""``FSDPOptimizer``: the local optimizer over the rows FSDP gives this rank.

- For every dense (or expert) parameter of the
  :class:`~shardwork.dist_optimizer.fsdp.FullyShardedDataParallel` chunks, this rank's rows
  ``[start, stop)`` of the TP-local parameter are a contiguous flat range ``[start·w, stop·w)``
  (``w`` = elements per row), so masters, statistics and checkpoints work as for a ZeRO-1
  piece. The master is the local shard itself (a 1-D view) for fp32/fp64 parameters — under
  ``FSDPConfig(param_dtype=bf16)`` the sharded parameters are the fp32 masters and only the
  gathered copies are bf16 — and an fp32 copy for bf16/fp16 sharded parameters.
- Gradients arrive reduce-scattered by FSDP; :meth:`prepare_grads` points each master's
  ``.grad`` at the local gradient rows (or copies them into the master's dtype).
- Statistics, clipping, the inf/nan skip and the loss scale are the base class's
  (:func:`~.step_flow.run_step`), so it chains with other parts like the ZeRO optimizer.
  Nothing is gathered after the step: the next forward's FSDP all-gather reads the updated
  shards.
- Optimizers that need whole matrices cannot run on row shards: a local optimizer that is
  :class:`~shardwork.dist_optimizer.muon.Muon` is refused when it is built (ValueError).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shardwork.dist_optimizer.fsdp import FullyShardedDataParallel
from shardwork.dist_optimizer.local_masters import (
    LocalMastersOptimizer,
    OptimizerConfig,
    OptimizerFactory,
    ParamGroupFn,
)
from shardwork.dist_optimizer.muon import Muon
from shardwork.parallel_state import ProcessGroups, get_param_meta, row_shard

__all__ = ["FSDPOptimizer", "RowMaster"]


@dataclass
class RowMaster:
    """This rank's rows of one sharded parameter, with their master."""

    name: str
    param: torch.nn.Parameter
    """The sharded (DTensor) parameter."""
    local: torch.Tensor
    """1-D view of the local rows in the parameter's own storage."""
    master: torch.Tensor
    """1-D master weights (``local`` itself for fp32/fp64, else an fp32 copy)."""
    param_start: int
    """First element (row-major, TP-local parameter) of the local rows."""
    param_end: int
    counted: bool
    """Counts toward the global norm (not a TP replica / second embedding copy)."""

    @property
    def master_is_view(self) -> bool:
        return self.master.data_ptr() == self.local.data_ptr()


class FSDPOptimizer(LocalMastersOptimizer):
    """Optimizer over FSDP row shards; arguments as
    :class:`~shardwork.dist_optimizer.DistributedOptimizer` with
    :class:`FullyShardedDataParallel` chunks instead of DDP ones (``overlap_param_gather`` has
    no effect: FSDP gathers in the next forward)."""

    wrapper = FullyShardedDataParallel

    def __init__(
        self,
        model: FullyShardedDataParallel | Sequence[FullyShardedDataParallel],
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
            sharded_grads=None,
            why="",
        )
        self.pieces: list[RowMaster] = []
        for m in self.models:
            for name, p in m.sharded_params(expert=expert):
                rows = row_shard(p)
                assert rows is not None, name  # every parameter of the wrapper is sharded
                if rows.stop == rows.start:
                    continue  # a trailing rank of a parameter with fewer rows than ranks
                width = math.prod(p.shape[1:])
                local = rows.local.view(-1)
                if local.dtype in (torch.float32, torch.float64):
                    master = local
                else:
                    # bf16/fp16 shards: an fp32 copy, so small updates accumulate instead of
                    # rounding away (mixed-precision master weights).
                    master = local.detach().to(torch.float32, copy=True)
                counted = self._counted(get_param_meta(p))
                self.pieces.append(
                    RowMaster(
                        name, p, local, master, rows.start * width, rows.stop * width, counted
                    )
                )
        self._build_optimizer(optimizer_factory, param_group_fn)
        if isinstance(self.optimizer, Muon):
            raise ValueError(
                "FSDPOptimizer: optimizer_factory built a Muon, which orthogonalises whole "
                "matrices, but FSDP leaves each rank only some rows of every matrix; valid: a "
                "per-element optimizer (torch.optim.AdamW, shardwork's AdamW, SGD...), or Muon "
                "through LayerWiseDistributedOptimizer over an all-reduce DDP"
            )

    @property
    def masters(self) -> list[RowMaster]:
        return self.pieces

    def master_ranges(self):
        for rm in self.pieces:
            yield rm.name, rm.param, rm.master, rm.param_start, rm.param_end

    # ------------------------------------------------------------------ step phases
    def prepare_grads(self, inv_scale: float) -> None:
        """Finish FSDP's reduction and point master grads at the local gradient rows (copied
        into the master's dtype where it differs), divided by the loss scale."""
        for m in self.models:
            m.finish_grad_sync()
        for rm in self.pieces:
            grad = rm.param.main_grad.view(-1)
            # FSDP makes a new gradient DTensor every step: re-point (or re-copy) each time.
            rm.master.grad = grad if grad.dtype == rm.master.dtype else grad.to(rm.master.dtype)
            if inv_scale != 1.0:
                rm.master.grad.mul_(inv_scale)

    def finish_step(self) -> None:
        """Round copied masters back into the parameter shards (the next forward gathers them)."""
        with torch.no_grad():
            for rm in self.pieces:
                if not rm.master_is_view:
                    rm.local.copy_(rm.master)

    def finish_param_sync(self) -> None:
        """Nothing to wait for: parameters are gathered by the next forward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the models' gradients and the masters' references to them."""
        for m in self.models:
            m.zero_grad_buffer()
        for rm in self.pieces:
            rm.master.grad = None
