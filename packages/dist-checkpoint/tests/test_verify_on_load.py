"""`load` verifies what it reads: one flipped byte in any checksummed file of a checkpoint
raises `CheckpointCorruptError` naming the checkpoint, the file and the found vs recorded
CRC-32 (computed here with zlib from the file as it is on disk), at world 1 and on every rank
of a 2-rank load; format-version-1 checkpoints (no version field, no marker CRC) still load
and are still verified, while a version-2 marker damaged so that it lacks its CRC (or has keys
no marker has) is refused by `verify` and `load` alike."""

import json
import warnings
import zlib
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex

from shardwork.dist_checkpoint import (
    CheckpointCorruptError,
    CheckpointRefusedError,
    UnsupportedFormatError,
    load,
    read_info,
    save,
    verify,
)
from shardwork.dist_checkpoint.testing import example_global, example_state

pytest.importorskip("shardwork.parallel_state")
from shardwork.parallel_state.testing import run_on_ranks

SEED = 3
DATA = "__0_0.distcp"


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x5A
    path.write_bytes(bytes(raw))


def _item_range(ckpt: Path, key: str) -> tuple[str, int, int]:
    """``(file, offset, length)`` of the stored item ``key`` (DCP's own reader's metadata)."""
    storage = FileSystemReader(ckpt).read_metadata().storage_data
    matches = [(i, info) for i, info in storage.items() if i.fqn.split("/")[0] == key]
    index, info = matches[0]
    assert isinstance(index, MetadataIndex)
    return info.relative_path, info.offset, info.length


def _payload(ckpt: Path, name: str) -> tuple[str, int]:
    """A byte inside the stored float32 values of global tensor ``name``."""
    needle = example_global(SEED)[name].numpy().tobytes()
    at = (ckpt / DATA).read_bytes().find(needle)
    assert at > 0
    return DATA, at + len(needle) // 2


def _info_digit(ckpt: Path) -> tuple[str, int]:
    """A digit of ``created_unix`` in shardwork.json (the JSON stays valid when changed)."""
    at = (ckpt / "shardwork.json").read_bytes().find(b'"created_unix": ') + 16
    return "shardwork.json", at


def _where(ckpt: Path, kind: str) -> tuple[str, int]:
    """``(file, offset)`` of the byte to corrupt for each kind of checksummed content."""
    if kind == "tensor payload":
        return _payload(ckpt, "matrix")
    if kind in ("zip header of a chunk", "object blob"):
        name, offset, length = _item_range(ckpt, "matrix" if kind.startswith("zip") else "rng")
        return name, offset if kind.startswith("zip") else offset + length // 2
    if kind == "archive directory at the end":
        return DATA, (ckpt / DATA).stat().st_size - 10
    if kind == "dcp metadata":
        return ".metadata", (ckpt / ".metadata").stat().st_size // 2
    return _info_digit(ckpt)


def _expected_message_parts(ckpt: Path, name: str, recorded: int) -> list[str]:
    found = zlib.crc32((ckpt / name).read_bytes())
    return [str(ckpt), f"{name}: checksum mismatch", f"crc32 {found:08x}", f"{recorded:08x}"]


def _recorded(ckpt: Path, name: str) -> int:
    if name == "shardwork.json":
        return json.loads((ckpt / "COMMITTED").read_text())["info_crc32"]
    return read_info(ckpt)["files"][name]["crc32"]


@pytest.fixture
def ckpt(tmp_path) -> Path:
    path = tmp_path / "step_1"
    save(example_state(0, 1, seed=SEED), path)
    return path


def _assert_intact_load(ckpt: Path) -> None:
    out = load(example_state(0, 1, seed=0, fill=False), ckpt)
    reference = example_global(SEED)
    assert torch.equal(out["model"]["matrix"], reference["matrix"])
    assert torch.equal(out["optimizer"]["moment"], reference["moment"].flatten())
    assert out["rng"] == {"rank": 0, "seed": SEED} and out["optimizer"]["step"] == SEED


KINDS = [
    "tensor payload",
    "zip header of a chunk",
    "archive directory at the end",
    "object blob",
    "dcp metadata",
    "shardwork json",
]


@pytest.mark.parametrize("kind", KINDS)
def test_flipped_byte_in_each_kind_of_file_is_named(ckpt, kind):
    _assert_intact_load(ckpt)
    name, offset = _where(ckpt, kind)
    recorded = _recorded(ckpt, name)
    _flip(ckpt / name, offset)
    with pytest.raises(CheckpointCorruptError) as info:
        load(example_state(0, 1, seed=0, fill=False), ckpt)
    for part in _expected_message_parts(ckpt, name, recorded):
        assert part in str(info.value), str(info.value)
    assert info.value.checkpoint == str(ckpt) and info.value.files == (name,)


