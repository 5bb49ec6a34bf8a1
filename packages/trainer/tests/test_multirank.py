"""Multi-rank runs on gloo: every layout trains the same model to fp32 rounding, layout
changes on resume, the data-parallel replica check, collective timeouts naming groups."""

import io
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from shardwork.parallel_state.testing import run_on_ranks

pytestmark = pytest.mark.multirank

MODEL = {"num_layers": 4}


def _train(run_dir, sections, cache):
    import os

    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    world = dist.get_world_size() if dist.is_initialized() else 1
    stream = io.StringIO()
    result = train(tiny_config(run_dir, world_size=world, **sections), stream=stream)
    return result.train_losses, result.valid_losses, stream.getvalue()


def _train_mtp(run_dir, sections, cache):
    """Like :func:`_train`, with the per-step MTP losses instead of the printed text."""
    import os

    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    world = dist.get_world_size() if dist.is_initialized() else 1
    result = train(tiny_config(run_dir, world_size=world, **sections), stream=io.StringIO())
    return result.train_losses, result.valid_losses, result.train_mtp_losses


def _standalone_layout(run_dir):
    """What the trainer builds on this rank for ``parallel.mtp_standalone`` at pp=2."""
    from shardwork.trainer.run.setup import build_assembly, init_runtime
    from shardwork.trainer.testing import tiny_config

    parallel = {"pp": 2, "mtp_standalone": True}
    config = tiny_config(
        run_dir, world_size=2, model={"preset": "tiny-deepseek-v3"}, parallel=parallel
    )
    (module,) = build_assembly(config, init_runtime(config)).modules
    return (
        list(range(*module.decoder.layer_range)),
        module.decoder.final_norm is not None,
        module.mtp is not None,
    )


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache):
    """Single-process losses of the 4-layer tiny model, 6 steps."""
    run_dir = tmp_path_factory.mktemp("ref")
    return _train(str(run_dir), _sections({}), cache)


def _sections(parallel, **extra):
    sections = {
        "model": MODEL,
        "parallel": parallel,
        "schedule": {"train_steps": 6, "warmup_steps": 2},
        "eval": {"interval": 3, "steps": 1},  # one global batch (8 samples)
    }
    sections.update(extra)
    return sections


@pytest.mark.parametrize(
    ("world", "parallel"),
    [
        (2, {}),  # dp=2, ZeRO-1 over 2 ranks
        (2, {"tp": 2}),
        (2, {"pp": 2}),  # 1F1B, 2 micro-batches
        (4, {"tp": 2, "pp": 2}),
        (4, {"pp": 2, "vpp": 2}),  # interleaved 1F1B, dp=2
        (4, {"tp": 2, "sequence_parallel": True}),  # dp=2
    ],
    ids=["dp2", "tp2", "pp2", "tp2-pp2", "pp2-vpp2-dp2", "tp2-sp-dp2"],
)
def test_layouts_match_single_process(tmp_path, cache, reference, world, parallel):
    sections = _sections(parallel)
    if "vpp" in parallel:
        # interleaving needs micro-batches in multiples of pp: 8 / (2 × dp=2) = 2
        sections["schedule"] = {**sections["schedule"], "micro_batch_size": 2}
    results = run_on_ranks(_train, world, args=(str(tmp_path), sections, cache), timeout=300)
    ref_train, ref_valid, _ = reference
    for train_losses, valid_losses, _ in results:
        assert sorted(train_losses) == list(range(6))
        for step in range(6):
            assert train_losses[step] == pytest.approx(ref_train[step], rel=2e-4, abs=2e-4)
        assert valid_losses[6] == pytest.approx(ref_valid[6], rel=2e-4, abs=2e-4)


def test_resume_at_another_layout_rederives_rng(tmp_path, cache, reference):
    first = _sections({}, checkpoint={"interval": 3, "keep_last": 2})
    _train(str(tmp_path / "a"), first, cache)  # one process, dp=1
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_000000003")
    resumed = _sections({"tp": 2}, checkpoint={"resume": ckpt})
    results = run_on_ranks(_train, 2, args=(str(tmp_path / "b"), resumed, cache), timeout=300)
    train_losses, _, text = results[0]
    assert sorted(train_losses) == [3, 4, 5]
    for step in (3, 4, 5):
        assert train_losses[step] == pytest.approx(reference[0][step], rel=2e-4, abs=2e-4)
    assert "RNG state cannot be resharded" in text and "re-derived" in text


def _replica_check(corrupt: bool):
    from shardwork.parallel_state import ParallelConfig, init_process_groups
    from shardwork.trainer.run.params_check import ReplicaMismatchError, check_dp_replicas

    groups = init_process_groups(ParallelConfig(), gloo_twins=True)
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3)
    if corrupt and dist.get_rank() == 1:
        with torch.no_grad():
            module.bias[1] += 1e-7
    try:
        return check_dp_replicas([module], groups, step=7)
    except ReplicaMismatchError as exc:
        return str(exc)


