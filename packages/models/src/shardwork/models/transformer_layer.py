"""Pre-norm transformer layer and the block of a pipeline stage's layers.

- ``TransformerLayer``: ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))``; hidden
  dropout draws from the replicated RNG stream (activations whole on every TP rank) or, under
  sequence parallelism, the TP-distinct stream (activations are sequence shards).
- ``TransformerBlock``: the layers ``layer_range = (start, stop)`` of the global stack (a
  pipeline stage or virtual chunk) plus the final norm when it is the last stage. Checkpoint
  keys use global layer numbers (``decoder.layers.<global index>...``), so stages of any pp
  split save into one layout-free namespace. ``recompute="full"`` checkpoints whole layers
  (``replay``: the model's :class:`~shardwork.models.recompute.RecomputeReplay`, so MoE
  routers count once per real forward).
- The MLP is built by ``mlp_factory(layer_index)`` when given (the MoE work plugs in here).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from shardwork.models.attention import Attention, AttentionInputs
from shardwork.models.config import GPTConfig
from shardwork.models.mla import MLAttention
from shardwork.models.mlp import SwiGLUMLP
from shardwork.models.module import ShardedModule
from shardwork.models.norm import RMSNorm
from shardwork.models.recompute import RecomputeReplay, checkpoint
from shardwork.models.rng import REPLICATED, TENSOR_PARALLEL, RNGTracker
from shardwork.parallel_state import ProcessGroups

__all__ = ["TransformerBlock", "TransformerLayer"]


def _norm(config: GPTConfig, groups: ProcessGroups, device) -> RMSNorm:
    return RMSNorm(
        config.hidden_size,
        groups=groups,
        eps=config.norm_epsilon,
        backend=config.kernel_backend,
        partial_grad=config.sequence_parallel,
        params_dtype=config.params_dtype,
        device=device,
    )


def hidden_dropout(x: torch.Tensor, p: float, *, training: bool, rng: RNGTracker, sp: bool):
    """Dropout on hidden states from the right RNG stream (see module docstring)."""
    if p == 0.0 or not training:
        return x
    with rng.fork(TENSOR_PARALLEL if sp else REPLICATED):
        return F.dropout(x, p=p, training=True)


class TransformerLayer(ShardedModule):
    """One pre-norm attention + MLP layer; ``layer_number`` is its global index."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        layer_number: int,
        rng: RNGTracker,
        mlp: torch.nn.Module | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        self.layer_number = layer_number
        self.rng = rng
        self.dropout = config.hidden_dropout
        self.sp = config.sequence_parallel
        self.input_layernorm = _norm(config, groups, device)
        if config.mla is not None:  # multi-head latent attention (DeepSeek)
            self.self_attention = MLAttention(config, groups, rng=rng, device=device)
        else:
            self.self_attention = Attention(config, groups, rng=rng, device=device)
        self.pre_mlp_layernorm = _norm(config, groups, device)
        self.mlp = mlp if mlp is not None else SwiGLUMLP(config, groups, device=device)

    def forward(self, hidden: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        drop = dict(training=self.training, rng=self.rng, sp=self.sp)
        attn = self.self_attention(self.input_layernorm(hidden), inputs)
        hidden = hidden + hidden_dropout(attn, self.dropout, **drop)
        mlp = self.mlp(self.pre_mlp_layernorm(hidden))
        return hidden + hidden_dropout(mlp, self.dropout, **drop)


class TransformerBlock(ShardedModule):
    """Layers ``[start, stop)`` of the decoder, and the final norm if ``final_norm``."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        layer_range: tuple[int, int],
        final_norm: bool,
        rng: RNGTracker,
        mlp_factory: Callable[[int], torch.nn.Module] | None = None,
        replay: RecomputeReplay | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        start, stop = layer_range
        self.replay = replay
        self.layer_range = (start, stop)
        self.rng = rng
        self.full_recompute = config.recompute == "full"
        self.layers = torch.nn.ModuleList(
            TransformerLayer(
                config,
                groups,
                layer_number=i,
                rng=rng,
                mlp=None if mlp_factory is None else mlp_factory(i),
                device=device,
            )
            for i in range(start, stop)
        )
        self.final_norm = _norm(config, groups, device) if final_norm else None

    def _child_prefix(self, name: str, index: int | None = None) -> str:
        if name == "layers" and index is not None:
            return f"layers.{self.layer_range[0] + index}"
        return super()._child_prefix(name, index)

    def forward(self, hidden: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        for layer in self.layers:
            if self.full_recompute and self.training:
                hidden = checkpoint(
                    lambda h, lyr=layer: lyr(h, inputs), self.rng, hidden, replay=self.replay
                )
            else:
                hidden = layer(hidden, inputs)
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return hidden
