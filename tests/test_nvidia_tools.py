"""NVIDIA's data tools and their command lines, as NVIDIA's test scripts and README run them.

- ``prepare_synthetic_dataset --feature_spec SPEC``: for each of the ten specs of NVIDIA's
  tests/feature_specs (``nvidia_specs.py``), a dataset with the spec's features, names,
  cardinalities, dtypes and file paths that the reader reads back; one also goes
  through the command lines of NVIDIA's tests/test_with_opts.sh (generate, then train).
- ``gen_csv`` then ``transcode --input``: NVIDIA's tests/transcoding/small_csv.yaml flow, the
  dataset compared with an independent parse of the CSV files (the ``csv`` module); and CSV
  written the way pandas writes a file that mixes ids with floats (``5.0``), with ``auto``
  cardinalities.
"""

from __future__ import annotations

import copy
import csv
import json
import os

import numpy as np
import pytest
import yaml
from nvidia_specs import FEATURE_SPECS, SMALL_CSV

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.synthetic import write_synthetic_dataset_for_spec
from dlrm.data.transcode import transcode_csv_source
from dlrm.engine.errors import DatasetError

ROWS = {"test": 48, "train": 96}


def _write_yaml(path, data: dict) -> str:
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _read_all(spec: FeatureSpec, split: str):
    with SplitBinaryReader(spec, split, batch_size=1 << 16) as reader:
        batches = [reader.read_batch(i) for i in range(len(reader))]
    return (np.concatenate([b.numerical.numpy() for b in batches]),
            np.concatenate([b.categorical.numpy() for b in batches]),
            np.concatenate([b.label.numpy() for b in batches]))


@pytest.mark.parametrize("name", sorted(FEATURE_SPECS))
def test_prepare_synthetic_dataset_follows_each_nvidia_feature_spec(tmp_path, name):
    given = FEATURE_SPECS[name]
    spec = FeatureSpec.from_yaml(_write_yaml(tmp_path / f"{name}.yaml", given))
    out = tmp_path / "data"
    write_synthetic_dataset_for_spec(str(out), spec, ROWS, batch_size=64, seed=3)
    written = FeatureSpec.from_yaml(str(out))
    as_written = written.to_dict()
    assert as_written["metadata"]["synthetic"]["seed"] == 3
    del as_written["metadata"]["synthetic"]
    assert as_written == given  # names, cardinalities, dtypes, paths, channel order: the spec's own
    channels = given["channel_spec"]
    cards = [given["feature_spec"][c]["cardinality"] for c in channels["categorical"]]
    for split, rows in ROWS.items():
        for chunk in given["source_spec"][split]:  # every file where the spec puts it, of the spec's width
            feature = chunk["features"][0]
            dtype = np.dtype(given["feature_spec"][feature]["dtype"])
            assert os.path.getsize(out / chunk["files"][0]) == rows * len(chunk["features"]) * dtype.itemsize
        numerical, categorical, label = _read_all(written, split)
        assert numerical.shape == (rows, len(channels["numerical"])) and numerical.dtype == np.float16
        assert categorical.shape == (rows, len(cards))
        assert ((categorical >= 0) & (categorical < np.array(cards))).all()
        assert set(np.unique(label).tolist()) <= {0, 1}
    for j, c in enumerate(channels["categorical"]):  # ids stored in the spec's dtype, values as read
        path = out / given["source_spec"]["train"][2 + j]["files"][0]
        raw = np.fromfile(path, dtype=given["feature_spec"][c]["dtype"])
        assert (raw == _read_all(written, "train")[1][:, j]).all()


def test_nvidia_test_script_commands_generate_and_train(tmp_path, cli):
    """tests/test_with_opts.sh: prepare_synthetic_dataset --feature_spec, then main --mode train
    (a tiny model, 3 steps, on the CPU), on the spec that renames every feature."""
    spec = _write_yaml(tmp_path / "different_feature_names.yaml", FEATURE_SPECS["different_feature_names"])
    data = tmp_path / "generated"
    proc = cli("dlrm.scripts.prepare_synthetic_dataset", "--feature_spec", spec, "--synthetic_dataset_dir", str(data),
               "--synthetic_dataset_num_entries", "256", "--num_test_entries", "128")
    assert "train" in proc.stdout and "256 rows" in proc.stdout
    assert FeatureSpec.from_yaml(str(data)).splits == ["test", "train"]  # no validation: NVIDIA's reader wants two
    log = tmp_path / "log.json"
    cli("dlrm.scripts.main", "--mode", "train", "--dataset", str(data), "--base_device", "cpu", "--embedding_dim", "4",
        "--bottom_mlp_sizes", "8,4", "--top_mlp_sizes", "8,1", "--batch_size", "64", "--test_batch_size", "128",
        "--max_steps", "3", "--log_path", str(log))
    summary = [json.loads(line) for line in log.read_text().splitlines() if '"summary"' in line][-1]
    assert 0 <= summary["best_auc"] <= 1, summary


def _csv_rows(path) -> list[list[str]]:
    with open(path, newline="") as f:
        return [row for row in csv.reader(f) if row]


