"""The Gated DeltaNet FLOPs formula against torch's FlopCounterMode on a real forward.

FlopCounterMode counts matmuls (mm/bmm/addmm) and convolutions, 2 FLOPs per multiply-add,
and nothing for ``linalg.solve_triangular`` or elementwise ops: the formula's ``counted`` part
must equal it exactly (integers). The solve term is checked against its own definition (a
unit lower-triangular forward substitution costs ``R·C·(C-1)`` FLOPs for ``R`` columns).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from shardwork.models import AttentionInputs, GatedDeltaNetConfig, GPTConfig, layout_groups
from shardwork.models.calculator_deltanet import deltanet_forward_flops
from shardwork.models.deltanet import GatedDeltaNetMixer
from shardwork.parallel_state import ParallelConfig


@pytest.mark.parametrize(
    ("gdn", "batch", "seq"),
    [
        (
            GatedDeltaNetConfig(
                num_key_heads=2, num_value_heads=4, key_head_dim=8, value_head_dim=6, chunk_size=4
            ),
            2,
            13,
        ),
        (
            GatedDeltaNetConfig(
                num_key_heads=1, num_value_heads=1, key_head_dim=4, value_head_dim=4, conv_kernel=3
            ),
            1,
            64,
        ),
    ],
)
def test_counted_flops_equal_flop_counter(gdn, batch, seq):
    cfg = GPTConfig(
        num_layers=1,
        hidden_size=24,
        num_attention_heads=2,
        ffn_hidden_size=32,
        vocab_size=64,
        linear_attention=gdn,
    )
    mixer = GatedDeltaNetMixer(cfg, layout_groups(ParallelConfig(), 1, 0))
    for p in mixer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(seq, batch, cfg.hidden_size)
    inputs = AttentionInputs(cos=torch.ones(seq, 1, 2), sin=torch.zeros(seq, 1, 2), mask=None)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        mixer(x, inputs)
    flops = deltanet_forward_flops(cfg, batch=batch, seq_length=seq)
    assert flops.counted == counter.get_total_flops()
    c, chunks = gdn.chunk_size, -(-seq // gdn.chunk_size)
    solve = (
        batch * gdn.num_value_heads * chunks * (gdn.key_head_dim + gdn.value_head_dim) * c * (c - 1)
    )
    assert flops.triangular_solve == solve
    assert flops.total == flops.counted + solve


def test_flops_input_errors():
    cfg = GPTConfig(
        num_layers=1, hidden_size=8, num_attention_heads=2, ffn_hidden_size=8, vocab_size=8
    )
    with pytest.raises(ValueError, match="linear_attention is None"):
        deltanet_forward_flops(cfg, batch=1, seq_length=4)
    cfg = cfg.replace(
        linear_attention=GatedDeltaNetConfig(
            num_key_heads=1, num_value_heads=1, key_head_dim=2, value_head_dim=2
        )
    )
    with pytest.raises(ValueError, match="seq_length=0 is invalid"):
        deltanet_forward_flops(cfg, batch=1, seq_length=0)
