"""Checksums recorded at save are verified on demand; corrupt/truncated files are named by
`verify`, by `load` and by the ``shardwork-ckpt`` CLI."""

import json

import pytest

from shardwork.dist_checkpoint import (
    CheckpointCorruptError,
    CheckpointManager,
    load,
    read_info,
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
    assert "layout {'dp': 1, 'tp': 1}" in out and "world size 1" in out
    assert "matrix" in out and "(8, 6)" in out and "float32" in out
    assert main(["inspect", str(ckpt.parent)]) == 0  # a manager root: lists steps
    out = capsys.readouterr().out
    assert "step_000000004  complete" in out
    assert main(["inspect", "--json", str(ckpt)]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 1
    (ckpt / "COMMITTED").unlink()
    assert main(["verify", str(ckpt)]) == 2
