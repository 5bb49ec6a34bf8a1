"""Gated DeltaNet token mixer (Qwen3-Next's linear-attention layers), tensor parallel.

Shapes: ``s`` sequence, ``b`` batch, ``nk``/``nv`` key/value heads on this TP rank (``nv = r·nk``,
value head ``j`` reads key head ``j // r``), ``dk``/``dv`` head widths.

- ``in_proj`` is one column-parallel projection with blocks [q | k | v | z | b | a] (global
  sizes ``Nk·dk, Nk·dk, Nv·dv, Nv·dv, Nv, Nv``), each split over TP by heads on its own
  (checkpoint keys ``in_proj.weight.q`` ...). One fused GEMM reads the input once and, under
  sequence parallelism, all-gathers it once. Transformers stores q|k|v|z and b|a interleaved
  per key-head group instead; :mod:`shardwork.models.hf.deltanet_weights` reorders.
- ``conv_weight [C, K]``: the causal depthwise convolution over the q|k|v channels
  (``C = 2·Nk·dk + Nv·dv``), no bias, followed by SiLU. Blocks q, k, v split over TP like
  ``in_proj``'s, so each rank convolves exactly the channels it projected.
- Then queries and keys are L2-normalised, queries scaled by ``1/sqrt(dk)``,
  ``beta = sigmoid(b)``, ``g = -exp(A_log) · softplus(a + dt_bias)`` (``A_log``, ``dt_bias``:
  one per value head, TP-split), and :func:`~shardwork.models.delta_rule.gated_delta_rule_chunked`
  mixes the tokens (its module docstring has the recurrence). The rule runs in at least float32.
- ``norm``: RMSNorm over ``dv`` per head (weight replicated; each rank normalises only its
  heads, so its gradient is partial and all-reduced over TP when tp > 1), multiplied by
  ``silu(z)``; then ``out_proj``, row-parallel over the value heads.

Not supported: packed sequences and context parallelism (the recurrent state would have to
reset at document boundaries / pass between cp ranks). ``forward`` refuses a mask.
Generation: :meth:`GatedDeltaNetMixer.init_state` and :meth:`GatedDeltaNetMixer.step` advance
one token with the recurrent form (conv window + delta-rule state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardwork.models.attention import AttentionInputs
from shardwork.models.config import GPTConfig
from shardwork.models.delta_rule import gated_delta_rule_chunked, gated_delta_rule_step
from shardwork.models.deltanet_kernels import FLA_GATED_DELTA_RULE, gated_delta_rule_kernel
from shardwork.models.module import ShardedModule
from shardwork.models.norm import RMSNorm
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.models.sharding import UniformInit, describe_param
from shardwork.parallel_state import ParamMeta, ProcessGroups

__all__ = ["A_LOG_INIT", "DeltaNetState", "GatedDeltaNetMixer"]

A_LOG_INIT = UniformInit(0.01, 16.0, torch.log)
"""``A_log = log U(0.01, 16)`` per value head, as transformers initialises Qwen3-Next (the
lower bound keeps ``log A`` finite)."""


@dataclass
class DeltaNetState:
    """One mixer's generation state for a batch (this TP rank's heads and channels)."""

    conv: torch.Tensor
    """The last ``K - 1`` q|k|v inputs of the convolution, ``[b, C_local, K - 1]``."""
    recurrent: torch.Tensor
    """The delta-rule state ``S``, ``[b, nv, dk, dv]``."""


class GatedDeltaNetMixer(ShardedModule):
    """Gated DeltaNet mixer over ``[s(/tp under SP), b, h]`` (see module docstring)."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        gdn = config.linear_attention
        if gdn is None:
            raise ValueError(
                "LayerSpec(mixer='gated_deltanet') needs GPTConfig.linear_attention (a "
                "GatedDeltaNetConfig); it is None"
            )
        self.rule_backend, self.model_backend = gdn.kernel_backend, config.kernel_backend
        tp = groups.size("tp")
        self.num_key_heads = gdn.num_key_heads // tp
        self.num_value_heads = gdn.num_value_heads // tp
        self.key_head_dim, self.value_head_dim = gdn.key_head_dim, gdn.value_head_dim
        self.kernel = gdn.conv_kernel
        self.chunk_size = gdn.chunk_size
        self.l2_eps = gdn.qk_l2norm_epsilon
        self.sequence_parallel = config.sequence_parallel
        kd, vd, nv = gdn.key_dim, gdn.value_dim, gdn.num_value_heads
        dtype = config.params_dtype
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            2 * kd + 2 * vd + 2 * nv,
            groups=groups,
            sequence_parallel=config.sequence_parallel,
            partition_sizes=(kd, kd, vd, vd, nv, nv),
            block_names=("q", "k", "v", "z", "b", "a"),
            params_dtype=dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )
        conv_channels = (2 * kd + vd) // tp
        bound = 1.0 / math.sqrt(self.kernel)  # torch's Conv1d default: U(±1/sqrt(fan_in))
        self.conv_weight = describe_param(
            torch.nn.Parameter(torch.empty(conv_channels, self.kernel, dtype=dtype, device=device)),
            ParamMeta(tp_axis=0, tp_partition_sizes=(kd, kd, vd)),
            init=UniformInit(-bound, bound),
            blocks=("q", "k", "v"),
        )
        self.A_log = describe_param(
            torch.nn.Parameter(torch.empty(nv // tp, dtype=dtype, device=device)),
            ParamMeta(tp_axis=0),
            init=A_LOG_INIT,
        )
        self.dt_bias = describe_param(
            torch.nn.Parameter(torch.empty(nv // tp, dtype=dtype, device=device)),
            ParamMeta(tp_axis=0),
            init="ones",
        )
        self.norm = RMSNorm(
            gdn.value_head_dim,
            groups=groups,
            eps=config.norm_epsilon,
            backend=config.kernel_backend,
            # Each TP rank normalises only its own heads: the weight's gradient is a partial sum.
            partial_grad=tp > 1,
            params_dtype=dtype,
            device=device,
        )
        self.out_proj = RowParallelLinear(
            vd,
            config.hidden_size,
            groups=groups,
            sequence_parallel=config.sequence_parallel,
            params_dtype=dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )

    # ---- pieces shared by forward and step ------------------------------------------------
    def _split_projection(self, proj: torch.Tensor):
        """``[..., local in_proj]`` -> (q|k|v channels, z, b, a), this rank's blocks."""
        kd = self.num_key_heads * self.key_head_dim
        vd = self.num_value_heads * self.value_head_dim
        nv = self.num_value_heads
        return proj.split((2 * kd + vd, vd, nv, nv), dim=-1)

    def _rule_inputs(self, qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor):
        """Convolved ``qkv [..., C]`` and ``b, a [..., nv]`` -> q, k (repeated to the value
        heads), v, g, beta in the rule's dtype (at least float32)."""
        dtype = torch.promote_types(qkv.dtype, torch.float32)
        qkv, b, a = qkv.to(dtype), b.to(dtype), a.to(dtype)
        kd = self.num_key_heads * self.key_head_dim
        q, k, v = qkv.split((kd, kd, qkv.shape[-1] - 2 * kd), dim=-1)
        lead = qkv.shape[:-1]
        q = q.reshape(*lead, self.num_key_heads, self.key_head_dim)
        k = k.reshape(*lead, self.num_key_heads, self.key_head_dim)
        v = v.reshape(*lead, self.num_value_heads, self.value_head_dim)
        q = q * torch.rsqrt(q.square().sum(-1, keepdim=True) + self.l2_eps)
        k = k * torch.rsqrt(k.square().sum(-1, keepdim=True) + self.l2_eps)
        q = q * self.key_head_dim**-0.5
        # Value head j reads key head j // r: repeat_interleave keeps each key head's r value
        # heads consecutive.
        r = self.num_value_heads // self.num_key_heads
        q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
        beta = torch.sigmoid(b)
        g = -self.A_log.to(dtype).exp() * F.softplus(a + self.dt_bias.to(dtype))
        return q, k, v, g, beta

    def _output(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm: ``o [..., nv, dv]`` (rule dtype), ``z [..., nv·dv]`` -> ``[..., nv·dv]``."""
        o = o.to(z.dtype)
        gate = F.silu(z.reshape(o.shape))
        return (self.norm(o) * gate).flatten(-2)

    # ---- training / prefill ---------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """``hidden [s(/tp under SP), b, h]`` -> same shape, causal over whole sequences."""
        if inputs.mask is not None or self.groups.size("cp") > 1:
            raise ValueError(
                "Gated DeltaNet layers need whole, unpacked sequences: packed sequences "
                "(document masks) and context parallelism are not supported (the recurrent "
                "state is not reset at document boundaries nor passed between cp ranks)"
            )
        # Decided (and a "triton" request the input cannot take refused) before any work.
        use_kernel = FLA_GATED_DELTA_RULE.use_kernel(self.rule_backend, self.model_backend, hidden)
        # [s, b, ·] -> [b, s, ·]: the rule and the convolution run batch-first.
        proj = self.in_proj(hidden).transpose(0, 1)
        qkv, z, b, a = self._split_projection(proj)
        # Causal: K-1 zeros before the first token only, so output t sees inputs t-K+1 .. t.
        padded = F.pad(qkv.transpose(1, 2), (self.kernel - 1, 0))  # [b, C, K-1+s]
        conv = F.conv1d(padded, self.conv_weight.to(qkv.dtype).unsqueeze(1), groups=qkv.shape[-1])
        qkv = F.silu(conv).transpose(1, 2)
        q, k, v, g, beta = self._rule_inputs(qkv, b, a)
        if use_kernel:
            o, _ = gated_delta_rule_kernel(q, k, v, g, beta)
        else:
            o, _ = gated_delta_rule_chunked(q, k, v, g, beta, self.chunk_size)
        out = self._output(o, z)  # [b, s, nv·dv]
        return self.out_proj(out.transpose(0, 1))

    # ---- generation -----------------------------------------------------------------------
    def init_state(self, batch: int, *, device: str | torch.device | None = None) -> DeltaNetState:
        """Zero state for ``batch`` sequences before their first token."""
        dtype = torch.promote_types(self.conv_weight.dtype, torch.float32)
        device = self.conv_weight.device if device is None else device
        conv = (batch, self.conv_weight.shape[0], self.kernel - 1)
        recurrent = (batch, self.num_value_heads, self.key_head_dim, self.value_head_dim)
        return DeltaNetState(
            conv=torch.zeros(conv, dtype=dtype, device=device),
            recurrent=torch.zeros(recurrent, dtype=dtype, device=device),
        )

    def step(
        self, hidden_t: torch.Tensor, state: DeltaNetState
    ) -> tuple[torch.Tensor, DeltaNetState]:
        """One token per sequence: ``hidden_t [b, h]`` -> (``[b, h]``, the advanced state)."""
        if self.sequence_parallel:
            raise ValueError(
                "GatedDeltaNetMixer.step is one token per sequence and cannot be split along the "
                "sequence: build the model with sequence_parallel=False for generation"
            )
        proj = self.in_proj(hidden_t.unsqueeze(0))[0]  # [b, local]
        qkv, z, b, a = self._split_projection(proj)
        window = torch.cat((state.conv.to(qkv.dtype), qkv.unsqueeze(-1)), dim=-1)  # [b, C, K]
        qkv_t = F.silu((window * self.conv_weight.to(qkv.dtype)).sum(-1))
        q, k, v, g, beta = self._rule_inputs(qkv_t, b, a)
        o, recurrent = gated_delta_rule_step(state.recurrent, q, k, v, g, beta)
        out = self.out_proj(self._output(o, z).unsqueeze(0))[0]
        return out, DeltaNetState(conv=window[..., 1:].to(state.conv.dtype), recurrent=recurrent)
