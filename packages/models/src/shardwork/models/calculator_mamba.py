"""Forward FLOPs of one Mamba-2 mixer (``GPTConfig.mamba``) for a ``(batch, seq)`` input.

Notation: ``b`` batch, ``s`` tokens, ``h`` model width, ``nh`` heads of ``p`` channels
(``I = nh·p``), ``g`` B/C groups of state size ``N``, ``k`` conv width, ``L`` chunk size,
``c = ceil(s / L)`` chunks and ``S = c·L`` the padded length the chunked scan works on.
A multiply-add counts 2.

- projections: ``in_proj`` ``2·b·s·h·(2I + 2gN + nh)`` and ``out_proj`` ``2·b·s·I·h``;
- conv: depthwise over ``I + 2gN`` channels, ``2·b·s·(I + 2gN)·k``;
- scan (:func:`~shardwork.models.ssd.ssd_chunked`'s four batched matmuls):
  ``C·B`` scores per group ``2·b·c·g·L²·N``, the masked scores applied to the inputs
  ``2·b·S·nh·L·p``, the chunks' state contributions ``2·b·S·nh·p·N``, and the entering
  states read by C ``2·b·S·nh·p·N``.

These are exactly the operations ``torch.utils.flop_counter.FlopCounterMode`` counts on the
mixer's forward: matrix products (``mm``/``addmm``/``bmm``, einsum lowers to ``bmm``) and
convolutions. Element-wise work (softplus, exp of the decays, SiLU, the gated norm, the
sequential chunk-to-chunk state update) is not counted by it, nor here.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardwork.models.config import GPTConfig

__all__ = ["MambaFlops", "mamba_forward_flops"]


@dataclass(frozen=True)
class MambaFlops:
    """One Mamba layer's forward FLOPs, by part (module docstring)."""

    projections: int
    conv: int
    scan: int

    @property
    def total(self) -> int:
        return self.projections + self.conv + self.scan


def mamba_forward_flops(config: GPTConfig, batch: int, seq: int) -> MambaFlops:
    """Forward FLOPs of one ``Mamba2Mixer`` of ``config`` over ``batch`` sequences of ``seq``
    tokens (the whole layer, summed over TP ranks)."""
    m = config.mamba
    if m is None:
        raise ValueError("mamba_forward_flops needs GPTConfig.mamba (got None)")
    b, s, h = batch, seq, config.hidden_size
    nh, p, g, n, L = m.num_heads, m.head_dim, m.num_groups, m.state_size, m.chunk_size
    inner, channels = nh * p, m.conv_channels
    chunks = -(-s // L)
    padded = chunks * L
    projections = 2 * b * s * h * (2 * inner + 2 * g * n + nh) + 2 * b * s * inner * h
    conv = 2 * b * s * channels * m.conv_kernel
    scores = 2 * b * chunks * g * L * L * n
    intra = 2 * b * padded * nh * L * p
    states = 2 * (2 * b * padded * nh * p * n)  # chunk contributions, then C · entering state
    return MambaFlops(projections=projections, conv=conv, scan=scores + intra + states)
