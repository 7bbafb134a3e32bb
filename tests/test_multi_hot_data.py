"""Multi-hot (bag) categorical features: the spec, both storage layouts, per-process reads, the
loader and synthetic data. References are plain Python lists of ids per (sample, feature),
built before anything is written, and raw numpy reads of the files."""

import hashlib
import os

import numpy as np
import pytest
import scipy.sparse
import torch
import yaml
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from dlrm.data.batch import Bags, Batch
from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.loader import PrefetchLoader
from dlrm.data.rank_source import RankSource, local_batch_sizes
from dlrm.data.sources import DataConfig, load_feature_spec, make_rank_source, make_source
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.split_binary_writer import SplitBinaryWriter
from dlrm.data.hidden_model import HiddenModel
from dlrm.data.synthetic import MLPERF_DLRMV2_CARDINALITIES, MLPERF_MULTI_HOT_SIZES, SyntheticDataset, write_synthetic_dataset
from dlrm.engine.errors import DatasetError, FeatureSpecError
from test_distributed import _open_files  # what a process has open under a dataset root

# cat_0 one-hot, cat_1 fixed bags of up to 3, cat_2 variable bags, cat_3 fixed bags of one (may
# be empty), cat_4 variable bags of a wide-id table
CARDS = [5, 300, 70000, 7, 2**31 + 5]
BAGS = [None, 3, "variable", 1, "variable"]
POOLING = [None, "sum", "mean", "mean", "sum"]
MAX_LEN = {2: 6, 4: 4}  # longest variable bag written, per feature


def random_rows(n, seed=0, cards=CARDS, bags=BAGS):
    """Per sample, per feature, a list of ids: the reference every read is compared with.
    Includes empty bags, full bags and the extreme ids 0 and cardinality - 1."""
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(n):
        row = []
        for f, (card, bag) in enumerate(zip(cards, bags)):
            length = 1 if bag is None else int(rng.integers(0, (MAX_LEN[f] if bag == "variable" else bag) + 1))
            if r == 0 and bag is not None:
                length = 0  # an empty bag at the very start
            ids = [int(x) for x in rng.integers(0, card, length)]
            if r == 1 and ids:
                ids[0] = card - 1
            if r == 2 and ids:
                ids[-1] = 0
            row.append(ids)
        rows.append(row)
    return rows


def bags_from_rows(rows, features=None):
    """Bags of ``features`` (default: all) built from the reference lists, feature-major."""
    features = list(range(len(rows[0]))) if features is None else features
    values, offsets = [], [0]
    for f in features:
        for row in rows:
            values += row[f]
            offsets.append(len(values))
    return Bags(torch.tensor(values, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64), len(features))


def bags_to_lists(bags):
    """[feature][sample] -> list of ids, from a Bags (plain Python, independent of the library)."""
    b, off, val = bags.batch_size, bags.offsets.tolist(), bags.values.tolist()
    return [[val[off[f * b + i]:off[f * b + i + 1]] for i in range(b)] for f in range(bags.num_features)]


def rows_to_lists(rows, features):
    return [[row[f] for row in rows] for f in features]


def dense(n, num_numerical=2, seed=0):
    rng = np.random.default_rng(seed + 100)
    return rng.standard_normal((n, num_numerical)).astype(np.float16), rng.integers(0, 2, n).astype(bool)


def make_spec(tmp_path, bags=BAGS, pooling=POOLING, cards=CARDS, splits=("train",), num_numerical=2):
    spec = FeatureSpec.default(num_numerical, cards, splits=splits, base_directory=str(tmp_path),
                               bag_sizes=bags, pooling=pooling)
    spec.to_yaml(str(tmp_path))
    return FeatureSpec.from_yaml(str(tmp_path))


def write_rows(spec, rows, numerical, label, split="train", chunk=7):
    with SplitBinaryWriter(spec, split) as w:
        for s in range(0, len(rows), chunk):
            w.write(Batch(torch.from_numpy(numerical[s:s + chunk]), bags_from_rows(rows[s:s + chunk]),
                          torch.from_numpy(label[s:s + chunk])))
    return w


def multi_hot_dataset(tmp_path, n=40, seed=0):
    spec = make_spec(tmp_path)
    rows = random_rows(n, seed)
    numerical, label = dense(n, seed=seed)
    write_rows(spec, rows, numerical, label)
    return spec, rows, numerical, label


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("start, count", [(0, 40), (3, 9), (5, 10), (38, 2), (4, 0), (0, 1)])
def test_read_rows_match_the_written_lists(tmp_path, start, count):
    spec, rows, numerical, label = multi_hot_dataset(tmp_path, n=40)  # written in chunks of 7
    with SplitBinaryReader(spec, "train", batch_size=5) as reader:
        batch = reader.read_rows(start, count)
    bags = batch.categorical
    assert isinstance(bags, Bags) and bags.num_features == 5 and bags.batch_size == count
    assert batch.categorical_rows == count == len(batch)
    assert bags.offsets.dtype == torch.int64 and bags.offsets.shape == (5 * count + 1,)
    assert bags.values.dtype == torch.int64  # the widest selected dtype (cat_4 needs int64)
    assert bags_to_lists(bags) == rows_to_lists(rows[start:start + count], range(5))
    np.testing.assert_array_equal(batch.numerical.numpy(), numerical[start:start + count])
    np.testing.assert_array_equal(batch.label.numpy(), label[start:start + count])


def test_batches_cover_the_split_in_order(tmp_path):
    spec, rows, _, _ = multi_hot_dataset(tmp_path, n=40)
    reader = SplitBinaryReader(spec, "train", batch_size=6)  # batches cross the writer's chunks of 7
    assert len(reader) == 7 and reader.num_samples == 40
    got = [reader.read_batch(i).categorical for i in range(len(reader))]
    assert [b.batch_size for b in got] == [6] * 6 + [4]
    for i, bags in enumerate(got):
        assert bags.equals(bags_from_rows(rows[6 * i:6 * i + 6]))
    reader.validate()  # clean files pass the pre-flight scan
    assert all(reader.read_batch(i).categorical.equals(g) for i, g in enumerate(got))
    reader.close()


