"""Checksums recorded at save are verified on demand; corrupt/truncated files are named by
`verify`, by `load` and by the ``shardwork-ckpt`` CLI."""

import json
import types
from importlib import metadata as importlib_metadata

import pytest
import torch

from shardwork.dist_checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    load,
    read_info,
    save,
    verify,
)
from shardwork.dist_checkpoint.cli import main
from shardwork.dist_checkpoint.testing import example_state


@pytest.fixture
def ckpt(tmp_path):
    manager = CheckpointManager(tmp_path, layout={"tp": 1, "dp": 1}, content_version=2)
    manager.save(4, example_state(0, 1, seed=4))
    return manager.step_path(4)


def test_verify_ok_and_recorded_metadata(ckpt):
    summary = verify(ckpt)
    info = read_info(ckpt)
    assert summary["files"] == len(info["files"]) == 2  # one data file + .metadata
    assert info["content_version"] == 2 and info["layout"] == {"tp": 1, "dp": 1}
    assert info["shardwork_version"] == importlib_metadata.version("shardwork-dist-checkpoint")
    assert info["torch_version"] == torch.__version__
    assert info["world_size"] == 1 and info["group_ranks"] == [0]
    assert info["user_metadata"] == {"step": 4}
    assert set(info["timings"]) == {"plan", "stage", "write"}
    assert info["keys"]["moment"] == {
        "kind": "tensor",
        "dtype": "float32",
        "global_shape": [5, 7],
        "paths": ["optimizer/moment"],
        "num_chunks": 1,
    }


def test_flipped_byte_is_named(ckpt):
    data = ckpt / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: checksum mismatch"):
        verify(ckpt)


def test_truncated_file_is_named_by_verify_load_and_cli(ckpt, capsys):
    data = ckpt / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: truncated"):
        verify(ckpt)
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: 100 bytes, recorded"):
        load(example_state(0, 1, seed=0, fill=False), ckpt)
    assert main(["verify", str(ckpt)]) == 1
    assert "__0_0.distcp" in capsys.readouterr().err


