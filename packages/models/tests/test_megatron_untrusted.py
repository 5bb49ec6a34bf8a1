"""Importing a Megatron-Core checkpoint never runs code from it.

Each hostile checkpoint starts as a megatron-core fixture (``data/megatron/``) copied to a
temporary folder and altered the way an attacker would: a payload that pickles as
``os.system("touch <marker>")`` in the ``.metadata`` index, in the ``common_state`` byte
record of a ``.distcp`` file, or in a legacy ``common.pt``. ``shardwork-ckpt import-megatron``
must refuse each (exit 2, one line naming the file and the refused global), write nothing and
leave no marker; each payload is then shown to be live: decoded the way torch (or the old
importer) decodes it, it does create the marker.

Megatron-LM's genuine ``args`` name Megatron's own enums (``args.attention_backend``), which
no allow-list here can build without importing megatron: such args are a warning and go
unchecked, while the weights still import.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import io
import pickle
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import TensorProperties

from shardwork.dist_checkpoint.cli import main as ckpt_main
from shardwork.dist_checkpoint.decode import decode_metadata
from shardwork.dist_checkpoint.hostile import RunsCommand
from shardwork.models.megatron import read_megatron_args, read_megatron_tensors

DATA = Path(__file__).parent / "data" / "megatron"
CASES = ("llama_w1_te", "llama_w1_local", "llama_tp2pp2", "moe_ep2", "moe_qb_w1")
COMMON_KEY = "common_state/shard_0_1"
# llama_w1_te's architecture as import-megatron arguments (see test_megatron_import._changes)
ARGS = ["--preset", "tiny-llama3-8b", "--set", "num_layers=2", "--set", "vocab_size=260",
        "--set", "ffn_hidden_size=64", "--set", "rope_theta=10000.0"]  # fmt: skip


def _copy(tmp_path: Path) -> Path:
    src = tmp_path / "megatron"
    shutil.copytree(DATA / "llama_w1_te", src)
    return src


def _import(src: Path, dst: Path, capsys) -> tuple[int, str]:
    """``shardwork-ckpt import-megatron SRC DST`` for llama_w1_te's architecture: exit status
    and stderr."""
    code = ckpt_main(["import-megatron", str(src), str(dst), *ARGS])
    return code, capsys.readouterr().err


def _read_index(src: Path):
    with open(src / ".metadata", "rb") as f:
        return pickle.load(f)  # a fixture this test just copied: trusted


def _write_index(src: Path, metadata) -> None:
    with open(src / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


def _plain_pickle(raw: bytes):
    """What plain pickle builds from an index. A fixture written under torch 2.15 pickles
    ``TensorProperties`` with a sixth value (``strides``, None here) that an older torch's class
    cannot take ("too many values to unpack"); there it is dropped, as 2.15 reads five."""
    if "strides" in TensorProperties.__dataclass_fields__:
        return pickle.loads(raw)
    original = TensorProperties.__setstate__
    try:
        TensorProperties.__setstate__ = lambda self, state: original(self, tuple(state)[:5])
        return pickle.loads(raw)
    finally:
        TensorProperties.__setstate__ = original


@pytest.mark.parametrize("name", CASES)
def test_megatron_indexes_decode_with_the_allow_list(name):
    """Every fixture's index (with its ``all_local_plans``) decodes without plain pickle, to
    the same index."""
    raw = (DATA / name / ".metadata").read_bytes()
    decoded = decode_metadata(raw, name=name)
    assert decoded == _plain_pickle(raw)
    assert decoded.all_local_plans and decoded.all_local_plans[0].items


def test_index_that_runs_code_is_refused(tmp_path, capsys):
    marker = tmp_path / "marker"
    src = _copy(tmp_path)
    metadata = _read_index(src)
    metadata.planner_data = {"x": RunsCommand(f"touch {marker}")}
    _write_index(src, metadata)
    code, err = _import(src, tmp_path / "out", capsys)
    assert code == 2, err
    assert err.startswith("shardwork-ckpt: ") and err.count("\n") == 1, err
    assert f"{str(src / '.metadata')!r} is not a readable torch_dist metadata file" in err
    assert "global posix.system is not allowed" in err
    with pytest.raises(ValueError, match=r"posix\.system"):
        read_megatron_tensors(src, meta=True)
    assert not marker.exists() and not (tmp_path / "out").exists()
    _read_index(src)  # the payload is live: plain pickle runs it
    assert marker.exists()


def _replace_common_state(src: Path, record: bytes) -> None:
    """Append ``record`` to the common state's ``.distcp`` file and point the index at it."""
    metadata = _read_index(src)
    (index,) = [k for k in metadata.storage_data if k.fqn == COMMON_KEY]
    info = metadata.storage_data[index]
    data = src / info.relative_path
    offset = data.stat().st_size
    with open(data, "ab") as f:
        f.write(record)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(record))
    _write_index(src, metadata)


def _saved(value) -> bytes:
    stream = io.BytesIO()
    torch.save(value, stream)
    return stream.getvalue()