def test_files_hold_the_documented_layouts(tmp_path):
    """Raw files, read with numpy, against the lists: [N, L] padded with -1 on the right;
    values plus int64 offsets from 0; one-hot columns as before."""
    _spec, rows, _, _ = multi_hot_dataset(tmp_path, n=40)
    d = tmp_path / "train"
    assert sorted(os.listdir(d)) == ["cat_0.bin", "cat_1.bin", "cat_2.bin", "cat_2.offsets.bin", "cat_3.bin",
                                     "cat_4.bin", "cat_4.offsets.bin", "label.bin", "numerical.bin"]
    np.testing.assert_array_equal(np.fromfile(d / "cat_0.bin", dtype=np.int8), [r[0][0] for r in rows])
    fixed = np.fromfile(d / "cat_1.bin", dtype=np.int16).reshape(40, 3)
    np.testing.assert_array_equal(fixed, [r[1] + [-1] * (3 - len(r[1])) for r in rows])
    np.testing.assert_array_equal(np.fromfile(d / "cat_3.bin", dtype=np.int8), [r[3][0] if r[3] else -1 for r in rows])
    for f, dtype in ((2, np.int32), (4, np.int64)):
        values = np.fromfile(d / f"cat_{f}.bin", dtype=dtype)
        offsets = np.fromfile(d / f"cat_{f}.offsets.bin", dtype="<i8")
        np.testing.assert_array_equal(values, [i for r in rows for i in r[f]])
        np.testing.assert_array_equal(offsets, np.cumsum([0] + [len(r[f]) for r in rows]))
        assert os.path.getsize(d / f"cat_{f}.offsets.bin") == 41 * 8


def test_selected_features_only_and_bags_only_when_one_is_multi_hot(tmp_path):
    spec, rows, _, _ = multi_hot_dataset(tmp_path, n=23)
    with SplitBinaryReader(spec, "train", batch_size=10, categorical_features=[2, 0]) as reader:
        bags = reader.read_rows(8, 15).categorical
    assert bags.values.dtype == torch.int32  # widest of int32 (cat_2) and int8 (cat_0)
    assert bags_to_lists(bags) == rows_to_lists(rows[8:23], [2, 0])  # selection order
    with SplitBinaryReader(spec, "train", batch_size=10, categorical_features=[0]) as reader:
        ids = reader.read_rows(8, 15).categorical  # one-hot only: [B, F] as ever
    assert isinstance(ids, torch.Tensor) and ids.shape == (15, 1) and ids.dtype == torch.int8
    assert ids[:, 0].tolist() == [r[0][0] for r in rows[8:23]]
    with SplitBinaryReader(spec, "train", batch_size=10, categorical_features=[]) as reader:
        assert reader.read_batch(2).categorical.shape == (3, 0)


def test_reads_are_positional_and_per_file(tmp_path, monkeypatch):
    """A batch is one read per file: label, numerical, the one-hot and fixed-size columns, and
    offsets then values of each variable-length feature; never one read per row."""
    spec, _, _, _ = multi_hot_dataset(tmp_path, n=40)
    reader = SplitBinaryReader(spec, "train", batch_size=16)
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: calls.append(fd) or real(fd, bufs, off))
    reader.read_batch(1)
    assert len(calls) == 2 + 3 + 2 * 2 and len(set(calls)) == 9


def test_one_hot_spec_read_both_ways(tmp_path):
    """A one-hot dataset reads as [B, F]; the same files under a spec that gives every feature
    `bag_size: 1` read as the bags of one that Bags.from_one_hot makes of it."""
    cards = [5, 300, 70000]
    spec = FeatureSpec.default(2, cards, splits=("train",), base_directory=str(tmp_path))
    spec.to_yaml(str(tmp_path))
    rng = np.random.default_rng(3)
    ids = np.stack([rng.integers(0, c, 30) for c in cards], 1)
    numerical, label = dense(30)
    with SplitBinaryWriter(spec, "train") as w:
        w.write(Batch(torch.from_numpy(numerical), torch.from_numpy(ids), torch.from_numpy(label)))
    one_hot = SplitBinaryReader(FeatureSpec.from_yaml(str(tmp_path)), "train", batch_size=8).read_rows(5, 20)
    assert isinstance(one_hot.categorical, torch.Tensor) and one_hot.categorical.shape == (20, 3)
    assert one_hot.categorical.tolist() == ids[5:25].tolist()

    d = yaml.safe_load((tmp_path / "feature_spec.yaml").read_text())
    for name in d["channel_spec"]["categorical"]:
        d["feature_spec"][name].update(bag_size=1, pooling="sum")
    (tmp_path / "feature_spec.yaml").write_text(yaml.safe_dump(d))
    as_bags = SplitBinaryReader(FeatureSpec.from_yaml(str(tmp_path)), "train", batch_size=8).read_rows(5, 20)
    assert as_bags.categorical.equals(Bags.from_one_hot(one_hot.categorical))
    assert bags_to_lists(as_bags.categorical) == [[[int(i)] for i in ids[5:25, f]] for f in range(3)]

    # bag_size 1 on one feature only: every selected feature comes as bags
    d["feature_spec"]["cat_0.bin"] = {"dtype": "int8", "cardinality": 5}
    d["feature_spec"]["cat_2.bin"] = {"dtype": "int32", "cardinality": 70000}
    (tmp_path / "feature_spec.yaml").write_text(yaml.safe_dump(d))
    mixed = SplitBinaryReader(FeatureSpec.from_yaml(str(tmp_path)), "train", batch_size=8).read_rows(5, 20)
    assert mixed.categorical.equals(Bags.from_one_hot(one_hot.categorical))


def test_writer_takes_one_id_per_feature_for_a_multi_hot_spec(tmp_path):
    spec = make_spec(tmp_path, bags=[None, 2, "variable"], pooling="sum", cards=[5, 300, 70000])
    ids = np.array([[1, 2, 3], [4, 299, 69999], [0, 0, 0]])
    numerical, label = dense(3)
    with SplitBinaryWriter(spec, "train") as w:
        w.write(Batch(torch.from_numpy(numerical), torch.from_numpy(ids), torch.from_numpy(label)))
    got = SplitBinaryReader(spec, "train", batch_size=3).read_batch(0).categorical
    assert bags_to_lists(got) == [[[int(i)] for i in ids[:, f]] for f in range(3)]
    np.testing.assert_array_equal(np.fromfile(tmp_path / "train" / "cat_1.bin", np.int16).reshape(3, 2),
                                  [[2, -1], [299, -1], [0, -1]])


def test_padding_anywhere_in_a_fixed_row_is_dropped(tmp_path):
    """Files from other tools may pad on the left or in the middle; ids keep their order."""
    spec, _rows, _, _ = multi_hot_dataset(tmp_path, n=6)
    block = np.array([[-1, 7, -1], [5, -1, 6], [-1, -1, -1], [1, 2, 3], [-1, -1, 299], [0, -1, -1]], dtype=np.int16)
    block.tofile(tmp_path / "train" / "cat_1.bin")
    reader = SplitBinaryReader(spec, "train", batch_size=6)
    reader.validate()
    got = bags_to_lists(reader.read_batch(0).categorical)[1]
    assert got == [[7], [5, 6], [], [1, 2, 3], [299], [0]]


