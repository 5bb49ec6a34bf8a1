"""bf16 params with fp32 masters, fp16 dynamic loss scaling with inf/nan skipping, bf16 moments."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from shardwork.dist_optimizer import (
    AdamW,
    ConstantLossScaler,
    DDPConfig,
    DistributedDataParallel,
    DistributedOptimizer,
    DynamicLossScaler,
    OptimizerConfig,
)
from shardwork.parallel_state import ParallelConfig, init_process_groups
from shardwork.parallel_state.testing import run_on_ranks

IN, HID, OUT, BATCH, STEPS, ACCUM = 8, 16, 4, 4, 3, 2


def build_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT)).to(dtype)


def data(dp: int):
    g = torch.Generator().manual_seed(6)
    return torch.randn(STEPS, ACCUM, dp * BATCH, IN, generator=g), torch.randn(
        STEPS, ACCUM, dp * BATCH, OUT, generator=g
    )


def adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1)


def _run_bf16():
    pg = init_process_groups(ParallelConfig())
    dp, rank = pg.size("dp"), pg.rank("dp")
    model = build_model(torch.bfloat16)
    cfg = DDPConfig(use_distributed_optimizer=True, bucket_size=64, pad_multiple=1)
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    opt = DistributedOptimizer(ddp, adamw, process_groups=pg)
    assert all(mp.master.dtype == torch.float32 for mp in opt.pieces)
    x, y = data(dp)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    norms = []
    for s in range(STEPS):
        opt.zero_grad()
        for m in range(ACCUM):
            ctx = ddp.no_sync() if m < ACCUM - 1 else contextlib.nullcontext()
            with ctx:
                out = ddp(x[s, m, local].bfloat16()).float()
                (nn.functional.mse_loss(out, y[s, m, local]) / ACCUM).backward()
        norms.append(opt.step().grad_norm)
    ddp.finish_param_sync()
    return [p.detach().float().clone() for p in model.parameters()], norms


@pytest.mark.multirank
def test_bf16_params_with_fp32_masters_match_fp32_master_reference():
    results = run_on_ranks(_run_bf16, 2)
    model = build_model(torch.bfloat16)
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = adamw(masters)
    x, y = data(2)
    ref_norms = []
    for s in range(STEPS):
        acc = [torch.zeros_like(m) for m in masters]
        for m in range(ACCUM):
            model.zero_grad()
            out = model(x[s, m].bfloat16()).float()
            (nn.functional.mse_loss(out, y[s, m]) / ACCUM).backward()
            for a, p in zip(acc, model.parameters()):
                a += p.grad.float()  # each micro-batch's bf16 grad into fp32
        for mst, a in zip(masters, acc):
            mst.grad = a
        ref_norms.append(float(nn.utils.clip_grad_norm_(masters, 1e30)))
        opt.step()
        with torch.no_grad():
            for p, mst in zip(model.parameters(), masters):
                p.copy_(mst)
    for params, norms in results:
        for got, want in zip(params, model.parameters()):
            torch.testing.assert_close(got, want.detach().float(), rtol=1e-2, atol=1e-2)
        # bf16 forward/backward on half the batch per rank vs the whole batch: measured
        # relative differences <= 6e-4; 3e-3 still fails a 1 % scale error
        assert norms == pytest.approx(ref_norms, rel=3e-3)


def _run_fp16_skip():
    pg = init_process_groups(ParallelConfig())
    dp, rank = pg.size("dp"), pg.rank("dp")
    model = build_model(torch.float16)
    cfg = DDPConfig(use_distributed_optimizer=True, bucket_size=64, pad_multiple=1)
    ddp = DistributedDataParallel(model, config=cfg, process_groups=pg)
    scaler = DynamicLossScaler(initial_scale=2.0**10, hysteresis=1, growth_interval=100)
    opt = DistributedOptimizer(
        ddp, adamw, process_groups=pg, loss_scaler=scaler, config=OptimizerConfig(clip_grad=1.0)
    )
    x, y = data(dp)
    local = slice(rank * BATCH, (rank + 1) * BATCH)
    log = []
    for s in range(STEPS):
        before = [p.detach().clone() for p in model.parameters()]
        opt.zero_grad()
        out = ddp(x[s, 0, local].half()).float()
        loss = nn.functional.mse_loss(out, y[s, 0, local])
        if s == 1 and rank == 1:
            loss = loss * float("inf")  # overflow on one rank only
        (loss * opt.loss_scale).backward()
        result = opt.step()
        ddp.finish_param_sync()
        changed = any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        log.append((result.update_successful, changed, opt.loss_scale, result.grad_norm))
    return log


@pytest.mark.multirank
def test_fp16_loss_scaling_skips_nonfinite_step_on_every_rank():
    logs = run_on_ranks(_run_fp16_skip, 2)
    for log in logs:
        assert [ok for ok, *_ in log] == [True, False, True]
        assert [changed for _, changed, *_ in log] == [True, False, True]
        assert [scale for *_, scale, _ in log] == [1024.0, 512.0, 512.0]
        assert log[1][3] is None and log[0][3] > 0
    # ranks agree on the (unscaled) gradient norm
    assert logs[0][0][3] == pytest.approx(logs[1][0][3])


def test_adamw_matches_torch_and_bf16_moments_are_close():
    torch.manual_seed(0)
    base = torch.randn(50)
    grads = [torch.randn(50) for _ in range(5)]
    results = {}
    for name, factory in {
        "torch": lambda p: torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1),
        "fp32": lambda p: AdamW([p], lr=1e-2, weight_decay=0.1),
        "bf16": lambda p: AdamW([p], lr=1e-2, weight_decay=0.1, state_dtype=torch.bfloat16),
    }.items():
        p = base.clone()
        opt = factory(p)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        results[name] = (p, opt.state[p])
    torch.testing.assert_close(results["fp32"][0], results["torch"][0], rtol=1e-6, atol=1e-7)
    assert results["bf16"][1]["exp_avg"].dtype == torch.bfloat16
    torch.testing.assert_close(results["bf16"][0], results["torch"][0], rtol=1e-2, atol=1e-3)
    assert not torch.equal(results["bf16"][0], results["torch"][0])


def test_dynamic_loss_scaler_hysteresis_and_growth():
    s = DynamicLossScaler(initial_scale=8.0, hysteresis=2, growth_interval=2)
    s.update(True)
    assert s.scale == 8.0  # first overflow tolerated
    s.update(True)
    assert s.scale == 4.0
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=1.5)


def test_can_back_off_until_the_scale_reaches_its_floor():
    s = DynamicLossScaler(initial_scale=8.0, min_scale=2.0, hysteresis=1)
    seen = []
    for _ in range(4):
        seen.append((s.scale, s.can_back_off))
        s.update(True)
    # by hand: 8 -> 4 -> 2, then the scale stays at min_scale and can drop no further
    assert seen == [(8.0, True), (4.0, True), (2.0, False), (2.0, False)]
    assert ConstantLossScaler(1024.0).can_back_off is False


def test_bf16_gradient_buffers_feed_fp32_masters():
    """grad_reduce_in_fp32=False: bf16 main_grad, copied into fp32 master grads each step."""
    model = build_model(torch.bfloat16)
    ddp = DistributedDataParallel(
        model, config=DDPConfig(use_distributed_optimizer=True, grad_reduce_in_fp32=False)
    )
    opt = DistributedOptimizer(ddp, adamw)
    assert {p.main_grad.dtype for p in model.parameters()} == {torch.bfloat16}
    ref = build_model(torch.bfloat16)
    masters = [p.detach().float().clone() for p in ref.parameters()]
    ref_opt = adamw(masters)
    x, y = data(1)
    for s in range(STEPS):
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x[s, 0].bfloat16()).float(), y[s, 0]).backward()
        opt.step()
        ref.zero_grad()
        nn.functional.mse_loss(ref(x[s, 0].bfloat16()).float(), y[s, 0]).backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), masters):
                p.copy_(m)
    assert all(mp.master.dtype == torch.float32 for mp in opt.pieces)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-2, atol=1e-2)
    assert ddp.state_dict().keys() == model.state_dict().keys()
