"""Vocabulary-parallel input embedding and LM head, tied or untied, with a padded vocabulary.

- Rows are padded to ``GPTConfig.padded_vocab_size`` (a multiple of
  ``make_vocab_size_divisible_by``, independent of tp) and split over TP in equal contiguous
  ranges. Padding rows start at zero, are never looked up, and the head's padded logits are
  set to the dtype's lowest value, so softmax/loss ignore them and gradients there are zero.
  Only the ``vocab_size`` real rows are saved (``real_rows`` in the parameter description).
- VocabParallelEmbedding: ids outside this rank's range are looked up as row 0 and zeroed,
  then the partial embeddings are all-reduced over TP (reduce-scattered along the sequence
  under SP). Output ``[s, b, h]``, times ``sqrt(h)`` with ``config.scale_embedding`` (Gemma:
  the factor rounded to float32, then to the weight's dtype, as transformers multiplies).
- LMHead: column-parallel projection to ``[s, b, V_pad/tp]`` logits, soft-capped when
  ``config.final_logit_softcapping`` is set (Gemma 2). ``LMHead.forward`` gives the logits
  (inference, ``gather_logits``, the unfused loss); ``LMHead.token_loss`` gives the training
  loss without them (fused linear cross-entropy, :func:`~shardwork.models.loss.linear_token_loss`)
  with the same cap and padding passed to the op, so both paths see the same capped logits
  over the real vocabulary. Tied on a stage that
  also holds the embedding, it uses the embedding's weight; tied on a later pipeline stage
  (pp > 1) it owns a copy with the embedding's key (same init values, ``shared_embedding``
  in its ParamMeta, saved as a replica) that ``finalize_model_grads`` keeps in sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.models.config import GPTConfig
from shardwork.models.loss import linear_token_loss
from shardwork.models.module import ShardedModule
from shardwork.models.parallel_linear import ColumnParallelLinear
from shardwork.models.sharding import describe_param, param_shards
from shardwork.models.softcap import soft_cap
from shardwork.parallel_state import (
    ParamMeta,
    ProcessGroups,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
)

__all__ = ["EMBEDDING_KEY", "LMHead", "VocabParallelEmbedding"]

EMBEDDING_KEY = "embedding.word_embeddings.weight"


class VocabParallelEmbedding(ShardedModule):
    """Token embedding with rows split over TP (see module docstring)."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        tp = groups.size("tp")
        self.vocab_size = config.vocab_size
        self.rows_per_rank = config.padded_vocab_size // tp
        self.vocab_start = self.rows_per_rank * groups.rank("tp")
        self.sequence_parallel = config.sequence_parallel
        # transformers builds the factor as a float32 tensor and casts it to the weight's dtype.
        self.scale = (
            torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
            if config.scale_embedding
            else None
        )
        # MTP on the last stage holds a copy of the embedding too (shardwork.models.mtp)
        shared = (config.tie_word_embeddings or config.mtp is not None) and groups.size("pp") > 1
        self.weight = describe_param(
            torch.nn.Parameter(
                torch.empty(
                    (self.rows_per_rank, config.hidden_size),
                    dtype=config.params_dtype,
                    device=device,
                )
            ),
            ParamMeta(tp_axis=0, shared_embedding=shared),
            init="normal",
            real_rows=config.vocab_size,
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids [b, s]`` -> ``[s(/tp under SP), b, h]`` in the parameter dtype."""
        out = self._lookup(input_ids)
        if self.scale is not None:
            out = out * self.scale.to(device=out.device, dtype=out.dtype)
        return out

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.transpose(0, 1)
        if self.groups.size("tp") == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.rows_per_rank)
        # Out-of-range ids look up row 0 (a valid index) and are zeroed: after the sum over TP each
        # token's embedding comes from the one rank that owns its row.
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            # Under SP the sum over TP and the split along the sequence happen in one
            # reduce-scatter.
            return reduce_scatter_to_sequence_region(out, self.groups.tp, dim=0)
        return reduce_from_tp_region(out, self.groups.tp)


class LMHead(ShardedModule):
    """Parallel output layer producing vocab-split logits (see module docstring).

    ``own_weight=False``: the caller passes the (tied) embedding weight to ``forward``.
    """

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        own_weight: bool,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        self.vocab_size = config.vocab_size
        self.padded_vocab_size = config.padded_vocab_size
        self.final_logit_softcapping = config.final_logit_softcapping
        """The cap of this head's logits (None: none); a fused loss must honour it."""
        self.tied_copy = own_weight and config.tie_word_embeddings
        self.linear = ColumnParallelLinear(
            config.hidden_size,
            config.padded_vocab_size,
            groups=groups,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )
        if own_weight:
            describe_param(
                self.linear.weight,
                ParamMeta(tp_axis=0, shared_embedding=self.tied_copy and groups.size("pp") > 1),
                init="normal",
                real_rows=config.vocab_size,
            )
        else:
            del self.linear.weight
            self.linear.register_parameter("weight", None)
        tp = groups.size("tp")
        # Padding sits at the end of the vocabulary, so only the last rank(s) hold padded columns.
        self.local_vocab_start = (config.padded_vocab_size // tp) * groups.rank("tp")

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden [s(/tp), b, h]`` -> logits ``[s, b, V_pad/tp]``, soft-capped if configured;
        padded columns masked."""
        logits = soft_cap(self.linear(hidden, weight), self.final_logit_softcapping)
        local = logits.shape[-1]
        real_here = self.vocab_size - self.local_vocab_start
        if real_here < local:
            mask = torch.arange(local, device=logits.device) >= real_here
            # Lowest finite value: after max-subtraction exp() of it is exactly 0 (zero probability
            # and gradient for padded columns) and no inf enters the arithmetic.
            logits = logits.masked_fill(mask, torch.finfo(logits.dtype).min)
        return logits

    def token_loss(
        self,
        hidden: torch.Tensor,
        labels: torch.Tensor,
        *,
        weight: torch.Tensor | None = None,
        loss_mask: torch.Tensor | None = None,
        grad_in_forward: bool = True,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss_sum, num_tokens)`` of ``hidden [s(/tp), b, h]`` vs ``labels [b, s]``: what
        ``token_loss(self(hidden, weight), labels, ...)`` gives, without the logits.

        ``grad_in_forward``: compute the gradients during the forward (3 GEMMs; holds ``dW``
        until backward) or recompute the logits chunk by chunk in backward (4 GEMMs).
        """
        w = self.linear.weight if weight is None else weight
        x = self.linear.enter_tp_region(hidden)
        return linear_token_loss(
            x,
            # Cast on the fly, as the linear does (fp32 params, bf16 activations).
            w.to(x.dtype),
            labels,
            vocab_size=self.vocab_size,
            loss_mask=loss_mask,
            tp_group=self.groups.tp,
            softcap=self.final_logit_softcapping,
            grad_in_forward=grad_in_forward,
            backend=backend,
        )

    def sharded_state_dict(self, prefix: str = "") -> dict[str, ShardedTensor]:
        if self.linear.weight is None:
            return {}
        if not self.tied_copy:
            return self.linear.sharded_state_dict(prefix)
        # the tied copy on a later pipeline stage is a replica of the embedding
        shards = param_shards(self.linear.weight, EMBEDDING_KEY, self.shard_ctx, replica_offset=1)
        return {st.key: st for st in shards}

    def named_param_keys(self, prefix: str = ""):
        if self.linear.weight is None:
            return
        key = EMBEDDING_KEY if self.tied_copy else f"{prefix}weight"
        yield key, self.linear.weight, self.linear
