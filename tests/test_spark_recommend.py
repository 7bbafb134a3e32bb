"""Top-K recommendations in Spark (local mode, 2 partitions) are recommender_predict's: the same
text file byte for byte from the same CSR dataset, the same lists from DSSTNE text and as
Parquet, and scores that a plain forward of the checkpoint's tensors gives (float64, by hand);
the best/last checkpoint as predict chooses it; bad input fails in one line."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import run_cli
from test_recommender_cli import K, USERS, read_csr, read_index
from test_recommender_cli import data, trained  # noqa: F401 (module fixtures: a split, a 4-step and a 2-step run)

pytest.importorskip("pyspark")

from dlrm.engine.errors import DatasetError  # noqa: E402
from dlrm.spark.job_io import task_error, write_parquet  # noqa: E402
from dlrm.spark.recommend import (  # noqa: E402
    RECOMMENDATIONS, read_csr_histories, read_text_histories, recommend, recommend_text, write_text,
)


@pytest.fixture(scope="module")
def run(data, trained):  # noqa: F811
    """A training run as predict sees it: its last checkpoint at ``ae`` (4 steps) and the best of its
    validation at ``ae.best`` (here the 2-step run), and predict's output, which uses ``ae.best``."""
    root, out = data["root"], data["out"]
    ae = str(root / "ae")
    shutil.copytree(trained["ckpt"], ae)
    shutil.copytree(trained["half"], ae + ".best")
    # Two runs stand in for one here: the .best is taken only from the latest checkpoint's run.
    meta_of = {p: os.path.join(p, "meta.json") for p in (ae, ae + ".best")}
    best_meta = json.load(open(meta_of[ae + ".best"]))
    best_meta["run_config"]["run_id"] = json.load(open(meta_of[ae]))["run_config"]["run_id"]
    with open(meta_of[ae + ".best"], "w") as f:
        json.dump(best_meta, f)
    paths = {"ae": ae, "input": os.path.join(out, "input"), "items": os.path.join(out, "features_index.txt"),
             "users": os.path.join(out, "samples_index.txt"), "predicted": str(root / "predicted.txt")}
    proc = run_cli("dlrm.scripts.recommender_predict", "--checkpoint", ae, "--input", paths["input"], "--k", str(K),
                   "--features_index", paths["items"], "--samples_index", paths["users"], "--output",
                   paths["predicted"], "--device", "cpu")
    assert f"model: {ae}.best" in proc.stdout, proc.stdout
    return paths


def parse_lines(path: str) -> list[tuple[str, list[str], list[float]]]:
    """DSSTNE's predict output: (user, items, scores) per line."""
    out = []
    for line in open(path, encoding="utf-8").read().splitlines():
        user, _, fields = line.partition("\t")
        pairs = [field.split(",") for field in fields.split(":")] if fields else []
        out.append((user, [name for name, _ in pairs], [float(score) for _, score in pairs]))
    return out


def test_cli_writes_predicts_file_byte_for_byte(run, tmp_path):
    """Two tasks of 150 users (one after the other: one Python worker, one model load), over an
    older file of recommendations, which --overwrite replaces whole (a file of anything else is
    refused: tests/test_hostile_outputs.py)."""
    out = tmp_path / "recs.txt"
    out.write_text("stale\titem1,0.5\n")
    proc = run_cli("dlrm.scripts.spark_recommend", "--checkpoint", run["ae"], "--input", run["input"],
                   "--features_index", run["items"], "--samples_index", run["users"], "--k", str(K),
                   "--users_per_partition", "150", "--output", str(out), "--spark_master", "local[1]", "--overwrite")
    assert f"model: {run['ae']}.best" in proc.stdout and f"wrote {out}: {USERS} users" in proc.stdout, proc.stdout
    assert out.read_bytes() == open(run["predicted"], "rb").read()
    assert os.listdir(tmp_path) == ["recs.txt"]  # nothing staged left beside it


