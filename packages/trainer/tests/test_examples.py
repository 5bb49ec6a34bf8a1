"""Every example config loads and validates at the world size it names (GPU configs with the
built-in corpus standing in for their data paths)."""

import dataclasses
import re
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
    assert resolved.model.num_layers >= 1