def test_dp_replica_check():
    assert run_on_ranks(_replica_check, 2, args=(False,)) == [2, 2]
    messages = run_on_ranks(_replica_check, 2, args=(True,))
    for message in messages:
        assert "step 7: parameters differ across the dp_cp group (ranks [0, 1])" in message
        assert "chunk0.bias" in message and "weight" not in message


def _train_recording_data_files(run_dir, sections, cache):
    """Train like :func:`_train` and record every file under the data cache that this rank
    opened during ``train()`` (``open`` and ``io.open`` cover numpy's memory maps and
    pathlib). Returns ``(pp rank, opened paths, train losses, valid losses)``."""
    import builtins

    os.environ["SHARDWORK_CACHE"] = cache
    from shardwork.trainer.run.trainer import train
    from shardwork.trainer.testing import tiny_config

    config = tiny_config(run_dir, world_size=dist.get_world_size(), **sections)
    real_open, opened = builtins.open, []

    def spy(file, *args, **kwargs):
        if isinstance(file, str | os.PathLike) and os.fspath(file).startswith(cache):
            opened.append(os.fspath(file))
        return real_open(file, *args, **kwargs)

    builtins.open = io.open = spy
    try:
        result = train(config, stream=io.StringIO())
    finally:  # the rank processes are pooled: restore
        builtins.open = io.open = real_open
    pp_rank = dist.get_rank() // (dist.get_world_size() // config.parallel.pp)
    return pp_rank, opened, result.train_losses, result.valid_losses


def test_middle_pipeline_stage_opens_no_data_file(tmp_path, cache, reference):
    # pp=3 (2 + 1 + 1 layers): stage 1 neither reads inputs nor labels
    sections = _sections({"pp": 3, "first_stage_layers": 2})
    results = run_on_ranks(
        _train_recording_data_files, 3, args=(str(tmp_path), sections, cache), timeout=300
    )
    ref_train, ref_valid, _ = reference
    by_stage = {pp_rank: opened for pp_rank, opened, _, _ in results}
    assert by_stage[1] == []
    for stage in (0, 2):  # the first and last stages read the .idx and .bin of the corpus
        suffixes = {os.path.splitext(path)[1] for path in by_stage[stage]}
        assert {".idx", ".bin"} <= suffixes, by_stage[stage]
    for _, _, train_losses, valid_losses in results:  # and the run is the one-process run
        for step in range(6):
            assert train_losses[step] == pytest.approx(ref_train[step], rel=2e-4, abs=2e-4)
        # the middle stage got the evaluation's micro-batch count from the first
        assert valid_losses[6] == pytest.approx(ref_valid[6], rel=2e-4, abs=2e-4)


def test_evaluation_in_chunks_matches_one_process(tmp_path, cache):
    # the evaluation checks the stop flag between chunks of micro-batches: one micro-batch
    # without pipelining (6 chunks of 4 samples here), one global batch with pp=2 (3 chunks of
    # 8); both must read the same 24 validation samples, so the losses agree (float64)
    sections = {
        "model": {"num_layers": 2},
        "precision": {"dtype": "fp64"},
        "schedule": {"train_steps": 2, "warmup_steps": 1},
        "eval": {"interval": None, "steps": 3, "at_end": True},
    }
    _, ref_valid, _ = _train(str(tmp_path / "ref"), sections, cache)
    piped = {**sections, "parallel": {"pp": 2}}
    for _, valid_losses, _ in run_on_ranks(
        _train, 2, args=(str(tmp_path / "pp"), piped, cache), timeout=300
    ):
        assert valid_losses[2] == pytest.approx(ref_valid[2], rel=1e-9)


def _eval_count_from_first_stage(counts):
    from shardwork.parallel_state import ParallelConfig, init_process_groups
    from shardwork.trainer.run.setup import Runtime
    from shardwork.trainer.run.trainer import _eval_micro_batches_of_first_stage

    groups = init_process_groups(ParallelConfig(pp=2))
    runtime = Runtime(groups, torch.device("cpu"), dist.get_rank(), 2, owns_distributed=False)
    return _eval_micro_batches_of_first_stage(counts[groups.rank("pp")], runtime)


def test_stages_take_the_first_stages_evaluation_length():
    # a stage without the data (here: the last one, given 0) gets the first stage's count
    assert run_on_ranks(_eval_count_from_first_stage, 2, args=([5, 0],)) == [5, 5]


