"""The data-file writer: tensor chunks in torch.save's archive format, checked by readers that
share no code with it (``torch.load``, Python's ``zipfile`` for the zip records' CRC-32s,
``zlib.crc32`` of the whole file), and the CRC-32 combination against ``zlib.crc32``."""

import io
import os
import struct
import zipfile
import zlib

import pytest
import torch

from shardwork.dist_checkpoint.archive import write_tensor_archive
from shardwork.dist_checkpoint.blob import HEAD_BYTES, parse_tensor_blob
from shardwork.dist_checkpoint.crc import crc32_combine
from shardwork.dist_checkpoint.datafile import DataFile
from shardwork.dist_checkpoint.testing import TENSOR_CASES, seeded

# the shared cases (seeds 1-7), then what only the writer meets: a row block (contiguous, at
# an offset), an empty tensor, a lazily conjugated complex tensor, a dtype it leaves to
# torch.save, and a payload large enough to be written in slices (last: it ends the file)
TENSORS = {
    **TENSOR_CASES,
    "row_block": lambda: torch.randn(10, 8, generator=seeded(8))[3:7],
    "empty": lambda: torch.empty(0, 4),
    "complex_conj": lambda: torch.randn(4, 3, dtype=torch.complex64, generator=seeded(9)).conj(),
    "float8_fallback": lambda: torch.randn(4, 4, generator=seeded(10)).to(torch.float8_e4m3fn),
    # 3 MiB + 28 bytes: written in slices, its CRC combined into the file's
    "sliced_payload": lambda: torch.randn(3 * 2**18 + 7, generator=seeded(11)),
}


def _same(a, b):
    if a.dtype == torch.float8_e4m3fn:
        return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return a.dtype == b.dtype and torch.equal(a, b.resolve_conj())


def _data_descriptors_agree(blob):
    """Each record's data descriptor (after its data: signature, CRC-32, sizes) says what the
    central directory says, as read by ``zipfile``."""
    for info in zipfile.ZipFile(io.BytesIO(blob)).infolist():
        name_len, extra_len = struct.unpack_from("<HH", blob, info.header_offset + 26)
        data_end = info.header_offset + 30 + name_len + extra_len + info.file_size
        descriptor = struct.unpack_from("<IIII", blob, data_end)
        if descriptor != (0x08074B50, info.CRC, info.compress_size, info.file_size):
            return False
    return True


def test_archives_load_with_torch_and_the_file_checksum_is_the_files(tmp_path):
    tensors = {name: make() for name, make in TENSORS.items()}
    out = DataFile(tmp_path / "__0_0.distcp", rank=0, sync_files=True)
    out.write(b"a byte item before the tensors")
    spans = {}
    for name, tensor in tensors.items():
        offset = out.tell()
        spans[name] = (offset, write_tensor_archive(out, tensor))
    out.close()

    raw = (tmp_path / "__0_0.distcp").read_bytes()
    assert (out.size, out.crc) == (len(raw), zlib.crc32(raw))
    assert spans["sliced_payload"][0] + spans["sliced_payload"][1] == len(raw)
    for name, (offset, length) in spans.items():
        blob = raw[offset : offset + length]
        loaded = torch.load(io.BytesIO(blob), weights_only=True)
        assert _same(loaded, tensors[name]), name
        assert zipfile.ZipFile(io.BytesIO(blob)).testzip() is None, name  # record CRCs
        assert _data_descriptors_agree(blob), name
        stored = parse_tensor_blob(blob[:HEAD_BYTES], length)
        assert (stored is None) == (name == "float8_fallback"), name
        if stored is not None:
            assert stored.data_offset % 64 == 0 and stored.size == tuple(tensors[name].shape)


def test_a_view_is_written_without_the_rest_of_its_storage(tmp_path):
    base = torch.randn(1000, 256, generator=seeded(12))
    rows = base[10:20]  # 10 KiB of a 1000 KiB storage
    out = DataFile(tmp_path / "f", rank=0, sync_files=False)
    length = write_tensor_archive(out, rows)
    out.close()
    assert rows.nbytes < length < rows.nbytes + 1024
    loaded = torch.load(tmp_path / "f", weights_only=True)
    assert torch.equal(loaded, rows) and loaded.untyped_storage().nbytes() == rows.nbytes


@pytest.mark.parametrize(
    ("len_a", "len_b"), [(0, 0), (0, 9), (9, 0), (1, 1), (77, 4096), (5, 2**20 + 3)]
)
def test_crc32_combine_equals_the_crc_of_the_concatenation(len_a, len_b):
    a, b = os.urandom(len_a), os.urandom(len_b)
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len_b) == zlib.crc32(a + b)
    with pytest.raises(ValueError, match="len_b=-1"):
        crc32_combine(0, 0, -1)
