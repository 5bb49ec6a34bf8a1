"""Memory formulas of the hybrid mixers (Mamba-2, Gated DeltaNet) on one tensor-parallel rank.

:mod:`shardwork.models.calculator_memory` registers these functions for the mixer kinds
``"mamba"`` and ``"gated_deltanet"``; they import nothing of it, so the two modules form no
cycle. Notation as in :mod:`shardwork.models.calculator_mamba` (``nh`` heads of ``p``
channels, ``I = nh·p``, ``g`` B/C groups of state size ``N``, conv width ``k``) and
:mod:`shardwork.models.calculator_deltanet` (``Nk``/``Nv`` key/value heads of ``dk``/``dv``
channels, ``Kd = Nk·dk``, ``Vd = Nv·dv``, conv width ``K``).

Parameters per TP rank (exact, as :class:`~shardwork.models.mamba.Mamba2Mixer` and
:class:`~shardwork.models.deltanet.GatedDeltaNetMixer` allocate them):
  Mamba-2   ``in_proj`` ``h·(2I + 2gN + nh)/tp`` (its blocks z, x, B, C, dt each split by
            heads or groups) ``[+ (2I + 2gN + nh)/tp`` bias], conv ``(I + 2gN)/tp·k [+ (I +
            2gN)/tp`` bias], ``dt_bias``, ``A_log``, ``D`` ``3·nh/tp``, gated-norm weight
            ``I/tp``, ``out_proj`` ``I/tp·h [+ h`` replicated bias]
  DeltaNet  ``in_proj`` ``h·(2Kd + 2Vd + 2Nv)/tp``, conv ``(2Kd + Vd)/tp·K``, ``A_log`` and
            ``dt_bias`` ``2·Nv/tp``, the per-head RMSNorm weight ``dv`` (replicated),
            ``out_proj`` ``Vd/tp·h``; no biases

Activations saved for backward by one mixer on a rank (the reference torch code; heads,
groups and widths below are this rank's, ``/tp``), for ``T`` local tokens of ``b`` sequences
of ``s``; ``e`` activation bytes, ``c`` the scan / rule dtype's (at least float32). The
chunked forms pad each sequence to whole chunks of ``L``: ``Tp = b·⌈s/L⌉·L`` tokens and
``Q = b·⌈s/L⌉`` chunks, and every term written with ``Tp`` or ``Q`` grows with that padding.
Neither mixer has a selective-recompute region (selective counts as none); under full
recompute only the layer input is kept. The mixer's input (``in_proj``'s saved input) is
counted with the norm before it.

Mamba-2 (:mod:`shardwork.models.mamba`, :mod:`shardwork.models.ssd`), ``W = 2I + 2gN + nh``:
  conv      zero-padded input ``(T + b·(k-1))·(I+2gN)·e``, SiLU's input and output
            ``2·T·(I+2gN)·e``
  dt        softplus and clamp inputs ``2·T·nh·e``, the clamped dt in the scan dtype ``T·nh·c``
  z, x      ``c = e``: z is a view that keeps the whole in_proj output, ``T·W·e``; else the
            upcast z and x, ``2·T·I·c``
  scan      ``Tp·nh·(2L + 4p + 2)·c`` (the ``[L, L]`` decays and their product with the C·B
            scores, ``x·dt`` and its two matmul copies, the decays to the chunk end, the
            entering state's decays, its read-out); ``Tp·g·(4N + L)·c`` (B and C copies for
            three einsums, the C·B scores); ``Q·nh·(1 + 2pN)·c`` (chunk decays, the states
            entering each chunk and their matmul copy)
  output    ``T·(4I + g)·c`` (``y + D·x``, silu(z), their product, 1/rms, the normed output),
            ``out_proj``'s input ``T·I·e``

Gated DeltaNet (:mod:`shardwork.models.deltanet`, :mod:`shardwork.models.delta_rule`),
``Ch = 2Kd + Vd``, ``W = Ch + Vd + 2Nv``:
  conv      zero-padded input ``(T + b·(K-1))·Ch·e``, SiLU's input ``T·Ch·e``, q|k|v in the
            rule dtype ``T·Ch·c`` (SiLU's output itself when ``c = e``)
  gates     q and k 1/norms ``2·T·Nk·c``; sigmoid(b), softplus input and output ``3·T·Nv·c``
  rule      ``Tp·Nv·(4·dk + dv + 4L + 3)·c`` (q and k repeated to the value heads, kβ, the
            solved ``[U | Kd]``, four ``[L, L]`` tiles: decays, kβ·kᵀ, the system, q·kᵀ;
            three exp decays) and ``Q·Nv·c``; unpadded with ``Nv > 1`` the chunked q and k
            are strided and four matmul copies add ``4·Tp·Nv·dk·c``; padded, v and beta are
            saved padded, ``Tp·Nv·(dv + 1)·c``
  chunks    the states entering each chunk and ``w``, ``Q·Nv·(dk·dv + L·dv)·c``; the masked
            scores and decayed keys ``Tp·Nv·(L + dk)·c``; the decayed queries ``Tp·Nv·dk·c``
            (less the first chunk's, ``b·L·Nv·dk·c``, when they are strided copies: its
            entering state is a constant zero)
  output    the norm's input ``Tp·Vd·c`` (``c = e``: the rule's padded output itself; else
            an unpadded copy ``T·Vd·c``), 1/rms and the normed values ``T·Nv·(dv + 1)·c``;
            silu(z) keeps the whole in_proj output ``T·W·e``; norm output, silu(z) and
            ``out_proj``'s input ``3·T·Vd·e``

Measured against the storages autograd saves (``tests/test_calculator_memory.py``): exact
up to the token-independent constants (causal masks, ``A``, a norm weight's fp32 copy).
"""

