"""``mamba_forward_flops`` against ``torch.utils.flop_counter.FlopCounterMode`` on the mixer.

FlopCounterMode counts matrix products and convolutions (2 per multiply-add), which is what
the calculator counts; element-wise work is outside both. The counts are integers, compared
exactly, over shapes where the chunked scan pads (seq not a multiple of the chunk) and B/C
are grouped.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardwork.models import AttentionInputs, GPTConfig, Mamba2Mixer, MambaConfig
from shardwork.models.calculator_mamba import mamba_forward_flops
from shardwork.models.sharding import init_from_shards
from shardwork.parallel_state import ProcessGroups

NO_POSITIONS = AttentionInputs(cos=torch.empty(0), sin=torch.empty(0), mask=None)


@pytest.mark.parametrize(
    ("batch", "seq", "heads", "groups", "chunk", "bias"),
    [(2, 13, 4, 2, 4, False), (1, 16, 6, 3, 8, True), (3, 5, 2, 1, 16, False)],
)
def test_calculator_equals_flop_counter(batch, seq, heads, groups, chunk, bias):
    mamba = MambaConfig(
        num_heads=heads,
        head_dim=4,
        state_size=5,
        num_groups=groups,
        chunk_size=chunk,
        proj_bias=bias,
    )
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=24,
        num_attention_heads=4,
        ffn_hidden_size=48,
        vocab_size=100,
        mamba=mamba,
    )
    mixer = Mamba2Mixer(cfg, ProcessGroups.single())
    for key, param, module in mixer.named_param_keys():
        init_from_shards(param, key, module.shard_ctx, init_seed=1, std=0.1, num_layers=1)
    hidden = torch.randn(seq, batch, cfg.hidden_size)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        mixer(hidden, NO_POSITIONS)
    expected = counter.get_total_flops()
    flops = mamba_forward_flops(cfg, batch, seq)
    assert flops.total == expected, (flops, counter.get_flop_counts())
    # the projections alone are the two linears' 2·rows·in·out, counted by torch as (add)mm
    counts = counter.get_flop_counts()["Global"]
    linear = sum(v for op, v in counts.items() if "mm" in str(op) and "bmm" not in str(op))
    assert flops.projections == linear
    conv = sum(v for op, v in counts.items() if "convolution" in str(op))
    assert flops.conv == conv
