"""Resume verifies what it loads.

- A flipped byte in the newest checkpoint (its data file, DCP's ``.metadata`` or
  ``shardwork.json``) makes ``checkpoint.resume = "auto"`` say which file failed and fall back
  to the previous checkpoint; the losses after the fallback equal the uninterrupted run's from
  that step exactly (one process, same layout: bit-identical, as in test_train_e2e), and the
  corrupt step is saved over when the run reaches it.
- ``checkpoint.fallback = false`` stops (exit 4 under the CLI, one paragraph naming the file
  and the checkpoint, no traceback, nothing written); no intact checkpoint at all stops too.
- ``shardwork-generate`` reads through the same verified load: a corrupt file exits with 4.
- Resuming a checkpoint of another model width prints a short summary with the options that
  resume it, not every key.
- A hostile newest checkpoint (DCP metadata whose pickle would run ``touch``, checksums
  re-recorded to match) is refused without running it: ``auto`` falls back past it with equal
  losses, and ``shardwork-generate`` refuses it (exit 4).
"""

import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardwork.dist_checkpoint import CheckpointCorruptError, CheckpointRefusedError, verify
from shardwork.dist_checkpoint.hostile import RunsCommand, rewrite_metadata
from shardwork.trainer.run.checkpointing import ResumeError
from shardwork.trainer.run.trainer import train
from shardwork.trainer.testing import tiny_config

STEPS = 6
COMMON = {
    "schedule": {"train_steps": STEPS, "warmup_steps": 1},
    "eval": {"interval": None, "at_end": False},
}
SAVES = {"interval": 2, "keep_last": 5, "save_at_end": True}
NEWEST, EARLIER = "step_000000004", "step_000000002"


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[int, float], Path]:
    """The uninterrupted run: its losses per step and its checkpoints (steps 2, 4, 6)."""
    base = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))
        result = train(tiny_config(base / "full", **COMMON, checkpoint=SAVES), stream=io.StringIO())
    assert sorted(result.train_losses) == list(range(STEPS))
    return result.train_losses, base / "full" / "checkpoints"


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("SHARDWORK_CACHE", str(tmp_path_factory.getbasetemp() / "corpus"))


def _interrupted(reference, tmp_path: Path) -> Path:
    """The checkpoints a run killed after step 4's save leaves: steps 2 and 4."""
    root = tmp_path / "checkpoints"
    shutil.copytree(reference[1], root)
    shutil.rmtree(root / "step_000000006")
    return root


def _corrupt(ckpt: Path, kind: str) -> str:
    """Flip one byte of a file of ``kind`` in ``ckpt``; return the file's name."""
    if kind == "data file":
        target = max(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size)
        offset = target.stat().st_size // 2
    elif kind == "dcp metadata":
        target = ckpt / ".metadata"
        offset = target.stat().st_size // 2
    else:  # a digit of a number: shardwork.json stays valid JSON, only its CRC tells
        target = ckpt / "shardwork.json"
        offset = target.read_bytes().find(b'"created_unix": ') + 16
    raw = bytearray(target.read_bytes())
    raw[offset] ^= 0x01
    target.write_bytes(bytes(raw))
    return target.name


def _resume(root: Path, run: Path, **checkpoint):
    config = tiny_config(
        run, **COMMON, checkpoint={**SAVES, "dir": str(root), "resume": "auto", **checkpoint}
    )
    stream = io.StringIO()
    return train(config, stream=stream), stream.getvalue()


@pytest.mark.parametrize("kind", ["data file", "dcp metadata", "shardwork json"])
def test_corrupt_newest_checkpoint_falls_back_with_equal_losses(reference, tmp_path, kind):
    root = _interrupted(reference, tmp_path)
    name = _corrupt(root / NEWEST, kind)
    result, text = _resume(root, tmp_path / "resumed")
    assert f"{root / NEWEST}" in text and f"{name}: checksum mismatch" in text, text
    assert "fell back to step 2" in text and f"resumed from {root / EARLIER}" in text, text
    assert sorted(result.train_losses) == list(range(2, STEPS))
    for step in range(2, STEPS):
        assert result.train_losses[step] == reference[0][step], step
    verify(root / NEWEST)  # saved over when the run reached step 4 again


def test_fallback_off_stops_naming_file_and_checkpoint(reference, tmp_path):
    root = _interrupted(reference, tmp_path)
    name = _corrupt(root / NEWEST, "data file")
    with pytest.raises(CheckpointCorruptError) as info:
        _resume(root, tmp_path / "resumed", fallback=False)
    for needle in (str(root / NEWEST), name, "checksum mismatch", "--checkpoint.fallback True"):
        assert needle in str(info.value), str(info.value)
    assert not (tmp_path / "resumed").exists()


def test_no_intact_checkpoint_stops(reference, tmp_path):
    root = _interrupted(reference, tmp_path)
    for step in (NEWEST, EARLIER):
        _corrupt(root / step, "data file")
    with pytest.raises(
        ResumeError, match=r"every checkpoint in .* \(steps \[2, 4\]\) failed verification"
    ):
        _resume(root, tmp_path / "resumed")


