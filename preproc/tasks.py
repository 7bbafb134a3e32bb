"""The per-chunk work of the single-machine engine, as self-contained functions.

Each task takes a chunk of whole lines and everything it needs as arguments (the vocabulary by
directory, memory-mapped), so it runs the same inline or in a worker process, and workers hold
no state between tasks. Only numpy and polars are imported here (not torch): workers start in
a fraction of a second.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

import numpy as np

from preproc.counting import count_chunk
from preproc.fragments import make_records
from preproc.numeric import LogTable
from preproc.order import bucket_of, position, shuffle_key
from preproc.parse import Chunk, parse_chunk
from preproc.vocab import Vocabulary


def init_worker() -> None:
    """Worker initializer: Ctrl-C is the main process's to handle (it stops the pool and keeps
    the finished files for resuming); one polars thread per worker (the pool is the parallelism)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.setdefault("POLARS_MAX_THREADS", "1")


@dataclass
class ScanResult:
    lines: int
    bad: list[tuple[int, bytes]]  # (line, raw) of malformed lines
    keys: np.ndarray  # aggregated counts of the counted rows: column << 32 | value
    counts: np.ndarray
    good: dict[str, int]  # well-formed rows per split


def scan_task(data: bytes, first_line: int, ranges: list[tuple[str, int, int]],
              counted_splits: tuple[str, ...] = ("train",)) -> ScanResult:
    """Parse a chunk, count the categorical values of its rows in ``counted_splits``, tally rows per split."""
    chunk = parse_chunk(data, first_line)
    rows = chunk.rows
    good = {}
    counted = np.zeros(len(rows), dtype=bool)
    for split, a, b in ranges:
        in_range = (rows.line >= a) & (rows.line <= b)
        good[split] = good.get(split, 0) + int(in_range.sum())
        if split in counted_splits:
            counted |= in_range
    if counted.all():
        keys, counts = count_chunk(rows.hashes, rows.hash_present)
    else:
        keys, counts = count_chunk(rows.hashes[counted], rows.hash_present[counted])
    return ScanResult(chunk.lines, chunk.bad, keys, counts, good)


def transform_chunk(data: bytes, first_line: int, table: LogTable, vocab: Vocabulary) -> tuple[Chunk, np.ndarray, np.ndarray]:
    """The transform of every well-formed line of a chunk: (the parsed chunk, float16
    numericals [n, 13], int64 ids [n, 26]) for ``chunk.rows``; ``chunk.bad`` holds the rest.
    What the engines write for a row, and what ``preproc.transform`` gives a scoring caller."""
    chunk = parse_chunk(data, first_line)
    rows = chunk.rows
    return chunk, rows.numerical(table), vocab.lookup(rows.hashes, rows.hash_present)


@dataclass
class TransformResult:
    lines: int
    malformed: int
    records: dict[tuple[str, int], np.ndarray]  # (split, bucket) -> packed records in row order


def transform_task(data: bytes, first_line: int, file_index: int, ranges: list[tuple[str, int, int]], vocab_dir: str,
                   table: LogTable, dtypes: dict[str, np.dtype], shuffle_seed: int | None, bucket_bits: int) -> TransformResult:
    """Parse a chunk and turn its rows into records per (split, bucket)."""
    chunk, numerical, ids = transform_chunk(data, first_line, table, Vocabulary.load(vocab_dir))
    rows = chunk.rows
    out: dict[tuple[str, int], np.ndarray] = {}
    for split, a, b in ranges:
        sel = np.flatnonzero((rows.line >= a) & (rows.line <= b))
        if len(sel) == 0:
            continue
        pos = position(file_index, rows.line[sel])
        dtype = dtypes[split]
        if split == "train" and shuffle_seed is not None:
            key = shuffle_key(shuffle_seed, pos)
            rec = make_records(dtype, pos, key, rows.label[sel], numerical[sel], ids[sel])
            bucket = bucket_of(key, bucket_bits)
            order = np.argsort(bucket, kind="stable")
            bounds = np.searchsorted(bucket[order], np.arange((1 << bucket_bits) + 1))
            for k in range(1 << bucket_bits):
                if bounds[k + 1] > bounds[k]:
                    out[(split, k)] = rec[order[bounds[k] : bounds[k + 1]]]
        else:
            out[(split, 0)] = make_records(dtype, pos, None, rows.label[sel], numerical[sel], ids[sel])
    return TransformResult(chunk.lines, len(chunk.bad), out)
