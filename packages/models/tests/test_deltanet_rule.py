"""The chunked gated delta rule against the token-by-token recurrence written here, in fp64.

Convention checked (the one ``shardwork.models.delta_rule`` documents), per head::

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}ᵀ k_t)ᵀ,   o_t = S_tᵀ q_t

with ``S`` a ``[dk, dv]`` matrix. The oracle below is that formula as a Python loop of
matrix products, nothing shared with the module under test. Tolerances: fp64 rounding at the
tensor's scale, ``ulps`` sized by the depth of the computation (a chunk's triangular solve and
a few matmuls of length <= 16 per element).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardwork.models.delta_rule import gated_delta_rule_chunked, gated_delta_rule_step
from shardwork.parallel_state.testing import assert_close_at_scale

F64 = torch.float64
# Measured max error of the chunked form vs the loop at these sizes: ~1e-15 at unit scale
# (≈ 5 eps); 256 eps leaves room for accumulation order and still rejects any wrong term.
ULPS = 256


def recurrence(q, k, v, g, beta, state):
    """The defining loop: per batch row, head and token, rank-one updates of ``S [dk, dv]``."""
    b, s, nh, _ = q.shape
    outs = torch.empty(b, s, nh, v.shape[-1], dtype=q.dtype)
    rows = []
    for i in range(b):
        heads = []
        for h in range(nh):
            S = state[i, h]
            for t in range(s):
                kt, vt = k[i, t, h][:, None], v[i, t, h][:, None]  # column vectors
                a = torch.exp(g[i, t, h])
                S = a * S + beta[i, t, h] * kt @ (vt - a * S.T @ kt).T
                outs[i, t, h] = (S.T @ q[i, t, h][:, None])[:, 0]
            heads.append(S)
        rows.append(torch.stack(heads))
    return outs, torch.stack(rows)


def inputs(b, s, nh, dk, dv, *, seed, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, nh, dk, generator=gen, dtype=F64) / dk**0.5
    # Unit keys, as the mixer feeds them (L2-normalised): the rule is a contraction then.
    k = F.normalize(torch.randn(b, s, nh, dk, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(b, s, nh, dv, generator=gen, dtype=F64)
    g = -torch.rand(b, s, nh, generator=gen, dtype=F64) * 2
    beta = torch.rand(b, s, nh, generator=gen, dtype=F64)
    state = torch.randn(b, nh, dk, dv, generator=gen, dtype=F64)
    tensors = [q, k, v, g, beta, state]
    return [t.requires_grad_(grad) for t in tensors]


@pytest.mark.parametrize(
    ("b", "s", "nh", "dk", "dv", "chunk", "with_state"),
    [
        (2, 13, 3, 5, 6, 4, True),  # s not a multiple of the chunk, an initial state
        (1, 13, 1, 4, 4, 4, False),  # one head, batch 1, zero state
        (1, 7, 2, 3, 5, 16, True),  # one partial chunk only
        (2, 16, 2, 8, 4, 8, True),  # whole chunks
        (1, 5, 1, 3, 2, 1, True),  # chunk of one token: the recurrence itself
    ],
)
def test_chunked_matches_recurrence(b, s, nh, dk, dv, chunk, with_state):
    q, k, v, g, beta, state = inputs(b, s, nh, dk, dv, seed=s * 31 + dk)
    init = state if with_state else torch.zeros_like(state)
    o, final = gated_delta_rule_chunked(
        q, k, v, g, beta, chunk, initial_state=init if with_state else None
    )
    o_ref, final_ref = recurrence(q, k, v, g, beta, init)
    assert_close_at_scale(o, o_ref, rtol=0, ulps=ULPS, name="o")
    assert_close_at_scale(final, final_ref, rtol=0, ulps=ULPS, name="final state")


def test_gradients_match_recurrence():
    """Every input's gradient (q, k, v, g, beta, initial state) through a random output weight."""
    b, s, nh, dk, dv = 2, 13, 2, 4, 3
    ours = inputs(b, s, nh, dk, dv, seed=5, grad=True)
    ref = inputs(b, s, nh, dk, dv, seed=5, grad=True)
    gen = torch.Generator().manual_seed(6)
    w_o = torch.randn(b, s, nh, dv, generator=gen, dtype=F64)
    w_s = torch.randn(b, nh, dk, dv, generator=gen, dtype=F64)
    o, final = gated_delta_rule_chunked(*ours[:5], 4, initial_state=ours[5])
    ((o * w_o).sum() + (final * w_s).sum()).backward()
    o_ref, final_ref = recurrence(*ref)
    ((o_ref * w_o).sum() + (final_ref * w_s).sum()).backward()
    for name, a, e in zip(("q", "k", "v", "g", "beta", "state"), ours, ref):
        assert_close_at_scale(a.grad, e.grad, rtol=0, ulps=ULPS, name=f"d{name}")


def test_step_matches_recurrence():
    q, k, v, g, beta, state = inputs(2, 9, 3, 4, 5, seed=11)
    o_ref, final_ref = recurrence(q, k, v, g, beta, state)
    outs = []
    for t in range(9):
        o_t, state = gated_delta_rule_step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(o_t)
    assert_close_at_scale(torch.stack(outs, dim=1), o_ref, rtol=0, ulps=ULPS, name="o")
    assert_close_at_scale(state, final_ref, rtol=0, ulps=ULPS, name="state")


def test_planted_bug_fails_tolerance():
    """The oracle and tolerance reject a rule missing the decay inside the delta term."""
    q, k, v, g, beta, state = inputs(1, 9, 2, 4, 3, seed=3)

    def wrong(q, k, v, g, beta, state):  # S_t = a S + beta k (v - Sᵀk)ᵀ: decay dropped once
        outs = []
        for t in range(q.shape[1]):
            a = g[:, t].exp()[..., None, None]
            pred = (state * k[:, t].unsqueeze(-1)).sum(-2)
            state = (
                a * state
                + k[:, t].unsqueeze(-1) * (beta[:, t, :, None] * (v[:, t] - pred))[..., None, :]
            )
            outs.append((state * q[:, t].unsqueeze(-1)).sum(-2))
        return torch.stack(outs, 1)

    o_ref, _ = recurrence(q, k, v, g, beta, state)
    with pytest.raises(AssertionError, match="o"):
        assert_close_at_scale(wrong(q, k, v, g, beta, state), o_ref, rtol=0, ulps=ULPS, name="o")


def test_bad_shapes_are_refused():
    q, k, v, g, beta, state = inputs(1, 5, 2, 4, 3, seed=1)
    with pytest.raises(ValueError, match=r"g \(1, 5, 1\)"):
        gated_delta_rule_chunked(q, k, v, g[..., :1], beta, 4)
    with pytest.raises(ValueError, match="initial_state"):
        gated_delta_rule_chunked(q, k, v, g, beta, 4, initial_state=state[:, :1])
    with pytest.raises(ValueError, match="chunk_size=0 is invalid"):
        gated_delta_rule_chunked(q, k, v, g, beta, 0)
