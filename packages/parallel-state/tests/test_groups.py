"""init_process_groups on real gloo ranks: each group reduces over exactly its members."""

import os
from datetime import timedelta

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
from shardwork.parallel_state.groups import _GLOO_TWINNED, _create_groups, _world_is_gloo_only
from shardwork.parallel_state.testing import run_on_ranks


def _twin_report(twins, handles):
    """Per twinned name: is it the world's own group, its backend, its ranks, its sum of rank+1."""
    report = {}
    for name in _GLOO_TWINNED:
        twin = twins[name]
        value = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
        dist.all_reduce(value, group=twin)
        report[name] = (
            twin is handles[name],
            dist.get_backend(twin),
            dist.get_process_group_ranks(twin),
            value.item(),
        )
    return report


def _member_sums(config_kwargs, ranks=None):
    config = ParallelConfig(**config_kwargs)
    if ranks is not None and dist.get_rank() not in ranks:
        return None
    groups = init_process_groups(config, ranks=ranks, gloo_twins=True)
    out = {}
    for name in GROUP_NAMES:
        if name not in groups.members:  # a middle pipeline stage has no embedding group
            for ask in (groups.group, groups.size, groups.rank):
                with pytest.raises(ValueError, match=f"belongs to no '{name}' group"):
                    ask(name)
            with pytest.raises(AttributeError, match=f"belongs to no '{name}' group"):
                getattr(groups, name)
            out[name] = None
            continue
        value = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
        dist.all_reduce(value, group=groups.group(name))
        out[name] = (
            value.item(),
            groups.members[name],
            groups.rank(name),
            group_rank(groups.group(name)),
        )
    # On a gloo world the twins are the world's groups; an NCCL world gets separate gloo
    # groups from _create_groups(backend="gloo"), asked for explicitly here.
    out["twins"] = _twin_report(groups.gloo, groups.handles)
    global_ranks = ranks if ranks is not None else list(range(dist.get_world_size()))
    layout = RankLayout.build(config, len(global_ranks))
    separate = _create_groups(
        layout, _GLOO_TWINNED, global_ranks, dist.get_rank(), backend="gloo", timeout=None
    )
    out["separate twins"] = _twin_report(separate, groups.handles)
    return out


def _check_twins(out, layout, global_ranks, local_rank):
    for name in _GLOO_TWINNED:
        members = [global_ranks[r] for r in layout.group_of(name, local_rank)]
        expected = ("gloo", members, float(sum(r + 1 for r in members)))
        assert out["twins"][name] == (True, *expected), name
        assert out["separate twins"][name] == (False, *expected), name


@pytest.mark.multirank
@pytest.mark.parametrize(
    "config_kwargs",
    [
        dict(tp=2, pp=2, ep=2, etp=1),
        dict(tp=2, cp=2, ep=4, etp=2),
        dict(pp=2, cp=2, ep=2, order="tp-ep-cp-dp-pp"),
        dict(tp=2, pp=4),
    ],
    ids=["tp2pp2ep2etp1", "tp2cp2ep4etp2", "pp2cp2ep2-order", "tp2pp4"],
)
def test_each_group_all_reduce_sums_exactly_its_members(config_kwargs):
    results = run_on_ranks(_member_sums, world_size=8, args=(config_kwargs,))
    layout = RankLayout.build(ParallelConfig(**config_kwargs), 8)
    for rank, out in enumerate(results):
        for name in GROUP_NAMES:
            if not any(rank in group for group in layout.groups[name]):
                assert out[name] is None, (name, rank)  # pp=4: stages 1 and 2 hold no embedding
                continue
            members = layout.group_of(name, rank)
            total, seen_members, index, torch_index = out[name]
            assert total == sum(r + 1 for r in members), (name, rank)
            assert list(seen_members) == members
            assert index == torch_index == members.index(rank)
        _check_twins(out, layout, list(range(8)), rank)


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
        _check_twins(out, layout, ranks, local)


def _init_with_bad_arguments():
    messages = []
    for kwargs in (
        dict(config=ParallelConfig(tp=3)),
        dict(config=ParallelConfig(), world_size=3),
        dict(config=ParallelConfig(), rank=1 - dist.get_rank()),
        dict(config=ParallelConfig(), ranks=[0, 1, 2]),
    ):
        try:
            init_process_groups(**kwargs)
        except ValueError as error:
            messages.append(str(error))
    # Nothing was created: the default group is the only one and still works.
    value = torch.ones(1)
    dist.all_reduce(value)
    return messages, value.item()


@pytest.mark.multirank
def test_bad_arguments_fail_before_any_group_is_created():
    results = run_on_ranks(_init_with_bad_arguments, world_size=2)
    for rank, (messages, total) in enumerate(results):
        assert len(messages) == 4
        assert "world_size=2 is not divisible by tp*cp*pp" in messages[0]
        assert "world_size=3 disagrees with the initialised torch.distributed world" in messages[1]
        assert f"rank={1 - rank} disagrees with the initialised" in messages[2]
        assert "[2] are not global ranks of a world of 2" in messages[3]
        assert total == 2.0


