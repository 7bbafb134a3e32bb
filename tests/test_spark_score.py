"""Batch scoring in Spark (local mode) with an exported ONNX model: the probabilities are the
eager model's, and the AUC of a scored labelled split is the offline evaluation's."""

import json
import os

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import roc_auc_score

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.inference.export import build_inference_model, export_onnx
from dlrm.spark.launch import local_session
from dlrm.spark.score import OUTPUT, prepare_raw_rows, prepared_columns, read_dataset, score
from preproc.transform import COLUMNS

from conftest import env_without_this_python
from test_preproc_transform_rows import _split_lines
from test_preproc_transform_rows import dataset as criteo_dataset  # noqa: F401 (fixtures)
from test_preproc_transform_rows import days  # noqa: F401
from test_torchrun import MODEL, dataset  # noqa: F401

pytest.importorskip("pyspark")
pytest.importorskip("onnxruntime")


def records(path, kind):
    return [r for r in map(json.loads, open(path)) if r["type"] == kind]


@pytest.fixture(scope="module")
def spark():
    session = local_session("local[2]")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory, cli):  # noqa: F811
    """A model trained for 12 steps, its ONNX export, and its offline test AUC (--mode test)."""
    root = tmp_path_factory.mktemp("trained")
    ckpt, log, test_log = str(root / "ckpt"), str(root / "train.json"), str(root / "test.json")
    common = ["--dataset", dataset, *MODEL, "--batch_size", "500", "--test_batch_size", "700", "--lr", "0.5"]
    cli("dlrm.scripts.main", *common, "--max_steps", "12", "--save_checkpoint_path", ckpt, "--log_path", log)
    cli("dlrm.scripts.main", *common, "--mode", "test", "--load_checkpoint_path", ckpt, "--log_path", test_log)
    model_path = str(root / "model.onnx")
    export_onnx(build_inference_model(ckpt), model_path)
    return ckpt, model_path, records(test_log, "summary")[0]["auc"]


@pytest.fixture(scope="module")
def cli():
    from conftest import run_cli
    return run_cli


def test_scored_split_has_the_offline_auc_and_the_eager_probabilities(spark, dataset, trained):  # noqa: F811
    ckpt, model_path, offline_auc = trained
    rows = read_dataset(spark, dataset, "test", rows_per_partition=700)  # 5 tasks, the last one short
    assert rows.rdd.getNumPartitions() == 5
    scored = score(rows, model_path).toPandas()
    spec = FeatureSpec.from_yaml(dataset)
    numerical, categorical = prepared_columns(spec.num_numerical, spec.num_categorical)
    with SplitBinaryReader(spec, "test", 3000) as reader:
        batch = reader.read_batch(0)
    # Rows come back in file order, with the prepared values of the dataset.
    np.testing.assert_array_equal(scored["label"].to_numpy(), batch.label.numpy().reshape(-1))
    np.testing.assert_array_equal(scored[categorical].to_numpy(), batch.categorical.numpy())
    np.testing.assert_array_equal(scored[numerical].to_numpy(np.float32), batch.numerical.float().numpy())
    model = build_inference_model(ckpt).double()
    with torch.no_grad():
        eager = torch.sigmoid(model(batch.numerical.double(), batch.categorical.long())).numpy()
    np.testing.assert_allclose(scored[OUTPUT].to_numpy(), eager, rtol=0, atol=2e-6)
    assert roc_auc_score(scored["label"], scored[OUTPUT]) == pytest.approx(offline_auc, abs=1e-6)


def test_cli_writes_parquet_and_prints_the_offline_auc(dataset, trained, cli, tmp_path):  # noqa: F811
    """Started by a python not on PATH (the tasks must run it, not the first python3 there),
    over an older output, which the scores replace."""
    _, model_path, offline_auc = trained
    out = tmp_path / "scores.parquet"
    out.mkdir()
    (out / "old.parquet").write_bytes(b"stale")
    stdout = cli("dlrm.scripts.spark_score", "--model", model_path, "--dataset", dataset, "--split", "test",
                 "--output", str(out), "--spark_master", "local[2]", env=env_without_this_python(tmp_path)).stdout
    assert "wrote 3,000 rows" in stdout
    assert float(stdout.split("auc ")[1].split()[0]) == pytest.approx(offline_auc, abs=2e-6)
    assert len(pd.read_parquet(out)) == 3000 and not (out / "old.parquet").exists()
    assert sorted(os.listdir(tmp_path)) == ["bin", "scores.parquet"]  # nothing staged left beside it


