"""The chunked SSD scan and its single step against the recurrence written out in this file.

The oracle is the definition of the Mamba-2 state space model, one token at a time in fp64::

    h_t = exp(dt_t · A) · h_{t-1} + dt_t · x_t ⊗ B_t,      y_t = h_t · C_t

with the B/C group of head ``j`` being ``j // (heads / groups)``. Outputs, final states and the
gradients of every input (autograd through both) are compared at fp64 rounding scale.
"""

from __future__ import annotations

import pytest
import torch

from shardwork.models.ssd import ssd_chunked, ssd_step
from shardwork.parallel_state.testing import assert_close_at_scale

# Chunked sums reassociate the recurrence's products: measured at most 3.7 ulps of each
# tensor's scale over the cases below (outputs, states and gradients); 32 leaves headroom.
ULPS = 32


def _recurrence(x, dt, A, B, C, initial_state=None):
    b, s, nh, p = x.shape
    g, n = B.shape[2], B.shape[3]
    state = x.new_zeros(b, nh, p, n) if initial_state is None else initial_state
    group = torch.arange(nh) // (nh // g)
    ys = []
    for t in range(s):
        decay = torch.exp(dt[:, t] * A)  # [b, nh]
        Bt, Ct = B[:, t, group], C[:, t, group]  # [b, nh, n]
        state = (
            decay[:, :, None, None] * state
            + (dt[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        )
        ys.append((state * Ct[:, :, None, :]).sum(-1))
    return torch.stack(ys, dim=1), state


def _inputs(b, s, nh, p, g, n, *, seed, with_state):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, B, C = rnd(b, s, nh, p), rnd(b, s, g, n), rnd(b, s, g, n)
    dt = torch.nn.functional.softplus(rnd(b, s, nh) - 1.0)
    A = -torch.exp(rnd(nh))
    state = rnd(b, nh, p, n) if with_state else None
    tensors = [x, dt, A, B, C] + ([state] if with_state else [])
    for t in tensors:
        t.requires_grad_(True)
    return tensors


CASES = [
    # (batch, seq, heads, head_dim, groups, state, chunk, initial state)
    (2, 13, 4, 3, 2, 5, 4, False),
    (1, 13, 1, 2, 1, 3, 4, True),
    (2, 16, 4, 3, 1, 4, 8, True),
    (1, 7, 2, 4, 2, 3, 16, False),  # one chunk, longer than the sequence
    (2, 9, 6, 2, 3, 2, 1, True),  # chunk of one token: all state passing
]


@pytest.mark.parametrize("case", CASES, ids=[f"s{c[1]}-c{c[6]}-g{c[4]}" for c in CASES])
def test_chunked_scan_equals_recurrence(case):
    b, s, nh, p, g, n, chunk, with_state = case
    inputs = _inputs(b, s, nh, p, g, n, seed=s * 100 + chunk, with_state=with_state)
    y, final = ssd_chunked(*inputs[:5], chunk, inputs[5] if with_state else None)
    y_ref, final_ref = _recurrence(*inputs)
    assert_close_at_scale(y, y_ref, rtol=0, ulps=ULPS, name="y")
    assert_close_at_scale(final, final_ref, rtol=0, ulps=ULPS, name="final state")
    gen = torch.Generator().manual_seed(7)
    wy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    wf = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((y * wy).sum() + (final * wf).sum(), inputs)
    grads_ref = torch.autograd.grad((y_ref * wy).sum() + (final_ref * wf).sum(), inputs)
    names = ["x", "dt", "A", "B", "C", "initial_state"]
    for name, got, want in zip(names, grads, grads_ref):
        assert_close_at_scale(got, want, rtol=0, ulps=ULPS, name=f"grad {name}")


def test_step_equals_recurrence():
    x, dt, A, B, C, state = _inputs(2, 6, 4, 3, 2, 5, seed=3, with_state=True)
    y_ref, final_ref = _recurrence(x, dt, A, B, C, state)
    ys = []
    for t in range(x.shape[1]):
        y_t, state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t])
        ys.append(y_t)
    assert_close_at_scale(torch.stack(ys, 1), y_ref, rtol=0, ulps=16, name="y")
    assert_close_at_scale(state, final_ref, rtol=0, ulps=16, name="state")


def test_planted_discretisation_bug_fails_the_tolerance():
    """``exp(A)`` instead of ``exp(dt·A)`` as the decay (a wrong discretisation) is caught."""
    x, dt, A, B, C = _inputs(2, 13, 4, 3, 2, 5, seed=5, with_state=False)

    def _bad(x, dt, A, B, C):
        b, s, nh, p = x.shape
        group = torch.arange(nh) // (nh // B.shape[2])
        state = x.new_zeros(b, nh, p, B.shape[3])
        ys = []
        for t in range(s):
            decay = torch.exp(A).expand(b, nh)
            upd = (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, group][:, :, None, :]
            state = decay[:, :, None, None] * state + upd
            ys.append((state * C[:, t, group][:, :, None, :]).sum(-1))
        return torch.stack(ys, 1)

    y, _ = ssd_chunked(x, dt, A, B, C, 4)
    with pytest.raises(AssertionError, match="y"):
        assert_close_at_scale(y, _bad(x, dt, A, B, C), rtol=0, ulps=ULPS, name="y")


def test_float32_inputs_scan_in_float32():
    x, dt, A, B, C = (
        t.detach().float() for t in _inputs(1, 5, 2, 2, 1, 3, seed=1, with_state=False)
    )
    y, final = ssd_chunked(x, dt, A, B, C, 4)
    assert y.dtype == torch.float32 and final.dtype == torch.float32
    y_ref, _ = _recurrence(*(t.double() for t in (x, dt, A, B, C)))
    assert_close_at_scale(y, y_ref.float(), rtol=0, ulps=ULPS, name="y")
