import os

import numpy as np
import pytest
import torch
import yaml

from dlrm.data.batch import Batch
from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.split_binary_writer import SplitBinaryWriter
from dlrm.engine.errors import DatasetError, FeatureSpecError

# Both sides of every dtype boundary (a cardinality c needs ids up to c-1).
BOUNDARY_CARDS = [127, 128, 129, 32767, 32768, 32769, 2**31 - 1, 2**31, 2**31 + 1]
BOUNDARY_ITEMSIZE = [1, 1, 2, 2, 2, 4, 4, 4, 8]


def make_arrays(n, num_numerical, cards, seed=0):
    rng = np.random.default_rng(seed)
    numerical = rng.standard_normal((n, num_numerical)).astype(np.float16)
    categorical = np.stack([rng.integers(0, c, n, dtype=np.int64) for c in cards], axis=1) if cards else np.zeros((n, 0), np.int64)
    if n >= 2 and cards:
        categorical[0] = 0  # the extreme ids of every column
        categorical[1] = np.asarray(cards) - 1
    label = rng.integers(0, 2, n).astype(bool)
    return numerical, categorical, label


def write_split(spec, split, numerical, categorical, label, chunk=11):
    with SplitBinaryWriter(spec, split) as w:
        for s in range(0, len(label), chunk):
            w.write(Batch(torch.from_numpy(numerical[s : s + chunk]), torch.from_numpy(categorical[s : s + chunk]), torch.from_numpy(label[s : s + chunk])))
    return w


def dataset(tmp_path, n=30, num_numerical=3, cards=(5, 300, 70000), splits=("train",)):
    spec = FeatureSpec.default(num_numerical, list(cards), splits=splits, base_directory=str(tmp_path))
    spec.to_yaml(str(tmp_path / "feature_spec.yaml"))
    arrays = make_arrays(n, num_numerical, list(cards))
    for split in splits:
        write_split(spec, split, *arrays)
    return FeatureSpec.from_yaml(str(tmp_path / "feature_spec.yaml")), arrays


def read_all(reader):
    batches = [reader.read_batch(i) for i in range(len(reader))]
    return batches, (
        torch.cat([b.numerical for b in batches]).numpy(),
        torch.cat([b.categorical for b in batches]).numpy(),
        torch.cat([b.label for b in batches]).numpy(),
    )


def test_round_trip_every_categorical_dtype(tmp_path):
    n = 30
    spec = FeatureSpec.default(2, BOUNDARY_CARDS, splits=("train",), base_directory=str(tmp_path))
    numerical, categorical, label = make_arrays(n, 2, BOUNDARY_CARDS)
    w = write_split(spec, "train", numerical, categorical, label)
    assert w.num_rows == n

    # files hold exactly the raw values at the expected widths (independent of the reader)
    paths = spec.paths("train")
    for j, (path, itemsize) in enumerate(zip(paths.categorical, BOUNDARY_ITEMSIZE)):
        assert os.path.getsize(path) == n * itemsize
        raw = np.fromfile(path, dtype=np.dtype(f"<i{itemsize}"))
        np.testing.assert_array_equal(raw, categorical[:, j])
    np.testing.assert_array_equal(np.fromfile(paths.label, dtype=np.uint8), label.astype(np.uint8))
    np.testing.assert_array_equal(np.fromfile(paths.numerical, dtype=np.float16).reshape(n, 2), numerical)

    reader = SplitBinaryReader(spec, "train", batch_size=7)
    assert reader.num_samples == n and len(reader) == 5
    batches, (num, cat, lab) = read_all(reader)
    assert [len(b) for b in batches] == [7, 7, 7, 7, 2]
    assert batches[0].categorical.dtype == torch.int64  # widest selected column
    assert batches[0].numerical.dtype == torch.float16
    assert batches[0].label.dtype == torch.bool
    np.testing.assert_array_equal(num, numerical)
    np.testing.assert_array_equal(cat, categorical)
    np.testing.assert_array_equal(lab, label)
    reader.close()


@pytest.mark.parametrize(
    "subset, dtype",
    [([0, 1], torch.int8), ([1, 3], torch.int16), ([5], torch.int32), ([8, 0], torch.int64), ([], torch.int64)],
)
def test_categorical_subset_narrowest_dtype(tmp_path, subset, dtype):
    spec = FeatureSpec.default(2, BOUNDARY_CARDS, splits=("train",), base_directory=str(tmp_path))
    numerical, categorical, label = make_arrays(20, 2, BOUNDARY_CARDS)
    write_split(spec, "train", numerical, categorical, label)
    with SplitBinaryReader(spec, "train", batch_size=8, categorical_features=subset) as reader:
        batches, (_, cat, _) = read_all(reader)
    assert batches[0].categorical.dtype == dtype
    assert cat.shape == (20, len(subset))
    np.testing.assert_array_equal(cat, categorical[:, subset])


