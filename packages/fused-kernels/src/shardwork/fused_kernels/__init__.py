"""shardwork.fused_kernels — fused training ops with a torch reference, Triton kernels and a TE backend.

Ops (each differentiable, each with ``backend="auto"|"torch"|"triton"|"te"``):

- :func:`rms_norm`, :func:`layer_norm` — float32 statistics, zero-centered gamma option.
- :func:`swiglu`, :func:`geglu` — on a fused ``[gate | up]`` projection, optional per-token weights.
- :func:`apply_rotary` with :func:`rotary_inv_freq` (linear / Llama-3 / YaRN scaling),
  :func:`rotary_cos_sin` and :func:`packed_positions` — half-split or interleaved, partial;
  :func:`apply_rotary_qkv` splits a fused QKV projection into SDPA's inputs while rotating.
- :func:`cross_entropy` — optionally vocab-parallel over ``tp_group``, label smoothing,
  ignore index, per-token losses.
- :func:`linear_cross_entropy` — output projection + cross entropy in chunks, never the
  ``[N, V]`` logits: vocab-parallel, token weights, label smoothing, logit soft-capping.
- :func:`router_topk` — MoE score function + (group-limited, biased) top-k + aux statistics.
- :func:`permute_tokens` / :func:`unpermute_tokens` — group token rows by expert and back.

- :func:`linear` — ``F.linear`` whose float32 CPU products run on oneDNN where MKL is the
  slower library (non-Intel CPUs; ``backend="auto"`` only); :func:`onednn_linear` and
  :func:`onednn_grouped_linear` run oneDNN explicitly, :func:`onednn_preferred` says where.
- :func:`grouped_swiglu_mlp` — the MoE experts' SwiGLU MLP on float32 CPU rows, one expert
  group at a time (products, activation and their gradients while the group is in cache).

Backend choice: :func:`resolve_backend`, :func:`set_default_backend`, :func:`get_default_backend`.
Environment variables (``SHARDWORK_KERNEL_BACKEND``, ``SHARDWORK_CPU_GEMM``):
:func:`environment_problems` checks them before a program starts work.
"""

from shardwork.fused_kernels.activations import geglu, swiglu
from shardwork.fused_kernels.backend import (
    BACKENDS,
    OPS,
    BackendUnavailableError,
    get_default_backend,
    resolve_backend,
    set_default_backend,
)
from shardwork.fused_kernels.cpu_expert_mlp import grouped_swiglu_mlp
from shardwork.fused_kernels.cpu_gemm import (
    linear,
    onednn_grouped_linear,
    onednn_linear,
    onednn_preferred,
)
from shardwork.fused_kernels.cross_entropy_op import cross_entropy
from shardwork.fused_kernels.environment import environment_problems
from shardwork.fused_kernels.linear_cross_entropy_op import linear_cross_entropy
from shardwork.fused_kernels.norms import layer_norm, rms_norm
from shardwork.fused_kernels.permute import permute_tokens, unpermute_tokens
from shardwork.fused_kernels.rotary import apply_rotary, apply_rotary_qkv
from shardwork.fused_kernels.rotary_freqs import (
    LinearRopeScaling,
    Llama3RopeScaling,
    YarnRopeScaling,
    packed_positions,
    rotary_cos_sin,
    rotary_inv_freq,
)
from shardwork.fused_kernels.router import router_topk
from shardwork.fused_kernels.router_output import RouterTopK

__all__ = [
    "BACKENDS",
    "OPS",
    "BackendUnavailableError",
    "LinearRopeScaling",
    "Llama3RopeScaling",
    "RouterTopK",
    "YarnRopeScaling",
    "apply_rotary",
    "apply_rotary_qkv",
    "cross_entropy",
    "environment_problems",
    "geglu",
    "get_default_backend",
    "grouped_swiglu_mlp",
    "layer_norm",
    "linear",
    "linear_cross_entropy",
    "onednn_grouped_linear",
    "onednn_linear",
    "onednn_preferred",
    "packed_positions",
    "permute_tokens",
    "resolve_backend",
    "rms_norm",
    "rotary_cos_sin",
    "rotary_inv_freq",
    "router_topk",
    "set_default_backend",
    "swiglu",
    "unpermute_tokens",
]
