"""Layout-equivalence matrix: every parallel layout trains the same model as one process.

- :data:`CELLS` is the matrix of issue 10: a tiny dense GPT (4 layers) and a tiny
  Mixtral-style MoE (4 layers, 8 experts, top-2) trained :data:`STEPS` steps through
  ``shardwork.trainer`` at DP=2 with ZeRO-1, TP=2+SP, PP=2 (1F1B), PP=2×VPP=2 (and, dense,
  with Llama 3's uneven virtual stages: 0 + 2 + 2 + 0 layers), CP=2, EP=2,
  EP=2×ETP=2, TP=2×PP=2×DP=2 and TP=2×EP=2×PP=2 (the EP cells are MoE only), plus the
  hybrid twins: Nemotron-H (Mamba-2, squared-ReLU MLP and RoPE-less attention from a layer
  pattern with an MTP depth) and Qwen3-Next (Gated DeltaNet and gated attention + MoE) at
  TP=2+SP, PP=2, TP=2×PP=2 and (Qwen3-Next) EP=2. Each cell is compared with the world-1
  run of the same config. Select cells with ``-k``, e.g. ``-k 'moe and ep2'``.
- float64 (``precision.dtype = "fp64"``: parameters, activations, gradients, ZeRO masters,
  AdamW moments; the MoE router follows the activation dtype) and every stochastic part off:
  dropout 0, no router input jitter, dropless routing (``test_matrix_models_are_deterministic``
  guards these premises). Layouts differ only in the order of reductions (~1e-16 relative
  per operation), so every curve must equal world 1 within :data:`RTOL` = 1e-9 over 20 steps
  (the measured worst cell differs by ~2e-15). One fp32 cell (:data:`FP32_CELL`, 3 steps)
  checks the everyday precision at rtol 1e-4.
- Per-rank statistics: every rank writes its own metrics file (``logging.per_rank``,
  interval 1), and each rank's record of every step — loss, gradient norm, and for the MoE
  per-layer expert load and load imbalance (routed-token counts reduced over the token groups
  of that step) — is compared with the world-1 record of the same step and the same
  micro-batches, as is the final validation loss.
- Statistics that are per rank by definition (:data:`STATS_CELLS`): MoE models with
  load-balancing losses (micro-batch, per-sequence or global), z-loss and token dropping
  (capacity factor 1) trained 20 steps at TP=2+SP, EP=2 and DP=2, each compared with a
  world-1 run that computes them over the cell's per-rank token groups (:class:`TokenGroups`):
  its routers drop tokens at the capacity of each rank's share (:func:`_capacity_per_rank`),
  and for the global loss its micro-batch holds the data-parallel ranks' micro-batches. The
  aux losses over TP×CP shares need no emulation: the router sums their token counts over
  the ranks that share a micro-batch. Dropping keeps the earliest tokens
  (``token_drop_policy = "position"``): with ``"probs"`` an expert's capacity boundary often
  falls between tokens of exactly equal probability (tokens with identical contexts; 4 such
  ties in the first step here), and which one ``torch.topk`` keeps depends on the rest of
  the column and on last-bit rounding, not on the tokens.
- One pool of rank processes runs the cells: ``run_on_ranks`` keeps its processes between
  calls and a cell of N ranks runs on the pool's first N (a fresh default process group of
  size N each time), so no cell starts a process. Each cell returns its ranks' pids and
  asserts they are those of the cells before it in this test process; where one differs
  (the pool replaced a process another test had killed) the old process must be dead and the
  new ones must run the next call too (:func:`_run_cell`). Under xdist every
  worker has its own pool: cells take a lock shared by the workers (one cell at a time), and
  ``xdist_group`` keeps them on one worker when pytest runs with ``--dist loadgroup``.
- FSDP cells (``parallel.fsdp``): DP=2 (dense), the ZeRO-2-like mode (MoE) and EP=2 (experts
  over a 1-rank edp) by default; DP=4, TP=2+SP×DP=2, PP=2×DP=2, PP=2×VPP=2×DP=2 (ZeRO-2-like),
  CP=2×DP=2, EP=2×DP=4 (experts sharded over edp=2) and Nemotron-H at DP=2 (its MTP depth a
  unit of its own) as slow.
- Cells with 8 ranks, the costlier 4-rank cells and the hybrids' TP cells are marked
  ``slow``; the default run covers the other 18 cells, the fp32 cell and the TP=2+SP
  per-rank-statistics cell.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch.distributed as dist

from shardwork.parallel_state.testing import run_on_ranks
from shardwork.trainer.data.corpus import corpus_digest

pytestmark = [pytest.mark.multirank, pytest.mark.xdist_group("layout-matrix")]

STEPS = 20
RTOL = 1e-9
"""Relative tolerance of float64 curves and statistics against world 1."""
KIND_RTOL = {"qwen3-next": 1e-7}
"""Kinds whose curves drift further where a layout reorders reductions (TP, EP): Qwen3-Next's
twin starts at the same ~1e-14 relative gradient difference as every kind (TP=2+SP, step 0),
but training amplifies it along the run (not isolated; the DeltaNet layers' per-chunk
triangular solves are the likely amplifier, the rest of the twin is the MoE kind's): at most
3.0e-9 over the 20 steps' statistics (measured: 2.92e-9 at TP=2+SP, 2.96e-9 at TP=2×PP=2, on
the gradient norm), so 1e-7 leaves ~30x headroom. The EP=2 cell (its dp=2 sums the non-expert
gradients of two half batches, and expert rows arrive rank by rank) starts at 2e-16 on the
gradient norm and grows about tenfold every two steps: 3.9e-10 at its worst step before issue
24's kernels, 1.5e-9 with them (a different trajectory of the same amplifier, the first steps
equally close), hence the same bound. PP cells, which split no reduction, stay within
RTOL."""

FP32_STEPS = 3
FP32_RTOL = 1e-4

MODELS = {
    # 4 layers so pp=2 x vpp=2 has one layer per virtual stage
    "dense": {"num_layers": 4},
    "moe": {"preset": "tiny-mixtral-8x7b", "num_layers": 4},
    # per-rank statistics on: micro-batch and per-sequence load-balancing losses, z-loss and
    # token dropping at capacity factor 1 (each expert keeps at most its balanced share);
    # 2 layers, as these cells run no pipeline
    "moe-aux": {
        "preset": "tiny-mixtral-8x7b",
        "num_layers": 2,
        "moe": {
            "router": {
                "load_balancing_type": ["aux_loss", "seq_aux_loss"],
                "aux_loss_coeff": [1e-2, 1e-2],
                "z_loss_coeff": 1e-3,
                "capacity_factor": 1.0,
                "token_drop_policy": "position",
            }
        },
    },
    # hybrids: Mamba-2 + squared-ReLU MLP + RoPE-less attention, one part per layer, with an
    # attention + MLP MTP depth from the pattern; and Gated DeltaNet / gated attention + MoE
    "nemotron-h": {
        "preset": "tiny-nemotron-h-8b",
        "hybrid_layer_pattern": "M-*-/*-",
        "mtp": {"num_layers": 1},
    },
    "qwen3-next": {"preset": "tiny-qwen3-next-80b-a3b"},
    # the global load-balancing loss (token counts over the data-parallel ranks and the
    # micro-batches so far), z-loss and token dropping
    "moe-gaux": {
        "preset": "tiny-mixtral-8x7b",
        "num_layers": 2,
        "moe": {
            "router": {
                "load_balancing_type": "global_aux_loss",
                "aux_loss_coeff": 1e-2,
                "z_loss_coeff": 1e-3,
                "capacity_factor": 1.0,
                "token_drop_policy": "position",
            }
        },
    },
}

CELL_TIMEOUT = 420
"""Seconds before a cell's ranks are killed: the slowest cell (8 ranks) takes ~20 s on a quiet
2-core machine and over 200 s at load average 20; a hung collective must not hold CI longer."""

SLOW = pytest.mark.slow

# (name, world, parallel section, model kind, marks)
CELLS = [
    ("dp2", 2, {}, "dense", ()),
    ("tp2-sp", 2, {"tp": 2, "sequence_parallel": True}, "dense", ()),
    ("pp2", 2, {"pp": 2}, "dense", ()),
    ("pp2-vpp2", 2, {"pp": 2, "vpp": 2}, "dense", ()),
    # Llama 3's split (Dubey et al. 2024, §3.3.2): the first chunk only embeds, the last only
    # projects and scores
    (
        "pp2-vpp2-virtual-ends",
        2,
        {"pp": 2, "vpp": 2, "first_virtual_stage_layers": 0, "last_virtual_stage_layers": 0},
        "dense",
        (),
    ),
    ("cp2", 2, {"cp": 2}, "dense", ()),
    ("tp2-pp2-dp2", 8, {"tp": 2, "pp": 2}, "dense", (SLOW,)),
    ("dp2", 2, {}, "moe", ()),
    ("tp2-sp", 2, {"tp": 2, "sequence_parallel": True}, "moe", ()),
    ("pp2", 2, {"pp": 2}, "moe", ()),
    ("pp2-vpp2", 2, {"pp": 2, "vpp": 2}, "moe", ()),
    ("cp2", 2, {"cp": 2}, "moe", ()),
    ("ep2", 2, {"ep": 2}, "moe", ()),
    ("ep2-etp2", 4, {"ep": 2, "etp": 2}, "moe", (SLOW,)),
    ("tp2-pp2-dp2", 8, {"tp": 2, "pp": 2}, "moe", (SLOW,)),
    ("tp2-ep2-pp2", 4, {"tp": 2, "ep": 2, "etp": 1, "pp": 2}, "moe", (SLOW,)),
    ("tp2-sp", 2, {"tp": 2, "sequence_parallel": True}, "nemotron-h", (SLOW,)),
    ("pp2", 2, {"pp": 2}, "nemotron-h", ()),
    ("tp2-pp2", 4, {"tp": 2, "pp": 2}, "nemotron-h", (SLOW,)),
    ("tp2-sp", 2, {"tp": 2, "sequence_parallel": True}, "qwen3-next", (SLOW,)),
    ("pp2", 2, {"pp": 2}, "qwen3-next", ()),
    ("ep2", 2, {"ep": 2}, "qwen3-next", ()),
    ("tp2-pp2", 4, {"tp": 2, "pp": 2}, "qwen3-next", (SLOW,)),
    # fully sharded data parallelism (parallel.fsdp, issue 23): torch's FSDP2 per layer over the
    # dp×cp group (experts over edp), composed with each other axis
    ("fsdp-dp2", 2, {"fsdp": "full"}, "dense", ()),
    ("fsdp-zero2-dp2", 2, {"fsdp": "zero2"}, "moe", ()),
    ("fsdp-ep2", 2, {"fsdp": "full", "ep": 2}, "moe", ()),
    ("fsdp-dp2", 2, {"fsdp": "full"}, "nemotron-h", (SLOW,)),
    ("fsdp-dp4", 4, {"fsdp": "full"}, "dense", (SLOW,)),
    ("fsdp-tp2-sp-dp2", 4, {"fsdp": "full", "tp": 2, "sequence_parallel": True}, "dense", (SLOW,)),
    ("fsdp-pp2-dp2", 4, {"fsdp": "full", "pp": 2}, "dense", (SLOW,)),
    ("fsdp-pp2-vpp2-dp2", 4, {"fsdp": "zero2", "pp": 2, "vpp": 2}, "moe", (SLOW,)),
    ("fsdp-cp2-dp2", 4, {"fsdp": "full", "cp": 2}, "dense", (SLOW,)),
    ("fsdp-ep2-dp4", 4, {"fsdp": "full", "ep": 2}, "moe", (SLOW,)),
]

FP32_CELL = ("tp2-ep2-pp2", 4, {"tp": 2, "ep": 2, "etp": 1, "pp": 2}, "moe")
"""The fp32 cell: TP, EP and PP at once, 3 steps at rtol 1e-4."""


@dataclasses.dataclass(frozen=True)
class TokenGroups:
    """How the world-1 reference of a cell reproduces the token groups of the cell's ranks.

    ``seq_shards``: each rank routes 1/seq_shards of a micro-batch's positions (sequence
    parallelism: TP rank r holds positions [r·s/tp, (r+1)·s/tp) of every sequence), so it
    drops tokens at the capacity of that share. ``batch_shards``: a statistic is reduced over
    this many data-parallel ranks per micro-batch (the global load-balancing loss), so the
    reference's micro-batch holds those ranks' micro-batches side by side — micro-batch i of
    DP rank d is the trainer's sequences ``(i·dp + d)·mbs ...``, the reference's micro-batch i
    those of all d — and inside it each rank's sequences drop tokens separately.
    """

    seq_shards: int = 1
    batch_shards: int = 1

    @property
    def name(self) -> str:
        return f"seq{self.seq_shards}-batch{self.batch_shards}"


WORLD_ONE = TokenGroups()

# (name, world, parallel section, model kind, token groups of the reference, marks)
STATS_CELLS = [
    # sequence parallelism: each TP rank drops at the capacity of its half of the positions
    ("tp2-sp", 2, {"tp": 2, "sequence_parallel": True}, "moe-aux", TokenGroups(seq_shards=2), ()),
    # expert parallelism: ranks route their own micro-batches, the world-1 micro-batches,
    # and send the tokens kept at capacity through the all-to-all
    ("ep2", 2, {"ep": 2}, "moe-aux", WORLD_ONE, (SLOW,)),
    # data parallelism: the global loss counts both ranks' tokens of each micro-batch
    ("dp2", 2, {}, "moe-gaux", TokenGroups(batch_shards=2), (SLOW,)),
]
"""Cells with per-rank statistics on (aux losses, z-loss, token dropping), each compared with
a world-1 run over the same token groups (:class:`TokenGroups`)."""

STATS = (
    "loss",
    "grad_norm",
    "load_imbalance",
    "expert_load",
    "load_balancing_loss",
    "seq_load_balancing_loss",
    "global_load_balancing_loss",
    "z_loss",
)
"""Per-step metrics compared with world 1 (all but the first two exist for the MoE only, the
aux losses when their coefficient is set)."""

MICRO_BATCH = 2


def _sections(
    kind: str,
    parallel: dict,
    *,
    dtype: str = "fp64",
    groups: TokenGroups = WORLD_ONE,
) -> dict:
    """Config sections of a cell (``parallel``) or of a world-1 reference over ``groups``: its
    micro-batch holds ``groups.batch_shards`` ranks' micro-batches."""
    steps = STEPS if dtype == "fp64" else FP32_STEPS
    mbs = MICRO_BATCH * groups.batch_shards
    model = dict(MODELS[kind])
    if "moe" in model:
        router = dict(model["moe"]["router"])
        # the z-loss is a mean over each rank's micro-batch, and the ranks' means add up:
        # batch_shards of them equal batch_shards × the mean over their union
        router["z_loss_coeff"] *= groups.batch_shards
        model["moe"] = {"router": router}
    return {
        "model": model,
        "parallel": parallel,
        "precision": {"dtype": dtype},
        "schedule": {"train_steps": steps, "warmup_steps": 2, "micro_batch_size": mbs},
        # one global batch of validation sequences: the same samples at every layout
        "eval": {"interval": None, "steps": 1, "at_end": True},
        "logging": {"interval": 1, "per_rank": True},
    }


