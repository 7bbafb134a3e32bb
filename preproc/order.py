"""Row positions and the seeded shuffle order, defined so every engine computes the same thing.

A row's *position* is ``(file_index << 40) | line_number``: the index of its input file in the
job's file order and its 1-based line number there. Unshuffled splits are written in position
order. The optional shuffle of the training split sorts its rows by
``(shuffle_key(seed, position), position)``, where ``shuffle_key`` is Spark's built-in
``xxhash64(seed, position)`` on two longs (XXH64 of each 8-byte value, chained from Spark's seed
42) compared as signed 64-bit integers. The numpy version here is checked against Spark in the
tests. The order therefore depends only on the seed and the input files, not on the engine,
the number of workers, partitions or memory limits.

Both engines split the shuffled rows into ``2**bits`` buckets by the top bits of the key (in
signed order), sort each bucket on its own and write the buckets in order: a global sort with
memory bounded by one bucket.

Imported by Spark's Python workers: numpy only.
"""

from __future__ import annotations

import numpy as np

LINE_BITS = 40  # up to ~10**12 lines per file
SPARK_HASH_SEED = 42  # the seed Spark's xxhash64() starts from

_P1 = np.uint64(0x9E3779B185EBCA87)
_P2 = np.uint64(0xC2B2AE3D27D4EB4F)
_P3 = np.uint64(0x165667B19E3779F9)
_P4 = np.uint64(0x85EBCA77C2B2AE63)
_P5 = np.uint64(0x27D4EB2F165667C5)
_SIGN = np.uint64(1 << 63)


def position(file_index: int | np.ndarray, line: np.ndarray) -> np.ndarray:
    """int64 positions of lines (1-based) of one file, or of files given elementwise."""
    return (np.asarray(file_index, dtype=np.int64) << LINE_BITS) | np.asarray(line, dtype=np.int64)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def xxhash64_long(value: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """XXH64 of each int64 ``value`` (8 bytes, little endian) with a per-element or scalar seed.

    Works on uint64 so multiplications wrap as in Java; returns int64 like Spark.
    """
    with np.errstate(over="ignore"):
        v = np.asarray(value, dtype=np.int64).view(np.uint64)
        h = np.asarray(seed, dtype=np.int64).astype(np.int64).view(np.uint64) + _P5 + np.uint64(8)
        h = h ^ (_rotl(v * _P2, 31) * _P1)
        h = _rotl(h, 27) * _P1 + _P4
        h = h ^ (h >> np.uint64(33))
        h = h * _P2
        h = h ^ (h >> np.uint64(29))
        h = h * _P3
        h = h ^ (h >> np.uint64(32))
    return h.view(np.int64)


def shuffle_key(seed: int, positions: np.ndarray) -> np.ndarray:
    """Spark's ``xxhash64(lit(seed).cast('long'), position)``: the sort key of the shuffle."""
    h = xxhash64_long(np.array([seed], dtype=np.int64), np.array([SPARK_HASH_SEED], dtype=np.int64))
    return xxhash64_long(np.asarray(positions, dtype=np.int64), h)


def bucket_of(keys: np.ndarray, bits: int) -> np.ndarray:
    """Bucket index (0 .. 2**bits - 1) of signed int64 keys, increasing with the key."""
    if bits == 0:
        return np.zeros(np.shape(keys), dtype=np.int64)
    flipped = np.asarray(keys, dtype=np.int64).view(np.uint64) ^ _SIGN
    return (flipped >> np.uint64(64 - bits)).astype(np.int64)


def bucket_bits(rows: int, bytes_per_row: int, budget_bytes: int) -> int:
    """Smallest number of bucket bits so one bucket of ``rows`` fits ``budget_bytes`` (max 16)."""
    bits = 0
    while bits < 16 and rows * bytes_per_row > budget_bytes * (1 << bits):
        bits += 1
    return bits
