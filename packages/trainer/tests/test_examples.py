"""Every example config loads and validates at the world size it names (GPU configs with the
built-in corpus standing in for their data paths); one CPU example runs under torchrun (slow)."""

import dataclasses
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardwork.trainer.config.load import load_config
from shardwork.trainer.config.sections import DataConfig
from shardwork.trainer.config.validate import validate_config

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
CONFIGS = sorted(EXAMPLES.glob("*/*.toml"))


def test_examples_exist():
    names = {p.relative_to(EXAMPLES).as_posix() for p in CONFIGS}
    assert {"gpu/llama3-8b.toml", "gpu/mixtral-8x7b.toml", "gpu/deepseek-v3.toml"} <= names
    assert len([n for n in names if n.startswith("cpu/")]) >= 5
    assert "cpu/cp2.toml" in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.relative_to(EXAMPLES).as_posix())
def test_example_validates_at_its_world_size(path, tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path))
    text = path.read_text()
    match = re.search(r"^# world_size = (\d+)$", text, re.M)
    assert match, f"{path} must name its world size in a '# world_size = N' comment"
    config = load_config(path)
    if path.parent.name == "gpu":
        data = DataConfig(seq_length=config.data.seq_length, split="98,2,0")
        config = dataclasses.replace(config, data=data)
        monkeypatch.chdir(EXAMPLES.parent)
    resolved = validate_config(config, world_size=int(match.group(1)))
    assert resolved.model.settings["num_layers"] >= 1


@pytest.mark.slow
def test_context_parallel_example_runs_under_torchrun(tmp_path):
    """examples/cpu/cp2.toml on 2 processes through torch.distributed.run, shortened to 3
    steps: it exits 0 and logs a finite loss every step and a finite validation loss."""
    from shardwork.trainer.observe.metrics import read_metrics

    config = EXAMPLES / "cpu" / "cp2.toml"
    assert re.search(r"^# world_size = 2$", config.read_text(), re.M)
    run_dir = tmp_path / "run"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "shardwork.trainer",
        "--config",
        str(config),
        "--schedule.train_steps",
        "3",
        "--schedule.warmup_steps",
        "1",
        "--eval.steps",
        "1",
        "--logging.interval",
        "1",
        "--logging.run_dir",
        str(run_dir),
        "--logging.plot",
        "false",
        "--logging.tensorboard",
        "false",
        "--checkpoint.save_at_end",
        "false",
    ]
    env = {**os.environ, "SHARDWORK_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(tp=1 pp=1 cp=2 ep=1 dp=1)" in out.stderr
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and 3.0 < r["loss"] < 7.0 for r in train)
    assert [r["step"] for r in valid] == [3] and math.isfinite(valid[0]["loss"])