# ---------------------------------------------------------------------------- the spec


def test_spec_exposes_bags_and_pooling_for_the_model(tmp_path):
    spec = make_spec(tmp_path)
    assert spec.multi_hot_features == ["cat_1.bin", "cat_2.bin", "cat_3.bin", "cat_4.bin"]
    assert [spec.is_multi_hot(i) for i in range(5)] == [False, True, True, True, True]
    assert [spec.bag_size(n) for n in spec.categorical_names] == [None, 3, "variable", 1, "variable"]
    assert spec.poolings == [None, "sum", "mean", "mean", "sum"]
    assert spec.pooling("cat_2.bin") == spec.pooling(2) == "mean"
    assert spec.paths("train").offsets == {2: str(tmp_path / "train" / "cat_2.offsets.bin"),
                                          4: str(tmp_path / "train" / "cat_4.offsets.bin")}
    raw = yaml.safe_load((tmp_path / "feature_spec.yaml").read_text())
    assert raw["feature_spec"]["cat_1.bin"] == {"dtype": "int16", "cardinality": 300, "bag_size": 3, "pooling": "sum"}
    assert raw["source_spec"]["train"][-1]["files"] == ["train/cat_4.bin", "train/cat_4.offsets.bin"]
    with pytest.raises(KeyError, match="num_0"):
        spec.pooling("num_0")
    with pytest.raises(IndexError):
        spec.is_multi_hot(5)


def test_one_hot_specs_have_no_multi_hot_features(tmp_path):
    spec = FeatureSpec.default(2, [5, 300], splits=("train",), base_directory=str(tmp_path))
    assert spec.multi_hot_features == [] and spec.poolings == [None, None]
    assert spec.paths("train").offsets == {}
    assert "bag_size" not in str(spec.to_dict()) and "pooling" not in str(spec.to_dict())


def _multi_hot_dict():
    return FeatureSpec.default(1, [10, 300, 70000], splits=("train",), bag_sizes=[None, 3, "variable"],
                               pooling="mean").to_dict()


def _set(path, value):
    def mutate(d):
        *keys, last = path
        for k in keys:
            d = d[k]
        if value is _DELETE:
            del d[last]
        else:
            d[last] = value
    return mutate


_DELETE = object()
FS = "feature_spec"
BROKEN_MULTI_HOT = {
    "another tool's key": (_set([FS, "cat_1.bin", "max_hotness"], 3), ["cat_1.bin", "max_hotness", "`bag_size`"]),
    "misspelt bag_size": (_set([FS, "cat_0.bin", "bagsize"], 3), ["cat_0.bin", "bagsize", "`bag_size`"]),
    "misspelt pooling": (_set([FS, "cat_1.bin", "poolling"], "sum"), ["cat_1.bin", "poolling", "`pooling`"]),
    "no pooling": (_set([FS, "cat_1.bin", "pooling"], _DELETE), ["cat_1.bin", "no `pooling`", "'sum', 'mean'"]),
    "unknown pooling": (_set([FS, "cat_2.bin", "pooling"], "max"), ["cat_2.bin", "'max'", "'sum', 'mean'"]),
    "pooling without bag_size": (_set([FS, "cat_0.bin", "pooling"], "sum"), ["cat_0.bin", "no `bag_size`", "remove `pooling`"]),
    "bag_size 0": (_set([FS, "cat_1.bin", "bag_size"], 0), ["cat_1.bin", "integer >= 1", "'variable'", "got 0"]),
    "bag_size -1": (_set([FS, "cat_1.bin", "bag_size"], -1), ["cat_1.bin", "got -1"]),
    "bag_size as text": (_set([FS, "cat_1.bin", "bag_size"], "3"), ["cat_1.bin", "got '3'"]),
    "bag_size true": (_set([FS, "cat_1.bin", "bag_size"], True), ["cat_1.bin", "got True"]),
    "bag_size 2.5": (_set([FS, "cat_1.bin", "bag_size"], 2.5), ["cat_1.bin", "got 2.5"]),
    "bag_size empty": (_set([FS, "cat_1.bin", "bag_size"], None), ["cat_1.bin", "`bag_size` is empty"]),
    "bag_size on a numerical feature": (_set([FS, "num_0", "bag_size"], 2), ["numerical feature 'num_0'", "categorical features only"]),
    "pooling on the label": (_set([FS, "label", "pooling"], "sum"), ["label feature 'label'", "categorical features only"]),
    "variable without offsets file": (
        _set(["source_spec", "train", 4, "files"], ["train/cat_2.bin"]),
        ["cat_2.bin", "two paths", "values file then the offsets file", "train/cat_2.offsets.bin"],
    ),
    "offsets file for a fixed feature": (
        _set(["source_spec", "train", 3, "files"], ["train/cat_1.bin", "train/cat_1.offsets.bin"]),
        ["cat_1.bin", "exactly one path", "only `bag_size: variable`"],
    ),
    "offsets file same as values": (
        _set(["source_spec", "train", 4, "files"], ["train/cat_2.bin", "train/cat_2.bin"]),
        ["cat_2.bin", "must differ"],
    ),
    "offsets file shared with another chunk": (
        _set(["source_spec", "train", 4, "files"], ["train/cat_2.bin", "train/cat_1.bin"]),
        ["train/cat_1.bin", "used by two chunks"],
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN_MULTI_HOT))
def test_inconsistent_multi_hot_spec_names_the_feature_and_the_fix(tmp_path, case):
    mutate, needles = BROKEN_MULTI_HOT[case]
    d = _multi_hot_dict()
    assert d["source_spec"]["train"][3]["features"] == ["cat_1.bin"]  # the indices the cases use
    assert d["source_spec"]["train"][4]["features"] == ["cat_2.bin"]
    mutate(d)
    path = tmp_path / "feature_spec.yaml"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(FeatureSpecError) as info:
        FeatureSpec.from_yaml(str(path))
    msg = str(info.value)
    assert str(path) in msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_harmless_unknown_keys_still_load(tmp_path):
    """Only multi-hot-looking keys are refused: other extra keys load as before."""
    d = _multi_hot_dict()
    d[FS]["cat_0.bin"]["description"] = "country"
    (tmp_path / "feature_spec.yaml").write_text(yaml.safe_dump(d))
    assert FeatureSpec.from_yaml(str(tmp_path)).multi_hot_features == ["cat_1.bin", "cat_2.bin"]


