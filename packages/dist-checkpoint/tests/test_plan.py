"""Writer choice without processes: every distinct rectangle is written exactly once and the
writing of replicated tensors is spread evenly over the ranks holding them."""

import torch

from shardwork.dist_checkpoint import ShardedTensor
from shardwork.dist_checkpoint.plan import build_global_plan, collect_local, summarize


def _rank_state(rank, world):
    state = {
        f"rep{i}": ShardedTensor.from_rank_offsets(f"rep{i}", torch.randn(250), replica_id=rank)
        for i in range(8)
    }
    # a 2x2 grid of a (4, 6) tensor on ranks 0-3
    state["grid"] = ShardedTensor.from_rank_offsets(
        "grid", torch.randn(2, 3), (0, rank // 2, 2), (1, rank % 2, 2)
    )
    # replicated over pairs (tp=2 x dp=2): dp rank = rank // 2 is the replica id
    state["tp"] = ShardedTensor.from_rank_offsets(
        "tp", torch.randn(5, 10), (0, rank % 2, 2), replica_id=rank // 2
    )
    return state


def test_each_rectangle_written_once_and_balanced():
    world = 4
    summaries = [summarize(collect_local(_rank_state(r, world))) for r in range(world)]
    plans = [build_global_plan(summaries, r) for r in range(world)]
    written = [p.mine_tensors for p in plans]
    all_items = [item for w in written for item in w]
    assert len(all_items) == len(set(all_items)) == 8 + 4 + 2
    # every rank computed the same byte split; the replicated tensors are spread evenly
    assert all(p.bytes_per_rank == plans[0].bytes_per_rank for p in plans)
    assert sum(plans[0].bytes_per_rank) == (8 * 250 + 24 + 100) * 4
    per_rank_rep = [sum(1 for key, _ in w if key.startswith("rep")) for w in written]
    assert per_rank_rep == [2, 2, 2, 2]
    # a TP piece is written by a rank that holds it (rank r holds rows 5 * (r % 2) ...)
    for r, items in enumerate(written):
        for key, offsets in items:
            if key == "tp":
                assert offsets == (5 * (r % 2), 0)
    assert plans[0].catalogue["grid"]["num_chunks"] == 4
    assert plans[0].catalogue["rep0"]["paths"] == ["rep0"]
