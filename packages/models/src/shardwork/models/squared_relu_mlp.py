"""Squared-ReLU MLP (Nemotron-H ``mlp_hidden_act="relu2"``): ``fc2(relu(fc1(x))²)``, not gated.

``fc1`` is column-parallel (``ffn_hidden_size`` outputs, split over TP; key ``mlp.fc1.weight``),
``fc2`` row-parallel with the scaled init of output layers (key ``mlp.fc2.weight``); both have
biases with ``config.add_mlp_bias`` (Nemotron-H's ``mlp_bias``). An MoE layer's shared expert
(Nemotron-H's ``shared_experts``) is this class too, with its own width and no biases. The
activation is elementwise, so each TP rank applies it to its own slice and the only
communication is the one of the two linears (and of sequence parallelism around them).
Registered as the MLP kind ``"relu2"``; ``spec_for`` picks it when
``GPTConfig.mlp_activation == "relu2"``.
"""

from __future__ import annotations

import torch

from shardwork.models.config import GPTConfig
from shardwork.models.module import ShardedModule
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.parallel_state import ProcessGroups

__all__ = ["SquaredReLUMLP"]


class SquaredReLUMLP(ShardedModule):
    """``fc2(relu(fc1(x))²)`` with tensor (and sequence) parallelism."""

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
        self.fc1 = ColumnParallelLinear(
            config.hidden_size,
            ffn,
            groups=groups,
            bias=bias,
            sequence_parallel=config.sequence_parallel,
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
        # fc1 -> [s, b, f/tp] -> relu² (elementwise, per rank) -> fc2 -> [s(/tp), b, h].
        return self.fc2(torch.relu(self.fc1(hidden)).square())
