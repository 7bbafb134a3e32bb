"""The recommender's command-line tools run as a user runs them (real subprocesses): generate a
held-out split, train, predict, evaluate; resume; DSSTNE text in. Outputs are read back with
numpy and plain file reads, not through the library that wrote them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REPO, logged_scalars, run_cli, tensorboard_scalars
import warm_python

NETWORK = {
    "Kind": "AutoEncoder",
    "Denoising": {"p": 0.1},
    "Layers": [
        {"Kind": "Input", "N": "auto", "DataSet": "input", "Sparse": True},
        {"Kind": "Hidden", "N": 16, "Activation": "Sigmoid", "pDropout": 0.1},
        {"Kind": "Output", "N": "auto", "DataSet": "output", "Activation": "Sigmoid"},
    ],
    "ErrorFunction": "ScaledMarginalCrossEntropy",
    "Optimizer": {"Kind": "SGD", "Alpha": 0.05},
}
USERS, ITEMS, K = 300, 60, 5
TRAIN = ("--batch_size", "64", "--log_every_steps", "1", "--device", "cpu", "--optimizer", "adam", "--alpha", "0.01")


def read_csr(path: str) -> tuple[list[np.ndarray], np.ndarray | None, int]:
    """(rows of item ids, values or None, n_features) straight from the files."""
    with open(os.path.join(path, "header.json")) as f:
        header = json.load(f)
    offsets = np.fromfile(os.path.join(path, "offsets.bin"), "<i8")
    indices = np.fromfile(os.path.join(path, "indices.bin"), "<i4")
    values = np.fromfile(os.path.join(path, "values.bin"), "<f4") if header["has_values"] else None
    assert offsets.shape[0] == header["n_samples"] + 1 and offsets[-1] == indices.shape[0] == header["nnz"]
    rows = [indices[offsets[r]:offsets[r + 1]] for r in range(header["n_samples"])]
    return rows, values, header["n_features"]


def read_index(path: str) -> dict[str, int]:
    with open(path, encoding="utf-8") as f:
        return {name: int(i) for name, i in (line.rstrip("\n").split("\t") for line in f if line.strip())}


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint's pieces (weights and optimizer state), by file and key."""
    out = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            out[prefix] = value

    for name in sorted(os.listdir(path)):
        if name.endswith(".pt"):
            walk(name, torch.load(os.path.join(path, name), map_location="cpu", weights_only=True))
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A synthetic held-out split and a network file."""
    root = tmp_path_factory.mktemp("recommender_cli")
    out = str(root / "data")
    proc = run_cli("dlrm.scripts.recommender_generate", "--synthetic", "--users", str(USERS), "--items", str(ITEMS),
                   "--interactions", str(USERS * 25), "--seed", "3", "--heldout_fraction", "0.2",
                   "--output", out)
    assert f"{USERS:,} users, {ITEMS:,} items" in proc.stdout, proc.stdout
    network = root / "network.json"
    network.write_text(json.dumps(NETWORK))
    return {"root": root, "out": out, "network": str(network)}


def run_together(*commands: tuple[str, ...]) -> list[subprocess.CompletedProcess]:
    """``python -m`` commands run side by side (each mostly imports torch on one core), as run_cli runs one."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [warm_python.Popen([sys.executable, "-m", *c], cwd=REPO, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for c in commands]
    done = []
    for command, proc in zip(commands, procs):
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{' '.join(command)} exited {proc.returncode}\n{stdout}\n{stderr}"
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return done


def train_args(data, ckpt: str, steps: int) -> tuple[str, ...]:
    return ("dlrm.scripts.recommender_train", "--network", data["network"], "--input",
            os.path.join(data["out"], "input"), "--checkpoint_path", ckpt, "--max_steps", str(steps), *TRAIN)


@pytest.fixture(scope="module")
def trained(data):
    """An uninterrupted 4-step run (logged), and beside it the first 2 steps of the resumed one."""
    ckpt, half = str(data["root"] / "ckpt4"), str(data["root"] / "ckpt2+2")
    log, board = str(data["root"] / "train4.json"), str(data["root"] / "board")
    proc, _ = run_together((*train_args(data, ckpt, 4), "--log_path", log, "--tensorboard_dir", board),
                           train_args(data, half, 2))
    assert "Finished (max_steps) after 4 steps" in proc.stdout, proc.stdout
    records = [json.loads(line) for line in open(log)]
    assert [r["type"] for r in records if r["type"] == "train"] == ["train"] * 4
    assert [r["type"] for r in records[:2]] == ["header", "flags"] and records[1]["lambda"] is None and records[-1]["type"] == "summary"
    return {"ckpt": ckpt, "half": half, "log": log, "board": board}


