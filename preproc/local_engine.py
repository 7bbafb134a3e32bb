"""The single-machine engine: streaming, bounded memory, no Java.

Stages, each resumable per input file (see ``workdir``):

1. **scan** every input file in order: parse, report malformed lines (fail at the first one,
   or count them), tally rows per split, and count the categorical values of train rows into
   spilled runs (``counting``).
2. **vocab**: merge the runs partition by partition into the vocabulary (``vocab``).
3. **transform** every input file: parse again, map values to ids, compute float16 numericals,
   write packed records per (split, shuffle bucket) (``tasks.transform_task``).
4. **assemble**: write the dataset, its vocabulary (``<output>/vocabulary``) and spec
   (``assemble``), and remove the work directory.

Chunks of 32 MiB of lines are parsed by a pool of worker processes (``workers``) and consumed
in order, so memory stays bounded by the number of chunks in flight, the count buffer and one
shuffle bucket, whatever the input size; the vocabulary is the only thing that grows with the
data (about 32 bytes per kept value).
"""

from __future__ import annotations

import collections
import math
import multiprocessing
import os
import time
import uuid
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Callable, Iterator

from dlrm.data.feature_spec import FeatureSpec
from dlrm.engine.errors import DatasetError
from preproc.assemble import finish_run, record_dtypes, write_job_dataset
from preproc.counting import RECORD_BYTES, CountWriter, merge_counts
from preproc.fragments import FragmentFiles, fragment_name
from preproc.job import Job, Result
from preproc.numeric import build_log_table
from preproc.order import bucket_bits as choose_bucket_bits
from preproc.progress import Progress
from preproc.report import MalformedSummary, classify_bad, empty_split_error, malformed_error
from preproc.tasks import init_worker, scan_task, transform_task
from preproc.textio import DEFAULT_CHUNK_BYTES, count_lines, numbered_chunks, prefetch
from preproc.vocab import Vocabulary
from preproc.workdir import WorkDir, file_stamp

UNKNOWN_END = 1 << 62  # last line of a file whose length need not be known
_BYTES_PER_LINE = 150  # rough size of a Criteo line, to size partitions before counting
_GZIP_RATIO = 4
_SHUFFLE_RECORD_BYTES = 300  # a shuffled record while a bucket is loaded and sorted (with copies)
_WORKER_BYTES = 12 * DEFAULT_CHUNK_BYTES  # a worker's peak for one chunk (parse temporaries)


def _input_bytes(path: str) -> int:
    return os.path.getsize(path) * (_GZIP_RATIO if path.endswith(".gz") else 1)