def test_skip_numerical_and_label(tmp_path):
    spec, (numerical, categorical, label) = dataset(tmp_path, n=23)
    reader = SplitBinaryReader(spec, "train", batch_size=10, read_numerical=False, read_label=False, categorical_features=[2])
    batches, _ = read_all(reader)
    assert [len(b) for b in batches] == [10, 10, 3]
    last = batches[-1]
    assert last.numerical.shape == (3, 0) and last.label.shape == (3, 0)
    np.testing.assert_array_equal(last.categorical.numpy()[:, 0], categorical[20:, 2])
    # nothing at all selected: the label file still defines the sample count
    empty = SplitBinaryReader(spec, "train", batch_size=10, read_numerical=False, read_label=False, categorical_features=[])
    assert empty.num_samples == 23
    assert empty.read_batch(2).categorical.shape == (3, 0)


def test_drop_last_batch_and_index_range(tmp_path):
    spec, _ = dataset(tmp_path, n=23)
    assert len(SplitBinaryReader(spec, "train", batch_size=10, drop_last_batch=True)) == 2
    assert len(SplitBinaryReader(spec, "train", batch_size=23)) == 1
    reader = SplitBinaryReader(spec, "train", batch_size=10)
    with pytest.raises(IndexError):
        reader.read_batch(3)
    with pytest.raises(ValueError):
        SplitBinaryReader(spec, "train", batch_size=10, categorical_features=[3])


def test_one_positional_read_per_file(tmp_path, monkeypatch):
    spec, _ = dataset(tmp_path, n=23)
    reader = SplitBinaryReader(spec, "train", batch_size=10)
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: calls.append(fd) or real(fd, bufs, off))
    reader.read_batch(1)
    assert len(calls) == 2 + 3 and len(set(calls)) == 5  # label, numerical, 3 categorical


def test_writer_puts_files_under_the_spec_base_directory(tmp_path):
    spec = FeatureSpec.default(1, [4], splits=("train",), base_directory=str(tmp_path))
    arrays = make_arrays(5, 1, [4])
    with SplitBinaryWriter(spec, "train") as w:
        w.write(Batch(*(torch.from_numpy(a) for a in arrays)))
    assert os.path.getsize(tmp_path / "train" / "cat_0.bin") == 5


def test_nvidia_style_files_read(tmp_path):
    """Spec built by hand as NVIDIA writes it (train/test only); files written with plain numpy."""
    num, cat = ["num_0", "num_1"], ["cat_0.bin", "cat_1.bin", "cat_2.bin"]
    cards, dtypes = [3, 1000, 50000], ["int8", "int16", "int32"]
    source = {
        s: [{"features": num, "files": [f"{s}/numerical.bin"], "type": "split_binary"},
            {"features": ["label"], "files": [f"{s}/label.bin"], "type": "split_binary"}]
        + [{"features": [c], "files": [f"{s}/{c}"], "type": "split_binary"} for c in cat]
        for s in ("train", "test")
    }
    spec_dict = {
        "channel_spec": {"categorical": cat, "label": ["label"], "numerical": num},
        "feature_spec": {
            **{c: {"cardinality": k, "dtype": d} for c, k, d in zip(cat, cards, dtypes)},
            "label": {"dtype": "bool"},
            **{x: {"dtype": "float16"} for x in num},
        },
        "metadata": {},
        "source_spec": source,
    }
    (tmp_path / "feature_spec.yaml").write_text(yaml.dump(spec_dict))
    rng = np.random.default_rng(1)
    expected = {}
    for split, n in (("train", 17), ("test", 9)):
        os.makedirs(tmp_path / split)
        numerical = rng.standard_normal((n, 2)).astype(np.float16)
        label = rng.integers(0, 2, n).astype(bool)
        ids = [rng.integers(0, k, n).astype(d) for k, d in zip(cards, dtypes)]
        numerical.tofile(tmp_path / split / "numerical.bin")
        label.tofile(tmp_path / split / "label.bin")
        for c, a in zip(cat, ids):
            a.tofile(tmp_path / split / c)
        expected[split] = (numerical, np.stack([a.astype(np.int64) for a in ids], 1), label)

    spec = FeatureSpec.from_yaml(str(tmp_path / "feature_spec.yaml"))
    for split in ("train", "test"):
        reader = SplitBinaryReader(spec, split, batch_size=4)
        _, got = read_all(reader)
        for g, e in zip(got, expected[split]):
            np.testing.assert_array_equal(g, e)
    with pytest.raises(DatasetError, match="known splits"):
        SplitBinaryReader(spec, "validation", batch_size=4)