def test_tensorboard_holds_the_logged_curves(trained):
    """--tensorboard_dir: every number of the log's train and validation records, at its step, as
    TensorBoard reads it back."""
    scalars = tensorboard_scalars(trained["board"])
    logged = logged_scalars(trained["log"], ("train", "validation"))
    assert "train/loss" in logged and set(scalars) == set(logged)
    for tag, points in logged.items():
        assert [s for s, _ in scalars[tag]] == [s for s, _ in points], tag
        np.testing.assert_allclose([v for _, v in scalars[tag]], [v for _, v in points], rtol=1e-6, err_msg=tag)


def test_generate_writes_a_heldout_split_whose_halves_make_the_whole(data):
    out = data["out"]
    whole, _, n = read_csr(os.path.join(out, "all"))
    kept, _, n_kept = read_csr(os.path.join(out, "input"))
    held, _, n_held = read_csr(os.path.join(out, "heldout"))
    assert n == n_kept == n_held == ITEMS and len(whole) == len(kept) == len(held) == USERS
    for w, a, b in zip(whole, kept, held):
        assert sorted(w) == sorted(np.concatenate([a, b])) and len(a) >= 1
        assert len(b) == int(np.floor(0.2 * len(w) + 0.5))
    assert len(read_index(os.path.join(out, "features_index.txt"))) == ITEMS
    assert len(read_index(os.path.join(out, "samples_index.txt"))) == USERS


def test_predict_recommends_k_unseen_items_per_user_best_first(cli, data, trained):
    out = data["out"]
    recs = str(data["root"] / "recs.txt")
    scores_path = str(data["root"] / "scores.npy")
    proc = cli("dlrm.scripts.recommender_predict", "--checkpoint", trained["ckpt"], "--input", os.path.join(out, "input"),
               "--k", str(K), "--output", recs, "--features_index", os.path.join(out, "features_index.txt"),
               "--samples_index", os.path.join(out, "samples_index.txt"),
               "--scores_path", scores_path, "--device", "cpu")
    assert f"wrote {recs}: {USERS} users" in proc.stdout, proc.stdout
    assert re.search(rf"\npredicted {USERS} users in [0-9.]+ s \([0-9,]+ users/s\)\n$", proc.stdout), proc.stdout
    items, users = read_index(os.path.join(out, "features_index.txt")), read_index(os.path.join(out, "samples_index.txt"))
    history, _, _ = read_csr(os.path.join(out, "input"))
    raw = np.load(scores_path)
    assert raw.shape == (USERS, ITEMS) and raw.dtype == np.float32
    lines = open(recs, encoding="utf-8").read().splitlines()
    assert len(lines) == USERS and "predicted" not in open(recs, encoding="utf-8").read()
    tied_at_3_decimals = 0
    for row, line in enumerate(lines):
        user, _, fields = line.partition("\t")
        assert users[user] == row
        pairs = [field.split(",") for field in fields.split(":")]
        assert len(pairs) == K and all(len(p) == 2 for p in pairs), line
        ids = [items[name] for name, _ in pairs]
        scores = [float(s) for _, s in pairs]
        assert len(set(ids)) == K and not set(ids) & set(history[row].tolist()), line
        assert all(a >= b for a, b in zip(scores, scores[1:])), line
        # 6 significant digits by default: a user's top K apart on paper where DSSTNE's %.3f ties them.
        assert len({s for _, s in pairs}) == K, line
        tied_at_3_decimals += len({f"{v:.3f}" for v in raw[row, ids]}) < K
        # The best unseen items by the dumped raw scores (ties aside).
        unseen = np.setdiff1d(np.arange(ITEMS), history[row])
        best = unseen[np.argsort(-raw[row, unseen], kind="stable")[:K]]
        np.testing.assert_allclose(np.sort(raw[row, ids]), np.sort(raw[row, best]), atol=1e-6)
        np.testing.assert_allclose(scores, raw[row, ids], rtol=6e-6)
    assert tied_at_3_decimals > 0  # 23 users of 300 here: the case the default format is for


