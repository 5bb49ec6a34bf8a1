"""No damaged checkpoint loads: one flipped bit at (every / every 4th) byte of every file of a
saved checkpoint, and a torn page of zeros in each file, make `load` raise
`CheckpointCorruptError` naming the checkpoint and the damaged file, with no warning before
it (torch warns about some damaged pickles; `load` drops the decode warnings of a damaged file).

The single exception is written here from the file format, not read from the code: the commit
marker's ``time`` is informational (nothing reads it back), so a flip that leaves it a number
loads, and the test then requires the loaded state to equal the saved one exactly. A flip in
the marker's ``info_crc32`` that leaves it a number is reported as the ``shardwork.json``
mismatch it causes (the message names the marker as where the CRC was recorded).

The every-byte sweep (~8,100 loads, ~15 s) runs under ``-m slow``; the default run takes every
4th byte, each file at another phase, so every bit position is flipped in every file.
"""

from __future__ import annotations

import random
import re
import warnings
from pathlib import Path

import pytest
import torch

from shardwork.dist_checkpoint import CheckpointCorruptError, load, save
from shardwork.dist_checkpoint.testing import example_global, example_state

SEED = 5
MARKER = "COMMITTED"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sweep") / "step_1"
    save(example_state(0, 1, seed=SEED), path)
    return path


def _value_span(marker: bytes, key: str) -> range:
    """Byte offsets of the number after ``"key":`` in the marker's JSON text."""
    match = re.search(rb'"' + key.encode() + rb'":\s*([0-9.eE+-]+)', marker)
    assert match is not None, marker
    return range(match.start(1), match.end(1))


def _load(ckpt: Path) -> dict:
    return load(example_state(0, 1, seed=0, fill=False), ckpt)


def _assert_saved_state(out: dict) -> None:
    reference = example_global(SEED)
    assert torch.equal(out["model"]["matrix"], reference["matrix"])
    assert torch.equal(out["optimizer"]["moment"], reference["moment"].flatten())
    assert out["rng"] == {"rank": 0, "seed": SEED} and out["optimizer"]["step"] == SEED


def _expected_files(name: str, offset: int, marker: bytes) -> set[tuple[str, ...]] | None:
    """The ``files`` the error may name; None where the flip may load (the marker's time)."""
    if name != MARKER:
        return {(name,)}
    if offset in _value_span(marker, "time"):
        return None
    if offset in _value_span(marker, "info_crc32"):  # still a number, or no longer JSON
        return {("shardwork.json",), (MARKER,)}
    return {(name,)}


def _check_damaged(ckpt: Path, name: str, damaged: bytes, expected: set | None) -> str:
    path = ckpt / name
    intact = path.read_bytes()
    path.write_bytes(damaged)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = _load(ckpt)
            except CheckpointCorruptError as exc:
                assert exc.checkpoint == str(ckpt)
                if expected is not None:
                    assert exc.files in expected, (name, str(exc))
                return "refused"
            finally:  # nothing but the error: no warning of torch's about the damaged bytes
                assert [str(w.message) for w in caught] == [], name
        assert expected is None, f"{name} damaged as {damaged[:80]!r}... loaded"
        _assert_saved_state(out)
        return "loaded"
    finally:
        path.write_bytes(intact)


@pytest.mark.parametrize(
    "stride", [4, pytest.param(1, marks=pytest.mark.slow, id="every-byte")], ids=str
)
def test_one_flipped_bit_anywhere_is_refused(ckpt, stride):
    _assert_saved_state(_load(ckpt))
    marker = (ckpt / MARKER).read_bytes()
    rng = random.Random(stride)
    outcomes = {"refused": 0, "loaded": 0}
    files = sorted(p.name for p in ckpt.iterdir())
    assert files == [".metadata", MARKER, "__0_0.distcp", "shardwork.json"]
    for phase, name in enumerate(files):
        raw = (ckpt / name).read_bytes()
        # Every byte of the marker (it is short and has the only informational field).
        offsets = range(len(raw)) if name == MARKER else range(phase % stride, len(raw), stride)
        for offset in offsets:
            damaged = bytearray(raw)
            damaged[offset] ^= 1 << (offset % 8 if stride > 1 else rng.randrange(8))
            expected = _expected_files(name, offset, marker)
            outcomes[_check_damaged(ckpt, name, bytes(damaged), expected)] += 1
    _assert_saved_state(_load(ckpt))  # every file was restored
    assert outcomes["refused"] > 0.99 * sum(outcomes.values()), outcomes


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_torn_page_of_zeros_is_refused(ckpt, where):
    """A write torn by a crash or a bad sector: up to 512 bytes of zeros at the start, middle
    or end of each file (the size stays the same, so only the checksums can tell)."""
    for name in sorted(p.name for p in ckpt.iterdir()):
        raw = (ckpt / name).read_bytes()
        width = min(512, len(raw))
        start = {"start": 0, "middle": (len(raw) - width) // 2, "end": len(raw) - width}[where]
        damaged = raw[:start] + bytes(width) + raw[start + width :]
        assert damaged != raw
        assert _check_damaged(ckpt, name, damaged, {(name,)}) == "refused"
