"""Both preprocessing engines on generated data: byte-identical to each other and to the reference.

Spark runs for real in local mode (one session for the module). Inputs are small generated
Criteo days with malformed lines of every kind mixed in, some days gzip-compressed; memory
settings are shrunk so counts spill to partitioned runs and the shuffle uses several buckets.
"""

from __future__ import annotations

import filecmp
import gzip
import os
import shutil
import signal
import sys
import time

import numpy as np
import pytest

from dlrm.data.feature_spec import FeatureSpec
from dlrm.engine.errors import DatasetError
from preproc import local_engine, spark_engine
from preproc.generate import generate_criteo_tsv, tsv_line
from preproc.job import Job
from preproc.layout import file_inputs, kaggle_inputs, split_ranges, terabyte_inputs
from preproc.local_engine import plan_settings, preprocess_local
from preproc.order import position, shuffle_key
from preproc.reference import column_thresholds, criteo_day_split, parse_threshold, reference_preprocess, split_day_23
from preproc.spark_engine import preprocess_spark, spark_session
from preproc.workdir import WorkDir
import warm_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SMALL = {"partition_bits": 2, "count_budget": 1500, "bucket_bits": 2}  # force spills and shuffle buckets
THRESHOLD = "14:1,15:3,2"  # C1 keeps everything, C2 needs 3, the rest 2




GOOD = tsv_line("1", {0: "1"}, {0: "aaaaaaaa"})
_GOOD_FIELDS = GOOD.split("\t")
# Each malformed kind, with the words the error must contain. The shifted-field lines would
# parse as plausible rows if a reader let fields slide into the next column.
MALFORMED = {
    "wrong field count": ("\t".join(_GOOD_FIELDS[:39]), "field_count", "40 tab-separated fields, got 39"),
    "extra field": ("\t".join(_GOOD_FIELDS[:14] + [""] + _GOOD_FIELDS[14:]), "field_count", "got 41"),
    "non-hex hash": (tsv_line("0", {}, {2: "zzzzzzzz"}), "categorical", "C3 must be empty or 8 hex digits"),
    "non-integer count": (tsv_line("0", {2: "1.5"}), "numerical", "I3 must be empty or an integer"),
    "label not 0/1": (tsv_line("2"), "label", "label must be '0' or '1'"),
    "carriage return": (GOOD + "\r", "categorical", "C26"),
}


def java_available() -> bool:
    return shutil.which("java") is not None or bool(os.environ.get("JAVA_HOME"))


@pytest.fixture(scope="module")
def spark():
    if not java_available():
        pytest.skip("the Spark engine needs Java (a JRE 17+ on PATH or JAVA_HOME)")
    session = spark_session("local[2]", {
        "spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4", "spark.driver.memory": "1g",
    })
    yield session
    session.stop()


