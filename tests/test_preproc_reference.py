"""The synthetic Criteo generator and the plain-Python reference transform.

Expected values are worked out by hand here (ids from counts, float16 values as literals), not
recomputed with the code under test.
"""

from __future__ import annotations

import collections
import gzip
import os
import re

import numpy as np
import pytest

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.engine.errors import DatasetError
from preproc import generate
from preproc.generate import generate_criteo_tsv, tsv_line
from preproc.reference import column_thresholds, criteo_day_split, parse_threshold, reference_preprocess, split_day_23

HEX8 = re.compile(r"[0-9a-f]{8}")
COUNT = re.compile(r"-?[0-9]+")




def write(path, lines: list[str]) -> str:
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def read_split(out: str, split: str, spec: FeatureSpec) -> tuple[bytes, np.ndarray, list[np.ndarray]]:
    """Raw files of a split: label bytes, numerical [N, 13] float16, one id array per column."""
    d = os.path.join(out, split)
    label = open(os.path.join(d, "label.bin"), "rb").read()
    numerical = np.fromfile(os.path.join(d, "numerical.bin"), dtype=np.float16).reshape(-1, 13)
    cats = [np.fromfile(os.path.join(d, f"cat_{j}.bin"), dtype=spec.categorical_dtypes[j]) for j in range(26)]
    return label, numerical, cats


def read_lines(path: str) -> list[list[str]]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return [line.rstrip("\n").split("\t") for line in f]


# ---------------------------------------------------------------------------- generator


def test_generator_is_deterministic_and_well_formed(tmp_path):
    a, b, c = tmp_path / "a.tsv", tmp_path / "b.tsv", tmp_path / "c.tsv"
    generate_criteo_tsv(str(a), 20000, seed=3)
    generate_criteo_tsv(str(b), 20000, seed=3)
    generate_criteo_tsv(str(c), 20000, seed=4)
    assert a.read_bytes() == b.read_bytes()
    assert a.read_bytes() != c.read_bytes()
    rows = read_lines(str(a))
    assert len(rows) == 20000
    assert {len(r) for r in rows} == {40}
    assert {r[0] for r in rows} == {"0", "1"}
    for r in rows[:2000]:
        assert all(v == "" or COUNT.fullmatch(v) for v in r[1:14]), r
        assert all(v == "" or HEX8.fullmatch(v) for v in r[14:]), r
    # Only I2 carries negative counts, and only -1..-3.
    negatives = {(k, int(r[k])) for r in rows for k in range(1, 14) if r[k].startswith("-")}
    assert negatives and {k for k, _ in negatives} == {2} and {v for _, v in negatives} == {-1, -2, -3}
    rate = np.mean([r[0] == "1" for r in rows])
    assert 0.20 < rate < 0.30


