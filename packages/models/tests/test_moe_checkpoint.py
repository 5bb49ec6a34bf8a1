"""MoE checkpoints reshard across expert layouts: saved at EP=2 (experts split) and loaded at
ETP=2 (every expert's width split) and at world size 1 — same tensors (experts, router, expert
bias buffer, MLA, MTP), same loss as the saving model. The loader starts from another seed."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwork.dist_checkpoint import load, save
from shardwork.models import GPTModel, preset
from shardwork.models.full_state import full_state_dict
from shardwork.models.moe import moe_routers
from shardwork.models.testing import random_batch
from shardwork.parallel_state import ParallelConfig, ProcessGroups, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _save_then_load(path, save_layout, load_layout):
    cfg = preset("tiny-deepseek-v3", params_dtype=torch.float64)
    saver = GPTModel(cfg, init_process_groups(ParallelConfig(**save_layout)))
    for r in moe_routers(saver):  # a trained-looking expert bias (a buffer, saved too)
        r.expert_bias.copy_(torch.linspace(-0.1, 0.1, r.expert_bias.numel()) * r.layer_index)
    save(saver.sharded_state_dict(), path)
    expected = full_state_dict(saver)
    ids, labels = random_batch(cfg.vocab_size)
    with torch.no_grad():
        saver_loss = [float(x) for x in saver.eval()(ids, labels=labels)]
    out = []
    for layout in (load_layout, None):
        if layout is None:
            loader = GPTModel(cfg.replace(init_seed=7), ProcessGroups.single())
            group = dist.new_group([dist.get_rank()])
        else:
            loader = GPTModel(
                cfg.replace(init_seed=7), init_process_groups(ParallelConfig(**layout))
            )
            group = None
        before = full_state_dict(loader, group=group)
        load(loader.sharded_state_dict(), path, group=group)
        after = full_state_dict(loader, group=group)
        assert set(after) == set(expected)
        assert any(not torch.equal(before[k], expected[k]) for k in expected)
        for key in expected:
            assert torch.equal(after[key], expected[key]), key
        biases = {r.layer_index: r.expert_bias for r in moe_routers(loader)}
        assert biases and all(float(b.abs().sum()) > 0 for i, b in biases.items() if i > 1)
        with torch.no_grad():
            loss = [float(x) for x in loader.eval()(ids, labels=labels)]
        torch.testing.assert_close(loss, saver_loss, rtol=1e-12, atol=0)
        out.append(loss[0])
    return out


def test_save_ep2_load_etp2_and_world1(tmp_path):
    results = run_on_ranks(
        _save_then_load, 2, args=(tmp_path / "ckpt", {"ep": 2, "etp": 1}, {"ep": 1, "etp": 2})
    )
    assert len({tuple(r) for r in results}) == 1
