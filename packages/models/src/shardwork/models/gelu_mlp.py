"""GELU MLP (GPT-2, Megatron's classic GPT): ``fc2(gelu_tanh(fc1(x)))``, not gated.

The tanh approximation of GELU (Hendrycks and Gimpel 2016; GPT-2's ``gelu_new``,
``F.gelu(approximate="tanh")``). The two linears are those of
:class:`~shardwork.models.squared_relu_mlp.SquaredReLUMLP` (``fc1`` column-parallel with
``ffn_hidden_size`` outputs, ``fc2`` row-parallel; biases with ``config.add_mlp_bias``; keys
``mlp.fc1.*`` / ``mlp.fc2.*``); only the activation differs. It is elementwise, so each TP rank
applies it to its own slice. Registered as the MLP kind ``"gelu"``; ``spec_for`` picks it when
``GPTConfig.mlp_activation == "gelu_tanh"``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwork.models.squared_relu_mlp import SquaredReLUMLP

__all__ = ["GeLUMLP"]


class GeLUMLP(SquaredReLUMLP):
    """``fc2(gelu_tanh(fc1(x)))`` with tensor (and sequence) parallelism."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h]`` -> same shape."""
        # fc1 -> [s, b, f/tp] -> GELU (elementwise, per rank) -> fc2 -> [s(/tp), b, h].
        return self.fc2(F.gelu(self.fc1(hidden), approximate="tanh"))
