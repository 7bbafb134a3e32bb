"""Datasets handed in from outside: a feature spec naming files outside its folder is refused
before anything is read (unless --allow_files_outside_dataset), and datasets of one numerical
feature (or none) train, test, benchmark and export, or are refused in one line.

The command lines of dlrm.scripts.main run in one process that forks per command after the
heavy imports (tests/entry_point_runner.py), each still the script run as ``__main__``."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
import yaml

from conftest import log_records, run_entry_points
from dlrm.data.csv_source import CsvSource
from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.rank_source import RankSource
from dlrm.data.sources import DataConfig, load_feature_spec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.split_binary_columns import HIDDEN
from dlrm.data.synthetic import write_synthetic_dataset
from dlrm.engine.errors import DatasetError
from dlrm.inference.export import build_inference_model, check_export, export_onnx, export_torchscript

TABLES = [5, 7]
ROWS = {"train": 300, "test": 100}
SMALL = ["--base_device", "cpu", "--embedding_dim", "4", "--bottom_mlp_sizes", "8,4", "--top_mlp_sizes", "8,1",
         "--batch_size", "100", "--test_batch_size", "100", "--epochs", "1"]
SECRET = bytes([0x80]) * ROWS["train"]  # as int8 ids: -128, the byte the old message quoted
FLAG = "--allow_files_outside_dataset"
ESCAPES = ("dotdot", "absolute", "symlink")


def _dataset(root, num_numerical: int, bag_sizes=None) -> str:
    out = str(root / f"ds{num_numerical}{'_bags' if bag_sizes else ''}")
    write_synthetic_dataset(out, num_numerical, TABLES, dict(ROWS), batch_size=128, seed=3, bag_sizes=bag_sizes)
    return out


def _escape(root, source: str, how: str) -> str:
    """A copy of dataset ``source`` whose train file of cat_0.bin is ``secret`` outside it,
    named by '..', by an absolute path, or reached through a link in the folder."""
    secret = root / "home" / ".ssh" / "id_rsa"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_bytes(SECRET)
    ds = root / f"escape_{how}"
    shutil.copytree(source, ds)
    spec = yaml.safe_load((ds / "feature_spec.yaml").read_text())
    (chunk,) = [c for c in spec["source_spec"]["train"] if c["features"] == ["cat_0.bin"]]
    if how == "symlink":
        os.remove(ds / chunk["files"][0])
        os.symlink(secret, ds / chunk["files"][0])
    else:
        chunk["files"] = [os.path.relpath(secret, ds) if how == "dotdot" else str(secret)]
        (ds / "feature_spec.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return str(ds)


def _run_main(tmp_path, cases: list[list[str]]) -> list[dict]:
    """Each argument list run as ``python -m dlrm.scripts.main``, in order, in one warm runner."""
    return run_entry_points("dlrm.scripts.main", cases, tmp_path, preload=("dlrm.scripts.dlrm_flags", "dlrm.training.build"))


def _refused(result: dict, *words: str) -> str:
    lines = result["stderr"].strip().splitlines()
    assert result["returncode"] == 2 and len(lines) == 1, result
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert "-128" not in lines[0] and "\\x80" not in lines[0]  # nothing read from the refused file
    return lines[0]


def _ok(result: dict) -> None:
    assert result["returncode"] == 0, result["stdout"][-2000:] + result["stderr"][-3000:]


# ---------------------------------------------------------------------------- R11, in-process


@pytest.mark.parametrize("how", ESCAPES)
def test_every_reader_refuses_files_outside_the_dataset_before_reading(tmp_path, how):
    ds = _escape(tmp_path, _dataset(tmp_path, 1), how)
    with pytest.raises(DatasetError, match=r"feature_spec\.yaml: the file .* of feature 'cat_0\.bin' lies outside "
                                           r"the dataset folder .*`allow_files_outside_dataset=True`") as e:
        load_feature_spec(DataConfig(dataset=ds, hash_indices=True))
    assert "-128" not in str(e.value)
    spec = FeatureSpec.from_yaml(ds)  # a library user who builds readers directly is refused too
    with pytest.raises(DatasetError, match="lies outside the dataset folder"):
        SplitBinaryReader(spec, "train", 50, check_ids=False)
    with pytest.raises(DatasetError, match="lies outside the dataset folder"):
        RankSource(lambda feats, num, label: SplitBinaryReader(spec, "train", 50, feats, num, label), [0], 0, 2)
    # opted in: read as named, and no message quotes what the outside file holds
    allowed = load_feature_spec(DataConfig(dataset=ds, allow_files_outside_dataset=True))
    reader = SplitBinaryReader(allowed, "train", 50)
    with pytest.raises(DatasetError, match="has id <not shown") as e:
        reader.read_batch(0)
    assert HIDDEN in str(e.value) and "-128" not in str(e.value)
    with pytest.raises(DatasetError, match="has id <not shown"):
        reader.validate()
    hashed = SplitBinaryReader(allowed, "train", 50, check_ids=False).read_batch(0)
    assert (hashed.categorical[:, 0] == -128).all()


def test_a_file_named_outside_but_missing_is_refused_not_opened(tmp_path):
    """Refusal comes first: the message is the spec's, not a missing file's."""
    ds = _dataset(tmp_path, 1)
    spec = yaml.safe_load(open(os.path.join(ds, "feature_spec.yaml")))
    spec["source_spec"]["test"][0]["files"] = ["/nonexistent/numerical.bin"]
    with open(os.path.join(ds, "feature_spec.yaml"), "w") as f:
        yaml.safe_dump(spec, f)
    with pytest.raises(DatasetError, match="'/nonexistent/numerical.bin' of feature 'num_0' lies outside"):
        SplitBinaryReader(FeatureSpec.from_yaml(ds), "test", 10)
    inside = FeatureSpec.from_yaml(ds)  # the split whose files lie inside still reads
    assert SplitBinaryReader(inside, "train", 10).read_batch(0).numerical.shape == (10, 1)


def test_csv_source_reading_refuses_files_outside_its_folder(tmp_path):
    (tmp_path / "outside.csv").write_text("1,0.5,3\n")
    folder = tmp_path / "csv"
    folder.mkdir()
    spec = {"feature_spec": {"label": {}, "n": {}, "c": {"cardinality": 4}},
            "channel_spec": {"label": ["label"], "numerical": ["n"], "categorical": ["c"]},
            "source_spec": {"train": [{"type": "csv", "features": ["label", "n", "c"], "files": ["../outside.csv"]}]}}
    (folder / "feature_spec.yaml").write_text(yaml.safe_dump(spec))
    with pytest.raises(DatasetError, match="'../outside.csv' of feature 'label' lies outside the dataset folder"):
        CsvSource.from_yaml(str(folder / "feature_spec.yaml"))
    allowed = CsvSource.from_yaml(str(folder / "feature_spec.yaml"), allow_files_outside=True)
    assert allowed.chunks("train")[0].path == str(tmp_path / "outside.csv")


# ---------------------------------------------------------------------------- R6, in-process


def test_one_numerical_feature_reads_as_a_column_in_every_reader(tmp_path):
    """[B, 1], never [B]: one-hot and multi-hot batches, a rank's share, and the full scan."""
    for ds in (_dataset(tmp_path, 1), _dataset(tmp_path, 1, bag_sizes=[3, 2])):
        spec = FeatureSpec.from_yaml(ds)
        raw = np.fromfile(os.path.join(ds, "train", "numerical.bin"), dtype=np.float16)
        batch = SplitBinaryReader(spec, "train", 64).read_batch(1)
        assert batch.numerical.shape == (64, 1) and batch.label.shape == (64,)
        np.testing.assert_array_equal(batch.numerical[:, 0].numpy(), raw[64:128])
        share = RankSource(lambda f, n, lab: SplitBinaryReader(spec, "train", 64, f, n, lab), [1], 1, 2).read_batch(0)
        assert share.numerical.shape == (32, 1)
        np.testing.assert_array_equal(share.numerical[:, 0].numpy(), raw[32:64])
    raw[7] = np.inf
    raw.tofile(os.path.join(ds, "train", "numerical.bin"))
    with pytest.raises(DatasetError, match="numerical feature 'num_0' is inf at row 7"):
        SplitBinaryReader(FeatureSpec.from_yaml(ds), "train", 64).validate()