def _insert(path: str, at: dict[int, str]) -> None:
    """Insert lines (text without newline) before the given 1-based line numbers."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        lines = f.read().split(b"\n")[:-1]
    for line_no in sorted(at):  # ascending: each ends up at its given line number
        lines.insert(line_no - 1, at[line_no].encode("utf-8"))
    data = b"".join(line + b"\n" for line in lines)
    if path.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    with open(path, "wb") as f:
        f.write(data)


@pytest.fixture(scope="module")
def days(tmp_path_factory):
    """24 generated days (166-167 lines each; days 0, 7, 23 gzipped) with 18 malformed train lines.

    Days 1, 2, 4, 7, 9, 13, 16, 20, 22 get one line of each kind in turn at line 3, 4, 5, ...
    and a line with non-ASCII bytes (and 41 fields) at line 100.
    """
    d = tmp_path_factory.mktemp("criteo") / "days"
    generate_criteo_tsv(str(d), 4000, seed=11, days=24)
    for day in (0, 7, 23):
        raw = (d / f"day_{day}").read_bytes()
        (d / f"day_{day}.gz").write_bytes(gzip.compress(raw, mtime=0))
        os.unlink(d / f"day_{day}")
    kinds = list(MALFORMED.values())
    for n, day in enumerate((1, 2, 4, 7, 9, 13, 16, 20, 22)):
        name = f"day_{day}" + (".gz" if day == 7 else "")
        _insert(str(d / name), {3 + n: kinds[n % len(kinds)][0], 100: "\xff\xfe\t" + GOOD})
    return d


def assert_same_dataset(a, b) -> None:
    a, b = str(a), str(b)
    names = sorted(os.path.relpath(os.path.join(r, f), a) for r, _, fs in os.walk(a) for f in fs)
    assert names == sorted(os.path.relpath(os.path.join(r, f), b) for r, _, fs in os.walk(b) for f in fs)
    different = [n for n in names if not filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)]
    assert not different, f"{a} and {b} differ in {different}"


def job(inputs, out, **kw) -> Job:
    kw.setdefault("thresholds", column_thresholds(parse_threshold(THRESHOLD)))
    kw.setdefault("extra", dict(SMALL))
    return Job(inputs, str(out), **kw)


# ---------------------------------------------------------------------------- identical output


def test_terabyte_layout_both_engines_match_the_reference(days, spark, tmp_path):
    train, day23 = criteo_day_split([str(days / n) for n in os.listdir(days)])
    test, validation = str(tmp_path / "test.tsv"), str(tmp_path / "validation.tsv")
    split_day_23(day23, test, validation)
    reference_preprocess(train, [test], [validation], str(tmp_path / "ref"),
                         frequency_threshold=parse_threshold(THRESHOLD), on_error="skip")

    local = preprocess_local(job(terabyte_inputs(str(days)), tmp_path / "local", on_error="skip"), workers=1,
                             chunk_bytes=16_384)
    assert_same_dataset(tmp_path / "ref", tmp_path / "local")
    spark_result = preprocess_spark(job(terabyte_inputs(str(days)), tmp_path / "spark", on_error="skip"), spark=spark)
    assert_same_dataset(tmp_path / "ref", tmp_path / "spark")

    # Every kind was counted at its place, and no malformed line became a row.
    skipped = FeatureSpec.from_yaml(str(tmp_path / "spark")).metadata["skipped_lines"]
    assert local.skipped == spark_result.skipped == skipped
    # Kinds in turn for days 1, 2, 4, 7, 9, 13, 16, 20, 22: count, extra, hex, integer, label, \r, count, extra, hex.
    assert {r: v["count"] for r, v in skipped.items()} == {"field_count": 4 + 9, "label": 1, "numerical": 1, "categorical": 3}
    assert skipped["field_count"]["first"] == [f"{days}/{n}" for n in ("day_1:3", "day_1:100", "day_2:4", "day_2:100", "day_4:100")]
    assert skipped["numerical"]["first"] == [f"{days}/day_7.gz:6"]
    train_lines = sum(sum(1 for _ in (gzip.open if p.endswith(".gz") else open)(p, "rb")) for p in train)
    assert local.rows == spark_result.rows == {"train": train_lines - 18, "test": 83, "validation": 83}


def test_vocabulary_over_all_days_and_direct_rounding_in_both_engines_match_the_reference(days, spark, tmp_path):
    """The non-default options (NVIDIA's vocabulary over every split, the single rounding) give the
    reference's bytes in both engines too; the default options are covered by the tests above."""
    train, day23 = criteo_day_split([str(days / n) for n in os.listdir(days)])
    train = [p for p in train if os.path.basename(p) in ("day_0.gz", "day_1", "day_2")]
    test, validation = str(tmp_path / "test.tsv"), str(tmp_path / "validation.tsv")
    split_day_23(day23, test, validation)
    options = {"vocabulary_days": "all", "numerical_rounding": "direct"}
    for name, kw in (("train_only", {}), ("ref", options)):
        reference_preprocess(train, [test], [validation], str(tmp_path / name),
                             frequency_threshold=parse_threshold(THRESHOLD), on_error="skip", **kw)
    inputs = terabyte_inputs(str(days), [0, 1, 2])
    preprocess_local(job(inputs, tmp_path / "local", on_error="skip", **options), workers=1, chunk_bytes=16_384)
    assert_same_dataset(tmp_path / "ref", tmp_path / "local")
    preprocess_spark(job(inputs, tmp_path / "spark", on_error="skip", **options), spark=spark)
    assert_same_dataset(tmp_path / "ref", tmp_path / "spark")
    spec, train_only = FeatureSpec.from_yaml(str(tmp_path / "spark")), FeatureSpec.from_yaml(str(tmp_path / "train_only"))
    assert spec.metadata["preprocessing"]["vocabulary_days"] == "all"
    assert spec.metadata["preprocessing"]["numerical_rounding"] == "direct"
    # Day 23's values count: more of them reach the threshold than with the train rows alone.
    assert sum(spec.cardinalities) > sum(train_only.cardinalities)
    assert all(a >= b for a, b in zip(spec.cardinalities, train_only.cardinalities))


def test_shuffled_output_is_the_documented_permutation_in_both_engines(days, spark, tmp_path):
    inputs = terabyte_inputs(str(days), [0, 1, 2, 3, 7])
    plain = preprocess_local(job(inputs, tmp_path / "plain", on_error="skip"), workers=1)
    shuffled = preprocess_local(job(inputs, tmp_path / "local", on_error="skip", shuffle_seed=7), workers=2,
                                chunk_bytes=8_192)
    preprocess_spark(job(inputs, tmp_path / "spark", on_error="skip", shuffle_seed=7), spark=spark)
    assert_same_dataset(tmp_path / "local", tmp_path / "spark")
    assert shuffled.rows == plain.rows

    # Positions of the unshuffled train rows (well-formed lines, in file order), sorted by key.
    positions = []
    for i, f in enumerate(inputs[:-1]):
        opener = gzip.open if f.path.endswith(".gz") else open
        with opener(f.path, "rb") as fh:
            for line_no, line in enumerate(fh, start=1):
                if line.isascii() and line.rstrip(b"\n") not in {m[0].encode() for m in MALFORMED.values()}:
                    positions.append(int(position(i, line_no)))
    positions = np.array(positions, dtype=np.int64)
    order = np.lexsort((positions, shuffle_key(7, positions)))
    assert len(positions) == plain.rows["train"]
    for name, dtype, width in [("label.bin", np.uint8, 1), ("numerical.bin", np.float16, 13), ("cat_0.bin", None, 1)]:
        spec = FeatureSpec.from_yaml(str(tmp_path / "plain"))
        dtype = dtype or spec.categorical_dtypes[0]
        a = np.fromfile(tmp_path / "plain" / "train" / name, dtype=dtype).reshape(-1, width)
        b = np.fromfile(tmp_path / "local" / "train" / name, dtype=dtype).reshape(-1, width)
        assert (a[order] == b).all(), name
    for split in ("test", "validation"):  # only train is shuffled
        assert filecmp.cmp(tmp_path / "plain" / split / "label.bin", tmp_path / "local" / split / "label.bin", shallow=False)
    assert FeatureSpec.from_yaml(str(tmp_path / "local")).metadata["preprocessing"]["shuffle"]["seed"] == 7


def test_kaggle_layout_both_engines_match_the_reference(spark, tmp_path):
    src = tmp_path / "kaggle"
    src.mkdir()
    generate_criteo_tsv(str(src / "train.txt"), 2003, seed=4)
    bad = [m[0] for m in MALFORMED.values()]
    _insert(str(src / "train.txt"), {10: bad[0], 700: bad[1], 1740: bad[2], 1900: bad[4], 2005: bad[5]})
    lines = (src / "train.txt").read_bytes().split(b"\n")[:-1]
    pieces = {}
    for split, a, b in split_ranges("kaggle_days", len(lines)):  # 2008 lines: 1722 / 143 / 143
        pieces[split] = str(tmp_path / f"{split}.tsv")
        (tmp_path / f"{split}.tsv").write_bytes(b"".join(x + b"\n" for x in lines[a - 1 : b]))
    reference_preprocess([pieces["train"]], [pieces["test"]], [pieces["validation"]], str(tmp_path / "ref"), 2,
                         on_error="skip")
    thresholds = column_thresholds(2)
    local = preprocess_local(job(kaggle_inputs(str(src)), tmp_path / "local", thresholds=thresholds, on_error="skip"),
                             workers=1, chunk_bytes=20_000)
    # Small file splits: Spark reads the file in ~15 pieces, and line numbers must still be exact.
    spark.conf.set("spark.sql.files.maxPartitionBytes", "32768")
    try:
        result = preprocess_spark(job(kaggle_inputs(str(src)), tmp_path / "spark", thresholds=thresholds, on_error="skip"),
                                  spark=spark)
    finally:
        spark.conf.set("spark.sql.files.maxPartitionBytes", spark_engine.PINNED_CONF["spark.sql.files.maxPartitionBytes"])
    assert_same_dataset(tmp_path / "local", tmp_path / "spark")
    os.unlink(tmp_path / "ref" / "feature_spec.yaml")  # its skipped lines name the pieces, not train.txt
    os.unlink(tmp_path / "local" / "feature_spec.yaml")
    assert_same_dataset(tmp_path / "ref", tmp_path / "local")
    # Lines 10 and 700 are in train (1-1722), 1740 in test (1723-1865), 1900 and 2005 in validation.
    assert local.rows == result.rows == {"train": 1722 - 2, "test": 143 - 1, "validation": 143 - 2}
    assert [loc.split(":")[-1] for v in result.skipped.values() for loc in v["first"]] == ["10", "700", "1900", "1740", "2005"]


def test_shipping_a_package_to_the_workers_leaves_the_driver_import_path_alone(spark, tmp_path):
    """pyspark's ``addPyFile`` also puts the zip's copy in the session's temporary folder on the
    driver's ``sys.path``; once that session stops, a later ``preproc`` import in the same process
    failed with FileNotFoundError. The workers still import what was shipped."""
    import zipfile

    name = f"shipped_probe_{os.getpid()}_{time.time_ns()}"
    with zipfile.ZipFile(tmp_path / f"{name}.zip", "w") as z:
        z.writestr(f"{name}.py", "ANSWER = 42\n")
    before = list(sys.path)
    spark_engine._add_py_file_for_workers_only(spark.sparkContext, str(tmp_path / f"{name}.zip"))
    assert sys.path == before
    answers = spark.sparkContext.parallelize([0, 1], 2).map(lambda _: __import__(name).ANSWER).collect()
    assert answers == [42, 42]


# ---------------------------------------------------------------------------- malformed lines


def _explicit(tmp_path, train_lines, test_lines):
    train, test = tmp_path / "train.tsv", tmp_path / "test.tsv"
    train.write_bytes("".join(x + "\n" for x in train_lines).encode("utf-8"))
    test.write_bytes("".join(x + "\n" for x in test_lines).encode("utf-8"))
    return file_inputs([str(train)], [str(test)]), str(train), str(test)


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_line_fails_naming_file_and_line_in_both_engines(spark, tmp_path, case):
    bad, _, words = MALFORMED[case]
    inputs, train, _ = _explicit(tmp_path, [GOOD, GOOD, bad, GOOD], [GOOD])
    messages = []
    for name, run in [("local", lambda j: preprocess_local(j, workers=1)), ("spark", lambda j: preprocess_spark(j, spark=spark))]:
        out = tmp_path / name
        with pytest.raises(DatasetError) as e:
            run(job(inputs, out))
        assert f"{train}, line 3: " in str(e.value) and words in str(e.value) and "--on_error skip" in str(e.value)
        assert not (out / "feature_spec.yaml").exists() and not (out / "train").exists()
        messages.append(str(e.value))
    assert messages[0] == messages[1]


def test_malformed_line_in_a_test_file_fails_too(spark, tmp_path):
    inputs, _, test = _explicit(tmp_path, [GOOD, GOOD], [GOOD, MALFORMED["label not 0/1"][0]])
    for name, run in [("local", lambda j: preprocess_local(j, workers=1)), ("spark", lambda j: preprocess_spark(j, spark=spark))]:
        with pytest.raises(DatasetError, match=f"{test}, line 2: label"):
            run(job(inputs, tmp_path / name))


def test_a_split_without_rows_is_an_error(spark, tmp_path):
    bad = MALFORMED["label not 0/1"][0]
    inputs, _, _ = _explicit(tmp_path, [GOOD, GOOD], [bad, bad])
    for name, run in [("local", lambda j: preprocess_local(j, workers=1)), ("spark", lambda j: preprocess_spark(j, spark=spark))]:
        with pytest.raises(DatasetError, match=r"split 'test' has no rows.*skipped 2 malformed line"):
            run(job(inputs, tmp_path / name, on_error="skip"))
        assert not (tmp_path / name / "feature_spec.yaml").exists() and not (tmp_path / name / "train").exists()
    # A day 23 of one line leaves the test half empty.
    d = tmp_path / "days"
    generate_criteo_tsv(str(d), 48, seed=0, days=24)
    (d / "day_23").write_text(GOOD + "\n")
    for name, run in [("local", lambda j: preprocess_local(j, workers=1)), ("spark", lambda j: preprocess_spark(j, spark=spark))]:
        with pytest.raises(DatasetError, match="split 'test' has no rows"):
            run(job(terabyte_inputs(str(d)), tmp_path / f"tb_{name}"))
        assert not (tmp_path / f"tb_{name}" / "feature_spec.yaml").exists()


# ---------------------------------------------------------------------------- resume


class _Interrupt(BaseException):
    """Stands for Ctrl-C or a killed process: not an Exception, so nothing swallows it."""


def test_local_engine_resumes_without_redoing_finished_files(days, tmp_path, monkeypatch):
    inputs = terabyte_inputs(str(days), list(range(8)))  # files 0-7 train, 8 is day 23
    preprocess_local(job(inputs, tmp_path / "whole", on_error="skip", shuffle_seed=3), workers=1)

    state: dict = {"file": None, "interrupt": {}, "calls": []}
    real_scan, real_transform, real_scan_file = local_engine.scan_task, local_engine.transform_task, local_engine.LocalEngine._scan_file

    def scan_file(self, i, done_before):
        state["file"] = i
        return real_scan_file(self, i, done_before)

    def task(stage, real, file_of):
        def run(*args):
            i = file_of(args)
            state["calls"].append((stage, i))
            if state["interrupt"].get(stage) == i:
                del state["interrupt"][stage]
                raise _Interrupt()
            return real(*args)
        return run

    monkeypatch.setattr(local_engine.LocalEngine, "_scan_file", scan_file)
    monkeypatch.setattr(local_engine, "scan_task", task("scan", real_scan, lambda args: state["file"]))
    monkeypatch.setattr(local_engine, "transform_task", task("transform", real_transform, lambda args: args[2]))
    out = tmp_path / "resumed"
    run = lambda **kw: preprocess_local(job(inputs, out, on_error="skip", shuffle_seed=kw.pop("seed", 3), **kw), workers=1)  # noqa: E731
    for stage, at in (("scan", 4), ("transform", 6)):  # interrupted in the scan, then in the transform
        state["interrupt"] = {stage: at}
        with pytest.raises(_Interrupt):
            run()
        assert sorted(os.listdir(out)) == [".preproc_work"]  # nothing but the resume state
    state["calls"].clear()
    result = run()
    assert result.resumed
    assert [c for c in state["calls"] if c[0] == "scan"] == []  # every file's scan was finished
    assert {i for stage, i in state["calls"] if stage == "transform"} == {6, 7, 8}  # from the interrupted file on
    assert_same_dataset(tmp_path / "whole", out)
    assert not (out / ".preproc_work").exists()

    state["interrupt"] = {"transform": 2}
    with pytest.raises(_Interrupt):
        run()
    with pytest.raises(DatasetError, match=r"shuffle_seed differ.*--fresh"):  # another job does not reuse the state
        run(seed=4)
    run(fresh=True)
    assert_same_dataset(tmp_path / "whole", out)


def test_a_changed_input_file_redoes_only_what_depends_on_it(days, tmp_path, monkeypatch):
    src = tmp_path / "days"
    shutil.copytree(days, src)
    inputs = terabyte_inputs(str(src), [0, 1, 2, 3])  # files 0-3 train, 4 is day 23
    out = tmp_path / "out"
    preprocess_local(job(inputs, out, on_error="skip", keep_work_dir=True), workers=1)
    first = {n: (out / "train" / n).read_bytes() for n in ("label.bin", "cat_1.bin")}
    calls: list[tuple[str, int]] = []
    real_scan_file, real_transform = local_engine.LocalEngine._scan_file, local_engine.transform_task
    monkeypatch.setattr(local_engine.LocalEngine, "_scan_file",
                        lambda self, i, before: calls.append(("scan", i)) or real_scan_file(self, i, before))
    monkeypatch.setattr(local_engine, "transform_task",
                        lambda *args: calls.append(("transform", args[2])) or real_transform(*args))
    run = lambda: preprocess_local(job(inputs, out, on_error="skip", keep_work_dir=True), workers=1)  # noqa: E731

    assert run().resumed and calls == []  # a finished work directory: only the final write again
    os.utime(inputs[4].path)  # day 23 changed: only it is scanned and transformed again
    run()
    assert {c for c in calls} == {("scan", 4), ("transform", 4)}
    calls.clear()
    _insert(inputs[1].path, {5: GOOD})  # a training file changed: new counts, new ids everywhere
    run()
    assert {i for stage, i in calls if stage == "scan"} == {0, 1, 2, 3}  # runs of the old vocabulary are gone
    assert {i for stage, i in calls if stage == "transform"} == {0, 1, 2, 3, 4}
    assert (out / "train" / "cat_1.bin").read_bytes() != first["cat_1.bin"]
    shutil.rmtree(out / ".preproc_work")
    preprocess_local(job(inputs, tmp_path / "check", on_error="skip"), workers=1)
    assert_same_dataset(tmp_path / "check", out)


def test_spark_engine_resumes_without_redoing_finished_groups(days, spark, tmp_path, monkeypatch):
    inputs = terabyte_inputs(str(days), [0, 1, 2])
    preprocess_local(job(inputs, tmp_path / "local", on_error="skip"), workers=1)
    calls: list[tuple[str, tuple]] = []
    real_lines, real_rows = spark_engine.SparkEngine._lines_group, spark_engine.SparkEngine._rows_group

    def lines_group(self, files):
        calls.append(("lines", tuple(files)))
        return real_lines(self, files)

    def rows_group(self, g, files, *args):
        calls.append(("rows", tuple(files)))
        if g == 2 and not interrupted:
            interrupted.append(True)
            raise _Interrupt()
        return real_rows(self, g, files, *args)

    interrupted: list[bool] = []
    monkeypatch.setattr(spark_engine.SparkEngine, "_lines_group", lines_group)
    monkeypatch.setattr(spark_engine.SparkEngine, "_rows_group", rows_group)
    out = tmp_path / "spark"
    with pytest.raises(_Interrupt):
        preprocess_spark(job(inputs, out, on_error="skip"), spark=spark, group_bytes=1)
    assert calls == [("lines", (i,)) for i in range(4)] + [("rows", (0,)), ("rows", (1,)), ("rows", (2,))]
    assert sorted(os.listdir(out)) == [".preproc_work"]
    calls.clear()
    result = preprocess_spark(job(inputs, out, on_error="skip"), spark=spark, group_bytes=1)
    assert result.resumed and calls == [("rows", (2,)), ("rows", (3,))]
    assert_same_dataset(tmp_path / "local", out)


# ---------------------------------------------------------------------------- what a failure leaves


def _temporaries(root) -> list[str]:
    """Temporary files and unit directories (``*.tmp``) anywhere under ``root``."""
    found = []
    for directory, dirs, files in os.walk(root):
        found += [os.path.relpath(os.path.join(directory, n), root) for n in dirs + files if n.endswith(".tmp")]
    return sorted(found)


@pytest.mark.parametrize("stage", ["scan", "transform"])
def test_a_failed_local_run_leaves_no_partial_files(days, tmp_path, monkeypatch, stage):
    """A malformed line (``--on_error fail``) in the scan, an exception in the transform: the
    unit being written is removed, the finished ones stay for a resume."""
    inputs = terabyte_inputs(str(days), [0, 1, 2])  # day 1 has a malformed line 3
    out = tmp_path / "out"
    if stage == "scan":
        with pytest.raises(DatasetError, match="line 3"):
            preprocess_local(job(inputs, out), workers=1, chunk_bytes=4096)
    else:
        real, seen = local_engine.transform_task, []

        def fail_in_file_1(*args):
            seen.append(args[2])
            if seen.count(1) == 3:
                raise RuntimeError("disk full")
            return real(*args)

        monkeypatch.setattr(local_engine, "transform_task", fail_in_file_1)
        with pytest.raises(RuntimeError, match="disk full"):
            preprocess_local(job(inputs, out, on_error="skip"), workers=1, chunk_bytes=4096)
        assert (out / ".preproc_work" / "rows" / "f0.json").exists()  # resume state is kept
    assert (out / ".preproc_work" / "manifest.json").exists()
    assert _temporaries(out) == []


_SLOW_SCAN = """
import glob, os, sys, time
from preproc import local_engine
from preproc.job import Job
from preproc.layout import terabyte_inputs
from preproc.reference import column_thresholds

real = local_engine.scan_task

def scan_task(*args):
    if glob.glob(os.path.join(sys.argv[2], ".preproc_work", "scan", "f*.tmp", "*")):  # count runs spilled
        open(sys.argv[3], "w").close()
        time.sleep(600)
    return real(*args)

local_engine.scan_task = scan_task
job = Job(terabyte_inputs(sys.argv[1], [0, 1]), sys.argv[2], column_thresholds(2), on_error="skip",
          extra={"partition_bits": 2, "count_budget": 1500, "bucket_bits": 0})
local_engine.preprocess_local(job, workers=1, chunk_bytes=4096)
"""


def test_a_run_killed_mid_scan_leaves_partial_files_the_next_run_removes(days, tmp_path):
    """``kill -9`` in the middle of a file's scan leaves its partial count runs; the next run
    removes them as soon as it opens the work directory, then finishes the job."""
    out, ready = tmp_path / "out", tmp_path / "ready"
    child = warm_python.Popen([sys.executable, "-c", _SLOW_SCAN, str(days), str(out), str(ready)], cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline, "the run never reached the scan"
            time.sleep(0.02)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    (partial,) = _temporaries(out)  # the scanned file's spilled count runs: part of its counts
    assert partial.startswith(os.path.join(".preproc_work", "scan", "f")) and os.listdir(out / partial)

    the_job = Job(terabyte_inputs(str(days), [0, 1]), str(out), column_thresholds(2), on_error="skip",
                  extra={"partition_bits": 2, "count_budget": 1500, "bucket_bits": 0})
    work = WorkDir(the_job.work_path, the_job.identity("local"), plan_settings(the_job))
    assert work.resumed and _temporaries(out) == []
    preprocess_local(the_job, workers=1)
    clean = Job(the_job.inputs, str(tmp_path / "clean"), the_job.thresholds, on_error="skip", extra=the_job.extra)
    preprocess_local(clean, workers=1)
    assert_same_dataset(tmp_path / "clean", out)


def test_a_failed_spark_task_leaves_no_partial_files(spark, tmp_path, monkeypatch):
    """A rows task that fails in Spark's Python worker (here: its vocabulary is missing) fails
    the run; the group's partial directory is removed, the finished stages stay for a resume."""
    inputs, _, _ = _explicit(tmp_path, [GOOD] * 20, [GOOD] * 4)
    real = spark_engine.make_fragment_writer
    monkeypatch.setattr(spark_engine, "make_fragment_writer",
                        lambda directory, splits, dtypes, table, vocab_dir: real(
                            directory, splits, dtypes, table, str(tmp_path / "no_vocab")))
    out = tmp_path / "out"
    with pytest.raises(Exception, match="No such file"):
        preprocess_spark(job(inputs, out), spark=spark)
    assert (out / ".preproc_work" / "spark" / "vocab.json").exists()
    assert _temporaries(out) == []