def _train(run_dir: str, sections: dict, cache: str, groups: TokenGroups = WORLD_ONE) -> dict:
    """Train with ``sections`` on this rank (or one process); a world-1 reference drops
    tokens over ``groups`` (:func:`_capacity_per_rank`).

    Returns this rank's curve, validation losses, per-step records of its metrics file and
    its process id.
    """
    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    config = tiny_config(run_dir, world_size=world, **sections)
    with _capacity_per_rank(config.schedule.micro_batch_size, groups) as calls:
        result = train(config, stream=io.StringIO())
    assert groups == WORLD_ONE or calls, "the reference never dropped tokens by rank groups"
    name = "metrics.jsonl" if rank == 0 else f"metrics-rank{rank}.jsonl"
    lines = (Path(run_dir) / name).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    steps = {r["step"]: {k: r[k] for k in STATS if k in r} for r in records if r["kind"] == "train"}
    return {
        "train": result.train_losses,
        "valid": result.valid_losses,
        "steps": steps,
        "pid": os.getpid(),
    }


@contextlib.contextmanager
def _capacity_per_rank(micro_batch_size: int, groups: TokenGroups):
    """In this (world-1) process, every router drops tokens at capacity separately within
    each rank's token group of a micro-batch (``groups``); yields the list of calls.

    The router's own ``drop_to_capacity`` runs on each group's rows, in their order: the
    capacity is that of the group's token count, as on the rank that routes the group. Rows
    are tokens ``t = position · b + sequence`` of the micro-batch ``[s, b]``.
    """
    if groups == WORLD_ONE:
        yield []
        return
    import torch

    from shardwork.moe_router import router as router_module

    drop = router_module.drop_to_capacity
    calls = []

    def grouped(probs_TE, map_TE, **options):
        calls.append(probs_TE.shape)
        tokens, b = probs_TE.shape[0], micro_batch_size
        positions = tokens // b
        t = torch.arange(tokens)
        group = (t // b) // (positions // groups.seq_shards) * groups.batch_shards + (t % b) // (
            b // groups.batch_shards
        )
        rows = [torch.nonzero(group == g).squeeze(1) for g in range(int(group.max()) + 1)]
        parts = [drop(probs_TE[r], map_TE[r], **options) for r in rows]
        order = torch.argsort(torch.cat(rows))
        return torch.cat([p for p, _ in parts])[order], torch.cat([m for _, m in parts])[order]

    router_module.drop_to_capacity = grouped
    try:
        yield calls
    finally:
        router_module.drop_to_capacity = drop


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_cache, cell_lock):
    """World-1 runs, computed once per (model kind, dtype, token groups) on first use.

    Under xdist the first worker that needs one computes it (holding the cell lock) and
    leaves it beside the lock file; the other workers read it instead of training again.
    """
    cache: dict[tuple[str, str, TokenGroups], dict] = {}

    def get(kind: str, dtype: str = "fp64", groups: TokenGroups = WORLD_ONE) -> dict:
        key = (kind, dtype, groups)
        if key in cache:
            return cache[key]
        name = f"ref-{kind}-{dtype}-{groups.name}"
        with _exclusive(cell_lock):
            shared = None if cell_lock is None else cell_lock.with_name(f"{name}.pkl")
            if shared is not None and shared.exists():
                cache[key] = pickle.loads(shared.read_bytes())
            else:
                run_dir = tmp_path_factory.mktemp(name)
                sections = _sections(kind, {}, dtype=dtype, groups=groups)
                cache[key] = _train(str(run_dir), sections, corpus_cache, groups)
                if shared is not None:
                    shared.write_bytes(pickle.dumps(cache[key]))
        return cache[key]

    return get


