"""MTP on a pipeline stage of its own (``build_stage(..., mtp_standalone=True)``).

Several SGD steps through the real 1F1B schedule and ``finalize_model_grads`` at PP=2 (stage 0:
every decoder layer and the final norm; stage 1: MTP, head, losses) and PP=3 (the decoder split
over two stages), tied and untied embeddings, plus one MoE (DeepSeek-V3 twin) case, against the
same steps at world size 1 (built on every rank; the layout-free init gives both the same
weights): main and per-depth MTP losses of every step and every parameter afterwards. A
checkpoint saved at the standalone layout has world 1's keys and loads there. A planted bug
(the shared embedding's gradients not summed over the embedding group) is detected.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from shardwork.dist_checkpoint import load, save
from shardwork.models import GPTModel, preset
from shardwork.models.full_state import full_state_dict
from shardwork.models.moe import moe_finalize_kwargs
from shardwork.models.moe.testing import global_batches
from shardwork.models.mtp import MTPConfig, reduce_mtp_losses
from shardwork.models.pipeline import (
    build_stage,
    finalize,
    finalize_model_grads,
    get_schedule,
    standalone_last_stage_layers,
)
from shardwork.parallel_state import ParallelConfig, ProcessGroups, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

LR = 0.5
STEPS = 3
MICROBATCHES, BATCH, SEQ = 2, 2, 16


def _config(name: str, overrides: dict):
    return preset(name, params_dtype=torch.float64, **overrides)


def _reference_step(model, opt, batches):
    """World-1 step over the same micro-batches; returns (mean loss, per-depth MTP means)."""
    total = sum(int((lab != -100).sum()) for _, lab in batches)
    model.mtp_loss_scale.set(1.0 / total)
    if model.aux_loss_scale is not None:
        model.aux_loss_scale.set(1.0 / total)
    loss = 0.0
    for ids, labels in batches:
        loss_sum, _ = model(ids, labels=labels)
        (loss_sum / total).backward()
        loss += float(loss_sum.detach())
    kwargs = moe_finalize_kwargs(model, ProcessGroups.single())
    if "moe_tracker" in kwargs:
        kwargs["moe_tracker"].reduce()
    for hook in kwargs.get("moe_hooks", ()):
        hook()
    opt.step()
    opt.zero_grad(set_to_none=True)
    mtp = model.mtp.tracker.mean_losses()
    model.mtp.tracker.reset()
    return loss / total, mtp


def _pipeline_step(stage, opt, batches, groups):
    """One step at the pipeline layout (backward from loss sums; finalize divides by tokens)."""
    mine = iter(batches)
    tokens = []

    def forward_step(_it, chunk):
        ids, labels = next(mine)
        # Every stage gets the ids: the MTP stage embeds the shifted tokens itself.
        out = chunk(ids, labels=labels)

        def loss_fn(output):
            loss_sum, n = output
            tokens.append(n)
            return loss_sum, n, {}

        return out, loss_fn

    pp = groups.size("pp")
    losses = get_schedule(pp)(
        forward_step_func=forward_step,
        data_iterator=None,
        model=stage,
        num_microbatches=MICROBATCHES,
        pp_group=groups.group("pp"),
        # Under sequence parallelism the activations between stages hold s/tp tokens.
        tensor_shape=(
            SEQ // groups.size("tp") if stage.config.sequence_parallel else SEQ,
            BATCH,
            stage.config.hidden_size,
        ),
        dtype=torch.float64,
    )
    total = finalize_model_grads(
        stage,
        groups,
        num_tokens=sum(int(n) for n in tokens),
        **moe_finalize_kwargs(stage, groups),
    )
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss_sum = torch.tensor(sum(float(item.loss_sum) for item in losses), dtype=torch.float64)
    dist.all_reduce(loss_sum, group=groups.group("pp"))
    mtp = reduce_mtp_losses(stage, groups)
    if stage.mtp is not None:
        stage.mtp.tracker.reset()
    return float(loss_sum / total), mtp


def _train(pp, name, overrides, ckpt_path=None, plant=False, tp=1):
    """Worker: STEPS steps at pp × tp (standalone MTP) and at world 1; returns what to compare."""
    groups = init_process_groups(ParallelConfig(pp=pp, tp=tp))
    cfg = _config(name, overrides)
    # One row per step (global_batches' rows are meant for dp ranks; here dp = 1).
    batches = global_batches(
        cfg.vocab_size, dp=STEPS, microbatches=MICROBATCHES, batch=BATCH, seq=SEQ
    )
    stage = build_stage(cfg, groups, mtp_standalone=True)
    stage.train()
    ref = GPTModel(cfg.replace(sequence_parallel=False), ProcessGroups.single())
    ref.train()
    opt = torch.optim.SGD(stage.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    layout = {
        "layers": list(range(*stage.decoder.layer_range)),
        "final_norm": stage.decoder.final_norm is not None,
        "mtp": stage.mtp is not None,
    }
    steps, ref_steps = [], []
    for step_batches in batches:
        ref_steps.append(_reference_step(ref, ref_opt, step_batches))
        if plant:  # the planted bug: shared-embedding gradients left unsummed
            with mock.patch.object(finalize, "_embedding_group", lambda _groups: None):
                steps.append(_pipeline_step(stage, opt, step_batches, groups))
        else:
            steps.append(_pipeline_step(stage, opt, step_batches, groups))
    solo = dist.new_group([dist.get_rank()])
    params = full_state_dict(stage)
    ref_params = full_state_dict(ref, group=solo)
    out = dict(layout=layout, steps=steps, ref_steps=ref_steps, params=params, ref=ref_params)
    out["embedding_copy"] = _embedding_copy(stage)
    if ckpt_path is not None:
        out |= _checkpoint(stage, cfg, ckpt_path, solo, groups)
    return out


def _embedding_copy(stage):
    """This rank's local copy of the input embedding (first stage: the embedding; MTP stage:
    the tied head's copy, or MTP's own copy when untied; None elsewhere)."""
    if stage.embedding is not None:
        return stage.embedding.weight.detach().clone()
    if stage.mtp is None:
        return None
    own = stage.mtp.embedding_weight
    return (own if own is not None else stage.output_layer.linear.weight).detach().clone()


def _checkpoint(stage, cfg, path, solo, groups):
    """Save at the standalone layout; keys over all ranks vs world 1's; load at world 1."""
    own = list(stage.sharded_state_dict())
    keys = [None] * groups.size("pp")
    dist.all_gather_object(keys, own, group=groups.group("pp"))
    save(stage.sharded_state_dict(), path)
    dist.barrier()
    loader = GPTModel(cfg.replace(init_seed=cfg.init_seed + 11), ProcessGroups.single())
    before = full_state_dict(loader, group=solo)
    load(loader.sharded_state_dict(), path, group=solo)
    return dict(
        saved_keys=sorted({k for rank_keys in keys for k in rank_keys}),
        world1_keys=sorted(loader.sharded_state_dict()),
        loaded=full_state_dict(loader, group=solo),
        before_load=before,
    )


