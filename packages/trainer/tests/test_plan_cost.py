"""The planner's memory and step-time model against independent computations in the test.

Memory must equal ``shardwork.models.calculator.memory_estimate`` (which walks the trainer's
schedule for the activations in flight, interleaved ones included), of the model with the fused
kernels a GPU run uses; each step-time term is recomputed here from its formula
(docs/planner.md) with the calculator's FLOPs, on a network made infinitely fast where a
term must vanish.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from shardwork.models import preset
from shardwork.models.calculator import flops_per_token, memory_estimate
from shardwork.models.calculator_memory import local_parameters
from shardwork.trainer.plan.cluster import GPUS, Cluster
from shardwork.trainer.plan.layouts import Layout
from shardwork.trainer.plan.planner import USABLE_MEMORY, plan, planning_model, price
from shardwork.trainer.plan.step_time import step_time

MODEL = preset("llama3-8b", params_dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
BATCH, SEQ, EFF = 128, 4096, 0.55
H100 = GPUS["h100-sxm"]


def _cluster(n=64, *, nvlink=H100.nvlink, internode=50e9):
    return Cluster(gpu=dataclasses.replace(H100, nvlink=nvlink), num_gpus=n, gpus_per_node=8,
                   internode=internode)  # fmt: skip


def _price(layout, cluster):
    return price(MODEL, layout, cluster, global_batch=BATCH, seq_length=SEQ, efficiency=EFF)


def _time(layout, cluster):
    """The step time whether or not the layout fits in memory."""
    return step_time(MODEL, layout, cluster, global_batch=BATCH, seq_length=SEQ, efficiency=EFF)


@pytest.mark.parametrize(
    "layout",
    [Layout(2, 1, 2, 16, micro_batch=2), Layout(8, 1, 4, 2, recompute="full"),
     Layout(4, 2, 1, 8, recompute="selective"), Layout(2, 1, 4, 8, vpp=2),
     Layout(2, 1, 4, 8, vpp=2, first_virtual_stage_layers=3, last_virtual_stage_layers=5)],
)  # fmt: skip
def test_memory_is_the_calculators(layout):
    row = _price(layout, _cluster())
    est = memory_estimate(
        MODEL.replace(sequence_parallel=layout.tp > 1), seq_length=SEQ,
        micro_batch_size=layout.micro_batch, tp=layout.tp, pp=layout.pp, dp=layout.dp,
        cp=layout.cp, vpp=layout.vpp if layout.vpp > 1 else None,
        num_microbatches=BATCH // (layout.dp * layout.micro_batch), recompute=layout.recompute,
        first_virtual_stage_layers=layout.first_virtual_stage_layers,
        last_virtual_stage_layers=layout.last_virtual_stage_layers,
    )  # fmt: skip
    assert row.memory == est.total
    assert (row.refused is None) == (row.memory <= USABLE_MEMORY * H100.memory)


def test_plan_prices_the_fused_kernels_a_gpu_run_uses():
    """plan() prices the model as a GPU run trains it: bf16 and kernel_backend="triton" (what
    "auto" resolves to on CUDA), whose norms and SwiGLU save less than the reference kernels."""
    result = plan(MODEL, _cluster(), global_batch=BATCH, seq_length=SEQ, eff=EFF)
    assert result.model == planning_model(MODEL)
    assert result.model.kernel_backend == "triton"
    row = next(r for r in result.rows if r.layout.recompute == "none")
    lay = row.layout
    kw = dict(
        seq_length=SEQ, micro_batch_size=lay.micro_batch, tp=lay.tp, pp=lay.pp, dp=lay.dp,
        cp=lay.cp, vpp=lay.vpp if lay.vpp > 1 else None, recompute=lay.recompute,
        num_microbatches=BATCH // (lay.dp * lay.micro_batch), **lay.split,
    )  # fmt: skip
    fused = memory_estimate(result.model.replace(sequence_parallel=lay.tp > 1), **kw)
    reference = memory_estimate(MODEL.replace(sequence_parallel=lay.tp > 1), **kw)
    assert row.memory == fused.total
    assert fused.activations < reference.activations


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_compute_time_is_hardware_flops_over_the_achievable_rate(recompute):
    n = 64
    lay = Layout(1, 1, 1, n, micro_batch=2, recompute=recompute)
    t = _time(lay, _cluster(nvlink=math.inf, internode=math.inf))
    f = flops_per_token(MODEL, SEQ)
    if recompute == "full":
        f = flops_per_token(MODEL, SEQ, full_recompute=True)
    if recompute == "selective":  # the causal scores' forward once more: QK^T and AV
        a, d = MODEL.num_attention_heads, MODEL.kv_channels
        f += MODEL.num_layers * 4 * SEQ * a * d * 0.5
    expected = f * BATCH * SEQ / (n * H100.peak_bf16 * EFF)
    assert t.compute == pytest.approx(expected, rel=1e-12)
    assert t.total == pytest.approx(expected, rel=1e-12)  # no bubble, no traffic


@pytest.mark.parametrize(("pp", "vpp"), [(4, 1), (4, 2), (8, 4)])
def test_bubble_is_pp_minus_one_over_vpp_micro_batches(pp, vpp):
    dp = 64 // (2 * pp)
    lay = Layout(2, 1, pp, dp, vpp=vpp, recompute="full")
    t = _time(lay, _cluster(nvlink=math.inf, internode=math.inf))
    m = BATCH // dp
    assert t.bubble / t.compute == pytest.approx((pp - 1) / (vpp * m), rel=1e-12)


def test_tensor_parallel_traffic_formula():
    """Sequence parallel: 2 all-gathers + 2 reduce-scatters of T·h bf16 per layer and pass."""
    tp, pp, dp, mb = 4, 2, 8, 2
    lay = Layout(tp, 1, pp, dp, micro_batch=mb, recompute="full")
    t = _time(lay, _cluster())
    tokens, layers, m = mb * SEQ, MODEL.num_layers // pp, BATCH // (dp * mb)
    per_layer = 4 * 3 * (tp - 1) / tp * tokens * MODEL.hidden_size * 2  # 3 passes: recompute
    assert t.tp == pytest.approx(m * layers * per_layer / H100.nvlink, rel=1e-12)


def test_data_parallel_traffic_is_exposed_only_beyond_one_micro_batch():
    lay = Layout(8, 1, 1, 8)
    fast = _time(lay, _cluster(internode=math.inf))
    assert fast.dp == 0.0
    slow_bw = 1e9
    slow = _time(lay, _cluster(internode=slow_bw))
    p = local_parameters(MODEL, tp=8).total
    rs, ag = 7 / 8 * p * 4 / slow_bw, 7 / 8 * p * 2 / slow_bw
    t_mb = slow.compute / (BATCH // 8)
    assert slow.dp == pytest.approx(max(0, rs - 2 / 3 * t_mb) + max(0, ag - t_mb / 3), rel=1e-9)
    assert slow.dp > 0


def test_plan_ranks_by_step_time_and_reports_mfu():
    result = plan(MODEL, _cluster(), global_batch=BATCH, seq_length=SEQ, eff=EFF)
    ranked = result.ranked()
    times = [r.time.total for r in ranked]
    assert times == sorted(times) and len(ranked) > 5
    assert len({r.layout.parallel_key for r in ranked}) == len(ranked)
    best = ranked[0]
    flops = flops_per_token(result.model, SEQ) * BATCH * SEQ
    assert best.mfu == pytest.approx(flops / (best.time.total * 64 * H100.peak_bf16), rel=1e-12)
    for row in result.rows:  # every fitting variant is no faster than its layout's best
        key_best = next(r for r in ranked if r.layout.parallel_key == row.layout.parallel_key)
        assert row.time.total >= key_best.time.total
    assert all(r.refused and "GiB" in r.refused for r in result.refused)
