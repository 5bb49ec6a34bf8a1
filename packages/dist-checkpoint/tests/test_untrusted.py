"""Opening a checkpoint never runs code from it and never reads outside it.

Each crafted checkpoint starts as a real one (saved here) and is then altered the way an
attacker would: a pickle payload that runs ``os.system("touch <marker>")`` in an object
record or in DCP's ``.metadata`` (with the sizes and CRCs recorded in ``shardwork.json`` and
``COMMITTED`` updated to match, so only the decoder stands in the way), a data file name that
leaves the directory, a byte range past a file's end. Every case must raise `CheckpointRefusedError` naming the file,
leave no marker, and leave the template's tensors untouched (still NaN). Each payload is
also shown to be live: decoded with plain pickle it does create the marker.

The committed ``fixtures/v1`` checkpoint (written by `tools/dist_checkpoint_v1_fixture.py`
before the allow-list decoder existed) still loads, value for value: the values it was written
with are ``fixtures/v1_values.pt`` (`example_global(11)` as it was then: float32 normal draws
on an AVX2 CPU, which no CPU without AVX2 reproduces), read with ``torch.load``.

The committed ``fixtures/enum_by_name`` checkpoint was written under CPython 3.11.2, which
pickles an enum member as ``getattr(Enum, name)`` (`tools/dist_checkpoint_enum_fixture.py`);
it loads under any Python, while ``getattr`` of anything but an allowed enum's member is
refused.
"""

import io
import json
import pickle
import pickletools
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

from shardwork.dist_checkpoint import (
    CheckpointRefusedError,
    ShardedObject,
    load,
    save,
    verify,
)
from shardwork.dist_checkpoint.cli import main as ckpt_main
from shardwork.dist_checkpoint.decode import decode_metadata, decode_object
from shardwork.dist_checkpoint.hostile import (
    RunsCommand,
    rerecord,
    rewrite_metadata,
    write_info,
)
from shardwork.dist_checkpoint.testing import example_global, example_state

pytest.importorskip("shardwork.parallel_state")
from shardwork.parallel_state.testing import run_on_ranks

FIXTURE_V1 = Path(__file__).parent / "fixtures" / "v1"
V1_VALUES = Path(__file__).parent / "fixtures" / "v1_values.pt"
V1_SEED = 11
FIXTURE_ENUM_BY_NAME = Path(__file__).parent / "fixtures" / "enum_by_name"
ENUM_BY_NAME_SEED = 13


def _saved(tmp_path: Path, rng_value=None) -> Path:
    state = example_state(0, 1, seed=3)
    if rng_value is not None:
        state["rng"] = ShardedObject("rng", rng_value, (1,), (0,))
    path = tmp_path / "ckpt"
    save(state, path)
    return path


def _template():
    return example_state(0, 1, seed=3, fill=False)


def _assert_untouched(template) -> None:
    for leaf in (template["model"]["matrix"], template["optimizer"]["moment"]):
        assert torch.isnan(leaf.data).all()


def test_object_record_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "marker"
    path = _saved(tmp_path, rng_value={"evil": RunsCommand(f"touch {marker}")})
    template = _template()
    with pytest.raises(CheckpointRefusedError, match=r"__0_0\.distcp: .*'rng/shard_0_1'.*system"):
        load(template, path)
    assert not marker.exists()
    _assert_untouched(template)
    # the payload is live: plain torch.load of the same record runs it
    with open(path / ".metadata", "rb") as f:
        storage = pickle.load(f).storage_data
    (info,) = [v for k, v in storage.items() if k.fqn == "rng/shard_0_1"]
    record = (path / info.relative_path).read_bytes()[info.offset : info.offset + info.length]
    torch.load(io.BytesIO(record), weights_only=False)
    assert marker.exists()


