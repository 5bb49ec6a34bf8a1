"""Multi-head latent attention (DeepSeek-V2/V3) with tensor, sequence and context parallelism.

Legend: ``n`` heads (``n/tp`` per rank), ``dn`` = qk_nope_head_dim, ``dr`` = qk_rope_head_dim,
``dv`` = v_head_dim, ``rq`` / ``rkv`` the query / key-value latent (LoRA) ranks.

- Queries: ``x → linear_q_down_proj [rq, h] → q_layernorm → linear_q_up_proj [n·(dn+dr), rq]``
  (or one ``linear_q_proj`` when ``q_lora_rank`` is None). Keys/values:
  ``x → linear_kv_down_proj [rkv+dr, h]`` → split into the latent (``kv_layernorm`` then
  ``linear_kv_up_proj [n·(dn+dv), rkv]``) and one shared rope key of ``dr`` features.
- The down projections and latent norms are replicated over TP (small); the up projections
  are column-parallel by heads and ``linear_proj`` row-parallel, so each TP rank runs whole
  heads. Under sequence parallelism the layer input is all-gathered once (backward keeps the
  own chunk: everything downstream has complete gradients) and the output reduce-scattered.
  The shared rope key enters the TP region with ``copy_to_tp_region`` (its gradient is summed
  over the heads of every rank).
- Decoupled RoPE on the ``dr`` part only, neighbouring-pair (interleaved) rotation via
  ``shardwork.fused_kernels.apply_rotary(interleaved=True)`` with tables built by the model
  (``GPTModel`` uses ``dr`` and interleaved layout when ``config.mla`` is set). This equals
  HF's de-interleave + rotate-half formulation up to the same permutation of q and k features,
  which leaves every attention score unchanged.
- Softmax scale ``(dn+dr)^-1/2``, times ``YarnRopeScaling.softmax_scale_factor()`` under YaRN
  (DeepSeek's ``mscale_all_dim``); YaRN's cos/sin attention factor is in the tables.
- Context parallelism: keys and values all-gathered over cp in position order like
  :class:`Attention`; packed documents and cp run through the same
  :func:`~shardwork.models.masked_attention.block_attention` (no ``[s, s]`` mask).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from shardwork.fused_kernels import YarnRopeScaling, apply_rotary, linear
from shardwork.models.attention import AttentionInputs
from shardwork.models.context_parallel import gather_in_position_order
from shardwork.models.masked_attention import block_attention
from shardwork.models.mla_config import MLAConfig
from shardwork.models.module import ShardedModule
from shardwork.models.norm import RMSNorm
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.models.recompute import checkpoint
from shardwork.models.rng import TENSOR_PARALLEL, RNGTracker
from shardwork.models.sharding import describe_param
from shardwork.parallel_state import (
    ParamMeta,
    ProcessGroups,
    copy_to_tp_region,
    gather_from_sequence_region,
)

__all__ = ["MLAConfig", "MLAttention", "ReplicatedLinear"]


class ReplicatedLinear(ShardedModule):
    """``y = x Wᵀ`` with ``W [out, in]`` replicated over TP, fed the full (gathered) sequence."""

    def __init__(
        self, in_features, out_features, *, groups, params_dtype, device, kernel_backend=None
    ) -> None:
        super().__init__(groups)
        self.kernel_backend = kernel_backend
        self.weight = describe_param(
            torch.nn.Parameter(
                torch.empty((out_features, in_features), dtype=params_dtype, device=device)
            ),
            ParamMeta(),
            init="normal",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same weight and full input on every TP rank: no collective. The layers after it
        # all-reduce their input gradient over TP, so this weight's gradient is identical on all.
        return linear(x, self.weight.to(x.dtype), backend=self.kernel_backend)


class MLAttention(ShardedModule):
    """Multi-head latent attention (see module docstring); same call as :class:`Attention`."""

    def __init__(
        self,
        config,
        groups: ProcessGroups,
        *,
        rng: RNGTracker,
        device: str | torch.device | None = None,
    ) -> None:
        super().__init__(groups)
        mla: MLAConfig = config.mla
        tp = groups.size("tp")
        n, h = config.num_attention_heads, config.hidden_size
        self.mla = mla
        self.num_heads = n // tp
        self.sp = config.sequence_parallel
        self.dropout = config.attention_dropout
        self.selective_recompute = config.recompute == "selective"
        self.backend = config.kernel_backend
        self.rng = rng
        # Scale by the full query-key width (dn+dr), not dv: the score is a dot product over dn+dr.
        scale = mla.qk_head_dim**-0.5
        if isinstance(config.rope_scaling, YarnRopeScaling):
            # DeepSeek-V3's reference multiplies the softmax scale by mscale(factor,
            # mscale_all_dim)² under YaRN; softmax_scale_factor returns that square.
            scale *= config.rope_scaling.softmax_scale_factor()
        self.softmax_scale = scale
        common = dict(
            groups=groups,
            params_dtype=config.params_dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )
        norm = dict(
            groups=groups,
            eps=config.norm_epsilon,
            backend=config.kernel_backend,
            # Latent norms see the full latent on every TP rank (replicated), so their gradient is
            # complete.
            partial_grad=False,
            zero_centered_gamma=config.layernorm_zero_centered_gamma,
            params_dtype=config.params_dtype,
            device=device,
        )
        q_out = n * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(h, q_out, **common)
            self.linear_q_down_proj = self.q_layernorm = self.linear_q_up_proj = None
        else:
            self.linear_q_proj = None
            self.linear_q_down_proj = ReplicatedLinear(h, mla.q_lora_rank, **common)
            self.q_layernorm = RMSNorm(mla.q_lora_rank, **norm)
            self.linear_q_up_proj = ColumnParallelLinear(mla.q_lora_rank, q_out, **common)
        self.linear_kv_down_proj = ReplicatedLinear(
            h, mla.kv_lora_rank + mla.qk_rope_head_dim, **common
        )
        self.kv_layernorm = RMSNorm(mla.kv_lora_rank, **norm)
        self.linear_kv_up_proj = ColumnParallelLinear(
            mla.kv_lora_rank, n * (mla.qk_nope_head_dim + mla.v_head_dim), **common
        )
        self.linear_proj = RowParallelLinear(
            n * mla.v_head_dim, h, sequence_parallel=config.sequence_parallel, **common
        )

    def _core(self, q, k, v, mask):
        """SDPA on ``q/k [s(k), b, n, dn+dr]``, ``v [sk, b, n, dv]`` -> ``[s, b, n·dv]``."""
        # [s, b, n, d] -> [b, n, s, d], SDPA's layout.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        if mask is None:
            attend = functools.partial(F.scaled_dot_product_attention, is_causal=True)
        else:
            attend = functools.partial(block_attention, mask=mask)
        if p > 0:
            with self.rng.fork(TENSOR_PARALLEL):
                out = attend(q, k, v, dropout_p=p, scale=self.softmax_scale)
        else:
            out = attend(q, k, v, dropout_p=p, scale=self.softmax_scale)
        # [b, n, s, dv] -> [s, b, n·dv].
        return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)

    def forward(self, hidden: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """``hidden [s(/tp under SP), b, h]`` -> same shape."""
        mla, tp = self.mla, self.groups.tp
        if self.sp:
            # One gather for all projections. Backward keeps the own chunk (no reduce-scatter): the
            # column up projections all-reduce their input gradient, so the gradient arriving here
            # is already complete on every rank.
            hidden = gather_from_sequence_region(hidden, tp, dim=0, grad_is_partial=False)
        s, b = hidden.shape[0], hidden.shape[1]
        dn, dr, dv = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        if self.linear_q_proj is not None:
            q = self.linear_q_proj(hidden)
        else:
            q = self.linear_q_up_proj(self.q_layernorm(self.linear_q_down_proj(hidden)))
        q = q.reshape(s, b, self.num_heads, dn + dr)
        q_nope, q_rot = q.split((dn, dr), dim=-1)
        # [s, b, rkv+dr] -> latent [s, b, rkv] and one rope key [s, b, dr] shared by all heads.
        latent, k_rot = self.linear_kv_down_proj(hidden).split((mla.kv_lora_rank, dr), dim=-1)
        kv = self.linear_kv_up_proj(self.kv_layernorm(latent))
        k_nope, v = kv.reshape(s, b, self.num_heads, dn + dv).split((dn, dv), dim=-1)
        # The shared rope key feeds every rank's heads: copy_to_tp_region all-reduces its gradient.
        k_rot = copy_to_tp_region(k_rot, tp).reshape(s, b, 1, dr)
        cos, sin = inputs.cos.to(q.dtype), inputs.sin.to(q.dtype)
        # Decoupled RoPE (DeepSeek-V2 paper, section 2.1.3): only the dr features rotate
        # (neighbouring pairs); the nope features stay position-free so that inference can absorb
        # the key up projection into the query projection.
        q_rot = apply_rotary(q_rot, cos, sin, interleaved=True, backend=self.backend)
        k_rot = apply_rotary(k_rot, cos, sin, interleaved=True, backend=self.backend)
        q = torch.cat((q_nope, q_rot), dim=-1)
        # Broadcast the single rope key [s, b, 1, dr] to every local head (a view, no copy).
        k = torch.cat((k_nope, k_rot.expand(s, b, self.num_heads, dr)), dim=-1)
        v = v.contiguous()
        if self.groups.size("cp") > 1:
            # Same as Attention: keys after RoPE, in position order, gradient reduce-scattered; k
            # then v on every cp rank.
            k = gather_in_position_order(k, self.groups.cp, dim=0)
            v = gather_in_position_order(v, self.groups.cp, dim=0)
        mask = inputs.mask
        if self.selective_recompute and self.training:
            out = checkpoint(lambda q_, k_, v_: self._core(q_, k_, v_, mask), self.rng, q, k, v)
        else:
            out = self._core(q, k, v, mask)
        return self.linear_proj(out)
