"""LoRA on grouped MoE experts: every expert its own ``A`` and ``B``, EP-sharded like the experts.

A stacked expert weight ``[L, out, in]`` (this rank's ``L`` experts) gets stacked factors
``A [L, r, in]`` and ``B [L, out, r]``; each grouped GEMM's rows stay with their expert, so the
adapter path is two more grouped GEMMs. Checkpoint keys are per expert, like the base's
(``...linear_fc1.lora_A.weight.<e>``, ``...linear_fc1.lora_B.weight.<e>.gate``):
:class:`LoRAExpertShards` describes them (global ``[r, in]`` / ``[out, r]`` per expert) and
draws their layout-independent initial values (uniform for ``A``, zeros for ``B``).

Expert tensor parallelism (etp > 1) is refused by ``apply_lora``: fc1's ``A`` would be
replicated over etp while ``B`` is split, and its gradient would need an etp reduction that the
optimizer does not do for expert parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardwork.models.lora_linear import LoRALinearMixin
from shardwork.models.moe.experts import ExpertLinear, ExpertShards
from shardwork.models.rng import TENSOR_PARALLEL
from shardwork.models.sharding import normal_slice

__all__ = ["LoRAExpertLinear", "LoRAExpertShards"]


@dataclass(frozen=True)
class LoRAExpertShards(ExpertShards):
    """:class:`ExpertShards` of an adapter factor, with the adapter's init."""

    bound: float | None = None
    """``U(-bound, bound)`` initial values (``A``); None: zeros (``B``)."""

    @torch.no_grad()
    def init_param(
        self, param: torch.Tensor, key: str, *, init_seed: int, std: float, num_layers: int
    ) -> None:
        """Uniform (``A``) or zero (``B``) values per expert key, this rank's slice only."""
        for k, view, gshape, off in self._pieces(param, key):
            if self.bound is None:
                view.zero_()
                continue
            unit = normal_slice(
                init_seed,
                k,
                gshape,
                off,
                tuple(view.shape),
                axis=self.ffn_axis - 1,
                draw=torch.rand,
            )
            view.copy_(((2.0 * unit - 1.0) * self.bound).to(view.dtype))


class LoRAExpertLinear(LoRALinearMixin, ExpertLinear):
    """Stacked expert weight plus per-expert adapters."""

    def forward(
        self, x_NI: torch.Tensor, counts_L: torch.Tensor, mode: str, backend: str | None = None
    ) -> torch.Tensor:
        y = super().forward(x_NI, counts_L, mode, backend)
        if self.lora_merged:
            return y
        # Token rows differ per EP rank (and per expert), so dropout draws per-rank masks.
        x = self.lora_input(x_NI, TENSOR_PARALLEL)
        # A forced grouped_mm needs 16-byte rows, which an r-wide factor may not have; the
        # adapter GEMMs are small, so they fall back to the padded bmm where needed.
        small = "batched" if mode == "batched" else "auto"
        h = self.lora_A(x, counts_L, small)
        delta = self.lora_B(h, counts_L, small)
        return y + self.lora_scaling * delta
