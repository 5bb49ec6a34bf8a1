"""``FullyShardedDataParallel``: torch's FSDP2 (``fully_shard``) over shardwork's groups.

- Parameters and gradients are sharded on dim 0 over the data-parallel group, and
  :class:`~shardwork.dist_optimizer.fsdp_optimizer.FSDPOptimizer` keeps optimizer state for
  the local rows only: dense parameters over dp×cp, expert parameters over edp. The meshes are
  made from the :class:`~shardwork.parallel_state.ProcessGroups`' own communicators
  (``DeviceMesh.from_group``); no communicator is created. What FSDP shards is the TP-local
  parameter the layers already hold, so it composes with TP, PP, CP and EP unchanged.
- Units (one all-gather and one reduce-scatter each, :mod:`.fsdp_units`): every block given
  (transformer layers, forward order), each block's expert containers on the edp mesh, and the
  root for the rest (embedding, final norm, head).
- ``ParamMeta`` and every other ``_shardwork_*`` attribute are carried from each replaced
  parameter onto its DTensor (``carry_param_attributes``): layout metadata stays the one
  source of truth for the optimizer, checkpoints and ``finalize_model_grads``.
- Gradients are *summed* over the group (divide factor 1, sum reduction), as shardwork's DDP
  with ``average_gradients=False``: ``finalize_model_grads`` divides by the global token count.
- Gradient accumulation: under :meth:`no_sync` micro-batch gradients accumulate unsharded
  (the TP-local size of every parameter stays allocated in the reduce dtype) and are
  reduce-scattered once at the last backward; with ``reduce_per_micro_batch`` every backward
  reduce-scatters and the sharded gradients accumulate (less memory, one collective per
  micro-batch).
- :meth:`finish_grad_sync` (called by ``finalize_model_grads``) gives every trainable
  parameter ``main_grad``: a view of its reduced local gradient rows, which the sequence-
  parallel and shared-embedding reductions and the token scaling then update in place.
- ``reshard_after_forward=False`` is the ZeRO-2-like mode: parameters stay gathered from a
  block's forward to its backward (no second all-gather; the whole model's gathered
  parameters are resident between the two), sharded again after backward.
- Prefetch: each block asks for the all-gather of the next ``forward_prefetch`` blocks when its
  forward starts and of the previous ``backward_prefetch`` blocks in backward (torch's
  ``set_modules_to_*_prefetch``), so those collectives run during the block's compute.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from shardwork.dist_optimizer.ddp import data_parallel_groups
from shardwork.dist_optimizer.fsdp_units import check_blocks, expert_containers, own_parameters
from shardwork.dist_optimizer.validation import check_bool, check_process_groups, check_type
from shardwork.parallel_state import (
    ProcessGroups,
    carry_param_attributes,
    get_param_meta,
    has_param_meta,
)

__all__ = ["FSDPConfig", "FullyShardedDataParallel"]

_NEEDED_TORCH_API = ("set_reduce_scatter_unused_params", "set_force_sum_reduction_for_comms")


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """Options of :class:`FullyShardedDataParallel`."""

    reshard_after_forward: bool = True
    """True: parameters are sharded again after each block's forward and gathered again in
    backward (full sharding). False: kept gathered until backward (ZeRO-2-like)."""
    param_dtype: torch.dtype | None = None
    """Dtype the gathered parameters are computed in (e.g. bf16 while the sharded parameters,
    the masters, stay fp32); None: the parameters' own dtype."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are accumulated and reduced in (e.g. fp32 under bf16 compute); None: the
    parameters' own dtype."""
    reduce_per_micro_batch: bool = False
    """Reduce-scatter after every backward instead of accumulating unsharded gradients under
    :meth:`FullyShardedDataParallel.no_sync` (trades collectives for memory)."""
    forward_prefetch: int = 1
    """Blocks ahead whose all-gather a block's forward starts (0: torch's implicit order)."""
    backward_prefetch: int = 1
    """Blocks behind whose all-gather a block's backward starts (0: torch's implicit order)."""

    def __post_init__(self) -> None:
        for name in ("reshard_after_forward", "reduce_per_micro_batch"):
            # "False" would silently act as True.
            check_bool(f"FSDPConfig.{name}", getattr(self, name))
        for name in ("forward_prefetch", "backward_prefetch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"FSDPConfig.{name}={value!r}; valid: an int >= 0")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"FSDPConfig.{name}={value!r}; valid: None or a floating torch.dtype"
                )


