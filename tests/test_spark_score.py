"""Batch scoring in Spark (local mode) with an exported ONNX model: the probabilities are the
eager model's, and the AUC of a scored labelled split is the offline evaluation's."""

import gzip
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.metrics import roc_auc_score

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.inference.export import build_inference_model, export_onnx
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.spark.job_io import read_raw_lines, task_error
from dlrm.spark.score import OUTPUT, model_maps_any_id, prepare_raw_rows, prepared_columns, read_dataset, score
from preproc.transform import COLUMNS

from conftest import env_without_this_python, log_records
from test_preproc_transform_rows import _split_lines
from test_preproc_transform_rows import dataset as criteo_dataset  # noqa: F401 (fixtures)
from test_preproc_transform_rows import days  # noqa: F401
from test_torchrun import MODEL, dataset  # noqa: F401

pytest.importorskip("pyspark")
pytest.importorskip("onnxruntime")


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
    return ckpt, model_path, log_records(test_log, "summary")[0]["auc"]


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
    over an older output of its own, which the scores replace with --overwrite only; the dataset
    being scored, or a folder of the user's, is never replaced (before Spark starts)."""
    _, model_path, offline_auc = trained
    out = tmp_path / "scores.parquet"
    out.mkdir()
    (out / "_SUCCESS").write_bytes(b"")
    (out / "part-00000-old.snappy.parquet").write_bytes(b"stale")
    score = ("dlrm.scripts.spark_score", "--model", model_path, "--dataset", dataset, "--split", "test")
    before = {p: p.read_bytes() for p in Path(dataset).rglob("*") if p.is_file()}
    proc = cli(*score, "--output", dataset, "--overwrite", check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is the input --dataset" in proc.stderr, proc.stderr
    assert {p: p.read_bytes() for p in Path(dataset).rglob("*") if p.is_file()} == before
    proc = cli(*score, "--output", str(out), check=False)
    assert proc.returncode == 2 and "pass --overwrite to replace it" in proc.stderr, proc.stderr
    stdout = cli(*score, "--output", str(out), "--overwrite", "--spark_master", "local[2]",
                 env=env_without_this_python(tmp_path)).stdout
    assert "wrote 3,000 rows" in stdout
    assert float(stdout.split("auc ")[1].split()[0]) == pytest.approx(offline_auc, abs=2e-6)
    assert len(pd.read_parquet(out)) == 3000 and not (out / "part-00000-old.snappy.parquet").exists()
    assert sorted(os.listdir(tmp_path)) == ["bin", "scores.parquet"]  # nothing staged left beside it


def assert_one_line_error(proc, expect: str, out: str) -> None:
    """Exit 2, the error last on stderr in one line holding ``expect``, no traceback, no ``out``."""
    report = proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.returncode == 2, report
    assert proc.stderr.splitlines()[-1].startswith("error: ") and expect in proc.stderr.splitlines()[-1], report
    assert "Traceback" not in proc.stderr and len(proc.stderr.splitlines()) < 20, report
    assert os.listdir(os.path.dirname(out)) == [], "left behind: " + str(os.listdir(os.path.dirname(out)))


def with_id_out_of_range(dataset: str, tmp_path) -> tuple[str, str]:  # noqa: F811
    """A copy of ``dataset`` whose test row 2500 has id 1234 in cat_3 (cardinality 1000), and that file."""
    bad = tmp_path / "bad"
    shutil.copytree(dataset, bad)
    cat = FeatureSpec.from_yaml(str(bad)).paths("test").categorical[3]
    ids = np.fromfile(cat, np.int16)
    ids[2500] = 1234
    ids.tofile(cat)
    return str(bad), cat


def test_cli_names_an_id_out_of_range_by_file_and_row_and_writes_nothing(dataset, trained, cli, tmp_path):  # noqa: F811
    _, model_path, _ = trained
    bad, cat = with_id_out_of_range(dataset, tmp_path)
    out = tmp_path / "scores" / "out.parquet"
    out.parent.mkdir()
    proc = cli("dlrm.scripts.spark_score", "--model", model_path, "--dataset", bad, "--split", "test",
               "--output", str(out), "--spark_master", "local[2]", check=False)
    assert_one_line_error(proc, f"{cat}: categorical feature", str(out))
    assert "has id 1234 at row 2500, outside [0, cardinality=1000)" in proc.stderr.splitlines()[-1]
    # the option it offers: a model that does not map ids refuses it at once
    proc = cli("dlrm.scripts.spark_score", "--model", model_path, "--dataset", bad, "--split", "test",
               "--output", str(out), "--hash_indices", check=False)
    assert_one_line_error(proc, "does not map ids outside its tables", str(out))


def test_a_model_that_maps_ids_scores_ids_out_of_range_with_hash_indices(
        spark, dataset, trained, tmp_path):  # noqa: F811
    _, model_path, _ = trained
    bad, _ = with_id_out_of_range(dataset, tmp_path)
    spec = FeatureSpec.from_yaml(bad)
    config = DLRMConfig(spec.num_numerical, list(spec.cardinalities), embedding_dim=8, bottom_mlp_sizes=[16, 8],
                        top_mlp_sizes=[32, 16, 1], hash_indices=True)
    hashing = str(tmp_path / "hashing.onnx")
    export_onnx(DLRM(config).eval(), hashing)
    assert model_maps_any_id(hashing) and not model_maps_any_id(model_path)
    scored = score(read_dataset(spark, bad, "test", hash_indices=True), hashing).toPandas()
    assert len(scored) == 3000 and scored["cat_3"][2500] == 1234 and scored[OUTPUT].notna().all()


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


@pytest.fixture(scope="module")
def criteo_trained(criteo_dataset, tmp_path_factory, cli):  # noqa: F811
    """A model of the preprocessed Criteo rows trained for 6 steps, its ONNX export, and its test AUC."""
    _, out = criteo_dataset
    root = tmp_path_factory.mktemp("criteo_trained")
    ckpt, test_log = str(root / "ckpt"), str(root / "test.json")
    common = ["--dataset", str(out), *MODEL, "--batch_size", "128", "--test_batch_size", "128", "--lr", "0.5"]
    cli("dlrm.scripts.main", *common, "--max_steps", "6", "--save_checkpoint_path", ckpt,
        "--log_path", str(root / "train.json"))
    cli("dlrm.scripts.main", *common, "--mode", "test", "--load_checkpoint_path", ckpt, "--log_path", test_log)
    model_path = str(root / "model.onnx")
    export_onnx(build_inference_model(ckpt), model_path)
    return model_path, log_records(test_log, "summary")[0]["auc"]


def test_raw_criteo_rows_score_as_their_preprocessed_rows(
        spark, criteo_dataset, criteo_trained, tmp_path):  # noqa: F811
    """Raw TSV lines of the test day, transformed in Spark with preprocessing's own transform and
    the dataset's vocabulary, then scored: the AUC of --mode test on the preprocessed split."""
    inputs, out = criteo_dataset
    model_path, test_auc = criteo_trained
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
    assert roc_auc_score(scored["label"], scored[OUTPUT]) == pytest.approx(test_auc, abs=1e-6)


def test_a_malformed_raw_line_is_named_by_its_file_and_line_or_left_out(spark, criteo_dataset, tmp_path):  # noqa: F811
    """Lines read in file splits of 2 KB, in Arrow batches of 7 rows: a malformed line is named by
    its file and its line number there (in a split that starts mid-file; in a gzipped file, read
    whole); with on_error='skip' it is left out."""
    inputs, out = criteo_dataset
    lines = _split_lines(inputs)["test"]
    settings = {"spark.sql.files.maxPartitionBytes": "2048", "spark.sql.execution.arrow.maxRecordsPerBatch": "7"}
    for key, value in settings.items():
        spark.conf.set(key, value)
    try:
        for n, (line, gzipped) in enumerate([(len(lines) // 2, False), (40, True)]):
            data = b"\n".join(lines[:line - 1] + [b"0\tnot a row"] + lines[line:]) + b"\n"
            path = tmp_path / f"day_{n}{'.gz' if gzipped else ''}"
            path.write_bytes(gzip.compress(data) if gzipped else data)
            rows = prepare_raw_rows(read_raw_lines(spark, str(path)), str(out))
            with pytest.raises(Exception) as caught:
                rows.count()
            assert str(task_error(caught.value)).startswith(f"{path}, line {line}: expected 40 tab-separated fields")
        assert spark.read.text(str(tmp_path / "day_0")).rdd.getNumPartitions() > 3  # split indeed
        kept = prepare_raw_rows(read_raw_lines(spark, str(tmp_path / "day_0")), str(out), on_error="skip")
        assert kept.count() == len(lines) - 1
    finally:
        for key in settings:
            spark.conf.unset(key)


def test_cli_names_a_malformed_raw_line_and_writes_nothing(criteo_dataset, criteo_trained, cli, tmp_path):  # noqa: F811
    inputs, dataset_dir = criteo_dataset
    model_path, _ = criteo_trained
    raw = tmp_path / "raw" / "day_23"
    raw.parent.mkdir()
    lines = _split_lines(inputs)["test"]
    raw.write_bytes(b"\n".join(lines[:9] + [b"0\tnot a row"] + lines[10:]) + b"\n")
    out = tmp_path / "scores" / "out.parquet"
    out.parent.mkdir()
    proc = cli("dlrm.scripts.spark_score", "--model", model_path, "--dataset", str(dataset_dir), "--raw", str(raw),
               "--output", str(out), "--spark_master", "local[2]", check=False)
    assert_one_line_error(proc, f"{raw}, line 10: expected 40 tab-separated fields, got 2", str(out))
    assert "--on_error skip" in proc.stderr.splitlines()[-1]


def test_raw_rows_of_a_dataset_without_vocabulary_are_refused_on_the_driver(spark, dataset):  # noqa: F811
    from dlrm.engine.errors import DatasetError

    raw = spark.createDataFrame([("0" + "\t" * 39,)], "value string")
    with pytest.raises(DatasetError, match="vocabulary"):
        prepare_raw_rows(raw, dataset)


def test_raw_rows_need_lines_or_the_forty_fields(spark, criteo_dataset):  # noqa: F811
    _, out = criteo_dataset
    with pytest.raises(ValueError, match="give TSV lines in column 'value'"):
        prepare_raw_rows(spark.createDataFrame([("x", 1)], "label string, I1 int"), str(out))
