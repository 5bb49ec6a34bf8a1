"""Save planning gathers the summaries on the first rank and scatters each rank its writes.

- The bytes a non-first rank receives while planning stay the same when the number of ranks
  (and so of all ranks' pieces) doubles; the first rank receives every rank's summary.
- A 4-rank save writes the same checkpoint as the all-gather planning did: the decoded
  ``.metadata`` and the sha256 of every data file equal the record in
  ``fixtures/save_gather_digest.json``, taken with the code before the change
  (``python tests/test_plan_gather.py <dir>`` prints it, run from the package directory).
"""

import hashlib
import importlib
import json
import pickle
import sys
from pathlib import Path

import pytest
import torch

from shardwork.dist_checkpoint import ShardedTensor, save
from shardwork.dist_checkpoint.plan import collect_local, summarize
from shardwork.dist_checkpoint.testing import example_state

pytest.importorskip("shardwork.parallel_state")
from shardwork.parallel_state.testing import run_on_ranks

FIXTURE = Path(__file__).parent / "fixtures" / "save_gather_digest.json"
PIECES = 6


def digest(path: str) -> dict:
    """The decoded DCP metadata and the sha256 of each data file of the checkpoint ``path``."""
    root = Path(path)
    with open(root / ".metadata", "rb") as f:
        meta = pickle.load(f)
    keys = {}
    for key, m in sorted(meta.state_dict_metadata.items()):
        if hasattr(m, "chunks"):
            chunks = sorted((list(c.offsets), list(c.sizes)) for c in m.chunks)
            keys[key] = {"dtype": str(m.properties.dtype), "size": list(m.size), "chunks": chunks}
        else:
            keys[key] = {"bytes": True}
    storage = []
    for idx, s in meta.storage_data.items():
        offset = list(idx.offset) if idx.offset is not None else None
        storage.append([idx.fqn, offset, s.relative_path, s.offset, s.length])
    storage.sort()
    files = {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.glob("*.distcp"))
    }
    return {"keys": keys, "storage": storage, "files": files}


def _rank_world():
    import torch.distributed as dist

    return dist.get_rank(), dist.get_world_size()


def _save_example(path):
    rank, world = _rank_world()
    save(example_state(rank, world, seed=3), path, layout={"dp": world})
    return digest(path) if rank == 0 else None


@pytest.mark.multirank
def test_save_writes_the_checkpoint_the_all_gather_planning_wrote(tmp_path):
    got = run_on_ranks(_save_example, 4, args=(str(tmp_path / "ckpt"),))[0]
    assert json.loads(json.dumps(got)) == json.loads(FIXTURE.read_text())


def _row_state(rank, world):
    """``PIECES`` tensors of shape (world, 3); this rank holds row ``rank`` of each, so its
    writes are the same ``PIECES`` rectangles at any world size."""
    gen = torch.Generator().manual_seed(rank)
    return {
        f"t{i}": ShardedTensor(f"t{i}", torch.randn(1, 3, generator=gen), (world, 3), (rank, 0))
        for i in range(PIECES)
    }


def _received_while_planning(path):
    """Save, counting the pickled bytes each planning collective handed this rank."""
    # the package exports the function `save` under the module's name
    save_module = importlib.import_module("shardwork.dist_checkpoint.save")
    rank, world = _rank_world()
    received = []
    real_gather, real_scatter = save_module.gather_object, save_module.scatter_object

    def gather(obj, g):
        out = real_gather(obj, g)
        received.append(0 if out is None else len(pickle.dumps(out)))
        return out

    def scatter(objs, g):
        out = real_scatter(objs, g)
        received.append(len(pickle.dumps(out)))
        return out

    save_module.gather_object, save_module.scatter_object = gather, scatter
    try:
        state = _row_state(rank, world)
        save(state, path)
    finally:
        # the rank processes are pooled: later tests get the real helpers back
        save_module.gather_object, save_module.scatter_object = real_gather, real_scatter
    return received, len(pickle.dumps(summarize(collect_local(state))))


@pytest.mark.multirank
def test_non_first_ranks_receive_only_their_writes(tmp_path):
    at2 = run_on_ranks(_received_while_planning, 2, args=(str(tmp_path / "w2"),))
    at4 = run_on_ranks(_received_while_planning, 4, args=(str(tmp_path / "w4"),))
    # Rank 1 holds and writes the same PIECES rectangles at 2 and at 4 ranks: what it receives
    # (nothing from the gather, its assignment from the scatter) is byte for byte the same.
    assert at2[1][0][0] == 0 and at4[1][0][0] == 0
    assert at4[1][0] == at2[1][0]
    for received, own_summary in at4[1:]:
        assert sum(received) < own_summary
    # The first rank receives every rank's summary: it grows with the ranks, as the all-gather
    # did on every rank.
    assert at4[0][0][0] > 2 * at2[0][0][0] - at2[0][1]


if __name__ == "__main__":
    print(json.dumps(digest(sys.argv[1]), indent=1))


def _save_with_broken_planner(path):
    """Save while the first rank's planner fails with a non-user error; what each rank raised."""
    save_module = importlib.import_module("shardwork.dist_checkpoint.save")
    rank, world = _rank_world()
    real = save_module.build_rank_plans

    def broken(summaries):
        raise RuntimeError(f"planner broke on {len(summaries)} summaries")

    save_module.build_rank_plans = broken
    try:
        save(_row_state(rank, world), path)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        save_module.build_rank_plans = real
    return None


@pytest.mark.multirank
def test_first_rank_planning_failure_reaches_every_rank(tmp_path):
    path = tmp_path / "ckpt"
    raised = run_on_ranks(_save_with_broken_planner, 3, args=(str(path),))
    assert raised[0] == ("RuntimeError", "planner broke on 3 summaries")
    for name, text in raised[1:]:
        assert name == "CheckpointSaveError"
        assert "RuntimeError: planner broke on 3 summaries" in text
    assert not path.exists()
