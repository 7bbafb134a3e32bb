"""The Spark engine: the same job, the same bytes, on a Spark cluster (local mode by default).

Input files are processed in *groups* (consecutive files of at least ``group_bytes``; a real
Criteo day is always alone), each group a unit of resume, in four stages:

1. **lines** (per group): read lines (only ``\\n`` ends a line), classify each with the
   reference's rules in Spark SQL (Java regex anchored with ``\\z``), and aggregate per file
   split: its first ``monotonically_increasing_id`` and line count (from which the driver
   derives every row's line number), and the malformed lines (count and first locations per
   reason, and the raw bytes of the first one, whose message ``reference.parse_line`` writes).
2. **counts** (per group with train rows): value counts per column of the well-formed train
   rows (posexplode + group-by), written as parquet.
3. **vocab**: counts summed over groups, filtered by threshold, ranked with
   ``row_number() over (partition by column order by count desc, value asc)``.
   The driver collects the ranking into the same hash table the single-machine engine uses
   (``vocab.Vocabulary``), saved in the work directory (and, at the end, kept with the
   dataset as ``<output>/vocabulary``).
4. **rows** (per group): a sort by (split, shuffle bucket, sort key, position), and
   ``mapInArrow`` tasks that map values to ids with that table (memory-mapped), compute the
   float16 numericals and write packed records (``spark_worker``), which the driver assembles
   exactly as the single-machine engine does.

Line numbers come from ``monotonically_increasing_id`` and the split offsets of stage 1, so the
file-split settings that decide them are pinned and recorded; a resumed run must use the same.
The output directory and work directory must be on a filesystem the driver and all executors
share (trivially true in local mode).
"""

from __future__ import annotations

import hashlib
import io
import os
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
import zipfile
from functools import reduce

import numpy as np

from dlrm.engine.atomic import write_atomically
from dlrm.engine.errors import DatasetError
from preproc.assemble import finish_run, record_dtypes, write_job_dataset
from preproc.job import NUM_CATEGORICAL, NUM_NUMERICAL, Job, Result
from preproc.layout import SPLITS
from preproc.numeric import MAX_TABLE_DIGITS, build_log_table
from preproc.order import LINE_BITS
from preproc.order import bucket_bits as choose_bucket_bits
from preproc.progress import Progress
from preproc.reference import ERROR_REASONS
from preproc.report import MalformedSummary, classify, empty_split_error, malformed_error
from preproc.spark_worker import SUMMARY_SCHEMA, hex_column, make_fragment_writer
from preproc.textio import check_lines
from preproc.vocab import Vocabulary
from preproc.workdir import WorkDir, file_stamp

# File-split settings pinned by this engine (they decide which rows share a split, hence line numbers).
PINNED_CONF = {
    "spark.sql.files.maxPartitionBytes": str(128 << 20),
    "spark.sql.files.openCostInBytes": str(4 << 20),
    "spark.sql.files.minPartitionNum": "1",
}
# Java regexes: \z is the very end of the text ($ would also match before a final \r); [0-9] is ASCII.
_LINE_RE = r"^[01](\t(-?[0-9]+)?){13}(\t([0-9a-fA-F]{8})?){26}\z"  # a whole well-formed line
_COUNT_RE = r"^-?[0-9]+\z"
_HASH_RE = r"^[0-9a-fA-F]{8}\z"
_SHUFFLE_RECORD_BYTES = 300
_SIGN = -(1 << 63)


# ---------------------------------------------------------------------------- session