def default_workers(memory_limit: int) -> int:
    return max(1, min(os.cpu_count() or 1, 8, memory_limit // (2 * _WORKER_BYTES)))


def plan_settings(job: Job) -> dict:
    """Partition and bucket counts for the job's size and memory limit (``job.extra`` may override)."""
    counted = sum(_input_bytes(f.path) for i, f in enumerate(job.inputs) if job.counted(i))
    est_rows = counted // _BYTES_PER_LINE
    # Distinct (column, value) pairs are a fraction of all values; a partition must fit half the limit.
    need = est_rows * 26 * 0.3 * RECORD_BYTES
    partition_bits = min(8, max(0, math.ceil(math.log2(max(need / (job.memory_limit / 2), 1)))))
    train_rows = sum(_input_bytes(f.path) for f in job.inputs if "train" in f.splits()) // _BYTES_PER_LINE
    settings = {
        "partition_bits": partition_bits,
        "count_budget": int(job.memory_limit / 4 / RECORD_BYTES),
        "bucket_bits": choose_bucket_bits(train_rows, _SHUFFLE_RECORD_BYTES, job.memory_limit // 2)
        if job.shuffle_seed is not None else 0,
    }
    settings.update({k: job.extra[k] for k in settings if k in job.extra})
    return settings


class _Pool:
    """Runs tasks inline (one worker) or in spawned processes, yielding results in order."""

    def __init__(self, workers: int):
        self.executor = None
        if workers > 1:
            context = multiprocessing.get_context("spawn")
            self.executor = ProcessPoolExecutor(workers, mp_context=context, initializer=init_worker)
        self.depth = workers + 1

    def ordered(self, fn: Callable, calls: Iterator[tuple[tuple, object]]) -> Iterator[tuple[object, object]]:
        """``calls`` yields (args, tag); yields (fn(*args), tag) in the same order."""
        if self.executor is None:
            for args, tag in calls:
                yield fn(*args), tag
            return
        window: collections.deque[tuple[Future, object]] = collections.deque()
        try:
            for args, tag in calls:
                window.append((self.executor.submit(fn, *args), tag))
                if len(window) >= self.depth:
                    future, t = window.popleft()
                    yield future.result(), t
            while window:
                future, t = window.popleft()
                yield future.result(), t
        finally:
            for future, _ in window:
                future.cancel()

    def close(self) -> None:
        if self.executor is not None:
            self.executor.shutdown(wait=True, cancel_futures=True)


class LocalEngine:
    """One run of a job; ``run()`` does the stages, skipping units a previous run finished."""

    def __init__(self, job: Job, progress: Progress | None = None, workers: int | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.job = job
        self.progress = progress or Progress("off")
        self.workers = workers or default_workers(job.memory_limit)
        self.chunk_bytes = chunk_bytes

    # ------------------------------------------------------------------ stages

    def run(self) -> Result:
        job = self.job
        start = time.monotonic()
        job.check_inputs()
        self.work = WorkDir(job.work_path, job.identity("local"), plan_settings(job), fresh=job.fresh)
        settings = self.work.settings
        if self.work.resumed:
            self.progress.message(f"resuming the unfinished run in {job.work_path}")
        self.pool = _Pool(self.workers)
        try:
            self.stamps = [file_stamp(p) for p in job.paths]
            lines = self._line_counts()
            self.ranges = [
                job.ranges(i, lines[i]) if f.needs_line_count else [(f.rule, 1, UNKNOWN_END)]
                for i, f in enumerate(job.inputs)
            ]
            vocab = self.work.done("vocab", self._vocab_depends())
            scans = self._scan(lines, need_runs=vocab is None)
            skipped = self._check_rows(scans)
            vocab = vocab or self._vocab(scans, settings)
            fragments = self._transform(vocab, settings)
            cardinalities = vocab["cardinalities"]
            spec = self._assemble(cardinalities, fragments, skipped, settings)
        except BaseException:
            self.work.remove_partial()  # the unit being written; finished units stay for a resume
            raise
        finally:
            self.pool.close()
        return finish_run(job, self.work, spec, skipped, self.progress, start)

    def _vocab_depends(self) -> dict:
        return {"counted": [self.stamps[i] for i in range(len(self.job.inputs)) if self.job.counted(i)]}

    def _line_counts(self) -> dict[int, int]:
        """Line counts of the files whose split boundaries depend on them (day 23, Kaggle)."""
        counts = {}
        todo = []
        for i, f in enumerate(self.job.inputs):
            if f.needs_line_count:
                marker = self.work.done(f"lines/f{i}", self.stamps[i])
                if marker is None:
                    todo.append(i)
                else:
                    counts[i] = marker["lines"]
        if todo:
            self.progress.begin("count lines", sum(os.path.getsize(self.job.inputs[i].path) for i in todo), len(todo))
            for n, i in enumerate(todo):
                counts[i] = count_lines(self.job.inputs[i].path, self.chunk_bytes)
                self.work.commit(f"lines/f{i}", {"lines": counts[i]}, self.stamps[i])
                self.progress.update(counts[i], files=n + 1)
            self.progress.end()
        return counts

    def _chunks(self, i: int, extra: Callable[[bytes, int], tuple]) -> Iterator[tuple[tuple, tuple]]:
        for data, first, n, raw_pos in prefetch(numbered_chunks(self.job.inputs[i].path, self.chunk_bytes)):
            yield extra(data, first), (first, n, raw_pos)

    def _scan(self, lines: dict[int, int], need_runs: bool) -> list[dict]:
        """Scan every file not scanned yet (or whose count runs a vocabulary rebuild needs)."""
        job, work = self.job, self.work
        paths = job.paths
        sizes = [os.path.getsize(p) for p in paths]
        self.progress.begin("scan", sum(sizes), len(paths))
        markers = []
        for i, path in enumerate(paths):
            marker = work.done(f"scan/f{i}", self.stamps[i])
            if marker is not None and need_runs and job.counted(i) and not os.path.isdir(work.file(f"scan/f{i}")):
                marker = None  # counted before, but its runs were dropped after an earlier vocabulary
            if marker is None:
                marker = self._scan_file(i, sum(sizes[:i]))
                if i in lines and marker["lines"] != lines[i]:
                    raise DatasetError(f"{path} has {marker['lines']} lines now but had {lines[i]} when counted: "
                                       f"it changed during the run; rerun to redo it")
            else:
                self.progress.update(marker["lines"])
            self.progress.update(done_bytes=sum(sizes[: i + 1]), files=i + 1)
            markers.append(marker)
        self.progress.end()
        return markers

    def _scan_file(self, i: int, done_before: int) -> dict:
        job, work, settings = self.job, self.work, self.work.settings
        path = job.inputs[i].path
        ranges = self.ranges[i]
        directory = work.begin(f"scan/f{i}")
        writer = CountWriter(directory, settings["partition_bits"], settings["count_budget"])
        summary = MalformedSummary()
        good: dict[str, int] = {}
        total = 0
        calls = self._chunks(i, lambda data, first: (data, first, ranges, job.counted_splits))
        for result, (first, n, raw_pos) in self.pool.ordered(scan_task, calls):
            for line, reason, detail in classify_bad(result.bad):
                if job.on_error == "fail":
                    raise malformed_error(path, line, detail)
                summary.add(reason, i, line)
            writer.add(result.keys, result.counts)
            for split, count in result.good.items():
                good[split] = good.get(split, 0) + count
            total += result.lines
            self.progress.update(result.lines, done_bytes=done_before + raw_pos)
        runs = writer.finish()
        marker = {"lines": total, "malformed": summary.to_json(), "good": good, "runs": runs}
        work.commit(f"scan/f{i}", marker, self.stamps[i])
        return marker

    def _check_rows(self, scans: list[dict]) -> dict:
        """The skipped-line summary; fails now if a split would be empty."""
        summary = MalformedSummary()
        good: dict[str, int] = {}
        for marker in scans:
            summary.extend(MalformedSummary.from_json(marker["malformed"]))
            for split, count in marker["good"].items():
                good[split] = good.get(split, 0) + count
        skipped = summary.metadata(self.job.paths)
        for split in self.job.written_splits:
            if not good.get(split):
                raise empty_split_error(split, self.job.split_files(split), skipped)
        return skipped

    def _vocab(self, scans: list[dict], settings: dict) -> dict:
        """Build the vocabulary; its marker has the cardinalities and an id of this build."""
        work = self.work
        self.progress.begin("vocab")
        runs = [(work.file(f"scan/f{i}"), m["runs"]) for i, m in enumerate(scans) if self.job.counted(i)]
        values = merge_counts(runs, settings["partition_bits"], self.job.thresholds)
        vocab = Vocabulary.build(values)
        vocab.save(work.begin("vocab"))
        marker = {"cardinalities": vocab.cardinalities, "build": uuid.uuid4().hex}
        work.commit("vocab", marker, self._vocab_depends())
        self.progress.end(f"cardinalities {vocab.cardinalities}")
        for i in range(len(scans)):
            work.clear(f"scan/f{i}")  # the count runs are not needed once the vocabulary exists
        return work.read("vocab.json")

    def _transform(self, vocab: dict, settings: dict) -> list[dict]:
        job, work = self.job, self.work
        cardinalities = vocab["cardinalities"]
        paths = job.paths
        sizes = [os.path.getsize(p) for p in paths]
        table = build_log_table(job.numerical_rounding)
        dtypes = record_dtypes(job, cardinalities)
        vocab_dir = work.file("vocab")
        self.progress.begin("transform", sum(sizes), len(paths))
        markers = []
        for i, path in enumerate(paths):
            depends = {"file": self.stamps[i], "vocab": vocab["build"]}
            marker = work.done(f"rows/f{i}", depends)
            if marker is None:
                files = FragmentFiles(work.begin(f"rows/f{i}"))
                ranges = self.ranges[i]
                calls = self._chunks(i, lambda data, first: (
                    data, first, i, ranges, vocab_dir, table, dtypes, job.shuffle_seed, settings["bucket_bits"]))
                try:
                    for result, (first, n, raw_pos) in self.pool.ordered(transform_task, calls):
                        for (split, bucket), records in result.records.items():
                            files.append(split, bucket, records)
                        self.progress.update(result.lines - result.malformed, done_bytes=sum(sizes[:i]) + raw_pos)
                    files.close()
                except BaseException:
                    files.abort()
                    raise
                marker = {"rows": {f"{s}.b{b}": n for (s, b), n in sorted(files.rows.items())}}
                work.commit(f"rows/f{i}", marker, depends)
            else:
                self.progress.update(sum(marker["rows"].values()))
            self.progress.update(done_bytes=sum(sizes[: i + 1]), files=i + 1)
            markers.append(marker)
        self.progress.end()
        return markers

    def _assemble(self, cardinalities: list[int], fragments: list[dict], skipped: dict, settings: dict) -> FeatureSpec:
        job, work = self.job, self.work
        files = {}
        for split in job.written_splits:
            buckets = 1 << settings["bucket_bits"] if job.shuffled(split) else 1
            files[split] = [
                [work.file(f"rows/f{i}", fragment_name(split, b)) for i, m in enumerate(fragments) if f"{split}.b{b}" in m["rows"]]
                for b in range(buckets)
            ]
        total = sum(n for m in fragments for key, n in m["rows"].items() if key.rsplit(".", 1)[0] in files)
        return write_job_dataset(job, cardinalities, files, total, skipped, self.progress, work.file("vocab"))


def preprocess_local(job: Job, progress: Progress | None = None, workers: int | None = None,
                     chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Result:
    """Run ``job`` with the single-machine engine; see the module docstring."""
    return LocalEngine(job, progress, workers, chunk_bytes).run()
