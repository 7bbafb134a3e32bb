"""The building blocks of the preprocessing engines, each against an independent reference.

Parsing and numericals against ``preproc.reference``; the hash index and counting against
plain dicts and Counters; the shuffle key against an XXH64 written out in plain Python here;
layouts and resume bookkeeping by hand.
"""

from __future__ import annotations

import collections
import gzip
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary_writer import SplitBinaryWriter
from dlrm.engine.errors import DatasetError
from preproc.counting import CountWriter, count_chunk, merge_counts
from preproc.generate import generate_criteo_tsv, tsv_line
from preproc.layout import DAY23, KAGGLE, file_inputs, kaggle_inputs, parse_days, split_ranges, terabyte_inputs
from preproc.numeric import build_log_table, log_counts_float16, long_count_float16
from preproc.order import bucket_of, shuffle_key
from preproc.parse import parse_chunk
from preproc.reference import log_transform, parse_line
from preproc.report import classify_bad
from preproc.textio import count_lines, numbered_chunks
from preproc.vocab import Vocabulary
from preproc.workdir import WorkDir




# Lines the fast parser must treat exactly as the reference: odd but valid, and malformed.
EDGE_LINES = [
    tsv_line("1"),
    tsv_line("0", {0: "-0", 1: "007", 2: "-1", 3: "-2", 4: "-3", 5: "-99999999999999999"}),
    tsv_line("1", {0: "999999999999999999", 1: "99999999999999999999", 2: "-999999999999999999999", 12: "123456789"}),
    tsv_line("1", {0: "0000000000000000000000005"}, {0: "ABCDEF01", 1: "abcdef01", 25: "00000000"}),
    tsv_line("0", {}, {0: "ffffffff", 12: "FfFfFfFf"}),
    tsv_line("2"),  # label
    tsv_line(""),
    tsv_line("01"),
    tsv_line("1", {0: "1.5"}),  # numerical
    tsv_line("1", {0: "+5"}),
    tsv_line("1", {0: "-"}),
    tsv_line("1", {0: "5-"}),
    tsv_line("1", {0: "1e5"}),
    tsv_line("1", {0: "a"}),
    tsv_line("1", {12: " 5"}),
    tsv_line("1", {0: "12345678901234567890a"}),
    tsv_line("1", {}, {0: "1234567"}),  # categorical
    tsv_line("1", {}, {0: "123456789"}),
    tsv_line("1", {}, {0: "-1234567"}),
    tsv_line("1", {}, {0: "1234567g"}),
    tsv_line("1", {}, {25: "abcdef0\r"}),
    tsv_line("1", {}, {3: "abcdéf01"}),
    "",  # field count
    "\t".join(["1"] * 39),
    "\t".join(["1"] + [""] * 40),
    tsv_line("1") + "\r",
    "1\t\t\t" + "\t".join([""] * 36) + "\t\t",
    "\x00" + tsv_line("1")[1:],
    tsv_line("1", {4: "9" * 5000}),  # more digits than Python turns into an int
    tsv_line("0", {0: "-" + "1" * 4300}),  # the most it does
]


def reference_rows(lines: list[str]):
    out = []
    for line in lines:
        try:
            out.append(parse_line(line))
        except Exception as e:  # the reference's own exception type
            out.append((e.reason, e.detail))  # type: ignore[attr-defined]
    return out