@pytest.fixture(scope="module")
def pool_pids() -> dict[int, int]:
    """Process id of each pool rank seen by an earlier cell of this module (rank -> pid)."""
    return {}


@pytest.fixture(scope="module")
def cell_lock(tmp_path_factory) -> Path | None:
    """A lock file shared by the xdist workers of this pytest run (None without xdist).

    Each xdist worker has its own rank pool; without ``--dist loadgroup`` (which keeps the
    ``xdist_group`` cells on one worker) two workers could run an 8-rank cell each at once,
    16 busy ranks on a 2-core machine. The lock runs one cell at a time across workers.
    """
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return None
    return tmp_path_factory.getbasetemp().parent / "layout-matrix.lock"


@contextlib.contextmanager
def _exclusive(lock: Path | None):
    if lock is None:
        yield
        return
    with open(lock, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run_cell(tmp_path, corpus_cache, pool_pids, cell_lock, world, sections) -> list[dict]:
    """Run a cell on ``world`` pooled ranks and prove no process was started for it.

    A rank's process is pooled when it is the process that ran that rank in the earlier
    cells. A different one is accepted only where the earlier process has died (another test
    in this pytest process had the pool kill it, a hang test say, and the pool replaced it)
    *and* the processes that ran this cell run the next call too (a probe right after it).
    A pool that started processes per call fails the probe; one that kept a set of
    processes per world size fails the first condition (the earlier process still lives).
    """
    try:
        with _exclusive(cell_lock):
            results = run_on_ranks(
                _train, world, args=(str(tmp_path), sections, corpus_cache), timeout=CELL_TIMEOUT
            )
            pids = [result["pid"] for result in results]
            if any(pool_pids.get(rank) != pid for rank, pid in enumerate(pids)):
                again = run_on_ranks(_pid, world, timeout=CELL_TIMEOUT)
                assert again == pids, f"cell ranks {pids}, next call {again}: not pooled"
    except Exception:
        pool_pids.clear()  # a failed cell may have had its ranks killed and restarted
        raise
    for rank, pid in enumerate(pids):
        earlier = pool_pids.setdefault(rank, pid)
        assert pid == earlier or not _alive(earlier), (
            f"rank {rank} ran in process {pid} while its earlier process {earlier} still "
            "lives: a process was started for this cell"
        )
        pool_pids[rank] = pid
    return results


def _pid() -> int:
    return os.getpid()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    with contextlib.suppress(OSError):
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _close(value, reference, rtol: float) -> bool:
    if isinstance(reference, list):
        return len(value) == len(reference) and all(
            _close(v, r, rtol) for v, r in zip(value, reference, strict=True)
        )
    return value == pytest.approx(reference, rel=rtol, abs=0)


def _assert_matches(results: list[dict], reference: dict, *, steps: int, rtol: float) -> None:
    ref_steps = reference["steps"]
    assert sorted(reference["train"]) == list(range(steps))
    assert sorted(ref_steps) == list(range(1, steps + 1))
    for rank, got in enumerate(results):
        assert sorted(got["train"]) == list(range(steps)), f"rank {rank}"
        for step in range(steps):
            assert got["train"][step] == pytest.approx(reference["train"][step], rel=rtol), (
                f"rank {rank} step {step}: loss"
            )
        assert sorted(got["steps"]) == sorted(ref_steps), f"rank {rank}: logged steps"
        for step, ref_stats in ref_steps.items():
            assert sorted(got["steps"][step]) == sorted(ref_stats), f"rank {rank} step {step}"
            for key, ref_value in ref_stats.items():
                assert _close(got["steps"][step][key], ref_value, rtol), (
                    f"rank {rank} step {step}: {key} {got['steps'][step][key]} != {ref_value}"
                )
        assert got["valid"][steps] == pytest.approx(reference["valid"][steps], rel=rtol), (
            f"rank {rank}: final validation loss"
        )


@pytest.mark.parametrize(
    ("world", "parallel", "kind"),
    [pytest.param(w, p, k, id=f"{k}-{n}", marks=m) for n, w, p, k, m in CELLS],
)
def test_layout_matches_world_one(
    tmp_path, corpus_cache, references, pool_pids, cell_lock, world, parallel, kind
):
    reference = references(kind)
    # the reference must move: a curve that equals itself because nothing trains proves nothing
    assert reference["train"][0] - reference["train"][STEPS - 1] > 1.0
    if kind == "moe":
        assert {"expert_load", "load_imbalance"} <= set(reference["steps"][1])
    sections = _sections(kind, parallel)
    results = _run_cell(tmp_path, corpus_cache, pool_pids, cell_lock, world, sections)
    reordered = parallel.get("tp", 1) > 1 or parallel.get("ep", 1) > 1
    rtol = KIND_RTOL.get(kind, RTOL) if reordered else RTOL
    _assert_matches(results, reference, steps=STEPS, rtol=rtol)


@pytest.mark.parametrize(
    ("world", "parallel", "kind", "groups"),
    [pytest.param(w, p, k, g, id=f"{k}-{n}", marks=m) for n, w, p, k, g, m in STATS_CELLS],
)
def test_per_rank_statistics_match_world_one(
    tmp_path, corpus_cache, references, pool_pids, cell_lock, world, parallel, kind, groups
):
    """Aux losses, z-loss and token dropping on: 20 steps equal a world-1 run whose routers
    compute these statistics over the cell's per-rank token groups."""
    reference = references(kind, "fp64", groups)
    assert reference["train"][0] - reference["train"][STEPS - 1] > 1.0
    logged = {"z_loss", "load_imbalance", "expert_load"}
    logged |= {"global_load_balancing_loss"} if kind == "moe-gaux" else {"load_balancing_loss"}
    assert logged <= set(reference["steps"][1])
    sections = _sections(kind, parallel)
    results = _run_cell(tmp_path, corpus_cache, pool_pids, cell_lock, world, sections)
    _assert_matches(results, reference, steps=STEPS, rtol=RTOL)


def test_fp32_cell_matches_world_one(tmp_path, corpus_cache, references, pool_pids, cell_lock):
    name, world, parallel, kind = FP32_CELL
    reference = references(kind, "fp32")
    sections = _sections(kind, parallel, dtype="fp32")
    results = _run_cell(tmp_path, corpus_cache, pool_pids, cell_lock, world, sections)
    _assert_matches(results, reference, steps=FP32_STEPS, rtol=FP32_RTOL)
    # fp32 rounding is visible: this cell is not secretly running in float64
    fp64 = references(kind)
    assert any(reference["train"][s] != fp64["train"][s] for s in range(FP32_STEPS)), (
        f"{name}: fp32 and fp64 curves are identical"
    )


GUARD_FIXTURE = Path(__file__).resolve().parent / "fixtures" / "layout_matrix_world1.json"
"""The world-1 references as trained before issue 18's restructuring (written by
``tools/layout_matrix_fixture.py``), with the kernels that produced them. Rewritten once since,
deliberately, for issue 24's kernels (RMSNorm's closed-form backward, grouped-query SDPA,
routing probabilities applied on the experts' activation), which change the last bits: the
new runs equal the previous fixture within 1e-12 (fp64 dense and MoE, loss and gradient norm;
~1e-15 with the aux losses) and 7.2e-8 (the fp32 MoE run), far inside the matrix's own
tolerances. Rewritten again for the float32 products on oneDNN (the fingerprint's
``cpu_gemm``): the fp64 runs are bit for bit the previous fixture's, the fp32 MoE run within
1.3e-7 of it (gradient norm). Rewritten for the run's AdamW on torch's fused kernel (stop 33):
relative to the previous fixture, fp64 within 1.1e-13 (gradient norm; losses 1e-14), fp32
within 4.6e-8 (loss); expert loads unchanged. Rewritten for the fused loss's softmax statistics
(stop 35: ``cross_entropy_shard.shard_softmax``): fp64 within 8.7e-13 (dense gradient norm;
losses 8.2e-15), fp32 within 4.6e-8 (loss); expert loads unchanged. Rewritten for the training
set's sample order of blocks (stop 45), which trains on other samples: with the earlier
``"whole"`` order forced, all four runs were first checked to equal the previous fixture bit for
bit, so nothing but the data changed."""

GUARDED_REFERENCES = [
    ("dense", "fp64", WORLD_ONE),
    ("moe", "fp64", WORLD_ONE),
    ("moe", "fp32", WORLD_ONE),
    ("moe-aux", "fp64", TokenGroups(seq_shards=2)),
]
"""The references the default (not slow) run trains anyway, so guarding them costs no run."""


def guard_key(kind: str, dtype: str, groups: TokenGroups) -> str:
    return f"{kind}-{dtype}-{groups.name}"


def kernel_fingerprint() -> dict:
    """What decides the last bits of a world-1 run on CPU: torch's build, the CPU kernels torch,
    MKL and oneDNN dispatch to (the last two capped by ``MKL_ENABLE_INSTRUCTIONS`` and
    ``ONEDNN_MAX_CPU_ISA``), the library of the float32 linear products (MKL, or oneDNN where
    ``shardwork.fused_kernels.onednn_preferred``), the CPU and the intra-op thread count
    (reduction split)."""
    import platform

    import torch

    from shardwork.fused_kernels import onednn_preferred

    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_instructions": os.environ.get("MKL_ENABLE_INSTRUCTIONS", ""),
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        "cpu_gemm": "onednn" if onednn_preferred("auto", torch.ones(1)) else "mkl",
        "cpu": cpu,
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }


def normal_draw_digest() -> str:
    """A digest of 64 float32 N(0, 1) draws from seed 0. torch draws float32 normals of 16 or
    more elements on a vectorised path where the CPU has AVX2 and a scalar one elsewhere, whose
    last bits differ; the models' initial weights are such draws
    (``shardwork.models.sharding.normal_slice``), so where this digest differs from the
    fixture's the runs start from other weights."""
    import torch

    draws = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    return hashlib.sha256(draws.numpy().tobytes()).hexdigest()[:16]


def _from_json(record: dict) -> dict:
    """A JSON-read reference with its integer step keys restored."""
    return {
        "train": {int(k): v for k, v in record["train"].items()},
        "valid": {int(k): v for k, v in record["valid"].items()},
        "steps": {int(k): v for k, v in record["steps"].items()},
    }


@pytest.mark.parametrize(
    ("kind", "dtype", "groups"),
    [pytest.param(k, d, g, id=guard_key(k, d, g)) for k, d, g in GUARDED_REFERENCES],
)
def test_world_one_reference_is_unchanged(references, kind, dtype, groups):
    """Refactoring guard (issue 18): the world-1 runs train exactly what they trained before.

    On a machine whose kernels match the fixture's (:func:`kernel_fingerprint`) every loss,
    gradient norm, expert load and aux loss must be equal bit for bit: a restructuring that
    changes no arithmetic changes no bit. Elsewhere the reduction order of the CPU's kernels
    differs, and the check is the matrix's own (rtol 1e-9 in float64, 1e-4 in float32). A CPU
    whose torch draws other float32 normals (:func:`normal_draw_digest`: no AVX2) starts the
    runs from other weights, a difference of ~5e-9 in float64 losses: skipped there. So is a
    Python whose ``pydoc_data`` text differs from the one the references trained on (the
    built-in corpus; patch releases change it): the runs then train on other data.
    """
    stored = json.loads(GUARD_FIXTURE.read_text())
    if stored["corpus"] != corpus_digest("pydoc"):
        pytest.skip(
            f"this Python's pydoc_data text (digest {corpus_digest('pydoc')}) is not the one "
            f"the references were trained on ({stored['corpus']})"
        )
    if stored["normal_draws"] != normal_draw_digest():
        pytest.skip(
            "this CPU's torch draws other float32 normals than the machine that wrote the "
            "references (no AVX2 path), so the models start from other initial weights"
        )
    expected = _from_json(stored["references"][guard_key(kind, dtype, groups)])
    got = references(kind, dtype, groups)
    steps = STEPS if dtype == "fp64" else FP32_STEPS
    if stored["machine"] == kernel_fingerprint():
        assert {k: got[k] for k in ("train", "valid", "steps")} == expected
    else:
        rtol = RTOL if dtype == "fp64" else FP32_RTOL
        _assert_matches([got], expected, steps=steps, rtol=rtol)