def test_common_state_record_that_runs_code_is_refused(tmp_path, capsys):
    marker = tmp_path / "marker"
    src = _copy(tmp_path)
    args = argparse.Namespace(num_layers=2, evil=RunsCommand(f"touch {marker}"))
    record = _saved([{"args": args}])
    _replace_common_state(src, record)
    code, err = _import(src, tmp_path / "out", capsys)
    assert code == 2, err
    assert err.startswith("shardwork-ckpt: ") and err.count("\n") == 1, err
    assert (
        f"{str(src / '__0_0.distcp')!r} record {COMMON_KEY!r}: refused to decode Megatron's "
        "common state: it names the global posix.system, which is not plain data" in err
    )
    assert not marker.exists() and not (tmp_path / "out").exists()
    torch.load(io.BytesIO(record), weights_only=False)  # live: torch's load_bytes runs it
    assert marker.exists()


def test_legacy_common_pt_that_runs_code_is_refused(tmp_path, capsys):
    marker = tmp_path / "marker"
    src = _copy(tmp_path)
    torch.save({"args": RunsCommand(f"touch {marker}")}, src / "common.pt")
    code, err = _import(src, tmp_path / "out", capsys)
    assert code == 2, err
    assert (
        f"{str(src / 'common.pt')!r}: refused to decode Megatron's common state: it names the "
        "global posix.system" in err
    )
    assert not marker.exists() and not (tmp_path / "out").exists()
    torch.load(src / "common.pt", weights_only=False)  # live: the old importer's call runs it
    assert marker.exists()


def test_a_damaged_common_state_record_is_refused(tmp_path, capsys):
    src = _copy(tmp_path)
    _replace_common_state(src, b"not a torch.save archive")
    code, err = _import(src, tmp_path / "out", capsys)
    assert code == 2, err
    assert "refused to decode Megatron's common state (" in err and "distcp" in err


class _ByName:
    """Pickles as ``getattr(enum, name)``: CPython 3.11.x's form of an enum member."""

    def __init__(self, member: enum.Enum) -> None:
        self.member = member

    def __reduce__(self):
        return getattr, (type(self.member), self.member.name)


@pytest.fixture
def megatron_enum(monkeypatch):
    """A stand-in for ``megatron.core.transformer.enums.AttnBackend``, importable only while
    the test pickles with it (the decoder must not need it)."""
    module = types.ModuleType("megatron.core.transformer.enums")
    attn = enum.Enum("AttnBackend", {"flash": 1, "fused": 2, "unfused": 3, "local": 4, "auto": 5})
    attn.__module__ = module.__name__
    module.AttnBackend = attn
    for name in ("megatron", "megatron.core", "megatron.core.transformer"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return attn


@pytest.mark.parametrize("form", ["by-value", "by-name"])
def test_args_naming_megatron_classes_are_a_warning(tmp_path, monkeypatch, megatron_enum, form):
    """Megatron-LM's args hold ``AttnBackend``; without megatron they cannot be built, so they
    go unchecked (a warning naming the file and the class) and the weights still import."""
    backend = megatron_enum.auto if form == "by-value" else _ByName(megatron_enum.auto)
    # CPython releases differ: 3.11.7 pickles an enum member by value (the class is named),
    # Debian's 3.11.2 by name (through getattr)
    by_name = form == "by-name" or b"getattr" in pickle.dumps(megatron_enum.auto)
    args = argparse.Namespace(num_layers=3, attention_backend=backend)
    src = _copy(tmp_path)
    torch.save({"args": args}, src / "common.pt")
    for name in [n for n in sys.modules if n.split(".")[0] == "megatron"]:
        monkeypatch.delitem(sys.modules, name)
    refused = "getattr" if by_name else "megatron.core.transformer.enums.AttnBackend"
    with pytest.warns(UserWarning, match=rf"common\.pt'.*could not be read safely.*{refused}"):
        assert read_megatron_args(src) is None
    with pytest.warns(UserWarning, match="could not be read safely"):
        assert ckpt_main(["import-megatron", str(src), str(tmp_path / "out"), *ARGS]) == 0


def test_plain_args_are_still_read(tmp_path):
    src = _copy(tmp_path)
    args = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16, kv_channels=None)
    torch.save({"args": args, "iteration": 10, "checkpoint_version": 3.0}, src / "common.pt")
    assert read_megatron_args(src) == vars(args)
    _replace_common_state(src, _saved([{"args": args}]))
    (src / "common.pt").unlink()
    assert read_megatron_args(src) == vars(args)


def test_an_index_naming_a_file_outside_the_folder_is_refused(tmp_path, capsys):
    """torch's FileSystemReader opens whatever file the index names: a byte-identical copy of
    the data file outside the folder, named ``../outside.distcp``, would be imported from."""
    src = _copy(tmp_path)
    metadata = _read_index(src)
    (name,) = {info.relative_path for info in metadata.storage_data.values()}
    shutil.copy(src / name, tmp_path / "outside.distcp")
    for info in metadata.storage_data.values():
        info.relative_path = "../outside.distcp"
    _write_index(src, metadata)
    code, err = _import(src, tmp_path / "out", capsys)
    assert code == 2, err
    assert "refused file name '../outside.distcp'" in err, err
    assert not (tmp_path / "out").exists()
