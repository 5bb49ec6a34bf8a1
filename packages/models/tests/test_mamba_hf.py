"""NemotronH Mamba mixer names and config fields <-> shardwork's, both ways.

The tensor blocks are checked against slices written out here from the documented fused
layouts (``in_proj`` rows ``[z | x | B | C | dt]``, ``conv1d`` channels ``[x | B | C]``);
export of an import gives the same tensors back exactly. The config fields are read from a
real ``NemotronHConfig`` (defaults and the old ``mamba_*`` aliases of a config.json).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardwork.models import MambaConfig
from shardwork.models.hf.mamba_weights import (
    mamba_config_from_hf,
    mamba_config_to_hf,
    mamba_from_hf,
    mamba_to_hf,
)

HEADS, P, G, N, H, K = 4, 3, 2, 5, 16, 4


def _hf_tensors(prefix: str, bias: bool) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    inner, bc = HEADS * P, G * N
    shapes = {
        "in_proj.weight": (2 * inner + 2 * bc + HEADS, H),
        "conv1d.weight": (inner + 2 * bc, 1, K),
        "conv1d.bias": (inner + 2 * bc,),
        "dt_bias": (HEADS,),
        "A_log": (HEADS,),
        "D": (HEADS,),
        "norm.weight": (inner,),
        "out_proj.weight": (H, inner),
    }
    if bias:
        shapes |= {"in_proj.bias": (2 * inner + 2 * bc + HEADS,), "out_proj.bias": (H,)}
    return {prefix + k: torch.randn(s, generator=gen) for k, s in shapes.items()}


@pytest.mark.parametrize("bias", [False, True], ids=["no-proj-bias", "proj-bias"])
def test_tensor_blocks_and_round_trip(bias):
    hf_prefix = "backbone.layers.3.mixer."
    hf = _hf_tensors(hf_prefix, bias)
    ours = mamba_from_hf(hf, hf_prefix, out_prefix="decoder.layers.3.self_attention.")
    inner, bc = HEADS * P, G * N
    w = hf[hf_prefix + "in_proj.weight"]
    starts = {"z": 0, "x": inner, "B": 2 * inner, "C": 2 * inner + bc, "dt": 2 * inner + 2 * bc}
    widths = {"z": inner, "x": inner, "B": bc, "C": bc, "dt": HEADS}
    for block, start in starts.items():
        got = ours[f"decoder.layers.3.self_attention.in_proj.weight.{block}"]
        assert torch.equal(got, w[start : start + widths[block]]), block
    conv = hf[hf_prefix + "conv1d.weight"]
    for block, start in {"x": 0, "B": inner, "C": inner + bc}.items():
        got = ours[f"decoder.layers.3.self_attention.conv1d.weight.{block}"]
        assert torch.equal(got, conv[start : start + widths[block]]), block
    assert torch.equal(ours["decoder.layers.3.self_attention.A_log"], hf[hf_prefix + "A_log"])
    assert len(ours) == 5 * (1 + bias) + 6 + 5 + bias
    back = mamba_to_hf(ours, "decoder.layers.3.self_attention.", hf_prefix=hf_prefix)
    assert set(back) == set(hf)
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


def test_inconsistent_fused_sizes_are_refused():
    hf = _hf_tensors("", False)
    hf["conv1d.weight"] = hf["conv1d.weight"][:-1]
    with pytest.raises(ValueError, match=r"not the .* layout of a Mamba-2 mixer"):
        mamba_from_hf(hf, "")


def test_config_fields_from_nemotron_h_config():
    pytest.importorskip("transformers")
    from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig

    hf = NemotronHConfig(
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=32,
        mamba_n_groups=4,  # an old config.json name
        chunk_size=64,
        time_step_min=0.002,
        layer_norm_epsilon=1e-6,
        use_conv_bias=False,
    )
    cfg = mamba_config_from_hf(hf)
    assert cfg == MambaConfig(
        num_heads=8,
        head_dim=16,
        state_size=32,
        num_groups=4,
        conv_kernel=4,
        chunk_size=64,
        conv_bias=False,
        proj_bias=False,
        dt_min=0.002,
        dt_max=0.1,
        dt_init_floor=1e-4,
        dt_limit=(0.002, math.inf),
        norm_epsilon=1e-6,
    )
    fields = mamba_config_to_hf(cfg, norm_epsilon=1e-5)
    # time_step_limit is written as the clamp the mixer applies, (time_step_min, inf); the
    # config object keeps its unused default (0, inf).
    assert fields.pop("time_step_limit") == [0.002, math.inf]
    assert fields == {name: getattr(hf, name) for name in fields}
    assert mamba_config_from_hf(fields | {"hidden_size": 64}) == cfg


def test_config_that_hf_cannot_express_is_refused():
    cfg = MambaConfig(num_heads=4, head_dim=8, state_size=6)  # dt_limit (0, inf), dt_min 0.001
    with pytest.raises(ValueError, match=r"dt_limit=\(0.0, inf\) cannot be written"):
        mamba_config_to_hf(cfg, norm_epsilon=1e-5)
    with pytest.raises(ValueError, match="mamba_hidden_act='gelu' is not supported"):
        mamba_config_from_hf(
            {"mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 6}
            | {"mamba_hidden_act": "gelu"}
        )
