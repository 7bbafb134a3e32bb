"""NVIDIA's data tools and their command lines, as NVIDIA's test scripts and README run them.

- ``prepare_synthetic_dataset --feature_spec SPEC``: for each of the ten specs of NVIDIA's
  tests/feature_specs (``nvidia_specs.py``), a dataset with the spec's features, names,
  cardinalities, dtypes and file paths that the reader reads back; one also goes
  through the command lines of NVIDIA's tests/test_with_opts.sh (generate, then train).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml
from nvidia_specs import FEATURE_SPECS

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.synthetic import write_synthetic_dataset_for_spec

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