def _train_with_replica_check(run_dir, cache, perturb: bool):
    """4 steps at dp=2 with reliability.check_dp_params_interval=2. With ``perturb``, rank 1
    adds 1e-6 to one parameter after step index 1 (after ZeRO's all-gather made the replicas
    equal again), just before the check at step 2. Returns ``(checks, outcome, perturbed)``:
    the ``(step, parameters compared)`` of every check that ran, the error text (or the final
    step), and the name of the parameter rank 1 changed (None on rank 0 and when nothing was
    raised)."""
    os.environ["SHARDWORK_CACHE"] = cache
    import shardwork.trainer.run.trainer as trainer_module
    from shardwork.trainer.run.params_check import ReplicaMismatchError
    from shardwork.trainer.testing import tiny_config

    real_step, real_check = trainer_module.train_step, trainer_module.check_dp_replicas
    checks, steps = [], []
    target = {}

    def step(assembly, *args, **kwargs):
        out = real_step(assembly, *args, **kwargs)
        steps.append(1)
        if perturb and len(steps) == 2 and dist.get_rank() == 1:
            names = [n for n, _ in assembly.modules[0].named_parameters()]
            target["name"] = names[len(names) // 2]
            with torch.no_grad():
                assembly.modules[0].get_parameter(target["name"]).view(-1)[0] += 1e-6
        return out

    def check(modules, groups, *, step):
        compared = real_check(modules, groups, step=step)
        checks.append((step, compared))
        return compared

    trainer_module.train_step, trainer_module.check_dp_replicas = step, check
    try:
        config = tiny_config(
            run_dir,
            world_size=2,
            schedule={"train_steps": 4},
            eval={"interval": None, "at_end": False},
            reliability={"check_dp_params_interval": 2},
        )
        try:
            result = trainer_module.train(config, stream=io.StringIO())
        except ReplicaMismatchError as exc:
            return checks, str(exc), target.get("name")
        return checks, result.final_step, None
    finally:  # the rank processes are pooled: leave the module as it was
        trainer_module.train_step, trainer_module.check_dp_replicas = real_step, real_check


def test_replica_check_in_the_loop(tmp_path, cache):
    equal = run_on_ranks(
        _train_with_replica_check, 2, args=(str(tmp_path / "a"), cache, False), timeout=300
    )
    (_, num_params), *_ = equal[0][0]
    assert num_params > 0
    for checks, final_step, _ in equal:  # checked at steps 2 and 4, all parameters equal
        assert checks == [(2, num_params), (4, num_params)]
        assert final_step == 4
    broken = run_on_ranks(
        _train_with_replica_check, 2, args=(str(tmp_path / "b"), cache, True), timeout=300
    )
    name = broken[1][2]
    for checks, message, _ in broken:  # both replicas stop at the step-2 check, naming it
        assert checks == []  # the check raised before returning
        assert message.startswith(
            "step 2: parameters differ across the dp_cp group (ranks [0, 1]): "
        )
        assert message.split("): ", 1)[1] == f"chunk0.{name}"


def _gathers_in_flight(chunks) -> int:
    """Parameter all-gather buckets of ``chunks`` launched and not yet waited for."""
    in_flight = 0
    for chunk in chunks:
        last = {}
        for kind, key, index in chunk.param_gather_log:
            last[(key, index)] = kind
        in_flight += sum(kind == "launch" for kind in last.values())
    return in_flight


def _train_overlapped_with_replica_check(run_dir, cache, preset):
    """3 steps at dp=2 with optimizer.overlap_param_gather and a replica check after every step
    (``preset``: None for the tiny dense model). Returns the final step and, per check, the
    all-gathers still in flight when it read the parameters."""
    os.environ["SHARDWORK_CACHE"] = cache
    import shardwork.trainer.run.trainer as trainer_module
    from shardwork.trainer.testing import tiny_config

    real_step, real_check = trainer_module.train_step, trainer_module.check_dp_replicas
    seen, in_flight = {}, []

    def step(assembly, *args, **kwargs):
        seen["chunks"] = assembly.chunks
        return real_step(assembly, *args, **kwargs)

    def check(modules, groups, *, step):
        in_flight.append(_gathers_in_flight(seen["chunks"]))
        return real_check(modules, groups, step=step)

    models = {} if preset is None else {"model": {"preset": preset}}
    config = tiny_config(
        run_dir,
        world_size=2,
        schedule={"train_steps": 3, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        optimizer={"overlap_param_gather": True},
        reliability={"check_dp_params_interval": 1},
        **models,
    )
    trainer_module.train_step, trainer_module.check_dp_replicas = step, check
    try:
        return trainer_module.train(config, stream=io.StringIO()).final_step, in_flight
    finally:  # the rank processes are pooled: leave the module as it was
        trainer_module.train_step, trainer_module.check_dp_replicas = real_step, real_check


@pytest.mark.parametrize("preset", [None, "tiny-mixtral-8x7b"], ids=["dense", "moe"])
def test_replica_check_waits_for_overlapped_param_gathers(tmp_path, cache, preset):
    """Under overlap_param_gather a step's parameter all-gathers are still in flight after it:
    the replica check waits for them (else it races them and may report equal replicas as
    different), and the run finishes."""
    results = run_on_ranks(
        _train_overlapped_with_replica_check, 2, args=(str(tmp_path), cache, preset), timeout=300
    )
    assert results == [(3, [0, 0, 0])] * 2


def _hang_one_rank():
    import time

    from shardwork.parallel_state import ParallelConfig, init_process_groups
    from shardwork.trainer.run.collectives import CollectiveTimeoutError, collective_phase

    groups = init_process_groups(ParallelConfig(), timeout=timedelta(seconds=2))
    if dist.get_rank() == 1:
        time.sleep(6)
        return "slept"
    try:
        with collective_phase("optimizer step", groups, ("dp_cp",), timeout_minutes=2 / 60):
            dist.all_reduce(torch.ones(1), group=groups.group("dp_cp"))
    except CollectiveTimeoutError as exc:
        return str(exc)
    return "no timeout"


def test_collective_timeout_names_phase_and_group():
    message = run_on_ranks(_hang_one_rank, 2, timeout=120)[0]
    assert "'optimizer step'" in message and "dp_cp=[0, 1]" in message


def test_mtp_standalone_setting_builds_the_mtp_stage(tmp_path):
    """parallel.mtp_standalone reaches the stage builder: rank 1 has MTP and no layer."""
    layouts = run_on_ranks(_standalone_layout, 2, args=(str(tmp_path),))
    assert layouts == [([0, 1, 2], True, False), ([], False, True)]


@pytest.mark.parametrize(
    ("preset", "parallel"),
    [
        # ep=2 with dp=2: tiny-mixtral has no aux loss (aux_loss_coeff=0) and routes dropless,
        # so the per-rank routing statistics do not enter the loss: every step must match
        ("tiny-mixtral-8x7b", {"ep": 2}),
        # MLA, MTP (needs input ids on the last stage), uneven stages: 1 + 2 layers
        ("tiny-deepseek-v3", {"pp": 2, "first_stage_layers": 1}),
        # MTP alone on the last rank (no decoder layer there; the final norm on rank 0)
        ("tiny-deepseek-v3", {"pp": 2, "mtp_standalone": True}),
    ],
    ids=["mixtral-ep2", "deepseek-pp2", "deepseek-pp2-mtp-standalone"],
)
def test_moe_models_match_single_process(tmp_path, cache, preset, parallel):
    sections = {
        "model": {"preset": preset},
        "schedule": {"train_steps": 4, "warmup_steps": 2},
        "eval": {"interval": 4, "steps": 1},
    }
    layout = {**sections, "parallel": parallel}
    # eval.steps counts global batches: every layout evaluates the same validation samples
    ref_train, ref_valid, ref_mtp = _train_mtp(str(tmp_path / "ref"), sections, cache)
    for train_losses, valid_losses, mtp_losses in run_on_ranks(
        _train_mtp, 2, args=(str(tmp_path / "par"), layout, cache), timeout=300
    ):
        assert train_losses[0] == pytest.approx(ref_train[0], rel=1e-5)
        assert train_losses[3] < train_losses[0] - 0.5  # and it trains
        for step in range(4):
            assert train_losses[step] == pytest.approx(ref_train[step], rel=2e-4, abs=2e-4)
        # MTP (deepseek; last stage only) reaches every rank's log through reduce_mtp_losses
        assert sorted(mtp_losses) == sorted(ref_mtp)
        for step in ref_mtp:
            assert mtp_losses[step] == pytest.approx(ref_mtp[step], rel=2e-4, abs=2e-4)
        assert valid_losses[4] == pytest.approx(ref_valid[4], rel=2e-4, abs=2e-4)


@pytest.mark.parametrize(
    ("world", "parallel", "model"),
    [
        (4, {"pp": 2, "tp": 2}, MODEL),
        (2, {"ep": 2}, {"preset": "tiny-mixtral-8x7b"}),
    ],
    ids=["pp2-tp2-to-1", "ep2-to-1"],
)
def test_checkpoint_from_a_parallel_layout_resumes_on_one_process(
    tmp_path, cache, world, parallel, model
):
    sections = _sections(parallel, model=model, checkpoint={"interval": 3, "keep_last": 2})
    sharded = run_on_ranks(_train, world, args=(str(tmp_path / "a"), sections, cache), timeout=300)
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_000000003")
    single = _sections({}, model=model, checkpoint={"resume": ckpt})
    train_losses, _, text = _train(str(tmp_path / "b"), single, cache)
    assert sorted(train_losses) == [3, 4, 5]
    for step in (3, 4, 5):
        assert train_losses[step] == pytest.approx(sharded[0][0][step], rel=2e-4, abs=2e-4)
    assert "re-derived" in text