def test_metadata_that_runs_code_is_refused(tmp_path):
    marker = tmp_path / "marker"
    path = _saved(tmp_path)
    rewrite_metadata(path, lambda m: m.planner_data.update(x=RunsCommand(f"touch {marker}")))
    # recorded checksums match: only the decoder stands in the way, in verify and in load
    for read in (verify, lambda p: load(_template(), p)):
        with pytest.raises(
            CheckpointRefusedError, match=r"ckpt/\.metadata: refused .*posix\.system"
        ):
            read(path)
    assert ckpt_main(["verify", str(path)]) != 0
    assert not marker.exists()
    with open(path / ".metadata", "rb") as f:
        pickle.load(f)  # the payload is live
    assert marker.exists()


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_data_file_outside_the_checkpoint_is_refused(tmp_path, where):
    path = _saved(tmp_path)
    # a byte-identical copy outside: without confinement the load would succeed from it
    outside = tmp_path / "outside.distcp"
    shutil.copy(path / "__0_0.distcp", outside)
    if where == "symlink":
        (path / "__0_0.distcp").unlink()
        (path / "__0_0.distcp").symlink_to(outside)
        expected = r"'__0_0\.distcp': it resolves to .*outside\.distcp"
    else:
        name = "../outside.distcp" if where == "parent" else str(outside)
        expected = "refused file name " + repr(name).replace(".", r"\.")

        def rename(metadata):
            for info in metadata.storage_data.values():
                info.relative_path = name

        rewrite_metadata(path, rename)
    template = _template()
    with pytest.raises(CheckpointRefusedError, match=expected):
        load(template, path)
    _assert_untouched(template)


def test_shardwork_json_file_name_outside_is_refused(tmp_path):
    path = _saved(tmp_path)
    info = json.loads((path / "shardwork.json").read_text())
    shutil.copy(path / ".metadata", tmp_path / "outside")
    info["files"]["../outside"] = info["files"].pop(".metadata")
    write_info(path, info)
    with pytest.raises(CheckpointRefusedError, match=r"refused file name '\.\./outside'"):
        verify(path)
    with pytest.raises(CheckpointRefusedError, match=r"refused file name '\.\./outside'"):
        load(_template(), path)
    assert ckpt_main(["verify", str(path)]) != 0


@pytest.mark.parametrize("field", ["offset", "length"])
def test_byte_range_past_the_file_end_is_refused(tmp_path, field):
    path = _saved(tmp_path)
    size = (path / "__0_0.distcp").stat().st_size

    def stretch(metadata):
        info = max(metadata.storage_data.values(), key=lambda i: i.offset)
        if field == "offset":
            info.offset = size - 8
        else:
            info.length = size - info.offset + 1

    rewrite_metadata(path, stretch)
    template = _template()
    with pytest.raises(
        CheckpointRefusedError, match=rf"__0_0\.distcp: record .* but the file has {size} bytes"
    ):
        load(template, path)
    _assert_untouched(template)


def _load_on_rank(path: str) -> str:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    template = example_state(rank, world, seed=3, fill=False)
    template["rng"] = ShardedObject("rng", None, (1,), (0,))  # both ranks read the saved cell
    try:
        load(template, path)
    except CheckpointRefusedError as exc:
        untouched = torch.isnan(template["model"]["matrix"].data).all().item()
        return f"refused untouched={untouched}: {exc}"
    return "loaded"


@pytest.mark.multirank
def test_two_ranks_refuse_crafted_checkpoints(tmp_path):
    marker = tmp_path / "marker"
    evil_object = _saved(tmp_path / "object", rng_value=RunsCommand(f"touch {marker}"))
    evil_metadata = _saved(tmp_path / "metadata")
    rewrite_metadata(
        evil_metadata, lambda m: m.planner_data.update(x=RunsCommand(f"touch {marker}"))
    )
    outside = _saved(tmp_path / "outside")

    def escape(metadata):
        for info in metadata.storage_data.values():
            info.relative_path = "../x.distcp"

    shutil.copy(outside / "__0_0.distcp", tmp_path / "outside" / "x.distcp")
    rewrite_metadata(outside, escape)
    past_end = _saved(tmp_path / "past_end")
    size = (past_end / "__0_0.distcp").stat().st_size

    stretched = {}

    def stretch(metadata):
        index, info = max(metadata.storage_data.items(), key=lambda item: item[1].offset)
        info.offset = size - 8
        stretched["needle"] = (
            f"record {index.fqn!r} asks for {info.length} bytes at offset {size - 8}"
        )

    rewrite_metadata(past_end, stretch)
    for path, fragment in [
        (evil_object, "__0_0.distcp"),
        (evil_metadata, ".metadata: refused"),
        (outside, "refused file name '../x.distcp'"),
        (past_end, "__0_0.distcp: " + stretched["needle"]),
    ]:
        results = run_on_ranks(_load_on_rank, 2, args=(str(path),))
        assert len(results) == 2
        for text in results:
            assert text.startswith("refused untouched=True"), text
            assert fragment in text, text
    assert not marker.exists()


