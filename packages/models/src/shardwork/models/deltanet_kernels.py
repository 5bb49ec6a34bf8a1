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

import importlib.metadata
import re

import torch

from shardwork.models.scan_kernels import OptionalKernel

__all__ = [
    "FLA_GATED_DELTA_RULE",
    "fla_arguments",
    "fla_device_refusal",
    "gated_delta_rule_kernel",
    "hopper_triton_refusal",
]

# Triton versions whose code for fla's gated backward (``chunk_bwd_dqkwg``) is wrong on
# Hopper (compute capability 9.x): fla 0.6.0 raises a RuntimeError in the first backward
# there (its issue #640). Seen on an H200 with Triton 3.6.0, 2026-11-27.
BAD_TRITON_ON_HOPPER = ((3, 4, 0), (3, 7, 1))


def _version_tuple(version: str) -> tuple[int, ...]:
    """``"3.6.0+git1a2b"`` -> ``(3, 6, 0)``: the leading dotted integers."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def hopper_triton_refusal(capability: tuple[int, int], triton_version: str) -> str | None:
    """Why fla's gated kernel must not run on a GPU of ``capability`` with this Triton, or
    None (see ``BAD_TRITON_ON_HOPPER``)."""
    low, high = BAD_TRITON_ON_HOPPER
    if capability[0] == 9 and low <= _version_tuple(triton_version) < high:
        return (
            f"Triton {triton_version} on a compute-capability {capability[0]}.{capability[1]} "
            "(Hopper) GPU miscompiles flash-linear-attention's gated backward, which fla refuses "
            "to run (fla issue #640; Triton >= 3.7.1 is fine)"
        )
    return None


def fla_device_refusal(device: torch.device) -> str | None:
    """:func:`hopper_triton_refusal` for a CUDA ``device`` and the installed Triton."""
    if device.type != "cuda":
        return None
    try:
        version = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None
    return hopper_triton_refusal(torch.cuda.get_device_capability(device), version)


FLA_GATED_DELTA_RULE = OptionalKernel(
    owner="GatedDeltaNetConfig",
    distribution="flash-linear-attention",
    module="fla.ops.gated_delta_rule",
    function="chunk_gated_delta_rule",
    device_refusal=fla_device_refusal,
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
