"""Rotary: frequencies vs Hugging Face, apply vs independent formulas, Triton vs reference, in place."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

import shardwork.fused_kernels as fk
from shardwork.fused_kernels.launches import count_launches
from shardwork.fused_kernels.rotary import apply_rotary_reference

# Golden / cross-implementation: CI reruns these with other CPU kernels (.ci/run).
pytestmark = pytest.mark.golden

# RoPE scaling cases: name -> (transformers ``rope_parameters``, head_dim, max positions).
# tools/fused_kernels_hf_rope_fixture.py writes transformers' answers for them to
# tests/data/hf_rope.pt, used when transformers is not installed (the isolated package job).
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN_EXTRAS = {
    "yarn": {},
    "yarn-mscale1": {"mscale": 1.0, "mscale_all_dim": 1.0},
    "yarn-mscale0.707-beta16": {"mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16},
}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0}
ROPE_CASES = {"llama3": (LLAMA3, 128, 4096)} | {
    name: ({**YARN, "original_max_position_embeddings": 4096, **extra}, 64, 163840)
    for name, extra in YARN_EXTRAS.items()
}
FIXTURE = Path(__file__).parent / "data" / "hf_rope.pt"


def transformers_inv_freq(name: str):
    """(inv_freq, attention_scale) from transformers' RoPE init for a Llama config."""
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_parameters, head_dim, max_pos = ROPE_CASES[name]
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rope_parameters=rope_parameters,
    )
    return ROPE_INIT_FUNCTIONS[rope_parameters["rope_type"]](config, "cpu")


def _hf_inv_freq(name: str):
    """transformers' (inv_freq, attention_scale) for case ``name``: computed live when
    transformers is installed (and then also checked against the committed fixture), read
    from the fixture otherwise."""
    saved = torch.load(FIXTURE)["cases"][name]
    try:
        import transformers  # noqa: F401
    except ImportError:
        return saved["inv_freq"], saved["attention_scale"]
    inv, scale = transformers_inv_freq(name)
    # transformers computes inv_freq elementwise in fp32 (pow, no sum), so each element carries
    # its own rounding: a few fp32 ulp of the element itself, whatever the CPU's pow kernel.
    torch.testing.assert_close(
        inv.double(), saved["inv_freq"], rtol=4 * torch.finfo(torch.float32).eps, atol=0
    )
    assert scale == pytest.approx(saved["attention_scale"])
    return inv, scale


def test_base_inv_freq_formula():
    inv = fk.rotary_inv_freq(64, base=500000.0)
    expect = torch.tensor([500000.0 ** (-2 * i / 64) for i in range(32)], dtype=torch.float64)
    torch.testing.assert_close(inv.double(), expect, rtol=1e-6, atol=0)


def test_llama3_matches_transformers():
    hf_inv, hf_scale = _hf_inv_freq("llama3")
    ours = fk.rotary_inv_freq(
        128,
        base=500000.0,
        scaling=fk.Llama3RopeScaling(
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
    )
    torch.testing.assert_close(ours, hf_inv.float())
    assert hf_scale == 1.0


@pytest.mark.parametrize("name", sorted(YARN_EXTRAS))
def test_yarn_matches_transformers(name):
    extra = YARN_EXTRAS[name]
    hf_inv, hf_scale = _hf_inv_freq(name)
    scaling = fk.YarnRopeScaling(
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=extra.get("beta_fast", 32.0),
        mscale=extra.get("mscale"),
        mscale_all_dim=extra.get("mscale_all_dim"),
    )
    torch.testing.assert_close(fk.rotary_inv_freq(64, scaling=scaling), hf_inv.float())
    assert scaling.attention_factor() == pytest.approx(hf_scale)
    cos, sin = fk.rotary_cos_sin(
        torch.arange(5), fk.rotary_inv_freq(64, scaling=scaling), scaling=scaling
    )
    torch.testing.assert_close(cos.pow(2) + sin.pow(2), torch.full((5, 64), hf_scale**2))


def test_yarn_softmax_scale_is_deepseek_mscale_squared():
    s = fk.YarnRopeScaling(
        factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0
    )
    assert s.softmax_scale_factor() == pytest.approx((0.1 * math.log(40.0) + 1.0) ** 2)


def test_packed_positions_restart_per_sequence():
    cu = torch.tensor([0, 3, 3, 8, 9])
    expect = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 0])
    assert torch.equal(fk.packed_positions(cu), expect)
    with pytest.raises(ValueError, match="must start at 0 and be non-decreasing"):
        fk.packed_positions(torch.tensor([0, 5, 4]))