def test_v1_checkpoint_still_loads(tmp_path):
    path = tmp_path / "v1"
    shutil.copytree(FIXTURE_V1, path)
    verify(path)
    out = load(example_state(0, 1, seed=V1_SEED, fill=False), path)
    expected = torch.load(V1_VALUES, weights_only=True)
    assert torch.equal(out["model"]["matrix"], expected["matrix"])
    assert torch.equal(out["model"]["replicated"], expected["replicated"])
    assert torch.equal(out["optimizer"]["moment"], expected["moment"].flatten())
    assert out["optimizer"]["step"] == V1_SEED
    assert out["rng"] == {"rank": 0, "seed": V1_SEED}


def test_checkpoint_with_enums_pickled_by_name_loads(tmp_path):
    path = tmp_path / "by_name"
    shutil.copytree(FIXTURE_ENUM_BY_NAME, path)
    raw = (path / ".metadata").read_bytes()
    # The fixture really holds the by-name form this test is about.
    assert [arg for _, arg, _ in pickletools.genops(raw) if arg == "getattr"] == ["getattr"]
    verify(path)
    out = load(example_state(0, 1, seed=ENUM_BY_NAME_SEED, fill=False), path)
    expected = example_global(ENUM_BY_NAME_SEED)
    assert torch.equal(out["model"]["matrix"], expected["matrix"])
    assert torch.equal(out["model"]["replicated"], expected["replicated"])
    assert torch.equal(out["optimizer"]["moment"], expected["moment"].flatten())
    assert out["optimizer"]["step"] == ENUM_BY_NAME_SEED


class _GetattrOf:
    """Pickles as ``getattr(owner, name)``, the form of an enum member pickled by name."""

    def __init__(self, owner, name):
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


@pytest.mark.parametrize(
    ("owner", "name", "fragment"),
    [
        (torch.Size, "__new__", "getattr of <class 'torch.Size'> is not allowed"),
        (io.BytesIO, "write", "global _io.BytesIO is not allowed"),
        (
            torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING,
            "__class__",
            "'__class__' is not a member of _MEM_FORMAT_ENCODING",
        ),
    ],
    ids=["allowed-class-not-enum", "class-not-allowed", "enum-attribute-not-member"],
)
def test_getattr_of_anything_but_an_enum_member_is_refused(owner, name, fragment):
    raw = pickle.dumps({"x": _GetattrOf(owner, name)})
    # Live: plain pickle does perform the lookup.
    assert pickle.loads(raw)["x"] is getattr(owner, name)
    with pytest.raises(CheckpointRefusedError, match="refused to decode DCP metadata") as info:
        decode_metadata(raw, name="crafted/.metadata")
    assert fragment in str(info.value)


def test_a_damaged_object_record_is_refused_before_torch_decodes_it():
    """Object records are decoded before their file's CRC-32 is compared, and torch.load sizes
    a storage by the element count in the pickle: a flipped bit there is an allocation of that
    size. Each entry of the record's archive is checked against its own CRC-32 first."""
    record = io.BytesIO()
    state = torch.get_rng_state()  # a uint8 tensor, as the trainer's RNG state holds
    torch.save({"cpu_rng": state, "step": 7}, record)
    raw = record.getvalue()
    assert torch.equal(decode_object(raw, name="rng")["cpu_rng"], state)
    count = state.numel().to_bytes(2, "little")  # BININT2 in the storage's persistent id
    at = raw.index(b"M" + count) + 2
    damaged = bytearray(raw)
    damaged[at] ^= 0x80  # numel 5056 -> 37824: larger than the record holds
    with pytest.raises(CheckpointRefusedError, match=r"archive/data\.pkl of its torch\.save "
                       r"archive does not match its CRC-32"):  # fmt: skip
        decode_object(bytes(damaged), name="rng")