def test_parse_chunk_agrees_with_the_reference_line_by_line(tmp_path):
    path = tmp_path / "gen.tsv"
    generate_criteo_tsv(str(path), 3000, seed=5)
    generated = path.read_text().splitlines()
    lines = generated[:1500] + EDGE_LINES + generated[1500:]
    data = "".join(line + "\n" for line in lines).encode("utf-8")
    table = build_log_table()
    chunk = parse_chunk(data, 1)
    expected = reference_rows([line.encode("utf-8").decode("ascii", errors="replace") for line in lines])
    bad = {line: (reason, detail) for line, reason, detail in classify_bad(chunk.bad)}
    rows = chunk.rows
    numerical = rows.numerical(table)
    assert chunk.lines == len(lines)
    good_index = 0
    for n, exp in enumerate(expected, start=1):
        if len(exp) == 2:
            assert bad[n] == exp, (n, lines[n - 1])
            continue
        label, counts, hashes = exp
        assert rows.line[good_index] == n
        assert rows.label[good_index] == label
        # The default rounding, NVIDIA's: float64 -> float32 -> float16.
        expected_numerical = np.array([log_transform(c) for c in counts]).astype(np.float32).astype(np.float16)
        assert numerical[good_index].tolist() == expected_numerical.tolist()
        assert rows.hashes[good_index].tolist() == [0 if h is None else int(h, 16) for h in hashes]
        assert rows.hash_present[good_index].tolist() == [h is not None for h in hashes]
        good_index += 1
    assert good_index == len(rows)
    assert len(bad) == sum(len(e) == 2 for e in expected) == 24


def test_chunks_split_only_at_newlines_and_keep_line_numbers(tmp_path):
    path = tmp_path / "a.tsv"
    generate_criteo_tsv(str(path), 2000, seed=1)
    raw = path.read_bytes()
    path.write_bytes(raw + b"0\tlast line without newline")  # a last line without \n still counts
    chunks = list(numbered_chunks(str(path), chunk_bytes=10_000))
    assert len(chunks) > 20
    assert b"".join(c[0] for c in chunks) == raw + b"0\tlast line without newline\n"
    assert [c[1] for c in chunks] == [1] + list(np.cumsum([c[2] for c in chunks])[:-1] + 1)
    assert count_lines(str(path)) == 2001
    gz = tmp_path / "a.tsv.gz"
    gz.write_bytes(gzip.compress(raw))
    assert b"".join(c[0] for c in numbered_chunks(str(gz), chunk_bytes=7_000)) == raw
    assert count_lines(str(gz)) == 2000 and count_lines(str(tmp_path / "a.tsv")) == 2001
    (tmp_path / "empty").write_bytes(b"")
    assert list(numbered_chunks(str(tmp_path / "empty"))) == [] and count_lines(str(tmp_path / "empty")) == 0


# float64 -> float16 as each rounding defines it, with numpy's casts (round to nearest even).
ROUND = {
    "nvidia": lambda v: np.asarray(v, dtype=np.float64).astype(np.float32).astype(np.float16),
    "direct": lambda v: np.asarray(v, dtype=np.float64).astype(np.float16),
}


@pytest.mark.parametrize("rounding", sorted(ROUND))
def test_log_table_equals_the_reference_on_every_boundary(rounding):
    table = build_log_table(rounding)
    assert table.rounding == rounding
    rng = np.random.default_rng(0)
    boundaries = table.thresholds.astype(np.int64)
    xs = np.concatenate([
        np.arange(-10, 200_000), boundaries - 3, boundaries - 4, rng.integers(0, 10**18 - 1, 20_000),
        (10 ** np.arange(1, 19, dtype=np.int64)) - 4, np.array([10**18 - 1]),
    ])
    got = log_counts_float16(xs, np.ones(len(xs), bool), table)
    expected = ROUND[rounding]([log_transform(int(x)) for x in xs])
    assert got.view(np.uint16).tolist() == expected.view(np.uint16).tolist()
    assert np.isfinite(got).all() and (got >= 0).all()
    missing = log_counts_float16(np.array([5, 5]), np.array([True, False]), table)
    assert missing.tolist() == [np.float16(np.log(8)), 0.0]
    for text in ("99999999999999999999", "-99999999999999999999", "1" + "0" * 30):
        assert long_count_float16(text, rounding) == ROUND[rounding](log_transform(int(text)))