_RENDEZVOUS_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _tp_and_dp_sums(groups):
    sums = []
    for group in (groups.tp, groups.dp):
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value, group=group)
        sums.append(value.item())
    return sums


def _init_uninitialised_from_file_store(store_dir):
    """Leave the pool's default group, then let init_process_groups initialise torch.distributed.

    After ``destroy_process_group`` this pooled process is in the state of a fresh one
    (torch.distributed not initialised); the rendezvous environment variables are removed too.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    saved = {name: os.environ.pop(name) for name in _RENDEZVOUS_ENV if name in os.environ}
    out = {}
    try:
        store = dist.FileStore(os.path.join(store_dir, "arguments"), world)
        config = ParallelConfig(tp=world)
        for kwargs, missing in ((dict(world_size=world), "rank"), (dict(rank=rank), "world_size")):
            try:
                init_process_groups(config, store=store, **kwargs)
            except ValueError as error:
                out[f"missing {missing}"] = (str(error), dist.is_initialized())
        # rank= and world_size= with a custom store; an explicit backend and timeout.
        groups = init_process_groups(
            config,
            backend="cpu:gloo",
            timeout=timedelta(seconds=60),
            store=store,
            rank=rank,
            world_size=world,
        )
        out["arguments"] = (dist.get_backend(), dist.get_world_size(), _tp_and_dp_sums(groups))
        dist.destroy_process_group()
        # The environment variables as the fallback; default backend (gloo on CPU).
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
        store = dist.FileStore(os.path.join(store_dir, "environment"), world)
        groups = init_process_groups(config, store=store)
        out["environment"] = (dist.get_backend(), dist.get_world_size(), _tp_and_dp_sums(groups))
    finally:
        for name in _RENDEZVOUS_ENV:
            os.environ.pop(name, None)
        os.environ.update(saved)
    return out


@pytest.mark.multirank
def test_initialises_torch_distributed_from_a_store_without_environment(tmp_path):
    results = run_on_ranks(_init_uninitialised_from_file_store, world_size=2, args=(str(tmp_path),))
    for rank, out in enumerate(results):
        for missing in ("rank", "world_size"):
            message, initialised = out[f"missing {missing}"]
            assert f"init_process_groups: {missing} is unknown" in message
            assert f"pass {missing}=" in message
            assert not initialised
        # tp spans both ranks (1 + 2); dp holds only this rank.
        assert out["arguments"] == ("cpu:gloo", 2, [3.0, float(rank + 1)])
        assert out["environment"] == ("gloo", 2, [3.0, float(rank + 1)])


@pytest.mark.parametrize(
    ("world_backend", "gloo_only"),
    [
        ("gloo", True),
        ("cpu:gloo", True),
        ("nccl", False),
        ("cuda:nccl", False),
        ("cpu:gloo,cuda:nccl", False),
        ("mpi", False),
    ],
)
def test_twins_reuse_the_world_groups_only_when_every_device_uses_gloo(world_backend, gloo_only):
    assert _world_is_gloo_only(world_backend) is gloo_only


def _nccl_world_twins(store_dir):
    """Leave the pool's gloo world, start an NCCL world (one GPU per rank) with gloo twins."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    torch.cuda.set_device(rank)
    store = dist.FileStore(os.path.join(store_dir, "nccl"), world)
    config = ParallelConfig(tp=2) if world % 2 == 0 else ParallelConfig()
    groups = init_process_groups(
        config, backend="nccl", store=store, rank=rank, world_size=world, gloo_twins=True
    )
    value = torch.tensor([float(rank + 1)], device="cuda")
    dist.all_reduce(value, group=groups.dp)
    return dist.get_backend(), value.item(), _twin_report(groups.gloo, groups.handles)


@pytest.mark.gpu
@pytest.mark.multirank
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (an NCCL world)")
def test_nccl_world_gets_separate_gloo_twins(tmp_path):
    world = min(torch.cuda.device_count(), 8)
    results = run_on_ranks(_nccl_world_twins, world_size=world, args=(str(tmp_path),))
    config = ParallelConfig(tp=2) if world % 2 == 0 else ParallelConfig()
    layout = RankLayout.build(config, world)
    for rank, (backend, dp_sum, twins) in enumerate(results):
        assert backend == "nccl"
        assert dp_sum == sum(r + 1 for r in layout.group_of("dp", rank))
        for name in _GLOO_TWINNED:
            members = layout.group_of(name, rank)
            assert twins[name] == (False, "gloo", members, float(sum(r + 1 for r in members)))


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
