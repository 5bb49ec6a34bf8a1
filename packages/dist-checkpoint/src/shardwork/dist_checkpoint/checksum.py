"""The CRC-32 function every checkpoint file is summed with, from the fastest installed library.

Checkpoints record the CRC-32 of every file (the zip / zlib polynomial: the zip records inside
each data file need exactly this CRC, and checkpoints written before this module record it).
Two implementations compute the same values:

- ``isal`` (Python bindings of Intel's ISA-L, the optional ``fast-crc`` extra:
  ``pip install 'shardwork-dist-checkpoint[fast-crc]'``): folds with carry-less multiplication
  (PCLMULQDQ / VPCLMULQDQ), measured ~27 GB/s on one core of the project's AMD EPYC;
- ``zlib`` (the standard library): a table-driven loop, ~4 GB/s on the same core, so a save of
  1 GiB spent ~0.25 s of CPU on it.

`crc32` uses ``isal`` when it imports, ``zlib`` otherwise. The algorithm is the same, so the
choice changes no file and no recorded value: checkpoints of either kind verify with either.
`select_crc32` switches the implementation for the whole process (benchmarks compare both in
one process; tests check both).
Both release the GIL on large buffers, so writer and reader threads checksum in parallel.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

try:  # optional: the fast-crc extra
    from isal import isal_zlib
except ImportError:  # pragma: no cover - depends on the installation
    isal_zlib = None

__all__ = ["available_crc32", "crc32", "crc32_implementation", "select_crc32"]

_Impl = Callable[..., int]


def available_crc32() -> dict[str, _Impl]:
    """The implementations installed here, by name (``zlib`` always)."""
    found: dict[str, _Impl] = {"zlib": zlib.crc32}
    if isal_zlib is not None:
        found["isal"] = isal_zlib.crc32
    return found


class _Selected:
    """The implementation in use (one per process)."""

    name = "zlib"
    fn: _Impl = zlib.crc32


def select_crc32(name: str) -> str:
    """Use implementation ``name`` (``"isal"`` or ``"zlib"``) from now on; return the previous.

    Raises ValueError naming what is installed when ``name`` is unknown or not installed.
    """
    found = available_crc32()
    if name not in found:
        hint = (
            "; install the fast-crc extra (pip install 'shardwork-dist-checkpoint[fast-crc]')"
            if name == "isal"
            else ""
        )
        raise ValueError(
            f"CRC-32 implementation {name!r} is not available; valid: {sorted(found)}{hint}"
        )
    previous = _Selected.name
    _Selected.name, _Selected.fn = name, found[name]
    return previous


def crc32_implementation() -> str:
    """Name of the implementation `crc32` uses now (``"isal"`` or ``"zlib"``)."""
    return _Selected.name


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """CRC-32 of ``data`` continuing from ``value`` (as ``zlib.crc32(data, value)``)."""
    return _Selected.fn(data, value)


select_crc32("isal" if isal_zlib is not None else "zlib")
