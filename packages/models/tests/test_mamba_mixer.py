"""``Mamba2Mixer`` at world size 1: against transformers' NemotronHMamba2Mixer (torch path),
its generation step against its own whole-sequence forward, and what it refuses.

transformers is the oracle for the whole mixer: weights mapped by ``mamba_from_hf``, fp64
inputs. Its torch path runs the scan and the gated norm in float32 (``.float()`` inside), so
outputs and input gradients agree at float32 rounding of each tensor's scale, not fp64's.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import shardwork.models.mamba as mamba_module
from shardwork.models import (
    AttentionInputs,
    DecoderSpec,
    GPTConfig,
    GPTModel,
    LayerSpec,
    Mamba2Mixer,
    MambaConfig,
    RotarySpec,
)
from shardwork.models.hf.mamba_weights import mamba_config_to_hf, mamba_from_hf
from shardwork.models.sharding import init_from_shards
from shardwork.models.testing import random_batch
from shardwork.parallel_state import ProcessGroups
from shardwork.parallel_state.testing import assert_close_at_scale

MAMBA = MambaConfig(
    num_heads=4, head_dim=8, state_size=6, num_groups=2, chunk_size=4, dt_limit=(0.01, 1e9)
)
NO_POSITIONS = AttentionInputs(cos=torch.empty(0), sin=torch.empty(0), mask=None)
# transformers scans in float32: measured at most 1.6 float32 ulps of each tensor's scale
# (outputs and input gradients, three input seeds); 16 leaves headroom.
HF_ULPS = 16


def _config(mamba=MAMBA, **kw) -> GPTConfig:
    base = dict(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        vocab_size=100,
        params_dtype=torch.float64,
        mamba=mamba,
    )
    return GPTConfig(**(base | kw))


def _mixer(cfg: GPTConfig, std: float = 0.3) -> Mamba2Mixer:
    mixer = Mamba2Mixer(cfg, ProcessGroups.single())
    for key, param, module in mixer.named_param_keys():
        init_from_shards(param, key, module.shard_ctx, init_seed=11, std=std, num_layers=1)
    return mixer


def _hf_mixer(cfg: GPTConfig):
    pytest.importorskip("transformers")
    from transformers.models.nemotron_h import modeling_nemotron_h as hf
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

    # The torch path: neither mamba-ssm nor causal-conv1d importable, and the fused
    # training entry point returns None (its torch fallback), so forward takes the split path.
    assert importlib.util.find_spec("mamba_ssm") is None
    assert importlib.util.find_spec("causal_conv1d") is None
    fields = mamba_config_to_hf(
        cfg.mamba.replace(dt_limit=(cfg.mamba.dt_min, float("inf"))),
        norm_epsilon=cfg.norm_epsilon,
    )
    hf_cfg = NemotronHConfig(
        hidden_size=cfg.hidden_size,
        num_hidden_layers=1,
        layers_block_type=["mamba"],
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        intermediate_size=64,
        **fields,
    )
    module = hf.NemotronHMamba2Mixer(hf_cfg, 0).double()
    probe = hf.mamba2_split_conv1d_scan_combined(
        torch.zeros(1, 1, 1), None, None, None, None, D=None, chunk_size=1
    )
    assert probe is None
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # random values everywhere, not HF's structured init
        for name, p in module.named_parameters():
            scale = 0.5 if name in ("dt_bias", "D", "A_log", "norm.weight") else 0.2
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
        module.norm.weight.add_(1.0)
    return module


def _load_from_hf(mixer: Mamba2Mixer, hf_module) -> None:
    mapped = mamba_from_hf(hf_module.state_dict(), "")
    shards = mixer.sharded_state_dict()
    assert set(mapped) == set(shards)
    with torch.no_grad():
        for key, st in shards.items():
            st.data.copy_(mapped[key])


def test_matches_transformers_nemotron_h_mixer():
    cfg = _config(mamba=MAMBA.replace(dt_limit=(MAMBA.dt_min, float("inf"))))
    hf_module = _hf_mixer(cfg)
    mixer = Mamba2Mixer(cfg, ProcessGroups.single())
    _load_from_hf(mixer, hf_module)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 13, cfg.hidden_size, generator=gen, dtype=torch.float64)
    x_ours = x.transpose(0, 1).clone().requires_grad_(True)  # [s, b, h]
    x_hf = x.clone().requires_grad_(True)
    ours = mixer(x_ours, NO_POSITIONS)
    theirs = hf_module(x_hf)
    assert_close_at_scale(
        ours.transpose(0, 1), theirs, rtol=0, ulps=HF_ULPS, dtype=torch.float32, name="out"
    )
    w = torch.randn(theirs.shape, generator=gen, dtype=torch.float64)
    (ours.transpose(0, 1) * w).sum().backward()
    (theirs * w).sum().backward()
    grad_ours = x_ours.grad.transpose(0, 1)
    assert_close_at_scale(
        grad_ours, x_hf.grad, rtol=0, ulps=HF_ULPS, dtype=torch.float32, name="input grad"
    )


def test_planted_norm_order_bug_fails_against_transformers(monkeypatch):
    """Normalising before gating (Mamba-2's other option) is not what NemotronH does."""
    cfg = _config(mamba=MAMBA.replace(dt_limit=(MAMBA.dt_min, float("inf"))))
    hf_module = _hf_mixer(cfg)
    mixer = Mamba2Mixer(cfg, ProcessGroups.single())
    _load_from_hf(mixer, hf_module)

    def norm_then_gate(y, z, weight, *, groups, eps):
        shaped = y.unflatten(-1, (groups, -1))
        normed = shaped * torch.rsqrt(shaped.square().mean(-1, keepdim=True) + eps)
        return normed.flatten(-2) * weight * torch.nn.functional.silu(z)

    monkeypatch.setattr(mamba_module, "gated_group_rmsnorm", norm_then_gate)
    x = torch.randn(2, 9, cfg.hidden_size, dtype=torch.float64)
    ours = mixer(x.transpose(0, 1), NO_POSITIONS).transpose(0, 1)
    with torch.no_grad():
        theirs = hf_module(x)
    with pytest.raises(AssertionError, match="out"):
        assert_close_at_scale(ours, theirs, rtol=0, ulps=HF_ULPS, dtype=torch.float32, name="out")


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "proj-bias"])
def test_step_by_step_equals_forward(bias):
    cfg = _config(mamba=MAMBA.replace(proj_bias=bias, chunk_size=3))
    mixer = _mixer(cfg)
    with torch.no_grad():  # zero-initialised biases would hide their use in step
        for name, p in mixer.named_parameters():
            if name.endswith("bias") and name != "dt_bias":
                p.normal_(0.0, 0.3)
    x = torch.randn(11, 3, cfg.hidden_size, dtype=torch.float64)
    with torch.no_grad():
        whole = mixer(x, NO_POSITIONS)
        state = mixer.init_state(3)
        steps = []
        for t in range(x.shape[0]):
            out, state = mixer.step(x[t], state)
            steps.append(out)
    # Measured at most 3 fp64 ulps of the output's scale (the step sums in another order).
    assert_close_at_scale(torch.stack(steps), whole, rtol=0, ulps=32, name="steps")


