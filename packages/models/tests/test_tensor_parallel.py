"""TP=2, TP=2+SP and CP=2: loss and every parameter's gradient equal the single-rank model's.

See ``shardwork.models.testing.compare_with_single_rank``: float64 at rtol 1e-9 (one case with
a plain ``F.cross_entropy`` oracle loss instead of the fused vocab-parallel one) and one
float32 case at rtol 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from shardwork.models import REPLICATED, TENSOR_PARALLEL, GPTModel, gather_logits, preset
from shardwork.models.testing import compare_with_single_rank, random_batch
from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank
RTOL64 = 1e-9


def _compare(name, kwargs):
    return compare_with_single_rank(name, **kwargs)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("tiny-llama3-8b", {"tp": 2}),
        ("tiny-llama3-8b", {"tp": 2, "oracle_loss": True}),
        ("tiny-llama3-8b", {"tp": 2, "sequence_parallel": True}),
        ("tiny-qwen3-8b", {"tp": 2, "sequence_parallel": True, "tie_word_embeddings": True}),
        ("tiny-qwen2.5-7b", {"tp": 2}),
        ("tiny-llama3-8b", {"cp": 2}),
        ("tiny-qwen3-8b", {"cp": 2, "tp": 2, "sequence_parallel": True}),
        (
            "tiny-llama3-8b",
            {"tp": 2, "sequence_parallel": True, "batch": 1, "cu_seqlens": [0, 5, 11, 16]},
        ),
    ],
    ids=[
        "tp2",
        "tp2-oracle-loss",
        "tp2-sp",
        "tp2-sp-qknorm-tied",
        "tp2-qkv-bias",
        "cp2",
        "cp2-tp2-sp",
        "tp2-sp-packed",
    ],
)
def test_layout_matches_single_rank_fp64(name, kwargs):
    world = kwargs.get("tp", 1) * kwargs.get("cp", 1)
    losses = run_on_ranks(_compare, world, args=(name, kwargs | {"rtol": RTOL64}))
    assert len(set(losses)) == 1


def test_tp2_sp_matches_single_rank_fp32():
    run_on_ranks(
        _compare,
        2,
        args=(
            "tiny-llama3.1-8b",
            {"tp": 2, "sequence_parallel": True, "dtype": torch.float32, "rtol": 1e-4},
        ),
    )


def _dropout_streams():
    groups = init_process_groups(ParallelConfig(tp=2))
    cfg = preset("tiny-llama3-8b", hidden_dropout=0.3, attention_dropout=0.3)
    model = GPTModel(cfg, groups).train()
    ids, _ = random_batch(cfg.vocab_size)
    logits = gather_logits(model(ids), tp_group=groups.tp, vocab_size=cfg.vocab_size)
    with model.rng_tracker.fork(REPLICATED):
        replicated = torch.rand(8)
    with model.rng_tracker.fork(TENSOR_PARALLEL):
        sharded = torch.rand(8)
    return logits.detach(), replicated, sharded


def test_tp_dropout_replicated_where_activations_are_replicated():
    (la, ra, sa), (lb, rb, sb) = run_on_ranks(_dropout_streams, 2)
    # the residual stream is whole on both TP ranks: its dropout masks must agree, so the
    # (gathered) logits are identical; attention dropout on local heads uses distinct streams
    assert torch.equal(la, lb)
    assert torch.equal(ra, rb)
    assert not torch.equal(sa, sb)
