"""Value counts per categorical column with bounded memory, and the vocabulary built from them.

Counts are kept as (key, count) pairs where ``key = column << 32 | value``. Each chunk's
values are aggregated (polars group-by) into a buffer; when the buffer outgrows its budget it is
compacted, and if still large, spilled to disk as a *run*: one .npy file per partition, the
partition being the top bits of a hash of the key. A file's counting ends with a final spill,
so a finished input file is a set of runs on disk (which is what makes it resumable).

Merging reads one partition at a time across all runs (every occurrence of a key is in the
same partition), sums, and keeps the keys that reach their column's threshold: memory is one
partition plus the kept vocabulary, whatever the input size.
"""

from __future__ import annotations

import os

import numpy as np
import polars as pl

from preproc.vocab import rank_values

RECORD_BYTES = 48  # a (key, count) pair in a polars group-by, with its hash-table overhead
_FIB = np.uint64(0x9E3779B97F4A7C15)


def partition_of(keys: np.ndarray, bits: int) -> np.ndarray:
    if bits == 0:
        return np.zeros(len(keys), dtype=np.int64)
    with np.errstate(over="ignore"):
        return ((keys * _FIB) >> np.uint64(64 - bits)).astype(np.int64)


def _aggregate(keys: np.ndarray, counts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    df = pl.DataFrame({"k": keys} if counts is None else {"k": keys, "c": counts})
    agg = df.group_by("k").len("c") if counts is None else df.group_by("k").agg(pl.col("c").sum())
    return agg["k"].to_numpy().astype(np.uint64), agg["c"].to_numpy().astype(np.uint64)


def chunk_keys(hashes: np.ndarray, present: np.ndarray) -> np.ndarray:
    """``column << 32 | value`` of every present value of a [n, 26] chunk."""
    columns = np.broadcast_to(np.arange(hashes.shape[1], dtype=np.uint64) << np.uint64(32), hashes.shape)
    return (columns[present] | hashes[present].astype(np.uint64)).astype(np.uint64)


def count_chunk(hashes: np.ndarray, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(keys, counts) of the present values of a [n, 26] chunk."""
    keys = chunk_keys(hashes, present)
    if len(keys) == 0:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    return _aggregate(keys)


class CountWriter:
    """Counts of one input file, spilled as runs under ``directory`` (created)."""

    def __init__(self, directory: str, partition_bits: int, budget_records: int):
        self.directory = directory
        self.partition_bits = partition_bits
        self.budget = max(1024, budget_records)
        self.runs = 0
        self._keys: list[np.ndarray] = []
        self._counts: list[np.ndarray] = []
        self._size = 0
        os.makedirs(directory, exist_ok=True)

    def add(self, k: np.ndarray, c: np.ndarray) -> None:
        """Add a chunk's aggregated counts (see ``count_chunk``)."""
        if len(k) == 0:
            return
        self._keys.append(k)
        self._counts.append(c)
        self._size += len(k)
        if self._size > self.budget:
            self._compact()
            if self._size > self.budget // 2:
                self._spill()

    def _compact(self) -> None:
        if len(self._keys) > 1:
            k, c = _aggregate(np.concatenate(self._keys), np.concatenate(self._counts))
            self._keys, self._counts, self._size = [k], [c], len(k)

    def _spill(self) -> None:
        self._compact()
        keys = self._keys[0] if self._keys else np.zeros(0, np.uint64)
        counts = self._counts[0] if self._counts else np.zeros(0, np.uint64)
        part = partition_of(keys, self.partition_bits)
        order = np.argsort(part, kind="stable")
        bounds = np.searchsorted(part[order], np.arange((1 << self.partition_bits) + 1))
        for p in range(1 << self.partition_bits):
            sel = order[bounds[p] : bounds[p + 1]]
            np.save(os.path.join(self.directory, f"run{self.runs}.p{p}.npy"), np.stack([keys[sel], counts[sel]], axis=1))
        self.runs += 1
        self._keys, self._counts, self._size = [], [], 0

    def finish(self) -> int:
        """Spill what is left; returns the number of runs written."""
        self._spill()
        return self.runs


def merge_counts(run_dirs: list[tuple[str, int]], partition_bits: int, thresholds: list[int]) -> list[np.ndarray]:
    """Values of each column in id order (see ``vocab.rank_values``), from ``(directory, runs)`` pairs."""
    thr = np.asarray(thresholds, dtype=np.uint64)
    kept_keys, kept_counts = [], []
    for p in range(1 << partition_bits):
        parts = [np.load(os.path.join(d, f"run{r}.p{p}.npy")) for d, runs in run_dirs for r in range(runs)]
        parts = [x for x in parts if len(x)]
        if not parts:
            continue
        both = np.concatenate(parts)
        keys, counts = _aggregate(both[:, 0], both[:, 1])
        keep = counts >= thr[(keys >> np.uint64(32)).astype(np.int64)]
        kept_keys.append(keys[keep])
        kept_counts.append(counts[keep])
    keys = np.concatenate(kept_keys) if kept_keys else np.zeros(0, np.uint64)
    counts = np.concatenate(kept_counts) if kept_counts else np.zeros(0, np.uint64)
    column = (keys >> np.uint64(32)).astype(np.int64)
    values = (keys & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return [rank_values(values[column == j], counts[column == j]) for j in range(len(thresholds))]