# ---------------------------------------------------------------------------- bad files


def _truncate(path, size):
    with open(path, "r+b") as f:
        f.truncate(size)


def _offsets_path(tmp_path, f=2):
    return tmp_path / "train" / f"cat_{f}.offsets.bin"


BAD_FILES = {
    # name: (damage(tmp_path, rows), needles)
    "fixed file truncated": (
        lambda p, rows: _truncate(p / "train" / "cat_1.bin", 40 * 3 * 2 - 2),
        ["cat_1.bin", "not a multiple of the row size 6 bytes", "3 value(s) per row", "`bag_size` (3)"],
    ),
    "fixed file one row short": (
        lambda p, rows: _truncate(p / "train" / "cat_1.bin", 39 * 3 * 2),
        ["disagree on the number of rows", "cat_1.bin: 39 rows", "label.bin: 40 rows"],
    ),
    "offsets truncated mid-value": (
        lambda p, rows: _truncate(_offsets_path(p), 41 * 8 - 3),
        ["cat_2.offsets.bin", "not a multiple of the row size 8 bytes", "offsets"],
    ),
    "offsets file empty": (lambda p, rows: _truncate(_offsets_path(p), 0), ["cat_2.offsets.bin", "is empty", "rows + 1"]),
    "offsets one row short": (
        lambda p, rows: np.cumsum([0] + [len(r[2]) for r in rows[:39]]).astype("<i8").tofile(_offsets_path(p))
        or _truncate(p / "train" / "cat_2.bin", 4 * sum(len(r[2]) for r in rows[:39])),
        ["disagree on the number of rows", "cat_2.offsets.bin: 39 rows", "label.bin: 40 rows"],
    ),
    "offsets not from 0": (
        lambda p, rows: (np.cumsum([0] + [len(r[2]) for r in rows]) + 1).astype("<i8").tofile(_offsets_path(p)),
        ["cat_2.offsets.bin", "start at 1, not 0"],
    ),
    "values file truncated": (
        lambda p, rows: _truncate(p / "train" / "cat_2.bin", 4 * (sum(len(r[2]) for r in rows) - 1)),
        ["cat_2.offsets.bin", "end at", "values file", "cat_2.bin holds", "do not belong together"],
    ),
    "values file torn": (
        lambda p, rows: _truncate(p / "train" / "cat_2.bin", 4 * sum(len(r[2]) for r in rows) - 1),
        ["cat_2.bin", "not a multiple of the row size 4 bytes"],
    ),
    "offsets file missing": (lambda p, rows: os.unlink(_offsets_path(p)), ["cat_2.offsets.bin", "missing"]),
    "values file missing": (lambda p, rows: os.unlink(p / "train" / "cat_4.bin"), ["cat_4.bin", "missing"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_files_fail_when_the_reader_opens_them(tmp_path, case):
    spec, rows, _, _ = multi_hot_dataset(tmp_path, n=40)
    damage, needles = BAD_FILES[case]
    damage(tmp_path, rows)
    with pytest.raises(DatasetError) as info:
        SplitBinaryReader(spec, "train", batch_size=8)
    msg = str(info.value)
    for needle in needles:
        assert needle in msg, (needle, msg)
    # a process that does not read the damaged feature does not care
    SplitBinaryReader(spec, "train", batch_size=8, categorical_features=[0]).close()


def _write_offsets_with_a_decrease(tmp_path, rows, at):
    offsets = np.cumsum([0] + [len(r[2]) for r in rows]).astype("<i8")
    offsets[at] = offsets[at + 1] + 1  # rows at-1 and at now disagree; first and last still fine
    offsets.tofile(_offsets_path(tmp_path))
    return offsets


@pytest.mark.parametrize("chunk_rows", [3, 1 << 22])
def test_validate_finds_decreasing_offsets(tmp_path, chunk_rows):
    spec, rows, _, _ = multi_hot_dataset(tmp_path, n=40)
    _write_offsets_with_a_decrease(tmp_path, rows, 21)
    reader = SplitBinaryReader(spec, "train", batch_size=8)  # first and last offsets are fine
    with pytest.raises(DatasetError, match=r"cat_2.offsets.bin: offsets of feature 'cat_2.bin' decrease after row 21"):
        reader.validate(chunk_rows=chunk_rows)
    assert not reader.validated
    SplitBinaryReader(spec, "train", batch_size=8, categorical_features=[0, 1, 3]).validate(chunk_rows=chunk_rows)


def test_reading_decreasing_or_overlong_offsets_fails_at_their_batch(tmp_path):
    spec, rows, _, _ = multi_hot_dataset(tmp_path, n=40)
    _write_offsets_with_a_decrease(tmp_path, rows, 21)
    for check_ids in (True, False):  # offsets are structure: checked even when ids are hashed
        reader = SplitBinaryReader(spec, "train", batch_size=8, check_ids=check_ids)
        reader.read_batch(0)
        reader.read_batch(3)  # rows 24..31 are fine
        with pytest.raises(DatasetError, match=r"cat_2.offsets.bin: .*decrease after row 21"):
            reader.read_batch(2)
    offsets = np.cumsum([0] + [len(r[2]) for r in rows]).astype("<i8")
    offsets[16] = offsets[-1] + 50  # past the end of the values file, at the end of batch 1
    offsets.tofile(_offsets_path(tmp_path))
    reader = SplitBinaryReader(spec, "train", batch_size=8, check_ids=False)
    with pytest.raises(DatasetError, match=r"cat_2.offsets.bin: offsets .* rows 8..16 run from .* outside the \d+ ids"):
        reader.read_batch(1)


def _put_id(tmp_path, rows, feature, row, value):
    """Rewrite feature's files with ``value`` as the first id of ``row``'s bag."""
    f = feature
    d = tmp_path / "train"
    if f == 1:
        block = np.array([r[1] + [-1] * (3 - len(r[1])) for r in rows], dtype=np.int16)
        block[row, 0] = value
        block.tofile(d / "cat_1.bin")
    else:
        values = np.array([i for r in rows for i in r[2]], dtype=np.int32)
        values[sum(len(r[2]) for r in rows[:row])] = value
        values.tofile(d / "cat_2.bin")


BAD_IDS = [(1, 300, "id 300", True), (1, -2, "id -2", True), (2, 70000, "id 70000", False), (2, -1, "id -1", False)]


@pytest.mark.parametrize("feature, value, needle, padded", BAD_IDS)
@pytest.mark.parametrize("chunk_rows", [5, 1 << 22])
def test_validate_finds_ids_out_of_range(tmp_path, feature, value, needle, padded, chunk_rows):
    spec, rows, _, _ = multi_hot_dataset(tmp_path, n=40)
    row = next(r for r in range(27, 40) if rows[r][feature])
    _put_id(tmp_path, rows, feature, row, value)
    with pytest.raises(DatasetError) as info:
        SplitBinaryReader(spec, "train", batch_size=8).validate(chunk_rows=chunk_rows)
    msg = str(info.value)
    for part in (f"cat_{feature}.bin", needle, f"at row {row}", "`hash_indices=True`"):
        assert part in msg, (part, msg)
    assert ("besides the padding id -1" in msg) == padded
    SplitBinaryReader(spec, "train", batch_size=8, check_ids=False).validate(chunk_rows=chunk_rows)


@pytest.mark.parametrize("feature, value, needle, padded", BAD_IDS)
def test_reading_ids_out_of_range_fails_at_their_batch(tmp_path, feature, value, needle, padded):
    spec, rows, _, _ = multi_hot_dataset(tmp_path, n=40)
    row = next(r for r in range(27, 40) if rows[r][feature])
    _put_id(tmp_path, rows, feature, row, value)
    reader = SplitBinaryReader(spec, "train", batch_size=8)
    reader.read_batch(0)
    with pytest.raises(DatasetError, match=rf"cat_{feature}.bin: categorical feature .* has {needle} at row {row},"):
        reader.read_batch(row // 8)
    unchecked = SplitBinaryReader(spec, "train", batch_size=8, check_ids=False)  # hashed ids pass through
    bags = bags_to_lists(unchecked.read_batch(row // 8).categorical)[feature]
    assert bags[row % 8][0] == value


def test_validated_reader_skips_per_batch_checks(tmp_path):
    """After validate() the per-batch id checks are off (validate read every value)."""
    spec, rows, _, _ = multi_hot_dataset(tmp_path, n=40)
    reader = SplitBinaryReader(spec, "train", batch_size=8)
    reader.validate()
    row = next(r for r in range(8, 16) if rows[r][2])
    _put_id(tmp_path, rows, 2, row, 70000)  # changed after the scan, on purpose
    assert bags_to_lists(reader.read_batch(1).categorical)[2][row - 8][0] == 70000
    with pytest.raises(DatasetError, match="id 70000"):
        SplitBinaryReader(spec, "train", batch_size=8).read_batch(1)


# ---------------------------------------------------------------------------- writer errors


def _one_batch(rows):
    numerical, label = dense(len(rows))
    return torch.from_numpy(numerical), torch.from_numpy(label)


WRITER_ERRORS = {
    "two ids for a one-hot feature": (lambda rows: rows[3][0].append(1), ["cat_0.bin", "one-hot", "row 3", "bag of 2"]),
    "too many ids for a fixed bag": (lambda rows: rows[4][1].extend([1, 2, 3, 4]), ["cat_1.bin", "`bag_size: 3`", "row 4"]),
    "no id for a one-hot feature": (lambda rows: rows[2][0].clear(), ["cat_0.bin", "bag of 0"]),
    "id at the cardinality": (lambda rows: rows[5][2].append(70000), ["cat_2.bin", "id 70000", "[0, 70000)"]),
    "negative id": (lambda rows: rows[5][2].insert(0, -1), ["cat_2.bin", "id -1", "[0, 70000)"]),
}


@pytest.mark.parametrize("case", sorted(WRITER_ERRORS))
def test_writer_refuses_bags_the_spec_cannot_hold(tmp_path, case):
    spec = make_spec(tmp_path)
    rows = random_rows(8)
    mutate, needles = WRITER_ERRORS[case]
    mutate(rows)
    numerical, label = _one_batch(rows)
    with pytest.raises(DatasetError) as info:
        with SplitBinaryWriter(spec, "train") as w:
            w.write(Batch(numerical, bags_from_rows(rows), label))
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert not (tmp_path / "train").exists() or os.listdir(tmp_path / "train") == []


def test_writer_refuses_inconsistent_bags(tmp_path):
    spec = make_spec(tmp_path)
    rows = random_rows(6)
    numerical, label = _one_batch(rows)
    good = bags_from_rows(rows)
    with SplitBinaryWriter(spec, "train") as w:
        with pytest.raises(DatasetError, match="bags of 4 features for 6 samples, expected 5 features for 6"):
            w.write(Batch(numerical, bags_from_rows(rows, [0, 1, 2, 3]), label))
        with pytest.raises(DatasetError, match="expected 5 features for 5 samples"):
            w.write(Batch(numerical[:5], good, label[:5]))
        decreasing = good.offsets.clone()
        decreasing[7] = decreasing[8] + 1
        with pytest.raises(DatasetError, match="non-decreasing"):
            w.write(Batch(numerical, Bags(good.values, decreasing, 5), label))
        with pytest.raises(DatasetError, match="non-decreasing"):
            w.write(Batch(numerical, Bags(good.values[:-1], good.offsets, 5), label))
        w.write(Batch(numerical, good, label))
    assert w.num_rows == 6


def test_failed_write_keeps_the_previous_dataset(tmp_path):
    spec, rows, numerical, label = multi_hot_dataset(tmp_path, n=40)
    before = {p: (tmp_path / "train" / p).read_bytes() for p in os.listdir(tmp_path / "train")}
    assert len(before) == 9
    bad = random_rows(20, seed=5)
    bad[15][1] = [1, 2, 3, 4]  # the second batch fails, after the first was written
    with pytest.raises(DatasetError):
        write_rows(spec, bad, *dense(20), chunk=10)
    with pytest.raises(RuntimeError, match="boom"):
        with SplitBinaryWriter(spec, "train") as w:
            w.write(Batch(torch.from_numpy(numerical[:5]), bags_from_rows(rows[:5]), torch.from_numpy(label[:5])))
            raise RuntimeError("boom")
    after = {p: (tmp_path / "train" / p).read_bytes() for p in os.listdir(tmp_path / "train")}
    assert after == before  # same names (no temporaries left) and same bytes, offsets included


def test_empty_split_has_a_lone_zero_offset(tmp_path):
    spec = make_spec(tmp_path)
    with SplitBinaryWriter(spec, "train"):
        pass
    assert np.fromfile(_offsets_path(tmp_path), dtype="<i8").tolist() == [0]
    reader = SplitBinaryReader(spec, "train", batch_size=4)
    assert reader.num_samples == 0 and len(reader) == 0
    reader.validate()


# ---------------------------------------------------------------------------- per process


def _files_of(tables):
    names = []
    for t in tables:
        names.append(f"train/cat_{t}.bin")
        if BAGS[t] == "variable":
            names.append(f"train/cat_{t}.offsets.bin")
    return names


@pytest.mark.parametrize("world, plan", [(1, [[0, 1, 2, 3, 4]]), (3, [[2, 0], [4], [1, 3]]), (4, [[1], [], [0], [2, 3, 4]])])
def test_rank_source_reads_own_tables_bags_for_the_global_batch(tmp_path, world, plan):
    spec, rows, numerical, label = multi_hot_dataset(tmp_path, n=40)
    cfg = DataConfig(dataset=str(tmp_path))
    root = str(tmp_path)
    assert _open_files(root) == []
    for rank in range(world):
        source = make_rank_source(cfg, spec, "train", 11, torch.device("cpu"), plan[rank], rank, world)
        assert _open_files(root) == sorted(_files_of(plan[rank]) + ["train/label.bin", "train/numerical.bin"])
        for i in range(len(source)):
            batch = source.read_batch(i)
            start, count = 11 * i, min(11, 40 - 11 * i)
            sizes = local_batch_sizes(count, world)
            own = slice(start + sum(sizes[:rank]), start + sum(sizes[:rank + 1]))
            if any(BAGS[t] is not None for t in plan[rank]):
                assert batch.categorical_rows == count
                assert bags_to_lists(batch.categorical) == rows_to_lists(rows[start:start + count], plan[rank])
            else:  # no multi-hot table of its own: [B, F] as before
                assert batch.categorical.shape == (count, len(plan[rank]))
                assert batch.categorical.tolist() == [[r[t][0] for t in plan[rank]] for r in rows[start:start + count]]
            np.testing.assert_array_equal(batch.numerical.numpy(), numerical[own])
            np.testing.assert_array_equal(batch.label.numpy(), label[own])
        source.close()
        assert _open_files(root) == []


def test_rank_source_slices_generated_bags():
    sizes, bag_sizes = [7, 50, 3, 1000], [2, 1, 5, 3]
    whole = SyntheticDataset(3, sizes, 100, 45, seed=4, bag_sizes=bag_sizes)
    for world, plan in ((2, [[3, 1], [0, 2]]), (3, [[], [2], [0, 1, 3]])):
        for rank in range(world):
            source = RankSource(lambda *a: SyntheticDataset(3, sizes, 100, 45, seed=4, bag_sizes=bag_sizes),
                                plan[rank], rank, world)
            for i in range(len(source)):
                full, mine = whole.read_batch(i), source.read_batch(i)
                b = len(full)
                lists = bags_to_lists(full.categorical)
                if plan[rank]:
                    assert bags_to_lists(mine.categorical) == [lists[t] for t in plan[rank]]
                else:
                    assert isinstance(mine.categorical, torch.Tensor) and mine.categorical.shape == (b, 0)
                local = local_batch_sizes(b, world)
                rows = slice(sum(local[:rank]), sum(local[:rank + 1]))
                assert torch.equal(mine.numerical, full.numerical[rows]) and torch.equal(mine.label, full.label[rows])


def test_bags_select_and_equals():
    rows = random_rows(9, seed=2)
    bags = bags_from_rows(rows)
    for features in ([4, 0, 2], [1], [3, 3], []):
        assert bags_to_lists(bags.select(features)) == rows_to_lists(rows, features)
        assert bags.select(features).batch_size == (9 if features else 0)
    assert bags.equals(Bags(bags.values.int(), bags.offsets, 5))  # storage dtypes may differ
    other = bags_from_rows(random_rows(9, seed=3))
    assert not bags.equals(other)
    assert not bags.equals(bags.select([0, 1, 2, 3]))


# ---------------------------------------------------------------------------- the loader


class BagSource:
    def __init__(self, rows, batch):
        self.rows, self.batch = rows, batch

    def __len__(self):
        return -(-len(self.rows) // self.batch)

    def read_batch(self, i):
        part = self.rows[i * self.batch:(i + 1) * self.batch]
        return Batch(torch.full((len(part), 2), float(i)), bags_from_rows(part), torch.zeros(len(part), dtype=torch.bool))


def test_loader_yields_bags_in_order():
    rows = random_rows(23, seed=7)
    order = [2, 0, 1]
    got = list(PrefetchLoader(BagSource(rows, 10), order, "cpu", prefetch=2))
    assert [int(b.numerical[0, 0]) for b in got] == order
    for i, b in zip(order, got):
        assert bags_to_lists(b.categorical) == rows_to_lists(rows[10 * i:10 * i + 10], range(5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loader_pins_and_copies_bags_to_the_gpu():
    rows = random_rows(23, seed=7)
    order = [1, 2, 0]
    got = list(PrefetchLoader(BagSource(rows, 10), order, "cuda", prefetch=2))
    for i, b in zip(order, got):
        assert b.categorical.values.is_cuda and b.categorical.offsets.is_cuda and b.numerical.is_cuda
        assert bags_to_lists(b.categorical.to("cpu")) == rows_to_lists(rows[10 * i:10 * i + 10], range(5))


# ---------------------------------------------------------------------------- synthetic


SIZES = [3, 10, 50, 200, 1000, 100_000]
BAG_SIZES = [2, 1, 4, 3, 1, 6]


def test_synthetic_bags_have_the_configured_sizes_and_ranges():
    ds = SyntheticDataset(4, SIZES, 1000, 300, seed=1, bag_sizes=BAG_SIZES, pooling="mean")
    sizes = [len(ds.read_batch(i)) for i in range(len(ds))]
    assert sizes == [300, 300, 300, 100]
    b = ds.read_batch(3)
    assert isinstance(b.categorical, Bags) and b.categorical_rows == 100
    assert b.categorical.values.dtype == torch.int32 and b.categorical.offsets.dtype == torch.int64
    lists = bags_to_lists(b.categorical)
    for t, (size, card) in enumerate(zip(BAG_SIZES, SIZES)):
        assert all(len(bag) == size for bag in lists[t])
        assert all(0 <= i < card for bag in lists[t] for i in bag)
    assert b.numerical.shape == (100, 4) and b.label.shape == (100,)
    big = SyntheticDataset(1, [2**40], 64, 64, bag_sizes=[3]).read_batch(0).categorical
    assert big.values.dtype == torch.int64 and big.values.max() < 2**40 and (big.values >= 2**32).any()


def test_synthetic_bags_are_deterministic_per_seed_split_and_index():
    def ds(seed=1, split="train"):
        return SyntheticDataset(4, SIZES, 900, 300, seed=seed, split=split, bag_sizes=BAG_SIZES)

    a, b = ds(), ds()
    batches = [a.read_batch(i) for i in range(3)]
    for i in (2, 0, 1):  # any order, another instance
        other = b.read_batch(i)
        assert batches[i].categorical.equals(other.categorical)
        assert torch.equal(batches[i].numerical, other.numerical) and torch.equal(batches[i].label, other.label)
    for other in (a.read_batch(1), ds(split="test").read_batch(0), ds(seed=2).read_batch(0)):
        assert not batches[0].categorical.equals(other.categorical)
        assert not torch.equal(batches[0].label, other.label)


# Digests of one-hot synthetic batches computed with the code before multi-hot data existed
# (commit c04d36d): one-hot data must not change, bit for bit.
ONE_HOT_REFERENCE = {
    "sizes6": ((13, [3, 10, 50, 200, 1000, 100_000], 10_000, 4096, 1, "train"), [
        ("125bf0b18c43049d", "29ca2192d730925f", "dbf7d359a1b3d772"),
        ("047d969e3b3e6e75", "92b56c83d235699c", "6dee1bde16faaa55"),
        ("3329428487d2e7fc", "11dabc4b4cf6142b", "478a59b1d099f145")]),
    "no_numerical": ((0, [10, 20], 100, 64, 12345, "validation"), [
        ("e3b0c44298fc1c14", "3a06e1990f33015c", "2b6246ea03318f79"),
        ("e3b0c44298fc1c14", "d44689bafb1267a9", "865c00f90e5b69cf")]),
    "int64_ids": ((2, [2**40, 5], 3000, 2048, 7, "train"), [
        ("b5131c51d16eb044", "ec9cc795f327dfe7", "23767b706061e94c"),
        ("6b542ea3fa19e7b0", "a7fb3be3527e38dc", "b09eafbc76a2ba13")]),
}
ONE_HOT_FILES = {
    "feature_spec.yaml": "3552cafaa850191a", "test/cat_0.bin": "267379ced36eddeb",
    "test/cat_1.bin": "80e86fa30dde23a2", "test/cat_2.bin": "7f1e4add3f253eae",
    "test/label.bin": "802aaad47482b136", "test/numerical.bin": "f0c3dfd20f4edb9d",
    "train/cat_0.bin": "fb6875a8b3226648", "train/cat_1.bin": "14e34bb7a03447a3",
    "train/cat_2.bin": "294ef6646375636c", "train/label.bin": "1fd8f3f9d3090817",
    "train/numerical.bin": "72cbd080697d39f8",
}


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


@pytest.mark.parametrize("case", sorted(ONE_HOT_REFERENCE))
def test_one_hot_synthetic_batches_are_unchanged(case):
    (num, sizes, rows, batch, seed, split), expected = ONE_HOT_REFERENCE[case]
    ds = SyntheticDataset(num, sizes, rows, batch, seed=seed, split=split)
    got = []
    for i in range(len(ds)):
        b = ds.read_batch(i)
        assert isinstance(b.categorical, torch.Tensor)
        got.append(tuple(_digest(t.contiguous().numpy().tobytes()) for t in (b.numerical, b.categorical, b.label)))
    assert got == expected


def test_one_hot_synthetic_dataset_files_are_unchanged(tmp_path):
    write_synthetic_dataset(str(tmp_path / "ds"), 3, [4, 300, 70000], {"train": 3000, "test": 1000}, batch_size=1024, seed=9)
    got = {}
    for root, _, names in os.walk(tmp_path / "ds"):
        for name in names:
            path = os.path.join(root, name)
            got[os.path.relpath(path, tmp_path / "ds")] = _digest(open(path, "rb").read())
    assert got == ONE_HOT_FILES


def test_bags_of_one_give_the_one_hot_logit():
    ds = SyntheticDataset(13, SIZES, 2000, 2000, seed=3)
    b = ds.read_batch(0)
    one_hot = ds.logits(b)
    as_bags = ds.hidden_model.logit(b.numerical, Bags.from_one_hot(b.categorical))
    torch.testing.assert_close(as_bags, one_hot, rtol=1e-5, atol=1e-5)
    assert one_hot.std() > 0.5  # a logit with signal, so the comparison means something


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_every_id_of_a_bag_moves_the_logit(pooling):
    """Replacing any one id of any table's bag changes the logit, and the change depends on
    that id alone (pooling is over the whole bag, not its first id)."""
    sizes, bag_sizes = [1000] * 5, [3, 1, 4, 2, 5]
    model = HiddenModel(2, sizes, seed=3, bag_sizes=bag_sizes, pooling=pooling)
    ds = SyntheticDataset(2, sizes, 256, 256, seed=3, bag_sizes=bag_sizes, pooling=pooling)
    b = ds.read_batch(0)
    base = model.logit(b.numerical, b.categorical)
    offsets = b.categorical.offsets
    for t, size in enumerate(bag_sizes):
        for k in range(size):
            values = b.categorical.values.clone()
            where = offsets[t * 256:(t + 1) * 256] + k  # the k-th id of every bag of table t
            values[where] = (values[where].long() + 1 + torch.arange(256) % 997).int() % 1000
            moved = model.logit(b.numerical, Bags(values, offsets, 5)) - base
            assert (moved.abs() > 1e-6).float().mean() > 0.9, (t, k)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_uneven_bags_pool_like_even_ones(pooling):
    """Bags read back from disk may have any lengths. A sample's logit depends on its own bags
    only, whether the batch's bags all have the table's size or not; and a mean-pooled bag of
    copies of one id scores as a bag of that id alone."""
    sizes, bag_sizes = [1000] * 4, [3, 2, 1, 4]
    model = HiddenModel(2, sizes, seed=6, bag_sizes=bag_sizes, pooling=pooling)
    b = SyntheticDataset(2, sizes, 64, 64, seed=6, bag_sizes=bag_sizes, pooling=pooling).read_batch(0)
    rows = [[lists[i] for lists in bags_to_lists(b.categorical)] for i in range(64)]
    even = model.logit(b.numerical, bags_from_rows(rows))
    uneven_rows = [list(map(list, r)) for r in rows]
    uneven_rows[0][0] = uneven_rows[0][0][:1]  # sample 0: shorter bags of tables 0 and 3
    uneven_rows[0][3] = []
    uneven = model.logit(b.numerical, bags_from_rows(uneven_rows))
    torch.testing.assert_close(uneven[1:], even[1:], rtol=1e-5, atol=1e-5)
    assert abs(uneven[0] - even[0]) > 1e-4
    if pooling == "mean":
        copies = [[[r[t][0]] * (1 + (i + t) % bag_sizes[t]) for t in range(4)] for i, r in enumerate(rows)]
        full = [[[r[t][0]] * bag_sizes[t] for t in range(4)] for r in rows]
        torch.testing.assert_close(model.logit(b.numerical, bags_from_rows(copies)),
                                   model.logit(b.numerical, bags_from_rows(full)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_mlperf_sized_bags_keep_the_calibration(pooling):
    """With MLPerf DLRMv2's bag sizes, the hidden model's scores still rank the labels well
    (AUC about 0.8) at a click-like positive rate."""
    assert len(MLPERF_MULTI_HOT_SIZES) == len(MLPERF_DLRMV2_CARDINALITIES) == 26
    ds = SyntheticDataset(13, [100_000] * 26, 16384, 16384, seed=12345, split="test",
                          bag_sizes=MLPERF_MULTI_HOT_SIZES, pooling=pooling)
    b = ds.read_batch(0)
    assert b.categorical.values.shape == (16384 * sum(MLPERF_MULTI_HOT_SIZES),)
    y = b.label.numpy()
    assert 0.27 <= y.mean() <= 0.33
    assert 0.76 < roc_auc_score(y, ds.logits(b).numpy()) < 0.85


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_multi_hot_signal_is_learnable_from_pooled_ids(pooling):
    """A logistic regression on numerical features and bag-of-ids counts (what a sum-pooled
    embedding bag sees), fitted on 'train', scores well above chance on 'test', and the ids
    add clearly to the numerical features."""
    sizes, bag_sizes = [3, 10, 30, 100, 200], [1, 3, 2, 5, 4]

    def features(split, n):
        b = SyntheticDataset(13, sizes, n, n, seed=5, split=split, bag_sizes=bag_sizes, pooling=pooling).read_batch(0)
        bags = b.categorical
        columns = []
        for t, size in enumerate(sizes):
            lo, hi = bags.offsets[t * n].item(), bags.offsets[(t + 1) * n].item()
            lengths = (bags.offsets[t * n + 1:(t + 1) * n + 1] - bags.offsets[t * n:(t + 1) * n]).numpy()
            rows = np.repeat(np.arange(n), lengths)
            columns.append(scipy.sparse.csr_matrix((np.ones(hi - lo), (rows, bags.values[lo:hi].numpy())), shape=(n, size)))
        return b.numerical.float().numpy(), scipy.sparse.hstack(columns).tocsr(), b.label.numpy()

    x_train, c_train, y_train = features("train", 30_000)
    x_test, c_test, y_test = features("test", 15_000)
    mean, std = x_train.mean(0), x_train.std(0)

    def design(x, c, with_ids):
        x = (x - mean) / std
        return scipy.sparse.hstack([x, c]).tocsr() if with_ids else x

    aucs = {}
    for with_ids in (False, True):
        model = LogisticRegression(C=0.1, max_iter=1000).fit(design(x_train, c_train, with_ids), y_train)
        aucs[with_ids] = roc_auc_score(y_test, model.decision_function(design(x_test, c_test, with_ids)))
    assert aucs[False] > 0.55
    assert aucs[True] > 0.7 and aucs[True] > aucs[False] + 0.05


@pytest.mark.parametrize("layout", ["fixed", "variable"])
def test_write_synthetic_multi_hot_dataset_round_trip(tmp_path, layout):
    sizes, bag_sizes = [1, 4, 300, 70_000], [2, 1, 3, 5]
    samples = {"train": 1100, "test": 300}
    out = tmp_path / "ds"
    write_synthetic_dataset(str(out), 3, sizes, samples, batch_size=512, seed=4,
                            bag_sizes=bag_sizes, pooling=["sum", "mean", "sum", "mean"], bag_layout=layout)
    spec = FeatureSpec.from_yaml(str(out))
    assert spec.cardinalities == sizes
    expected_bag = bag_sizes if layout == "fixed" else ["variable"] * 4
    assert [spec.bag_size(i) for i in range(4)] == expected_bag
    assert spec.poolings == ["sum", "mean", "sum", "mean"]
    assert spec.metadata["synthetic"]["bag_sizes"] == bag_sizes
    for split, n in samples.items():
        source = SyntheticDataset(3, sizes, n, 512, seed=4, split=split, bag_sizes=bag_sizes,
                                  pooling=["sum", "mean", "sum", "mean"])
        generated = [source.read_batch(i) for i in range(len(source))]
        lists = [[bag for b in generated for bag in bags_to_lists(b.categorical)[t]] for t in range(4)]
        reader = SplitBinaryReader(spec, split, 200)  # another batch size: the same rows
        reader.validate()
        got = [reader.read_batch(i) for i in range(len(reader))]
        assert [[bag for b in got for bag in bags_to_lists(b.categorical)[t]] for t in range(4)] == lists
        assert torch.equal(torch.cat([b.label for b in got]), torch.cat([b.label for b in generated]))
        assert torch.equal(torch.cat([b.numerical for b in got]), torch.cat([b.numerical for b in generated]))
        reader.close()
    with pytest.raises(ValueError, match="bag_layout"):
        write_synthetic_dataset(str(tmp_path / "x"), 1, [5], {"train": 5}, bag_sizes=[2], bag_layout="jagged")
    with pytest.raises(ValueError, match="bag_sizes"):
        SyntheticDataset(1, [5, 6], 10, 10, bag_sizes=[2])
    with pytest.raises(ValueError, match="pooling"):
        SyntheticDataset(1, [5], 10, 10, bag_sizes=[2], pooling="max")


def test_synthetic_config_gives_a_multi_hot_spec_and_source():
    cfg = DataConfig(dataset_type="synthetic", synthetic_table_sizes=[10, 20, 30], synthetic_num_numerical=2,
                     synthetic_bag_sizes=[2, 1, 3], synthetic_pooling="mean", synthetic_num_entries=50)
    spec = load_feature_spec(cfg)
    assert spec.multi_hot_features == spec.categorical_names and spec.poolings == ["mean"] * 3
    assert [spec.bag_size(i) for i in range(3)] == [2, 1, 3]
    batch = make_source(cfg, spec, "train", 20, torch.device("cpu")).read_batch(0)
    assert isinstance(batch.categorical, Bags) and batch.categorical.lengths().sum(1).tolist() == [40, 20, 60]
    one_hot = DataConfig(dataset_type="synthetic", synthetic_table_sizes=[10, 20], synthetic_num_numerical=2)
    assert load_feature_spec(one_hot).multi_hot_features == []