def test_no_numerical_feature_is_refused_at_spec_time(tmp_path):
    ds = _dataset(tmp_path, 0)
    assert SplitBinaryReader(FeatureSpec.from_yaml(ds), "train", 8).read_batch(0).numerical.shape == (8, 0)
    with pytest.raises(DatasetError, match=r"feature_spec\.yaml: the dataset has no numerical feature.*"
                                           r"`num_numerical_features=1`"):
        load_feature_spec(DataConfig(dataset=ds))


# ---------------------------------------------------------------------------- the command lines


def test_command_lines_refuse_escaping_specs_and_run_one_numerical_datasets(tmp_path):
    one = _dataset(tmp_path, 1)
    escapes = {how: _escape(tmp_path, one, how) for how in ESCAPES}
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "test.json")
    cases = [
        ["--dataset", one, *SMALL, "--save_checkpoint_path", ckpt],  # R6: train
        ["--mode", "test", "--dataset", one, *SMALL, "--load_checkpoint_path", ckpt, "--log_path", log],
        ["--mode", "inference_benchmark", "--dataset", one, *SMALL, "--load_checkpoint_path", ckpt,
         "--inference_benchmark_batch_sizes", "1,16", "--inference_benchmark_steps", "3"],
        ["--dataset", _dataset(tmp_path, 0), *SMALL],  # no numerical feature: refused with the fix
    ]
    for ds in escapes.values():  # R11: training and --mode test, refused
        cases += [["--dataset", ds, *SMALL, "--hash_indices"],
                  ["--mode", "test", "--dataset", ds, *SMALL, "--hash_indices", "--load_checkpoint_path", ckpt]]
    dotdot = escapes["dotdot"]
    hashed = str(tmp_path / "hashed")
    cases += [["--dataset", dotdot, *SMALL, "--hash_indices", FLAG, "--save_checkpoint_path", hashed],  # opted in
              ["--mode", "test", "--dataset", dotdot, *SMALL, "--hash_indices", FLAG, "--load_checkpoint_path", hashed]]
    results = _run_main(tmp_path, cases)
    train, test, bench, none, *escaped = results[:4 + 2 * len(ESCAPES)]
    _ok(train)
    _ok(test)
    assert log_records(log, "summary")[0]["samples"] == ROWS["test"]
    _ok(bench)
    assert "p99 ms" in bench["stdout"]
    _refused(none, "feature_spec.yaml", "no numerical feature", "num_numerical_features=1")
    for result in escaped:
        _refused(result, "feature_spec.yaml", "'cat_0.bin'", FLAG, "lies outside the dataset folder")
    for result in results[4 + 2 * len(ESCAPES):]:  # opted in
        _ok(result)

    # the one-numerical checkpoint exports (ONNX when onnxruntime is here), as dlrm.scripts.export does
    model = build_inference_model(ckpt)
    path = str(tmp_path / ("model.onnx" if _has("onnxruntime") else "model.pt"))
    (export_onnx if path.endswith(".onnx") else export_torchscript)(model, path)
    errors = check_export(model, path, batch_sizes=(1, 5))
    assert model.config.num_numerical_features == 1 and max(errors.values()) < 1e-5


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True