# ---------------------------------------------------------------------------- errors


def test_missing_file(tmp_path):
    spec, _ = dataset(tmp_path)
    os.unlink(tmp_path / "train" / "cat_1.bin")
    with pytest.raises(DatasetError) as info:
        SplitBinaryReader(spec, "train", batch_size=4)
    msg = str(info.value)
    assert "cat_1.bin" in msg and "missing" in msg and str(tmp_path / "train") in msg
    # a rank that does not read the file does not need it
    SplitBinaryReader(spec, "train", batch_size=4, categorical_features=[0, 2]).close()


def test_truncated_file(tmp_path):
    spec, _ = dataset(tmp_path, n=30)
    path = tmp_path / "train" / "numerical.bin"
    with open(path, "r+b") as f:
        f.truncate(30 * 6 - 1)
    with pytest.raises(DatasetError) as info:
        SplitBinaryReader(spec, "train", batch_size=4)
    msg = str(info.value)
    assert str(path) in msg and "179 bytes" in msg and "row size 6 bytes" in msg


def test_row_counts_disagree(tmp_path):
    spec, _ = dataset(tmp_path, n=30)
    path = tmp_path / "train" / "cat_2.bin"  # int32 column
    with open(path, "r+b") as f:
        f.truncate(29 * 4)
    with pytest.raises(DatasetError) as info:
        SplitBinaryReader(spec, "train", batch_size=4)
    msg = str(info.value)
    assert f"{path}: 29 rows" in msg and f"{tmp_path / 'train' / 'label.bin'}: 30 rows" in msg


def test_id_out_of_range_on_read(tmp_path):
    spec, (_, categorical, _) = dataset(tmp_path, n=30, cards=(5, 300, 70000))
    ids = categorical[:, 1].astype(np.int16)
    ids[13] = 300
    path = tmp_path / "train" / "cat_1.bin"
    ids.tofile(path)
    reader = SplitBinaryReader(spec, "train", batch_size=4)
    reader.read_batch(2)  # rows 8..11 are fine
    with pytest.raises(DatasetError) as info:
        reader.read_batch(3)
    msg = str(info.value)
    for needle in (str(path), "cat_1.bin", "id 300", "row 13", "cardinality=300", "`hash_indices=True`", "id % cardinality"):
        assert needle in msg
    unchecked = SplitBinaryReader(spec, "train", batch_size=4, check_ids=False)
    assert unchecked.read_batch(3).categorical[1, 1].item() == 300
    ids[13] = -1
    ids.tofile(path)
    with pytest.raises(DatasetError, match="id -1"):
        reader.read_batch(3)


def test_spec_dtype_too_small_for_cardinality(tmp_path):
    spec, _ = dataset(tmp_path, cards=(5, 300, 70000))
    d = yaml.safe_load((tmp_path / "feature_spec.yaml").read_text())
    d["feature_spec"]["cat_1.bin"]["dtype"] = "int8"
    (tmp_path / "feature_spec.yaml").write_text(yaml.safe_dump(d))
    with pytest.raises(FeatureSpecError) as info:
        FeatureSpec.from_yaml(str(tmp_path / "feature_spec.yaml"))
    assert "cat_1.bin" in str(info.value) and "int16" in str(info.value)


@pytest.mark.parametrize("bad, needle", [(-1, "id -1"), (300, "id 300")])
def test_writer_rejects_ids_out_of_range(tmp_path, bad, needle):
    spec = FeatureSpec.default(1, [5, 300], splits=("train",), base_directory=str(tmp_path))
    numerical, categorical, label = make_arrays(6, 1, [5, 300])
    categorical[4, 1] = bad
    with pytest.raises(DatasetError) as info:
        write_split(spec, "train", numerical, categorical, label)
    assert "cat_1.bin" in str(info.value) and needle in str(info.value)


