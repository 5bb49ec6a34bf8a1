"""permute / unpermute / pad_routing_map against plain per-token formulas; exact gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardwork.moe_router import drop_to_capacity, pad_routing_map, permute, topk_routing, unpermute


def _routing(T=24, E=6, K=2, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g, dtype=dtype)
    probs, rmap, _, _ = topk_routing(logits, K, pre_softmax=True)
    x = torch.randn(T, 5, generator=g, dtype=dtype)
    return x, probs, rmap


def _maps():
    x, probs, rmap = _routing()
    yield "dropless", x, probs, rmap
    p, m = drop_to_capacity(probs, rmap, top_k=2, capacity_factor=0.75)
    yield "dropped", x, p, m
    p, m = drop_to_capacity(probs, rmap, top_k=2, capacity_factor=1.0, pad_to_capacity=True)
    yield "padded", x, p, m
    m = pad_routing_map(rmap, 4)
    yield "aligned", x, probs * m, m


@pytest.mark.parametrize("case", list(_maps()), ids=lambda c: c[0])
def test_permute_order_and_roundtrip(case):
    _, x, probs, rmap = case
    permuted, pprobs, idx, counts = permute(x, rmap, probs_TE=probs)
    # Reference order: expert-major, token order inside each expert.
    ref_rows = [(e, t) for e in range(rmap.shape[1]) for t in range(rmap.shape[0]) if rmap[t, e]]
    assert idx.tolist() == [t for _, t in ref_rows]
    assert counts.tolist() == rmap.sum(0).tolist()
    torch.testing.assert_close(permuted, x[[t for _, t in ref_rows]])
    torch.testing.assert_close(pprobs, torch.stack([probs[t, e] for e, t in ref_rows]))
    # Weighted unpermute == sum_e p[t, e] x[t] over routed experts.
    out = unpermute(permuted, idx, num_tokens=x.shape[0], probs_N=pprobs)
    torch.testing.assert_close(out, x * (probs * rmap).sum(1, keepdim=True))
    # Unweighted unpermute counts copies.
    out = unpermute(permuted, idx, num_tokens=x.shape[0])
    torch.testing.assert_close(out, x * rmap.sum(1, keepdim=True).to(x.dtype))
    # Sync-free path (stable argsort with known N) gives the same rows.
    permuted2, pprobs2, idx2, _ = permute(x, rmap, probs_TE=probs, num_out_tokens=int(rmap.sum()))
    assert (
        torch.equal(idx, idx2) and torch.equal(permuted, permuted2) and torch.equal(pprobs, pprobs2)
    )


def test_gradients_exact():
    x, probs, rmap = _routing(T=10, E=4)
    w = torch.randn(4, 5, 5, dtype=torch.float64)

    def f(x, probs):
        permuted, pprobs, idx, counts = permute(x, rmap, probs_TE=probs)
        expert = torch.repeat_interleave(torch.arange(4), counts)
        y = torch.einsum("nh,nhk->nk", permuted, w[expert])
        return unpermute(torch.tanh(y), idx, num_tokens=x.shape[0], probs_N=pprobs)

    assert torch.autograd.gradcheck(f, (x.requires_grad_(), probs.requires_grad_()))


def test_unweighted_unpermute_gradient_exact_and_low_precision_sums_in_fp32():
    x, probs, rmap = _routing(T=10, E=4)
    permuted, _, idx, _ = permute(x, rmap, probs_TE=probs)
    rows = permuted.detach().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda r: unpermute(torch.sin(r), idx, num_tokens=10), (rows,))
    # bf16 copies of a token are summed in fp32 and rounded once (a bf16 running sum would
    # round after every add): the result equals the fp32 sum rounded to bf16.
    low = permuted.to(torch.bfloat16)
    out = unpermute(low, idx, num_tokens=10)
    expect = torch.zeros(10, 5).index_add_(0, idx, low.float()).to(torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expect)


@pytest.mark.parametrize("weighted", [False, True])
def test_unpermute_saves_no_row_sized_product(weighted):
    # Backward keeps the index (and, weighted, the rows and probabilities), never x * p.
    x, probs, rmap = _routing(T=12, E=4)
    permuted, pprobs, idx, _ = permute(x, rmap, probs_TE=probs)
    rows = permuted.detach().requires_grad_(True)
    p = pprobs.detach().requires_grad_(True) if weighted else None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        unpermute(rows, idx, num_tokens=12, probs_N=p)
    pointers = {t.untyped_storage().data_ptr() for t in saved}
    expected = {idx.untyped_storage().data_ptr()}
    if weighted:
        expected |= {rows.untyped_storage().data_ptr(), p.untyped_storage().data_ptr()}
    assert pointers == expected


def test_pad_routing_map():
    _, _, rmap = _routing(T=30, E=5)
    padded = pad_routing_map(rmap, 4)
    assert (padded.sum(0) % 4 == 0).all()
    assert (padded | ~rmap).all() and (padded & rmap).sum() == rmap.sum()
    # Extra slots are the earliest unrouted tokens of each expert.
    for e in range(5):
        extra = (padded[:, e] & ~rmap[:, e]).nonzero().flatten().tolist()
        free = (~rmap[:, e]).nonzero().flatten().tolist()
        assert extra == free[: len(extra)]
    with pytest.raises(ValueError, match="multiple"):
        pad_routing_map(rmap, 0)


@settings(max_examples=40, deadline=None)
@given(
    T=st.integers(1, 40),
    E=st.integers(1, 9),
    density=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_unpermute_inverts_permute_for_any_map(T, E, density, seed):
    """Any map (empty rows, empty experts, full rows): permute then unpermute with probs gives
    Σ_e p[t, e]·x[t] over routed e, and the sync-free path agrees."""
    g = torch.Generator().manual_seed(seed)
    rmap = torch.rand(T, E, generator=g) < density
    probs = torch.rand(T, E, generator=g, dtype=torch.float64) * rmap
    x = torch.randn(T, 3, generator=g, dtype=torch.float64)
    permuted, pprobs, idx, counts = permute(x, rmap, probs_TE=probs)
    assert counts.tolist() == rmap.sum(0).tolist() and permuted.shape[0] == int(rmap.sum())
    out = unpermute(permuted, idx, num_tokens=T, probs_N=pprobs)
    torch.testing.assert_close(out, x * probs.sum(1, keepdim=True))
    _, _, idx2, _ = permute(x, rmap, num_out_tokens=int(rmap.sum()))
    assert torch.equal(idx, idx2)


def _six_tokens():
    x = torch.randn(6, 8)
    rmap = torch.zeros(6, 4, dtype=torch.bool)
    rmap[torch.arange(6), torch.tensor([0, 1, 2, 3, 0, 1])] = True
    return x, rmap


def test_permute_refuses_maps_probs_and_counts_that_do_not_fit():
    x, rmap = _six_tokens()
    # a map for 5 tokens silently dropped token 5; one for 7 raised IndexError
    for rows in (rmap[:5], torch.cat([rmap, rmap[:1]])):
        with pytest.raises(ValueError, match=rf"routing_map_TE of shape \({rows.shape[0]}, 4\)"):
            permute(x, rows)
    with pytest.raises(ValueError, match=r"probs_TE of shape \(6, 3\) is invalid"):
        permute(x, rmap, probs_TE=torch.rand(6, 3))
    # 20 > the 6 routed pairs (formerly 14 rows of unrouted pairs), -1, more than T*E
    for n in (20, 5):
        with pytest.raises(ValueError, match=f"num_out_tokens={n} is invalid: .* routes 6"):
            permute(x, rmap, num_out_tokens=n)
    for n in (-1, 25, 6.0):
        with pytest.raises(ValueError, match=rf"num_out_tokens={n} is invalid: .* T\*E = 24"):
            permute(x, rmap, num_out_tokens=n)
    # the exact count, and an empty map with 0, still permute
    rows, _, _, counts = permute(x, rmap, num_out_tokens=6)
    assert rows.shape == (6, 8) and counts.tolist() == [2, 2, 1, 1]
    empty = torch.zeros_like(rmap)
    assert permute(x, empty, num_out_tokens=0)[0].shape == (0, 8)


def test_unpermute_refuses_sizes_that_do_not_match():
    x, rmap = _six_tokens()
    rows, probs, idx, _ = permute(x, rmap, probs_TE=torch.rand(6, 4))
    with pytest.raises(ValueError, match=r"num_tokens=3 is invalid .* tokens 0\.\.5"):
        unpermute(rows, idx, num_tokens=3)
    with pytest.raises(ValueError, match="num_tokens=-1 is invalid"):
        unpermute(rows, idx, num_tokens=-1)
    with pytest.raises(ValueError, match=r"probs_N of shape \(5,\) is invalid"):
        unpermute(rows, idx, num_tokens=6, probs_N=probs[:5])
    with pytest.raises(ValueError, match=r"sorted_indices_N of shape \(5,\) is invalid"):
        unpermute(rows, idx[:5], num_tokens=6)
    with pytest.raises(TypeError, match=r"sorted_indices_N of dtype torch\.float32"):
        unpermute(rows, idx.float(), num_tokens=6)
    # num_tokens = max index + 1 is the boundary that works (a trailing unrouted token stays 0)
    out = unpermute(rows, idx, num_tokens=7, probs_N=probs)
    assert out.shape == (7, 8) and not out[6].any()


def test_pad_routing_map_refuses_multiples_it_cannot_meet():
    _, rmap = _six_tokens()
    with pytest.raises(ValueError, match=r"multiple=2\.5 is invalid: it must be an integer"):
        pad_routing_map(rmap, 2.5)
    with pytest.raises(ValueError, match="multiple=True is invalid"):
        pad_routing_map(rmap, True)
    # expert 0 holds 2 tokens: their next multiple of 16 is more than the 6 tokens there are
    with pytest.raises(ValueError, match=r"multiple=16 is invalid .* expert 0 has 2 tokens"):
        pad_routing_map(rmap, 16)
    full = rmap.clone()
    full[:5, 0] = True  # 5 tokens round up to 8 > 6 (2 tokens round up to 4 and fit)
    with pytest.raises(ValueError, match=r"multiple=4 is invalid .* expert 0 has 5 tokens, .* 8"):
        pad_routing_map(full, 4)
    # multiple == T: every count rounds up to 0 or T
    padded = pad_routing_map(rmap, 6)
    assert padded.sum(0).tolist() == [6, 6, 6, 6]
