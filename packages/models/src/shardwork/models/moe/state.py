"""MoE state owned by a model, and the hooks ``finalize_model_grads`` runs for it.

- :func:`attach_moe` (run by ``GPTModel`` on every chunk; nothing when ``config.moe`` is
  None) gives the model an :class:`~shardwork.moe_router.AuxLossTracker` (``model.aux_loss_tracker``: per-layer aux
  losses and per-expert token counts, ``num_layers`` rows on every stage so stages without MoE
  layers join the same reductions) and an :class:`~shardwork.moe_router.AuxLossScale`
  (``model.aux_loss_scale``: the factor on aux-loss gradients; the trainer sets it to its
  main-loss backward scale); the ``"moe"`` MLP kind (:mod:`shardwork.models.layer_kinds`)
  builds each :class:`~shardwork.models.moe.layer.MoELayer` with them.
- :func:`moe_finalize_kwargs` returns ``{"moe_tracker": ..., "moe_hooks": [...]}`` for
  ``finalize_model_grads(chunks, groups, **kwargs)``: the tracker reduction over pp / tp×cp / dp
  and the aux-loss-free expert-bias update (DeepSeek-V3) from token counts summed over the
  ranks that routed different tokens, or the quantile-balancing update of ``qb_beta``
  (quantiles averaged over dp×cp: each router already gathered its micro-batch's tokens over
  its token group). Nothing is module-level: it is all on the model.
- :func:`expert_load` gives ``[num_layers, E]`` routed token counts for logging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from shardwork.models.moe.router import MoERouter
from shardwork.moe_router import (
    AuxLossScale,
    AuxLossTracker,
    update_expert_bias,
    update_quantile_balancing,
)
from shardwork.parallel_state import ProcessGroups

__all__ = ["attach_moe", "expert_load", "moe_finalize_kwargs", "moe_routers"]


def attach_moe(model: nn.Module, config, device) -> None:
    """Create ``model.aux_loss_tracker`` / ``model.aux_loss_scale`` (the ``"moe"`` MLP kind's
    ``attach`` in :mod:`shardwork.models.layer_kinds`, run before any layer is built); nothing
    for a model without ``config.moe``."""
    moe = config.moe
    if moe is None:
        return
    # Meta tensors hold no values and the tracker counts real tokens: CPU for a meta build.
    tracker_device = "cpu" if torch.device(device).type == "meta" else device
    mtp_depths = config.mtp.num_layers if config.mtp is not None else 0
    model.aux_loss_tracker = AuxLossTracker(
        # One row per global layer on every stage (MTP layers after the decoder's): stages without
        # MoE layers join the same reductions with zero rows, so all ranks' tensors have one shape.
        num_layers=config.num_layers + mtp_depths,
        num_experts=moe.router.num_experts,
        device=tracker_device,
    )
    model.aux_loss_scale = AuxLossScale(1.0)


def _unwrap(chunk: nn.Module) -> nn.Module:
    while not hasattr(chunk, "aux_loss_tracker") and isinstance(
        getattr(chunk, "module", None), nn.Module
    ):
        chunk = chunk.module
    return chunk


def moe_routers(chunks: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The moe-router ``TopKRouter`` of every MoE layer in ``chunks`` (wrappers looked through)."""
    chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    return [m.inner for c in chunks for m in c.modules() if isinstance(m, MoERouter)]


class _Trackers:
    """The chunks' trackers, reduced one after the other (same count on every rank).

    ``token_group``: the group whose ranks routed *different* tokens of a micro-batch, which
    replaces finalize's tp×cp group: without sequence parallelism the TP ranks route the same
    tokens, so only cp ranks hold distinct shares.
    """

    def __init__(self, trackers: list[AuxLossTracker], token_group) -> None:
        self.trackers = trackers
        self.token_group = token_group

    def reduce(self, *, pp_group=None, tp_cp_group=None, dp_group=None) -> None:
        for t in self.trackers:
            t.reduce(pp_group=pp_group, tp_cp_group=self.token_group, dp_group=dp_group)


def moe_finalize_kwargs(
    chunks: nn.Module | Sequence[nn.Module], groups: ProcessGroups
) -> dict[str, Any]:
    """Keyword arguments for ``finalize_model_grads``: the tracker and the expert-bias hook.

    Every rank of the layout must call ``finalize_model_grads`` with them (chunks of a model
    without MoE give ``{}``).
    """
    chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    models = [_unwrap(c) for c in chunks]
    trackers = [m.aux_loss_tracker for m in models if getattr(m, "aux_loss_tracker", None)]
    if not trackers:
        return {}
    config = models[0].config
    sp = config.sequence_parallel and groups.size("tp") > 1
    # Expert-bias token counts summed over the ranks that routed different tokens: with SP the TP
    # ranks too; without it they routed the same tokens and would be counted tp times.
    bias_group = groups.group("tp_dp_cp") if sp else groups.group("dp_cp")
    routers = moe_routers(models)
    hooks = []
    if config.moe.router.enable_expert_bias:
        hooks.append(lambda: update_expert_bias(routers, group=bias_group))
    if config.moe.router.load_balancing_type == "quantile_balancing":
        # Megatron-Core averages over dp×cp too; cp ranks hold equal quantiles (gathered).
        qb_group = groups.group("dp_cp")
        hooks.append(lambda: update_quantile_balancing(routers, group=qb_group))
    tracker = _Trackers(trackers, groups.group("tp_cp") if sp else groups.group("cp"))
    return {"moe_tracker": tracker, "moe_hooks": hooks}


def expert_load(chunks: nn.Module | Sequence[nn.Module]) -> torch.Tensor:
    """``[num_layers, E]`` routed token counts of this step (sum over chunks; reduce first)."""
    chunks = [chunks] if isinstance(chunks, nn.Module) else list(chunks)
    trackers = [_unwrap(c).aux_loss_tracker for c in chunks]
    return torch.stack([t.tokens_per_expert for t in trackers]).sum(0)