def test_a_partial_read_still_checks_the_whole_file(ckpt):
    """Loading only ``matrix`` reads part of the data file; a flip in ``moment``'s bytes (not
    needed by this load) is still found, since the recorded CRC is of the whole file."""
    name, offset = _payload(ckpt, "moment")
    _flip(ckpt / name, offset)
    stats: dict[str, int] = {}
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: checksum mismatch"):
        load(
            example_state(0, 1, seed=0, fill=False),
            ckpt,
            key_filter=lambda _p, key: key == "matrix",
            stats=stats,
        )
    assert stats == {}  # the error is raised before the counts are reported


def test_verify_false_reads_the_corrupt_bytes(ckpt):
    name, offset = _payload(ckpt, "matrix")
    _flip(ckpt / name, offset)
    out = load(example_state(0, 1, seed=0, fill=False), ckpt, verify=False)
    differs = out["model"]["matrix"] != example_global(SEED)["matrix"]
    assert int(differs.sum()) == 1  # exactly the flipped element


def _as_version_1(ckpt: Path) -> None:
    """Rewrite the metadata as format version 1 wrote it: no ``format_version`` field here (the
    oldest form) and a marker without ``info_crc32``."""
    info = json.loads((ckpt / "shardwork.json").read_text())
    del info["format_version"]
    (ckpt / "shardwork.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    (ckpt / "COMMITTED").write_text(json.dumps({"committed": True, "time": 0.0}))


def test_old_format_without_version_loads_and_is_verified(ckpt):
    _as_version_1(ckpt)
    _assert_intact_load(ckpt)
    name, offset = _payload(ckpt, "matrix")
    recorded = _recorded(ckpt, name)
    _flip(ckpt / name, offset)
    with pytest.raises(CheckpointCorruptError) as info:
        load(example_state(0, 1, seed=0, fill=False), ckpt)
    for part in _expected_message_parts(ckpt, name, recorded):
        assert part in str(info.value)


def test_unknown_format_version_is_refused(ckpt):
    info = json.loads((ckpt / "shardwork.json").read_text())
    info["format_version"] = 99
    text = json.dumps(info)
    (ckpt / "shardwork.json").write_text(text)
    marker = {"committed": True, "time": 0.0, "info_crc32": zlib.crc32(text.encode())}
    (ckpt / "COMMITTED").write_text(json.dumps(marker))
    with pytest.raises(ValueError, match=r"format_version=99 .* valid: \[1, 2\]"):
        load(example_state(0, 1, seed=0, fill=False), ckpt)


def _flip_world_size(ckpt: Path) -> None:
    """One bit of shardwork.json: ``"world_size": 1`` becomes 3 (still valid JSON)."""
    raw = bytearray((ckpt / "shardwork.json").read_bytes())
    at = bytes(raw).index(b'"world_size": 1') + len(b'"world_size": ')
    raw[at] ^= 0x02
    (ckpt / "shardwork.json").write_bytes(bytes(raw))
    assert json.loads(raw)["world_size"] == 3


def _rename_crc_key_one_bit(ckpt: Path) -> None:
    raw = bytearray((ckpt / "COMMITTED").read_bytes())
    raw[bytes(raw).index(b"info_crc32") + 9] ^= 0x01  # info_crc32 -> info_crc33
    (ckpt / "COMMITTED").write_bytes(bytes(raw))


def _edit_marker(ckpt: Path, edit) -> None:
    marker = json.loads((ckpt / "COMMITTED").read_text())
    edit(marker)
    (ckpt / "COMMITTED").write_text(json.dumps(marker))


MARKER_DAMAGE = {
    # the auditor's case: with the CRC key gone, shardwork.json was no longer checked
    "crc key renamed by one bit": (
        _rename_crc_key_one_bit,
        "COMMITTED has unknown keys ['info_crc33']; valid keys: ['committed', 'info_crc32', 'time']",
    ),
    "crc key deleted": (
        lambda ckpt: _edit_marker(ckpt, lambda m: m.pop("info_crc32")),
        "COMMITTED has no 'info_crc32' (keys: ['committed', 'time']), which every marker of "
        "format_version >= 2 records; shardwork.json says format_version=2",
    ),
    "unknown key added": (
        lambda ckpt: _edit_marker(ckpt, lambda m: m.update(extra=1)),
        "COMMITTED has unknown keys ['extra']",
    ),
    "time deleted": (
        lambda ckpt: _edit_marker(ckpt, lambda m: m.pop("time")),
        "COMMITTED lacks ['time']",
    ),
    "committed false": (
        lambda ckpt: _edit_marker(ckpt, lambda m: m.update(committed=False)),
        "COMMITTED has committed=False; valid: true",
    ),
}


@pytest.mark.parametrize("damage", list(MARKER_DAMAGE))
def test_a_damaged_commit_marker_is_refused_by_verify_and_load(ckpt, damage):
    """A marker that lacks ``info_crc32`` must not pass as format version 1 (which would
    leave shardwork.json unchecked: its world_size is then flipped 1 -> 3 too; with the CRC
    still there, that flip would be found by it, so it is made only without)."""
    verify(ckpt)  # pristine: verifies and loads
    _assert_intact_load(ckpt)
    edit, expected = MARKER_DAMAGE[damage]
    edit(ckpt)
    if b'"info_crc32"' not in (ckpt / "COMMITTED").read_bytes():
        _flip_world_size(ckpt)
    for action in (lambda: verify(ckpt), lambda: load(example_state(0, 1, seed=0), ckpt)):
        with pytest.raises(CheckpointCorruptError) as info:
            action()
        assert f"checkpoint {str(ckpt)!r} is corrupt: " in str(info.value)
        assert expected in str(info.value)
        assert info.value.checkpoint == str(ckpt) and info.value.files == ("COMMITTED",)


def test_version_1_marker_with_an_unknown_key_is_refused(ckpt):
    _as_version_1(ckpt)
    _edit_marker(ckpt, lambda m: m.update(info_crc33=0))
    with pytest.raises(
        CheckpointCorruptError, match=r"COMMITTED has unknown keys \['info_crc33'\]"
    ):
        verify(ckpt)


def test_a_newer_format_with_new_marker_keys_is_unsupported_not_corrupt(ckpt):
    """A newer writer's marker may hold keys this version does not know: said as such."""
    info = json.loads((ckpt / "shardwork.json").read_text())
    info["format_version"] = 3
    (ckpt / "shardwork.json").write_text(json.dumps(info))
    (ckpt / "COMMITTED").write_text(json.dumps({"committed": True, "time": 0.0, "info_sha": 1}))
    with pytest.raises(UnsupportedFormatError, match=r"format_version=3 .* valid: \[1, 2\]"):
        verify(ckpt)


def _load_where_only_rank_1_reads(path: str):
    """Rank 0 asks for nothing, rank 1 for everything: only rank 1 reads the data file."""
    import torch.distributed as dist

    template = {} if dist.get_rank() == 0 else example_state(0, 1, seed=0, fill=False)
    try:
        load(template, path, strict=False)
    except CheckpointCorruptError as exc:
        return type(exc).__name__, str(exc), exc.files
    return "no error", "", ()


@pytest.mark.multirank
@pytest.mark.parametrize("kind", ["tensor payload", "dcp metadata"])
def test_two_ranks_all_raise_when_one_finds_a_bad_file(ckpt, kind):
    name, offset = _where(ckpt, kind)
    recorded = _recorded(ckpt, name)
    _flip(ckpt / name, offset)
    outcomes = run_on_ranks(_load_where_only_rank_1_reads, 2, args=(str(ckpt),))
    assert [o[0] for o in outcomes] == ["CheckpointCorruptError"] * 2
    for _, message, files in outcomes:
        assert files == (name,)
        for part in _expected_message_parts(ckpt, name, recorded):
            assert part in message


def test_a_damaged_object_record_is_refused_without_torchs_warning(ckpt):
    """Torch decodes a pickle whose protocol byte was flipped with a warning that asks the
    user to file a torch issue. The record's archive fails its own CRC-32 first, so nothing is
    decoded and nothing warns, with or without `load`'s verification of the file."""
    name, offset, length = _item_range(ckpt, "rng")
    blob = (ckpt / name).read_bytes()[offset : offset + length]
    _flip(ckpt / name, offset + blob.index(b"\x80\x02") + 1)  # the pickle's protocol number
    for checked, error in ((True, CheckpointCorruptError), (False, CheckpointRefusedError)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(error, match=r"__0_0\.distcp"):
                load(example_state(0, 1, seed=0, fill=False), ckpt, verify=checked)
        assert [str(w.message) for w in caught] == [], checked


def test_warnings_while_reading_reach_the_caller_only_from_intact_files(ckpt, monkeypatch):
    """`load` holds the warnings raised while it reads and passes them on only when every
    file it read matched its record: a decoder's warning about damaged bytes would only
    mislead next to the corruption error."""
    real_load = torch.load

    def warning_load(*args, **kwargs):
        warnings.warn("a decoder's remark", UserWarning, stacklevel=2)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", warning_load)
    with pytest.warns(UserWarning, match="a decoder's remark"):
        _assert_intact_load(ckpt)
    name, offset = _payload(ckpt, "matrix")
    _flip(ckpt / name, offset)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: checksum mismatch"):
            load(example_state(0, 1, seed=0, fill=False), ckpt)
    assert [str(w.message) for w in caught] == []
