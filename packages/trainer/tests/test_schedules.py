"""LR, weight-decay and batch-size schedules against hand-computed values."""

import math

import pytest

from shardwork.trainer.config.sections import OptimizerSection, ScheduleConfig
from shardwork.trainer.schedules import batch_size, consumed_samples, learning_rate, weight_decay

OPT = OptimizerSection(lr=1.0, min_lr=0.1)


def lr(step, **kw):
    return learning_rate(step, ScheduleConfig(**kw), OPT)


def test_warmup_is_linear_from_the_first_step():
    assert [lr(s, warmup_steps=4, train_steps=20) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


@pytest.mark.parametrize(
    ("kind", "step", "want"),
    [
        ("constant", 15, 1.0),
        # t = (step - W) / (D - W) with W=10, D=110
        ("linear", 10, 1.0),
        ("linear", 60, 0.1 + 0.9 * 0.5),
        ("linear", 85, 0.1 + 0.9 * 0.25),
        ("linear", 110, 0.1),
        ("linear", 500, 0.1),
        ("cosine", 60, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))),
        ("cosine", 35, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25))),
        ("cosine", 110, 0.1),
        # inverse sqrt: peak * sqrt(W) / sqrt(step + 1)
        ("inverse_sqrt", 39, math.sqrt(10) / math.sqrt(40)),
        ("inverse_sqrt", 10_000, 0.1),
    ],
)
def test_decays(kind, step, want):
    got = lr(step, lr_schedule=kind, warmup_steps=10, train_steps=110)
    assert got == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize(
    ("style", "u", "coeff"),
    [
        ("linear", 0.25, 0.75),
        ("cosine", 0.5, 0.5),
        ("exponential", 0.5, 2 * 0.5**0.5 - 1),
        ("minus_sqrt", 0.25, 0.5),
    ],
)
def test_wsd(style, u, coeff):
    kw = dict(
        lr_schedule="wsd",
        warmup_steps=10,
        train_steps=110,
        wsd_decay_steps=20,
        wsd_decay_style=style,
    )
    assert lr(50, **kw) == 1.0  # stable phase
    assert lr(89, **kw) == 1.0
    assert lr(90 + int(u * 20), **kw) == pytest.approx(0.1 + 0.9 * coeff, rel=1e-12)
    assert lr(110, **kw) == pytest.approx(0.1)


def test_wsd_default_decay_is_20_percent():
    kw = dict(lr_schedule="wsd", warmup_steps=0, train_steps=100)
    assert lr(79, **kw) == 1.0 and lr(80, **kw) == 1.0 and lr(90, **kw) == pytest.approx(0.55)


def test_weight_decay_schedules():
    lin = OptimizerSection(weight_decay=0.0, weight_decay_end=0.2, weight_decay_schedule="linear")
    cos = OptimizerSection(weight_decay=0.0, weight_decay_end=0.2, weight_decay_schedule="cosine")
    assert weight_decay(25, lin, train_steps=100) == pytest.approx(0.05)
    assert weight_decay(50, cos, train_steps=100) == pytest.approx(0.1)
    assert weight_decay(25, cos, train_steps=100) == pytest.approx(
        0.1 * (1 - math.cos(math.pi / 4))
    )
    assert weight_decay(7, OptimizerSection(weight_decay=0.3), train_steps=100) == 0.3


def test_batch_size_ramp_and_consumed_samples():
    ramp = [(10, 8), (20, 16)]
    sizes = [batch_size(s, global_batch_size=4, ramp=ramp) for s in range(25)]
    assert sizes == [4] * 10 + [8] * 10 + [16] * 5
    for step in range(26):
        assert consumed_samples(step, global_batch_size=4, ramp=ramp) == sum(sizes[:step])
    assert consumed_samples(5, global_batch_size=4, ramp=[(0, 2)]) == 10
