"""``ChainedOptimizer``: several distributed optimizers (dense + expert) stepping as one.

- The parts keep their own data-parallel groups (dense: dp×cp, expert: edp); the chain runs
  :func:`~shardwork.dist_optimizer.step_flow.run_step` over all of them, so the inf/nan check,
  the global gradient norm (``sqrt(Σ_parts Σ g²)``), the clipping coefficient and the
  zero count are shared, and either every part steps or none does.
- A part with no parameters on this rank (a pipeline stage without MoE layers) still joins
  its statistics all-reduce, so every rank must build the same list of parts.
- One loss scaler for the whole chain (fp16); the parts' own scalers are not used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardwork.dist_optimizer.distributed_optimizer import DistributedOptimizer
from shardwork.dist_optimizer.fsdp import FullyShardedDataParallel
from shardwork.dist_optimizer.fsdp_optimizer import FSDPOptimizer
from shardwork.dist_optimizer.layerwise import LayerWiseDistributedOptimizer
from shardwork.dist_optimizer.local_masters import (
    LocalMastersOptimizer,
    OptimizerConfig,
    OptimizerFactory,
    as_models,
    check_optimizer_options,
)
from shardwork.dist_optimizer.step_flow import StepResult, run_step
from shardwork.dist_optimizer.validation import short_repr, with_article
from shardwork.parallel_state import ProcessGroups

__all__ = ["ChainedOptimizer", "build_optimizer"]


def check_parts(parts: Sequence[Any]) -> None:
    """TypeError for a part that is not one of this package's distributed optimizers (the
    chain drives their step phases; a torch optimizer has none of them)."""
    for i, part in enumerate(parts):
        if not isinstance(part, LocalMastersOptimizer):
            raise TypeError(
                f"ChainedOptimizer: parts[{i}]={short_repr(part, 60)} is "
                f"{with_article(type(part).__name__)}; valid: DistributedOptimizer, "
                "LayerWiseDistributedOptimizer or FSDPOptimizer parts (a torch.optim optimizer "
                "goes inside one of them, built by its optimizer_factory)"
            )


class ChainedOptimizer:
    """Step ``parts`` (DistributedOptimizer / LayerWiseDistributedOptimizer / FSDPOptimizer)
    together.

    ``config`` (default: the first part's) gives clipping, inf/nan skipping and zero
    counting; ``loss_scaler`` (default: the first part's) scales the whole chain.
    """

    def __init__(
        self,
        parts: Sequence[Any],
        *,
        config: OptimizerConfig | None = None,
        loss_scaler: Any = None,
    ) -> None:
        parts = list(parts)
        if not parts:
            raise ValueError("ChainedOptimizer(parts=[]); valid: at least one optimizer")
        check_parts(parts)
        check_optimizer_options("ChainedOptimizer", config, loss_scaler)
        if len({id(p) for p in parts}) != len(parts):
            raise ValueError("ChainedOptimizer: a part appears twice; valid: each optimizer once")
        owned: set[int] = set()
        for i, part in enumerate(parts):
            for mp in getattr(part, "pieces", ()):
                if id(mp.param) in owned and not getattr(part, "shares_params", False):
                    raise ValueError(
                        f"ChainedOptimizer: parameter {mp.name!r} of part {i} is already "
                        "owned by an earlier part; valid: disjoint parameter sets"
                    )
            owned |= {id(mp.param) for mp in getattr(part, "pieces", ())}
        self.parts = parts
        self.config = config or parts[0].config
        self.loss_scaler = loss_scaler if loss_scaler is not None else parts[0].loss_scaler
        self.last_result: StepResult | None = None

    def step(self) -> StepResult:
        """One step of every part; returns ``(update_successful, grad_norm, num_zeros)``."""
        self.last_result = run_step(
            self.parts,
            clip_grad=self.config.clip_grad,
            loss_scaler=self.loss_scaler,
            skip_nonfinite=self.config.skip_nonfinite,
            count_zeros=self.config.count_zeros,
        )
        return self.last_result

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none)

    def finish_param_sync(self) -> None:
        """Wait until every part's updated parameters have arrived (overlapped gathers)."""
        for part in self.parts:
            part.finish_param_sync()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """Every part's param groups, concatenated (set ``"lr"`` here)."""
        return [g for part in self.parts for g in part.param_groups]

    @property
    def loss_scale(self) -> float:
        return 1.0 if self.loss_scaler is None else float(self.loss_scaler.scale)

    def get_grad_norm(self) -> float | None:
        return None if self.last_result is None else self.last_result.grad_norm

    def _part_kwargs(self, kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        rects = kwargs.get("param_rects")
        if not isinstance(rects, (list, tuple)):
            return [kwargs] * len(self.parts)
        if len(rects) != len(self.parts):
            raise ValueError(
                f"param_rects has {len(rects)} entries for {len(self.parts)} parts; valid: one "
                "function for all parts, or one per part"
            )
        return [{**kwargs, "param_rects": r} for r in rects]

    def sharded_state_dict(self, **kwargs: Any) -> dict[str, Any]:
        """``{"0": part0 state, "1": part1 state, ...}`` plus the chain's loss scaler.

        ``param_rects`` may be one function for all parts or a list with one per part (the
        expert part's TP-replica ids follow the etp rank)."""
        out: dict[str, Any] = {
            str(i): p.sharded_state_dict(**kw)
            for i, (p, kw) in enumerate(zip(self.parts, self._part_kwargs(kwargs)))
        }
        if self.loss_scaler is not None:
            out["loss_scaler"] = self.loss_scaler.state_dict()
        return out

    def load_sharded_state_dict(self, state: Mapping[str, Any], **kwargs: Any) -> None:
        """Restore from ``dist_checkpoint.load`` of the template :meth:`sharded_state_dict` gave
        (pass the same ``param_rects``)."""
        for i, (part, kw) in enumerate(zip(self.parts, self._part_kwargs(kwargs))):
            part.load_sharded_state_dict(state[str(i)], **kw)
        if self.loss_scaler is not None and "loss_scaler" in state:
            self.loss_scaler.load_state_dict(state["loss_scaler"])


def build_optimizer(
    model: Any,
    optimizer_factory: OptimizerFactory,
    *,
    process_groups: ProcessGroups,
    config: OptimizerConfig | None = None,
    loss_scaler: Any = None,
    param_group_fn: Any = None,
    expert_optimizer_factory: OptimizerFactory | None = None,
) -> ChainedOptimizer:
    """Dense + expert optimizers for DDP or FSDP chunk(s) ``model``, chained.

    The kind follows the chunks: :class:`FSDPOptimizer` for
    :class:`FullyShardedDataParallel` chunks; for DDP chunks :class:`DistributedOptimizer`
    (ZeRO-1) when built with ``use_distributed_optimizer=True``, else
    :class:`LayerWiseDistributedOptimizer`.
    The expert part is always built (it may own nothing on this rank) so that every rank
    joins the same collectives. ``expert_optimizer_factory`` defaults to ``optimizer_factory``.
    """
    first = model[0] if isinstance(model, (list, tuple)) and model else model
    if isinstance(first, FullyShardedDataParallel):
        models = as_models(model, FullyShardedDataParallel)
        kind: type = FSDPOptimizer
    else:
        models = as_models(model)
        kind = (
            DistributedOptimizer
            if models[0].config.use_distributed_optimizer
            else LayerWiseDistributedOptimizer
        )
    common = {"config": config, "process_groups": process_groups, "param_group_fn": param_group_fn}
    parts = [
        kind(models, optimizer_factory, expert=False, **common),
        kind(models, expert_optimizer_factory or optimizer_factory, expert=True, **common),
    ]
    return ChainedOptimizer(parts, config=config, loss_scaler=loss_scaler)
