import io
import os
import sys

import numpy as np
import pytest
import torch
import yaml

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.transcode import transcode
from dlrm.engine.errors import DatasetError
import warm_python

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
    proc = warm_python.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    spec = FeatureSpec.from_yaml(str(out))
    assert spec.cardinalities == [10, 40001, 9]
    for got, expected in zip(read_split(spec, "test"), parse_reference(TEST_LINES)):
        np.testing.assert_array_equal(got, expected)

    bad = write(tmp_path, "bad.tsv", ["1\t2"])
    proc = warm_python.run(cmd[:4] + [bad] + cmd[5:] + ["--overwrite"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert f"{bad}, line 1" in proc.stderr and "Traceback" not in proc.stderr


def _values_at_float16_midpoints() -> np.ndarray:
    """float64 values on the midpoint of two neighbouring float16 values and one float64 ulp
    below and above it, over the float16 range (both signs, subnormals included), where the
    roundings through float32 and at once part."""
    bits = np.arange(0, 0x77FF, 29, dtype=np.uint16)  # finite float16 up to 32752, spread over every exponent
    low = bits.view(np.float16).astype(np.float64)
    high = (bits + 1).view(np.float16).astype(np.float64)
    mid = (low + high) / 2  # exact in float64
    values = np.concatenate([mid, np.nextafter(mid, -np.inf), np.nextafter(mid, np.inf)])
    return np.concatenate([values, -values])


def _write_columns(path, values: np.ndarray, columns: int, sep: str, label_first: bool = True) -> np.ndarray:
    """``values`` as rows of ``columns`` numericals (label 1 first, an id 0 last), written with
    Python's shortest round-trip repr; returns them as the [rows, columns] float64 the text holds."""
    table = values[: len(values) // columns * columns].reshape(-1, columns)
    lines = [sep.join(["1", *(repr(float(v)) for v in row), "0"]) for row in table]
    path.write_text("\n".join(lines) + "\n")
    parsed = np.array([[float(x) for x in line.split(sep)[1:-1]] for line in lines])  # independent parse
    assert (parsed.view(np.int64) == table.view(np.int64)).all()  # the text holds these exact float64s
    return table


# The roundings, spelled with numpy's casts: NVIDIA's float64 -> float32 -> float16 (its
# transcode.py casts with torch, which rounds float64 -> float16 through float32), and once.
REFERENCE = {"nvidia": lambda x: x.astype(np.float32).astype(np.float16), "direct": lambda x: x.astype(np.float16)}


def test_reference_roundings_are_what_they_claim():
    values = _values_at_float16_midpoints()
    torch_cast = torch.from_numpy(values).to(torch.float16).numpy()  # the cast in NVIDIA's transcode.py
    assert (REFERENCE["nvidia"](values).view(np.uint16) == torch_cast.view(np.uint16)).all()
    # NVIDIA's transcode.py parses with pandas' default float parser, which is off by up to a few
    # thousand float64 ulps; float32 absorbs that, so its bytes are those of the exact values.
    pandas = pytest.importorskip("pandas")
    parsed = pandas.read_csv(io.StringIO("\n".join(map(repr, values.tolist()))), header=None)[0].to_numpy()
    nvidia = torch.from_numpy(parsed).to(torch.float16).numpy()
    assert (REFERENCE["nvidia"](values).view(np.uint16) == nvidia.view(np.uint16)).all()
    differ = REFERENCE["nvidia"](values).view(np.uint16) != REFERENCE["direct"](values).view(np.uint16)
    # At a midpoint both round the tie to even; of the two values beside it, float32 rounds both onto
    # the midpoint, so the one on the side away from the even neighbour goes the other way: 1 in 3.
    assert differ.sum() == len(values) // 3


@pytest.mark.parametrize("rounding", [None, "nvidia", "direct"])
def test_numericals_round_to_float16_as_nvidia_or_directly(tmp_path, rounding):
    """Byte identity of numerical.bin with the reference rounding, on values at and one float64
    ulp beside float16 midpoints; the default is NVIDIA's."""
    table = _write_columns(tmp_path / "train.tsv", _values_at_float16_midpoints(), 3, "\t")
    options = {} if rounding is None else {"numerical_rounding": rounding}
    spec = transcode({"train": str(tmp_path / "train.tsv")}, str(tmp_path / "ds"), 3, 1, chunk_rows=500, **options)
    got = np.fromfile(spec.paths("train").numerical, dtype=np.float16).reshape(table.shape)
    expected = REFERENCE[rounding or "nvidia"](table)
    assert got.view(np.uint16).tobytes() == expected.view(np.uint16).tobytes()


def test_nvidia_csv_form_writes_nvidias_numerical_bytes(tmp_path, cli):
    """``transcode --input`` (NVIDIA's form) by default, and with ``--numerical_rounding direct``."""
    data = tmp_path / "data"
    data.mkdir()
    table = _write_columns(data / "train.csv", _values_at_float16_midpoints()[:1200], 4, ",")
    spec = {"channel_spec": {"label": ["y"], "numerical": ["a", "b", "c", "d"], "categorical": ["k"]},
            "feature_spec": {"y": {}, "a": {}, "b": {}, "c": {}, "d": {}, "k": {"cardinality": 3}},
            "metadata": {},
            "source_spec": {"train": [{"type": "csv", "features": ["y", "a", "b", "c", "d", "k"],
                                       "files": ["train.csv"]}]}}
    (data / "feature_spec.yaml").write_text(yaml.safe_dump(spec))
    for rounding, extra in (("nvidia", []), ("direct", ["--numerical_rounding", "direct"])):
        out = tmp_path / rounding
        cli("dlrm.scripts.transcode", "--input", str(data), "--output", str(out), *extra)
        got = (out / "train" / "numerical.bin").read_bytes()
        assert got == REFERENCE[rounding](table).view(np.uint16).tobytes(), rounding
        assert FeatureSpec.from_yaml(str(out)).metadata["transcoded_from"]["numerical_rounding"] == rounding
