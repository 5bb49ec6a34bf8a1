"""Pre-norm transformer layer and the block of a pipeline stage's layers.

- ``TransformerLayer``: ``x + drop(attn(norm(x)))`` then ``x + drop(mlp(norm(x)))`` (a hybrid
  stack's layer holds only one of the two, each with its own norm and residual); with
  ``config.sandwich_norm`` (Gemma) each part's output is normalised again before the dropout
  and residual add, ``x + drop(post_norm(attn(norm(x))))``; hidden
  dropout draws from the replicated RNG stream (activations whole on every TP rank) or, under
  sequence parallelism, the TP-distinct stream (activations are sequence shards).
- ``TransformerBlock``: the layers ``layer_range = (start, stop)`` of the global stack (a
  pipeline stage or virtual chunk) plus the final norm when it is the last stage. Checkpoint
  keys use global layer numbers (``decoder.layers.<global index>...``), so stages of any pp
  split save into one layout-free namespace. ``recompute="full"`` checkpoints whole layers
  (``replay``: the model's :class:`~shardwork.models.recompute.RecomputeReplay`, so MoE
  routers count once per real forward).
- The layer is generic: its mixer, MLP and norms are built from a
  :class:`~shardwork.models.spec.LayerSpec` by :func:`build_layer` through the registries of
  :mod:`shardwork.models.layer_kinds`; the block builds its range of the global
  :class:`~shardwork.models.spec.DecoderSpec` layers. Submodule names (``self_attention``,
  ``mlp``, ``input_layernorm``, ``pre_mlp_layernorm``, ``post_attention_layernorm``,
  ``post_mlp_layernorm``, ``final_norm``) are the checkpoint keys
  whatever the kind, so state-dict keys do not depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from shardwork.models.attention import AttentionInputs
from shardwork.models.config import GPTConfig
from shardwork.models.layer_kinds import BuildContext, build_mixer, build_mlp, build_norm
from shardwork.models.module import ShardedModule
from shardwork.models.recompute import RecomputeReplay, checkpoint
from shardwork.models.rng import REPLICATED, TENSOR_PARALLEL, RNGTracker
from shardwork.models.spec import LayerSpec
from shardwork.parallel_state import ProcessGroups

__all__ = ["TransformerBlock", "TransformerLayer", "build_layer"]


def hidden_dropout(x: torch.Tensor, p: float, *, training: bool, rng: RNGTracker, sp: bool):
    """Dropout on hidden states from the right RNG stream (see module docstring)."""
    if p == 0.0 or not training:
        return x
    # Under SP each TP rank holds different tokens, so masks must differ per rank; without SP every
    # TP rank holds the same hidden states and must drop the same elements, or the replicas diverge.
    with rng.fork(TENSOR_PARALLEL if sp else REPLICATED):
        return F.dropout(x, p=p, training=True)


class TransformerLayer(ShardedModule):
    """One pre-norm mixer + MLP layer (or just one of them); ``layer_number`` is its global
    index."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        layer_number: int,
        rng: RNGTracker,
        mixer: torch.nn.Module | None,
        mlp: torch.nn.Module | None,
        norms: tuple[torch.nn.Module | None, torch.nn.Module | None],
        post_norms: tuple[torch.nn.Module | None, torch.nn.Module | None] = (None, None),
    ) -> None:
        """``norms``: the pre-mixer and pre-MLP norms (None with an absent part);
        ``post_norms``: the norms of the mixer's and the MLP's outputs (sandwich norms), None
        without them."""
        super().__init__(groups)
        self.layer_number = layer_number
        self.rng = rng
        self.dropout = config.hidden_dropout
        self.sp = config.sequence_parallel
        # Registration order (norm, mixer, norm, MLP) fixes the parameter order, which the
        # gradient buffers and the norm reductions follow.
        self.input_layernorm = norms[0]
        self.self_attention = mixer
        self.post_attention_layernorm = post_norms[0]
        self.pre_mlp_layernorm = norms[1]
        self.mlp = mlp
        self.post_mlp_layernorm = post_norms[1]

    def forward(self, hidden: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        drop = dict(training=self.training, rng=self.rng, sp=self.sp)
        if self.self_attention is not None:
            attn = self.self_attention(self.input_layernorm(hidden), inputs)
            if self.post_attention_layernorm is not None:
                attn = self.post_attention_layernorm(attn)
            hidden = hidden + hidden_dropout(attn, self.dropout, **drop)
        if self.mlp is not None:
            mlp = self.mlp(self.pre_mlp_layernorm(hidden))
            if self.post_mlp_layernorm is not None:
                mlp = self.post_mlp_layernorm(mlp)
            hidden = hidden + hidden_dropout(mlp, self.dropout, **drop)
        return hidden


def build_layer(spec: LayerSpec, ctx: BuildContext, layer_number: int) -> TransformerLayer:
    """The layer ``spec`` describes, as global layer ``layer_number``."""
    mlp = None if spec.mlp is None else build_mlp(spec.mlp, ctx, layer_number)
    mixer = None if spec.mixer is None else build_mixer(spec.mixer, ctx, layer_number)
    h = ctx.config.hidden_size
    norms = tuple(None if part is None else build_norm(spec.norm, ctx, h) for part in (mixer, mlp))
    post_norms = (None, None)
    if ctx.config.sandwich_norm:
        post_norms = tuple(
            None if part is None else build_norm(spec.norm, ctx, h) for part in (mixer, mlp)
        )
    return TransformerLayer(
        ctx.config,
        ctx.groups,
        layer_number=layer_number,
        rng=ctx.rng,
        mixer=mixer,
        mlp=mlp,
        norms=norms,
        post_norms=post_norms,
    )


class TransformerBlock(ShardedModule):
    """Layers ``[start, stop)`` of the decoder, and the final norm if ``final_norm``."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        layer_range: tuple[int, int],
        final_norm: str | None,
        rng: RNGTracker,
        specs: Sequence[LayerSpec],
        ctx: BuildContext,
        replay: RecomputeReplay | None = None,
    ) -> None:
        """``specs``: the global stack's layer specs (this block builds ``specs[start:stop]``);
        ``final_norm``: the kind of the norm after the last layer, None on earlier stages."""
        super().__init__(groups)
        start, stop = layer_range
        self.replay = replay
        self.layer_range = (start, stop)
        self.rng = rng
        self.full_recompute = config.recompute == "full"
        self.layers = torch.nn.ModuleList(build_layer(specs[i], ctx, i) for i in range(start, stop))
        self.final_norm = (
            None if final_norm is None else build_norm(final_norm, ctx, config.hidden_size)
        )

    def _child_prefix(self, name: str, index: int | None = None) -> str:
        if name == "layers" and index is not None:
            return f"layers.{self.layer_range[0] + index}"
        return super()._child_prefix(name, index)

    def forward(self, hidden: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        for layer in self.layers:
            if self.full_recompute and self.training:
                # lyr=layer binds this iteration's layer: the recompute runs in backward, after
                # the loop ended.
                hidden = checkpoint(
                    lambda h, lyr=layer: lyr(h, inputs), self.rng, hidden, replay=self.replay
                )
            else:
                hidden = layer(hidden, inputs)
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        return hidden