def test_half_split_matches_transformers_apply():
    pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q = torch.randn(2, 7, 4, 16, dtype=torch.float64)  # [b, s, h, d]
    cos, sin = fk.rotary_cos_sin(torch.arange(7), fk.rotary_inv_freq(16), dtype=torch.float64)
    hf_q, _ = apply_rotary_pos_emb(q, q, cos[None], sin[None], unsqueeze_dim=2)
    torch.testing.assert_close(apply_rotary_reference(q, cos, sin), hf_q)
    torch.testing.assert_close(fk.apply_rotary(q, cos, sin, backend="torch"), hf_q)


def test_interleaved_is_complex_multiplication_and_partial_passes_through():
    x = torch.randn(6, 3, 20, dtype=torch.float64)  # rotary_dim 12 of head_dim 20
    inv = fk.rotary_inv_freq(12)
    pos = torch.arange(6)
    cos, sin = fk.rotary_cos_sin(pos, inv, interleaved=True, dtype=torch.float64)
    angles = pos[:, None].double() * inv.double()[None]
    rot = (
        torch.view_as_complex(x[..., :12].reshape(6, 3, 6, 2).contiguous())
        * torch.polar(torch.ones_like(angles), angles)[:, None]
    )
    expect = torch.cat((torch.view_as_real(rot).reshape(6, 3, 12), x[..., 12:]), dim=-1)
    torch.testing.assert_close(apply_rotary_reference(x, cos, sin, interleaved=True), expect)
    torch.testing.assert_close(
        fk.apply_rotary(x, cos, sin, interleaved=True, backend="torch"), expect
    )


# x [T..., H, D] with rotary dim R: H=20 spans two head blocks of 16 (second partial).
CASES = [((3, 2), 20, 12, 8), ((5,), 20, 16, 16), ((1,), 3, 6, 4)]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("lead", "heads", "head_dim", "rdim"), CASES)
def test_triton_matches_reference(
    interleaved, dtype, lead, heads, head_dim, rdim, triton_device, tol, poison
):
    torch.manual_seed(0)
    dev = triton_device
    x = torch.randn(*lead, heads, head_dim, device=dev).to(dtype).requires_grad_(True)
    # positions per token: packed sequences along the last leading dim
    pos = (
        fk.packed_positions(torch.tensor([0, 1, lead[-1]])).to(dev)
        if lead[-1] > 1
        else torch.zeros(1, dtype=torch.long)
    )
    cos, sin = fk.rotary_cos_sin(
        pos.to(dev), fk.rotary_inv_freq(rdim).to(dev), interleaved=interleaved
    )
    gy = torch.randn(x.shape, device=dev).to(dtype)

    def run(backend):
        y = fk.apply_rotary(x, cos, sin, interleaved=interleaved, backend=backend)
        return y, torch.autograd.grad(y, [x], gy)[0]

    with count_launches() as launches:
        y, g = run("triton")
    assert launches["rotary_fwd"] == 1 and launches["rotary_bwd"] == 1
    y_ref = apply_rotary_reference(x, cos, sin, interleaved=interleaved)
    g_ref = torch.autograd.grad(y_ref, [x], gy)[0]
    torch.testing.assert_close(y.float(), y_ref.float(), **tol(dtype))
    torch.testing.assert_close(g.float(), g_ref.float(), **tol(dtype))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("lead", "heads", "head_dim", "rdim"), [*CASES, ((256, 4), 8, 64, 64)])
