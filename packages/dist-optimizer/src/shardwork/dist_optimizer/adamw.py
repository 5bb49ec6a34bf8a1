"""``AdamW`` with a selectable moment dtype (fp32 or bf16), for a sharded fp32 master.

Same update as ``torch.optim.AdamW`` (decoupled weight decay, bias correction, no amsgrad):
``p *= 1 - lr·wd; m = β1·m + (1-β1)·g; v = β2·v + (1-β2)·g²;
p -= lr/(1-β1^t) · m / (sqrt(v)/sqrt(1-β2^t) + eps)``. The arithmetic runs in fp32; only
the stored moments ``exp_avg``/``exp_avg_sq`` take ``state_dtype`` (bf16 halves the
optimizer-state memory: 4 bytes per parameter instead of 8; round-to-nearest, no
stochastic rounding). It works per element, so it runs unchanged on a ZeRO shard.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from shardwork.dist_optimizer.validation import check_betas, check_real, option_label

__all__ = ["AdamW"]


def check_options(options: Mapping[str, Any], group_index: int | None = None) -> None:
    """TypeError/ValueError for a bad ``lr``, ``betas``, ``eps`` or ``weight_decay`` among
    ``options`` (the constructor's, or param group ``group_index``'s): finite, >= 0 (a
    negative weight decay would grow the weights; torch.optim.AdamW refuses it too)."""
    for name in ("lr", "eps", "weight_decay"):
        if name in options:
            check_real(option_label("AdamW", name, group_index), options[name], at_least=0)
    if "betas" in options:
        check_betas(option_label("AdamW", "betas", group_index), options["betas"])


class AdamW(torch.optim.Optimizer):
    """AdamW whose moments are stored in ``state_dtype``.

    ``lr``, ``eps``, ``weight_decay`` (finite, >= 0) and ``betas`` (two numbers in [0, 1)) are
    checked for the constructor and for each param group's own values (see
    :func:`check_options`)."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        check_options(defaults)
        if state_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"AdamW.state_dtype={state_dtype}; valid: torch.float32, torch.bfloat16, torch.float16"
            )
        super().__init__(params, defaults)
        self.state_dtype = state_dtype

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Check the group's options (with the defaults it inherits), then add it (torch's
        rules): a bad value raises here, not at the first step, and the group is not added."""
        if isinstance(param_group, dict):
            check_options({**self.defaults, **param_group}, len(self.param_groups))
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype)
                state["step"] += 1
                t = float(state["step"])
                g = p.grad.float()
                m = state["exp_avg"].float()
                v = state["exp_avg_sq"].float()
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.mul_(1 - lr * wd)
                denom = (v.sqrt() / math.sqrt(1 - b2**t)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - b1**t))
                state["exp_avg"].copy_(m)
                state["exp_avg_sq"].copy_(v)
        return loss
