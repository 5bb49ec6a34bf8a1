"""The background write of an async save communicates only on its dedicated gloo group.

Every torch.distributed collective is wrapped (in the ``torch.distributed`` namespace, where
DCP and shardwork call them, and in ``distributed_c10d``, where the object collectives call
the tensor ones) to record the thread it ran on and the group it was given. While an async
save writes, the training thread keeps issuing its own collectives on the training group, as
a training loop would.
"""

import datetime
import inspect
import os
import threading

import pytest
import torch

from shardwork.dist_checkpoint import CheckpointManager, save
from shardwork.dist_checkpoint.testing import example_state

pytest.importorskip("shardwork.parallel_state")
from shardwork.parallel_state.testing import run_on_ranks

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)


class CollectiveSpy:
    """Records ``(on the main thread, thread name, function, group, backend, ranks)`` of
    every collective call (backend and ranks looked up at the call: groups a save creates
    are destroyed by its finalize)."""

    def __init__(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.records = []
        self._lock = threading.Lock()
        self._patched = []
        for module in (dist, c10d):
            for name in COLLECTIVES:
                original = getattr(module, name, None)
                if original is not None:
                    self._patched.append((module, name, original))
                    setattr(module, name, self._wrap(original))

    def _wrap(self, original):
        signature = inspect.signature(original)

        def spy(*args, **kwargs):
            import torch.distributed as dist

            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            thread = threading.current_thread()
            backend = dist.get_backend(group)
            ranks = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
            with self._lock:
                self.records.append(
                    (
                        thread is threading.main_thread(),
                        thread.name,
                        original.__name__,
                        group,
                        backend,
                        ranks,
                    )
                )
            return original(*args, **kwargs)

        return spy

    def restore(self):
        for module, name, original in self._patched:
            setattr(module, name, original)


def _classify(records, training_group):
    """Summary of the calls made off the main thread, by group."""
    import torch.distributed as dist

    world = dist.group.WORLD
    off_main = [r for r in records if not r[0]]
    groups = {id(r[3]): r[3] for r in off_main}
    return {
        "off_main_calls": len(off_main),
        "off_main_names": sorted({r[2] for r in off_main}),
        "off_main_threads": sorted({r[1] for r in off_main}),
        "off_main_groups": len(groups),
        "on_training_group": sum(
            1 for r in off_main if r[3] is None or r[3] is world or r[3] is training_group
        ),
        "background_backends": sorted({r[4] for r in off_main}),
        "background_ranks": sorted({r[5] for r in off_main}),
        "main_calls_on_training_group": sum(
            1 for r in records if r[0] and (r[3] is None or r[3] is training_group)
        ),
    }


def _train_while_writing(handle, group):
    """Training-thread collectives while the background write may still run."""
    import torch.distributed as dist

    total = torch.zeros(())
    for step in range(5):
        t = torch.full((64,), float(step + dist.get_rank()))
        dist.all_reduce(t, group=group)
        total += t.sum()
    handle.finalize()
    return total.item()


def _spy_async_saves(root):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    training = dist.new_group(list(range(world)))
    spy = CollectiveSpy()
    try:
        # a plain save on the default group, background group created by save itself
        handle = save(
            example_state(rank, world, seed=1), os.path.join(root, "plain"), async_save=True
        )
        _train_while_writing(handle, None)
        plain = _classify(spy.records, None)
        spy.records.clear()
        # the manager on an explicit training group, two saves (the second waits for the first)
        manager = CheckpointManager(os.path.join(root, "managed"), group=training, async_save=True)
        manager.save(1, example_state(rank, world, seed=1))
        manager.save(2, example_state(rank, world, seed=2))
        _train_while_writing(manager._pending, training)
        manager.close()
        managed = _classify(spy.records, training)
    finally:
        spy.restore()
    return plain, managed


@pytest.mark.multirank
def test_background_collectives_use_only_the_dedicated_gloo_group(tmp_path):
    results = run_on_ranks(_spy_async_saves, 2, args=(str(tmp_path),), timeout=60)
    for plain, managed in results:
        for summary in (plain, managed):
            # the background write did communicate, on its own thread, and only on one
            # gloo group over the same ranks that is neither the world nor the training group
            assert summary["off_main_calls"] > 0
            assert summary["off_main_threads"] == ["shardwork-ckpt-writer"]
            assert summary["on_training_group"] == 0
            assert summary["off_main_groups"] == 1
            assert summary["background_backends"] == ["gloo"]
            assert summary["background_ranks"] == [(0, 1)]
            assert summary["main_calls_on_training_group"] >= 5
        assert "gather_object" in plain["off_main_names"]


def _wait_alone_on_the_background_group(root):
    """Rank 0 waits alone at a barrier of the manager's background group (rank 1 never
    comes): with ``async_timeout`` it must fail after that long, not torch's 30 minutes."""
    import torch.distributed as dist

    created = []
    new_group = dist.new_group

    def capture(*args, **kwargs):
        created.append(new_group(*args, **kwargs))
        return created[-1]

    dist.new_group = capture
    try:
        manager = CheckpointManager(
            root, async_save=True, async_timeout=datetime.timedelta(seconds=2)
        )
        manager.save(1, example_state(dist.get_rank(), 2, seed=1))
        manager.finalize()
    finally:
        dist.new_group = new_group
    outcome = None
    if dist.get_rank() == 0:
        try:
            dist.barrier(group=created[0])
            outcome = "returned"
        except RuntimeError as err:
            outcome = f"{type(err).__name__}: {err}"
    dist.barrier()
    manager.close()
    return len(created), outcome


@pytest.mark.multirank
def test_async_timeout_bounds_the_background_group(tmp_path):
    """Without the timeout reaching ``new_group`` rank 0 would wait 30 minutes, and
    ``run_on_ranks`` fails the test after 60 s."""
    results = run_on_ranks(
        _wait_alone_on_the_background_group, 2, args=(str(tmp_path),), timeout=60
    )
    (groups, outcome), (_, nothing) = results
    assert groups == 1
    assert nothing is None
    assert outcome is not None and "timed out" in outcome.lower(), outcome


def test_async_timeout_is_validated(tmp_path):
    for bad in (30, datetime.timedelta(0), "10m"):
        with pytest.raises(ValueError, match=r"async_timeout=.*positive datetime\.timedelta"):
            CheckpointManager(tmp_path, async_timeout=bad)
