"""Writer choice without processes: every distinct rectangle is written exactly once and the
writing of replicated tensors is spread evenly over the ranks holding them."""

import json
from pathlib import Path

import pytest
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


FIXTURE = Path(__file__).parent / "fixtures" / "global_plan.json"


def _as_input(summaries):
    """The fixture's JSON lists back to the tuples `summarize` produces (boxes are dict keys)."""
    out = []
    for s in summaries:
        tensors = [
            (k, d, tuple(g), r, p, [(tuple(o), tuple(z)) for o, z in boxes])
            for k, d, g, r, p, boxes in s["tensors"]
        ]
        objects = [(k, tuple(g), tuple(o), r, p) for k, g, o, r, p in s["objects"]]
        out.append({"tensors": tensors, "objects": objects, "plain": list(s["plain"])})
    return out


@pytest.mark.golden
def test_plan_matches_recorded_plans_of_every_rank():
    """The plan of every rank equals the one recorded before `build_global_plan` was split into
    phases (tools/dist_checkpoint_plan_fixture.py): same catalogue, writers, bytes."""
    record = json.loads(FIXTURE.read_text())
    summaries = _as_input(record["summaries"])
    assert len(summaries) == len(record["plans"]) == 8
    for rank, expected in enumerate(record["plans"]):
        plan = build_global_plan(summaries, rank)
        assert json.loads(json.dumps(plan.catalogue)) == expected["catalogue"]
        mine = sorted([key, list(off)] for key, off in plan.mine_tensors)
        assert mine == expected["mine_tensors"], rank
        assert sorted(plan.mine_objects) == expected["mine_objects"]
        assert sorted(plan.mine_empty) == expected["mine_empty"]
        assert plan.bytes_per_rank == expected["bytes_per_rank"]
        assert plan.plain_paths == expected["plain_paths"]


@pytest.mark.golden
@pytest.mark.parametrize("case", range(6))
def test_invalid_summaries_raise_the_recorded_error(case):
    record = json.loads(FIXTURE.read_text())["invalid"][case]
    with pytest.raises(ValueError) as info:
        build_global_plan(_as_input(record["summaries"]), 0)
    assert str(info.value) == record["error"], record["name"]