from __future__ import annotations

from shardwork.models.config import GPTConfig

__all__ = [
    "deltanet_bytes",
    "deltanet_params",
    "deltanet_state_elements",
    "mamba_bytes",
    "mamba_params",
    "mamba_state_elements",
]


def mamba_params(c: GPTConfig, tp: int) -> int:
    """Local parameter elements of one Mamba-2 mixer at tensor parallel size ``tp``."""
    m, h = c.mamba, c.hidden_size
    proj = (2 * m.inner_size + 2 * m.num_groups * m.state_size + m.num_heads) // tp
    channels = m.conv_channels // tp
    p = h * proj + channels * m.conv_kernel + 3 * m.num_heads // tp + m.inner_size // tp
    p += m.inner_size // tp * h  # out_proj, row parallel
    if m.conv_bias:
        p += channels
    if m.proj_bias:
        p += proj + h  # in_proj's bias is split like its rows; out_proj's is replicated
    return p


def deltanet_params(c: GPTConfig, tp: int) -> int:
    """Local parameter elements of one Gated DeltaNet mixer at tensor parallel size ``tp``."""
    d, h = c.linear_attention, c.hidden_size
    proj = (2 * d.key_dim + 2 * d.value_dim + 2 * d.num_value_heads) // tp
    conv = (2 * d.key_dim + d.value_dim) // tp * d.conv_kernel
    # A_log and dt_bias per value head; the norm weight over dv is replicated.
    small = 2 * d.num_value_heads // tp + d.value_head_dim
    return h * proj + conv + small + d.value_dim // tp * h


def mamba_state_elements(c: GPTConfig, tp: int) -> int:
    """Generation state of one Mamba-2 mixer for one sequence on a rank: the last ``k - 1``
    inputs of the ``(I + 2gN)/tp`` conv channels and the ``nh/tp·p·N`` SSM state."""
    m = c.mamba
    return m.conv_channels // tp * (m.conv_kernel - 1) + m.num_heads // tp * m.head_dim * (
        m.state_size
    )


def deltanet_state_elements(c: GPTConfig, tp: int) -> int:
    """Generation state of one Gated DeltaNet mixer for one sequence on a rank: the last
    ``K - 1`` inputs of the ``(2Kd + Vd)/tp`` conv channels and the ``Nv/tp·dk·dv`` state."""
    d = c.linear_attention
    conv = (2 * d.key_dim + d.value_dim) // tp * (d.conv_kernel - 1)
    return conv + d.num_value_heads // tp * d.key_head_dim * d.value_head_dim


