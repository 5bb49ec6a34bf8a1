"""Async save: same files as a sync save, the state may change right after `save` returns,
a training-style loop with async saves, and background failures raised at finalize."""

import dataclasses
import json
import os
import time

import pytest
import torch

from shardwork.dist_checkpoint import (
    AsyncSave,
    CheckpointManager,
    CheckpointSaveError,
    StagingBuffers,
    is_committed,
    load,
    save,
)
from shardwork.dist_checkpoint.faults import FAULT_ENV
from shardwork.dist_checkpoint.inflight import IN_FLIGHT_MARKER
from shardwork.dist_checkpoint.testing import example_global, example_state

pytest.importorskip("shardwork.parallel_state")
from shardwork.parallel_state.testing import run_on_ranks


def _rank_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _files(path):
    with open(os.path.join(path, "shardwork.json")) as f:
        files = json.load(f)["files"]
    return {name: rec for name, rec in files.items() if name.endswith(".distcp")}


def _check(out, seed, rank, world):
    ref = example_global(seed)
    rows = 8 // world
    numel = ref["moment"].numel()
    start, stop = numel * rank // world, numel * (rank + 1) // world
    return (
        torch.equal(out["model"]["matrix"], ref["matrix"][rank * rows : (rank + 1) * rows])
        and torch.equal(out["model"]["replicated"], ref["replicated"])
        and torch.equal(out["optimizer"]["moment"], ref["moment"].flatten()[start:stop])
        and out["optimizer"]["step"] == seed
        and out["rng"] == {"rank": rank, "seed": seed}
    )


def _check_phase_timings(timings, *, asynchronous, save_call, finalize_call, total):
    """Phases are non-negative, disjoint sub-intervals of what the caller measured around
    the calls (``save_call``: around `save`; ``finalize_call``: around `finalize`; ``total``:
    from `save` to the end of `finalize`), so they cannot add up to more."""
    assert set(timings) == {"plan", "stage", "write", "finalize", "blocking"}
    assert all(v >= 0.0 for v in timings.values()), timings
    assert timings["blocking"] <= save_call
    if asynchronous:
        assert timings["plan"] + timings["stage"] <= timings["blocking"]
        assert timings["finalize"] <= finalize_call
    else:
        assert timings["stage"] == 0.0
        assert timings["plan"] + timings["write"] + timings["finalize"] <= timings["blocking"]
    assert sum(timings[k] for k in ("plan", "stage", "write", "finalize")) <= total


def _sync_vs_async(root):
    rank, world = _rank_world()
    state = example_state(rank, world, seed=3)
    sync_path, async_path = os.path.join(root, "sync"), os.path.join(root, "async")
    t0 = time.perf_counter()
    sync_result = save(state, sync_path)
    sync_call = time.perf_counter() - t0
    _check_phase_timings(
        sync_result.timings,
        asynchronous=False,
        save_call=sync_call,
        finalize_call=0.0,
        total=sync_call,
    )
    t0 = time.perf_counter()
    handle = save(state, async_path, async_save=True)
    save_call = time.perf_counter() - t0
    assert isinstance(handle, AsyncSave)
    # the caller owns the state again as soon as save() returns: scribble over it
    for leaf in (
        state["model"]["matrix"],
        state["model"]["replicated"],
        state["optimizer"]["moment"],
    ):
        leaf.data.add_(1000.0)
    t1 = time.perf_counter()
    result = handle.finalize()
    finalize_call = time.perf_counter() - t1
    _check_phase_timings(
        result.timings,
        asynchronous=True,
        save_call=save_call,
        finalize_call=finalize_call,
        total=time.perf_counter() - t0,
    )
    out = load(example_state(rank, world, seed=3, fill=False), async_path)
    return _check(out, 3, rank, world), sync_result.timings, result.timings


