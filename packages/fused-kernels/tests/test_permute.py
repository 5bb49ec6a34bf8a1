"""Token permute / unpermute: reference vs an explicit loop, Triton vs reference (forward + grads)."""

from __future__ import annotations

import re

import pytest
import torch

import shardwork.fused_kernels as fk
from shardwork.fused_kernels.launches import count_launches


def _routing(n, e, k, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, e, generator=g)
    out = fk.router_topk(logits, topk=k, backend="torch")
    return out.routing_map.to(device), out.probs.to(device)


def test_reference_matches_explicit_loop():
    n, e, h = 9, 4, 5
    routing_map, probs = _routing(n, e, 2)
    routing_map[3] = False  # a token routed nowhere
    probs[3] = 0
    tokens = torch.randn(n, h, dtype=torch.float64)
    permuted, permuted_probs, idx = fk.permute_tokens(
        tokens, routing_map, probs=probs, backend="torch"
    )
    rows, row_probs, tok = [], [], []
    for expert in range(e):
        for t in range(n):
            if routing_map[t, expert]:
                rows.append(tokens[t])
                row_probs.append(probs[t, expert])
                tok.append(t)
    torch.testing.assert_close(permuted, torch.stack(rows))
    torch.testing.assert_close(permuted_probs, torch.stack(row_probs))
    assert idx.tolist() == tok
    expert_out = permuted * 3.0
    restored = fk.unpermute_tokens(
        expert_out, idx, probs=permuted_probs, restore_shape=(n, h), backend="torch"
    )
    expect = torch.zeros(n, h, dtype=torch.float64)
    for j, t in enumerate(tok):
        expect[t] += expert_out[j] * row_probs[j].double()
    torch.testing.assert_close(restored, expect)
    assert bool((restored[3] == 0).all())
    dense = fk.unpermute_tokens(
        expert_out, idx, probs=probs, routing_map=routing_map, restore_shape=(n, h), backend="torch"
    )
    torch.testing.assert_close(dense, expect)


def test_num_out_tokens_keeps_the_first_rows():
    routing_map, probs = _routing(10, 4, 2)
    tokens = torch.randn(10, 3)
    full, full_probs, full_idx = fk.permute_tokens(
        tokens, routing_map, probs=probs, backend="torch"
    )
    cut, cut_probs, cut_idx = fk.permute_tokens(
        tokens, routing_map, probs=probs, num_out_tokens=13, backend="torch"
    )
    assert torch.equal(cut, full[:13]) and torch.equal(cut_idx, full_idx[:13])
    assert torch.equal(cut_probs, full_probs[:13])


# H=1030: two 1024-wide hidden blocks (second partial); 19 tokens × top-2 = 38 rows in
# 16-row blocks (3 programs, last partial); a single token.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("n", "e", "k", "h", "num_out"),
    [(19, 6, 2, 1030, None), (19, 6, 2, 40, 30), (1, 4, 3, 8, None)],
)
def test_triton_matches_reference(dtype, n, e, k, h, num_out, triton_device, tol, poison):
    dev = triton_device
    routing_map, probs = _routing(n, e, k, device=dev)
    tokens = torch.randn(n, h, generator=torch.Generator().manual_seed(1)).to(dtype).to(dev)
    gy = torch.randn(n, h, generator=torch.Generator().manual_seed(2)).to(dtype).to(dev)

    def run(backend):
        x = tokens.clone().requires_grad_(True)
        p = probs.clone().requires_grad_(True)
        permuted, permuted_probs, idx = fk.permute_tokens(
            x, routing_map, probs=p, num_out_tokens=num_out, backend=backend
        )
        expert_out = permuted * 1.5
        y = fk.unpermute_tokens(
            expert_out, idx, probs=permuted_probs, restore_shape=x.shape, backend=backend
        )
        return (permuted, y, *torch.autograd.grad(y, [x, p], gy))

    with count_launches() as launches:
        got = run("triton")
    assert launches["permute_gather_rows"] == 2 and launches["permute_sum_rows"] == 2
    assert launches["permute_row_dot"] == 1
    ref = run("torch")
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), **tol(dtype))


def test_bad_inputs_name_the_field():
    tokens = torch.randn(4, 3)
    with pytest.raises(ValueError, match="must be bool"):
        fk.permute_tokens(tokens, torch.ones(4, 2))
    with pytest.raises(ValueError, match="num_out_tokens=9"):
        fk.permute_tokens(tokens, torch.ones(4, 2, dtype=torch.bool), num_out_tokens=9)
    with pytest.raises(ValueError, match="restore_shape"):
        fk.unpermute_tokens(
            torch.randn(5, 3), torch.zeros(5, dtype=torch.long), restore_shape=(4, 2)
        )
    with pytest.raises(ValueError, match="need routing_map"):
        fk.unpermute_tokens(
            torch.randn(5, 3),
            torch.zeros(5, dtype=torch.long),
            probs=torch.rand(4, 2),
            restore_shape=(4, 3),
        )


