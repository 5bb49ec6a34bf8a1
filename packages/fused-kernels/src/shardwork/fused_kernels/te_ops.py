"""The ``te`` backend: thin adapters from this package's op signatures to Transformer Engine.

Imported only after ``backend.resolve_backend`` has confirmed (through ``te_support``) that
TE imports and is recent enough for the op, on a CUDA tensor. Which TE API each adapter
calls, and from which version, is listed in ``te_support.MIN_TE_VERSION``:

- norms: ``transformer_engine_torch`` ``rmsnorm_fwd/bwd`` and ``layernorm_fwd/bwd``
  (TE 2.x argument order) inside our own autograd function, so the weight stays the
  caller's parameter;
- SwiGLU/GeGLU: ``transformer_engine.pytorch.ops.SwiGLU``/``GEGLU`` (TE gates the first
  half, as we do); token weights are one extra multiply;
- cross entropy: ``transformer_engine.pytorch.cross_entropy.parallel_cross_entropy``
  (label smoothing and ignore index passed through, per-token losses); TE overwrites its
  input with the gradient in forward, so it gets a copy unless ``inplace_backward=True``;
- router: ``transformer_engine.pytorch.router.fused_topk_with_score_function`` and
  ``fused_compute_score_for_moe_aux_loss`` (Megatron-Core's fused path).

These adapters cannot run on the CPU machines this package is developed on; their tests
(``tests/test_te.py``) compare each with the torch reference and skip without TE and a GPU.
"""

from __future__ import annotations

import importlib

import torch

from shardwork.fused_kernels import te_support
from shardwork.fused_kernels.router_output import RouterTopK, default_normalize

__all__ = ["cross_entropy", "glu", "layer_norm", "rms_norm", "router_topk"]


def _tex():
    return importlib.import_module("transformer_engine_torch")


def _te_dtype(dtype: torch.dtype):
    return importlib.import_module("transformer_engine.pytorch.constants").TE_DType[dtype]


class _TENorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps, zero_centered, rms):
        tex = _tex()
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        otype = _te_dtype(x.dtype)
        if rms:
            y, _, rsigma = tex.rmsnorm_fwd(x2, weight, eps, None, None, otype, 0, zero_centered)
            mu = None
        else:
            y, mu, rsigma = tex.layernorm_fwd(
                x2, weight, bias, eps, None, None, otype, 0, zero_centered
            )
        ctx.save_for_backward(x2, weight, mu, rsigma)
        ctx.cfg = (zero_centered, rms, x.shape, bias is not None)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        tex = _tex()
        x2, weight, mu, rsigma = ctx.saved_tensors
        zero_centered, rms, shape, has_bias = ctx.cfg
        dy2 = dy.reshape(x2.shape).contiguous()
        if rms:
            dx, dw = tex.rmsnorm_bwd(dy2, x2, rsigma, weight, 0, zero_centered)
            db = None
        else:
            dx, dw, db = tex.layernorm_bwd(dy2, x2, mu, rsigma, weight, 0, zero_centered)
            db = db if has_bias else None
        return dx.view(shape), dw, db, None, None, None


def rms_norm(x, weight, *, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """RMSNorm through Transformer Engine's fused kernels."""
    return _TENorm.apply(x, weight, None, float(eps), bool(zero_centered_gamma), True)


def layer_norm(x, weight, bias, *, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """LayerNorm through Transformer Engine's fused kernels (zero bias when ``bias`` is None)."""
    b = bias if bias is not None else torch.zeros_like(weight)
    return _TENorm.apply(x, weight, b, float(eps), bool(zero_centered_gamma), False)


def glu(x, token_weights, *, kind: str) -> torch.Tensor:
    """SwiGLU or GeGLU (tanh) through ``transformer_engine.pytorch.ops``; token weights multiplied after."""
    ops = te_support.te_module().ops
    op = ops.SwiGLU() if kind == "swiglu" else ops.GEGLU()
    y = op(x)
    if token_weights is not None:
        w = token_weights if token_weights.dim() == y.dim() else token_weights.unsqueeze(-1)
        y = (y.float() * w.float()).to(y.dtype)
    return y


def cross_entropy(
    logits, labels, *, tp_group, ignore_index: int, label_smoothing: float, inplace: bool
) -> torch.Tensor:
    """Per-token losses ``[N]`` from TE's (vocab-parallel) cross entropy.

    TE's kernel stores the gradient into its input during the forward pass, so unless the
    caller allowed ``inplace`` (``inplace_backward=True``) it gets a copy of the logits.
    """
    if not inplace:
        logits = logits.clone()
    ce = importlib.import_module("transformer_engine.pytorch.cross_entropy")
    losses = ce.parallel_cross_entropy(
        logits.unsqueeze(0),
        labels.unsqueeze(0),
        float(label_smoothing),
        False,
        tp_group,
        int(ignore_index),
    )
    return losses.reshape(-1).float()


def router_topk(logits, *, topk, score_function, pre_softmax, num_groups, group_topk, expert_bias,
                scaling_factor, normalize):  # fmt: skip
    """Router top-k through TE's fused router kernels (Megatron-Core semantics)."""
    default = default_normalize(score_function, topk)
    if normalize is not None and normalize != default:
        raise ValueError(
            f"backend='te' follows Megatron's renormalisation rule only (normalize={default} here), "
            f"got normalize={normalize}"
        )
    if score_function == "sqrtsoftplus":
        reason = te_support.feature_unavailable_reason("router_topk.sqrtsoftplus")
        if reason is not None:
            raise ValueError(f"backend='te': {reason}")
    router = importlib.import_module("transformer_engine.pytorch.router")
    probs, routing_map = router.fused_topk_with_score_function(
        logits=logits,
        topk=topk,
        use_pre_softmax=pre_softmax,
        num_groups=num_groups,
        group_topk=group_topk,
        scaling_factor=scaling_factor,
        score_function=score_function,
        expert_bias=expert_bias,
    )
    aux_map, aux_scores = router.fused_compute_score_for_moe_aux_loss(
        logits=logits, topk=topk, score_function=score_function
    )
    return RouterTopK(probs, routing_map.bool(), aux_scores, aux_map.sum(0).long())