def test_gen_csv_then_transcode_matches_the_csv_files(tmp_path, cli):
    spec_in = _write_yaml(tmp_path / "small_csv.yaml", SMALL_CSV)
    data, out = tmp_path / "data", tmp_path / "converted"
    cli("dlrm.scripts.gen_csv", "--feature_spec_in", spec_in, "--output", str(data), "--size", "300", "--seed", "1")
    assert yaml.safe_load((data / "feature_spec.yaml").read_text()) == SMALL_CSV  # where transcode --input looks
    proc = cli("dlrm.scripts.transcode", "--input", str(data), "--output", str(out), "--chunk_size", "64",
               "--feature_spec_out", "spec.yaml")
    assert "cardinalities [10, 23412, 45000, 100, 50, 127]" in proc.stdout
    spec = FeatureSpec.from_yaml(str(out / "spec.yaml"))
    # NVIDIA's output naming: num_<i>, cat_<i>.bin in channel order, label; the splits of the input.
    assert spec.numerical_names == ["num_0", "num_1", "num_2"] and spec.label_name == "label"
    assert spec.categorical_names == [f"cat_{j}.bin" for j in range(6)] and sorted(spec.splits) == ["test", "train"]
    assert spec.cardinalities == [10, 23412, 45000, 100, 50, 127]
    for split, chunks in SMALL_CSV["source_spec"].items():
        columns = {}
        for chunk in chunks:  # an independent parse: the csv module, one column per feature
            rows = _csv_rows(data / chunk["files"][0])
            assert len(rows) == 300
            for k, feature in enumerate(chunk["features"]):
                columns[feature] = [row[k] for row in rows]
        numerical, categorical, label = _read_all(spec, split)
        expected = np.array([[float(v) for v in columns[f"num_{i}"]] for i in range(3)]).T
        expected = expected.astype(np.float32).astype(np.float16)  # NVIDIA's rounding (torch's cast)
        assert (numerical.view(np.uint16) == expected.view(np.uint16)).all()
        assert (categorical == np.array([[int(v) for v in columns[f"cat_{j}.bin"]] for j in range(6)]).T).all()
        assert (label == np.array([v == "1" for v in columns["label"]])).all()
        assert 0 < label.mean() < 1  # both labels drawn
    # An earlier run's files are replaced only on request, named with the fix.
    proc = cli("dlrm.scripts.gen_csv", "--feature_spec_in", spec_in, "--output", str(data), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "already holds a CSV dataset; pass --overwrite" in proc.stderr


def test_transcode_reads_ids_written_as_floats_and_infers_auto_cardinalities(tmp_path):
    """NVIDIA's gen_csv writes a chunk that mixes numericals and ids through pandas, so its ids
    come as 5.0; NVIDIA's transcode reads them, and so does this one. ``auto`` and a left-out
    cardinality are max id + 1 over both splits."""
    source = copy.deepcopy(SMALL_CSV)
    order = ["num_0", "cat_3.bin", "label", "num_1", "num_2"] + [f"cat_{j}.bin" for j in (0, 1, 2, 4, 5)]
    for split in ("train", "test"):
        source["source_spec"][split] = [{"features": order, "files": [f"{split}.csv"], "type": "csv"}]
    source["feature_spec"]["cat_1.bin"]["cardinality"] = "auto"
    del source["feature_spec"]["cat_2.bin"]["cardinality"]
    rng = np.random.default_rng(5)
    values = {}
    for split, n in (("train", 40), ("test", 30)):
        table = np.empty((n, len(order)))
        for k, feature in enumerate(order):
            kind = "label" if feature == "label" else feature[:3]
            table[:, k] = (rng.integers(0, 2, n) if kind == "label" else rng.random(n) if kind == "num"
                           else rng.integers(0, 9, n))
        values[split] = table
        lines = [",".join(repr(float(v)) for v in row) for row in table]
        lines.insert(7, "")  # a blank line is skipped
        (tmp_path / f"{split}.csv").write_text("\n".join(lines) + "\n")
    spec = transcode_csv_source(_write_yaml(tmp_path / "feature_spec.yaml", source), str(tmp_path / "out"),
                                chunk_rows=16)
    both = np.concatenate([values["train"], values["test"]])
    assert spec.cardinalities[1:3] == [int(both[:, order.index(c)].max()) + 1 for c in ("cat_1.bin", "cat_2.bin")]
    numerical, categorical, label = _read_all(spec, "train")
    table = values["train"]
    assert (categorical == table[:, [order.index(f"cat_{j}.bin") for j in range(6)]].astype(np.int64)).all()
    expected = table[:, [order.index(f"num_{i}") for i in range(3)]].astype(np.float32).astype(np.float16)
    assert (numerical.view(np.uint16) == expected.view(np.uint16)).all()
    assert (label == table[:, order.index("label")].astype(bool)).all()

    (tmp_path / "test.csv").write_text("1.0,2.5" + ",0" * (len(order) - 2) + "\n")  # cat_3.bin is 2.5
    with pytest.raises(DatasetError, match=r"test.csv, line 1: field 2 \(feature 'cat_3.bin'\) is '2.5', expected a "
                                           r"non-negative integer id"):
        transcode_csv_source(str(tmp_path / "feature_spec.yaml"), str(tmp_path / "out2"))
    assert not (tmp_path / "out2").exists()