def test_a_linear_model_gives_predicts_file_byte_for_byte(run, tmp_path):
    """The default model (linear item-item) of the same input: Spark's lists are predict's."""
    ckpt = str(tmp_path / "linear")
    run_cli("dlrm.scripts.recommender_train", "--input", run["input"], "--save_checkpoint_path", ckpt)
    args = ["--input", run["input"], "--features_index", run["items"], "--samples_index", run["users"], "--k", str(K)]
    run_cli("dlrm.scripts.recommender_predict", "--load_checkpoint_path", ckpt, *args, "--output",
            str(tmp_path / "predicted.txt"))
    proc = run_cli("dlrm.scripts.spark_recommend", "--load_checkpoint_path", ckpt, *args, "--users_per_partition",
                   "150", "--output", str(tmp_path / "recs.txt"), "--spark_master", "local[1]")
    assert "linear item-item model" in proc.stdout, proc.stdout
    assert (tmp_path / "recs.txt").read_bytes() == (tmp_path / "predicted.txt").read_bytes()


def test_text_histories_give_predicts_lines_and_parquet_its_lists(spark, data, run, tmp_path):  # noqa: F811
    """The input split written as DSSTNE text (two files, read in the order given: 2 tasks); its
    text lines are predict's file, and its Parquet lists are predict's, scores to float32."""
    rows, _, _ = read_csr(run["input"])
    names = {i: name for name, i in read_index(run["items"]).items()}
    users = sorted(read_index(run["users"]), key=read_index(run["users"]).get)
    lines = [f"{user}\t{':'.join(names[int(i)] for i in row)}\n" for user, row in zip(users, rows)]
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_text("".join(lines[:100]) + "\n")  # a blank line is skipped, as recommender_generate skips it
    second.write_text("".join(lines[100:]))
    histories = read_text_histories(spark, [str(first), str(second)])
    assert histories.rdd.getNumPartitions() == 2
    text = str(tmp_path / "recs.txt")
    assert write_text(recommend_text(histories, run["ae"], K, features_index=run["items"]), text) == USERS
    assert open(text, "rb").read() == open(run["predicted"], "rb").read()

    parquet = str(tmp_path / "recs.parquet")
    write_parquet(recommend(histories, run["ae"], K, features_index=run["items"]), parquet)
    table = pd.read_parquet(parquet)
    assert list(table.columns) == ["user", RECOMMENDATIONS] and len(table) == USERS
    checked = 0
    for (user, items, scores), got_user, got in zip(parse_lines(run["predicted"]), table["user"],
                                                  table[RECOMMENDATIONS]):
        assert got_user == user and len(got) == K
        got_scores = np.array([entry["score"] for entry in got], np.float32)
        np.testing.assert_allclose(got_scores, scores, rtol=6e-6)  # predict wrote 6 significant digits
        assert (np.diff(got_scores) <= 0).all()
        if (np.diff(got_scores) < 0).all():  # no tie: the order is fixed
            assert [entry["item"] for entry in got] == items
            checked += 1
    assert checked > USERS * 0.9


def forward(checkpoint: str, rows: list[list[int]], weights: list[list[float] | None]) -> np.ndarray:
    """Sigmoid(W_out sigmoid(sum_i w_i W_in[i] + b_in) + b_out) for each history, in float64, from the
    checkpoint's tensor files (the network of test_recommender_cli: one hidden layer, sigmoids)."""
    def load(name):
        return torch.load(os.path.join(checkpoint, name), map_location="cpu", weights_only=True)

    (inputs,) = [n for n in os.listdir(checkpoint) if n.startswith("input_rows_")]
    (outputs,) = [n for n in os.listdir(checkpoint) if n.startswith("output_rows_")]
    w_in, b_in = load(inputs)["weight"].double(), load("replicated.pt")["params"]["input_bias"].double()
    w_out, b_out = load(outputs)["weight"].double(), load(outputs)["bias"].double()
    scores = []
    for row, w in zip(rows, weights):
        x = torch.zeros(w_in.shape[0], dtype=torch.float64)
        for i, v in zip(row, w if w is not None else [1.0] * len(row)):
            x[i] += v
        scores.append(torch.sigmoid(w_out @ torch.sigmoid(x @ w_in + b_in) + b_out).numpy())
    return np.array(scores)


