"""``Mamba2Mixer``: the Mamba-2 token mixer (``LayerSpec(mixer="mamba")``), tensor parallel.

Shapes: ``s`` sequence, ``b`` batch, ``h`` model width; per TP rank ``nh`` heads of ``p``
channels, ``g`` B/C groups of state size ``n`` (``GPTConfig.mamba``, split over tp).

1. ``in_proj`` (column parallel) gives the fused blocks ``z, x, B, C, dt`` (global widths
   ``nh·p, nh·p, g·n, g·n, nh``), each split over TP on its own (checkpoint keys
   ``in_proj.weight.z`` ...): x, z and dt by heads, B and C by groups, so a rank holds whole
   heads and the groups those heads read.
2. A causal depthwise convolution of width ``conv_kernel`` over the ``x, B, C`` channels,
   then SiLU. Its weight ``[channels, 1, k]`` and bias are split over TP along the same
   blocks (keys ``conv1d.weight.x`` / ``.B`` / ``.C``).
3. ``dt = clamp(softplus(dt + dt_bias), dt_limit)``, ``A = -exp(A_log)``, the SSD scan
   (:mod:`shardwork.models.ssd`) and the skip ``+ D·x``.
4. The gated grouped RMSNorm: ``rmsnorm_g(y · silu(z)) · w`` with ``num_groups`` groups of
   ``nh·p / g`` channels (NemotronH's ``norm_before_gate=False``). A rank holds whole groups,
   so no reduction crosses ranks; ``w`` is split over TP.
5. ``out_proj`` (row parallel; init ``scaled_normal`` like the other output projections).

Initial values are layout-free: ``A_log = log U(A_init_range)``, ``dt_bias =
softplus⁻¹(max(exp(U(log dt_min, log dt_max)), dt_init_floor))`` (both
:class:`~shardwork.models.sharding.UniformInit`), ``D`` and the norm weight ones, the
projections and the convolution weight normal (``init_method_std``), biases zero.

The scan runs over whole sequences from a zero state: packed sequences (documents whose state
would have to be reset at their boundaries) and context parallelism (the state would cross
ranks) are refused. :meth:`Mamba2Mixer.step` is the recurrent form for generation.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardwork.models.attention import AttentionInputs
from shardwork.models.config import GPTConfig
from shardwork.models.mamba_kernels import MAMBA_SSD_KERNEL, ssd_chunked_kernel
from shardwork.models.module import ShardedModule
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.models.sharding import UniformInit, describe_param
from shardwork.models.ssd import ssd_chunked, ssd_step
from shardwork.parallel_state import ParamMeta, ProcessGroups

__all__ = ["Mamba2Mixer", "MambaState"]


@dataclass
class MambaState:
    """A sequence's generation state on this TP rank: the last ``k - 1`` conv inputs
    ``conv [b, channels, k - 1]`` and the SSM state ``ssm [b, nh, p, n]``."""

    conv: torch.Tensor
    ssm: torch.Tensor


def _dt_bias_from_uniform(u: torch.Tensor, *, floor: float) -> torch.Tensor:
    """``softplus⁻¹(max(exp(u), floor))``: the bias whose softplus is the drawn time step."""
    dt = torch.exp(u).clamp(min=floor)
    # softplus⁻¹(dt) = log(exp(dt) - 1) = dt + log(1 - exp(-dt)), without overflow for large dt.
    return dt + torch.log(-torch.expm1(-dt))


def _vector(size, meta, init, *, dtype, device, blocks=None) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.empty(size, dtype=dtype, device=device))
    return describe_param(param, meta, init=init, blocks=blocks)


def gated_group_rmsnorm(y, z, weight, *, groups: int, eps: float) -> torch.Tensor:
    """``rmsnorm(y · silu(z))`` over ``groups`` equal groups of the last dim, times ``weight``;
    computed in at least float32, returned in ``y``'s dtype."""
    dtype = torch.promote_types(y.dtype, torch.float32)
    gated = y.to(dtype) * F.silu(z.to(dtype))
    shaped = gated.unflatten(-1, (groups, -1))
    normed = shaped * torch.rsqrt(shaped.square().mean(-1, keepdim=True) + eps)
    return (normed.flatten(-2) * weight.to(dtype)).to(y.dtype)