def test_generator_missing_rates_skew_and_vocabularies(tmp_path):
    path = tmp_path / "a.tsv"
    generate_criteo_tsv(str(path), 20000, seed=0)
    rows = read_lines(str(path))
    n = len(rows)
    for k in range(13):
        missing = sum(r[1 + k] == "" for r in rows) / n
        assert abs(missing - generate.NUMERICAL_MISSING_RATES[k]) < 0.02, (f"I{k + 1}", missing)
    for j in range(26):
        values = collections.Counter(r[14 + j] for r in rows)
        missing = values.pop("", 0) / n
        assert abs(missing - generate.CATEGORICAL_MISSING_RATES[j]) < 0.02, (f"C{j + 1}", missing)
        assert len(values) <= generate.VOCAB_SIZES[j]
        if generate.VOCAB_SIZES[j] >= 1000:
            freqs = sorted(values.values())
            assert freqs[-1] > 50 * freqs[len(freqs) // 2], (f"C{j + 1}", freqs[-1], freqs[len(freqs) // 2])
    # Small vocabularies are (nearly) exhausted; the largest shows many distinct values.
    assert len({r[14 + 5] for r in rows} - {""}) == 4
    assert len({r[14] for r in rows} - {""}) > 2000


def test_generator_days_and_gzip(tmp_path, cli):
    out = tmp_path / "days"
    generate_criteo_tsv(str(out), 1001, seed=1, days=3, gzip=True)
    assert sorted(os.listdir(out)) == ["day_0.gz", "day_1.gz", "day_2.gz"]
    assert [len(read_lines(str(out / f"day_{d}.gz"))) for d in range(3)] == [334, 334, 333]
    first = (out / "day_0.gz").read_bytes()
    generate_criteo_tsv(str(out), 1001, seed=1, days=3, gzip=True)
    assert (out / "day_0.gz").read_bytes() == first  # no timestamp in the gzip header

    cli("preproc.generate", "--output", str(tmp_path / "cli"), "--rows", "10", "--days", "2", "--seed", "5")
    assert sorted(os.listdir(tmp_path / "cli")) == ["day_0", "day_1"]
    assert len(read_lines(str(tmp_path / "cli" / "day_1"))) == 5


# ---------------------------------------------------------------------------- reference transform


def f16(y: float) -> float:
    """Round to the nearest float16 (ties to even) for normal values, by hand: spacing 2^(e-10)."""
    if y == 0:
        return 0.0
    step = 2.0 ** (np.floor(np.log2(abs(y))) - 10)
    return round(y / step) * step


TRAIN = [
    tsv_line("1", {1: "0"}, {0: "aaaaaaaa", 1: "deadbeef"}),
    tsv_line("0", {0: "-1", 1: "5"}, {0: "aaaaaaaa"}),
    tsv_line("0", {0: "-2", 1: "-3"}, {0: "AAAAAAAA"}),  # same value as aaaaaaaa
    tsv_line("1", {0: "1000000"}, {0: "BBBBBBBB"}),
    tsv_line("0", {0: "-7"}, {0: "bbbbbbbb"}),
    tsv_line("0", {0: "99999999999999999999"}, {0: "0000000a"}),
    tsv_line("1", {}, {0: "0000000a"}),
    tsv_line("0", {}, {0: "cccccccc"}),
]
TEST = [
    tsv_line("1", {}, {0: "aaaaaaaa", 1: "deadbeef"}),
    tsv_line("0", {0: "3"}, {0: "eeeeeeee"}),  # unseen in train
]
VALIDATION = [
    tsv_line("0", {}, {0: "cccccccc", 1: "DEADBEEF"}),
    tsv_line("1", {}, {0: "BbBbBbBb"}),
]


@pytest.fixture
def tiny(tmp_path):
    return (
        [write(tmp_path / "train.tsv", TRAIN)],
        [write(tmp_path / "test.tsv", TEST)],
        [write(tmp_path / "validation.tsv", VALIDATION)],
    )


def test_reference_exact_output(tmp_path, tiny):
    out = str(tmp_path / "out")
    # C2 (field 15) keeps values seen once; every other column needs 2 occurrences.
    spec = reference_preprocess(*tiny, out, frequency_threshold={15: 1, None: 2})
    # C1 counts: aaaaaaaa 3, 0000000a 2, bbbbbbbb 2 (tie: '0000000a' < 'bbbbbbbb'), cccccccc 1 (< 2).
    assert spec.cardinalities == [4, 2] + [1] * 24
    assert FeatureSpec.from_yaml(out).cardinalities == spec.cardinalities

    label, num, cats = read_split(out, "train", spec)
    assert label == bytes([1, 0, 0, 1, 0, 0, 1, 0])
    assert cats[0].tolist() == [1, 1, 1, 3, 3, 2, 2, 0]
    assert cats[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    assert all(c.tolist() == [0] * 8 for c in cats[2:])
    assert cats[0].dtype == np.int8
    # I1: missing, -1, -2, 1e6, -7, 1e20-1, missing, missing -> 0, ln 2, ln 1, ln(1000003), 0, ln(1e20+2), 0, 0
    assert num[:, 0].tolist() == [0.0, 0.693359375, 0.0, 13.8125, 0.0, 46.0625, 0.0, 0.0]
    # I2: 0, 5, -3 (ln 0 is undefined -> 0), then missing.
    assert num[:, 1].tolist() == [1.0986328125, 2.080078125, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert (num[:, 2:] == 0).all()
    # The literals above are float16 roundings; check them against the by-hand rounding too.
    assert [f16(np.log(v)) for v in (2, 3, 8, 1000003)] == [0.693359375, 1.0986328125, 2.080078125, 13.8125]

    label, num, cats = read_split(out, "test", spec)
    assert label == bytes([1, 0])
    assert cats[0].tolist() == [1, 0] and cats[1].tolist() == [1, 0]
    assert num[:, 0].tolist() == [0.0, f16(np.log(6))] == [0.0, 1.7919921875]

    label, num, cats = read_split(out, "validation", spec)
    assert label == bytes([0, 1])
    assert cats[0].tolist() == [0, 3] and cats[1].tolist() == [1, 0]


def test_reference_vocabulary_over_all_days(tmp_path, tiny):
    out = str(tmp_path / "out")
    spec = reference_preprocess(*tiny, out, frequency_threshold={15: 1, None: 2}, vocabulary_days="all")
    # C1 over train, test and validation: aaaaaaaa 3 + 1, bbbbbbbb 2 + 1 (BbBbBbBb), 0000000a 2,
    # cccccccc 1 + 1 (tie with 0000000a: '0000000a' < 'cccccccc'), eeeeeeee 1 (< 2).
    # C2: deadbeef once in each split.
    assert spec.cardinalities == [5, 2] + [1] * 24
    assert spec.metadata["preprocessing"]["vocabulary_days"] == "all"
    _, _, cats = read_split(out, "train", spec)
    assert cats[0].tolist() == [1, 1, 1, 2, 2, 3, 3, 4] and cats[1].tolist() == [1, 0, 0, 0, 0, 0, 0, 0]
    _, _, cats = read_split(out, "test", spec)
    assert cats[0].tolist() == [1, 0] and cats[1].tolist() == [1, 0]
    _, _, cats = read_split(out, "validation", spec)
    assert cats[0].tolist() == [4, 2] and cats[1].tolist() == [1, 0]
    with pytest.raises(ValueError, match="vocabulary_days must be one of"):
        reference_preprocess(*tiny, str(tmp_path / "bad"), vocabulary_days="test")


def test_reference_numerical_rounding(tmp_path):
    # ln(10361 + 3) = 9.2460935417...: the nearest float16 is 9.2421875 (direct), but float32 rounds
    # it to 9.24609375, the midpoint, which float16 rounds to even: 9.25 (NVIDIA's two casts).
    lines = [tsv_line("1", {0: "10361", 1: "5"}, {})]
    train, test = write(tmp_path / "train.tsv", lines), write(tmp_path / "test.tsv", lines)
    expected = {"nvidia": [9.25, 2.080078125], "direct": [9.2421875, 2.080078125]}
    for rounding, values in expected.items():
        out = str(tmp_path / rounding)
        spec = reference_preprocess([train], [test], [], out, numerical_rounding=rounding)
        assert read_split(out, "train", spec)[1][0, :2].tolist() == values
        assert spec.metadata["preprocessing"]["numerical_rounding"] == rounding
    assert f16(np.log(10364)) == 9.2421875  # by hand: the single rounding
    default = reference_preprocess([train], [test], [], str(tmp_path / "default"))
    assert default.metadata["preprocessing"]["numerical_rounding"] == "nvidia"
    with pytest.raises(ValueError, match="numerical rounding must be one of"):
        reference_preprocess([train], [test], [], str(tmp_path / "bad"), numerical_rounding="float32")


def test_reference_global_threshold_and_no_validation(tmp_path, tiny):
    out = str(tmp_path / "out")
    spec = reference_preprocess(tiny[0], tiny[1], [], out, frequency_threshold=2)
    assert spec.splits == ["train", "test"]
    assert spec.cardinalities == [4, 1] + [1] * 24  # deadbeef seen once -> 0
    _, _, cats = read_split(out, "train", spec)
    assert cats[1].tolist() == [0] * 8
    # Threshold 0 keeps every train value: C1 has 4 distinct values, C2 one.
    spec = reference_preprocess(tiny[0], tiny[1], [], str(tmp_path / "out0"), frequency_threshold=0)
    assert spec.cardinalities[:2] == [5, 2]
    _, _, cats = read_split(str(tmp_path / "out0"), "train", spec)
    assert cats[0].tolist() == [1, 1, 1, 3, 3, 2, 2, 4]


def test_parse_threshold():
    assert parse_threshold("15") == 15
    assert parse_threshold("14:3,15") == {14: 3, None: 15}
    assert parse_threshold("39:2") == {39: 2}
    assert column_thresholds(parse_threshold("14:3,15")) == [3] + [15] * 25
    assert column_thresholds({39: 2}) == [0] * 25 + [2]
    assert column_thresholds(7) == [7] * 26
    for bad in ("13:3", "40:1", "x", "14:3,14:4", "14:-1", "1,2"):
        with pytest.raises(ValueError):
            parse_threshold(bad)


GOOD = tsv_line("1", {0: "1"}, {0: "aaaaaaaa"})
_fields = GOOD.split("\t")
MALFORMED = {
    "wrong field count": ("\t".join(_fields[:39]), "field_count", "40 tab-separated fields, got 39"),
    "non-hex hash": (tsv_line("0", {}, {2: "zzzzzzzz"}), "categorical", "C3"),
    "7-digit hash": (tsv_line("0", {}, {25: "1234567"}), "categorical", "C26"),
    "non-integer count": (tsv_line("0", {2: "1.5"}), "numerical", "I3"),
    "label 2": (tsv_line("2", {}), "label", "label"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_line_fails_with_file_and_line(tmp_path, case):
    bad, _, words = MALFORMED[case]
    train = write(tmp_path / "train.tsv", [GOOD, GOOD, bad, GOOD])
    test = write(tmp_path / "test.tsv", [GOOD])
    out = tmp_path / "out"
    with pytest.raises(DatasetError) as e:
        reference_preprocess([train], [test], [], str(out))
    assert f"{train}, line 3:" in str(e.value) and words in str(e.value)
    assert not (out / "feature_spec.yaml").exists() and not (out / "train" / "label.bin").exists()
    # Also in a test file, which only the second pass reads.
    train = write(tmp_path / "train.tsv", [GOOD])
    test = write(tmp_path / "test.tsv", [GOOD, bad])
    with pytest.raises(DatasetError, match=re.escape(f"{test}, line 2:")):
        reference_preprocess([train], [test], [], str(out))
    assert not (out / "train" / "label.bin").exists()  # nothing committed when a later split fails


def test_skip_mode_counts_and_drops_exactly_the_bad_lines(tmp_path, capsys):
    lines, good_values = [], []
    for i, case in enumerate(sorted(MALFORMED)):
        good_values.append(i + 1)
        lines.append(tsv_line(str(i % 2), {0: str(i + 1)}, {0: "aaaaaaaa"}))
        lines.append(MALFORMED[case][0])
    train = write(tmp_path / "train.tsv", lines)  # bad lines at 2, 4, 6, 8, 10
    test = write(tmp_path / "test.tsv", [GOOD, MALFORMED["label 2"][0]])
    out = str(tmp_path / "out")
    spec = reference_preprocess([train], [test], [], out, on_error="skip")
    skipped = spec.metadata["skipped_lines"]
    # sorted cases: 7-digit hash, label 2, non-hex hash, non-integer count, wrong field count
    assert skipped == {
        "field_count": {"count": 1, "first": [f"{train}:10"]},
        "label": {"count": 2, "first": [f"{train}:4", f"{test}:2"]},
        "numerical": {"count": 1, "first": [f"{train}:8"]},
        "categorical": {"count": 2, "first": [f"{train}:2", f"{train}:6"]},
    }
    assert FeatureSpec.from_yaml(out).metadata["skipped_lines"] == skipped
    assert "skipped 6 malformed line(s)" in capsys.readouterr().err
    label, num, cats = read_split(out, "train", spec)
    assert label == bytes([0, 1, 0, 1, 0])
    assert num[:, 0].tolist() == [f16(np.log(v + 3)) for v in good_values]
    assert cats[0].tolist() == [1] * 5 and spec.cardinalities[0] == 2
    assert read_split(out, "test", spec)[0] == bytes([1])


def test_empty_split_is_an_error(tmp_path):
    train = write(tmp_path / "train.tsv", [GOOD])
    test = write(tmp_path / "test.tsv", [MALFORMED["label 2"][0]])
    empty = write(tmp_path / "empty.tsv", [])
    out = tmp_path / "out"
    with pytest.raises(DatasetError, match="split 'test' has no rows"):
        reference_preprocess([train], [test], [], str(out), on_error="skip")
    with pytest.raises(DatasetError, match="split 'validation' has no rows"):
        reference_preprocess([train], [train], [empty], str(out))
    with pytest.raises(DatasetError, match="split 'train' has no rows"):
        reference_preprocess([empty], [train], [], str(out))
    assert not (out / "feature_spec.yaml").exists()
    assert not (out / "train" / "label.bin").exists()


def test_day_split(tmp_path):
    names = [f"day_{d}" for d in range(24)]
    train, last = criteo_day_split([str(tmp_path / n) for n in reversed(names)])
    assert [os.path.basename(p) for p in train] == names[:23] and os.path.basename(last) == "day_23"
    with pytest.raises(ValueError, match="missing \\[5\\]"):
        criteo_day_split([str(tmp_path / n) for n in names if n != "day_5"])
    day23 = tmp_path / "day_23"
    day23.write_bytes(b"a\nb\nc\nd\ne\n")
    assert split_day_23(str(day23), str(tmp_path / "t"), str(tmp_path / "v")) == (2, 3)
    assert (tmp_path / "t").read_bytes() == b"a\nb\n" and (tmp_path / "v").read_bytes() == b"c\nd\ne\n"


# ---------------------------------------------------------------------------- end to end


def test_generate_then_preprocess_end_to_end(tmp_path):
    days = tmp_path / "days"
    generate_criteo_tsv(str(days), 20000, seed=7, days=24)
    train, day23 = criteo_day_split([str(days / n) for n in os.listdir(days)])
    n_test, n_val = split_day_23(day23, str(tmp_path / "test.tsv"), str(tmp_path / "val.tsv"))
    out = str(tmp_path / "out")
    spec = reference_preprocess(train, [str(tmp_path / "test.tsv")], [str(tmp_path / "val.tsv")], out, frequency_threshold=3)
    spec = FeatureSpec.from_yaml(out)
    train_rows = [r for p in train for r in read_lines(p)]
    expected = {"train": len(train_rows), "test": n_test, "validation": n_val}
    assert sum(expected.values()) == 20000 and n_test + n_val == 833
    for split, rows in expected.items():
        with SplitBinaryReader(spec, split, batch_size=4096) as reader:
            assert reader.num_samples == rows
            batches = [reader.read_batch(i) for i in range(len(reader))]  # checks ids < cardinality
        num = np.concatenate([b.numerical.numpy() for b in batches]).astype(np.float32)
        cat = np.concatenate([b.categorical.numpy() for b in batches])
        assert np.isfinite(num).all() and (num >= 0).all()
        assert (cat >= 0).all() and (cat < np.array(spec.cardinalities)).all()
    # Independent check on C1: id 1 is its most frequent train value, and K = values seen >= 3 times.
    c1 = collections.Counter(r[14].lower() for r in train_rows if r[14])
    assert spec.cardinalities[0] == 1 + sum(c >= 3 for c in c1.values())
    ids = np.fromfile(os.path.join(out, "train", "cat_0.bin"), dtype=spec.categorical_dtypes[0])
    assert (ids == 1).sum() == max(c1.values())
    labels = np.fromfile(os.path.join(out, "train", "label.bin"), dtype=np.uint8)
    assert labels.sum() == sum(r[0] == "1" for r in train_rows)