def test_packed_sequences_are_refused():
    mixer = _mixer(_config())
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    inputs = AttentionInputs(cos=torch.empty(0), sin=torch.empty(0), mask=mask)
    with pytest.raises(ValueError, match=r"packed sequences .* are not supported"):
        mixer(torch.randn(5, 1, 32, dtype=torch.float64), inputs)


def test_mamba_layer_without_config_is_refused():
    with pytest.raises(ValueError, match=r"needs GPTConfig.mamba=MambaConfig\(...\) \(got None\)"):
        Mamba2Mixer(_config(mamba=None), ProcessGroups.single())


def test_bfloat16_compute_stays_at_bfloat16_rounding():
    """bf16 activations (fp32 weights): the scan, skip and norm run in float32 inside, so the
    output is the fp64 mixer's at bf16 rounding (measured at most 2.1 bf16 ulps of the
    output's scale over four inputs; 8 allowed)."""
    exact = _mixer(_config(), std=0.2)
    low = _mixer(_config(params_dtype=torch.float32, compute_dtype=torch.bfloat16), std=0.2)
    x = torch.randn(13, 2, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = exact(x, NO_POSITIONS)
        got = low(x.bfloat16(), NO_POSITIONS)
    assert got.dtype == torch.bfloat16
    assert_close_at_scale(got.double(), want, rtol=0, ulps=8, dtype=torch.bfloat16, name="bf16")


def test_full_recompute_gives_the_same_gradients():
    """A Mamba layer under ``recompute="full"`` replays its forward in backward: the gradients
    equal those of the stored-activation run bit for bit (the mixer draws no randomness)."""
    cfg = _config(num_layers=2)
    spec = DecoderSpec(
        layers=(LayerSpec(mixer="mamba"), LayerSpec(mixer="attention")),
        rotary=RotarySpec(cfg.kv_channels),
    )
    ids, labels = random_batch(cfg.vocab_size)
    grads = []
    for mode in ("none", "full"):
        model = GPTModel(cfg.replace(recompute=mode), spec=spec)
        loss_sum, n = model(ids, labels=labels)
        (loss_sum / n).backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    assert grads[0].keys() == grads[1].keys()
    assert any(".self_attention.A_log" in k for k in grads[0])
    for key, grad in grads[0].items():
        assert torch.equal(grads[1][key], grad), key