def test_the_two_roundings_differ_exactly_where_float32_lands_on_a_float16_midpoint():
    """NVIDIA's double rounding against an independent numpy computation over every count from
    -2 to 10**7: the tables agree with numpy's casts of numpy's log, and the counts where the
    roundings differ are those whose float32 log is a float16 midpoint (605 of them)."""
    xs = np.arange(-2, 10**7 + 1, dtype=np.int64)
    logs = np.log((xs + 3).astype(np.float64))
    nvidia = log_counts_float16(xs, np.ones(len(xs), bool), build_log_table("nvidia"))
    direct = log_counts_float16(xs, np.ones(len(xs), bool), build_log_table("direct"))
    assert (nvidia.view(np.uint16) == ROUND["nvidia"](logs).view(np.uint16)).all()
    assert (direct.view(np.uint16) == ROUND["direct"](logs).view(np.uint16)).all()
    differ = np.flatnonzero(nvidia != direct)
    assert len(differ) == 605
    # One float16 step apart, and float32 put each of them exactly halfway between the two.
    steps = nvidia[differ].view(np.uint16).astype(np.int32) - direct[differ].view(np.uint16).astype(np.int32)
    assert set(np.abs(steps).tolist()) == {1}
    mid = (nvidia[differ].astype(np.float64) + direct[differ].astype(np.float64)) / 2
    assert (logs[differ].astype(np.float32).astype(np.float64) == mid).all()
    # The example: 10361 -> ln(10364) = 9.24609354...; 9.2421875 directly, 9.25 through float32.
    i = 10361 + 2
    assert (float(direct[i]), float(nvidia[i])) == (9.2421875, 9.25)


def _xxh64_long(value: int, seed: int) -> int:
    """XXH64 of one 8-byte little-endian value, written out from the algorithm's definition."""
    m = (1 << 64) - 1
    p1, p2, p3, p4, p5 = (0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63,
                          0x27D4EB2F165667C5)
    rotl = lambda x, r: ((x << r) | (x >> (64 - r))) & m  # noqa: E731
    h = (seed + p5 + 8) & m
    h ^= rotl((value & m) * p2 & m, 31) * p1 & m
    h = (rotl(h, 27) * p1 + p4) & m
    h ^= h >> 33
    h = h * p2 & m
    h ^= h >> 29
    h = h * p3 & m
    h ^= h >> 32
    return h - (1 << 64) if h >> 63 else h


def test_shuffle_key_is_chained_xxh64_and_buckets_follow_signed_order():
    positions = np.array([0, 1, (3 << 40) | 17, 2**62 + 5, -1], dtype=np.int64)
    for seed in (0, 7, -3):
        expected = [_xxh64_long(int(p), _xxh64_long(seed, 42)) for p in positions]
        assert shuffle_key(seed, positions).tolist() == expected
    keys = np.sort(np.random.default_rng(0).integers(-2**63, 2**63 - 1, 10_000, dtype=np.int64))
    for bits in (0, 1, 3):
        b = bucket_of(keys, bits)
        assert (np.diff(b) >= 0).all() and b.min() >= 0 and b.max() < 2**bits
    assert bucket_of(np.array([-2**63, -1, 0, 2**63 - 1]), 1).tolist() == [0, 0, 1, 1]


def test_vocabulary_lookup_matches_a_dict(tmp_path):
    rng = np.random.default_rng(1)
    sizes = [0, 1, 4, 1000, 50_000] + [300] * 21
    values = [rng.choice(2**32, size=k, replace=False).astype(np.uint32) for k in sizes]
    values[2][:] = [0, 1, 0xFFFFFFFF, 0x80000000]  # extremes of the value range
    vocab = Vocabulary.build(values)
    vocab.save(str(tmp_path / "v"))
    loaded = Vocabulary.load(str(tmp_path / "v"))
    assert loaded.cardinalities == [k + 1 for k in sizes]
    n = 20_000
    queries = np.empty((n, 26), np.uint32)
    for j, v in enumerate(values):
        pool = np.concatenate([v, rng.integers(0, 2**32, 50, dtype=np.uint32)])
        queries[:, j] = pool[rng.integers(0, len(pool), n)]
    present = rng.random((n, 26)) < 0.9
    ids = loaded.lookup(queries, present)
    for j, v in enumerate(values):
        d = {int(x): i + 1 for i, x in enumerate(v)}
        assert ids[:, j].tolist() == [d.get(int(q), 0) if p else 0 for q, p in zip(queries[:, j], present[:, j])]