class Mamba2Mixer(ShardedModule):
    """The Mamba-2 mixer (module docstring); ``forward([s(/tp), b, h], inputs)`` -> same shape."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        m = config.mamba
        if m is None:
            raise ValueError(
                "LayerSpec(mixer='mamba') needs GPTConfig.mamba=MambaConfig(...) (got None)"
            )
        m.check_layout(groups.config)
        self.scan_backend, self.model_backend = m.kernel_backend, config.kernel_backend
        tp = groups.size("tp")
        self.heads, self.head_dim = m.num_heads // tp, m.head_dim
        self.num_groups, self.state_size = m.num_groups // tp, m.state_size
        self.kernel, self.chunk_size = m.conv_kernel, m.chunk_size
        self.dt_limit = tuple(float(v) for v in m.dt_limit)
        self.eps = m.epsilon(config)
        inner, bc = m.inner_size, m.num_groups * m.state_size
        dtype = config.params_dtype
        sp = config.sequence_parallel
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            2 * inner + 2 * bc + m.num_heads,
            groups=groups,
            bias=m.proj_bias,
            sequence_parallel=sp,
            partition_sizes=(inner, inner, bc, bc, m.num_heads),
            block_names=("z", "x", "B", "C", "dt"),
            params_dtype=dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )
        self.conv1d = _Conv(m, tp, groups, dtype=dtype, device=device)
        heads = ParamMeta(tp_axis=0)
        dt_rule = UniformInit(
            math.log(m.dt_min),
            math.log(m.dt_max),
            functools.partial(_dt_bias_from_uniform, floor=m.dt_init_floor),
        )
        self.dt_bias = _vector(self.heads, heads, dt_rule, dtype=dtype, device=device)
        a_rule = UniformInit(*m.A_init_range, torch.log)
        self.A_log = _vector(self.heads, heads, a_rule, dtype=dtype, device=device)
        self.D = _vector(self.heads, heads, "ones", dtype=dtype, device=device)
        self.norm = _GatedNorm(inner // tp, groups, dtype=dtype, device=device)
        self.out_proj = RowParallelLinear(
            inner,
            config.hidden_size,
            groups=groups,
            bias=m.proj_bias,
            sequence_parallel=sp,
            params_dtype=dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )

    # ---- pieces shared by forward and step ---------------------------------------------
    def _split_projection(self, zxbcdt: torch.Tensor):
        """``[..., local width]`` -> ``z``, ``xBC`` (conv input), ``dt`` (this rank's blocks)."""
        inner = self.heads * self.head_dim
        conv = inner + 2 * self.num_groups * self.state_size
        return zxbcdt.split((inner, conv, self.heads), dim=-1)

    def _split_conv_output(self, xbc: torch.Tensor):
        """``[..., channels]`` -> ``x [..., nh, p]``, ``B``/``C [..., g, n]``."""
        inner, bc = self.heads * self.head_dim, self.num_groups * self.state_size
        x, B, C = xbc.split((inner, bc, bc), dim=-1)
        x = x.unflatten(-1, (self.heads, self.head_dim))
        return x, B.unflatten(-1, (self.num_groups, -1)), C.unflatten(-1, (self.num_groups, -1))

    def _time_step(self, dt_raw: torch.Tensor) -> torch.Tensor:
        dt = F.softplus(dt_raw + self.dt_bias.to(dt_raw.dtype))
        return dt.clamp(min=self.dt_limit[0], max=self.dt_limit[1])

    def _decay_rate(self, dtype: torch.dtype) -> torch.Tensor:
        return -torch.exp(self.A_log.to(torch.promote_types(dtype, torch.float32)))

    def _output(self, y, x, z):
        """Skip, gated norm: ``y``/``x [..., nh, p]``, ``z [..., nh·p]`` -> ``[..., nh·p]``
        in ``x``'s dtype; the skip is added in at least float32 like the scan."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        y = y.to(dtype) + self.D.to(dtype)[:, None] * x.to(dtype)
        out = gated_group_rmsnorm(
            y.flatten(-2), z, self.norm.weight, groups=self.num_groups, eps=self.eps
        )
        return out.to(x.dtype)

    # ---- whole sequences -----------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """``hidden [s(/tp under SP), b, h]`` -> same shape."""
        if inputs.mask is not None:
            raise ValueError(
                "Mamba layers run whole sequences from a zero state: packed sequences "
                "(cu_seqlens) and context parallelism are not supported (the scan's state "
                "would have to be reset at document boundaries or passed between cp ranks)"
            )
        # Decided (and a "triton" request the input cannot take refused) before any work.
        use_kernel = MAMBA_SSD_KERNEL.use_kernel(self.scan_backend, self.model_backend, hidden)
        scan = ssd_chunked_kernel if use_kernel else ssd_chunked
        zxbcdt = self.in_proj(hidden)  # [s, b, local width]
        z, xbc, dt = self._split_projection(zxbcdt.transpose(0, 1))  # batch first from here
        xbc = F.silu(self.conv1d(xbc))
        x, B, C = self._split_conv_output(xbc)
        y, _ = scan(x, self._time_step(dt), self._decay_rate(x.dtype), B, C, self.chunk_size)
        out = self._output(y, x, z)  # [b, s, nh·p]
        return self.out_proj(out.transpose(0, 1))

    # ---- generation ------------------------------------------------------------------------
    def init_state(self, batch: int) -> MambaState:
        """A zero state for ``batch`` sequences (this rank's channels and heads)."""
        channels = self.conv1d.weight.shape[0]
        dtype = torch.promote_types(self.A_log.dtype, torch.float32)
        device = self.A_log.device
        return MambaState(
            conv=torch.zeros(batch, channels, self.kernel - 1, dtype=dtype, device=device),
            ssm=torch.zeros(
                batch, self.heads, self.head_dim, self.state_size, dtype=dtype, device=device
            ),
        )

    def step(self, hidden_t: torch.Tensor, state: MambaState) -> tuple[torch.Tensor, MambaState]:
        """One token per sequence: ``hidden_t [b, h]`` (whole, on every TP rank) ->
        ``(out [b, h], next state)``; the same as ``forward`` at that position.

        ``in_proj`` and ``out_proj`` are called as modules (a one-token sequence), so what
        their forward adds (LoRA adapters) is in the step too."""
        if self.in_proj.sequence_parallel:
            raise ValueError(
                "Mamba2Mixer.step is one token per sequence and cannot be split along the "
                "sequence: build the model with sequence_parallel=False for generation"
            )
        z, xbc, dt = self._split_projection(self.in_proj(hidden_t.unsqueeze(0))[0])
        window = torch.cat([state.conv.to(xbc.dtype), xbc[:, :, None]], dim=-1)  # [b, ch, k]
        x, B, C = self._split_conv_output(F.silu(self.conv1d.last(window)))
        y, ssm = ssd_step(state.ssm, x, self._time_step(dt), self._decay_rate(x.dtype), B, C)
        out = self._output(y, x, z)
        full = self.out_proj(out.unsqueeze(0))[0]  # row-parallel: reduced over TP, bias once
        return full, MambaState(conv=window[:, :, 1:].to(state.conv.dtype), ssm=ssm)


class _Conv(ShardedModule):
    """The causal depthwise convolution over ``[x | B | C]``, split over TP by block."""

    def __init__(self, m, tp: int, groups: ProcessGroups, *, dtype, device) -> None:
        super().__init__(groups)
        inner, bc = m.inner_size, m.num_groups * m.state_size
        channels = (inner + 2 * bc) // tp
        meta = ParamMeta(tp_axis=0, tp_partition_sizes=(inner, bc, bc))
        blocks = ("x", "B", "C")
        self.weight = _vector(
            (channels, 1, m.conv_kernel), meta, "normal", dtype=dtype, device=device, blocks=blocks
        )
        if m.conv_bias:
            self.bias = _vector(channels, meta, "zeros", dtype=dtype, device=device, blocks=blocks)
        else:
            self.register_parameter("bias", None)

    def forward(self, xbc: torch.Tensor) -> torch.Tensor:
        """``[b, s, channels]`` -> same: each output sees its channel's last ``k`` inputs."""
        k = self.weight.shape[-1]
        seq = F.pad(xbc.transpose(1, 2), (k - 1, 0))  # zeros before the first token
        bias = None if self.bias is None else self.bias.to(xbc.dtype)
        out = F.conv1d(seq, self.weight.to(xbc.dtype), bias, groups=seq.shape[1])
        return out.transpose(1, 2)

    def last(self, window: torch.Tensor) -> torch.Tensor:
        """The output at the last position of ``window [b, channels, k]`` -> ``[b, channels]``."""
        out = (window * self.weight[:, 0].to(window.dtype)).sum(-1)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class _GatedNorm(ShardedModule):
    """Holds the gated norm's weight (key ``norm.weight``), split over TP with the heads."""

    def __init__(self, size: int, groups: ProcessGroups, *, dtype, device) -> None:
        super().__init__(groups)
        self.weight = _vector(size, ParamMeta(tp_axis=0), "ones", dtype=dtype, device=device)
