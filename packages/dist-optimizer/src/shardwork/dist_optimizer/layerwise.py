"""``LayerWiseDistributedOptimizer``: whole parameters updated on one owner rank each.

For optimizers that need entire matrices (Muon), ZeRO's flat shards do not work. Instead:

- every (dense or expert) parameter of the DDP chunks is assigned to one data-parallel
  owner rank, largest first to the least-loaded rank (ties: lowest rank), so each rank owns
  about ``1/DP`` of the elements; the assignment is the same on every rank;
  :meth:`assign_owners` computes it without processes;
- gradients are all-reduced by DDP (``use_distributed_optimizer=False``); the owner keeps an
  fp32 master (the parameter itself when fp32) and optimizer state for its parameters only;
- after the local step each parameter is broadcast from its owner over the data-parallel
  group, in a fixed order; with ``overlap_param_gather`` the broadcasts are asynchronous and
  each module waits for its own parameters in a forward pre-hook;
- statistics (norm, inf/nan, zeros) are summed over owned parameters and all-reduced over
  ``stats_groups`` exactly like :class:`DistributedOptimizer`, so the two chain together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardwork.dist_optimizer.ddp import DistributedDataParallel
from shardwork.dist_optimizer.local_masters import (
    LocalMastersOptimizer,
    OptimizerConfig,
    OptimizerFactory,
    ParamGroupFn,
)
from shardwork.dist_optimizer.optimizer_groups import group_ranks
from shardwork.parallel_state import ProcessGroups, get_param_meta, group_rank, set_param_meta

__all__ = ["LayerWiseDistributedOptimizer", "OwnedParam"]


@dataclass
class OwnedParam:
    """A parameter this rank owns, with its master."""

    name: str
    param: torch.nn.Parameter
    master: torch.Tensor
    counted: bool

    @property
    def master_is_view(self) -> bool:
        return self.master.data_ptr() == self.param.data_ptr()


class LayerWiseDistributedOptimizer(LocalMastersOptimizer):
    """Owner-rank optimizer for whole parameters; arguments as :class:`DistributedOptimizer`,
    except that the DDP chunks must use all-reduce (``use_distributed_optimizer=False``)."""

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
            sharded_grads=False,
            why="the layer-wise optimizer needs all-reduced gradients",
        )
        dp_size = len(group_ranks(self.dp_group))
        my_rank = group_rank(self.dp_group)

        self.params: list[tuple[str, torch.nn.Parameter]] = []
        for m in self.models:
            for p in m.buffer_params():
                if get_param_meta(p).is_expert == expert:
                    self.params.append((m.param_names[id(p)], p))
        self.owners = self.assign_owners([p.numel() for _, p in self.params], dp_size)
        self.owned: list[OwnedParam] = []
        for (name, p), owner in zip(self.params, self.owners):
            if owner != my_rank:
                continue
            meta = get_param_meta(p)
            master = p.data if p.dtype in (torch.float32, torch.float64) else p.data.float()
            set_param_meta(master, meta)
            self.owned.append(OwnedParam(name, p, master, self._counted(meta)))
        self._build_optimizer(optimizer_factory, param_group_fn)
        self._handles: dict[int, Any] = {}
        self._hooks = []
        if self.config.overlap_param_gather:
            for m in self.models:
                for sub in m.module.modules():
                    if any(True for _ in sub.parameters(recurse=False)):
                        self._hooks.append(sub.register_forward_pre_hook(self._wait_params))

    @property
    def masters(self) -> list[OwnedParam]:
        return self.owned

    def master_ranges(self):
        for op in self.owned:
            yield op.name, op.param, op.master, 0, op.param.numel()

    @staticmethod
    def assign_owners(numels: Sequence[int], dp_size: int) -> list[int]:
        """Owner rank of each parameter: largest first onto the least-loaded rank."""
        if dp_size < 1:
            raise ValueError(f"dp_size={dp_size}; valid: >= 1")
        load = [0] * dp_size
        owners = [0] * len(numels)
        for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
            r = min(range(dp_size), key=lambda r: (load[r], r))
            owners[i] = r
            load[r] += numels[i]
        return owners

    def _wait_params(self, module: torch.nn.Module, _args: Any) -> None:
        for p in module.parameters(recurse=False):
            handle = self._handles.pop(id(p), None)
            if handle is not None:
                handle.wait()

    def _wait_all(self) -> None:
        for handle in self._handles.values():
            handle.wait()
        self._handles.clear()

    # ------------------------------------------------------------------ step phases
    def prepare_grads(self, inv_scale: float) -> None:
        self._wait_all()
        for m in self.models:
            m.finish_grad_sync()
        for op in self.owned:
            g = op.param.main_grad
            op.master.grad = g if g.dtype == op.master.dtype else g.to(op.master.dtype)
            if inv_scale != 1.0:
                if op.master.grad is g:
                    op.master.grad = g * inv_scale
                else:
                    op.master.grad.mul_(inv_scale)

    def finish_step(self) -> None:
        with torch.no_grad():
            for op in self.owned:
                if not op.master_is_view:
                    op.param.data.copy_(op.master)
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        overlap = self.config.overlap_param_gather
        for (_, p), owner in zip(self.params, self.owners):
            src = dist.get_global_rank(self.dp_group, owner)
            handle = dist.broadcast(p.data, src=src, group=self.dp_group, async_op=overlap)
            if overlap:
                self._handles[id(p)] = handle

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter broadcast."""
        self._wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.models:
            m.zero_grad_buffer()
        for op in self.owned:
            op.master.grad = None
