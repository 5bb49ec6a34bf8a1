"""The MoE experts' SwiGLU MLP on float32 CPU rows, computed one expert group at a time.

``y[rows of expert l] = (silu(gate) · up · p) · W2[l]ᵀ`` with ``[gate | up] = x · W1[l]ᵀ``, for
rows grouped contiguously by expert (``counts``) and optional per-row routing weights ``p``.

Run as three whole-tensor steps (grouped fc1, SwiGLU, grouped fc2), the activation reads and
writes the ``[N, 2f]`` fc1 output after it has left the cache: on the 2-core AMD EPYC, one
thread, Mixtral-style experts (8 x ffn 1792, 4,096 rows), the SwiGLU's multiplications took
~14 ms per ``[4096, 1792]`` pass, ~5x the per-row cost of the same work on one expert's rows
right after its product (``benchmarks/models_moe.py``). Here each group runs fc1, the
activation and fc2 back to back, and its backward likewise, so the elementwise work finds its
operands in cache. The products are :func:`~shardwork.fused_kernels.cpu_gemm.group_mm_nt`'s
(oneDNN from :func:`~shardwork.fused_kernels.cpu_gemm.group_min` rows and inner width, MKL
below), the weight gradients :func:`~shardwork.fused_kernels.cpu_gemm.weight_grad_mm`'s (fc2's
``[H, f]`` on oneDNN where ``f >= 2H``, fc1's on MKL; both on oneDNN on Zen 5), as in the
unfused path.

Memory: the tensors the unfused path saves, group by group (fc1's output, ``silu(gate)`` and
fc2's input; the caller's ``x``), so activation memory and its estimate
(``shardwork.models.calculator_memory``) are the same on both paths. The backward writes the fc1
output's gradient over the saved fc1 output (nothing else reads it), so the graph can be
backpropagated once, as the eager SwiGLU with ``inplace_backward``.

Same arithmetic, in the same order, as the unfused path (grouped products, then
``shardwork.fused_kernels.swiglu`` with ``token_weights``): the results are equal bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from shardwork.fused_kernels.cpu_gemm import group_mm_nt, group_rows, weight_grad_mm

__all__ = ["grouped_swiglu_mlp"]


def _swiglu(h: torch.Tensor, p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(silu(gate), silu(gate) · up)`` of one group's fc1 output ``h [n, 2f]``, the second
    times ``p [n, 1]`` in place when given (the eager SwiGLU's order of operations)."""
    gate, up = h.chunk(2, dim=-1)
    act = F.silu(gate)
    out = act * up
    return act, (out if p is None else out.mul_(p))


class _GroupedSwiGLUMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NH, w1_LFH, w2_LHf, probs_N1, counts):
        y_NH = x_NH.new_empty((x_NH.shape[0], w2_LHf.shape[1]))
        saved = []  # per expert with rows: fc1 output, silu(gate), fc2 input
        for group, rows in group_rows(counts):
            if rows.start == rows.stop:
                continue
            h = group_mm_nt(x_NH[rows], w1_LFH[group])
            act, a = _swiglu(h, None if probs_N1 is None else probs_N1[rows])
            group_mm_nt(a, w2_LHf[group], y_NH[rows])
            saved += (h, act, a)
        ctx.counts = counts
        ctx.save_for_backward(x_NH, w1_LFH, w2_LHf, probs_N1, *saved)
        return y_NH

    @staticmethod
    @once_differentiable
    def backward(ctx, dy_NH):
        x_NH, w1_LFH, w2_LHf, probs_N1, *saved = ctx.saved_tensors
        need_x, need_w1, need_w2, need_p = ctx.needs_input_grad[:4]
        dx = torch.empty_like(x_NH) if need_x else None
        dw1 = torch.empty_like(w1_LFH) if need_w1 else None
        dw2 = torch.empty_like(w2_LHf) if need_w2 else None
        dp = torch.empty_like(probs_N1) if need_p else None
        per_group = iter(saved)
        for group, rows in group_rows(ctx.counts):
            if rows.start == rows.stop:  # an expert without rows: zero weight gradients
                for dw in (dw1, dw2):
                    if dw is not None:
                        dw[group].zero_()
                continue
            h, act, a = next(per_group), next(per_group), next(per_group)
            dy, gate, up = dy_NH[rows], *h.chunk(2, dim=-1)
            if dw2 is not None:
                weight_grad_mm(dy, a, dw2[group])
            da = group_mm_nt(dy, w2_LHf[group].t())  # dL/d(fc2 input), [n, f]
            if probs_N1 is not None:
                if dp is not None:
                    dp[rows] = (act * up).mul_(da).sum(dim=-1, keepdim=True)
                da.mul_(probs_N1[rows])
            # fc1's output gradient over its saved values: da · up is taken before the up half
            # becomes d(up), and silu_backward reads each gate value before overwriting it.
            da_up = da * up
            torch.mul(da, act, out=up)
            torch.ops.aten.silu_backward.grad_input(da_up, gate, grad_input=gate)
            if dw1 is not None:
                weight_grad_mm(h, x_NH[rows], dw1[group])
            if dx is not None:
                group_mm_nt(h, w1_LFH[group].t(), dx[rows])
        return dx, dw1, dw2, dp, None


