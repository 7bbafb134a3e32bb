"""The last step of both engines: fragments -> split-binary dataset and feature_spec.yaml.

Each split's files are written through ``SplitBinaryWriter`` (temporary names, checked ids and
labels; temporaries a killed run left behind are removed first) in row order: unshuffled fragments are streamed in the order given; the buckets of a
shuffled split are loaded one at a time and sorted by (key, position). Nothing replaces an
existing dataset unless every split has rows and was written completely: the old spec is
removed first (so a crash while renaming leaves no spec rather than a wrong one), then the
files are renamed into place, then the new spec is written.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dlrm.data.atomic import pid_alive
from dlrm.data.batch import Batch
from dlrm.data.feature_spec import SPEC_FILE_NAME, FeatureSpec
from dlrm.data.split_binary import SplitBinaryWriter
from preproc.report import empty_split_error

NUM_NUMERICAL = 13
NUM_CATEGORICAL = 26
_WRITE_ROWS = 1 << 18


@dataclass
class SplitFragments:
    """Fragment files of one split: ``buckets[b]`` lists bucket b's files in row order."""

    dtype: np.dtype
    buckets: list[list[str]]
    sort: bool  # shuffled: sort each bucket by (key, pos)


def _batches(records: np.ndarray):
    for a in range(0, len(records), _WRITE_ROWS):
        rec = records[a : a + _WRITE_ROWS]
        ids = np.empty((len(rec), NUM_CATEGORICAL), dtype=np.int64)
        for j in range(NUM_CATEGORICAL):
            ids[:, j] = rec[f"c{j}"]
        yield Batch(numerical=rec["num"], categorical=ids, label=rec["label"])  # type: ignore[arg-type]


def _write_split(writer: SplitBinaryWriter, frags: SplitFragments, advance: Callable[[int], None]) -> None:
    for files in frags.buckets:
        if frags.sort:
            parts = [np.fromfile(p, dtype=frags.dtype) for p in files]
            if not parts:
                continue
            records = np.concatenate(parts)
            del parts
            records = records[np.lexsort((records["pos"], records["key"]))]
            for batch in _batches(records):
                writer.write(batch)
                advance(len(batch))
            del records
            continue
        for p in files:
            records = np.memmap(p, dtype=frags.dtype, mode="r") if os.path.getsize(p) else np.zeros(0, frags.dtype)
            for batch in _batches(records):
                writer.write(batch)
                advance(len(batch))
            del records


_WRITER_TEMP = re.compile(r"\..+\.(?P<pid>\d+)-[0-9a-f]+\.tmp")  # SplitBinaryWriter's .<file>.<pid>-<id>.tmp


def _remove_stale_temporaries(output_dir: str, splits: list[str]) -> None:
    """Temporary files a killed run left in the split directories; never a dataset file, nor
    the file of a writer that is still running (its pid is in the name)."""
    for split in splits:
        directory = os.path.join(output_dir, split)
        if os.path.isdir(directory):
            for name in os.listdir(directory):
                m = _WRITER_TEMP.fullmatch(name)
                if m and not pid_alive(int(m["pid"])):
                    os.unlink(os.path.join(directory, name))


def write_dataset(output_dir: str, cardinalities: list[int], splits: dict[str, SplitFragments], split_files: dict[str, list[str]],
                  metadata_for: Callable[[dict[str, int]], dict], advance: Callable[[int], None] = lambda n: None,
                  skipped: dict | None = None) -> FeatureSpec:
    """Write every split, then the spec (whose metadata ``metadata_for(rows per split)`` gives)."""
    os.makedirs(output_dir, exist_ok=True)
    _remove_stale_temporaries(output_dir, list(splits))
    spec = FeatureSpec.default(NUM_NUMERICAL, cardinalities, splits=list(splits), base_directory=os.path.abspath(output_dir))
    writers = [SplitBinaryWriter(spec, name) for name in splits]
    try:
        for writer, (name, frags) in zip(writers, splits.items()):
            _write_split(writer, frags, advance)
            if writer.num_rows == 0:
                raise empty_split_error(name, split_files[name], skipped or {})
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    rows = {name: w.num_rows for name, w in zip(splits, writers)}
    spec.metadata = metadata_for(rows)
    old_spec = os.path.join(output_dir, SPEC_FILE_NAME)
    if os.path.exists(old_spec):
        os.unlink(old_spec)
    for writer in writers:
        writer.close()
    spec.to_yaml(output_dir)
    return spec


def write_job_dataset(job, cardinalities: list[int], splits: dict[str, SplitFragments], total_rows: int,
                      skipped: dict, progress) -> FeatureSpec:
    """``write_dataset`` for a ``Job`` (its output directory, input files and metadata), shown
    as the ``assemble`` phase of ``progress``; what both engines end with."""
    progress.begin("assemble", total_rows)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        progress.update(n, done_bytes=done)

    spec = write_dataset(
        job.output_dir, cardinalities, splits, {s: job.split_files(s) for s in job.splits},
        lambda rows: job.metadata(rows, skipped), advance, skipped,
    )
    progress.end()
    return spec