@pytest.mark.parametrize("partition_bits,budget", [(0, 10**9), (2, 1500)])
def test_counts_spill_and_merge_to_the_reference_ranking(tmp_path, partition_bits, budget):
    rng = np.random.default_rng(2)
    n = 30_000
    hashes = (rng.zipf(1.4, (n, 26)) % 3000).astype(np.uint32)
    hashes[:, 3] = rng.integers(0, 2**32, n, dtype=np.uint32)  # almost all values unique
    present = rng.random((n, 26)) < 0.85
    thresholds = [0, 1, 2, 5] + [3] * 22
    runs = []
    for f, (a, b) in enumerate([(0, 12_000), (12_000, n)]):
        writer = CountWriter(str(tmp_path / f"f{f}"), partition_bits, budget)
        for start in range(a, b, 2_500):
            writer.add(*count_chunk(hashes[start:min(b, start + 2_500)], present[start:min(b, start + 2_500)]))
        runs.append((str(tmp_path / f"f{f}"), writer.finish()))
    if budget < 10**9:
        assert runs[0][1] > 1  # it did spill
    ranked = merge_counts(runs, partition_bits, thresholds)
    for j in range(26):
        counter = collections.Counter(format(int(v), "08x") for v in hashes[present[:, j], j])
        kept = sorted((-c, v) for v, c in counter.items() if c >= thresholds[j])
        assert [format(int(v), "08x") for v in ranked[j]] == [v for _, v in kept], j


def test_layouts(tmp_path):
    days = tmp_path / "days"
    days.mkdir()
    for d in range(24):
        (days / (f"day_{d}.gz" if d % 5 == 0 else f"day_{d}")).write_bytes(b"")
    inputs = terabyte_inputs(str(days))
    assert [os.path.basename(f.path) for f in inputs] == [f"day_{d}" + (".gz" if d % 5 == 0 else "") for d in range(24)]
    assert [f.rule for f in inputs] == ["train"] * 23 + [DAY23]
    assert [os.path.basename(f.path) for f in terabyte_inputs(str(days), parse_days("0-2,7"))] == [
        "day_0.gz", "day_1", "day_2", "day_7", "day_23"]
    with pytest.raises(ValueError, match="day 23"):
        terabyte_inputs(str(days), [22, 23])
    os.unlink(days / "day_4")
    with pytest.raises(ValueError, match="missing Criteo day file.*day_4"):
        terabyte_inputs(str(days))
    (days / "day_3.gz").write_bytes(b"")
    with pytest.raises(ValueError, match="day 3 exists twice"):
        terabyte_inputs(str(days), [0])
    assert split_ranges(DAY23, 5) == [("test", 1, 2), ("validation", 3, 5)]
    # Kaggle: 7 days by line count; the last (n // 7 lines) is cut into test and validation.
    assert split_ranges(KAGGLE, 100) == [("train", 1, 86), ("test", 87, 93), ("validation", 94, 100)]
    with pytest.raises(ValueError, match="no train.txt"):
        kaggle_inputs(str(days))
    with pytest.raises(ValueError, match="given twice"):
        file_inputs([str(days / "day_0.gz")], [str(days / "day_0.gz")])
    for bad in ("x", "3-1", "1,,2"):
        with pytest.raises(ValueError):
            parse_days(bad)