def test_predict_writes_dsstne_score_format_on_request(cli, data, trained):
    out = data["out"]
    recs, scores_path = str(data["root"] / "recs_dsstne.txt"), str(data["root"] / "scores_dsstne.npy")
    args = ("dlrm.scripts.recommender_predict", "--checkpoint", trained["ckpt"], "--input", os.path.join(out, "input"),
            "--k", str(K), "--output", recs, "--device", "cpu", "--features_index=")  # column numbers
    cli(*args, "--score_format", "4.3f", "--scores_path", scores_path)  # as DSSTNE's predict -p 4.3f
    raw = np.load(scores_path)
    for row, line in enumerate(open(recs, encoding="utf-8").read().splitlines()):
        pairs = [field.split(",") for field in line.partition("\t")[2].split(":")]
        assert [s for _, s in pairs] == [f"{raw[row, int(i)]:.3f}" for i, _ in pairs], line
    refused = cli(*args, "--score_format", "%.3f:", "--overwrite", check=False)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert lines[0] == "error: --score_format '%.3f:': give a printf format of one float, e.g. %.6g (the default) or " \
                       "%4.3f (DSSTNE's), with at most 17 digits of precision and a width of at most 32", lines


def test_evaluate_reports_the_model_and_four_baselines(cli, data, trained):
    out = data["out"]
    metrics = str(data["root"] / "metrics.json")
    proc = cli("dlrm.scripts.recommender_evaluate", "--input", os.path.join(out, "input"), "--heldout",
               os.path.join(out, "heldout"), "--checkpoint", trained["ckpt"], "--k", "1,5", "--output", metrics,
               "--mf_factors", "4", "--mf_iterations", "2", "--knn_neighbours", "10", "--ease_lambda", "20",
               "--device", "cpu")
    report = json.load(open(metrics))
    assert report["k"] == [1, 5] and list(report["results"]) == ["model", "popularity", "itemknn", "mf", "ease"]
    for name, row in report["results"].items():
        for k in (1, 5):
            for metric in ("precision", "recall", "ndcg", "coverage"):
                assert 0.0 <= row[f"{metric}@{k}"] <= 1.0, (name, metric, k)
        assert row["users"] == USERS
        assert proc.stdout.count(f"\n{name} ") == 1, proc.stdout
    assert "P@5" in proc.stdout and "NDCG@5" in proc.stdout and "cov@5" in proc.stdout