@pytest.mark.parametrize("best", [True, False])
def test_scores_are_a_plain_forward_of_the_chosen_checkpoint(spark, run, best):
    """Column numbers as items, with weights, an empty and a null history, and an exclusion
    column; ``best`` picks ``ae.best`` or ``ae`` as predict's --best/--nobest do."""
    rows = [[3, 17, 41, 8], [], None, [5, 5, 12], [0, 59]]
    weights = [None, None, None, [2.0, 0.5, 1.0], [1.0, 3.0]]
    exclude = [[1, 2], None, [7], [], [17]]
    histories = spark.createDataFrame(list(zip(range(100, 105), rows, weights, exclude)),
                                      "id long, history array<int>, rating array<double>, bought array<long>")
    got = recommend(histories, run["ae"], K, best=best, user_column="id", items_column="history",
                    weights_column="rating", exclude_column="bought").toPandas()
    assert got["id"].tolist() == list(range(100, 105))
    expected = forward(run["ae"] + (".best" if best else ""), [r or [] for r in rows], weights)
    other = forward(run["ae"] + ("" if best else ".best"), [r or [] for r in rows], weights)
    assert np.abs(expected - other).max() > 1e-3  # the two checkpoints differ: the choice is seen
    for user, (row, bought, recs) in enumerate(zip(rows, exclude, got[RECOMMENDATIONS])):
        seen = set(row or []) | set(bought or [])
        unseen = [i for i in range(expected.shape[1]) if i not in seen]
        ranked = sorted(unseen, key=lambda i: (-expected[user, i], i))[:K]
        items = [int(entry["item"]) for entry in recs]
        assert not seen & set(items)
        np.testing.assert_allclose([entry["score"] for entry in recs], expected[user, items], atol=1e-6)
        np.testing.assert_allclose(expected[user, items], expected[user, ranked], atol=1e-6)


def test_unknown_items_and_malformed_lines_fail_naming_them_or_are_skipped(spark, run, tmp_path):
    histories = spark.createDataFrame([("u1", ["item3", "no_such_item", "item7"])], "user string, items array<string>")
    with pytest.raises(Exception) as failed:
        recommend(histories, run["ae"], K, features_index=run["items"]).collect()
    error = task_error(failed.value)
    assert isinstance(error, DatasetError) and str(error).startswith("user 'u1': item 'no_such_item' is not one"), error
    skipped = recommend(histories, run["ae"], K, features_index=run["items"], on_error="skip").collect()
    known = spark.createDataFrame([("u1", ["item3", "item7"])], "user string, items array<string>")
    assert skipped == recommend(known, run["ae"], K, features_index=run["items"]).collect()
    with pytest.raises(ValueError, match="give the features index that names them"):
        recommend(histories, run["ae"], K)  # names without an index: refused on the driver

    for bad in (float("nan"), float("inf"), 1e300):  # 1e300: a double beyond float32
        weighted = spark.createDataFrame([("u1", ["item3", "item7"], [1.0, bad])],
                                         "user string, items array<string>, weights array<double>")
        with pytest.raises(Exception) as failed:
            recommend(weighted, run["ae"], K, features_index=run["items"]).collect()
        error = task_error(failed.value)
        assert isinstance(error, DatasetError), failed.value
        assert str(error).startswith(("user 'u1': weight inf", "user 'u1': weight nan")), error
        assert "is not a finite number" in str(error) and "\n" not in str(error)

    text = tmp_path / "histories.txt"
    text.write_text("u1\titem3:item7\nu2 item3\n")
    with pytest.raises(Exception) as failed:
        read_text_histories(spark, str(text)).collect()
    assert str(task_error(failed.value)).startswith(f"{text}:2: malformed line 'u2 item3': no tab")
    assert [r.user for r in read_text_histories(spark, str(text), on_error="skip").collect()] == ["u1"]


def assert_one_line_error(proc, expect: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert expect in lines[0], lines


def test_cli_refuses_bad_paths_and_flags_in_one_line_before_spark(run, tmp_path):
    out = str(tmp_path / "recs.txt")
    base = ("dlrm.scripts.spark_recommend", "--output", out)
    help_ = run_cli("dlrm.scripts.spark_recommend", "--help")
    assert help_.returncode == 0 and "--checkpoint" in help_.stdout and "--output_format" in help_.stdout
    missing = str(tmp_path / "no_ckpt")
    assert_one_line_error(run_cli(*base, "--checkpoint", missing, "--input", run["input"], check=False),
                          f"No recommender checkpoint at {missing}")
    assert_one_line_error(run_cli(*base, "--checkpoint", run["ae"], "--input", str(tmp_path / "nope"), check=False),
                          f"--input {tmp_path / 'nope'} does not exist")
    assert_one_line_error(run_cli(*base, "--checkpoint", run["ae"], "--text", str(tmp_path / "nope.txt"),
                                  "--features_index", run["items"], check=False), "--text")
    assert os.listdir(tmp_path) == []
