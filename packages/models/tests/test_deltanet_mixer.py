"""GatedDeltaNetMixer at world 1: against transformers' Qwen3NextGatedDeltaNet (its torch
fallback path, asserted), its own recurrent ``step``, and the HF weight mapping.

Precision: both modules hold fp64 weights and inputs, but transformers' torch delta rule
computes in float32 whatever the input dtype (``torch_chunk_gated_delta_rule`` casts, and
``g`` is computed from ``a.float()``), so the comparison with it runs at float32 rounding:
``ULPS_F32`` float32 ulps at the tensor's scale. Measured max error: outputs 3.5, input
gradients 7.7 float32 ulps; of parameter gradients up to ~110 ulps (``A_log``, ``dt_bias``:
sums over all tokens of float32 terms through ``exp``/``softplus``), hence their budget of
``ULPS_F32 · b·s``. A wrong weight order or gate is off by O(1).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from shardwork.models import AttentionInputs, GatedDeltaNetConfig, GPTConfig, layout_groups
from shardwork.models.deltanet import GatedDeltaNetMixer
from shardwork.models.hf.deltanet_weights import (
    deltanet_config_from_hf,
    deltanet_config_to_hf,
    deltanet_from_hf,
    deltanet_to_hf,
)
from shardwork.models.sharding import ShardContext, param_shards
from shardwork.parallel_state import ParallelConfig
from shardwork.parallel_state.testing import assert_close_at_scale

F64 = torch.float64
ULPS_F32 = 64
GDN = GatedDeltaNetConfig(
    num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, chunk_size=4
)


def gpt_config(gdn: GatedDeltaNetConfig = GDN) -> GPTConfig:
    return GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        vocab_size=97,
        params_dtype=F64,
        norm_epsilon=1e-6,
        linear_attention=gdn,
    )


def world1_mixer(gdn: GatedDeltaNetConfig = GDN) -> GatedDeltaNetMixer:
    return GatedDeltaNetMixer(gpt_config(gdn), layout_groups(ParallelConfig(), 1, 0))


def load_global(module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy global tensors into ``module``'s local pieces, key by key."""
    with torch.no_grad():
        for key, st in module.sharded_state_dict().items():
            index = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.data.shape))
            st.data.copy_(tensors[key][index])


def no_inputs(s: int) -> AttentionInputs:
    return AttentionInputs(cos=torch.ones(s, 1, 2), sin=torch.zeros(s, 1, 2), mask=None)


