"""The Mamba-2 state-space-duality (SSD) scan in plain torch: chunked form and single step.

Per head ``h`` (``nh`` heads of ``p`` channels, state size ``n``, heads grouped ``g`` ways for
B and C), with ``a_t = dt_t · A_h`` (``A_h < 0``, so ``exp(a_t)`` is a decay in (0, 1])::

    S_t = exp(a_t) · S_{t-1} + dt_t · x_t ⊗ B_t        S: [p, n]
    y_t = S_t · C_t                                      y: [p]

:func:`ssd_step` is that recurrence for one token (generation). :func:`ssd_chunked` computes
the same outputs for a whole sequence with matrix products (Dao & Gu 2024, "Transformers are
SSMs", section 6): the sequence is cut into chunks of ``chunk_size`` tokens and

1. inside a chunk, ``y_l = Σ_{s<=l} (C_l·B_s) · exp(cum_l - cum_s) · dt_s x_s``, where
   ``cum`` is the running sum of ``a`` in the chunk: an attention-like masked product;
2. each chunk's contribution to the state at its end,
   ``Σ_s exp(cum_last - cum_s) · dt_s x_s ⊗ B_s``;
3. the states entering the chunks, by the recurrence above taken a chunk at a time
   (``S_c = exp(cum_last) · S_{c-1} + contribution_c``), a loop over ``s / chunk_size`` chunks;
4. what the entering state adds to each token: ``exp(cum_l) · S_entering · C_l``.

B and C are used per group (heads ``j·nh/g ... (j+1)·nh/g - 1`` share group ``j``), so the
``C·B`` scores are computed once per group, not per head. A sequence that is not a multiple of
``chunk_size`` is padded with ``dt = 0`` steps, which neither decay nor add to the state, so
the outputs and the final state are those of the unpadded sequence. The scan runs in the
inputs' dtype, at least float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["ssd_chunked", "ssd_step"]


def _scan_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _chunks(t: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """``[b, s, ...]`` -> ``[b, c, chunk, ...]``, padded with zeros at the end of ``s``."""
    if pad:
        widths = [0, 0] * (t.dim() - 2) + [0, pad]
        t = F.pad(t, widths)
    return t.reshape(t.shape[0], -1, chunk, *t.shape[2:])


def _chunk_states(cum, xdt, B, initial_state):
    """States entering each chunk ``[b, c, g, r, p, n]`` and the final state (steps 2 and 3)."""
    decay_to_end = torch.exp(cum[:, :, -1:] - cum)  # [b, c, L, g, r]
    # Two operands, one batched matmul over the chunk's positions (a three-operand einsum's
    # contraction order, and so its cost, would depend on whether opt_einsum is installed).
    contrib = torch.einsum("bclgrp,bclgn->bcgrpn", xdt * decay_to_end[..., None], B)
    chunk_decay = torch.exp(cum[:, :, -1])  # [b, c, g, r]: decay across a whole chunk
    b, c, g, r, p, n = contrib.shape
    state = (
        contrib.new_zeros(b, g, r, p, n)
        if initial_state is None
        else initial_state.to(contrib.dtype).reshape(b, g, r, p, n)
    )
    entering = []
    for k in range(c):
        entering.append(state)
        state = chunk_decay[:, k, :, :, None, None] * state + contrib[:, k]
    return torch.stack(entering, dim=1), state


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan of a whole sequence (module docstring).

    ``x [b, s, nh, p]``, ``dt [b, s, nh]`` (already softplus'd, biased and clamped),
    ``A [nh]`` (negative), ``B``/``C [b, s, g, n]``, ``initial_state [b, nh, p, n]`` or None
    (zeros). Returns ``y [b, s, nh, p]`` in ``x``'s dtype and the final state
    ``[b, nh, p, n]`` in the scan dtype (``x``'s, at least float32).
    """
    b, s, nh, p = x.shape
    g, n = B.shape[2], B.shape[3]
    if nh % g != 0:
        raise ValueError(f"ssd_chunked: {nh} heads do not split into {g} B/C groups")
    r = nh // g
    dtype = _scan_dtype(x.dtype)
    pad = (-s) % chunk_size
    dt = dt.to(dtype)
    # Heads as (group, head in group): B and C broadcast over r instead of being repeated.
    a = _chunks((dt * A.to(dtype)).reshape(b, s, g, r), pad, chunk_size)
    xdt = _chunks((x.to(dtype) * dt[..., None]).reshape(b, s, g, r, p), pad, chunk_size)
    B = _chunks(B.to(dtype), pad, chunk_size)
    C = _chunks(C.to(dtype), pad, chunk_size)
    cum = torch.cumsum(a, dim=2)  # [b, c, L, g, r]
    # Step 1: decay from s to l (l >= s) inside a chunk; -inf above the diagonal so exp gives 0
    # with a zero gradient, where exp(cum_l - cum_s) for l < s could overflow.
    seg = cum.permute(0, 1, 3, 4, 2)  # [b, c, g, r, L]
    diff = seg[..., :, None] - seg[..., None, :]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp(diff.masked_fill(~causal, float("-inf")))  # [b, c, g, r, L, L]
    scores = torch.einsum("bclgn,bcsgn->bcgls", C, B)
    y = torch.einsum("bcgrls,bcsgrp->bclgrp", decay * scores[:, :, :, None], xdt)
    entering, final = _chunk_states(cum, xdt, B, initial_state)
    # Step 4: the entering state read by C_l, decayed from the chunk start to l.
    y_state = torch.einsum("bclgn,bcgrpn->bclgrp", C, entering)
    y = y + y_state * torch.exp(cum)[..., None]
    y = y.reshape(b, -1, nh, p)[:, :s]
    return y.to(x.dtype), final.reshape(b, nh, p, n)


def ssd_step(
    state: torch.Tensor,
    x_t: torch.Tensor,
    dt_t: torch.Tensor,
    A: torch.Tensor,
    B_t: torch.Tensor,
    C_t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: ``state [b, nh, p, n]``, ``x_t [b, nh, p]``,
    ``dt_t [b, nh]``, ``A [nh]``, ``B_t``/``C_t [b, g, n]`` -> ``(y_t [b, nh, p], new state)``.
    """
    nh, g = x_t.shape[1], B_t.shape[1]
    dtype = _scan_dtype(x_t.dtype)
    dt_t = dt_t.to(dtype)
    B_h = B_t.to(dtype).repeat_interleave(nh // g, dim=1)  # [b, nh, n]
    C_h = C_t.to(dtype).repeat_interleave(nh // g, dim=1)
    decay = torch.exp(dt_t * A.to(dtype))[..., None, None]
    update = (dt_t[..., None] * x_t.to(dtype))[..., None] * B_h[:, :, None, :]
    new_state = decay * state.to(dtype) + update
    y_t = torch.einsum("bhpn,bhn->bhp", new_state, C_h)
    return y_t.to(x_t.dtype), new_state
