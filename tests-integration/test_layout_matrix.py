"""Layout-equivalence matrix: every parallel layout trains the same model as one process.

Each row of :data:`CELLS` is (name, world size, ``parallel`` section, model kind). A cell
trains the tiny dense GPT or the tiny Mixtral-style MoE (8 experts, top-2, dropless, no aux
loss, no router jitter, no dropout) through ``shardwork.trainer`` on that many pooled gloo
ranks and compares every rank's per-step loss curve, and the final validation loss, with the
world-1 run of the same config. Select cells with ``-k``, e.g. ``-k 'moe and ep2'``.

Precision: the trainer's ``precision.dtype`` offers fp32/bf16/fp16 only (the optimizer keeps
fp32 master weights), so float64 training cannot be requested through it; the cells run in
fp32 and compare at ``RTOL`` (the measured worst cell differs by a few 1e-6 relative).
Cells that need 8 ranks, and the costlier ones, are marked ``slow``.
"""

from __future__ import annotations

import io

import pytest
import torch.distributed as dist

from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

STEPS = 6
RTOL = 5e-5
"""Relative tolerance of fp32 loss curves (sums over 256 tokens reduced in different orders)."""

MODELS = {
    # 4 layers so pp=2 x vpp=2 has one layer per virtual stage
    "dense": {"num_layers": 4},
    "moe": {"preset": "tiny-mixtral-8x7b", "num_layers": 4},
}

CELL_TIMEOUT = 240
"""Seconds before a cell's ranks are killed (the slowest passing cell, 8 ranks, takes ~60 s on a
loaded 2-core machine; a hung collective must not hold CI for long)."""

SLOW = pytest.mark.slow

# (name, world, parallel section, model kind, marks)
CELLS = [
    ("dp2", 2, {}, "dense", ()),
    ("tp2-sp", 2, {"tp": 2, "sequence_parallel": True}, "dense", ()),
    ("pp2", 2, {"pp": 2}, "dense", ()),
    ("pp2-vpp2", 2, {"pp": 2, "vpp": 2}, "dense", ()),
    ("cp2", 2, {"cp": 2}, "dense", ()),
    ("tp2-pp2-dp2", 8, {"tp": 2, "pp": 2}, "dense", (SLOW,)),
    ("dp2", 2, {}, "moe", ()),
    ("tp2-sp", 2, {"tp": 2, "sequence_parallel": True}, "moe", ()),
    ("pp2", 2, {"pp": 2}, "moe", ()),
    ("pp2-vpp2", 2, {"pp": 2, "vpp": 2}, "moe", ()),
    ("cp2", 2, {"cp": 2}, "moe", (SLOW,)),
    ("ep2", 2, {"ep": 2}, "moe", (SLOW,)),
    ("ep2-etp2", 4, {"ep": 2, "etp": 2}, "moe", (SLOW,)),
    ("tp2-pp2-dp2", 8, {"tp": 2, "pp": 2}, "moe", (SLOW,)),
    ("tp2-ep2-pp2", 4, {"tp": 2, "ep": 2, "etp": 1, "pp": 2}, "moe", (SLOW,)),
]


EVAL_SAMPLES = 8
"""Validation sequences per evaluation (eval.steps × micro_batch_size × dp, kept equal)."""


def _sections(kind: str, parallel: dict, world: int = 1) -> dict:
    dp = world // (parallel.get("tp", 1) * parallel.get("pp", 1) * parallel.get("cp", 1))
    return {
        "model": dict(MODELS[kind]),
        "parallel": parallel,
        "schedule": {"train_steps": STEPS, "warmup_steps": 2, "micro_batch_size": 2},
        "eval": {"interval": None, "steps": EVAL_SAMPLES // (2 * dp), "at_end": True},
    }


def _train(run_dir: str, sections: dict, cache: str):
    """Train with ``sections`` on this rank (or one process); return (train, valid) losses."""
    import os

    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    world = dist.get_world_size() if dist.is_initialized() else 1
    result = train(tiny_config(run_dir, world_size=world, **sections), stream=io.StringIO())
    return result.train_losses, result.valid_losses


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache):
    """World-1 curves, computed once per model kind on first use."""
    cache: dict[str, tuple] = {}

    def get(kind: str):
        if kind not in cache:
            run_dir = tmp_path_factory.mktemp(f"ref-{kind}")
            cache[kind] = _train(str(run_dir), _sections(kind, {}), corpus_cache)
        return cache[kind]

    return get


@pytest.mark.parametrize(
    ("world", "parallel", "kind"),
    [pytest.param(w, p, k, id=f"{k}-{n}", marks=m) for n, w, p, k, m in CELLS],
)
def test_layout_matches_world_one(tmp_path, corpus_cache, references, world, parallel, kind):
    ref_train, ref_valid = references(kind)
    assert sorted(ref_train) == list(range(STEPS))
    # the reference must move: a curve that equals itself because nothing trains proves nothing
    assert abs(ref_train[STEPS - 1] - ref_train[0]) > 1e-2
    results = run_on_ranks(
        _train,
        world,
        args=(str(tmp_path), _sections(kind, parallel, world), corpus_cache),
        timeout=CELL_TIMEOUT,
    )
    for rank, (train_losses, valid_losses) in enumerate(results):
        assert sorted(train_losses) == list(range(STEPS)), f"rank {rank}"
        for step in range(STEPS):
            assert train_losses[step] == pytest.approx(ref_train[step], rel=RTOL), (
                f"rank {rank} step {step}"
            )
        assert valid_losses[STEPS] == pytest.approx(ref_valid[STEPS], rel=RTOL), f"rank {rank}"