def spark_session(master: str = "local[*]", conf: dict[str, str] | None = None, memory_limit: int | None = None):
    """A SparkSession for preprocessing: pinned file splits, this Python for workers, quiet logs.

    ``conf`` overrides the defaults (but a pinned file-split setting that differs is recorded
    in the work directory, and resuming with another value is refused).
    """
    from pyspark.sql import SparkSession

    settings = {
        "spark.app.name": "criteo-preprocessing",
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        "spark.sql.execution.arrow.maxRecordsPerBatch": "65536",
        "spark.ui.showConsoleProgress": "false",
        **PINNED_CONF,
    }
    if master.startswith("local"):
        if memory_limit:
            settings["spark.driver.memory"] = f"{max(1, memory_limit >> 30)}g"
        cores = os.cpu_count() or 1
        settings["spark.sql.shuffle.partitions"] = str(max(4, 4 * cores))
        # Workers forked from a daemon that imported torch (which the workers' imports pull in
        # through dlrm) once, not once per worker: see dlrm.spark.worker_daemon.
        settings["spark.python.daemon.module"] = "dlrm.spark.worker_daemon"
    settings.update(conf or {})
    # A session started from Python takes its workers' interpreter from PYSPARK_PYTHON, not from
    # spark.pyspark.python: without it they run the first python3 on PATH, which lacks this
    # project's packages when a venv's python was started by its path.
    os.environ["PYSPARK_PYTHON"] = ((conf or {}).get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON")
                                    or sys.executable)
    builder = SparkSession.builder.master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(os.environ.get("PREPROC_SPARK_LOG_LEVEL", "ERROR"))
    return spark


def _ship_package(spark) -> None:
    """Make ``preproc`` importable in the Python workers: a zip of its sources, named by content.

    The zip lives in the system's temporary directory (not the work directory, which a
    finished run deletes while the session may live on); a session ships each version once.
    """
    package = os.path.dirname(os.path.abspath(__file__))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in sorted(os.listdir(package)):
            if name.endswith(".py"):
                info = zipfile.ZipInfo(f"preproc/{name}", date_time=(1980, 1, 1, 0, 0, 0))
                with open(os.path.join(package, name), "rb") as f:
                    z.writestr(info, f.read())
    data = buf.getvalue()
    name = f"preproc-{hashlib.sha1(data).hexdigest()[:12]}.zip"
    sc = spark.sparkContext
    if name in {os.path.basename(p) for p in getattr(sc, "_python_includes", None) or []}:
        return
    path = os.path.join(tempfile.gettempdir(), name)
    if not os.path.exists(path):
        def write(tmp: str) -> None:
            with open(tmp, "wb") as f:
                f.write(data)

        write_atomically(path, write)
    _add_py_file_for_workers_only(sc, path)


def _add_py_file_for_workers_only(sc, path: str) -> None:
    """``sc.addPyFile(path)`` without its change to this process's ``sys.path``.

    pyspark also puts the shipped zip's copy (in the session's temporary folder) first on the
    driver's import path; once the session stops, that folder is gone, and a later import of a
    ``preproc`` module in this process (a second run, a notebook) fails with FileNotFoundError.
    The driver imports ``preproc`` from where it is installed; only the workers need the zip.
    """
    before = list(sys.path)
    sc.addPyFile(path)
    for entry in [p for p in sys.path if p not in before]:
        sys.path.remove(entry)
        sys.path_importer_cache.pop(entry, None)


class _Status(threading.Thread):
    """Shows the running Spark stage's task progress on the progress line while a job runs."""

    def __init__(self, spark, progress: Progress):
        super().__init__(daemon=True, name="preproc-spark-status")
        self.tracker = spark.sparkContext.statusTracker()
        self.progress = progress
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            try:
                stages = [self.tracker.getStageInfo(s) for s in self.tracker.getActiveStageIds()]
            except Exception:  # the context is shutting down
                return
            tasks = [(s.numCompletedTasks, s.numTasks) for s in stages if s is not None]
            if tasks:
                done, total = sum(t[0] for t in tasks), sum(t[1] for t in tasks)
                self.progress.detail = f"spark tasks {done}/{total}"
                self.progress.update(0)

    def __enter__(self) -> "_Status":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()
        self.progress.detail = ""


# ---------------------------------------------------------------------------- expressions


def _escape_glob(path: str) -> str:
    """Spark treats input paths as Hadoop globs; escape the special characters of a real path."""
    return "".join("\\" + c if c in "\\*?[]{}" else c for c in os.path.abspath(path))


def _fields(F):
    return F.split(F.col("value"), "\t", -1)