def _shapes_fit(x_NH: torch.Tensor, w1_LFH: torch.Tensor, w2_LHf: torch.Tensor) -> bool:
    if x_NH.dim() != 2 or w1_LFH.dim() != 3:
        return False
    L, two_f, hidden = w1_LFH.shape
    return x_NH.shape[1] == hidden and two_f % 2 == 0 and w2_LHf.shape == (L, hidden, two_f // 2)


def grouped_swiglu_mlp(
    x_NH: torch.Tensor,
    w1_LFH: torch.Tensor,
    w2_LHf: torch.Tensor,
    counts: list[int],
    probs_N: torch.Tensor | None = None,
) -> torch.Tensor:
    """The SwiGLU experts' output ``[N, H]`` for rows grouped by expert (module docstring).

    ``x_NH [N, H]``; ``w1_LFH [L, 2f, H]`` (each expert's ``[gate | up]`` rows, the layout of
    ``GroupedExperts.linear_fc1``); ``w2_LHf [L, H, f]``; ``counts``: ``L`` Python ints, rows per
    expert, summing to ``N``; ``probs_N``: ``[N]`` or ``[N, 1]`` weights scaling each row's
    activation, or None. All plain float32 CPU tensors (callers ask
    :func:`~shardwork.fused_kernels.cpu_gemm.onednn_preferred` first). Gradients flow to every
    tensor argument; one backward only (see the module docstring).
    """
    tensors = {"x_NH": x_NH, "w1_LFH": w1_LFH, "w2_LHf": w2_LHf, "probs_N": probs_N}
    for name, t in tensors.items():
        if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu"):
            raise ValueError(f"{name} is {t.dtype} on {t.device}: float32 CPU tensors only")
    if not _shapes_fit(x_NH, w1_LFH, w2_LHf):
        raise ValueError(
            f"shapes x_NH={tuple(x_NH.shape)}, w1_LFH={tuple(w1_LFH.shape)}, "
            f"w2_LHf={tuple(w2_LHf.shape)}: expected [N, H], [L, 2f, H] and [L, H, f]"
        )
    L = w1_LFH.shape[0]
    if len(counts) != L or sum(counts) != x_NH.shape[0] or min(counts, default=0) < 0:
        raise ValueError(
            f"counts={counts} must hold {L} non-negative row counts (one per expert) summing to "
            f"x_NH's {x_NH.shape[0]} rows"
        )
    probs_N1 = None
    if probs_N is not None:
        n = x_NH.shape[0]
        if probs_N.dim() not in (1, 2) or probs_N.numel() != n or probs_N.shape[0] != n:
            raise ValueError(f"probs_N.shape={tuple(probs_N.shape)}: expected [{n}] or [{n}, 1]")
        probs_N1 = probs_N.reshape(-1, 1)
    return _GroupedSwiGLUMLP.apply(x_NH.contiguous(), w1_LFH, w2_LHf, probs_N1, list(counts))
