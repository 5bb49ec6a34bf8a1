"""The Mamba-2 SSD scan through mamba-ssm's Triton kernel (optional; :mod:`.scan_kernels`).

:func:`ssd_chunked_kernel` has the contract of :func:`shardwork.models.ssd.ssd_chunked`
(same shapes, same layout: ``x [b, s, nh, p]``, ``dt [b, s, nh]``, ``A [nh]``,
``B``/``C [b, s, g, n]`` with head ``h`` reading group ``h // (nh / g)``, both libraries'
convention) so the mixer swaps one for the other. The mixer already applies ``dt_bias``,
softplus and ``dt_limit`` to ``dt`` and adds ``D·x`` and the gate itself, so the kernel is
called with ``D=None, z=None, dt_bias=None, dt_softplus=False`` and its default
``dt_limit=(0, inf)`` (no clamp): it computes exactly what the reference computes.
"""

from __future__ import annotations

import torch

from shardwork.models.scan_kernels import OptionalKernel

__all__ = ["MAMBA_SSD_KERNEL", "ssd_chunked_kernel"]

MAMBA_SSD_KERNEL = OptionalKernel(
    owner="MambaConfig",
    distribution="mamba-ssm",
    module="mamba_ssm.ops.triton.ssd_combined",
    function="mamba_chunk_scan_combined",
)


def ssd_chunked_kernel(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``ssd_chunked``'s inputs and outputs (``y [b, s, nh, p]``, final state
    ``[b, nh, p, n]``), computed by ``mamba_chunk_scan_combined``."""
    scan = MAMBA_SSD_KERNEL.load()
    y, final = scan(
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        z=None,
        dt_bias=None,
        initial_states=initial_state,
        dt_softplus=False,
        return_final_states=True,
    )
    return y, final