def _good(F):
    """Whether a line is well formed: one regex over the whole line."""
    return F.col("value").rlike(_LINE_RE)


def _reason(F):
    """The reference's reason of a line (null when well formed), in its order of checks.

    The field-by-field checks only run for lines that fail the whole-line regex.
    """
    fields = _fields(F)
    field = lambda k: F.get(fields, k)  # noqa: E731  (null past the end, in any ANSI mode)
    label_ok = field(0).isin("0", "1")
    counts_ok = reduce(lambda a, b: a & b, [(field(k) == "") | field(k).rlike(_COUNT_RE) for k in range(1, 14)])
    hashes_ok = reduce(lambda a, b: a & b, [(field(k) == "") | field(k).rlike(_HASH_RE) for k in range(14, 40)])
    return (
        F.when(_good(F), F.lit(None).cast("string"))
        .when(F.size(fields) != 40, "field_count")
        .when(~label_ok, "label")
        .when(~counts_ok, "numerical")
        .when(~hashes_ok, "categorical")
    )


class SparkEngine:
    """One run of a job on Spark; ``run()`` does the stages, skipping finished groups."""

    def __init__(self, job: Job, progress: Progress | None = None, spark=None, master: str = "local[*]",
                 conf: dict[str, str] | None = None, group_bytes: int = 1 << 30):
        from pyspark.sql import functions as F

        self.F = F
        self.job = job
        self.progress = progress or Progress("off")
        self.own_session = spark is None
        self.spark = spark or spark_session(master, conf, job.memory_limit)
        self.group_bytes = group_bytes

    # ------------------------------------------------------------------ plan

    def _groups(self) -> list[list[int]]:
        groups: list[list[int]] = []
        size = 0
        for i, f in enumerate(self.job.inputs):
            if not groups or size >= self.group_bytes:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += os.path.getsize(f.path)
        return groups

    def _settings(self) -> dict:
        conf = self.spark.conf
        job = self.job
        train_bytes = sum(os.path.getsize(f.path) * (4 if f.path.endswith(".gz") else 1) for f in job.inputs if "train" in f.splits())
        return {
            "groups": self._groups(),
            "files": {k: conf.get(k) for k in PINNED_CONF},
            "bucket_bits": job.extra.get("bucket_bits", choose_bucket_bits(train_bytes // 150, _SHUFFLE_RECORD_BYTES, job.memory_limit // 2))
            if job.shuffle_seed is not None else 0,
        }

    # ------------------------------------------------------------------ run

    def run(self) -> Result:
        job = self.job
        start = time.monotonic()
        job.check_inputs()
        self.work = WorkDir(job.work_path, job.identity("spark"), self._settings(), fresh=job.fresh)
        current = {k: self.spark.conf.get(k) for k in PINNED_CONF}
        if self.work.settings["files"] != current:
            raise DatasetError(
                f"{job.work_path}: the unfinished run split files with {self.work.settings['files']}, this session "
                f"with {current}; line numbers would differ: use the same settings or pass --fresh"
            )
        if self.work.resumed:
            self.progress.message(f"resuming the unfinished run in {job.work_path}")
        _ship_package(self.spark)
        groups = self.work.settings["groups"]
        self.stamps = [file_stamp(p) for p in job.paths]
        try:
            lines = self._lines_stage(groups)
            self.ranges = {i: job.ranges(i, lines[i]["lines"]) for i in range(len(job.inputs))}
            skipped = self._check_rows(lines)
            vocab = self._vocab_stage(groups, lines)
            cardinalities = vocab["cardinalities"]
            fragments = self._rows_stage(groups, lines, vocab)
            spec = self._assemble(cardinalities, fragments, skipped)
        except BaseException:
            self.work.remove_partial()  # the group being written; finished groups stay for a resume
            raise
        return finish_run(job, self.work, spec, skipped, self.progress, start)

    # ------------------------------------------------------------------ stage 1: lines

    def _read(self, files: list[int]):
        """Lines of ``files`` (one read) with ``uri``, split ``block`` start and ``mid`` (increasing id)."""
        F = self.F
        paths = [_escape_glob(self.job.inputs[i].path) for i in files]
        return self.spark.read.option("lineSep", "\n").text(paths).select(
            F.col("_metadata.file_path").alias("uri"), F.col("_metadata.file_block_start").alias("block"),
            F.monotonically_increasing_id().alias("mid"), F.col("value"),
        )

    def _file_index(self, uris: set[str], files: list[int]) -> dict[str, int]:
        """Which input file each of Spark's file URIs is."""
        known = {}
        for i in files:
            path = self.job.inputs[i].path
            known[os.path.abspath(path)] = i
            known[os.path.realpath(path)] = i
        out = {}
        for uri in uris:
            parsed = urllib.parse.urlparse(uri)
            local = urllib.parse.unquote(parsed.path) if parsed.scheme in ("", "file") else uri
            if local not in known:
                raise RuntimeError(f"internal error: Spark read {uri}, which is none of the input files")
            out[uri] = known[local]
        return out

    def _lines_stage(self, groups: list[list[int]]) -> dict[int, dict]:
        job, work = self.job, self.work
        sizes = [os.path.getsize(p) for p in job.paths]
        self.progress.begin("spark lines", sum(sizes), len(job.inputs))
        out: dict[int, dict] = {}
        done_files = 0
        for g, files in enumerate(groups):
            depends = [self.stamps[i] for i in files]
            marker = work.done(f"spark/lines/g{g}", depends)
            if marker is None:
                for i in files:  # a line over the bound, or binary data, refused before Spark reads it
                    check_lines(job.inputs[i].path)
                with _Status(self.spark, self.progress):
                    marker = self._lines_group(files)
                work.commit(f"spark/lines/g{g}", marker, depends)
            for i in files:
                info = marker[str(i)]
                out[i] = info
                if job.on_error == "fail" and info["first_bad"] is not None:
                    line, raw = info["first_bad"]
                    found = classify(bytes.fromhex(raw))
                    if found is None:
                        raise RuntimeError(f"internal error: Spark set aside {job.inputs[i].path}:{line}, the reference parses it")
                    raise malformed_error(job.inputs[i].path, line, found[1])
            done_files += len(files)
            self.progress.update(sum(out[i]["lines"] for i in files), done_bytes=sum(sizes[:done_files]), files=done_files)
        self.progress.end()
        return out

    def _lines_group(self, files: list[int]) -> dict:
        F = self.F
        df = self._read(files).withColumn("reason", _reason(F))
        aggs = [F.min("mid").alias("mid0"), F.count(F.lit(1)).alias("n")]
        for r in ERROR_REASONS:
            aggs.append(F.count(F.when(F.col("reason") == r, 1)).alias(f"n_{r}"))
            aggs.append(F.slice(F.array_sort(F.collect_list(F.when(F.col("reason") == r, F.col("mid")))), 1, 5).alias(f"first_{r}"))
        aggs.append(F.min(F.when(F.col("reason").isNotNull(), F.struct(F.col("mid"), F.col("value").cast("binary").alias("raw")))).alias("bad"))
        blocks = df.groupBy("uri", "block").agg(*aggs).collect()
        index = self._file_index({b["uri"] for b in blocks}, files)
        marker: dict = {}
        for i in files:
            mine = sorted((b for b in blocks if index[b["uri"]] == i), key=lambda b: b["block"])
            summary = MalformedSummary()
            base, first_bad, bases = 0, None, []
            for b in mine:
                offset = base - b["mid0"] + 1  # line = mid + offset
                bases.append([b["uri"], b["block"], offset])
                for r in ERROR_REASONS:
                    summary.counts[r] += b[f"n_{r}"]
                    summary.first[r] = sorted(summary.first[r] + [(i, m + offset) for m in b[f"first_{r}"]])[:5]
                if b["bad"] is not None:
                    line = b["bad"]["mid"] + offset
                    if first_bad is None or line < first_bad[0]:
                        first_bad = [line, bytes(b["bad"]["raw"]).hex()]
                base += b["n"]
            marker[str(i)] = {"lines": base, "bases": bases, "malformed": summary.to_json(), "first_bad": first_bad}
        return marker

    def _check_rows(self, lines: dict[int, dict]) -> dict:
        summary = MalformedSummary()
        for i in range(len(self.job.inputs)):
            summary.extend(MalformedSummary.from_json(lines[i]["malformed"]))
        skipped = summary.metadata(self.job.paths)
        # Splits made of whole files can be checked now; halves of a file are checked when written.
        for split in self.job.written_splits:
            whole = [i for i, f in enumerate(self.job.inputs) if f.rule == split]
            if whole and len(whole) == len(self.job.split_files(split)):
                good = sum(lines[i]["lines"] - MalformedSummary.from_json(lines[i]["malformed"]).total for i in whole)
                if good == 0:
                    raise empty_split_error(split, self.job.split_files(split), skipped)
        return skipped

    # ------------------------------------------------------------------ rows with line numbers and splits

    def _good_rows(self, files: list[int], lines: dict[int, dict]):
        """Well-formed rows of ``files`` with ``line``, ``pos`` and ``split`` (index into SPLITS)."""
        F = self.F
        df = self._read(files).filter(_good(F))
        bases = [(uri, block, i, offset) for i in files for uri, block, offset in lines[i]["bases"]]
        table = self.spark.createDataFrame(bases, "uri string, block long, file int, offset long")
        df = df.join(F.broadcast(table), on=["uri", "block"], how="inner")
        df = df.withColumn("line", F.col("mid") + F.col("offset"))
        split = None
        for i in files:
            for name, a, b in self.ranges[i]:
                cond = (F.col("file") == i) & F.col("line").between(a, b)
                split = F.when(cond, SPLITS.index(name)) if split is None else split.when(cond, SPLITS.index(name))
        return df.withColumn("split", split).withColumn("pos", F.shiftleft(F.col("file").cast("long"), LINE_BITS) + F.col("line"))

    # ------------------------------------------------------------------ stage 2 and 3: counts and vocab

    def _vocab_stage(self, groups: list[list[int]], lines: dict[int, dict]) -> dict:
        """Counts per group, then the vocabulary; returns the vocabulary's marker."""
        from pyspark.sql import Window

        job, work, F = self.job, self.work, self.F
        counted = [g for g, files in enumerate(groups) if any(job.counted(i) for i in files)]
        vocab_depends = [self.stamps[i] for i in range(len(job.inputs)) if job.counted(i)]
        marker = work.done("spark/vocab", vocab_depends)
        if marker is not None:
            return marker
        sizes = {g: sum(os.path.getsize(job.inputs[i].path) for i in groups[g]) for g in counted}
        self.progress.begin("spark counts", sum(sizes.values()), len(counted), unit="groups")
        for n, g in enumerate(counted):
            depends = [self.stamps[i] for i in groups[g]]
            unit = f"spark/counts/g{g}"
            if work.done(unit, depends) is None or not os.path.isdir(work.file(unit)):
                with _Status(self.spark, self.progress):
                    rows = self._good_rows(groups[g], lines).filter(
                        F.col("split").isin([SPLITS.index(s) for s in job.counted_splits]))
                    values = rows.select(F.posexplode(F.slice(_fields(F), 15, NUM_CATEGORICAL)).alias("col", "value"))
                    counts = values.filter(F.col("value") != "").select("col", F.lower("value").alias("value"))
                    counts.groupBy("col", "value").agg(F.count(F.lit(1)).alias("n")).write.parquet(
                        os.path.join(work.begin(unit), "data"))
                work.commit(unit, {}, depends)
            self.progress.update(sum(lines[i]["lines"] for i in groups[g] if job.counted(i)),
                                 done_bytes=sum(sizes[c] for c in counted[: n + 1]), files=n + 1)
        self.progress.end()

        self.progress.begin("spark vocab")
        with _Status(self.spark, self.progress):
            counts = self.spark.read.parquet(*[work.file(f"spark/counts/g{g}", "data") for g in counted])
            totals = counts.groupBy("col", "value").agg(F.sum("n").alias("n"))
            threshold = F.element_at(F.array(*[F.lit(int(t)) for t in job.thresholds]), F.col("col") + 1)
            kept = totals.filter(F.col("n") >= threshold)
            rank = F.row_number().over(Window.partitionBy("col").orderBy(F.desc("n"), F.asc("value")))
            unit = work.begin("spark/vocab")
            directory = os.path.join(unit, "data")
            kept.select("col", "value", rank.alias("id")).write.partitionBy("col").parquet(directory)
            vocab = self._collect_vocab(directory)
            vocab.save(os.path.join(unit, "table"))
        work.commit("spark/vocab", {"cardinalities": vocab.cardinalities, "build": uuid.uuid4().hex}, vocab_depends)
        self.progress.end(f"cardinalities {vocab.cardinalities}")
        for g in counted:
            work.clear(f"spark/counts/g{g}")  # the counts are not needed once the vocabulary exists
        return work.read("spark/vocab.json")

    def _collect_vocab(self, directory: str) -> Vocabulary:
        """Spark's ranked values, column by column in id order, as the engines' lookup table."""
        ranked = self.spark.read.parquet(directory).select("col", "id", "value").orderBy("col", "id").toArrow()
        col = ranked.column("col").to_numpy()
        ids = ranked.column("id").to_numpy()
        values, present = hex_column(ranked.column("value").combine_chunks())
        if not present.all():
            raise RuntimeError("internal error: a kept categorical value is not 8 hex digits")
        by_column = []
        for j in range(NUM_CATEGORICAL):
            mine = col == j
            if not np.array_equal(ids[mine], np.arange(1, int(mine.sum()) + 1)):
                raise RuntimeError(f"internal error: the ids of column {j} are not 1..{int(mine.sum())}")
            by_column.append(values[mine])
        return Vocabulary.build(by_column)

    # ------------------------------------------------------------------ stage 4: rows

    def _rows_stage(self, groups: list[list[int]], lines: dict[int, dict], vocab: dict) -> list[dict]:
        job, work = self.job, self.work
        cardinalities = vocab["cardinalities"]
        sizes = [os.path.getsize(p) for p in job.paths]
        self.progress.begin("spark rows", sum(sizes), len(job.inputs))
        dtypes = record_dtypes(job, cardinalities)
        table = build_log_table(job.numerical_rounding)
        markers = []
        done_files = 0
        for g, files in enumerate(groups):
            depends = {"files": [self.stamps[i] for i in files], "vocab": vocab["build"]}
            marker = work.done(f"spark/rows/g{g}", depends)
            if marker is None:
                with _Status(self.spark, self.progress):
                    marker = self._rows_group(g, files, lines, cardinalities, dtypes, table)
                work.commit(f"spark/rows/g{g}", marker, depends)
            markers.append(marker)
            done_files += len(files)
            rows = sum(f["rows"] for f in marker["fragments"])
            self.progress.update(rows, done_bytes=sum(sizes[:done_files]), files=done_files)
        self.progress.end()
        return markers

    def _rows_group(self, g: int, files: list[int], lines: dict[int, dict], cardinalities: list[int],
                    dtypes: dict, table) -> dict:
        job, F = self.job, self.F
        df = self._good_rows(files, lines)
        fields = _fields(F)
        cols = [F.col("split"), F.col("pos"), F.get(fields, 0).cast("int").alias("label")]
        for k in range(NUM_NUMERICAL):
            text = F.get(fields, k + 1)
            cols.append(F.when((text != "") & (F.length(text) <= MAX_TABLE_DIGITS), text.try_cast("long")).alias(f"n{k}"))
        any_long = reduce(lambda a, b: a | b, [F.length(F.get(fields, k + 1)) > MAX_TABLE_DIGITS for k in range(NUM_NUMERICAL)])
        cols.append(F.when(any_long, F.concat_ws("\t", *[F.get(fields, k + 1) for k in range(NUM_NUMERICAL)])).alias("longc"))
        cols += [F.get(fields, 14 + j).alias(f"c{j}") for j in range(NUM_CATEGORICAL)]
        df = df.select(*cols)
        train = F.col("split") == SPLITS.index("train")
        if job.shuffle_seed is not None:
            bits = self.work.settings["bucket_bits"]
            key = F.xxhash64(F.lit(job.shuffle_seed).cast("long"), F.col("pos"))
            bucket = F.shiftrightunsigned(key.bitwiseXOR(F.lit(_SIGN)), 64 - bits).cast("int") if bits else F.lit(0)
            df = df.withColumn("sortkey", F.when(train, key).otherwise(F.col("pos")))
            df = df.withColumn("bucket", F.when(train, bucket).otherwise(F.lit(0)))
        else:
            df = df.withColumn("sortkey", F.col("pos")).withColumn("bucket", F.lit(0))
        out = df.select(
            "split", "bucket", "sortkey", "pos", "label", *[f"n{k}" for k in range(NUM_NUMERICAL)], "longc",
            *[f"c{j}" for j in range(NUM_CATEGORICAL)],
        ).orderBy("split", "bucket", "sortkey", "pos")
        directory = self.work.begin(f"spark/rows/g{g}")
        writer = make_fragment_writer(directory, list(SPLITS), {s: dtypes[s] for s in job.splits}, table,
                                      self.work.file("spark/vocab", "table"))
        summary = out.mapInArrow(writer, SUMMARY_SCHEMA).collect()
        fragments = sorted(
            ({"split": r["split"], "bucket": r["bucket"], "part": r["part"], "rows": r["rows"], "first": r["first"],
              "last": r["last"], "name": r["name"]} for r in summary if r["kind"] == "fragment"),
            key=lambda f: (f["split"], f["bucket"], f["part"]),
        )
        per_file: dict[int, int] = {}
        for r in summary:
            if r["kind"] == "file":
                per_file[r["part"]] = per_file.get(r["part"], 0) + r["rows"]
        for i in files:  # every well-formed line must have become exactly one row
            expected = lines[i]["lines"] - MalformedSummary.from_json(lines[i]["malformed"]).total
            if per_file.get(i, 0) != expected:
                raise RuntimeError(
                    f"internal error: {job.inputs[i].path}: {per_file.get(i, 0)} rows written, {expected} well-formed "
                    f"lines; were Spark's file-split settings changed during the run?"
                )
        return {"fragments": fragments}

    # ------------------------------------------------------------------ assemble

    def _assemble(self, cardinalities: list[int], markers: list[dict], skipped: dict):
        job, work = self.job, self.work
        files = {}
        for split in job.written_splits:
            buckets = 1 << work.settings["bucket_bits"] if job.shuffled(split) else 1
            lists: list[list[str]] = [[] for _ in range(buckets)]
            last = None
            for g, marker in enumerate(markers):
                for f in marker["fragments"]:
                    if f["split"] != split:
                        continue
                    if not job.shuffled(split):  # parts must follow each other in row order
                        if last is not None and f["first"] <= last:
                            raise RuntimeError(f"internal error: Spark fragments of split '{split}' are out of order")
                        last = f["last"]
                    lists[f["bucket"]].append(work.file(f"spark/rows/g{g}", f["name"]))
            files[split] = lists
        total = sum(f["rows"] for m in markers for f in m["fragments"] if f["split"] in files)
        return write_job_dataset(job, cardinalities, files, total, skipped, self.progress,
                                 work.file("spark/vocab", "table"))


def preprocess_spark(job: Job, progress: Progress | None = None, spark=None, master: str = "local[*]",
                     conf: dict[str, str] | None = None, group_bytes: int = 1 << 30) -> Result:
    """Run ``job`` with Spark (an existing ``spark`` session, or one made from ``master`` and ``conf``)."""
    engine = SparkEngine(job, progress, spark, master, conf, group_bytes)
    try:
        return engine.run()
    finally:
        if engine.own_session:
            engine.spark.stop()