def test_cli_inspect_and_verify(ckpt, capsys):
    assert main(["verify", str(ckpt)]) == 0
    assert "ok: 2 files" in capsys.readouterr().out
    assert main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert "saved at        world size 1 (global ranks 0)" in out
    assert "layout          tp=1 dp=1" in out
    version = importlib_metadata.version("shardwork-dist-checkpoint")
    assert f"shardwork       {version}   torch {torch.__version__}" in out
    assert "content version 2" in out
    assert "matrix" in out and "(8, 6)" in out and "float32" in out
    assert main(["inspect", str(ckpt.parent)]) == 0  # a manager root: lists steps
    out = capsys.readouterr().out
    assert "step_000000004  complete" in out
    assert main(["inspect", "--json", str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 1
    (ckpt / "COMMITTED").unlink()
    assert main(["verify", str(ckpt)]) == 2


def test_layout_is_read_from_any_object_with_the_parallel_sizes(tmp_path, capsys):
    state = example_state(0, 1, seed=1)
    # duck typing: a ProcessGroups-like bundle (sizes on .config), or a config itself
    bundle = types.SimpleNamespace(
        config=types.SimpleNamespace(
            tp=2, pp=2, vpp=None, cp=1, ep=4, etp=1, dp=2, order="tp-cp-ep-dp-pp"
        ),
        tp=object(),  # a process group handle: not a size, never read
    )
    save(state, tmp_path / "bundle", layout=bundle)
    expected = {"tp": 2, "pp": 2, "vpp": None, "cp": 1, "ep": 4, "etp": 1, "dp": 2}
    assert read_info(tmp_path / "bundle")["layout"] == {**expected, "order": "tp-cp-ep-dp-pp"}
    save(state, tmp_path / "config", layout=types.SimpleNamespace(tp=4, dp=2))
    assert read_info(tmp_path / "config")["layout"] == {"tp": 4, "dp": 2}
    # no layout given: still the world size and ranks, and inspect says what is missing
    save(state, tmp_path / "none")
    info = read_info(tmp_path / "none")
    assert info["layout"] is None and info["world_size"] == 1 and info["group_ranks"] == [0]
    assert main(["inspect", str(tmp_path / "none")]) == 0
    assert "layout          not recorded" in capsys.readouterr().out
    # bad layouts are refused before anything is written
    for bad, match in ((42, "layout=42 is not valid"), ({"tp": object()}, "layout=.*JSON")):
        with pytest.raises(ValueError, match=match):
            save(state, tmp_path / "bad", layout=bad)
        with pytest.raises(ValueError, match=match):
            CheckpointManager(tmp_path / "bad", layout=bad)
    assert not (tmp_path / "bad").exists()


def test_layout_from_a_real_process_groups_bundle(tmp_path):
    parallel_state = pytest.importorskip("shardwork.parallel_state")
    groups = parallel_state.ProcessGroups.single()
    manager = CheckpointManager(tmp_path, layout=groups)
    manager.save(1, example_state(0, 1, seed=1))
    layout = read_info(manager.step_path(1))["layout"]
    c = groups.config
    assert layout == {
        name: getattr(c, name) for name in ("tp", "pp", "vpp", "cp", "ep", "etp", "dp", "order")
    }
    assert layout["tp"] == 1 and layout["dp"] == 1


def test_cli_verify_of_a_root_checks_every_complete_checkpoint(tmp_path, capsys):
    """``verify ROOT`` (what ``inspect ROOT`` already accepts): each complete step verified
    and listed, an interrupted save listed as such, a corrupt step named (exit 1)."""
    root = tmp_path / "checkpoints"
    manager = CheckpointManager(root, keep_last=5)
    for step in (2, 4):
        manager.save(step, example_state(0, 1, seed=step))
    manager.step_path(6).mkdir()  # an interrupted save: no marker
    assert main(["verify", str(root)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == [
        "step_000000002", "step_000000004", "step_000000006"
    ]  # fmt: skip
    assert "ok: 2 files" in out[0] and "ok: 2 files" in out[1] and "INCOMPLETE" in out[2]
    data = manager.step_path(4) / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    assert main(["verify", str(root)]) == 1
    assert "step_000000004" in capsys.readouterr().err


def test_cli_names_a_run_folder_as_one(tmp_path, capsys):
    """A training run's folder given where a checkpoint is expected: the message says where
    its checkpoints are instead of "no COMMITTED marker"."""
    run = tmp_path / "run"
    CheckpointManager(run / "checkpoints").save(3, example_state(0, 1, seed=3))
    (run / "metrics.jsonl").write_text("{}\n")
    for command in ("verify", "inspect"):
        assert main([command, str(run)]) == 2
        err = capsys.readouterr().err
        assert "is a training run's folder, not a checkpoint" in err, err
        assert f"in {str(run / 'checkpoints')!r}" in err, err


def test_cli_names_a_folder_without_checkpoint_files_as_not_a_checkpoint(tmp_path, capsys, ckpt):
    """A folder with no checkpoint file (or an empty one) was described as "not a complete
    checkpoint: no COMMITTED marker (the save was interrupted ...)", which sends the user
    looking for a broken save; an interrupted save (data and .metadata written, no marker)
    keeps that message."""
    other = tmp_path / "notes"
    other.mkdir()
    (other / "x.txt").write_text("hi\n")
    empty = tmp_path / "empty"
    empty.mkdir()
    for folder in (other, empty):
        for command in ("verify", "inspect"):
            assert main([command, str(folder)]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"shardwork-ckpt: {str(folder)!r} is not a checkpoint: ")
            assert "interrupted" not in err and "no step_* checkpoint folders" in err, err
    (ckpt / "COMMITTED").unlink()  # a save that never committed
    for command in ("verify", "inspect"):
        assert main([command, str(ckpt)]) == 2
        assert "no COMMITTED marker (the save was interrupted" in capsys.readouterr().err