@pytest.mark.multirank
def test_async_save_writes_the_same_files_as_sync(tmp_path):
    results = run_on_ranks(_sync_vs_async, 2, args=(str(tmp_path),))
    assert [ok for ok, _, _ in results] == [True, True]
    sync_files, async_files = _files(tmp_path / "sync"), _files(tmp_path / "async")
    assert sync_files == async_files and len(sync_files) == 2
    # shardwork.json records, per phase, the slowest rank's time
    for name, which in (("sync", 1), ("async", 2)):
        with open(tmp_path / name / "shardwork.json") as f:
            recorded = json.load(f)["timings"]
        for phase in ("plan", "stage", "write"):
            assert recorded[phase] == max(r[which][phase] for r in results)


def _training_loop(root):
    rank, world = _rank_world()
    manager = CheckpointManager(root, async_save=True, keep_last=2)
    state = example_state(rank, world, seed=0)
    for step in range(1, 6):
        # "train": the state at step s is example_state(seed=s)
        fresh = example_state(rank, world, seed=step)
        for section, name in (
            ("model", "matrix"),
            ("model", "replicated"),
            ("optimizer", "moment"),
        ):
            state[section][name].data.copy_(fresh[section][name].data)
        state["optimizer"]["step"] = step
        state["rng"] = fresh["rng"]
        manager.save(step, state)
        # a non-blocking poll from the loop never raises and may or may not commit
        manager.finalize(blocking=False)
    manager.close()
    ok = []
    for step in manager.list():
        out = manager.load(example_state(rank, world, seed=step, fill=False), step=step)
        ok.append(_check(out, step, rank, world))
    # granular, verified load of the latest across ranks: model only
    template = {"model": example_state(rank, world, seed=0, fill=False)["model"]}
    out = manager.load(template, include=("model",), verify_files=True)
    ref = example_global(5)["matrix"].chunk(world)[rank]
    ok.append(torch.equal(out["model"]["matrix"], ref))
    return manager.list(), manager.latest(), ok, sorted(manager.last_timings)


@pytest.mark.multirank
def test_training_loop_with_async_saves_and_retention(tmp_path):
    results = run_on_ranks(_training_loop, 2, args=(str(tmp_path),))
    for steps, latest, ok, timings in results:
        assert steps == [4, 5] and latest == 5 and ok == [True, True, True]
        assert timings == ["blocking", "finalize", "plan", "stage", "write"]
    assert sorted(os.listdir(tmp_path)) == ["step_000000004", "step_000000005"]


def _background_failure(root):
    rank, world = _rank_world()
    manager = CheckpointManager(root, async_save=True)
    manager.save(1, example_state(rank, world, seed=1))
    manager.finalize()
    os.environ[FAULT_ENV] = "mid_file@1:raise"
    try:
        manager.save(2, example_state(rank, world, seed=2))  # returns: the failure is later
        manager.finalize()
    except CheckpointSaveError as exc:
        message = str(exc)
    else:
        message = None
    finally:
        del os.environ[FAULT_ENV]
    after = (manager.latest(), [p.name for p in manager.incomplete()])
    # the next save cleans interrupted saves on rank 0: every rank looks before that
    torch.distributed.barrier()
    manager.save(3, example_state(rank, world, seed=3))
    manager.close()
    return message, after, manager.list(), manager.incomplete()


@pytest.mark.multirank
def test_background_failure_surfaces_at_finalize(tmp_path):
    results = run_on_ranks(_background_failure, 2, args=(str(tmp_path),))
    for message, after, steps, incomplete in results:
        assert message is not None and "injected fault at 'mid_file' on rank 1" in message
        assert after == (1, ["step_000000002"])
        assert steps == [1, 3] and incomplete == []


def _staging_failure(root):
    """Rank 1's state holds an object that cannot be pickled: its staging fails."""
    rank, world = _rank_world()
    state = example_state(rank, world, seed=1)
    if rank == 1:
        state["rng"] = dataclasses.replace(state["rng"], data={"unpicklable": lambda: None})
    try:
        save(state, os.path.join(root, "bad"), async_save=True)
    except Exception as exc:
        outcome = (type(exc).__name__, str(exc))
    else:
        outcome = None
    # the group stays usable: the next async save of good state commits
    handle = save(example_state(rank, world, seed=2), os.path.join(root, "good"), async_save=True)
    handle.finalize()
    return outcome, is_committed(os.path.join(root, "bad")), is_committed(handle.path)


