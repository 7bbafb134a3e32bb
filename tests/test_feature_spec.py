import copy
import os

import numpy as np
import pytest
import yaml

from dlrm.data.feature_spec import FeatureSpec, SplitPaths, dtype_for_cardinality
from dlrm.engine.errors import DatasetError, FeatureSpecError


@pytest.mark.parametrize(
    "cardinality, expected",
    [
        (1, np.int8),
        (127, np.int8),
        (128, np.int8),  # max id 127 fits int8
        (129, np.int16),
        (32767, np.int16),
        (32768, np.int16),
        (32769, np.int32),
        (2**31 - 1, np.int32),
        (2**31, np.int32),
        (2**31 + 1, np.int64),
        (2**63, np.int64),
    ],
)
def test_dtype_for_cardinality(cardinality, expected):
    assert dtype_for_cardinality(cardinality) == np.dtype(expected)


@pytest.mark.parametrize("cardinality", [0, -3, 2**63 + 1])
def test_dtype_for_cardinality_rejects(cardinality):
    with pytest.raises(ValueError):
        dtype_for_cardinality(cardinality)


def nvidia_dict(splits=("train", "test")):
    """A spec as NVIDIA's pipeline writes it: `.bin` in categorical names, train/test only."""
    num = ["num_0", "num_1"]
    cat = ["cat_0.bin", "cat_1.bin"]
    feature_spec = {
        "cat_0.bin": {"cardinality": 100, "dtype": "int8"},
        "cat_1.bin": {"cardinality": 40000, "dtype": "int32"},
        "label": {"dtype": "bool"},
        "num_0": {"dtype": "float16"},
        "num_1": {"dtype": "float16"},
    }
    source = {}
    for s in splits:
        source[s] = [
            {"features": num, "files": [f"{s}/numerical.bin"], "type": "split_binary"},
            {"features": ["label"], "files": [f"{s}/label.bin"], "type": "split_binary"},
        ] + [{"features": [c], "files": [f"{s}/{c}"], "type": "split_binary"} for c in cat]
    return {
        "channel_spec": {"categorical": cat, "label": ["label"], "numerical": num},
        "feature_spec": feature_spec,
        "metadata": {},
        "source_spec": source,
    }


def write_yaml(tmp_path, d):
    path = tmp_path / "feature_spec.yaml"
    # yaml.dump (not safe_dump, no alias suppression) mirrors how NVIDIA's files come out, anchors included
    path.write_text(yaml.dump(d))
    return str(path)


def test_nvidia_spec_loads(tmp_path):
    d = nvidia_dict()
    path = write_yaml(tmp_path, d)
    assert "&id" in open(path).read()  # shared numerical list is written as an anchor
    spec = FeatureSpec.from_yaml(path)
    assert sorted(spec.splits) == ["test", "train"]
    assert spec.categorical_names == ["cat_0.bin", "cat_1.bin"]
    assert spec.numerical_names == ["num_0", "num_1"]
    assert spec.label_name == "label"
    assert spec.cardinalities == [100, 40000]
    assert spec.categorical_dtypes == [np.dtype("int8"), np.dtype("int32")]
    assert spec.num_numerical == 2
    assert spec.base_directory == str(tmp_path)
    assert spec.multi_hot_features == [] and spec.poolings == [None, None]  # one-hot, as NVIDIA's files are
    assert not spec.is_multi_hot("cat_1.bin") and spec.bag_size(0) is None
    p = spec.paths("test")
    assert p == SplitPaths(
        label=str(tmp_path / "test" / "label.bin"),
        numerical=str(tmp_path / "test" / "numerical.bin"),
        categorical=[str(tmp_path / "test" / "cat_0.bin"), str(tmp_path / "test" / "cat_1.bin")],
    )
    # a directory works as well as the file
    assert FeatureSpec.from_yaml(str(tmp_path)).to_dict() == spec.to_dict()


def test_unknown_split_lists_known(tmp_path):
    spec = FeatureSpec.from_yaml(write_yaml(tmp_path, nvidia_dict()))
    with pytest.raises(DatasetError, match=r"no split 'validation'.*known splits: \['test', 'train'\]"):
        spec.paths("validation")


def test_default_matches_nvidia_naming(tmp_path):
    spec = FeatureSpec.default(2, [100, 40000], splits=("train", "test"), base_directory=str(tmp_path))
    assert spec.to_dict() == nvidia_dict()
    full = FeatureSpec.default(13, [5] * 26)
    assert full.splits == ["train", "test", "validation"]
    assert full.categorical_names[25] == "cat_25.bin"
    with pytest.raises(DatasetError, match="base_directory"):
        full.paths("train")


def test_default_without_numerical(tmp_path):
    spec = FeatureSpec.default(0, [3], splits=("train",), base_directory=str(tmp_path))
    assert spec.paths("train").numerical is None
    assert spec.num_numerical == 0