def _mesh(group: Any, device_type: str) -> DeviceMesh:
    """A 1-D mesh over an existing communicator (no new group is created)."""
    return DeviceMesh.from_group(group, device_type=device_type)


def _sharding_groups(process_groups, dp_group, expert_dp_group) -> tuple[Any, Any]:
    """DDP's group resolution (:func:`data_parallel_groups`), except that FSDP needs a real
    data-parallel group: it shards over that group's communicator."""
    dp_group, expert_dp_group = data_parallel_groups(process_groups, dp_group, expert_dp_group)
    if dp_group is None:
        raise ValueError(
            "FullyShardedDataParallel: dp_group is None (no torch.distributed); valid: a "
            "data-parallel process group (FSDP shards over its communicator)"
        )
    return dp_group, expert_dp_group


class FullyShardedDataParallel(nn.Module):
    """FSDP of ``module`` by blocks over shardwork's data-parallel groups (module docstring).

    Args:
        module: the model chunk (on its device; trainable parameters only).
        blocks: its transformer layers (each one FSDP unit), in forward order.
        config: :class:`FSDPConfig`.
        process_groups: take ``dp_cp`` (dense) and ``edp`` (expert) from this bundle.
        dp_group / expert_dp_group: explicit groups instead (expert defaults to dense).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        blocks: Sequence[nn.Module],
        config: FSDPConfig | None = None,
        process_groups: ProcessGroups | None = None,
        dp_group: Any = None,
        expert_dp_group: Any = None,
    ) -> None:
        check_type(
            "FullyShardedDataParallel: config",
            config,
            FSDPConfig,
            "e.g. FSDPConfig(forward_prefetch=2), or FSDPConfig(**d) for a dict d of its fields",
        )
        check_process_groups("FullyShardedDataParallel: process_groups", process_groups)
        super().__init__()
        config = config or FSDPConfig()
        missing = [name for name in _NEEDED_TORCH_API if not hasattr(FSDPModule, name)]
        if missing:
            raise ValueError(
                f"FullyShardedDataParallel needs torch's FSDPModule.{missing[0]} (torch "
                f"{torch.__version__} lacks it); valid: a torch that has it (2.13 or newer)"
            )
        dp_group, expert_dp_group = _sharding_groups(process_groups, dp_group, expert_dp_group)
        frozen = [n for n, p in module.named_parameters() if not p.requires_grad]
        if frozen:
            raise ValueError(
                f"FullyShardedDataParallel: parameter {frozen[0]!r} is frozen "
                "(requires_grad=False); valid: a model whose parameters all train (frozen "
                "parameters under FSDP are not supported)"
            )
        blocks = list(blocks)
        check_blocks(module, blocks)
        devices = {p.device.type for p in module.parameters()}
        if len(devices) != 1:
            raise ValueError(
                f"FullyShardedDataParallel: parameters on devices {sorted(devices)}; valid: one"
            )
        self.module = module
        self.config = config
        self.dp_group = dp_group
        self.expert_dp_group = expert_dp_group
        self.blocks = blocks
        replaced = dict(module.named_parameters(remove_duplicate=False))
        meshes = {False: _mesh(dp_group, devices.pop())}
        meshes[True] = (
            meshes[False]
            if expert_dp_group is dp_group
            else _mesh(expert_dp_group, meshes[False].device_type)
        )
        self.expert_units: list[FSDPModule] = []
        """The units of expert containers (sharded over edp)."""
        self.units = self._shard(meshes)
        """Every FSDP unit, bottom-up (the root last)."""
        self.params: list[nn.Parameter] = []
        """The sharded (DTensor) parameters, in registration order."""
        self.param_names: dict[int, str] = {}
        """``id(param) -> qualified name`` of every sharded parameter."""
        for name, p in module.named_parameters(remove_duplicate=False):
            old = replaced[name]
            carry_param_attributes(old, p)
            # Internal invariant: a parameter whose ParamMeta was dropped would silently be read
            # as replicated dense.
            assert has_param_meta(p) == has_param_meta(old), name
            if id(p) not in self.param_names:
                self.param_names[id(p)] = name
                self.params.append(p)
        root = self.module
        assert isinstance(root, FSDPModule)
        # Sum, never average: finalize_model_grads divides by the global token count. Forcing a SUM
        # collective also keeps gloo, which has no PREMUL_SUM, working.
        for unit in self.units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        # Zero gradients for parameters a rank did not use (experts that got no token, an MTP
        # depth): every rank of a group must reduce-scatter the same tensors.
        root.set_reduce_scatter_unused_params(True)
        self._set_prefetch()

    # ------------------------------------------------------------------ construction helpers
    def _policy(self, params: Sequence[nn.Parameter]) -> MixedPrecisionPolicy:
        c = self.config
        # An explicit reduce dtype also gives unused parameters' zero gradients a dtype every rank
        # agrees on (torch requires one for set_reduce_scatter_unused_params).
        reduce_dtype = c.reduce_dtype or (params[0].dtype if params else None)
        return MixedPrecisionPolicy(param_dtype=c.param_dtype, reduce_dtype=reduce_dtype)

    def _shard_unit(
        self, target: nn.Module | list[nn.Module], mesh: DeviceMesh, params: list[nn.Parameter]
    ) -> FSDPModule:
        return fully_shard(
            target,
            mesh=mesh,
            reshard_after_forward=self.config.reshard_after_forward,
            mp_policy=self._policy(params),
        )

    def _shard(self, meshes: dict[bool, DeviceMesh]) -> list[FSDPModule]:
        """``fully_shard`` bottom-up: each block's expert containers, the block, then the same for
        the root. Returns the units (root last)."""
        units: list[FSDPModule] = []

        def is_unit(m: nn.Module) -> bool:
            return isinstance(m, FSDPModule)

        for index, owner in enumerate([*self.blocks, self.module]):
            where = f"blocks[{index}]" if owner is not self.module else "the root module"
            experts = expert_containers(owner, is_unit, where=where)
            if experts:
                params = [p for m in experts for p in m.parameters()]
                target = experts[0] if len(experts) == 1 else experts
                unit = self._shard_unit(target, meshes[True], params)
                units.append(unit)
                self.expert_units.append(unit)
            params = [p for _, p in own_parameters(owner, is_unit)]
            units.append(self._shard_unit(owner, meshes[False], params))
        return units

    def _set_prefetch(self) -> None:
        blocks = self.blocks
        c = self.config
        for i, block in enumerate(blocks):
            ahead = blocks[i + 1 : i + 1 + c.forward_prefetch]
            behind = blocks[max(0, i - c.backward_prefetch) : i][::-1]
            if c.forward_prefetch and ahead:
                block.set_modules_to_forward_prefetch(ahead)
            if c.backward_prefetch and behind:
                block.set_modules_to_backward_prefetch(behind)

    # ------------------------------------------------------------------ public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate this backward's gradients unsharded, without reducing them (every
        micro-batch but the last); a no-op with ``reduce_per_micro_batch``."""
        if self.config.reduce_per_micro_batch:
            yield
            return
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def finish_grad_sync(self) -> None:
        """After the last backward: every trainable parameter's ``main_grad`` is the view of its
        reduced local gradient rows (zeros where no backward reached it). Idempotent."""
        for p in self.params:
            if p.grad is None:
                # A DTensor of zeros with the parameter's sharding: no collective.
                p.grad = torch.zeros_like(p)
            with torch.no_grad():
                p.main_grad = p.grad.to_local()

    def zero_grad_buffer(self) -> None:
        """Drop every gradient (start of an iteration): FSDP would otherwise add the next
        reduction into it."""
        for p in self.params:
            p.grad = None
            p.main_grad = None

    def sharded_params(self, *, expert: bool) -> list[tuple[str, nn.Parameter]]:
        """``(name, sharded parameter)`` of the expert (``expert=True``) or dense parameters."""
        return [
            (self.param_names[id(p)], p)
            for p in self.params
            if get_param_meta(p).is_expert == expert
        ]
