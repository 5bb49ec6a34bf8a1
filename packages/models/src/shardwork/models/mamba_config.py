"""``MambaConfig``: the shapes and initial values of a Mamba-2 (SSD) mixer (``GPTConfig.mamba``).

Its own module so that ``GPTConfig`` (which holds one) and :mod:`shardwork.models.mamba`
(which builds the mixer from one) both depend on it, and not on each other. Field names
follow Megatron's Mamba settings; :mod:`shardwork.models.hf.mamba_weights` maps them to and
from a Hugging Face ``NemotronHConfig``.

Context parallelism is refused by :meth:`MambaConfig.check_layout`: the scan's state after a
cp rank's chunk of the sequence is the next rank's initial state, so the ranks would run one
after the other (or pass a state correction around); neither is implemented.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from shardwork.models.field_types import check_field_types
from shardwork.models.mamba_kernels import MAMBA_SSD_KERNEL
from shardwork.models.scan_kernels import check_scan_backend

__all__ = ["MambaConfig"]


def _positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"MambaConfig.{name}={value!r} is invalid: it must be an integer >= 1")


def _pair(name: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise ValueError(f"MambaConfig.{name}={value!r} is invalid: it must be a pair (low, high)")
    low, high = (float(v) for v in value)
    return low, high


@dataclass(frozen=True, kw_only=True)
class MambaConfig:
    """Shapes, dt/A init ranges and norm of every Mamba-2 mixer of a model."""

    num_heads: int
    """SSM heads ``nh`` (NemotronH-8B: 128); split over tensor parallelism."""
    head_dim: int
    """Channels per head ``p`` (64); the inner width is ``num_heads * head_dim``."""
    state_size: int
    """SSM state size ``n`` per head (128)."""
    num_groups: int = 1
    """Groups ``g`` of B/C (heads ``i·nh/g ..`` share group ``i``'s B and C), also the groups of
    the gated RMSNorm; must divide ``num_heads``; split over tensor parallelism."""
    conv_kernel: int = 4
    """Width of the causal depthwise convolution over the x, B and C channels."""
    chunk_size: int = 128
    """Chunk length of the chunked SSD scan (results do not depend on it, only cost)."""
    conv_bias: bool = True
    """Bias on the convolution."""
    proj_bias: bool = False
    """Bias on ``in_proj`` and ``out_proj``."""
    dt_min: float = 0.001
    """Lower end of the initial time steps ``dt = exp(U(log dt_min, log dt_max))``."""
    dt_max: float = 0.1
    """Upper end of the initial time steps."""
    dt_init_floor: float = 1e-4
    """Initial time steps are clamped to at least this before ``dt_bias = softplus⁻¹(dt)``."""
    A_init_range: tuple[float, float] = (1.0, 16.0)
    """``A_log`` is initialised to ``log U(low, high)`` (``A = -exp(A_log)``)."""
    dt_limit: tuple[float, float] = (0.0, math.inf)
    """``dt = softplus(dt_raw + dt_bias)`` is clamped into this range in every forward
    (NemotronH: ``(time_step_min, inf)``)."""
    norm_epsilon: float | None = None
    """Epsilon of the gated grouped RMSNorm; None: ``GPTConfig.norm_epsilon``."""
    kernel_backend: str = "auto"
    """The SSD scan: "torch" (plain-torch reference), "triton" (mamba-ssm's Triton kernel,
    which must import when a GPTConfig holds this config) or "auto" (the kernel for CUDA
    tensors when it imports); see :mod:`shardwork.models.scan_kernels`."""

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("num_heads", "head_dim", "state_size", "num_groups", "chunk_size"):
            _positive(name, getattr(self, name))
        _positive("conv_kernel", self.conv_kernel)
        if self.num_heads % self.num_groups != 0:
            raise ValueError(
                f"MambaConfig.num_groups={self.num_groups} is invalid: it must divide "
                f"num_heads={self.num_heads}"
            )
        if not 0 < self.dt_min <= self.dt_max:
            raise ValueError(
                f"MambaConfig.dt_min={self.dt_min} / dt_max={self.dt_max} are invalid: they need "
                "0 < dt_min <= dt_max"
            )
        if not self.dt_init_floor > 0:
            raise ValueError(f"MambaConfig.dt_init_floor={self.dt_init_floor} must be > 0")
        low, high = _pair("A_init_range", self.A_init_range)
        if not 0 < low <= high:
            raise ValueError(
                f"MambaConfig.A_init_range={self.A_init_range!r} is invalid: it needs "
                "0 < low <= high (A_log = log U(low, high))"
            )
        low, high = _pair("dt_limit", self.dt_limit)
        if not 0 <= low < high:
            raise ValueError(
                f"MambaConfig.dt_limit={self.dt_limit!r} is invalid: it needs 0 <= low < high"
            )
        if self.norm_epsilon is not None and not self.norm_epsilon > 0:
            raise ValueError(f"MambaConfig.norm_epsilon={self.norm_epsilon} must be > 0 or None")
        check_scan_backend("MambaConfig", self.kernel_backend)

    @property
    def inner_size(self) -> int:
        """``num_heads * head_dim``: the width of x, z and the scan output."""
        return self.num_heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the convolution: x, B and C."""
        return self.inner_size + 2 * self.num_groups * self.state_size

    def epsilon(self, config: Any) -> float:
        """The gated norm's epsilon (its own, or the model's)."""
        return config.norm_epsilon if self.norm_epsilon is None else self.norm_epsilon

    def validate(self, config: Any) -> None:
        """Called by ``GPTConfig``: a model that asks for ``kernel_backend="triton"`` needs
        mamba-ssm importable here, refused now rather than when the mixer runs. The mixer
        reads only ``hidden_size`` and ``norm_epsilon`` of ``config``, validated there."""
        if self.kernel_backend == "triton":
            MAMBA_SSD_KERNEL.require()

    def check_layout(self, parallel: Any) -> None:
        """Heads and groups split over tp; context parallelism refused (module docstring)."""
        tp, cp = parallel.tp, parallel.cp
        for name in ("num_heads", "num_groups"):
            value = getattr(self, name)
            if value % tp != 0:
                raise ValueError(
                    f"MambaConfig.{name}={value} is not divisible by tp={tp}: each "
                    "tensor-parallel rank needs whole heads and whole B/C groups"
                )
        if cp > 1:
            raise ValueError(
                f"Mamba layers do not support context parallelism (cp={cp}): the scan's state "
                "would have to pass between cp ranks; use cp=1"
            )

    def replace(self, **changes: Any) -> MambaConfig:
        return dataclasses.replace(self, **changes)
