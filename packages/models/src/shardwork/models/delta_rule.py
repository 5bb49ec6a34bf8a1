"""The gated delta rule in plain torch: chunked (training, prefill) and one step (generation).

Convention (Yang et al., "Gated Delta Networks", 2024), per batch row and head, with the state
``S`` a ``[dk, dv]`` matrix, ``S_0`` the initial state (zeros by default)::

    S_t = exp(g_t) · S_{t-1} + beta_t · k_t (v_t - exp(g_t) · S_{t-1}ᵀ k_t)ᵀ
    o_t = S_tᵀ q_t

i.e. ``S_t = exp(g_t) (I - beta_t k_t k_tᵀ) S_{t-1} + beta_t k_t v_tᵀ``: decay the memory,
then move its prediction for key ``k_t`` a fraction ``beta_t`` towards ``v_t``. ``g_t <= 0``
is a log decay. No normalisation or scaling happens here: the mixer L2-normalises q and k
and scales q by ``1/sqrt(dk)`` before calling in.

Chunked form (WY / UT transform). Within a chunk of ``C`` tokens let ``c_i = g_1 + ... + g_i``
(cumulative log decay from the chunk start) and write the update as
``S_i = exp(g_i) S_{i-1} + k_i w_iᵀ`` with ``w_i = beta_i (v_i - exp(g_i) S_{i-1}ᵀ k_i)``.
Unrolling ``S_{i-1}`` from the chunk's initial state ``S_0`` gives, for all ``i`` at once, the
unit lower-triangular system

    (I + A) W = beta ⊙ V - (beta · exp(c)) ⊙ K S_0,
    A_ij = beta_i exp(c_i - c_j) k_i·k_j  (j < i),

solved by triangular substitution for both right-hand sides (``U`` and ``Kd`` below, so
``W = U - Kd S_0``). Then ``O = (exp(c) ⊙ Q) S_0 + ((Q Kᵀ) ⊙ D) W`` with
``D_ij = exp(c_i - c_j)`` for ``j <= i`` (0 above the diagonal), and the state passed on is
``S_C = exp(c_C) S_0 + (exp(c_C - c) ⊙ K)ᵀ W``. Everything but the last two lines is batched
over all chunks; only the state passes sequentially from chunk to chunk. The result equals
the recurrence up to rounding. A sequence that is not a multiple of the chunk is padded with
``k = v = q = 0``, ``g = 0``, ``beta = 0`` tokens, which leave the state unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["gated_delta_rule_chunked", "gated_delta_rule_step"]


def _check_shapes(q, k, v, g, beta, initial_state) -> None:
    b, s, nh, dk = q.shape
    if k.shape != q.shape or v.shape[:3] != (b, s, nh):
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k must be "
            "[b, s, nh, dk] and v [b, s, nh, dv] (repeat key heads to the value heads first)"
        )
    if g.shape != (b, s, nh) or beta.shape != (b, s, nh):
        raise ValueError(
            f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [b, s, nh] = {(b, s, nh)}"
        )
    if initial_state is not None and initial_state.shape != (b, nh, dk, v.shape[-1]):
        raise ValueError(
            f"initial_state {tuple(initial_state.shape)} must be [b, nh, dk, dv] = "
            f"{(b, nh, dk, v.shape[-1])}"
        )


def _chunks(x: torch.Tensor, pad: int, chunk: int) -> torch.Tensor:
    """``[b, s, nh, *rest]`` -> ``[b, nh, n_chunks, chunk, *rest]``, zero-padded at the end."""
    x = x.transpose(1, 2)
    if pad:
        # F.pad counts pairs from the last dim: skip the trailing dims, pad the sequence's end.
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(*x.shape[:2], -1, chunk, *x.shape[3:])


def gated_delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a whole sequence, chunk by chunk (see module docstring).

    ``q, k [b, s, nh, dk]``, ``v [b, s, nh, dv]``, ``g, beta [b, s, nh]``,
    ``initial_state [b, nh, dk, dv]`` or None (zeros). Returns ``o [b, s, nh, dv]`` and the
    final state ``[b, nh, dk, dv]``. Computes in the inputs' dtype (callers upcast bf16).
    """
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} is invalid: it must be an integer >= 1")
    _check_shapes(q, k, v, g, beta, initial_state)
    b, s, nh, dk = q.shape
    dv = v.shape[-1]
    chunk = chunk_size
    pad = -s % chunk
    q, k, v = (_chunks(x, pad, chunk) for x in (q, k, v))
    g, beta = (_chunks(x, pad, chunk) for x in (g, beta))
    c = g.cumsum(-1)  # [b, nh, n, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(c_i - c_j) for j <= i; above the diagonal the difference is positive and could
    # overflow, so it is masked before exp rather than after.
    diff = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~causal, float("-inf"))
    decay = diff.exp()  # D, [b, nh, n, C, C]
    kb = k * beta.unsqueeze(-1)
    lower = (kb @ k.transpose(-1, -2)) * decay
    system = lower.tril(-1) + torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat((v * beta.unsqueeze(-1), kb * c.exp().unsqueeze(-1)), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, kd = solved.split((dv, dk), dim=-1)
    scores = (q @ k.transpose(-1, -2)) * decay
    q_in = q * c.exp().unsqueeze(-1)  # reads the chunk's initial state
    k_out = k * (c[..., -1:] - c).exp().unsqueeze(-1)  # writes into the chunk's final state
    chunk_decay = c[..., -1].exp()[..., None, None]  # [b, nh, n, 1, 1]
    if initial_state is None:
        state = q.new_zeros(b, nh, dk, dv)
    else:
        state = initial_state.to(q.dtype)
    outs = []
    for i in range(q.shape[2]):
        w = u[:, :, i] - kd[:, :, i] @ state
        outs.append(q_in[:, :, i] @ state + scores[:, :, i] @ w)
        state = chunk_decay[:, :, i] * state + k_out[:, :, i].transpose(-1, -2) @ w
    o = torch.stack(outs, dim=2).reshape(b, nh, -1, dv)[:, :, :s]
    return o.transpose(1, 2), state


def gated_delta_rule_step(
    state: torch.Tensor,
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    g_t: torch.Tensor,
    beta_t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the recurrence: ``state [b, nh, dk, dv]``, ``q_t, k_t [b, nh, dk]``,
    ``v_t [b, nh, dv]``, ``g_t, beta_t [b, nh]`` -> ``(o_t [b, nh, dv], new state)``."""
    decayed = g_t.exp()[..., None, None] * state
    predicted = (decayed * k_t.unsqueeze(-1)).sum(-2)  # S_{t-1}ᵀ k_t after decay, [b, nh, dv]
    delta = beta_t.unsqueeze(-1) * (v_t - predicted)
    new_state = decayed + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
    o_t = (new_state * q_t.unsqueeze(-1)).sum(-2)
    return o_t, new_state
