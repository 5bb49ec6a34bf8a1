"""Shape terms of the layer options that every calculator shares (one place, so the parameter,
FLOPs and memory formulas cannot disagree about them).

- :func:`mlp_matrices`: ``h×f`` matrices of a dense MLP, 3 for SwiGLU (gate, up, down), 2 for
  the squared-ReLU and GELU MLPs (up, down).
- :func:`query_blocks`: query-sized (``a·d``) blocks of the fused QKV projection, 2 with the
  attention output gate (Q and the gate), else 1; the projection has ``(q·a + 2g)·d`` outputs.
- :func:`mlp_bias_params`: the dense MLP's bias elements on one TP rank with ``add_mlp_bias``,
  ``(m − 1)·f/tp`` (``fc1``, split) ``+ h`` (``fc2``, replicated).
- :func:`norms_per_part`: ``h``-wide norms around each layer part, 2 with ``sandwich_norm``
  (pre- and post-norm), else 1.
- :func:`attended_keys`: keys a query attends to on average in one layer (the attention
  FLOPs' sequence term): ``s·c`` (``c = 1/2`` causal), or for a causal sliding-window layer with
  window ``W < s`` the mean of ``min(i + 1, W)``, ``W − W²/(2s)`` in the same continuous
  convention (it equals ``s/2`` at ``W = s``); a non-causal layer attends ``min(s, W)`` keys.
- :func:`norm_params`: elements of one norm over ``h``, ``h`` (RMSNorm) or ``2h`` (LayerNorm's
  weight and bias); replicated over TP.
- :func:`proj_bias_params`: attention's output-projection bias, ``h`` with ``add_proj_bias``
  (replicated).
- :func:`position_params`: the learned position table, ``max_position_embeddings·h`` with
  ``position_embedding_type="learned_absolute"`` (replicated, first pipeline stage).
- :func:`head_columns`: the vocabulary columns a training head multiplies: the real ``V`` with
  ``fused_linear_cross_entropy`` (it skips the padding rows), else the padded ``V_pad``.
"""

from __future__ import annotations

from shardwork.models.config import GPTConfig
from shardwork.models.layer_options import is_sliding_window_layer

__all__ = [
    "attended_keys",
    "head_columns",
    "mlp_bias_params",
    "mlp_matrices",
    "norm_params",
    "norms_per_part",
    "position_params",
    "proj_bias_params",
    "query_blocks",
]


def mlp_matrices(config: GPTConfig) -> int:
    """``h×f`` weight matrices of one dense MLP."""
    return 2 if config.mlp_activation in ("relu2", "gelu_tanh") else 3


def query_blocks(config: GPTConfig) -> int:
    """Blocks of ``a·d`` outputs in the QKV projection (Q, plus the gate when gated)."""
    return 2 if config.attention_output_gate else 1


def mlp_bias_params(config: GPTConfig, tp: int = 1) -> int:
    """Bias elements of one dense MLP on a TP rank (0 without ``add_mlp_bias``)."""
    if not config.add_mlp_bias:
        return 0
    return (mlp_matrices(config) - 1) * config.ffn_hidden_size // tp + config.hidden_size


def norms_per_part(config: GPTConfig) -> int:
    """Norms of width ``h`` per layer part (mixer or MLP): 2 with sandwich norms, else 1."""
    return 2 if config.sandwich_norm else 1


def attended_keys(config: GPTConfig, layer: int, seq_length: int, causal: bool) -> float:
    """Mean keys per query of decoder layer ``layer`` (see module docstring)."""
    s = seq_length
    if not is_sliding_window_layer(config, layer) or config.sliding_window >= s:
        return s * (0.5 if causal else 1.0)
    w = config.sliding_window
    return w - w * w / (2 * s) if causal else float(w)


def norm_params(config: GPTConfig) -> int:
    """Elements of one norm over the hidden size (weight, and LayerNorm's bias)."""
    return config.hidden_size * (2 if config.normalization == "layernorm" else 1)


def proj_bias_params(config: GPTConfig) -> int:
    """Elements of attention's output-projection bias (0 without ``add_proj_bias``)."""
    return config.hidden_size if config.add_proj_bias else 0


def position_params(config: GPTConfig) -> int:
    """Elements of the learned position table (0 unless ``learned_absolute``)."""
    if config.position_embedding_type != "learned_absolute":
        return 0
    return config.max_position_embeddings * config.hidden_size


def head_columns(config: GPTConfig) -> int:
    """Vocabulary columns of the training head's GEMMs (see module docstring)."""
    return config.vocab_size if config.fused_linear_cross_entropy else config.padded_vocab_size
