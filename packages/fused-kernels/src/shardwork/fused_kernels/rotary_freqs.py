"""Rotary frequency tables: base, linear, Llama-3 and YaRN scaled inverse frequencies, cos/sin, packed positions.

- ``rotary_inv_freq(rotary_dim, base=, scaling=)`` gives ``[rotary_dim // 2]`` float32
  inverse frequencies, matching Hugging Face's ``default``, ``linear``, ``llama3`` and ``yarn``
  rope types.
- YaRN also scales cos/sin by an attention factor (``YarnRopeScaling.attention_factor()``,
  HF's ``attention_factor``); :func:`rotary_cos_sin` applies it as HF does.
  DeepSeek-V3 additionally multiplies the softmax scale by
  ``get_mscale(factor, mscale_all_dim) ** 2``: see :meth:`YarnRopeScaling.softmax_scale_factor`.
- :func:`rotary_cos_sin` lays cos/sin out for half-split pairing (``cat(f, f)``, the
  HF ``rotate_half`` layout) or interleaved pairing (each frequency repeated twice).
- :func:`packed_positions` turns ``cu_seqlens`` of packed sequences into positions that
  restart at 0 for every sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from shardwork.fused_kernels._checks import check_int, check_number

__all__ = [
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "YarnRopeScaling",
    "packed_positions",
    "rotary_cos_sin",
    "rotary_inv_freq",
]


@dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama-3.1 frequency scaling (HF ``rope_type="llama3"``)."""

    factor: float = 8.0
    """Divisor of low frequencies (wavelength above ``original_max_position_embeddings / low_freq_factor``)."""
    low_freq_factor: float = 1.0
    """Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``."""
    high_freq_factor: float = 4.0
    """Wavelengths shorter than ``original_max_position_embeddings / high_freq_factor`` are kept."""
    original_max_position_embeddings: int = 8192
    """Context length the model was pretrained at."""

    def __post_init__(self) -> None:
        for field in ("factor", "low_freq_factor", "high_freq_factor"):
            check_number(f"Llama3RopeScaling.{field}", getattr(self, field))
        check_int(
            "Llama3RopeScaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
        )
        if not self.factor > 0:
            raise ValueError(f"Llama3RopeScaling.factor={self.factor} must be > 0")
        if not self.high_freq_factor > self.low_freq_factor > 0:
            raise ValueError(
                f"Llama3RopeScaling: need high_freq_factor > low_freq_factor > 0, got "
                f"high_freq_factor={self.high_freq_factor}, low_freq_factor={self.low_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "Llama3RopeScaling.original_max_position_embeddings="
                f"{self.original_max_position_embeddings} must be > 0"
            )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True, kw_only=True)