def test_evaluate_refuses_ease_above_its_memory_bound_in_one_line(cli, data):
    out = data["out"]
    proc = cli("dlrm.scripts.recommender_evaluate", "--input", os.path.join(out, "input"), "--heldout",
               os.path.join(out, "heldout"), "--baselines", "popularity,ease", "--ease_max_memory_gb", "0", check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and not proc.stdout, (proc.stdout, proc.stderr)
    assert lines[0] == (f"error: --baselines ease: a catalogue of {ITEMS} items needs 42.2 KiB for EASE (items^2 x 12 "
                        f"bytes), over --ease_max_memory_gb 0; raise --ease_max_memory_gb if the machine has the "
                        f"memory, leave ease out (--baselines popularity), or evaluate a smaller catalogue"), lines


def test_resume_continues_exactly(cli, data, trained):
    args = train_args(data, trained["half"], 2)  # its first 2 steps ran beside the 4-step run
    refused = cli(*args, check=False)  # a checkpoint is there and no --resume: kept, not replaced
    assert refused.returncode == 2 and "pass --resume" in refused.stderr, refused.stderr
    proc = cli(*args, "--resume")
    assert "resuming at step 2" in proc.stdout and "after 4 steps" in proc.stdout, proc.stdout
    resumed, uninterrupted = read_checkpoint(trained["half"]), read_checkpoint(trained["ckpt"])
    assert resumed.keys() == uninterrupted.keys() and any("exp_avg" in key for key in resumed)
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key


def test_generate_text_round_trip(cli, tmp_path):
    lines = ["alice\tm1:m2:m3", "bob\tm2,2.5:m4,0.5", "", "carol\t", "dave\tm4:m1"]
    text = tmp_path / "ratings.txt"
    text.write_text("\n".join(lines) + "\n")
    out = str(tmp_path / "out")
    proc = cli("dlrm.scripts.recommender_generate", "--text", str(text), "--output", out)
    assert "4 users, 4 items" in proc.stdout and "7 interactions" in proc.stdout, proc.stdout
    features, samples = read_index(os.path.join(out, "features_index.txt")), read_index(os.path.join(out, "samples_index.txt"))
    assert features == {"m1": 0, "m2": 1, "m3": 2, "m4": 3} and samples == {"alice": 0, "bob": 1, "carol": 2, "dave": 3}
    rows, values, n = read_csr(os.path.join(out, "all"))
    assert n == 4 and not os.path.exists(os.path.join(out, "input"))
    names = {v: k for k, v in features.items()}
    got, position = [], 0
    for user, row in zip(samples, rows):
        fields = []
        for item in row:
            value = values[position]
            fields.append(names[item] if value == 1.0 else f"{names[item]},{value:g}")
            position += 1
        got.append(f"{user}\t{':'.join(fields)}")
    assert got == [line for line in lines if line]

    # Another file into the same features index: known items keep their columns.
    more = tmp_path / "more.txt"
    more.write_text("erin\tm9:m2\n")
    proc = cli("dlrm.scripts.recommender_generate", "--text", str(more), "--output", str(tmp_path / "out2"),
               "--features_index", os.path.join(out, "features_index.txt"))
    assert read_index(os.path.join(out, "features_index.txt")) == {**features, "m9": 4}
    rows, _, n = read_csr(str(tmp_path / "out2" / "all"))
    assert n == 5 and [r.tolist() for r in rows] == [[4, 1]]


def test_a_network_file_with_an_unknown_key_is_one_line_naming_it(cli, tmp_path):
    network = tmp_path / "network.json"
    network.write_text(json.dumps({**NETWORK, "LearningRate": 0.1}))
    proc = cli("dlrm.scripts.recommender_train", "--network", str(network), "--input", str(tmp_path / "missing"),
               "--checkpoint_path", str(tmp_path / "ckpt"), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: --network {network}: 'LearningRate': unknown key"), lines
    assert not os.path.exists(tmp_path / "ckpt")


def test_dlrm_flag_names_and_the_earlier_ones_set_the_same(cli, data, trained):
    """--save_checkpoint_path, --print_freq and --base_device (dlrm.scripts.main's names) train the
    run --checkpoint_path, --log_every_steps and --device train (the 4-step run above), and
    --load_checkpoint_path reads it as --checkpoint does; the log records each setting once, under
    its name in the run's config (RecommenderConfig: log_every_steps for --print_freq)."""
    ckpt, log = str(data["root"] / "ckpt_new_names"), str(data["root"] / "new_names.json")
    new = [a.replace("--log_every_steps", "--print_freq").replace("--device", "--base_device") for a in TRAIN]
    cli("dlrm.scripts.recommender_train", "--network", data["network"], "--input", os.path.join(data["out"], "input"),
        "--save_checkpoint_path", ckpt, "--max_steps", "4", "--log_path", log, *new)
    resumed, uninterrupted = read_checkpoint(ckpt), read_checkpoint(trained["ckpt"])
    assert resumed.keys() == uninterrupted.keys()
    for key, value in uninterrupted.items():
        assert torch.equal(resumed[key], value), key
    (flags_record,) = [r for r in map(json.loads, open(log)) if r["type"] == "flags"]
    assert flags_record["save_checkpoint_path"] == ckpt and flags_record["log_every_steps"] == 1
    assert not {"checkpoint_path", "print_freq", "device"} & set(flags_record)
    recs = str(data["root"] / "recs_new_names.txt")
    proc = cli("dlrm.scripts.recommender_predict", "--load_checkpoint_path", ckpt, "--input",
               os.path.join(data["out"], "input"), "--k", str(K), "--output", recs, "--base_device", "cpu")
    lines = open(recs, encoding="utf-8").read().splitlines()
    assert len(lines) == USERS
    # Without --features_index and --samples_index: the indexes recommender_generate wrote beside --input.
    assert "(beside the input)" in proc.stdout, proc.stdout
    items = read_index(os.path.join(data["out"], "features_index.txt"))
    users = read_index(os.path.join(data["out"], "samples_index.txt"))
    assert [line.split("\t")[0] for line in lines] == sorted(users, key=users.get)
    assert all(entry.split(",")[0] in items for line in lines for entry in line.split("\t")[1].split(":"))
