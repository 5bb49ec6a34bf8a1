"""RMSNorm module over ``shardwork.fused_kernels.rms_norm`` with the model's chosen backend.

The weight is replicated across TP. Its ParamMeta says ``sequence_parallel=True`` when each
TP rank's gradient is only a partial sum (norms fed by sequence-parallel activations; QK-norm
whenever tp > 1, since each rank normalises only its own heads), so that
``finalize_model_grads`` all-reduces it over TP.

``zero_centered_gamma`` (Qwen3-Next, Megatron's ``layernorm_zero_centered_gamma``): the scale is
``1 + weight`` with ``weight`` initialised to zeros, so the initial norm is the plain one and
weight decay pulls the scale towards 1 instead of 0. Every fused-kernels backend takes the flag,
and the gradient with respect to ``weight`` is the one of the plain norm's scale.
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels import rms_norm
from shardwork.models.module import ShardedModule
from shardwork.models.sharding import describe_param
from shardwork.parallel_state import ParamMeta, ProcessGroups

__all__ = ["RMSNorm"]


class RMSNorm(ShardedModule):
    """``x / rms(x) * weight`` (``* (1 + weight)`` when zero-centred) over a last dim of ``size``."""

    def __init__(
        self,
        size: int,
        *,
        groups: ProcessGroups,
        eps: float,
        backend: str,
        partial_grad: bool,
        zero_centered_gamma: bool = False,
        params_dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        self.eps, self.backend = eps, backend
        self.zero_centered_gamma = zero_centered_gamma
        self.weight = describe_param(
            torch.nn.Parameter(torch.empty(size, dtype=params_dtype, device=device)),
            ParamMeta(sequence_parallel=partial_grad),
            init="zeros" if zero_centered_gamma else "ones",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            x,
            self.weight.to(x.dtype),
            eps=self.eps,
            zero_centered_gamma=self.zero_centered_gamma,
            backend=self.backend,
        )
