"""Self-attention: MHA/GQA, fused QKV, QK-norm, RoPE, causal/document masks, context parallel.

Shapes: ``s`` local sequence, ``b`` batch, ``nq``/``nkv`` query/key-value heads on this TP
rank, ``d`` head dim.

- ``linear_qkv`` is column-parallel with blocks [Q | K | V] (global sizes ``nq·d, nkv·d,
  nkv·d``); each TP rank holds whole heads of each block (checkpoint keys ``.q .k .v``).
  With ``attention_output_gate`` (Qwen3-Next) a fourth block ``gate`` (``nq·d``, split by query
  heads like Q) follows V: ``[Q | K | V | G]``, so Q/K/V keep the offsets and keys of the
  ungated model. The core attention output of head j is multiplied by ``sigmoid(G_j)`` before
  ``linear_proj``. (Hugging Face interleaves query and gate per head inside ``q_proj``:
  :mod:`shardwork.models.hf.gated_attention_weights` converts.)
- QK-norm (Qwen3) is an RMSNorm over ``d`` before RoPE; RoPE uses
  ``shardwork.fused_kernels.apply_rotary`` with half-split pairing (the HF convention) on the
  first ``cos.shape[-1]`` channels of each head (``rotary_percent`` < 1 leaves the rest as
  they are). With ``position_embedding_type="none"`` nothing is rotated. Without QK-norm,
  output gate or cp > 1, ``apply_rotary_qkv`` does the split, the rotation and SDPA's layout
  in one op (the same values; new q/k/v, so the qkv output is not kept for backward).
- Core attention is torch SDPA on ``[b, n, s, d]`` q/k/v (strided views, any layout) with
  ``enable_gqa`` (K/V are not repeated per query head). The plain causal case uses
  ``is_causal``; packed sequences, context parallelism and sliding windows bring a
  :class:`~shardwork.models.block_mask.BlockMask` (query segments over contiguous key ranges,
  never an ``[s, s]`` tensor) that :func:`~shardwork.models.masked_attention.block_attention`
  runs exactly with memory linear in ``s`` (grouped K/V too). The scale is ``head_dim^-0.5`` or
  ``query_pre_attn_scalar^-0.5`` (Gemma). With
  ``attn_logit_softcapping`` (Gemma 2) the scores are capped (:mod:`shardwork.models.softcap`)
  before the mask, which SDPA cannot do: those layers compute ``softmax(cap(q·kᵀ·scale)) v``
  explicitly (per segment of the block mask), softmax in at least float32 like transformers'
  eager path.
- Sliding-window layers (``config.sliding_window``, chosen by ``sliding_window_pattern``) read
  ``inputs.sliding``: their own block mask (window on global positions, so it holds under
  context parallelism and packing) and, with ``rope_local_theta``, their own RoPE table.
- ``add_qkv_bias`` / ``add_proj_bias``: biases on ``linear_qkv`` (split like its blocks) and
  ``linear_proj`` (replicated, added once after the TP reduction).
- Context parallelism: K/V are all-gathered over the cp group in position order with a
  differentiable gather (backward reduce-scatters), queries stay local.
- Attention dropout draws from the model's TP-distinct RNG stream (heads are TP-sharded).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shardwork.fused_kernels import apply_rotary, apply_rotary_qkv
from shardwork.models.block_mask import BlockMask
from shardwork.models.config import GPTConfig
from shardwork.models.context_parallel import gather_in_position_order
from shardwork.models.layer_options import is_sliding_window_layer
from shardwork.models.masked_attention import block_attention, capped_attention
from shardwork.models.module import ShardedModule
from shardwork.models.norm import RMSNorm
from shardwork.models.parallel_linear import ColumnParallelLinear, RowParallelLinear
from shardwork.models.recompute import checkpoint
from shardwork.models.rng import TENSOR_PARALLEL, RNGTracker
from shardwork.parallel_state import ProcessGroups

__all__ = ["Attention", "AttentionInputs"]


@dataclass
class AttentionInputs:
    """Per-forward tensors shared by every layer: RoPE tables and the mask.

    ``cos``/``sin``: ``[s_local, 1, d_rot]`` for this rank's (global) query positions, or None
    when the model has no rotary table (``DecoderSpec.rotary`` None).
    ``mask``: which keys each query attends (packed documents, context-parallel chunks, a
    sliding window), or None for plain causal attention over the rank's own keys.
    ``sliding``: the inputs of sliding-window layers (their windowed mask and RoPE table), None
    in a model without them.
    """

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    mask: BlockMask | None
    sliding: AttentionInputs | None = None


class Attention(ShardedModule):
    """Grouped-query self-attention with tensor and context parallelism."""

    def __init__(
        self,
        config: GPTConfig,
        groups: ProcessGroups,
        *,
        rng: RNGTracker,
        device: str | torch.device | None = None,
        layer_number: int = 0,
    ) -> None:
        """``layer_number``: the global layer index (picks sliding-window or global attention)."""
        super().__init__(groups)
        tp = groups.size("tp")
        d = config.kv_channels
        self.head_dim = d
        self.num_heads = config.num_attention_heads // tp
        # GQA: each TP rank keeps whole kv heads, so kv_heads must divide by tp (checked in
        # GPTConfig).
        self.num_kv_heads = config.kv_heads // tp
        self.dropout = config.attention_dropout
        self.selective_recompute = config.recompute == "selective"
        self.backend = config.kernel_backend
        self.rng = rng
        self.rotate = config.position_embedding_type == "rope"
        self.gated = config.attention_output_gate
        self.sliding = is_sliding_window_layer(config, layer_number)
        self.softcap = config.attn_logit_softcapping
        scalar = config.query_pre_attn_scalar
        # None: SDPA's own head_dim^-0.5 (the numerics of models without the option unchanged).
        self.scale = None if scalar is None else scalar**-0.5
        q_size, kv_size = config.num_attention_heads * d, config.kv_heads * d
        sizes, names = (q_size, kv_size, kv_size), ("q", "k", "v")
        if self.gated:
            sizes, names = (*sizes, q_size), (*names, "gate")
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            sum(sizes),
            groups=groups,
            bias=config.add_qkv_bias,
            sequence_parallel=config.sequence_parallel,
            partition_sizes=sizes,
            block_names=names,
            params_dtype=config.params_dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )
        if config.qk_layernorm:
            kw = dict(
                groups=groups,
                eps=config.norm_epsilon,
                backend=config.kernel_backend,
                # Each TP rank normalises only its own heads, so the norm weight's gradient is a
                # partial sum over ranks: marked like an SP parameter, it is all-reduced over TP.
                partial_grad=tp > 1,
                zero_centered_gamma=config.layernorm_zero_centered_gamma,
                params_dtype=config.params_dtype,
                device=device,
            )
            self.q_layernorm = RMSNorm(d, **kw)
            self.k_layernorm = RMSNorm(d, **kw)
        else:
            self.q_layernorm = self.k_layernorm = None
        self.linear_proj = RowParallelLinear(
            q_size,
            config.hidden_size,
            groups=groups,
            bias=config.add_proj_bias,
            sequence_parallel=config.sequence_parallel,
            params_dtype=config.params_dtype,
            device=device,
            kernel_backend=config.kernel_backend,
        )

    def _core(self, q, k, v, mask):
        """Attention of ``q [b, nq, s, d]``, ``k/v [b, nkv, sk, d]`` (SDPA's layout, any
        strides) -> ``[s, b, nq·d]``. GQA stays grouped: query head j uses kv head
        j // (nq / nkv)."""
        p = self.dropout if self.training else 0.0
        attend = self._softcapped if self.softcap is not None else self._sdpa
        if p > 0:
            # Heads are TP-sharded, so each rank must draw a different dropout pattern for its
            # heads.
            with self.rng.fork(TENSOR_PARALLEL):
                out = attend(q, k, v, mask, p)
        else:
            out = attend(q, k, v, mask, p)
        s, b = out.shape[2], out.shape[0]
        # [b, n, s, d] -> [s, b, n·d]: heads contiguous per token, linear_proj's input order.
        return out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.head_dim)

    def _sdpa(self, q, k, v, mask, p):
        if mask is not None:  # a BlockMask: packed documents, cp > 1 or a sliding window
            return block_attention(q, k, v, mask, scale=self.scale, dropout_p=p)
        # is_causal masks top-left aligned, correct only when queries and keys are the same
        # positions 0..s-1; context parallel and packed sequences always bring an explicit mask.
        # enable_gqa (torch >= 2.5): each kv head serves its group of query heads inside the
        # kernel, instead of a repeat_interleave copy of K and V (and the sum over each group
        # in backward).
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            dropout_p=p,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )

    def _softcapped(self, q, k, v, mask, p):
        """``softmax(cap·tanh(q·kᵀ·scale / cap) masked) v`` of ``q [b, nq, s, d]``, ``k/v [b, nkv,
        sk, d]``."""
        scale = self.head_dim**-0.5 if self.scale is None else self.scale
        if mask is not None:
            return block_attention(q, k, v, mask, scale=scale, dropout_p=p, softcap=self.softcap)
        sq, sk = q.shape[2], k.shape[2]
        causal = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril()
        return capped_attention(q, k, v, causal, scale=scale, softcap=self.softcap, dropout_p=p)

    def forward(self, hidden: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """``hidden [s(/tp under SP), b, h]`` -> same shape."""
        if self.sliding:
            if inputs.sliding is None:
                raise ValueError(
                    "a sliding-window attention layer got no sliding inputs: build its "
                    "AttentionInputs with GPTModel._attention_inputs of a config with sliding_window"
                )
            inputs = inputs.sliding
        qkv = self.linear_qkv(hidden)
        gate = None
        cp = self.groups.size("cp")
        if self.rotate and not self.gated and self.q_layernorm is None and cp == 1:
            # The common case in one op: split, rotate q and k, SDPA's layout.
            cos, sin = self._tables(inputs, qkv.dtype)
            heads = dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads)
            q, k, v = apply_rotary_qkv(qkv, cos, sin, **heads, backend=self.backend)
        else:
            q, k, v, gate = self._heads(qkv, inputs, cp)
        mask = inputs.mask
        # Selective recompute (Korthikanti et al. 2022): keep q/k/v, recompute the s x s scores,
        # softmax and dropout in backward; checkpoint replays the same dropout draws.
        if self.selective_recompute and self.training:
            out = checkpoint(lambda q_, k_, v_: self._core(q_, k_, v_, mask), self.rng, q, k, v)
        else:
            out = self._core(q, k, v, mask)
        if gate is not None:
            # gate [s, b, nq·d] is in the same head-major order as the core output.
            out = out * torch.sigmoid(gate)
        return self.linear_proj(out)

    def _heads(self, qkv, inputs: AttentionInputs, cp: int):
        """``qkv [s, b, ...]`` -> ``q [b, nq, s, d]``, ``k/v [b, nkv, s·cp, d]`` (QK-norm, RoPE,
        the cp gather of K/V) and the output gate ``[s, b, nq·d]`` (or None)."""
        s, b = qkv.shape[0], qkv.shape[1]
        d = self.head_dim
        q_len, kv_len = self.num_heads * d, self.num_kv_heads * d
        # The column-parallel shard is [Q | K | V (| G)] of this rank's heads (partition_sizes),
        # not interleaved.
        gate = None
        if self.gated:
            q, k, v, gate = qkv.split((q_len, kv_len, kv_len, q_len), dim=-1)
        else:
            q, k, v = qkv.split((q_len, kv_len, kv_len), dim=-1)
        q = q.reshape(s, b, self.num_heads, d)
        k = k.reshape(s, b, self.num_kv_heads, d)
        v = v.reshape(s, b, self.num_kv_heads, d)
        if self.q_layernorm is not None:
            q = self.q_layernorm(q)
            k = self.k_layernorm(k)
        if self.rotate:
            cos, sin = self._tables(inputs, q.dtype)
            q = apply_rotary(q, cos, sin, backend=self.backend)
            k = apply_rotary(k, cos, sin, backend=self.backend)
        if cp == 1 and (self.rotate or self.q_layernorm is not None):
            # q and k are new tensors: with a copy of v too, nothing keeps the qkv output (gate
            # block included) for backward, as apply_rotary_qkv does.
            v = v.contiguous()
        if cp > 1:
            # After RoPE, so every key carries its own global position; keys in position order,
            # as the block mask indexes them. All cp ranks issue k then v in this order.
            k = gather_in_position_order(k, self.groups.cp, dim=0)
            v = gather_in_position_order(v, self.groups.cp, dim=0)
        # [s, b, n, d] -> [b, n, s, d], SDPA's layout: strided views, no copies (SDPA reads
        # strides).
        return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), gate

    def _tables(self, inputs: AttentionInputs, dtype: torch.dtype):
        """The RoPE ``(cos, sin)`` in the activations' ``dtype``."""
        if inputs.cos is None:
            raise ValueError(
                "Attention with position_embedding_type='rope' got no rotary table: the model's "
                "DecoderSpec.rotary is None; give it a RotarySpec or set "
                "position_embedding_type='none'"
            )
        # Tables are fp32 (fp64 in fp64 runs); cast to the activations' dtype so the rotation does
        # not upcast q/k. Their width is the rotated one: apply_rotary leaves later channels as is.
        return inputs.cos.to(dtype), inputs.sin.to(dtype)
