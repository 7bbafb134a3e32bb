"""The part of the Spark engine that runs in Spark's Python workers (through ``mapInArrow``).

Each task receives its partition's rows already sorted (split, bucket, sort key, position),
maps categorical values to ids with the vocabulary Spark ranked (as a memory-mapped hash
table) and computes the float16 numericals with the same table, then appends packed records to
its own fragment files, named by split, bucket and partition.
Files are written under an attempt-specific name and renamed when the task's input is
exhausted, so a retried or speculative task never leaves a half file under a final name.
The task returns one summary row per fragment (rows, first and last position) and one per
input file (rows), which the driver checks and records.

Imported in workers: numpy, pyarrow and the numpy-only preproc modules.
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import pyarrow as pa

from preproc.fragments import FragmentFiles, make_records
from preproc.numeric import MAX_TABLE_DIGITS, LogTable, log_counts_float16, long_count_float16
from preproc.order import LINE_BITS
from preproc.parse import hex8_at
from preproc.vocab import Vocabulary

NUM_NUMERICAL = 13
NUM_CATEGORICAL = 26
SUMMARY_SCHEMA = "kind string, split string, bucket int, part int, rows long, first long, last long, name string"


def hex_column(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """(uint32 values, present) of an Arrow string column of validated 8-hex-digit or empty values."""
    if array.type not in (pa.string(), pa.large_string()):
        array = array.cast(pa.large_string())
    n = len(array)
    width = np.int64 if array.type == pa.large_string() else np.int32
    offsets = np.frombuffer(array.buffers()[1], dtype=width)[array.offset : array.offset + n + 1].astype(np.int64)
    present = np.diff(offsets) == 8
    if array.null_count:
        present &= array.is_valid().to_numpy(zero_copy_only=False)
    data = array.buffers()[2]
    raw = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    values = np.zeros(n, dtype=np.uint32)
    if present.any():
        values[present] = hex8_at(raw, offsets[:-1][present])
    return values, present


def _numerical(batch: pa.RecordBatch, table: LogTable) -> np.ndarray:
    n = batch.num_rows
    counts = np.zeros((n, NUM_NUMERICAL), dtype=np.int64)
    present = np.zeros((n, NUM_NUMERICAL), dtype=bool)
    for k in range(NUM_NUMERICAL):
        col = batch.column(f"n{k}")
        present[:, k] = col.is_valid().to_numpy(zero_copy_only=False)
        counts[:, k] = col.fill_null(0).to_numpy(zero_copy_only=False)
    out = log_counts_float16(counts, present, table)
    longs = batch.column("longc")
    if longs.null_count < n:
        for row in np.flatnonzero(longs.is_valid().to_numpy(zero_copy_only=False)).tolist():
            for k, text in enumerate(longs[row].as_py().split("\t")):
                if len(text) > MAX_TABLE_DIGITS:
                    out[row, k] = long_count_float16(text, table.rounding)
    return out


def make_fragment_writer(directory: str, splits: list[str], dtypes: dict[str, np.dtype], table: LogTable,
                         vocab_dir: str) -> Callable[[Iterator[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """The ``mapInArrow`` function writing a partition's rows into fragments under ``directory``.

    Categorical values arrive as their text (validated) and are mapped with the vocabulary the
    driver built from Spark's ranking, memory-mapped from ``vocab_dir`` (shared storage).
    """

    def write(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        from pyspark import TaskContext

        vocab = Vocabulary.load(vocab_dir)
        ctx = TaskContext.get()
        part = ctx.partitionId()
        files = FragmentFiles(directory, suffix=f".attempt{ctx.attemptNumber()}-{ctx.taskAttemptId()}")
        bounds: dict[tuple[str, int], list[int]] = {}
        per_file: dict[int, int] = {}
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                split_idx = batch.column("split").to_numpy(zero_copy_only=False)
                bucket = batch.column("bucket").to_numpy(zero_copy_only=False)
                pos = batch.column("pos").to_numpy(zero_copy_only=False)
                sortkey = batch.column("sortkey").to_numpy(zero_copy_only=False)
                label = batch.column("label").to_numpy(zero_copy_only=False).astype(np.uint8)
                numerical = _numerical(batch, table)
                hashes = np.empty((batch.num_rows, NUM_CATEGORICAL), dtype=np.uint32)
                present = np.empty((batch.num_rows, NUM_CATEGORICAL), dtype=bool)
                for j in range(NUM_CATEGORICAL):
                    hashes[:, j], present[:, j] = hex_column(batch.column(f"c{j}"))
                ids = vocab.lookup(hashes, present)
                group = split_idx.astype(np.int64) << 32 | bucket.astype(np.int64)
                starts = np.flatnonzero(np.concatenate([[True], group[1:] != group[:-1]]))
                ends = np.append(starts[1:], len(group))
                for a, b in zip(starts.tolist(), ends.tolist()):
                    split = splits[int(split_idx[a])]
                    dtype = dtypes[split]
                    key = sortkey[a:b] if "key" in dtype.names else None
                    rec = make_records(dtype, pos[a:b], key, label[a:b], numerical[a:b], ids[a:b])
                    k = (split, int(bucket[a]))
                    files.append(k[0], k[1], rec, part)
                    lo, hi = int(sortkey[a]), int(sortkey[b - 1])
                    bounds[k] = [bounds[k][0], hi] if k in bounds else [lo, hi]
                for f, c in zip(*np.unique(pos >> LINE_BITS, return_counts=True)):
                    per_file[int(f)] = per_file.get(int(f), 0) + int(c)
            names = files.close()
        except BaseException:
            files.abort()
            raise
        rows = [("fragment", s, b, part, files.rows[(s, b)], bounds[(s, b)][0], bounds[(s, b)][1], names[(s, b)])
                for s, b in names]
        rows += [("file", "", 0, f, c, 0, 0, "") for f, c in per_file.items()]
        cols = list(zip(*rows)) if rows else [[] for _ in range(8)]
        names_ = ["kind", "split", "bucket", "part", "rows", "first", "last", "name"]
        types = [pa.string(), pa.string(), pa.int32(), pa.int32(), pa.int64(), pa.int64(), pa.int64(), pa.string()]
        yield pa.RecordBatch.from_arrays([pa.array(list(c), type=t) for c, t in zip(cols, types)], names=names_)

    return write
