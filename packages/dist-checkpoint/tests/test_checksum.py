"""The CRC-32 implementations give zlib's values, so checkpoints verify whichever one wrote them.

ISA-L's CRC-32 (`isal`, the ``fast-crc`` extra, in the test group) is compared with the standard
library's ``zlib.crc32`` on random bytes, whole and continued piece by piece; then a checkpoint
with a multi-slice payload (over `datafile`'s 4 MiB slices, so the combine path runs) is saved
with each implementation: the data files are byte-identical, every recorded CRC equals
``zlib.crc32`` of the file on disk, each loads and verifies under the other implementation, and a
flipped payload byte is caught under both."""

import json
import zlib
from pathlib import Path

import pytest
import torch

from shardwork.dist_checkpoint import CheckpointCorruptError, ShardedTensor, load, save, verify
from shardwork.dist_checkpoint.checksum import (
    available_crc32,
    crc32,
    crc32_implementation,
    select_crc32,
)

pytest.importorskip("isal", reason="the fast-crc extra (isal) is not installed")

BIG = 5 * 2**20 // 4 + 3  # float32 elements: a payload of 5 MiB + 12 bytes (two slices + tail)


@pytest.fixture(autouse=True)
def _restore_implementation():
    previous = crc32_implementation()
    yield
    select_crc32(previous)


@pytest.mark.parametrize("length", [0, 1, 63, 4096 + 5, 3 * 2**20 + 7])
def test_isal_equals_zlib_whole_and_continued(length):
    gen = torch.Generator().manual_seed(length)
    data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=gen).numpy().tobytes()
    select_crc32("isal")
    assert crc32(data) == zlib.crc32(data)
    # Continued over uneven pieces from a non-zero start value, as DataFile and FileCheck do.
    cuts = sorted(torch.randint(0, length + 1, (4,), generator=gen).tolist())
    value, start = 12345, 0
    for end in [*cuts, length]:
        value = crc32(memoryview(data)[start:end], value)
        start = end
    assert value == zlib.crc32(data, 12345)


def test_unknown_implementation_is_refused():
    with pytest.raises(ValueError, match=r"'crc64' is not available; valid: \['isal', 'zlib'\]"):
        select_crc32("crc64")
    assert crc32_implementation() in available_crc32()


def _state() -> dict:
    gen = torch.Generator().manual_seed(11)
    big = torch.randn(BIG, generator=gen)
    small = torch.randn(6, 5, generator=gen)
    return {
        "model": {
            "big": ShardedTensor("big", big, (BIG,), (0,)),
            "small": ShardedTensor("small", small, (6, 5), (0, 0)),
        },
        "step": 7,
    }


def _template() -> dict:
    return {
        "model": {
            "big": ShardedTensor("big", torch.full((BIG,), float("nan")), (BIG,), (0,)),
            "small": ShardedTensor("small", torch.full((6, 5), float("nan")), (6, 5), (0, 0)),
        },
        "step": 0,
    }


def _recorded(ckpt: Path) -> dict:
    return json.loads((ckpt / "shardwork.json").read_text())["files"]


def test_checkpoints_agree_and_verify_across_implementations(tmp_path):
    written = {}
    for name in ("zlib", "isal"):
        select_crc32(name)
        save(_state(), tmp_path / name)
        written[name] = tmp_path / name
    data_files = sorted(f.name for f in written["zlib"].glob("*.distcp"))
    assert data_files == sorted(f.name for f in written["isal"].glob("*.distcp"))
    for name in data_files:
        assert (written["zlib"] / name).read_bytes() == (written["isal"] / name).read_bytes()
    for ckpt in written.values():
        for name, record in _recorded(ckpt).items():
            raw = (ckpt / name).read_bytes()
            assert record == {"size": len(raw), "crc32": zlib.crc32(raw)}, name
    expected = _state()["model"]
    for writer, reader in (("zlib", "isal"), ("isal", "zlib")):
        select_crc32(reader)
        verify(written[writer])
        loaded = load(_template(), written[writer])
        for key in ("big", "small"):
            assert torch.equal(loaded["model"][key], expected[key].data)
        assert loaded["step"] == 7


@pytest.mark.parametrize("name", ["zlib", "isal"])
def test_flipped_payload_byte_is_caught(tmp_path, name):
    select_crc32(name)
    save(_state(), tmp_path / "ckpt")
    data_file = tmp_path / "ckpt" / "__0_0.distcp"
    raw = bytearray(data_file.read_bytes())
    # A byte in the second 4 MiB slice of the big payload (after its first slice's CRC).
    needle = _state()["model"]["big"].data.numpy().tobytes()
    at = raw.find(needle[: 2**12]) + 4 * 2**20 + 1000
    raw[at] ^= 0x01
    data_file.write_bytes(bytes(raw))
    recorded = _recorded(tmp_path / "ckpt")["__0_0.distcp"]["crc32"]
    found = zlib.crc32(bytes(raw))
    message = f"checksum mismatch \\(crc32 {found:08x}, recorded {recorded:08x}\\)"
    with pytest.raises(CheckpointCorruptError, match=message):
        load(_template(), tmp_path / "ckpt")
    with pytest.raises(CheckpointCorruptError, match=message):
        verify(tmp_path / "ckpt")
