"""apply_rotary_qkv: a fused QKV projection split into SDPA's inputs, queries and keys rotated.

Held to the composition it replaces, written out here: split the ``[s, b, (nq + 2·nkv)·d]``
projection into heads, rotate q and k with the autograd reference, permute each to
``[b, n, s, d]``. The torch backend does the same arithmetic per element, so values and the
fused input gradient must be equal bit for bit; Triton (interpreter on CPU) within rounding.
"""

from __future__ import annotations

import pytest
import torch

import shardwork.fused_kernels as fk
from shardwork.fused_kernels.rotary import apply_rotary_reference

pytestmark = pytest.mark.golden

# (s, b, nq, nkv, head_dim, rotary_dim): the dense benchmark's layer, odd sizes (scalar tails),
# MHA, one kv head, partial rotary.
SHAPES = [
    (256, 4, 8, 4, 64, 64),
    (7, 3, 6, 2, 10, 6),
    (5, 2, 3, 3, 8, 8),
    (9, 1, 4, 1, 12, 4),
]


def composed(qkv, cos, sin, nq, nkv, interleaved):
    """Split into heads, rotate q and k by the reference formula, permute to SDPA's layout."""
    heads = qkv.unflatten(-1, (nq + 2 * nkv, -1))
    q, k, v = heads.split((nq, nkv, nkv), dim=2)
    q = apply_rotary_reference(q, cos, sin, interleaved=interleaved)
    k = apply_rotary_reference(k, cos, sin, interleaved=interleaved)
    return tuple(t.permute(1, 2, 0, 3) for t in (q, k, v))


def tables(s, b, rdim, interleaved, dtype, *, per_token: bool, device="cpu"):
    """cos/sin ``[s, 1, R]`` (one row per position) or ``[s, b, R]`` (packed: a row per token),
    the sine scaled unevenly so a table applied to the wrong pair member would show."""
    gen = torch.Generator().manual_seed(11)
    pos = torch.randint(0, 4096, (s, b) if per_token else (s, 1), generator=gen)
    cos, sin = fk.rotary_cos_sin(pos, fk.rotary_inv_freq(rdim), interleaved=interleaved)
    sin = sin * torch.linspace(0.5, 1.5, rdim)
    return cos.to(device, dtype), sin.to(device, dtype)


def run(fn, qkv, grads):
    q, k, v = fn(qkv)
    (dqkv,) = torch.autograd.grad((q, k, v), [qkv], grads)
    return (q, k, v), dqkv


def op_and_composition(qkv, cos, sin, nq, nkv, interleaved, backend, grads):
    """``((q, k, v), dqkv)`` of ``apply_rotary_qkv`` on ``backend``, then of the composition."""
    heads = dict(num_heads=nq, num_kv_heads=nkv, interleaved=interleaved, backend=backend)
    fused = run(lambda x: fk.apply_rotary_qkv(x, cos, sin, **heads), qkv, grads)
    return fused, run(lambda x: composed(x, cos, sin, nq, nkv, interleaved), qkv, grads)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("s", "b", "nq", "nkv", "d", "rdim"), SHAPES)
def test_torch_backend_equals_the_composition_bit_for_bit(
    interleaved, dtype, s, b, nq, nkv, d, rdim, poison
):
    # ``poison`` makes every freshly allocated output NaN: an unwritten channel of q, k, v or
    # of the fused gradient fails torch.equal.
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(s, b, (nq + 2 * nkv) * d, generator=gen).to(dtype).requires_grad_(True)
    cos, sin = tables(s, b, rdim, interleaved, dtype, per_token=s % 2 == 1)
    grads = [torch.randn(b, n, s, d, generator=gen).to(dtype) for n in (nq, nkv, nkv)]

    (outs, dqkv), (ref_outs, ref_dqkv) = op_and_composition(
        qkv, cos, sin, nq, nkv, interleaved, "torch", grads
    )
    for out, ref in zip(outs, ref_outs, strict=True):
        assert out.shape == ref.shape and out.dtype == dtype
        assert torch.equal(out, ref)
    assert torch.equal(dqkv, ref_dqkv)


@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_matches_the_composition(interleaved, triton_device, tol):
    s, b, nq, nkv, d, rdim = 7, 3, 6, 2, 10, 6
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(s, b, (nq + 2 * nkv) * d, generator=gen).to(triton_device)
    qkv.requires_grad_(True)
    cos, sin = tables(s, b, rdim, interleaved, torch.float32, per_token=True, device=qkv.device)
    grads = [torch.randn(b, n, s, d, generator=gen).to(triton_device) for n in (nq, nkv, nkv)]

    (outs, dqkv), (ref_outs, ref_dqkv) = op_and_composition(
        qkv, cos, sin, nq, nkv, interleaved, "triton", grads
    )
    for out, ref in zip(outs, ref_outs, strict=True):
        torch.testing.assert_close(out, ref, **tol(torch.float32))
    torch.testing.assert_close(dqkv, ref_dqkv, **tol(torch.float32))


def test_bad_inputs_name_the_field():
    qkv = torch.randn(4, 2, 8 * 16)  # 8 heads of 16
    cos = sin = torch.randn(4, 1, 16)
    with pytest.raises(ValueError, match=r"qkv.shape=\(4, 2, 128\) must be \[s, b, \(num_heads"):
        fk.apply_rotary_qkv(qkv, cos, sin, num_heads=3, num_kv_heads=1)  # 5 heads
    with pytest.raises(ValueError, match=r"qkv.shape=\(8, 128\)"):
        fk.apply_rotary_qkv(qkv.flatten(0, 1), cos, sin, num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="num_kv_heads=0 must be a positive int"):
        fk.apply_rotary_qkv(qkv, cos, sin, num_heads=8, num_kv_heads=0)
    with pytest.raises(TypeError, match="num_kv_heads=True must be an int, not bool"):
        fk.apply_rotary_qkv(qkv, cos, sin, num_heads=6, num_kv_heads=True)  # 8 heads if True = 1
    with pytest.raises(ValueError, match="must broadcast"):
        fk.apply_rotary_qkv(qkv, cos[:3], sin[:3], num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"cos.shape\[-1\]=18 \(rotary_dim\)"):
        wide = torch.randn(4, 1, 18)
        fk.apply_rotary_qkv(qkv, wide, wide, num_heads=4, num_kv_heads=2)