def _rezipped(raw: bytes, method: int, *, length: int = 0, pickle_edit=None) -> bytes:
    """The ``torch.save`` archive ``raw`` written again entry by entry with ``method``, CRCs
    consistent (zipfile computes them); ``pickle_edit`` rewrites ``data.pkl``'s bytes; an
    archive comment pads the result to ``length`` bytes (if given)."""

    def write(comment: bytes) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(io.BytesIO(raw)) as src, zipfile.ZipFile(out, "w") as dst:
            for entry in src.infolist():
                data = src.read(entry.filename)
                if pickle_edit and entry.filename.endswith("/data.pkl"):
                    data = pickle_edit(data)
                dst.writestr(entry.filename, data, compress_type=method)
            dst.comment = comment
        return out.getvalue()

    packed = write(b"")
    if not length:
        return packed
    assert 0 < length - len(packed) < 65536, (length, len(packed))
    return write(b"#" * (length - len(packed)))


def test_a_compressed_object_record_is_refused_before_torch_expands_it():
    """torch.load expands a deflated entry to the size its header states: ~1,000x the record's
    bytes for a constant tensor. torch.save never compresses, so a compressed entry is refused
    even with every CRC consistent."""
    record = io.BytesIO()
    torch.save({"w": torch.full((1 << 21,), 0.5)}, record)  # 8 MiB of one value
    bomb = _rezipped(record.getvalue(), zipfile.ZIP_DEFLATED)
    assert len(bomb) < 16 << 10  # 8 MiB in under 16 KiB
    assert torch.load(io.BytesIO(bomb), weights_only=True)["w"].numel() == 1 << 21  # live
    with pytest.raises(CheckpointRefusedError, match=r"entry archive/data\.pkl .* is compressed"):
        decode_object(bomb, name="rng")


def test_a_compressed_tensor_chunk_is_refused_with_or_without_records(tmp_path):
    """A chunk the head parser cannot read goes to torch.load; a deflated one (padded to its
    recorded length, the file re-recorded) holds the saved values and would load. The reader
    refuses it before torch.load expands it, also with ``verify=False`` (no records)."""
    path = _saved(tmp_path)
    with open(path / ".metadata", "rb") as f:
        storage = pickle.load(f).storage_data  # our own, just saved
    (info,) = [v for k, v in storage.items() if k.fqn == "matrix"]
    data = bytearray((path / info.relative_path).read_bytes())
    chunk = bytes(data[info.offset : info.offset + info.length])
    packed = _rezipped(chunk, zipfile.ZIP_DEFLATED, length=info.length)
    assert torch.equal(torch.load(io.BytesIO(packed), weights_only=True),
                       torch.load(io.BytesIO(chunk), weights_only=True))  # fmt: skip
    data[info.offset : info.offset + info.length] = packed
    (path / info.relative_path).write_bytes(bytes(data))
    rerecord(path, info.relative_path)
    for check in (True, False):
        with pytest.raises(CheckpointRefusedError, match=r"archive/data\.pkl .* is compressed"):
            load(_template(), path, verify=check)


def test_an_element_count_in_a_record_sizes_no_allocation():
    """What the reader relies on (not checked again there): torch.load compares a storage's
    element count with its stored entry's length before it allocates, so a consistent
    archive (CRCs match) claiming 2**40 float32 elements (4 TiB) is refused, not allocated."""
    record = io.BytesIO()
    torch.save({"w": torch.randn(10, generator=torch.Generator().manual_seed(5))}, record)
    huge = b"\x8a\x06" + (1 << 40).to_bytes(6, "little")  # LONG1: 2**40

    def claim_huge(pkl: bytes) -> bytes:
        at = pkl.index(b"X\x03\x00\x00\x00cpu")  # the location; the count follows
        rest = pkl.index(b"K\x0a", at)  # BININT1 10 (the element count)
        return pkl[:rest] + huge + pkl[rest + 2 :]

    crafted = _rezipped(record.getvalue(), zipfile.ZIP_STORED, pickle_edit=claim_huge)
    with pytest.raises(CheckpointRefusedError, match=r"record size \(40 bytes\) does not match"):
        decode_object(crafted, name="rng")