def test_matrix_models_are_deterministic(tmp_path, corpus_cache, monkeypatch):
    """The premises of the 1e-9 tolerance: float64 everywhere, nothing stochastic, dropless."""
    import torch

    monkeypatch.setenv("SHARDWORK_CACHE", corpus_cache)
    from shardwork.trainer.model_factory import gpt_config
    from shardwork.trainer.testing import tiny_config

    for kind in MODELS:
        model = gpt_config(tiny_config(tmp_path, **_sections(kind, {})))
        assert model.params_dtype == torch.float64, kind
        assert model.hidden_dropout == 0.0 and model.attention_dropout == 0.0, kind
        if kind in ("dense", "nemotron-h"):
            assert model.moe is None
            continue
        router = model.moe.router
        assert router.input_jitter_eps is None, kind  # no router jitter
        assert router.router_dtype in (None, "fp64"), kind  # the router follows float64
        if kind in ("moe", "qwen3-next"):
            assert router.capacity_factor is None  # dropless: no token is dropped per rank
            assert router.aux_loss_coeff == 0.0 and router.z_loss_coeff is None
        else:  # the per-rank statistics are on (compared over the ranks' token groups)
            assert router.capacity_factor == 1.0 and router.z_loss_coeff > 0, kind
            assert router.aux_loss_enabled, kind
