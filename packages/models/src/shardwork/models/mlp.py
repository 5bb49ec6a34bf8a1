"""Gated MLP: column-parallel fused [gate | up], ``shardwork.fused_kernels.swiglu`` (or ``geglu``
with ``mlp_activation="geglu"``: GELU with the tanh approximation, Gemma), row-parallel down.

``fc1`` has blocks ``gate`` and ``up`` (each ``ffn_hidden_size``); a TP rank holds its slice of
each, laid out ``[gate_local | up_local]`` which is exactly the fused layout ``swiglu`` takes.
With ``config.add_mlp_bias`` (dense models only: GPTConfig refuses it with ``moe``, whose shared
experts are this class too) ``fc1`` has a bias with the same blocks and ``fc2`` a replicated
one.
"""

from __future__ import annotations

import torch

from shardwork.fused_kernels import geglu, swiglu
from shardwork.models.config import GPTConfig
from shardwork.models.module import ShardedModule
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.parallel_state import ProcessGroups

__all__ = ["SwiGLUMLP"]


class SwiGLUMLP(ShardedModule):
    """``fc2(act(gate(x)) * up(x))`` (act: SiLU, or tanh-GELU for GeGLU) with tensor (and
    sequence) parallelism."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        ffn_hidden_size: int | None = None,
        bias: bool | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        ffn = ffn_hidden_size or config.ffn_hidden_size
        bias = config.add_mlp_bias if bias is None else bias
        self.backend = config.kernel_backend
        self.activation = geglu if config.mlp_activation == "geglu" else swiglu
        self.fc1 = ColumnParallelLinear(
            config.hidden_size,
            2 * ffn,
            groups=groups,
            bias=bias,
            sequence_parallel=config.sequence_parallel,
            partition_sizes=(ffn, ffn),
            block_names=("gate", "up"),
            params_dtype=config.params_dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )
        self.fc2 = RowParallelLinear(
            ffn,
            config.hidden_size,
            groups=groups,
            bias=bias,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h]`` -> same shape."""
        # fc1 -> [s, b, 2f/tp] ([gate_local | up_local]) -> swiglu/geglu -> [s, b, f/tp] -> fc2
        # -> [s(/tp), b, h].
        # fc1's output feeds only the activation, so the activation's backward writes its
        # gradient into that buffer (inplace_backward) instead of allocating another.
        h = self.activation(self.fc1(hidden), inplace_backward=True, backend=self.backend)
        return self.fc2(h)