# fp64 throughout, but fused-kernels' cross entropy keeps float32 statistics. Step 1 sees the
# same weights and inputs as world 1, so its losses agree to the last bits: equal with this
# machine's AVX-512 and AVX2 kernels, 1 ulp apart (1.6e-16 relative) with torch's plain kernels
# (ATEN_CPU_CAPABILITY=default), whose sums group the split sequence's terms otherwise; checked
# at FIRST_STEP_RTOL = 1e-14. Its update differs only in the summation order of the shared
# embedding's gradient halves (fp64 rounding); from step 2 on that perturbation reaches the float32 statistics. Measured over the
# six cases (3 steps): losses rel <= 6.1e-10, MTP losses rel <= 1.3e-10, parameters abs
# <= 1.1e-8 at weight scale <= 0.26. Tolerances: 1e-8 (losses), 1e-7 (parameters), a factor
# >= 9 above that; the planted missing sync moves losses by >= 1.5e-4 and weights by >= 2e-3.
LOSS_RTOL, PARAM_TOL, FIRST_STEP_RTOL = 1e-8, 1e-7, 1e-14


def _assert_equal_to_world1(result):
    steps, ref_steps = result["steps"], result["ref_steps"]
    assert len(steps) == len(ref_steps) == STEPS
    # same weights, same inputs: first losses equal to rounding of the sums' grouping
    torch.testing.assert_close(steps[0], ref_steps[0], rtol=FIRST_STEP_RTOL, atol=0)
    for (loss, mtp), (ref_loss, ref_mtp) in zip(steps, ref_steps, strict=True):
        torch.testing.assert_close(loss, ref_loss, rtol=LOSS_RTOL, atol=0)
        torch.testing.assert_close(mtp, ref_mtp, rtol=LOSS_RTOL, atol=0)
    params, ref = result["params"], result["ref"]
    assert set(params) == set(ref), sorted(set(params) ^ set(ref))
    for key in ref:
        torch.testing.assert_close(
            params[key], ref[key], rtol=PARAM_TOL, atol=PARAM_TOL, msg=lambda m, k=key: f"{k}: {m}"
        )


