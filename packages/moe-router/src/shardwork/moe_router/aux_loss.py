"""Aux-loss plumbing: the caller-owned loss scale and the autograd function that injects a loss.

- ``AuxLossScale``: a small object holding the factor every aux-loss gradient is multiplied by
  (the trainer sets it to the main loss's backward scale, e.g. 1/num_micro_batches or the
  fp16 loss scale). It is read at backward time, so setting it after forward but before
  backward works. Owned by the caller: no class-level or module-level state.
- ``attach_aux_loss(x, loss, scale)``: returns ``x`` unchanged; in backward it passes x's
  gradient through and gives ``loss`` the gradient ``scale.value`` — exactly as if
  ``scale.value * loss`` had been added to the objective, without changing what the layer
  returns.
- Load-balancing loss formulas (``switch_aux_loss``, ``switch_aux_loss_from_sums``, ``z_loss``)
  live here too.
"""

from __future__ import annotations

import math
import numbers

import torch


def _scale_tensor(value: float | torch.Tensor, where: str) -> torch.Tensor:
    """``value`` as a fresh 0-d fp32 tensor; TypeError / ValueError naming ``where`` for
    anything but a finite real number or a one-element numeric tensor (not read: no sync)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise ValueError(
                f"{where}: value of shape {tuple(value.shape)} and dtype {value.dtype} is "
                "invalid: it must be a one-element real tensor or a Python number"
            )
        # Copied so a later in-place change to the caller's tensor cannot change the scale.
        return value.detach().to(torch.float32).reshape(()).clone()
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(
            f"{where}: value={value!r} is invalid: it must be a real number or a one-element "
            f"tensor (got {type(value).__name__})"
        )
    if not math.isfinite(value):
        raise ValueError(f"{where}: value={value!r} is invalid: it must be finite")
    return torch.tensor(float(value), dtype=torch.float32)


class AuxLossScale:
    """Multiplier applied to every aux-loss gradient; ``set`` it once per step (or micro-batch)."""

    def __init__(self, value: float | torch.Tensor = 1.0) -> None:
        self._value = _scale_tensor(value, "AuxLossScale")

    def set(self, value: float | torch.Tensor) -> None:
        """Replace the scale (a finite Python number or a one-element tensor; tensors are
        copied, not read, so no host sync)."""
        self._value = _scale_tensor(value, "AuxLossScale.set")

    @property
    def value(self) -> torch.Tensor:
        """The current scale as a 0-d fp32 tensor."""
        return self._value

    def __repr__(self) -> str:
        return f"AuxLossScale({float(self._value)})"


class _AttachAuxLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor, scale: AuxLossScale | None):
        ctx.scale = scale
        ctx.loss_meta = (loss.dtype, loss.device)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x: torch.Tensor):
        dtype, device = ctx.loss_meta
        value = ctx.scale.value if ctx.scale is not None else torch.tensor(1.0)
        # d(scale * loss)/d(loss) = scale: the loss receives the scale as its gradient.
        return grad_x, value.to(dtype=dtype, device=device), None


def attach_aux_loss(
    x: torch.Tensor, loss: torch.Tensor, scale: AuxLossScale | None = None
) -> torch.Tensor:
    """Return ``x``; backward adds ``scale.value * d(loss)/d(inputs)`` (scale 1 when None)."""
    # No graph behind the loss (e.g. under no_grad): there is nothing to send a gradient to.
    if not loss.requires_grad:
        return x
    return _AttachAuxLoss.apply(x, loss, scale)


def switch_aux_loss(
    scores_TE: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    total_num_tokens: float | torch.Tensor,
    top_k: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """Switch/GShard load-balancing loss from local scores and (reduced) token counts.

    loss = coeff * E / (K * T^2) * sum_i c_i * sum_{x local} s(x, i)

    with c_i the tokens routed to expert i and T the token count at the reduction level of
    ``tokens_per_expert_E`` (micro-batch over TP×CP, or global over TP×CP×DP). Equivalently
    coeff * E * sum_i f_i * P_i with f_i = c_i/(K T), P_i = mean score of expert i: the local
    term is one rank's share and the per-rank losses sum to the full loss. ``num_experts`` is
    passed explicitly because the per-sequence loss folds the batch into the expert axis.
    """
    return switch_aux_loss_from_sums(
        scores_TE.sum(dim=0),
        tokens_per_expert_E,
        total_num_tokens=total_num_tokens,
        top_k=top_k,
        num_experts=num_experts,
        coeff=coeff,
    )


def switch_aux_loss_from_sums(
    score_sums_E: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    total_num_tokens: float | torch.Tensor,
    top_k: int,
    num_experts: int,
    coeff: float,
) -> torch.Tensor:
    """:func:`switch_aux_loss` from the per-expert score sums ``sum_{x local} s(x, i)``."""
    return torch.sum(score_sums_E * tokens_per_expert_E) * switch_loss_factor(
        num_experts=num_experts, top_k=top_k, coeff=coeff, total_num_tokens=total_num_tokens
    )


def switch_loss_factor(
    *, num_experts: int, top_k: int, coeff: float, total_num_tokens: float | torch.Tensor
):
    """The constant c in loss = c * sum_i sums_i * c_i: coeff * E / (K * T^2).

    The loss is linear in the score sums, so c * tokens_per_expert is its gradient w.r.t.
    them (what the router injects in backward).
    """
    return num_experts * coeff / (top_k * total_num_tokens * total_num_tokens)


def z_loss(
    logits_TE: torch.Tensor, coeff: float, padding_mask_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Router z-loss (ST-MoE): coeff * mean over valid tokens of logsumexp(logits)^2.

    ``padding_mask_T`` (True = padding, left out) must be a bool tensor of the logits' shape
    without the expert dim; ValueError / TypeError otherwise, before any work.
    """
    if padding_mask_T is not None:
        _check_padding_mask(logits_TE, padding_mask_T)
    # Router z-loss of ST-MoE (Zoph et al., 2022): squared log-partition of each token's logits.
    values_T = torch.square(torch.logsumexp(logits_TE, dim=-1))
    if padding_mask_T is None:
        return torch.mean(values_T) * coeff
    valid_T = ~padding_mask_T
    # clamp: an all-padding batch gives 0 / 1 = 0 rather than 0 / 0 = NaN.
    return (values_T * valid_T).sum() / torch.clamp(valid_T.sum(), min=1.0) * coeff


def _check_padding_mask(logits_TE: torch.Tensor, padding_mask_T: torch.Tensor) -> None:
    """One bool entry per token of ``logits_TE`` (its shape without the expert dim)."""
    if not isinstance(padding_mask_T, torch.Tensor) or padding_mask_T.dtype != torch.bool:
        what = getattr(padding_mask_T, "dtype", type(padding_mask_T).__name__)
        raise TypeError(
            f"z_loss: padding_mask_T of type {what} is invalid: it must be a bool tensor "
            "(True marks padding)"
        )
    if padding_mask_T.shape != logits_TE.shape[:-1]:
        raise ValueError(
            f"z_loss: padding_mask_T of shape {tuple(padding_mask_T.shape)} is invalid: it must "
            f"be {tuple(logits_TE.shape[:-1])}, logits_TE's shape without the expert dim"
        )
