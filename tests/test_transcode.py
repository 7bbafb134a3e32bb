import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from dlrm.data.errors import DatasetError
from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.transcode import transcode

# label, 2 numerical, 3 categorical; empty fields mean 0
TRAIN_LINES = [
    "1\t0.5\t3\t1\t2\t3",
    "0\t\t-2.25\t0\t\t7",
    "1\t100\t\t4\t40000\t",
    "",  # blank lines are skipped
    "0\t1e2\t7\t\t1\t0",
]
TEST_LINES = ["0\t1\t2\t9\t0\t1", "1\t\t\t\t\t"]


def parse_reference(lines, sep="\t"):
    """Independent parse with plain Python."""
    rows = [line.split(sep) for line in lines if line]
    label = np.array([int(r[0]) for r in rows], dtype=bool)
    numerical = np.array([[float(x or 0) for x in r[1:3]] for r in rows], dtype=np.float16).reshape(len(rows), 2)
    categorical = np.array([[int(x or 0) for x in r[3:]] for r in rows], dtype=np.int64).reshape(len(rows), 3)
    return numerical, categorical, label


def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def read_split(spec, split):
    reader = SplitBinaryReader(spec, split, batch_size=2)
    batches = [reader.read_batch(i) for i in range(len(reader))]
    reader.close()
    return (
        torch.cat([b.numerical for b in batches]).numpy(),
        torch.cat([b.categorical for b in batches]).numpy(),
        torch.cat([b.label for b in batches]).numpy(),
    )


@pytest.mark.parametrize("chunk_rows", [1, 2, 1000])
def test_round_trip(tmp_path, chunk_rows):
    inputs = {"train": write(tmp_path, "train.tsv", TRAIN_LINES), "test": write(tmp_path, "test.tsv", TEST_LINES)}
    out = tmp_path / "ds"
    spec = transcode(inputs, str(out), num_numerical=2, num_categorical=3, chunk_rows=chunk_rows)
    # max id + 1 over both splits: col0 max 9 (test), col1 40000, col2 7
    assert spec.cardinalities == [10, 40001, 8]
    assert [str(d) for d in spec.categorical_dtypes] == ["int8", "int32", "int8"]
    loaded = FeatureSpec.from_yaml(str(out / "feature_spec.yaml"))
    assert loaded.to_dict() == spec.to_dict()
    assert sorted(loaded.splits) == ["test", "train"]
    for split, lines in (("train", TRAIN_LINES), ("test", TEST_LINES)):
        for got, expected in zip(read_split(loaded, split), parse_reference(lines)):
            np.testing.assert_array_equal(got, expected)
    assert not [f for f in os.listdir(out / "train") if f.endswith(".tmp")]


def test_given_cardinalities_and_comma(tmp_path):
    lines = [line.replace("\t", ",") for line in TRAIN_LINES]
    path = write(tmp_path, "train.csv", lines)
    spec = transcode({"train": path}, str(tmp_path / "ds"), 2, 3, delimiter=",", cardinalities=[5, 70000, 300])
    assert spec.cardinalities == [5, 70000, 300]
    assert [str(d) for d in spec.categorical_dtypes] == ["int8", "int32", "int16"]
    for got, expected in zip(read_split(spec, "train"), parse_reference(lines, ",")):
        np.testing.assert_array_equal(got, expected)


BAD_LINES = {
    "too few fields": ("1\t2\t3\t4\t5", "5 fields, expected 6"),
    "too many fields": ("1\t2\t3\t4\t5\t6\t7", "7 fields, expected 6"),
    "non-numeric numerical": ("1\tabc\t3\t1\t2\t3", "field 2 (numerical feature 0) is 'abc'"),
    "non-integer id": ("1\t2\t3\t1\t2.5\t3", "field 5 (categorical feature 1) is '2.5'"),
    "label not 0/1": ("2\t2\t3\t1\t2\t3", "label is 2.0, expected 0 or 1"),
    "negative id": ("1\t2\t3\t1\t-4\t3", "categorical feature 1 is -4"),
    "float16 overflow": ("1\t70000\t3\t1\t4\t3", "numerical feature 0 is 70000.0"),
    "id over given cardinality": ("1\t2\t3\t1\t2\t12", "categorical feature 2 is 12, outside [0, 10)"),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
@pytest.mark.parametrize("chunk_rows", [2, 100])
def test_malformed_line_names_file_and_line(tmp_path, case, chunk_rows):
    bad, needle = BAD_LINES[case]
    lines = TRAIN_LINES[:3] + [bad] + TRAIN_LINES[3:]  # the bad line is line 4 of the file
    path = write(tmp_path, "train.tsv", lines)
    out = tmp_path / "ds"
    with pytest.raises(DatasetError) as info:
        transcode({"train": path}, str(out), 2, 3, cardinalities=[10, 40001, 10], chunk_rows=chunk_rows)
    msg = str(info.value)
    assert f"{path}, line 4:" in msg
    assert needle in msg
    assert not (out / "feature_spec.yaml").exists()
    assert not os.path.exists(out / "train") or os.listdir(out / "train") == []


def test_error_in_later_split_keeps_previous_dataset(tmp_path):
    out = tmp_path / "ds"
    train = write(tmp_path, "train.tsv", TRAIN_LINES)
    transcode({"train": train, "test": write(tmp_path, "test.tsv", TEST_LINES)}, str(out), 2, 3)
    before = {(d, f): (out / d / f).read_bytes() for d in ("train", "test") for f in os.listdir(out / d)}
    spec_before = (out / "feature_spec.yaml").read_text()
    bad_test = write(tmp_path, "bad.tsv", TEST_LINES + ["1\tx\t1\t1\t1\t1"])
    with pytest.raises(DatasetError, match=r"bad.tsv, line 3"):
        transcode({"train": write(tmp_path, "train2.tsv", TRAIN_LINES[:2]), "test": bad_test}, str(out), 2, 3,
                  overwrite=True)
    after = {(d, f): (out / d / f).read_bytes() for d in ("train", "test") for f in os.listdir(out / d)}
    assert after == before
    assert (out / "feature_spec.yaml").read_text() == spec_before


def test_missing_input(tmp_path):
    with pytest.raises(DatasetError, match="nope.tsv"):
        transcode({"train": str(tmp_path / "nope.tsv")}, str(tmp_path / "ds"), 2, 3)


def test_script(tmp_path):
    train = write(tmp_path, "train.tsv", TRAIN_LINES)
    test = write(tmp_path, "test.tsv", TEST_LINES)
    out = tmp_path / "ds"
    cmd = [sys.executable, "-m", "dlrm.scripts.transcode", "--train", train, "--test", test, "--output", str(out),
           "--num_numerical", "2", "--num_categorical", "3", "--delimiter", "tab", "--cardinalities", "10,40001,9",
           "--chunk_rows", "2"]  # the project's name of --chunk_size
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    spec = FeatureSpec.from_yaml(str(out))
    assert spec.cardinalities == [10, 40001, 9]
    for got, expected in zip(read_split(spec, "test"), parse_reference(TEST_LINES)):
        np.testing.assert_array_equal(got, expected)

    bad = write(tmp_path, "bad.tsv", ["1\t2"])
    proc = subprocess.run(cmd[:4] + [bad] + cmd[5:] + ["--overwrite"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{bad}, line 1" in proc.stderr and "Traceback" not in proc.stderr
