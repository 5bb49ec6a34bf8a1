"""LoRA versions of the parallel linears: ``y = W x + scaling · B (A dropout(x))``, TP-correct.

:func:`shardwork.models.lora.apply_lora` turns a matched linear into the LoRA subclass of its
own class *in place* (same object, same base parameters), so references held elsewhere (the
attention block's, the optimizer's) stay valid, and adds two children, ``lora_A`` and
``lora_B``, each holding a ``weight``: checkpoint keys read ``P.lora_A.weight`` and
``P.lora_B.weight[.block]`` (:func:`shardwork.models.lora_config.lora_key_names`).

How each kind is split over tensor parallelism (no rank ever gathers the base weight):

- Column-parallel base ``W [out/tp, in]``: ``B [out/tp, r]`` is split along the output axis
  exactly like ``W`` (a fused ``[q | k | v]`` or ``[gate | up]`` base gives ``B`` the same
  per-rank blocks), ``A [r, in]`` is replicated. ``A x`` is computed on the layer's *input*
  (this rank's sequence chunk under SP) and then enters the TP region the way the input does:
  all-gathered along the sequence under SP (backward reduce-scatter), else copied (backward
  all-reduce, since every rank's ``B`` slice contributes to ``A x``'s gradient). Under SP, ``A``
  sees only this rank's tokens, so its ParamMeta is ``sequence_parallel`` (gradient all-reduced
  over TP, like a norm weight).
- Row-parallel base ``W [out, in/tp]``: ``A [r, in/tp]`` is split along the input axis like
  ``W``; ``A x`` is a partial sum over TP and is reduced like the base's partial output
  (all-reduce, or reduce-scatter along the sequence under SP) before the replicated
  ``B [out, r]``; under SP ``B``'s gradient comes from this rank's tokens only, so it is
  ``sequence_parallel`` (the row-parallel bias's rule).
- Replicated base (MLA's down projections): ``A`` and ``B`` replicated, no collective.

The extra collectives move ``r``-wide activations (``r`` ≪ hidden), never weights.

Dropout draws from the model's RNG tracker: the ``replicated`` stream where the adapter's input
is the same on every TP rank (column-parallel without SP, replicated linears), the
``tensor_parallel`` stream where it differs (row-parallel inputs, SP chunks).

Merge (:meth:`LoRALinearMixin.merge_lora`) adds ``scaling · B @ A`` to this rank's base shard
(the shapes agree per rank for every kind) after keeping a copy of the shard; unmerge copies
the kept shard back, bit-exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shardwork.fused_kernels import linear
from shardwork.models.lora_config import LoRAConfig
from shardwork.models.mla import ReplicatedLinear
from shardwork.models.module import ShardedModule
from shardwork.models.moe.experts import grouped_linear
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.models.rng import REPLICATED, TENSOR_PARALLEL, RNGTracker

__all__ = [
    "LoRAColumnParallelLinear",
    "LoRAFactor",
    "LoRALinearMixin",
    "LoRAReplicatedLinear",
    "LoRARowParallelLinear",
]


class LoRAFactor(ShardedModule):
    """Holds one adapter factor as ``weight`` (so its key reads ``P.lora_A.weight``).

    The LoRA linears *call* it rather than read ``weight``: forward pre-hooks on it then run
    before the factor is used (DDP's wait for an overlapped ZeRO parameter all-gather hooks
    the module that owns the parameter)."""

    def __init__(self, groups, weight: torch.nn.Parameter) -> None:
        super().__init__(groups)
        self.weight = weight

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor | None = None, mode: str = "auto"
    ) -> torch.Tensor:
        """``x @ weightᵀ``; stacked expert factors with ``counts`` rows per local expert."""
        if counts is None:
            return F.linear(x, self.weight.to(x.dtype))
        return grouped_linear(x, self.weight.to(x.dtype), counts, mode=mode)


class LoRALinearMixin:
    """Adapter state and merge/unmerge shared by every LoRA linear (see module docstring)."""

    lora_A: LoRAFactor  # noqa: N815 (PEFT's and the checkpoint keys' name)
    lora_B: LoRAFactor  # noqa: N815
    lora_config: LoRAConfig
    lora_rng: RNGTracker | None
    lora_kept_base: torch.Tensor | None
    weight: torch.nn.Parameter
    training: bool

    def attach_lora(
        self, a: LoRAFactor, b: LoRAFactor, config: LoRAConfig, rng: RNGTracker | None
    ) -> None:
        """Give this (already converted) module its factors and options."""
        self.lora_A, self.lora_B = a, b
        self.lora_config = config
        self.lora_rng = rng
        self.lora_kept_base = None

    @property
    def lora_scaling(self) -> float:
        return self.lora_config.scaling

    @property
    def lora_merged(self) -> bool:
        return self.lora_kept_base is not None

    def lora_input(self, x: torch.Tensor, stream: str) -> torch.Tensor:
        """``x`` with the adapter's dropout (training only), drawn from RNG stream ``stream``."""
        p = self.lora_config.dropout
        if p == 0.0 or not self.training:
            return x
        if self.lora_rng is None:
            return F.dropout(x, p, training=True)
        with self.lora_rng.fork(stream):
            return F.dropout(x, p, training=True)

    def lora_delta(self) -> torch.Tensor:
        """``scaling · B @ A`` for this rank's base shard (batched for stacked experts)."""
        b, a = self.lora_B.weight.detach(), self.lora_A.weight.detach()
        return self.lora_scaling * torch.matmul(b.to(self.weight.dtype), a.to(self.weight.dtype))

    @torch.no_grad()
    def merge_lora(self) -> None:
        """Fold the adapter into the base shard, keeping the shard to restore it exactly."""
        if self.lora_merged:
            raise RuntimeError("merge_lora: this module's adapter is already merged")
        self.lora_kept_base = self.weight.detach().clone()
        self.weight.add_(self.lora_delta())

    @torch.no_grad()
    def unmerge_lora(self) -> None:
        """Restore the base shard kept by :meth:`merge_lora` (bit-exact)."""
        if not self.lora_merged:
            raise RuntimeError("unmerge_lora: this module's adapter is not merged")
        self.weight.copy_(self.lora_kept_base)
        self.lora_kept_base = None


