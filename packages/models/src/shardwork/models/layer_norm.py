"""LayerNorm module (weight and bias) over ``shardwork.fused_kernels.layer_norm``: the norm kind
``"layernorm"`` of ``GPTConfig.normalization`` (GPT-2, Megatron's classic GPT).

Like :class:`~shardwork.models.norm.RMSNorm`: statistics in float32 (float64 for float64
input), the output in the input's dtype, weight and bias replicated across TP and marked
``sequence_parallel`` when each TP rank's gradient is a partial sum (sequence-parallel
activations), so that ``finalize_model_grads`` all-reduces both over TP. With
``zero_centered_gamma`` the scale is ``1 + weight`` (weight initialised to zeros); the bias
starts at zero either way.
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels import layer_norm
from shardwork.models.module import ShardedModule
from shardwork.models.sharding import describe_param
from shardwork.parallel_state import ParamMeta, ProcessGroups

__all__ = ["LayerNorm"]


class LayerNorm(ShardedModule):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over a last dim of ``size``."""

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
        meta = ParamMeta(sequence_parallel=partial_grad)
        self.weight = describe_param(
            torch.nn.Parameter(torch.empty(size, dtype=params_dtype, device=device)),
            meta,
            init="zeros" if zero_centered_gamma else "ones",
        )
        self.bias = describe_param(
            torch.nn.Parameter(torch.empty(size, dtype=params_dtype, device=device)),
            meta,
            init="zeros",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(
            x,
            self.weight.to(x.dtype),
            self.bias.to(x.dtype),
            eps=self.eps,
            zero_centered_gamma=self.zero_centered_gamma,
            backend=self.backend,
        )