def _padded_tokens(t: float, seq: int, chunk: int) -> tuple[float, float]:
    """(tokens after rounding each sequence up to whole chunks, chunks) for ``t`` local tokens."""
    batch = t / seq
    chunks = -(-seq // chunk)
    return batch * chunks * chunk, batch * chunks


def mamba_bytes(cfg: GPTConfig, t, tp, cp, seq, recompute, c, e) -> float:
    """Bytes one Mamba-2 mixer saves for backward (module docstring; ``recompute`` other than
    ``"full"`` changes nothing: the mixer has no selective-recompute region)."""
    m = cfg.mamba
    nh, g, p, n, chunk = (
        m.num_heads // tp,
        m.num_groups // tp,
        m.head_dim,
        m.state_size,
        m.chunk_size,
    )
    inner, channels = nh * p, m.conv_channels // tp
    width = channels + inner + nh  # this rank's in_proj output: z | x B C | dt
    tpad, chunks = _padded_tokens(t, seq, m.chunk_size)
    batch = t / seq
    # conv's zero-padded input (k - 1 more steps a sequence), SiLU's input and output
    out = (t + batch * (m.conv_kernel - 1)) * channels * e + 2 * t * channels * e
    out += t * nh * (2 * e + c)  # softplus and clamp inputs, the clamped dt in the scan dtype
    # z: in the scan dtype a view that keeps the whole in_proj output alive; else its upcast
    out += t * width * e if c == e else 2 * t * inner * c  # (and x upcast for the scan)
    out += tpad * nh * (2 * chunk + 4 * p + 2) * c  # decays, their product, xdt and copies
    out += tpad * g * (4 * n + chunk) * c  # B and C copies for the three einsums, C·B scores
    out += chunks * nh * (1 + 2 * p * n) * c  # chunk decays, entering states and their copy
    out += t * (4 * inner + g) * c  # gated norm: y + D·x, silu(z), the product, 1/rms, normed
    if c != e:  # below the scan dtype, B's upcast (before chunk padding) is a copy, not a view
        out += t * g * n * c
    return out + t * inner * e  # out_proj's input


def deltanet_bytes(cfg: GPTConfig, t, tp, cp, seq, recompute, c, e) -> float:
    """Bytes one Gated DeltaNet mixer saves for backward (module docstring)."""
    d = cfg.linear_attention
    nk, nv, dk, dv, chunk = (
        d.num_key_heads // tp,
        d.num_value_heads // tp,
        d.key_head_dim,
        d.value_head_dim,
        d.chunk_size,
    )
    channels = (2 * d.key_dim + d.value_dim) // tp
    width = channels + nv * dv + 2 * nv  # this rank's in_proj output: q k v | z | b | a
    tpad, chunks = _padded_tokens(t, seq, chunk)
    batch = t / seq
    # conv's zero-padded input, SiLU's input, q|k|v in the rule's dtype
    out = (t + batch * (d.conv_kernel - 1)) * channels * e + t * channels * (e + c)
    out += t * (2 * nk + 3 * nv) * c  # q and k 1/norm, sigmoid(b), softplus input and output
    # rule: q, k (repeated to the value heads) and kβ; the solved [U | Kd]; the four [C, C]
    # tiles (decays, kβ·kᵀ, the system, q·kᵀ); three exp decays; the chunks' decay
    out += tpad * nv * (4 * dk + dv + 4 * chunk + 3) * c + chunks * nv * c
    # Unpadded with several heads, the chunked q and k are strided views of [b, s, nv, dk] and
    # the matmuls save 4 contiguous copies; padding makes them contiguous (and saves v and beta
    # padded), and so does a single head per rank.
    strided = tpad == t and nv > 1
    if strided:
        out += 4 * tpad * nv * dk * c
    elif tpad != t:
        out += tpad * nv * (dv + 1) * c
    # chunk loop: entering states, w; the decayed keys and queries (the first chunk's zero
    # state needs no queries unless they are one padded tensor); the masked scores
    out += chunks * nv * (dk * dv + chunk * dv) * c + tpad * nv * (chunk + dk) * c
    out += (tpad - batch * chunk if strided else tpad) * nv * dk * c
    # gated norm (the torch backend's RMSNorm keeps only its normed values and 1/rms, not its
    # input)
    out += t * nv * (dv + 1) * c
    out += t * width * e  # silu(z) keeps the whole in_proj output alive
    return out + 3 * t * nv * dv * e  # norm output, silu(z), out_proj's input
