"""The routers' losses in a transformers output: their value in ``loss``/``aux_loss``, their
gradient scaled as the loss is.

shardwork's routers inject the gradient of their losses in backward (scaled by an
:class:`AuxLossScale`) and leave the forward values alone; the value reaches the tracker.
For a transformers model the integration then

- adds the value of this forward's losses (``coeff · L`` summed over layers and loss types,
  from the tracker's rows before and after the forward) to ``outputs.loss``, detached: the
  gradient is already injected, once;
- passes ``outputs.loss`` through :class:`LossGradientToScale`, whose backward copies
  d(objective)/d(outputs.loss) into that forward's :class:`AuxLossScale` before any router
  node runs (every router node is upstream of the loss), so ``(outputs.loss / n).backward()``
  or an fp16 loss scaler scales the aux-loss gradients exactly like the rest.
"""

from __future__ import annotations

import torch

from shardwork.moe_router.aux_loss import AuxLossScale
from shardwork.moe_router.config import RouterConfig
from shardwork.moe_router.tracker import LOSS_NAMES

_CONFIG_LOSS_TYPES = {
    "load_balancing_loss": "aux_loss",
    "seq_load_balancing_loss": "seq_aux_loss",
    "global_load_balancing_loss": "global_aux_loss",
}


def loss_coefficients(config: RouterConfig) -> torch.Tensor:
    """fp64 [len(LOSS_NAMES)]: the coefficient of each tracker row (0 when the loss is off)."""
    coeffs = []
    for name in LOSS_NAMES:
        if name == "z_loss":
            coeffs.append(float(config.z_loss_coeff or 0.0))
        else:
            coeffs.append(config.aux_loss_coeff_for(_CONFIG_LOSS_TYPES[name]))
    return torch.tensor(coeffs, dtype=torch.float64)


def weighted_total(
    losses_before: torch.Tensor, losses_after: torch.Tensor, coefficients: torch.Tensor
) -> torch.Tensor:
    """Σ_name Σ_layer coeff · (after − before): the loss a forward added, fp64 0-d.

    The tracker stores each loss divided by its coefficient, [loss name, layer]."""
    delta = losses_after - losses_before
    return (coefficients.to(delta.device).unsqueeze(1) * delta).sum()


class LossGradientToScale(torch.autograd.Function):
    """Identity on the loss; backward stores the loss's incoming gradient in ``scale``."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, scale: AuxLossScale) -> torch.Tensor:
        ctx.scale = scale
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        ctx.scale.set(grad_loss)
        return grad_loss, None
