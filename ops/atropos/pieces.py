"""Pre-compressed JSON pieces, joined into one gzip stream without compressing again.

A ``/batch`` answer is 64 groups of ~1 MB of JSON each; compressing it per call costs
about 11 ms of CPU per group. So each group's JSON is deflated once, when it is posted
(or first read), and ``/batch`` only concatenates. Several gzip *members* in a row are
valid gzip, but httpx and aiohttp decode only the first member and drop the rest
silently, so the pieces are joined into one member instead: each piece is a raw deflate
stream ended with a sync flush (byte-aligned, no final block), which may follow any other
such stream; ``gzip_join`` adds the header, an empty final block and the trailer, whose
CRC-32 it combines from the pieces' own CRCs (zlib's ``crc32_combine``, with each piece's
length operator precomputed so a join costs a few microseconds a piece).

A piece is ``<crc32 u32><length u64><operator u32>`` (little-endian) then the deflate
bytes; ``inflate`` gives the JSON back for clients that do not accept gzip.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator, Sequence

_POLY = 0xEDB88320  # CRC-32 (reflected), as zlib
_HEADER = struct.Struct("<IQI")
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no mtime
_FINAL_BLOCK = b"\x03\x00"  # an empty final block with fixed codes


def _multiply(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial (zlib's ``multmodp``)."""
    product = 0
    bit = 1 << 31
    while True:
        if a & bit:
            product ^= b
            if a & (bit - 1) == 0:
                return product
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _powers() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multiply(table[-1], table[-1]))
    return table


_X2N = _powers()  # x^(2^k) modulo the polynomial


def _operator(length: int) -> int:
    """x^(8 * length) modulo the polynomial: appends ``length`` bytes to a CRC."""
    product = 1 << 31  # x^0
    k = 3
    while length:
        if length & 1:
            product = _multiply(_X2N[k & 31], product)
        length >>= 1
        k += 1
    return product


def compress(raw: bytes, level: int = 1) -> bytes:
    """The piece of ``raw`` (deflated at ``level``, sync-flushed)."""
    deflater = zlib.compressobj(level, zlib.DEFLATED, -15)
    body = deflater.compress(raw) + deflater.flush(zlib.Z_SYNC_FLUSH)
    return _HEADER.pack(zlib.crc32(raw), len(raw), _operator(len(raw))) + body


def inflate(piece: bytes) -> bytes:
    """The bytes a piece was made from."""
    _, length, _ = _HEADER.unpack_from(piece)
    raw = zlib.decompressobj(-15).decompress(memoryview(piece)[_HEADER.size:])
    if len(raw) != length:
        raise ValueError(f"piece inflates to {len(raw)} bytes, its header says {length}")
    return raw


def gzip_chunks(pieces: Sequence[bytes]) -> list[bytes | memoryview]:
    """One gzip stream (a single member) of the pieces' bytes, in order, as chunks to send
    one after the other (views of the pieces: nothing is copied)."""
    crc = 0
    total = 0
    for piece in pieces:
        piece_crc, length, operator = _HEADER.unpack_from(piece)
        crc = _multiply(operator, crc) ^ piece_crc
        total += length
    trailer = struct.pack("<II", crc, total & 0xFFFFFFFF)
    return [_GZIP_HEADER, *(memoryview(piece)[_HEADER.size:] for piece in pieces),
            _FINAL_BLOCK + trailer]


def gzip_join(pieces: Sequence[bytes]) -> bytes:
    """``gzip_chunks`` joined."""
    return b"".join(gzip_chunks(pieces))


def raw_length(pieces: Sequence[bytes]) -> int:
    """Bytes the pieces inflate to, from their headers."""
    return sum(_HEADER.unpack_from(piece)[1] for piece in pieces)


def raw_chunks(pieces: Sequence[bytes]) -> Iterator[bytes]:
    """The pieces' bytes, in order, uncompressed one piece at a time."""
    return (inflate(piece) for piece in pieces)


def raw_join(pieces: Sequence[bytes]) -> bytes:
    """The pieces' bytes, in order, uncompressed."""
    return b"".join(raw_chunks(pieces))
