"""init_process_groups on real gloo ranks: each group reduces over exactly its members."""

import pytest
import torch
import torch.distributed as dist

from shardwork.parallel_state import (
    GROUP_NAMES,
    ParallelConfig,
    ProcessGroups,
    RankLayout,
    group_rank,
    group_size,
    init_process_groups,
)
from shardwork.parallel_state.testing import run_on_ranks


def _member_sums(config_kwargs, ranks=None):
    config = ParallelConfig(**config_kwargs)
    if ranks is not None and dist.get_rank() not in ranks:
        return None
    groups = init_process_groups(config, ranks=ranks, gloo_twins=True)
    out = {}
    for name in GROUP_NAMES:
        value = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
        dist.all_reduce(value, group=groups.group(name))
        out[name] = (
            value.item(),
            groups.members[name],
            groups.rank(name),
            group_rank(groups.group(name)),
        )
    twin = torch.ones(1)
    dist.all_reduce(twin, group=groups.gloo_group("dp"))
    out["gloo_dp"] = twin.item()
    return out


@pytest.mark.multirank
@pytest.mark.parametrize(
    "config_kwargs",
    [
        dict(tp=2, pp=2, ep=2, etp=1),
        dict(tp=2, cp=2, ep=4, etp=2),
        dict(pp=2, cp=2, ep=2, order="tp-ep-cp-dp-pp"),
    ],
    ids=["tp2pp2ep2etp1", "tp2cp2ep4etp2", "pp2cp2ep2-order"],
)
def test_each_group_all_reduce_sums_exactly_its_members(config_kwargs):
    results = run_on_ranks(_member_sums, world_size=8, args=(config_kwargs,))
    layout = RankLayout.build(ParallelConfig(**config_kwargs), 8)
    for rank, out in enumerate(results):
        for name in GROUP_NAMES:
            members = layout.group_of(name, rank)
            total, seen_members, index, torch_index = out[name]
            assert total == sum(r + 1 for r in members), (name, rank)
            assert list(seen_members) == members
            assert index == torch_index == members.index(rank)
        assert out["gloo_dp"] == layout.size("dp")


@pytest.mark.multirank
def test_layout_on_a_subset_of_the_world():
    # A 4-rank layout hosted on global ranks 4..7 of an 8-rank world; ranks 0..3 sit out.
    ranks = [4, 5, 6, 7]
    results = run_on_ranks(_member_sums, world_size=8, args=(dict(tp=2, pp=2), ranks))
    assert results[:4] == [None] * 4
    layout = RankLayout.build(ParallelConfig(tp=2, pp=2), 4)
    for local, out in enumerate(results[4:]):
        for name in ("tp", "pp", "dp", "mp"):
            members = [ranks[r] for r in layout.group_of(name, local)]
            assert out[name][0] == sum(r + 1 for r in members)
            assert list(out[name][1]) == members


def _init_with_bad_config():
    try:
        init_process_groups(ParallelConfig(tp=3))
    except ValueError as error:
        # Nothing was created: the default group is the only one and still works.
        value = torch.ones(1)
        dist.all_reduce(value)
        return str(error), value.item()
    return None


@pytest.mark.multirank
def test_bad_config_fails_before_any_group_is_created():
    results = run_on_ranks(_init_with_bad_config, world_size=2)
    for message, total in results:
        assert "world_size=2 is not divisible by tp*cp*pp" in message
        assert total == 2.0


def test_single_process_bundle():
    groups = ProcessGroups.single()
    for name in GROUP_NAMES:
        assert groups.group(name) is None
        assert groups.size(name) == 1
        assert groups.rank(name) == 0
    assert groups.tp is None and group_size(groups.tp) == 1 and group_rank(None) == 0
    assert groups.is_first_pp_stage and groups.is_last_pp_stage
    with pytest.raises(ValueError, match="unknown group name 'tensor'"):
        groups.group("tensor")