def test_writer_rejects_bad_label_and_float16_overflow(tmp_path):
    spec = FeatureSpec.default(1, [5], splits=("train",), base_directory=str(tmp_path))
    numerical, categorical, label = make_arrays(6, 1, [5])
    with SplitBinaryWriter(spec, "train") as w:
        with pytest.raises(DatasetError, match="not 0 or 1"):
            w.write(Batch(torch.from_numpy(numerical), torch.from_numpy(categorical), torch.full((6,), 2)))
        with pytest.raises(DatasetError, match="num_0"):
            w.write(Batch(torch.full((6, 1), 1e6), torch.from_numpy(categorical), torch.from_numpy(label)))
        with pytest.raises(DatasetError, match="shape"):
            w.write(Batch(torch.zeros(6, 2), torch.from_numpy(categorical), torch.from_numpy(label)))
        w.write(Batch(torch.from_numpy(numerical).float(), torch.from_numpy(categorical).int(), torch.from_numpy(label).float()))
    assert w.num_rows == 6


def test_writer_exception_keeps_previous_files(tmp_path):
    spec, (numerical, categorical, label) = dataset(tmp_path, n=30)
    before = {p: (tmp_path / "train" / p).read_bytes() for p in os.listdir(tmp_path / "train")}
    assert len(before) == 5
    with pytest.raises(RuntimeError, match="boom"):
        with SplitBinaryWriter(spec, "train") as w:
            w.write(Batch(*(torch.from_numpy(a[:10][::-1].copy()) for a in (numerical, categorical, label))))
            raise RuntimeError("boom")
    after = {p: (tmp_path / "train" / p).read_bytes() for p in os.listdir(tmp_path / "train")}
    assert after == before  # same names (no temp files) and same bytes
    # an id error mid-way behaves the same
    categorical = categorical.copy()
    categorical[25, 0] = 99
    with pytest.raises(DatasetError):
        write_split(spec, "train", numerical, categorical, label, chunk=20)
    assert {p: (tmp_path / "train" / p).read_bytes() for p in os.listdir(tmp_path / "train")} == before


@pytest.mark.parametrize("chunk_rows", [7, 1 << 22])
def test_validate_finds_every_bad_value_before_reading_batches(tmp_path, chunk_rows):
    """``validate`` scans whole columns (in chunks) and reports what ``read_batch`` would, up front."""
    spec, (numerical, categorical, label) = dataset(tmp_path, n=50, cards=(5, 300, 70000))
    SplitBinaryReader(spec, "train", batch_size=8).validate(chunk_rows=chunk_rows)  # clean data passes

    ids = categorical[:, 2].astype(np.int32)
    ids[41] = 70000
    ids.tofile(tmp_path / "train" / "cat_2.bin")
    with pytest.raises(DatasetError, match=r"cat_2.bin: categorical feature .* has id 70000 at row 41"):
        SplitBinaryReader(spec, "train", batch_size=8).validate(chunk_rows=chunk_rows)
    SplitBinaryReader(spec, "train", batch_size=8, check_ids=False).validate(chunk_rows=chunk_rows)  # hashed ids
    SplitBinaryReader(spec, "train", batch_size=8, categorical_features=[0, 1]).validate(chunk_rows=chunk_rows)

    values = numerical.astype(np.float16)
    values[33, 2] = np.nan
    values.tofile(tmp_path / "train" / "numerical.bin")
    with pytest.raises(DatasetError, match=r"numerical.bin: numerical feature .* is nan at row 33"):
        SplitBinaryReader(spec, "train", batch_size=8, categorical_features=[]).validate(chunk_rows=chunk_rows)

    labels = label.astype(np.uint8).reshape(-1)
    labels[48] = 7
    labels.tofile(tmp_path / "train" / "label.bin")
    with pytest.raises(DatasetError, match=r"label.bin: label byte 7 at row 48 is not 0 or 1"):
        SplitBinaryReader(spec, "train", batch_size=8, read_numerical=False,
                          categorical_features=[]).validate(chunk_rows=chunk_rows)


def test_batches_of_a_validated_reader_skip_the_per_batch_checks(tmp_path, monkeypatch):
    spec, _ = dataset(tmp_path, n=30, cards=(5, 300, 70000))
    reader = SplitBinaryReader(spec, "train", batch_size=8)
    calls = []
    real = SplitBinaryReader._check_ids
    monkeypatch.setattr(SplitBinaryReader, "_check_ids", staticmethod(lambda *a: calls.append(1) or real(*a)))
    reader.read_batch(0)
    assert len(calls) == 3  # one per categorical column
    reader.validate()
    calls.clear()
    reader.read_batch(1)
    assert calls == []  # validate() already checked every id of the split