def test_yaml_round_trip_is_atomic_and_plain(tmp_path):
    spec = FeatureSpec.default(3, [2, 300, 70000], base_directory=str(tmp_path))
    spec.metadata = {"source": "unit test"}
    spec.to_yaml(str(tmp_path / "feature_spec.yaml"))
    assert sorted(os.listdir(tmp_path)) == ["feature_spec.yaml"]  # no temp file left
    text = (tmp_path / "feature_spec.yaml").read_text()
    assert "&id" not in text and "*id" not in text
    loaded = FeatureSpec.from_yaml(str(tmp_path / "feature_spec.yaml"))
    assert loaded.to_dict() == spec.to_dict()
    assert yaml.safe_load(text)["feature_spec"]["cat_2.bin"] == {"dtype": "int32", "cardinality": 70000}


def test_to_yaml_failure_keeps_old_file(tmp_path, monkeypatch):
    path = tmp_path / "feature_spec.yaml"
    path.write_text("old contents\n")
    spec = FeatureSpec.default(1, [2], base_directory=str(tmp_path))

    def broken_replace(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        spec.to_yaml(str(path))
    assert path.read_text() == "old contents\n"
    assert os.listdir(tmp_path) == ["feature_spec.yaml"]


def test_missing_yaml(tmp_path):
    with pytest.raises(DatasetError, match=r"feature_spec.yaml.*not found"):
        FeatureSpec.from_yaml(str(tmp_path))


def _break(fn):
    d = nvidia_dict()
    fn(d)
    return d


BROKEN = {
    "missing top-level key": (lambda d: d.pop("source_spec"), "source_spec"),
    "unknown top-level key": (lambda d: d.update(extra=1), "extra"),
    "two labels": (lambda d: d["channel_spec"].update(label=["label", "num_0"]), "exactly one"),
    "no label": (lambda d: d["channel_spec"].update(label=[]), "exactly one"),
    "channel feature missing from feature_spec": (lambda d: d["feature_spec"].pop("cat_1.bin"), "cat_1.bin"),
    "feature in no channel": (lambda d: d["feature_spec"].update(num_9={"dtype": "float16"}), "num_9"),
    "numerical chunk out of order": (
        lambda d: d["source_spec"]["test"][0].update(features=["num_1", "num_0"]),
        "channel order",
    ),
    "float32 numerical": (lambda d: d["feature_spec"]["num_1"].update(dtype="float32"), "num_1"),
    "unknown chunk type": (lambda d: d["source_spec"]["train"][2].update(type="parquet"), "parquet"),
    "dtype too small": (lambda d: d["feature_spec"]["cat_1.bin"].update(dtype="int8"), "cat_1.bin"),
    "no cardinality": (lambda d: d["feature_spec"]["cat_0.bin"].pop("cardinality"), "cat_0.bin"),
    "float categorical": (lambda d: d["feature_spec"]["cat_0.bin"].update(dtype="float32"), "cat_0.bin"),
    "bad numpy dtype": (lambda d: d["feature_spec"]["cat_0.bin"].update(dtype="intX"), "cat_0.bin"),
    "non-bool label": (lambda d: d["feature_spec"]["label"].update(dtype="int32"), "label"),
    "feature absent from split": (lambda d: d["source_spec"]["test"].pop(), "cat_1.bin"),
    "two files in chunk": (
        lambda d: d["source_spec"]["train"][1].update(files=["a.bin", "b.bin"]),
        "exactly one path",
    ),
    "two categoricals in one file": (
        lambda d: d["source_spec"]["train"][2].update(features=["cat_0.bin", "cat_1.bin"]),
        "alone in its file",
    ),
    "unknown channel": (lambda d: d["channel_spec"].update(dense=[]), "dense"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_malformed_spec_names_file_and_feature(tmp_path, case):
    mutate, needle = BROKEN[case]
    path = write_yaml(tmp_path, _break(mutate))
    with pytest.raises(FeatureSpecError) as info:
        FeatureSpec.from_yaml(path)
    msg = str(info.value)
    assert path in msg
    assert needle in msg


def test_split_named_in_split_errors(tmp_path):
    path = write_yaml(tmp_path, _break(lambda d: d["source_spec"]["test"].pop()))
    with pytest.raises(FeatureSpecError, match="split 'test'"):
        FeatureSpec.from_yaml(path)


def test_validate_without_yaml():
    d = nvidia_dict()
    spec = FeatureSpec(**copy.deepcopy(d))
    spec.validate()
    spec.feature_spec["cat_0.bin"]["cardinality"] = 1000  # int8 can't hold id 999
    with pytest.raises(FeatureSpecError, match=r"cat_0.bin.*int16"):
        spec.validate()


def test_to_yaml_is_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        spec = FeatureSpec.default(2, [5, 6], base_directory=str(tmp_path))
        spec.to_yaml(str(tmp_path / "feature_spec.yaml"))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "feature_spec.yaml").st_mode & 0o777 == 0o644
