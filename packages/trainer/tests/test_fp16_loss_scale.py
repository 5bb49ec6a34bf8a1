"""fp16 with the default dynamic loss scaler trains; real divergence still stops the run.

The scaler starts at 65,536 and overflows in the first steps while it finds its scale; those
skipped steps are no failures. Once the scale is at its floor, non-finite gradients stop the
run exactly as in bf16/fp32 (reliability.on_nan).
"""

import io
import math
import re

import pytest

import shardwork.trainer.run.trainer as trainer_module
from shardwork.trainer.observe.metrics import read_metrics
from shardwork.trainer.run.trainer import NonFiniteLossError, train
from shardwork.trainer.testing import tiny_config


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def _fp16_config(tmp_path, *, precision=None, **sections):
    return tiny_config(
        tmp_path,
        precision={"dtype": "fp16", **(precision or {})},
        schedule={"train_steps": 30},
        eval={"interval": None, "at_end": False},
        logging={"interval": 1},
        **sections,
    )


def test_default_fp16_config_trains_30_steps(tmp_path):
    config = _fp16_config(tmp_path)
    # the defaults under test: stop on the first non-finite step, dynamic scale from 2**16
    assert config.reliability.on_nan == "stop"
    assert config.precision.initial_loss_scale == 2.0**16
    stream = io.StringIO()
    result = train(config, stream=stream)
    losses = [result.train_losses[s] for s in range(30)]
    assert all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    # measured: first ~5.56, last ~3.04 nats/token (fp32, no skipped steps: 5.20 -> 2.46)
    assert last < first - 1.5, (first, last)
    assert result.skipped_steps == 0
    n = result.overflow_skips
    assert 1 <= n < 30, n  # the scaler did overflow at 65,536 and did settle
    # hysteresis 2: the first overflow is tolerated, each later one halves the scale, and no
    # growth within 30 steps (growth_interval 1000)
    records = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    scale_after = {r["step"]: r["loss_scale"] for r in records}
    assert scale_after[30] == 2.0**16 * 0.5 ** (n - 1)
    # said once, on the first update after the first overflow skips (a later overflow may
    # lower the scale again without a word): the scale and skip count of that step
    settled = [line for line in stream.getvalue().splitlines() if "loss scale settled" in line]
    assert len(settled) == 1, settled
    found = re.search(
        r"step (\d+): fp16 loss scale settled at (\S+) after (\d+) overflow", settled[0]
    )
    assert found, settled
    step, said_scale, said_skips = int(found[1]), float(found[2]), int(found[3])
    assert said_scale == scale_after[step] == 2.0**16 * 0.5 ** (said_skips - 1)
    # that many skipped steps came before it
    assert 1 <= said_skips <= n and step > said_skips
    assert settled[0].endswith(
        f"after {said_skips} overflow-skipped step(s) (normal for a dynamic scaler)"
    )


def _poison_gradients(monkeypatch) -> None:
    """Every backward gives the first parameter an infinite gradient, whatever the loss scale."""
    real = trainer_module.build_assembly

    def build(*args, **kwargs):
        assembly = real(*args, **kwargs)
        first = next(assembly.modules[0].parameters())
        first.register_hook(lambda g: g.new_full(g.shape, math.inf))
        return assembly

    monkeypatch.setattr(trainer_module, "build_assembly", build)


def test_nonfinite_gradients_stop_once_the_scale_is_at_its_floor(tmp_path, monkeypatch):
    _poison_gradients(monkeypatch)
    config = _fp16_config(tmp_path, precision={"initial_loss_scale": 16.0})
    with pytest.raises(NonFiniteLossError) as err:
        train(config)
    # by hand (hysteresis 2, floor 1): step 1 tolerated at 16, steps 2-5 halve 16 -> 1, all
    # overflow skips; step 6 overflows at the floor and stops the run (on_nan='stop'). Steps
    # are numbered from 1, as the step log lines number them.
    text = str(err.value)
    assert text.startswith("step 6: non-finite gradients at the loss scale's floor (1)"), text
    assert "reliability.on_nan='stop'" in text


def test_fp16_divergence_from_a_huge_lr_stops(tmp_path):
    config = _fp16_config(
        tmp_path,
        optimizer={"lr": 1e30, "min_lr": 0.0, "clip_grad": 0.0},
        reliability={"on_nan": "skip", "max_consecutive_skips": 2},
    )
    with pytest.raises(NonFiniteLossError, match="2 consecutive steps had loss nan"):
        train(config)
