"""The last step of both engines: fragments -> split-binary dataset and feature_spec.yaml, and
the end of a run that both share.

Each split's files are written through ``SplitBinaryWriter`` (temporary names, checked ids and
labels; temporaries a killed run left behind are removed first) in row order: unshuffled
fragments are streamed in the order given; the buckets of a shuffled split are loaded one at a
time and sorted by (key, position). Nothing replaces an existing dataset unless every split has
rows and was written completely: the old spec is removed first (so a crash while renaming leaves
no spec rather than a wrong one), then the files are renamed into place, then the vocabulary the
ids came from replaces ``<output>/vocabulary`` (``vocab.save_dataset_vocabulary``), then the new
spec is written: a dataset with a spec always has the vocabulary of its ids.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from dlrm.data.feature_spec import SPEC_FILE_NAME, FeatureSpec, dtype_for_cardinality
from dlrm.data.split_binary_writer import SplitBinaryWriter
from preproc.fragments import record_dtype
from preproc.job import NUM_CATEGORICAL, NUM_NUMERICAL, Job, Result
from preproc.progress import Progress
from preproc.report import empty_split_error, skipped_text
from preproc.vocab import save_dataset_vocabulary
from preproc.workdir import WorkDir

_WRITE_ROWS = 1 << 18


@dataclass
class SplitFragments:
    """Fragment files of one split: ``buckets[b]`` lists bucket b's files in row order."""

    dtype: np.dtype
    buckets: list[list[str]]
    sort: bool  # shuffled: sort each bucket by (key, pos)


def _write_records(writer: SplitBinaryWriter, records: np.ndarray, advance: Callable[[int], None]) -> None:
    from dlrm.data.batch import Batch  # torch: only once there is a dataset to write, so a refused input fails fast

    for a in range(0, len(records), _WRITE_ROWS):
        rec = records[a : a + _WRITE_ROWS]
        ids = np.empty((len(rec), NUM_CATEGORICAL), dtype=np.int64)
        for j in range(NUM_CATEGORICAL):
            ids[:, j] = rec[f"c{j}"]
        writer.write(Batch(numerical=rec["num"], categorical=ids, label=rec["label"]))  # type: ignore[arg-type]
        advance(len(rec))


def _write_split(writer: SplitBinaryWriter, frags: SplitFragments, advance: Callable[[int], None]) -> None:
    for files in frags.buckets:
        if frags.sort:
            parts = [np.fromfile(p, dtype=frags.dtype) for p in files]
            if not parts:
                continue
            records = np.concatenate(parts)
            del parts
            records = records[np.lexsort((records["pos"], records["key"]))]
            _write_records(writer, records, advance)
            del records
            continue
        for p in files:
            records = np.memmap(p, dtype=frags.dtype, mode="r") if os.path.getsize(p) else np.zeros(0, frags.dtype)
            _write_records(writer, records, advance)
            del records


def write_dataset(output_dir: str, cardinalities: list[int], splits: dict[str, SplitFragments], split_files: dict[str, list[str]],
                  metadata_for: Callable[[dict[str, int]], dict], advance: Callable[[int], None] = lambda n: None,
                  skipped: dict | None = None, vocabulary: str | None = None) -> FeatureSpec:
    """Write every split, then the vocabulary saved in directory ``vocabulary`` (if given) as
    ``<output_dir>/vocabulary``, then the spec (whose metadata ``metadata_for(rows per split)`` gives)."""
    os.makedirs(output_dir, exist_ok=True)
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
    if vocabulary is not None:
        save_dataset_vocabulary(output_dir, vocabulary)
    spec.to_yaml(output_dir)
    return spec


def record_dtypes(job: Job, cardinalities: list[int]) -> dict[str, np.dtype]:
    """Each split's fragment record: ids in the dtypes of the final files, and the shuffle key
    when the split is shuffled."""
    cat = [dtype_for_cardinality(c) for c in cardinalities]
    return {s: record_dtype(cat, keyed=job.shuffled(s)) for s in job.splits}


def write_job_dataset(job: Job, cardinalities: list[int], fragments: dict[str, list[list[str]]], total_rows: int,
                      skipped: dict, progress: Progress, vocabulary: str) -> FeatureSpec:
    """``write_dataset`` for a ``Job`` (its output directory, input files and metadata), shown
    as the ``assemble`` phase of ``progress``; what both engines end with. ``fragments[split][b]``
    lists bucket b's fragment files in row order; ``vocabulary`` is the work directory's saved
    vocabulary, kept with the dataset."""
    dtypes = record_dtypes(job, cardinalities)
    splits = {s: SplitFragments(dtypes[s], fragments[s], sort=job.shuffled(s)) for s in job.written_splits}
    progress.begin("assemble", total_rows)
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        progress.update(n, done_bytes=done)

    spec = write_dataset(
        job.output_dir, cardinalities, splits, {s: job.split_files(s) for s in job.written_splits},
        lambda rows: job.metadata(rows, skipped), advance, skipped, vocabulary,
    )
    progress.end()
    return spec


def finish_run(job: Job, work: WorkDir, spec: FeatureSpec, skipped: dict, progress: Progress, start: float) -> Result:
    """What both engines do once the dataset is written: report the skipped lines, remove the
    work directory (unless kept) and sum up the run."""
    if skipped:
        print(skipped_text(skipped), file=sys.stderr)
    if not job.keep_work_dir:
        work.remove()
    rows = spec.metadata["preprocessing"]["rows"]
    return Result(spec, rows, skipped, dict(progress.summaries), time.monotonic() - start, work.resumed)