def test_work_dir_resumes_only_the_same_job(tmp_path):
    ident = {"inputs": ["a"], "thresholds": [1], "on_error": "fail"}
    work = WorkDir(str(tmp_path / "w"), ident, {"bits": 3})
    assert not work.resumed
    unit = work.begin("rows/f0")
    (open(os.path.join(unit, "x"), "w")).write("data")
    assert work.done("rows/f0") is None and not os.path.exists(unit)  # unfinished: removed
    unit = work.begin("rows/f0")
    (open(os.path.join(unit, "x"), "w")).write("data")
    work.commit("rows/f0", {"rows": 1}, depends={"file": (10, 20)})
    again = WorkDir(str(tmp_path / "w"), {**ident, "on_error": "skip"}, {"bits": 9})  # fail -> skip may resume
    assert again.resumed and again.settings == {"bits": 3}
    assert again.done("rows/f0", {"file": [10, 20]}) == {"rows": 1, "depends": {"file": [10, 20]}}
    assert open(os.path.join(again.file("rows/f0"), "x")).read() == "data"
    assert again.done("rows/f0", {"file": [10, 21]}) is None  # its input changed: redone
    assert not os.path.exists(again.file("rows/f0")) and again.done("rows/f0", {"file": [10, 20]}) is None
    with pytest.raises(DatasetError, match="thresholds differ.*--fresh"):
        WorkDir(str(tmp_path / "w"), {**ident, "thresholds": [2]}, {})
    fresh = WorkDir(str(tmp_path / "w"), {**ident, "thresholds": [2]}, {}, fresh=True)
    assert not fresh.resumed and fresh.done("rows/f0") is None
    assert json.load(open(tmp_path / "w" / "manifest.json"))["identity"]["thresholds"] == [2]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _own(work: str, pid: int, host: str | None = None) -> None:
    """Make the manifest of ``work`` say process ``pid`` (on ``host``) owns it."""
    path = os.path.join(work, "manifest.json")
    manifest = json.load(open(path))
    manifest["owner"] = {"host": host or socket.gethostname(), "pid": pid}
    json.dump(manifest, open(path, "w"))


def test_work_dir_removes_a_dead_runs_partial_files_and_refuses_a_live_runs(tmp_path):
    ident = {"inputs": ["a"], "thresholds": [1], "on_error": "fail"}
    path = str(tmp_path / "w")
    work = WorkDir(path, ident, {})
    work.begin("scan/f0")
    work.commit("scan/f0", {"lines": 1})
    partial = [work.begin("scan/f1"), work.file("scan", ".f1.json.123@host.abc.tmp"), work.file(".manifest.json.x.tmp")]
    for p in partial[1:]:
        open(p, "w").write("half")
    keep = sorted(os.listdir(path)), sorted(os.listdir(work.file("scan")))

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _own(path, live.pid)
        with pytest.raises(DatasetError, match=f"in use by a running preprocessing run \\(pid {live.pid}\\)"):
            WorkDir(path, ident, {})
        with pytest.raises(DatasetError, match="in use"):
            WorkDir(path, ident, {}, fresh=True)
        assert all(os.path.exists(p) for p in partial)  # a live run's files are not touched
    finally:
        live.kill()
        live.wait()
    _own(path, live.pid, host="elsewhere")  # cannot tell whether it still runs: its files stay
    assert WorkDir(path, ident, {}).resumed and all(os.path.exists(p) for p in partial)
    _own(path, _dead_pid())  # killed: everything it had half written goes, finished units stay
    again = WorkDir(path, ident, {})
    assert again.resumed and not any(os.path.exists(p) for p in partial)
    assert again.done("scan/f0") == {"lines": 1, "depends": None}
    assert (sorted(os.listdir(path)), sorted(os.listdir(work.file("scan")))) == (
        sorted(n for n in keep[0] if not n.endswith(".tmp")), ["f0", "f0.json"])
    assert WorkDir(path, ident, {}).resumed  # this process's own earlier run is no obstacle


def test_stale_split_temporaries_are_removed_but_not_a_live_writers(tmp_path):
    """The split writer that ``assemble`` uses removes what a killed writer left, nothing else."""
    (tmp_path / "train").mkdir()
    host = socket.gethostname()
    dead, mine = f".label.bin.{_dead_pid()}@{host}.0123abcd.tmp", f".label.bin.{os.getpid()}@{host}.4567ef01.tmp"
    for name in (dead, mine, "label.bin", ".notes.tmp"):
        (tmp_path / "train" / name).write_text("x")
    spec = FeatureSpec.default(13, [5] * 26, splits=("train", "test"), base_directory=str(tmp_path))
    SplitBinaryWriter(spec, "train").abort()
    assert sorted(os.listdir(tmp_path / "train")) == sorted([mine, "label.bin", ".notes.tmp"])