def hf_module(seed: int):
    """A random fp64 Qwen3NextGatedDeltaNet on the torch fallback path (asserted)."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig

    for package in ("fla", "causal_conv1d"):
        assert importlib.util.find_spec(package) is None, f"{package} is installed"
    for name in ("causal_conv1d_fn", "torch_chunk_gated_delta_rule"):
        fn = getattr(modeling, name)
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__)))
        assert cells["implementation"] is cells["torch_function"], f"{name} is not torch's"
    hf_config = Qwen3NextConfig(
        hidden_size=32,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        **deltanet_config_to_hf(GDN),
    )
    torch.manual_seed(seed)
    module = modeling.Qwen3NextGatedDeltaNet(hf_config, layer_idx=0).double()
    with torch.no_grad():
        for p in module.parameters():  # all random, so every mapping error shows
            p.copy_(torch.randn_like(p) * 0.3)
        module.A_log.copy_(torch.empty_like(module.A_log).uniform_(0.01, 16).log())
    return module, hf_config


def test_matches_transformers_outputs_and_gradients():
    hf, hf_config = hf_module(seed=0)
    assert deltanet_config_from_hf(hf_config.to_dict(), chunk_size=4) == GDN
    ours = world1_mixer()
    hf_state = dict(hf.state_dict())
    load_global(ours, deltanet_from_hf(hf_state, "", GDN))
    gen = torch.Generator().manual_seed(1)
    b, s = 2, 11  # s not a multiple of our chunk (4) nor of transformers' (64)
    x = torch.randn(b, s, 32, generator=gen, dtype=F64)
    w = torch.randn(b, s, 32, generator=gen, dtype=F64)
    x_hf, x_ours = x.clone().requires_grad_(), x.transpose(0, 1).clone().requires_grad_()
    y_hf = hf(x_hf)
    y_ours = ours(x_ours, no_inputs(s))
    assert_close_at_scale(
        y_ours.transpose(0, 1), y_hf, rtol=0, ulps=ULPS_F32, dtype=torch.float32, name="output"
    )
    (y_hf * w).sum().backward()
    (y_ours * w.transpose(0, 1)).sum().backward()
    assert_close_at_scale(
        x_ours.grad.transpose(0, 1), x_hf.grad, rtol=0, ulps=ULPS_F32, dtype=torch.float32
    )
    hf_grads = {n: p.grad for n, p in hf.named_parameters()}
    expected = deltanet_from_hf(hf_grads, "", GDN)
    # Our gradients under our keys: each parameter's gradient described like the parameter.
    got = {
        st.key: st.data
        for name, p in ours.named_parameters()
        for st in param_shards(p, name, ShardContext(), source=p.grad)
    }
    assert got.keys() == expected.keys()
    for key, grad in got.items():
        # A parameter's gradient sums b·s tokens' float32 terms in transformers (rounding
        # grows with the count, and terms larger than the sum cancel): b·s times the per-token
        # budget.
        assert_close_at_scale(
            grad, expected[key], rtol=0, ulps=ULPS_F32 * b * s, dtype=torch.float32, name=f"d{key}"
        )


def test_planted_mapping_bug_fails_tolerance():
    """Splitting in_proj_qkvz as if it were blockwise (ignoring the per-group interleave)."""
    hf, _ = hf_module(seed=2)
    ours = world1_mixer()
    state = dict(hf.state_dict())
    tensors = deltanet_from_hf(state, "", GDN)
    kd, vd = GDN.key_dim, GDN.value_dim
    q, k, v, z = state["in_proj_qkvz.weight"].split((kd, kd, vd, vd))
    tensors.update({"in_proj.weight.q": q, "in_proj.weight.k": k})
    tensors.update({"in_proj.weight.v": v, "in_proj.weight.z": z})
    load_global(ours, tensors)
    x = torch.randn(1, 9, 32, dtype=F64, generator=torch.Generator().manual_seed(3))
    with pytest.raises(AssertionError, match="output"):
        assert_close_at_scale(
            ours(x.transpose(0, 1), no_inputs(9)).transpose(0, 1),
            hf(x).detach(),
            rtol=0,
            ulps=ULPS_F32,
            dtype=torch.float32,
            name="output",
        )


def test_hf_mapping_round_trip_is_exact():
    hf, _ = hf_module(seed=4)
    state = {f"model.layers.3.linear_attn.{n}": t for n, t in hf.state_dict().items()}
    ours = deltanet_from_hf(state, "model.layers.3.linear_attn.", GDN, key_prefix="x.")
    back = deltanet_to_hf(ours, "x.", GDN, prefix="model.layers.3.linear_attn.")
    assert back.keys() == state.keys()
    for name in state:
        assert torch.equal(back[name], state[name]), name


def test_hf_config_errors():
    fields = deltanet_config_to_hf(GDN)
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        deltanet_config_from_hf({**fields, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="linear_key_head_dim"):
        deltanet_config_from_hf({k: v for k, v in fields.items() if k != "linear_key_head_dim"})
    with pytest.raises(ValueError, match=r"'conv1d.weight' has shape \(56, 1, 3\)"):
        bad = deltanet_to_hf(_random_keys(GDN), "", GDN)
        bad["conv1d.weight"] = bad["conv1d.weight"][..., :3]
        deltanet_from_hf(bad, "", GDN)


def _random_keys(gdn):
    mixer = world1_mixer(gdn)
    return {
        k: torch.randn(st.global_shape, dtype=F64) for k, st in mixer.sharded_state_dict().items()
    }


@pytest.mark.parametrize("gdn", [GDN, GDN.replace(num_value_heads=2, conv_kernel=3)])
def test_step_equals_forward(gdn):
    """Token-by-token generation (conv window + recurrent state) equals the chunked forward."""
    mixer = world1_mixer(gdn)
    load_global(mixer, {k: t * 0.3 for k, t in _random_keys(gdn).items()})
    gen = torch.Generator().manual_seed(7)
    s, b = 10, 3
    x = torch.randn(s, b, 32, generator=gen, dtype=F64)
    with torch.no_grad():
        full = mixer(x, no_inputs(s))
        state = mixer.init_state(b)
        steps = []
        for t in range(s):
            y, state = mixer.step(x[t], state)
            steps.append(y)
    assert_close_at_scale(torch.stack(steps), full, rtol=0, ulps=256, name="step vs forward")


def test_masks_are_refused():
    mixer = world1_mixer()
    x = torch.randn(4, 1, 32, dtype=F64)
    inputs = AttentionInputs(cos=torch.ones(4, 1, 2), sin=torch.zeros(4, 1, 2), mask=None)
    inputs.mask = torch.ones(4, 4, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match="packed sequences"):
        mixer(x, inputs)