def test_torch_backend_equals_reference_bit_for_bit(
    interleaved, dtype, lead, heads, head_dim, rdim, poison
):
    # Same products and one add/subtract per element as the reference: outputs and input
    # gradients equal exactly (partial rotary included: pass-through channels are copied).
    # ``poison`` makes unwritten output channels NaN, which torch.equal rejects.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(*lead, heads, head_dim, generator=gen).to(dtype).requires_grad_(True)
    pos = torch.randint(0, 4096, lead[:1], generator=gen)
    cos, sin = fk.rotary_cos_sin(pos, fk.rotary_inv_freq(rdim), interleaved=interleaved)
    if len(lead) == 2:
        cos, sin = cos[:, None], sin[:, None]  # [s, 1, R]: broadcast over the batch dim
    # A non-symmetric table (cos halves differ) so a swapped sine in backward would show.
    sin = sin * torch.linspace(0.5, 1.5, rdim)
    gy = torch.randn(x.shape, generator=gen).to(dtype)
    y = fk.apply_rotary(x, cos, sin, interleaved=interleaved, backend="torch")
    (g,) = torch.autograd.grad(y, [x], gy)
    y_ref = apply_rotary_reference(x, cos, sin, interleaved=interleaved)
    (g_ref,) = torch.autograd.grad(y_ref, [x], gy)
    assert y.dtype == dtype and g.dtype == dtype
    assert torch.equal(y, y_ref) and torch.equal(g, g_ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_in_place_on_a_strided_slice_with_autograd(backend, triton_device, tol):
    dev = triton_device
    qkv = torch.randn(4, 2, 7, 16, device=dev, requires_grad=True)  # [s, b, q+k+v heads, d]
    cos, sin = fk.rotary_cos_sin(torch.arange(4, device=dev), fk.rotary_inv_freq(16).to(dev))
    cos, sin = cos[:, None], sin[:, None]  # broadcast over batch
    gy = torch.randn(4, 2, 7, 16, device=dev)

    h = qkv * 1.0
    out = fk.apply_rotary(h[:, :, :5], cos, sin, inplace=True, backend=backend)
    assert out.data_ptr() == h.data_ptr()
    h.backward(gy)

    ref_leaf = qkv.detach().clone().requires_grad_(True)
    rotated = apply_rotary_reference(ref_leaf[:, :, :5], cos, sin)
    ref = torch.cat((rotated, ref_leaf[:, :, 5:]), dim=2)
    ref.backward(gy)
    torch.testing.assert_close(h.detach(), ref.detach(), **tol(torch.float32))
    torch.testing.assert_close(qkv.grad, ref_leaf.grad, **tol(torch.float32))


def test_bad_inputs_name_the_field():
    x = torch.randn(3, 2, 8)
    c = torch.randn(3, 6)
    with pytest.raises(ValueError, match="rotary_dim"):
        fk.apply_rotary(x, torch.randn(3, 10), torch.randn(3, 10))
    with pytest.raises(ValueError, match=r"must equal sin\.shape"):
        fk.apply_rotary(x, c, torch.randn(3, 4))
    with pytest.raises(ValueError, match="must broadcast"):
        fk.apply_rotary(x, torch.randn(4, 6), torch.randn(4, 6))
    with pytest.raises(ValueError, match="leaf tensor"):
        fk.apply_rotary(x.requires_grad_(True), c, c, inplace=True)
    with pytest.raises(ValueError, match="rotary_dim=7"):
        fk.rotary_inv_freq(7)
    with pytest.raises(ValueError, match="beta_fast > beta_slow"):
        fk.YarnRopeScaling(
            factor=4.0, original_max_position_embeddings=10, beta_fast=1.0, beta_slow=2.0
        )


def test_number_arguments_are_checked_by_name():
    with pytest.raises(TypeError, match=re.escape("rotary_dim=64.0 must be an int")):
        fk.rotary_inv_freq(64.0)
    with pytest.raises(TypeError, match=re.escape("base='1e4' must be a number")):
        fk.rotary_inv_freq(64, base="1e4")
    with pytest.raises(ValueError, match=re.escape("base=inf must be a finite number > 1")):
        fk.rotary_inv_freq(64, base=float("inf"))
    with pytest.raises(TypeError, match=re.escape("YarnRopeScaling.factor='4' must be a number")):
        fk.YarnRopeScaling(factor="4", original_max_position_embeddings=4096)
    with pytest.raises(TypeError, match=re.escape(
        "Llama3RopeScaling.original_max_position_embeddings=8192.0 must be an int")):  # fmt: skip
        fk.Llama3RopeScaling(original_max_position_embeddings=8192.0)
    with pytest.raises(
        TypeError, match=re.escape("LinearRopeScaling.factor=True must be a number")
    ):
        fk.LinearRopeScaling(factor=True)
    # Ints where floats are expected are numbers: accepted.
    torch.testing.assert_close(fk.rotary_inv_freq(64, base=10000), fk.rotary_inv_freq(64))


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_triton_bf16_on_gpu(interleaved, cuda_device, tol):
    x = torch.randn(2048, 2, 32, 128, device=cuda_device, dtype=torch.bfloat16, requires_grad=True)
    cos, sin = fk.rotary_cos_sin(
        torch.arange(2048, device=cuda_device),
        fk.rotary_inv_freq(64).to(cuda_device),
        interleaved=interleaved,
    )
    cos, sin = cos[:, None], sin[:, None]
    gy = torch.randn_like(x)
    out = {}
    for backend in ("triton", "torch"):
        y = fk.apply_rotary(x, cos, sin, interleaved=interleaved, backend=backend)
        out[backend] = (y, torch.autograd.grad(y, [x], gy)[0])
    for a, b in zip(out["triton"], out["torch"]):
        torch.testing.assert_close(a.float(), b.float(), **tol(torch.bfloat16))