def test_score_refuses_rows_that_do_not_fit_the_model(spark, dataset, trained):  # noqa: F811
    _, model_path, _ = trained
    rows = read_dataset(spark, dataset, "test")
    with pytest.raises(ValueError, match="but the rows have 6 numerical and 6 categorical columns"):
        score(rows.drop("cat_6"), model_path)
    with pytest.raises(ValueError, match="expected cat_0 .. cat_<n-1>, each once"):
        score(rows.drop("cat_3"), model_path)
    with pytest.raises(ValueError, match="already have a column 'label'"):
        score(rows, model_path, output_column="label")
    assert os.path.isfile(model_path)


def test_raw_criteo_rows_score_as_their_preprocessed_rows(spark, criteo_dataset, cli, tmp_path):  # noqa: F811
    """Raw TSV lines of the test day, transformed in Spark with preprocessing's own transform and
    the dataset's vocabulary, then scored: the AUC of --mode test on the preprocessed split."""
    inputs, out = criteo_dataset
    ckpt, test_log = str(tmp_path / "ckpt"), str(tmp_path / "test.json")
    common = ["--dataset", str(out), *MODEL, "--batch_size", "128", "--test_batch_size", "128", "--lr", "0.5"]
    cli("dlrm.scripts.main", *common, "--max_steps", "6", "--save_checkpoint_path", ckpt,
        "--log_path", str(tmp_path / "train.json"))
    cli("dlrm.scripts.main", *common, "--mode", "test", "--load_checkpoint_path", ckpt, "--log_path", test_log)
    model_path = str(tmp_path / "model.onnx")
    export_onnx(build_inference_model(ckpt), model_path)
    lines = [line.decode() for line in _split_lines(inputs)["test"]]
    raw = spark.createDataFrame([(line,) for line in lines], "value string").repartition(2)
    scored = score(prepare_raw_rows(raw, str(out)), model_path).toPandas()
    # The same rows as a Parquet table of the 40 fields (counts as nullable ints, categories as text).
    table = pd.DataFrame([line.split("\t") for line in lines], columns=COLUMNS).replace("", None)
    for column in COLUMNS[:14]:
        table[column] = pd.to_numeric(table[column]).astype("Int64")
    table.to_parquet(tmp_path / "raw.parquet")
    from_parquet = score(prepare_raw_rows(spark.read.parquet(str(tmp_path / "raw.parquet")), str(out)),
                         model_path).toPandas()
    assert sorted(from_parquet[OUTPUT].tolist()) == sorted(scored[OUTPUT].tolist())
    spec = FeatureSpec.from_yaml(str(out))
    with SplitBinaryReader(spec, "test", len(lines)) as reader:
        batch = reader.read_batch(0)
    _, categorical = prepared_columns(13, 26)
    # The same rows as the dataset's test split (Spark's order aside), and the offline AUC.
    assert sorted(map(tuple, scored[categorical].to_numpy().tolist())) == sorted(
        map(tuple, batch.categorical.long().numpy().tolist()))
    assert roc_auc_score(scored["label"], scored[OUTPUT]) == pytest.approx(
        records(test_log, "summary")[0]["auc"], abs=1e-6)


def test_raw_rows_of_a_dataset_without_vocabulary_are_refused_on_the_driver(spark, dataset):  # noqa: F811
    from dlrm.data.errors import DatasetError

    raw = spark.createDataFrame([("0" + "\t" * 39,)], "value string")
    with pytest.raises(DatasetError, match="vocabulary"):
        prepare_raw_rows(raw, dataset)


def test_raw_rows_need_lines_or_the_forty_fields(spark, criteo_dataset):  # noqa: F811
    _, out = criteo_dataset
    with pytest.raises(ValueError, match="give TSV lines in column 'value'"):
        prepare_raw_rows(spark.createDataFrame([("x", 1)], "label string, I1 int"), str(out))
