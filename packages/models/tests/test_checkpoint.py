"""Save at one layout, load at another (shardwork.dist_checkpoint): same weights, same loss.

Layouts: TP=2+SP -> CP=2, and PP=2 (tied embeddings: the last stage's head copy is saved as a
replica of the embedding) -> TP=2. The loading model starts from a different init seed, so
equality proves the load.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwork.dist_checkpoint import load, save
from shardwork.models import GPTModel, preset, reduce_loss, slice_for_context_parallel
from shardwork.models.full_state import full_state_dict
from shardwork.models.testing import random_batch
from shardwork.parallel_state import ParallelConfig, ProcessGroups, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank


def _build(cfg, parallel: ParallelConfig):
    groups = init_process_groups(parallel)
    if parallel.pp == 1:
        return GPTModel(cfg, groups), groups
    half = cfg.num_layers // 2
    rng = (0, half) if groups.rank("pp") == 0 else (half, cfg.num_layers)
    return GPTModel(cfg, groups, layer_range=rng), groups


def _save_then_load(path, save_layout, load_layout):
    cfg = preset("tiny-qwen3-8b", params_dtype=torch.float64, tie_word_embeddings=True)
    saver, _ = _build(
        cfg.replace(sequence_parallel=save_layout.get("tp", 1) > 1), ParallelConfig(**save_layout)
    )
    save(saver.sharded_state_dict(), path)
    expected = full_state_dict(saver)
    loader, groups = _build(cfg.replace(init_seed=99), ParallelConfig(**load_layout))
    before = full_state_dict(loader)
    load(loader.sharded_state_dict(), path)
    after = full_state_dict(loader)
    assert set(after) == set(expected)
    assert any(not torch.equal(before[k], expected[k]) for k in expected)
    for key in expected:
        assert torch.equal(after[key], expected[key]), key
    # same loss as the world-1 model built from the saver's init seed
    ref = GPTModel(cfg, ProcessGroups.single())
    ids, labels = random_batch(cfg.vocab_size)
    cp, cp_rank = groups.size("cp"), groups.rank("cp")
    loss_sum, n = loader(
        slice_for_context_parallel(ids, cp_rank=cp_rank, cp_size=cp),
        labels=slice_for_context_parallel(labels, cp_rank=cp_rank, cp_size=cp),
    )
    ref_sum, ref_n = ref(ids, labels=labels)
    dist.barrier()
    return float(reduce_loss(loss_sum, n, groups.dp_cp)), float(ref_sum / ref_n)


def test_save_tp2_sp_load_cp2(tmp_path):
    results = run_on_ranks(_save_then_load, 2, args=(str(tmp_path / "ckpt"), {"tp": 2}, {"cp": 2}))
    for loss, ref in results:
        assert loss == pytest.approx(ref, rel=1e-6)


def test_save_pp2_tied_load_tp2(tmp_path):
    results = run_on_ranks(_save_then_load, 2, args=(str(tmp_path / "ckpt"), {"pp": 2}, {"tp": 2}))
    for loss, ref in results:
        assert loss == pytest.approx(ref, rel=1e-6)
