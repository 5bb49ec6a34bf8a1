"""``MambaConfig`` validation and layout checks, and the mixer's layout-free initial values.

- Each invalid field raises a ValueError naming ``MambaConfig.<field>=<value>`` and what is
  valid; tp that splits heads or groups unevenly, and any cp > 1, are refused by
  ``GPTConfig.check_layout`` before a process group exists.
- A tp=2 model built on the meta device and materialised for each rank (no processes) holds
  exactly the world-1 model's values in its slices; the per-head vectors follow their
  documented formulas (``A_log = log U(1, 16)``, ``softplus(dt_bias) in [dt_min, dt_max]``).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwork.models import (
    DecoderSpec,
    GPTConfig,
    GPTModel,
    LayerSpec,
    MambaConfig,
    RotarySpec,
    layout_groups,
)
from shardwork.parallel_state import ParallelConfig

SHAPES = dict(num_heads=4, head_dim=8, state_size=6)


def hybrid_config() -> GPTConfig:
    return GPTConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        vocab_size=100,
        params_dtype=torch.float64,
        mamba=MambaConfig(**SHAPES, num_groups=2, chunk_size=4),
    )


def hybrid_spec(cfg: GPTConfig) -> DecoderSpec:
    layers = (LayerSpec(mixer="mamba"), LayerSpec(mixer="attention"))
    return DecoderSpec(layers=layers, rotary=RotarySpec(cfg.kv_channels))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_heads": 0}, "MambaConfig.num_heads=0 is invalid: it must be an integer >= 1"),
        ({"head_dim": 2.5}, "MambaConfig.head_dim=2.5 is invalid: it must be an integer"),
        ({"num_groups": 3}, "MambaConfig.num_groups=3 is invalid: it must divide num_heads=4"),
        ({"chunk_size": -1}, "MambaConfig.chunk_size=-1 is invalid"),
        ({"conv_kernel": True}, "MambaConfig.conv_kernel=True is invalid"),
        ({"dt_min": 0.2}, "dt_min=0.2 / dt_max=0.1 are invalid: they need 0 < dt_min <= dt_max"),
        ({"dt_init_floor": 0.0}, "MambaConfig.dt_init_floor=0.0 must be > 0"),
        ({"A_init_range": (0.0, 16.0)}, r"A_init_range=\(0.0, 16.0\) is invalid: it needs 0 <"),
        ({"A_init_range": (1.0,)}, r"A_init_range=\(1.0,\) is invalid: it must be a pair"),
        ({"dt_limit": (0.5, 0.1)}, r"dt_limit=\(0.5, 0.1\) is invalid: it needs 0 <= low < hi"),
        ({"norm_epsilon": -1.0}, "MambaConfig.norm_epsilon=-1.0 must be > 0 or None"),
    ],
)
def test_invalid_fields_are_named(changes, message):
    with pytest.raises(ValueError, match=message):
        MambaConfig(**(SHAPES | changes))


@pytest.mark.parametrize(
    ("mamba", "parallel", "message"),
    [
        (
            dict(num_heads=6, num_groups=3),
            dict(tp=2),
            "MambaConfig.num_groups=3 is not divisible by tp=2: each tensor-parallel rank",
        ),
        (
            dict(num_heads=6, num_groups=1),
            dict(tp=4),
            "MambaConfig.num_heads=6 is not divisible by tp=4",
        ),
        (
            dict(num_heads=4, num_groups=2),
            dict(cp=2),
            r"Mamba layers do not support context parallelism \(cp=2\): the scan's state would "
            "have to pass between cp ranks; use cp=1",
        ),
    ],
    ids=["groups-tp2", "heads-tp4", "cp2"],
)
def test_layout_refused_before_any_group(mamba, parallel, message):
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=64,
        vocab_size=100,
        mamba=MambaConfig(head_dim=8, state_size=6, **mamba),
    )
    with pytest.raises(ValueError, match=message):
        cfg.check_layout(ParallelConfig(**parallel))


def test_gpt_config_validates_its_mamba_part():
    cfg = hybrid_config()
    assert cfg.mamba.epsilon(cfg) == cfg.norm_epsilon
    assert cfg.mamba.replace(norm_epsilon=1e-3).epsilon(cfg) == 1e-3
    assert cfg.mamba.inner_size == 32 and cfg.mamba.conv_channels == 32 + 2 * 2 * 6


def _params(model):
    return model.sharded_state_dict()


def test_tp2_slices_equal_world1_values():
    cfg = hybrid_config()
    spec = hybrid_spec(cfg)
    ref = {k: st.data for k, st in _params(GPTModel(cfg, spec=spec)).items()}
    mixer_keys = {k for k in ref if ".self_attention." in k and k.startswith("decoder.layers.0.")}
    expected = {
        f"decoder.layers.0.self_attention.{name}"
        for name in (
            *(f"in_proj.weight.{b}" for b in ("z", "x", "B", "C", "dt")),
            *(f"conv1d.{w}.{b}" for w in ("weight", "bias") for b in ("x", "B", "C")),
            "dt_bias",
            "A_log",
            "D",
            "norm.weight",
            "out_proj.weight",
        )
    }
    assert mixer_keys == expected
    seen = set()
    for rank in range(2):
        stage = GPTModel(
            cfg, layout_groups(ParallelConfig(tp=2), 2, rank), device="meta", spec=spec
        )
        for key, st in _params(stage.materialize("cpu")).items():
            index = tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.data.shape))
            assert torch.equal(st.data, ref[key][index]), (rank, key)
            seen.add(key)
    assert seen == set(ref)
    _check_formulas(cfg, ref, "decoder.layers.0.self_attention.")


def _check_formulas(cfg, ref, prefix):
    m = cfg.mamba
    a = torch.exp(ref[prefix + "A_log"])
    assert bool((a >= m.A_init_range[0]).all() and (a <= m.A_init_range[1]).all())
    dt = torch.nn.functional.softplus(ref[prefix + "dt_bias"])
    assert bool((dt >= m.dt_min * (1 - 1e-6)).all() and (dt <= m.dt_max * (1 + 1e-6)).all())
    assert ref[prefix + "dt_bias"].unique().numel() == m.num_heads  # drawn, not constant
    assert torch.equal(ref[prefix + "D"], torch.ones(m.num_heads, dtype=torch.float64))
    assert torch.equal(ref[prefix + "norm.weight"], torch.ones(m.inner_size, dtype=torch.float64))
    out_std = float(ref[prefix + "out_proj.weight"].std())
    scaled = cfg.init_method_std / math.sqrt(2 * cfg.num_layers)
    assert 0.7 * scaled < out_std < 1.3 * scaled