class YarnRopeScaling:
    """YaRN frequency scaling (HF ``rope_type="yarn"``; DeepSeek-V3, Qwen long context)."""

    factor: float
    """Context extension factor (new length / original length)."""
    original_max_position_embeddings: int
    """Context length the model was pretrained at."""
    beta_fast: float = 32.0
    """Rotations above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """Rotations below which a frequency is divided by ``factor`` (interpolated)."""
    mscale: float | None = None
    """Numerator coefficient of the attention factor (DeepSeek); None: plain YaRN."""
    mscale_all_dim: float | None = None
    """Denominator coefficient of the attention factor (DeepSeek); None: plain YaRN."""
    attention_factor_override: float | None = None
    """HF ``attention_factor`` given explicitly; None derives it from factor/mscale."""
    truncate: bool = True
    """Round the correction range to whole dims (HF default True)."""

    def __post_init__(self) -> None:
        for field in ("factor", "beta_fast", "beta_slow"):
            check_number(f"YarnRopeScaling.{field}", getattr(self, field))
        for field in ("mscale", "mscale_all_dim", "attention_factor_override"):
            if getattr(self, field) is not None:
                check_number(f"YarnRopeScaling.{field}", getattr(self, field))
        check_int(
            "YarnRopeScaling.original_max_position_embeddings",
            self.original_max_position_embeddings,
        )
        if not self.factor > 0:
            raise ValueError(f"YarnRopeScaling.factor={self.factor} must be > 0")
        if self.original_max_position_embeddings <= 0:
            raise ValueError(
                "YarnRopeScaling.original_max_position_embeddings="
                f"{self.original_max_position_embeddings} must be > 0"
            )
        if not self.beta_fast > self.beta_slow > 0:
            raise ValueError(
                f"YarnRopeScaling: need beta_fast > beta_slow > 0, got beta_fast={self.beta_fast}, "
                f"beta_slow={self.beta_slow}"
            )

    def attention_factor(self) -> float:
        """Multiplier of cos and sin (HF's ``attention_factor``)."""
        if self.attention_factor_override is not None:
            return float(self.attention_factor_override)
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return _yarn_mscale(self.factor)

    def softmax_scale_factor(self) -> float:
        """DeepSeek-V3's extra softmax-scale multiplier ``mscale(factor, mscale_all_dim)²`` (1 if unset)."""
        if not self.mscale_all_dim:
            return 1.0
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2


@dataclass(frozen=True, kw_only=True)
class LinearRopeScaling:
    """Position interpolation (HF ``rope_type="linear"``; Gemma 3's global layers): every
    inverse frequency divided by ``factor``."""

    factor: float
    """Divisor of every frequency (new context length / original)."""

    def __post_init__(self) -> None:
        check_number("LinearRopeScaling.factor", self.factor)
        if not self.factor > 0:
            raise ValueError(f"LinearRopeScaling.factor={self.factor!r} must be a number > 0")


RopeScaling = Llama3RopeScaling | YarnRopeScaling | LinearRopeScaling


def _base_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    # int64 arange then float, as Hugging Face computes it, so the tables match it bit for bit.
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (base**exponents)


def _llama3(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    old_len = s.original_max_position_embeddings
    low_wavelen = old_len / s.low_freq_factor
    high_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Llama 3.1: long wavelengths (low frequencies) are divided by factor, short ones kept, and the
    # band in between blended below.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rotary_dim: int, base: float, s: YarnRopeScaling) -> torch.Tensor:
    def correction_dim(rotations: float) -> float:
        # YaRN (Peng et al., 2023): the dimension whose frequency makes ``rotations`` full turns
        # over the original context length.
        return (
            rotary_dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
        ) / (2 * math.log(base))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        # Keeps the ramp's denominator nonzero (Hugging Face adds the same 0.001).
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0: extrapolate (frequency kept); ramp 1: interpolate (divided by factor).
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    inv_extrapolation = 1.0 / pos_freqs
    inv_interpolation = 1.0 / (s.factor * pos_freqs)
    return inv_interpolation * (1 - extrapolation_weight) + inv_extrapolation * extrapolation_weight


def rotary_inv_freq(
    rotary_dim: int, *, base: float = 10000.0, scaling: RopeScaling | None = None
) -> torch.Tensor:
    """Inverse frequencies ``[rotary_dim // 2]`` (float32, CPU) for rotary embedding of ``rotary_dim`` features."""
    check_int("rotary_dim", rotary_dim)
    if rotary_dim <= 0 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim={rotary_dim} must be a positive even number")
    check_number("base", base)
    if not 1 < base < math.inf:
        raise ValueError(f"base={base} must be a finite number > 1")
    if scaling is None:
        return _base_inv_freq(rotary_dim, base)
    if isinstance(scaling, Llama3RopeScaling):
        return _llama3(_base_inv_freq(rotary_dim, base), scaling)
    if isinstance(scaling, YarnRopeScaling):
        return _yarn(rotary_dim, base, scaling)
    if isinstance(scaling, LinearRopeScaling):
        # fp32 division of the fp32 base frequencies, as Hugging Face's linear rope type does.
        return _base_inv_freq(rotary_dim, base) / scaling.factor
    raise ValueError(
        f"scaling={scaling!r} is not a rope scaling; valid: None, Llama3RopeScaling, "
        "YarnRopeScaling, LinearRopeScaling"
    )


def rotary_cos_sin(
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    scaling: RopeScaling | None = None,
    interleaved: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[*positions.shape, rotary_dim]`` for integer (or float) ``positions``.

    Angles are computed in float32 (float64 if ``dtype`` is float64). Half-split
    layout (default) is ``cat(angles, angles)``; ``interleaved=True`` repeats each
    angle twice in place. A YaRN ``scaling`` multiplies cos and sin by its attention factor.
    """
    if inv_freq.dim() != 1:
        raise ValueError(f"inv_freq.shape={tuple(inv_freq.shape)} must be 1-D [rotary_dim // 2]")
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    # Angles in float32 (or float64): positions times inv_freq in bf16 would lose the angle's
    # fractional part at large positions.
    angles = positions.to(compute).unsqueeze(-1) * inv_freq.to(positions.device, compute)
    if interleaved:
        angles = angles.repeat_interleave(2, dim=-1)
    else:
        angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if isinstance(scaling, YarnRopeScaling):
        factor = scaling.attention_factor()
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype), sin.to(dtype)


def packed_positions(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Positions ``[cu_seqlens[-1]]`` (int64) restarting at 0 at every packed sequence start.

    ``cu_seqlens`` is ``[num_seqs + 1]``, non-decreasing, starting at 0 (FlashAttention's varlen layout).
    """
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens.shape={tuple(cu_seqlens.shape)} must be 1-D [num_seqs + 1]")
    cu = cu_seqlens.to(torch.int64)
    if int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens={cu.tolist()} must start at 0 and be non-decreasing")
    total = int(cu[-1])
    lengths = cu[1:] - cu[:-1]
    # Each sequence's start offset, repeated over its length.
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu.device) - starts
