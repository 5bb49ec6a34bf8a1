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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardwork.dist_optimizer.ddp import DistributedDataParallel
from shardwork.dist_optimizer.distributed_optimizer import (
    OptimizerConfig,
    OptimizerFactory,
    _as_models,
    group_ranks,
)
from shardwork.dist_optimizer.grad_stats import grad_stats
from shardwork.dist_optimizer.optimizer_groups import resolve_optimizer_groups
from shardwork.dist_optimizer.step_flow import StepResult, run_step
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


class LayerWiseDistributedOptimizer:
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
        param_group_fn: Callable[[str, torch.nn.Parameter], Mapping[str, Any] | None] | None = None,
        loss_scaler: Any = None,
    ) -> None:
        self.models = _as_models(model)
        self.config = config or OptimizerConfig()
        self.expert = expert
        for i, m in enumerate(self.models):
            if m.config.use_distributed_optimizer:
                raise ValueError(
                    f"model[{i}] was built with DDPConfig(use_distributed_optimizer=True); "
                    "valid: False (the layer-wise optimizer needs all-reduced gradients)"
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
            counted = (meta.tp_axis is not None or tp_rank == 0) and (
                not meta.shared_embedding or self.pp_rank == 0
            )
            self.owned.append(OwnedParam(name, p, master, counted))
        grouped: dict[tuple, dict[str, Any]] = {}
        for op in self.owned:
            overrides = dict(param_group_fn(op.name, op.param) or {}) if param_group_fn else {}
            signature = tuple(sorted((k, repr(v)) for k, v in overrides.items()))
            grouped.setdefault(signature, {"params": [], **overrides})["params"].append(op.master)
        self.optimizer: torch.optim.Optimizer | None = (
            optimizer_factory(list(grouped.values())) if self.owned else None
        )
        self._handles: dict[int, Any] = {}
        self._hooks = []
        if self.config.overlap_param_gather:
            for m in self.models:
                for sub in m.module.modules():
                    if any(True for _ in sub.parameters(recurse=False)):
                        self._hooks.append(sub.register_forward_pre_hook(self._wait_params))
        self.last_result: StepResult | None = None

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

    def local_grad_stats(self, count_zeros: bool = True) -> torch.Tensor:
        """``[pieces with a non-finite value, Σg², zero count]`` over the owned master grads."""
        return grad_stats(
            [op.master.grad for op in self.owned],
            [op.counted for op in self.owned],
            count_zeros=count_zeros,
        )

    def scale_grads(self, factor: float) -> None:
        for op in self.owned:
            op.master.grad.mul_(factor)

    def step_local(self) -> None:
        if self.optimizer is not None:
            self.optimizer.step()

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

    # ------------------------------------------------------------------ public API
    def step(self) -> StepResult:
        """Reduce, (clip,) update owned parameters, broadcast; ``(ok, grad_norm, num_zeros)``."""
        self.last_result = run_step(
            [self],
            clip_grad=self.config.clip_grad,
            loss_scaler=self.loss_scaler,
            skip_nonfinite=self.config.skip_nonfinite,
            count_zeros=self.config.count_zeros,
        )
        return self.last_result

    def finish_param_sync(self) -> None:
        """Wait for every outstanding parameter broadcast."""
        self._wait_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for m in self.models:
            m.zero_grad_buffer()
        for op in self.owned:
            op.master.grad = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups if self.optimizer is not None else []

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else float(self.loss_scaler.scale)

    def get_grad_norm(self) -> float | None:
        return None if self.last_result is None else self.last_result.grad_norm

    def sharded_state_dict(self, **kwargs: Any) -> dict[str, Any]:
        """Owned parameters' state as whole TP-local rectangles in global coordinates."""
        from shardwork.dist_optimizer.sharded_state import layerwise_sharded_state_dict

        return layerwise_sharded_state_dict(self, **kwargs)

    def load_sharded_state_dict(self, state: Mapping[str, Any], **kwargs: Any) -> None:
        from shardwork.dist_optimizer.sharded_state import load_layerwise_sharded_state_dict

        load_layerwise_sharded_state_dict(self, state, **kwargs)