def _cli(scratch: Path, config) -> subprocess.CompletedProcess:
    from shardwork.trainer.config.load import config_to_toml

    (scratch / "run.toml").write_text(config_to_toml(config))
    return subprocess.run(
        [sys.executable, "-m", "shardwork.trainer", "--config", str(scratch / "run.toml")],
        env=dict(os.environ, WORLD_SIZE="1", RANK="0"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=scratch,
    )


def test_cli_fallback_off_exits_4_with_one_paragraph(reference, tmp_path):
    root = _interrupted(reference, tmp_path)
    name = _corrupt(root / NEWEST, "data file")
    checkpoint = {**SAVES, "dir": str(root), "resume": "auto", "fallback": False}
    proc = _cli(tmp_path, tiny_config(tmp_path / "resumed", **COMMON, checkpoint=checkpoint))
    assert proc.returncode == 4, proc.stderr
    message = proc.stderr.strip()
    assert "Traceback" not in message and "\n" not in message, message
    assert message.startswith("shardwork-train: cannot resume: checkpoint")
    assert str(root / NEWEST) in message and f"{name}: checksum mismatch" in message
    assert not (tmp_path / "resumed").exists()


def test_generate_refuses_a_corrupt_checkpoint(reference, tmp_path, capsys):
    from shardwork.trainer.generate import main
    from shardwork.trainer.inference import load_for_inference

    ckpt = tmp_path / "step_000000006"
    shutil.copytree(reference[1] / "step_000000006", ckpt)
    name = _corrupt(ckpt, "data file")
    with pytest.raises(CheckpointCorruptError, match=f"{name}: checksum mismatch"):
        load_for_inference(ckpt)
    assert main([str(ckpt), "--prompt", "def "]) == 4
    err = capsys.readouterr().err
    assert str(ckpt) in err and name in err and "Traceback" not in err
    assert f"`shardwork-ckpt verify {tmp_path}` lists which checkpoints there are intact" in err


def test_other_width_is_summarised_with_the_cli_remedy(reference, tmp_path):
    """The checkpoint has hidden_size 32; this run asks for 48: dozens of tensors differ."""
    saved = reference[1] / "step_000000006"
    wider = tiny_config(
        tmp_path / "wider",
        **COMMON,
        model={"hidden_size": 48, "ffn_hidden_size": 96},
        checkpoint={"resume": str(saved)},
    )
    proc = _cli(tmp_path, wider)
    assert proc.returncode == 4, proc.stderr
    message = proc.stderr
    assert "Traceback" not in message and len(message) < 1500, message
    count = re.search(r"(\d+) with another shape or kind", message)
    assert count and int(count.group(1)) > 10, message  # every layer's weights differ
    shapes = re.findall(
        r"checkpoint has global shape \(([\d, ]+)\), this run has global shape \(([\d, ]+)\)",
        message,
    )
    assert len(shapes) == 3, message  # the first three, not all of them
    for saved_shape, run_shape in shapes:  # a real mismatch: 32 wide vs 48 wide somewhere
        assert saved_shape != run_shape and ("32" in saved_shape or "64" in saved_shape)
    assert "--model.hidden_size 32" in message and "--model.ffn_hidden_size 64" in message
    assert "--checkpoint.resume none" in message
    assert not (tmp_path / "wider").exists()


def _plant(ckpt: Path, marker: Path) -> None:
    rewrite_metadata(ckpt, lambda m: m.planner_data.update(planted=RunsCommand(f"touch {marker}")))


def test_hostile_newest_checkpoint_is_refused_and_skipped(reference, tmp_path):
    root = _interrupted(reference, tmp_path)
    marker = tmp_path / "marker"
    _plant(root / NEWEST, marker)
    result, text = _resume(root, tmp_path / "resumed")
    assert "refused to decode DCP metadata" in text and "posix.system" in text, text
    assert "fell back to step 2" in text, text
    for step in range(2, STEPS):
        assert result.train_losses[step] == reference[0][step], step
    assert not marker.exists()


def test_generate_refuses_a_hostile_checkpoint(reference, tmp_path, capsys):
    from shardwork.trainer.generate import main
    from shardwork.trainer.inference import load_for_inference

    ckpt = tmp_path / "step_000000006"
    shutil.copytree(reference[1] / "step_000000006", ckpt)
    marker = tmp_path / "marker"
    _plant(ckpt, marker)
    with pytest.raises(CheckpointRefusedError, match=r"posix\.system"):
        load_for_inference(ckpt)
    assert main([str(ckpt), "--prompt", "def "]) == 4
    err = capsys.readouterr().err
    assert "refused" in err and "Traceback" not in err
    assert not marker.exists()


def test_resuming_past_train_steps_says_there_is_nothing_to_train(reference, tmp_path):
    """The step-4 checkpoint resumed with ``train_steps=3``: no step runs, and a notice says
    why instead of the run ending silently."""
    root = _interrupted(reference, tmp_path)
    config = tiny_config(
        tmp_path / "run",
        schedule={"train_steps": 3, "warmup_steps": 1},
        eval={"interval": None, "at_end": False},
        checkpoint={**SAVES, "dir": str(root), "resume": "auto"},
    )
    stream = io.StringIO()
    result = train(config, stream=stream)
    assert result.train_losses == {}
    assert "the checkpoint is at step 4, at or past schedule.train_steps=3" in stream.getvalue()