CASES = {
    "pp2-tied": (2, "tiny-llama3.2-1b", {"mtp": MTPConfig(num_layers=2, loss_coeff=0.5)}),
    "pp2-untied": (2, "tiny-llama3-8b", {"mtp": MTPConfig(num_layers=1, loss_coeff=0.3)}),
    "pp3-tied": (3, "tiny-llama3.2-1b", {"mtp": MTPConfig(num_layers=1, loss_coeff=0.4)}),
    "pp3-untied": (3, "tiny-llama3-8b", {"mtp": MTPConfig(num_layers=2, loss_coeff=0.2)}),
}


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["pp2-tied", "pp3-untied"])
def test_standalone_mtp_trains_like_world1(case, tmp_path):
    pp, name, overrides = CASES[case]
    results = run_on_ranks(_train, pp, args=(pp, name, overrides, str(tmp_path / "ckpt")))
    num_layers = _config(name, overrides).num_layers
    # The plan: the last rank holds no decoder layer but MTP; the rank before it the final norm.
    layouts = [r["layout"] for r in results]
    assert [lay["mtp"] for lay in layouts] == [False] * (pp - 1) + [True]
    assert [lay["final_norm"] for lay in layouts] == [False] * (pp - 2) + [True, False]
    assert layouts[-1]["layers"] == []
    assert [i for lay in layouts for i in lay["layers"]] == list(range(num_layers))
    # The MTP stage's embedding copy stayed bit-identical to the first stage's embedding.
    first, last = results[0]["embedding_copy"], results[-1]["embedding_copy"]
    assert first is not None and torch.equal(first, last)
    for result in results:
        _assert_equal_to_world1(result)
        assert result["saved_keys"] == result["world1_keys"]
        loaded, trained = result["loaded"], result["params"]
        assert any(not torch.equal(result["before_load"][k], loaded[k]) for k in loaded)
        for key in loaded:
            assert torch.equal(loaded[key], trained[key]), key


@pytest.mark.multirank
@pytest.mark.slow
@pytest.mark.parametrize("case", ["pp2-untied", "pp3-tied"])
def test_standalone_mtp_trains_like_world1_more_layouts(case):
    pp, name, overrides = CASES[case]
    for result in run_on_ranks(_train, pp, args=(pp, name, overrides)):
        _assert_equal_to_world1(result)


@pytest.mark.multirank
@pytest.mark.slow
def test_standalone_mtp_tp2_sequence_parallel_trains_like_world1():
    """pp=2 × tp=2 with sequence parallelism: the s/tp activation crosses to the MTP stage."""
    overrides = {"mtp": MTPConfig(num_layers=2, loss_coeff=0.3), "sequence_parallel": True}
    results = run_on_ranks(_train, 4, args=(2, "tiny-llama3-8b", overrides, None, False, 2))
    for result in results:
        _assert_equal_to_world1(result)


@pytest.mark.multirank
@pytest.mark.slow
def test_standalone_mtp_moe_trains_like_world1():
    for result in run_on_ranks(_train, 2, args=(2, "tiny-deepseek-v3", {})):
        _assert_equal_to_world1(result)


@pytest.mark.multirank
@pytest.mark.parametrize("case", ["pp2-tied", "pp2-untied"])
def test_planted_missing_embedding_sync_is_caught(case):
    pp, name, overrides = CASES[case]
    results = run_on_ranks(_train, pp, args=(pp, name, overrides, None, True))
    assert not torch.equal(results[0]["embedding_copy"], results[-1]["embedding_copy"])
    for result in results:
        with pytest.raises(AssertionError):
            _assert_equal_to_world1(result)


def test_standalone_option_is_checked_before_building():
    """pp=1, vpp>1, an MTP-less model and a non-zero last_stage_layers are refused by name."""
    cfg = _config("tiny-llama3-8b", {"mtp": MTPConfig()})
    with pytest.raises(ValueError, match=r"mtp_standalone=True needs pp >= 2.*got pp=1"):
        build_stage(cfg, ProcessGroups.single(), mtp_standalone=True)
    with pytest.raises(ValueError, match=r"mtp_standalone=True needs a model with multi-token"):
        build_stage(_config("tiny-llama3-8b", {}), ProcessGroups.single(), mtp_standalone=True)
    # The layout checks need no process group: the shared helper raises them.
    with pytest.raises(ValueError, match=r"needs vpp=1 or None, got vpp=2"):
        standalone_last_stage_layers(True, has_mtp=True, pp=2, vpp=2, last_stage_layers=None)
    with pytest.raises(ValueError, match=r"last_stage_layers=1 conflicts with mtp_standalone"):
        standalone_last_stage_layers(True, has_mtp=True, pp=2, vpp=None, last_stage_layers=1)
    with pytest.raises(ValueError, match=r"mtp_standalone='yes' is invalid"):
        standalone_last_stage_layers("yes", has_mtp=True, pp=2, vpp=None, last_stage_layers=None)
    assert standalone_last_stage_layers(True, has_mtp=True, pp=3, vpp=1, last_stage_layers=0) == 0
    assert (
        standalone_last_stage_layers(False, has_mtp=False, pp=1, vpp=None, last_stage_layers=2) == 2
    )
