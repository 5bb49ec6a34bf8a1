"""The gated delta rule through flash-linear-attention's Triton kernel (optional;
:mod:`.scan_kernels`).

:func:`gated_delta_rule_kernel` has the contract of
:func:`shardwork.models.delta_rule.gated_delta_rule_chunked` minus ``chunk_size`` (fla fixes
its own chunk; the result does not depend on it). Both use the ``[b, s, heads, dim]`` layout,
``g`` as a log decay (``S_t = exp(g_t)·S_{t-1} + ...``), ``beta`` after the sigmoid and a
``[b, nh, dk, dv]`` state. The mixer has already L2-normalised q and k (with its own
epsilon), scaled q by ``1/sqrt(dk)`` and repeated the key heads to the value heads, so fla
is called with ``scale=1.0`` and ``use_qk_l2norm_in_kernel=False``; fla's own defaults
(``scale=1/sqrt(dk)``, its GVA head mapping) would apply those steps a second time or with
another convention.
"""

from __future__ import annotations

import torch

from shardwork.models.scan_kernels import OptionalKernel

__all__ = ["FLA_GATED_DELTA_RULE", "fla_arguments", "gated_delta_rule_kernel"]

FLA_GATED_DELTA_RULE = OptionalKernel(
    owner="GatedDeltaNetConfig",
    distribution="flash-linear-attention",
    module="fla.ops.gated_delta_rule",
    function="chunk_gated_delta_rule",
)


def fla_arguments(q, k, v, g, beta, initial_state) -> dict:
    """fla's keyword arguments for the reference's inputs (module docstring); the kernel-only
    flags are kept apart so that fla's naive reference can take the rest."""
    return dict(
        q=q,
        k=k,
        v=v,
        g=g,
        beta=beta,
        scale=1.0,
        initial_state=initial_state,
        output_final_state=True,
    )


def gated_delta_rule_kernel(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``gated_delta_rule_chunked``'s inputs and outputs (``o [b, s, nh, dv]``, final state
    ``[b, nh, dk, dv]``), computed by fla's ``chunk_gated_delta_rule``."""
    rule = FLA_GATED_DELTA_RULE.load()
    arguments = fla_arguments(q, k, v, g, beta, initial_state)
    return rule(**arguments, use_qk_l2norm_in_kernel=False)
