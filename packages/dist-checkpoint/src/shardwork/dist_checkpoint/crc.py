"""CRC-32 (the zip / zlib polynomial) of a concatenation from the CRCs of its parts.

The writer needs two CRC-32s of every tensor payload: the zip record's own (of the payload
alone, required by the archive format) and the running CRC of the whole data file (recorded
in ``shardwork.json`` for `verify`). Computing the payload's CRC once and *combining* it into
the file's CRC costs O(log n) small-integer operations instead of a second pass over the
bytes.

Math: CRC-32 is linear over GF(2). For ``A`` followed by ``B`` (``len(B) = n`` bytes),
``crc(A+B) = crc(A)·x^(8n) mod P  xor  crc(B)``, with polynomials in the reflected bit order
zlib uses (bit 31 is the coefficient of x^0). ``x^(8n) mod P`` is the product of precomputed
``x^(2^k) mod P`` over the set bits of ``8n``.
"""

from __future__ import annotations

__all__ = ["crc32_combine"]

_POLY = 0xEDB88320  # P(x), reflected
_ONE = 1 << 31  # the polynomial 1 in reflected order


def _mul(a: int, b: int) -> int:
    """``a(x)·b(x) mod P(x)`` (reflected 32-bit polynomials)."""
    product = 0
    for bit in range(31, -1, -1):
        if a >> bit & 1:
            product ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers_of_x() -> tuple[int, ...]:
    """``x^(2^k) mod P`` for k = 0..63 (enough for any byte count below 2^61)."""
    powers = [1 << 30]  # x^1
    for _ in range(63):
        powers.append(_mul(powers[-1], powers[-1]))
    return tuple(powers)


_X_POW_2K = _powers_of_x()


def _x_pow(exponent: int) -> int:
    """``x^exponent mod P``."""
    result, k = _ONE, 0
    while exponent:
        if exponent & 1:
            result = _mul(_X_POW_2K[k], result)
        exponent >>= 1
        k += 1
    return result


def crc32_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC-32 of ``A + B`` from ``crc_a = crc32(A)``, ``crc_b = crc32(B)`` and ``len(B)``."""
    if len_b < 0:
        raise ValueError(f"len_b={len_b} is not valid; valid: a byte count >= 0")
    return _mul(_x_pow(8 * len_b), crc_a) ^ crc_b
