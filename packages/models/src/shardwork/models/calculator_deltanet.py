"""Forward FLOPs of one Gated DeltaNet mixer (:class:`~shardwork.models.deltanet.GatedDeltaNetMixer`).

Notation: ``b`` batch, ``s`` sequence, ``h`` hidden, ``Nk``/``Nv`` key/value heads, ``dk``/``dv``
head widths, ``Kd = Nk·dk``, ``Vd = Nv·dv``, ``K`` conv width, ``C`` chunk, ``S = ⌈s/C⌉·C`` (the
padded length the chunked rule works on), one multiply-add = 2 FLOPs. Whole model (tp=1);
tensor parallelism divides every term by tp.

- projections: ``2·b·s·h·(2·Kd + 2·Vd + 2·Nv)`` (in_proj) ``+ 2·b·s·Vd·h`` (out_proj);
- convolution: ``2·b·s·K·(2·Kd + Vd)`` (depthwise, left-padded so only ``s`` outputs);
- delta-rule matmuls, per batch row and value head (q, k repeated to the value heads):
  ``4·S·C·dk`` (the chunks' ``kβ·kᵀ`` and ``q·kᵀ``) ``+ 2·S·C·dv`` (scores × new values)
  ``+ 6·S·dk·dv`` (reading the state twice, writing it once);
- triangular solve: ``(dk + dv)·C·(C-1)`` per chunk, batch row and value head (forward
  substitution on both right-hand sides).

Everything else (L2 norms, gates, exp/softplus, the gated RMSNorm) is elementwise and not
counted, like the attention calculator counts matmuls only. ``counted`` is what torch's
``FlopCounterMode`` reports for the forward (matmuls and convolutions; it has no formula for
``linalg.solve_triangular``); ``total`` adds the solve.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwork.models.config import GPTConfig

__all__ = ["DeltaNetFlops", "deltanet_forward_flops"]


@dataclass(frozen=True)
class DeltaNetFlops:
    """One mixer's forward FLOPs by part (see module docstring)."""

    projections: int
    conv: int
    rule_matmuls: int
    triangular_solve: int

    @property
    def counted(self) -> int:
        """Matmuls and convolution: what ``torch.utils.flop_counter.FlopCounterMode`` counts."""
        return self.projections + self.conv + self.rule_matmuls

    @property
    def total(self) -> int:
        return self.counted + self.triangular_solve


def deltanet_forward_flops(config: GPTConfig, *, batch: int, seq_length: int) -> DeltaNetFlops:
    """Forward FLOPs of one Gated DeltaNet layer's mixer for ``batch`` sequences of ``seq_length``."""
    gdn = config.linear_attention
    if gdn is None:
        raise ValueError(
            "GPTConfig.linear_attention is None: the model has no Gated DeltaNet mixer"
        )
    for name, value in (("batch", batch), ("seq_length", seq_length)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= 1")
    b, s, h = batch, seq_length, config.hidden_size
    kd, vd, nv = gdn.key_dim, gdn.value_dim, gdn.num_value_heads
    dk, dv, c = gdn.key_head_dim, gdn.value_head_dim, gdn.chunk_size
    chunks = -(-s // c)
    padded = chunks * c
    projections = 2 * b * s * h * (2 * kd + 2 * vd + 2 * nv) + 2 * b * s * vd * h
    conv = 2 * b * s * gdn.conv_kernel * (2 * kd + vd)
    per_head = 4 * padded * c * dk + 2 * padded * c * dv + 6 * padded * dk * dv
    solve = chunks * (dk + dv) * c * (c - 1)
    return DeltaNetFlops(
        projections=projections,
        conv=conv,
        rule_matmuls=b * nv * per_head,
        triangular_solve=b * nv * solve,
    )