def test_num_out_tokens_past_the_routed_pairs_is_refused():
    tokens = torch.randn(5, 8)
    routing_map = torch.zeros(5, 4, dtype=torch.bool)
    routing_map[[0, 1, 1, 3, 4], [2, 0, 3, 1, 2]] = True  # 5 routed pairs of 20
    with pytest.raises(ValueError, match=re.escape(
        "num_out_tokens=8 exceeds the 5 routed (token, expert) pairs of routing_map; "
        "valid: 0 to 5")):  # fmt: skip
        fk.permute_tokens(tokens, routing_map, num_out_tokens=8)
    with pytest.raises(TypeError, match=re.escape("num_out_tokens='5' must be an int")):
        fk.permute_tokens(tokens, routing_map, num_out_tokens="5")
    with pytest.raises(TypeError, match=re.escape("num_out_tokens=True must be an int")):
        fk.permute_tokens(tokens, routing_map, num_out_tokens=True)
    # Every routed pair, or fewer: accepted.
    rows, _, idx = fk.permute_tokens(tokens, routing_map, num_out_tokens=5)
    assert rows.shape == (5, 8) and sorted(idx.tolist()) == [0, 1, 1, 3, 4]
    assert fk.permute_tokens(tokens, routing_map, num_out_tokens=2)[0].shape == (2, 8)


def test_unpermute_refuses_bad_restore_shapes_and_index_types():
    rows, idx = torch.randn(3, 8), torch.tensor([0, 2, 2])
    with pytest.raises(ValueError, match=re.escape("restore_shape=(-1, 8): N=-1 must be >= 0")):
        fk.unpermute_tokens(rows, idx, restore_shape=(-1, 8))
    with pytest.raises(TypeError, match=re.escape("restore_shape=(3.0, 8): N=3.0 must be an int")):
        fk.unpermute_tokens(rows, idx, restore_shape=(3.0, 8))
    with pytest.raises(TypeError, match=re.escape("restore_shape=3 must be a tuple (N, H)")):
        fk.unpermute_tokens(rows, idx, restore_shape=3)
    with pytest.raises(ValueError, match=re.escape("restore_shape=(3, 8, 1) must be (N, H)")):
        fk.unpermute_tokens(rows, idx, restore_shape=(3, 8, 1))
    with pytest.raises(ValueError, match=re.escape(
        "sorted_indices must be an int64/int32 tensor (as permute_tokens returns), got "
        "torch.float32")):  # fmt: skip
        fk.unpermute_tokens(rows, idx.float(), restore_shape=(3, 8))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_unpermute_refuses_indices_outside_the_restored_rows(backend, request):
    # Before: a RuntimeError from index_add (torch) or an IndexError from the Triton
    # backend's destination table, neither naming the argument.
    if backend == "triton" and request.getfixturevalue("triton_device").type != "cpu":
        pytest.skip("the exact check runs on CPU tensors")
    rows = torch.randn(3, 8)
    for indices, position, bad in (([0, 1, 2], 2, 2), ([0, -1, 1], 1, -1)):
        with pytest.raises(ValueError, match=re.escape(
            f"sorted_indices[{position}]={bad} is not a token row of restore_shape[0]=2; "
            "valid: 0 <= index < 2")):  # fmt: skip
            fk.unpermute_tokens(rows, torch.tensor(indices), restore_shape=(2, 8), backend=backend)
    # The last row (N - 1), int32 indices and a torch.Size: accepted, equal to a plain sum.
    out = fk.unpermute_tokens(rows, torch.tensor([1, 0, 1], dtype=torch.int32),
                              restore_shape=torch.Size([2, 8]), backend=backend)  # fmt: skip
    torch.testing.assert_close(out, torch.stack([rows[1], rows[0] + rows[2]]))


@pytest.mark.gpu
def test_triton_bf16_on_gpu(cuda_device, tol):
    routing_map, probs = _routing(4096, 64, 8, device=cuda_device)
    tokens = torch.randn(4096, 2048, device=cuda_device, dtype=torch.bfloat16)
    out = {}
    for backend in ("triton", "torch"):
        permuted, pp, idx = fk.permute_tokens(tokens, routing_map, probs=probs, backend=backend)
        out[backend] = (
            permuted,
            fk.unpermute_tokens(
                permuted, idx, probs=pp, restore_shape=tokens.shape, backend=backend
            ),
        )
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a.float(), b.float(), **tol(torch.bfloat16))