@pytest.mark.multirank
def test_staging_failure_on_one_rank_raises_on_every_rank(tmp_path):
    results = run_on_ranks(_staging_failure, 2, args=(str(tmp_path),), timeout=60)
    (kind0, message0), bad0, good0 = results[0]
    assert kind0 == "CheckpointSaveError" and "staging failed on rank(s) [1]" in message0
    assert results[1][0] is not None and results[1][0][0] != "CheckpointSaveError"
    assert not bad0 and good0 and results[1][1:] == (False, True)


def _refused(fn):
    try:
        fn()
    except ValueError as exc:
        return str(exc)
    return None


def _second_save_waits_for_the_first(root):
    rank, world = _rank_world()
    buffers = StagingBuffers()
    a, b = os.path.join(root, "ckpts", "a"), os.path.join(root, "ckpts", "b")
    elsewhere = os.path.join(root, "elsewhere", "c")
    first = save(example_state(rank, world, seed=1), a, async_save=True, staging_buffers=buffers)
    in_flight = os.path.exists(os.path.join(a, IN_FLIGHT_MARKER)) if rank == 0 else None
    # without previous=, a save into the same root is refused (sync or async), and so is a
    # save elsewhere that would restage into the buffers the first write still reads
    refusals = [
        _refused(lambda: save(example_state(rank, world, seed=2), b, async_save=True)),
        _refused(lambda: save(example_state(rank, world, seed=2), b)),
        _refused(
            lambda: save(
                example_state(rank, world, seed=2),
                elsewhere,
                async_save=True,
                staging_buffers=buffers,
            )
        ),
    ]
    untouched = not os.path.exists(b) and not os.path.exists(elsewhere)
    # with previous=, the second save finalizes (commits) the first before it plans
    second = save(
        example_state(rank, world, seed=2),
        b,
        async_save=True,
        staging_buffers=buffers,
        previous=first,
    )
    first_committed_before_second_returned = is_committed(a) and first.finalized
    first_result = first.finalize()  # idempotent: no second commit, no collective
    second.finalize()
    no_marker_left = not any(os.path.exists(os.path.join(d, IN_FLIGHT_MARKER)) for d in (a, b))
    # a marker left by a process that died does not block anything
    stale = os.path.join(root, "ckpts", "stale")
    if rank == 0:
        os.makedirs(stale)
        with open(os.path.join(stale, IN_FLIGHT_MARKER), "w") as f:
            json.dump({"host": "gone", "pid": 1, "start": "0"}, f)
    torch.distributed.barrier()
    save(example_state(rank, world, seed=4), os.path.join(root, "ckpts", "d"))
    ok = [
        _check(load(example_state(rank, world, seed=s, fill=False), p), s, rank, world)
        for s, p in ((1, a), (2, b), (4, os.path.join(root, "ckpts", "d")))
    ]
    return (
        in_flight,
        refusals,
        untouched,
        first_committed_before_second_returned,
        first_result.path.name,
        no_marker_left,
        ok,
    )


@pytest.mark.multirank
def test_a_second_save_waits_for_the_first_or_is_refused(tmp_path):
    results = run_on_ranks(_second_save_waits_for_the_first, 2, args=(str(tmp_path),))
    assert results[0][0] is True  # rank 0 marked the first save in flight
    for _, refusals, untouched, committed_first, name, no_marker, ok in results:
        same_root, sync_same_root, held_buffers = refusals
        for text in (same_root, sync_same_root):
            assert text is not None and "ckpts/a' in the same root is not finalized" in text
            assert "previous=" in text
        assert held_buffers is not None and "staging_buffers are held" in held_buffers
        assert untouched and committed_first and name == "a" and no_marker
        assert ok == [True, True, True]
