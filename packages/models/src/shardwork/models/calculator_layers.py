"""Shape terms of the layer options that every calculator shares (one place, so the parameter,
FLOPs and memory formulas cannot disagree about them).

- :func:`mlp_matrices`: ``h×f`` matrices of a dense MLP, 3 for SwiGLU (gate, up, down), 2 for
  the squared-ReLU MLP (up, down).
- :func:`query_blocks`: query-sized (``a·d``) blocks of the fused QKV projection, 2 with the
  attention output gate (Q and the gate), else 1; the projection has ``(q·a + 2g)·d`` outputs.
- :func:`mlp_bias_params`: the dense MLP's bias elements on one TP rank with ``add_mlp_bias``,
  ``(m − 1)·f/tp`` (``fc1``, split) ``+ h`` (``fc2``, replicated).
"""

from __future__ import annotations

from shardwork.models.config import GPTConfig

__all__ = ["mlp_bias_params", "mlp_matrices", "query_blocks"]


def mlp_matrices(config: GPTConfig) -> int:
    """``h×f`` weight matrices of one dense MLP."""
    return 2 if config.mlp_activation == "relu2" else 3


def query_blocks(config: GPTConfig) -> int:
    """Blocks of ``a·d`` outputs in the QKV projection (Q, plus the gate when gated)."""
    return 2 if config.attention_output_gate else 1


def mlp_bias_params(config: GPTConfig, tp: int = 1) -> int:
    """Bias elements of one dense MLP on a TP rank (0 without ``add_mlp_bias``)."""
    if not config.add_mlp_bias:
        return 0
    return (mlp_matrices(config) - 1) * config.ffn_hidden_size // tp + config.hidden_size
