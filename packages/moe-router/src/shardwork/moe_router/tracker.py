"""``AuxLossTracker``: per-layer aux-loss values and per-expert token counts for logging.

- Owned by the caller (model or trainer) and handed to each router; reset by the caller once
  per step with :meth:`AuxLossTracker.reset`. No module-level state.
- Storage is preallocated with fixed shapes (every known loss name × ``num_layers``, and
  ``num_layers`` × ``num_experts`` token counts), so every rank holds identical shapes whether
  or not its pipeline stage has MoE layers.
- :meth:`reduce` issues the same collectives in the same order on every rank: a sum over the
  pipeline group first (a layer lives on one stage; the others contribute zeros), then the
  in-stage reductions each quantity needs. A stage without MoE layers therefore joins every
  collective (Megatron-Core's tracker skips names a stage never recorded and hangs there).

Reductions (see docs/moe-router.md):

================================  ======================================================
quantity                          reduction after the pipeline sum
================================  ======================================================
load_balancing_loss               sum over TP×CP (per-rank shares), mean over DP
seq_load_balancing_loss           sum over TP×CP, mean over DP
global_load_balancing_loss        sum over TP×CP×DP (already a global-batch quantity)
z_loss                            mean over TP×CP×DP
tokens_per_expert                 sum over TP×CP×DP
================================  ======================================================
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LOSS_NAMES = (
    "load_balancing_loss",
    "seq_load_balancing_loss",
    "global_load_balancing_loss",
    "z_loss",
)


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


class AuxLossTracker:
    """Accumulates, per MoE layer, aux-loss values (divided by their coefficient) and routed
    token counts over the micro-batches of a step."""

    def __init__(self, *, num_layers: int, num_experts: int, device: torch.device | str = "cpu"):
        for name, value in (("num_layers", num_layers), ("num_experts", num_experts)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"AuxLossTracker.{name}={value!r} is invalid: it must be an integer >= 1"
                )
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.losses = torch.zeros(len(LOSS_NAMES), num_layers, dtype=torch.float64, device=device)
        """[loss name, layer] accumulated values (order of ``LOSS_NAMES``)."""
        self.tokens_per_expert = torch.zeros(
            num_layers, num_experts, dtype=torch.float64, device=device
        )
        """[layer, expert] routed (token, expert) pairs, after dropping and padding masks."""

    def _check_layer(self, layer_index: int) -> None:
        if not 0 <= layer_index < self.num_layers:
            raise ValueError(
                f"layer_index={layer_index} is invalid: the tracker holds num_layers={self.num_layers} "
                "(0-based indices)"
            )

    def record_loss(self, name: str, layer_index: int, value: torch.Tensor) -> None:
        """Add a (detached) loss value to layer ``layer_index``'s entry for ``name``."""
        if name not in LOSS_NAMES:
            raise ValueError(f"name={name!r} is invalid: use one of {LOSS_NAMES}")
        self._check_layer(layer_index)
        self.losses[LOSS_NAMES.index(name), layer_index] += value.detach().to(self.losses)

    def record_tokens(self, layer_index: int, tokens_per_expert_E: torch.Tensor) -> None:
        """Add a layer's per-expert routed token counts."""
        self._check_layer(layer_index)
        if tokens_per_expert_E.shape != (self.num_experts,):
            raise ValueError(
                f"tokens_per_expert shape {tuple(tokens_per_expert_E.shape)} is invalid: expected "
                f"({self.num_experts},)"
            )
        self.tokens_per_expert[layer_index] += tokens_per_expert_E.detach().to(
            self.tokens_per_expert
        )

    def reset(self) -> None:
        """Zero every value (call once per training step)."""
        self.losses.zero_()
        self.tokens_per_expert.zero_()

    def reduce(self, *, pp_group=None, tp_cp_group=None, dp_group=None) -> None:
        """Reduce in place across ranks; every rank of every pipeline stage must call it.

        ``pp_group``: pipeline group; ``tp_cp_group``: the ranks splitting one micro-batch's
        tokens (tensor × context parallel); ``dp_group``: data parallel (without CP). None
        means that dimension has size 1.
        """
        if pp_group is not None:
            dist.all_reduce(self.losses, group=pp_group)
            dist.all_reduce(self.tokens_per_expert, group=pp_group)
        if tp_cp_group is not None:
            # Shares of aux/seq/global losses and token counts add up over TP×CP;
            # z-loss is a mean of per-rank means.
            dist.all_reduce(self.losses, group=tp_cp_group)
            dist.all_reduce(self.tokens_per_expert, group=tp_cp_group)
            self.losses[LOSS_NAMES.index("z_loss")] /= _size(tp_cp_group)
        if dp_group is not None:
            dist.all_reduce(self.losses, group=dp_group)
            dist.all_reduce(self.tokens_per_expert, group=dp_group)
            dp = _size(dp_group)
            for name in ("load_balancing_loss", "seq_load_balancing_loss", "z_loss"):
                self.losses[LOSS_NAMES.index(name)] /= dp
            # global_load_balancing_loss: each DP rank holds its share of the global loss.

    def loss_values(self) -> dict[str, torch.Tensor]:
        """``{name: per-layer values [num_layers]}`` for the loss names."""
        return {name: self.losses[i].clone() for i, name in enumerate(LOSS_NAMES)}

    def summary(self, *, num_micro_batches: int = 1) -> dict[str, float]:
        """Mean over layers that recorded anything, divided by ``num_micro_batches``, per loss,
        plus ``load_imbalance`` = mean over layers of max(tokens)/mean(tokens)."""
        out: dict[str, float] = {}
        for i, name in enumerate(LOSS_NAMES):
            row = self.losses[i]
            active = row != 0
            if bool(active.any()):
                out[name] = float(row[active].mean()) / num_micro_batches
        counts = self.tokens_per_expert
        used = counts.sum(dim=1) > 0
        if bool(used.any()):
            c = counts[used]
            out["load_imbalance"] = float((c.max(dim=1).values / c.mean(dim=1)).mean())
        return out