class LoRAColumnParallelLinear(LoRALinearMixin, ColumnParallelLinear):
    """Column-parallel linear plus ``B`` split like its output, ``A`` replicated."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if self.lora_merged:
            return super().forward(x, weight)
        if weight is not None:
            raise RuntimeError("a LoRA column-parallel linear cannot take a tied weight")
        stream = TENSOR_PARALLEL if self.sequence_parallel else REPLICATED
        # The adapter's r-wide activation enters the TP region like the input does (see the
        # module docstring): gathering h instead of x keeps A's input this rank's own tokens.
        h = self.lora_A(self.lora_input(x, stream))
        h = self.enter_tp_region(h)
        x = self.enter_tp_region(x)
        b = None if self.bias is None else self.bias.to(x.dtype)
        y = linear(x, self.weight.to(x.dtype), b, backend=self.kernel_backend)
        y = y + self.lora_scaling * self.lora_B(h)
        return self._leave_tp_region(y)


class LoRARowParallelLinear(LoRALinearMixin, RowParallelLinear):
    """Row-parallel linear plus ``A`` split like its input, ``B`` replicated."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora_merged:
            return super().forward(x)
        y = self._reduce_partial(linear(x, self.weight.to(x.dtype), backend=self.kernel_backend))
        # A's product is a partial sum over this rank's input slice, reduced like the base's.
        h = self.lora_A(self.lora_input(x, TENSOR_PARALLEL))
        h = self._reduce_partial(h)
        y = y + self.lora_scaling * self.lora_B(h)
        return self._add_bias(y)


class LoRAReplicatedLinear(LoRALinearMixin, ReplicatedLinear):
    """Replicated linear (MLA down projections) plus replicated ``A`` and ``B``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        if self.lora_merged:
            return y
        h = self.lora_A(self.lora_input(x, REPLICATED))
        return y + self.lora_scaling * self.lora_B(h)
