"""Validation inside the recommender's training, and the run's endings as DLRM's: the split
against its definition, validation metrics against a plain float64 reference, early stopping
with the best checkpoint kept, exact resume with validation, a real SIGTERM and Ctrl-C (saved,
exit 143 / 130, resumed exactly), kill -9 then an exact resume from the last checkpoint, an error
mid-run saved and resumed exactly, and an empty dataset refused."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO, run_cli
from dlrm.recommender.csr_dataset import CsrDataset, write_csr
from dlrm.recommender.model import SparseAutoencoder
from dlrm.recommender.network import parse_network
from dlrm.recommender.csr_rows import take_rows
from dlrm.recommender.user_histories import HistoryConfig, generate_user_histories
from dlrm.recommender.validation import ValidationConfig, make_split, validate
import warm_python

NETWORK = {
    "Kind": "AutoEncoder",
    "Layers": [
        {"Kind": "Input", "N": "auto", "DataSet": "input", "Sparse": True},
        {"Kind": "Hidden", "N": 12, "Activation": "Tanh"},
        {"Kind": "Output", "N": "auto", "DataSet": "output", "Activation": "SoftMax"},
    ],
    "ErrorFunction": "CrossEntropy",
    "Optimizer": {"Kind": "Adam", "Alpha": 0.01},
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("validation")
    h = generate_user_histories(HistoryConfig(n_users=400, n_items=50, n_interactions=6000, min_length=2,
                                              n_clusters=5), seed=2)
    write_csr(root / "all", h.rows)
    (root / "network.json").write_text(json.dumps(NETWORK))
    return str(root)


def test_split_follows_its_definition(dataset):
    data = CsrDataset(os.path.join(dataset, "all"))
    cfg = ValidationConfig(user_fraction=0.25, max_users=80, item_fraction=0.3)
    split = make_split(data, cfg, seed=5)
    lengths = np.diff(np.asarray(data.offsets))
    assert len(split.users) == 80 and np.all(np.diff(split.users) > 0)  # 25% of 400 capped at 80, sorted
    held_per_user = np.add.reduceat(split.held.astype(np.int64), np.asarray(data.offsets)[:-1]) * (lengths > 0)
    chosen = np.zeros(len(data), bool)
    chosen[split.users] = True
    assert not held_per_user[~chosen].any()  # only validation users lend items
    want = np.clip(np.rint(0.3 * lengths[split.users]), 1, lengths[split.users] - 1)
    assert np.array_equal(held_per_user[split.users], want)  # their share, at least one, never all
    again = make_split(data, cfg, seed=5)
    assert np.array_equal(again.users, split.users) and np.array_equal(again.held, split.held)
    assert not np.array_equal(make_split(data, cfg, seed=6).held, split.held)


def test_take_rows_with_a_mask_equals_a_plain_filter(dataset):
    data = CsrDataset(os.path.join(dataset, "all"))
    keep = np.random.default_rng(0).random(int(data.offsets[-1])) < 0.6
    samples = np.array([7, 3, 399, 0, 3], dtype=np.int64)
    offsets, indices, _ = take_rows(data, samples, keep)
    offsets_all = np.asarray(data.offsets)
    for r, s in enumerate(samples):
        positions = range(offsets_all[s], offsets_all[s + 1])
        want = [int(data.indices[p]) for p in positions if keep[p]]
        assert indices[offsets[r]:offsets[r + 1]].tolist() == want


def test_validation_metrics_equal_a_plain_float64_reference(dataset):
    data = CsrDataset(os.path.join(dataset, "all"))
    cfg = ValidationConfig(user_fraction=0.2, item_fraction=0.25, k=5, batch_size=7)
    split = make_split(data, cfg, seed=1)
    network = parse_network(NETWORK).resolve(data.n_features, data.n_features)
    model = SparseAutoencoder(network, seed=4, dtype=torch.float64)
    got = validate(model, data, split, cfg)
    # Reference: a dense float64 forward per user, seen items removed, NDCG and precision by hand.
    offsets = np.asarray(data.offsets)
    ndcgs, precisions = [], []
    with torch.no_grad():
        for u in split.users:
            positions = np.arange(offsets[u], offsets[u + 1])
            items = np.asarray(data.indices)[positions]
            seen, held = items[~split.held[positions]], set(items[split.held[positions]].tolist())
            x = torch.zeros(data.n_features, dtype=torch.float64)
            x[torch.from_numpy(seen.astype(np.int64))] = 1.0
            h = torch.tanh(x @ model.input_weight + model.input_bias)
            scores = (h @ model.output_weight.T + model.output_bias).numpy().copy()
            scores[seen] = -np.inf
            top = sorted(range(data.n_features), key=lambda i: (-scores[i], i))[:5]
            hits = [1.0 if i in held else 0.0 for i in top]
            ideal = sum(1 / math.log2(r + 2) for r in range(min(len(held), 5)))
            ndcgs.append(sum(hit / math.log2(r + 2) for r, hit in enumerate(hits)) / ideal)
            precisions.append(sum(hits) / 5)
    assert got.users == len(split.users)
    assert got.ndcg == pytest.approx(np.mean(ndcgs), abs=1e-12)
    assert got.precision == pytest.approx(np.mean(precisions), abs=1e-12)


def _train(dataset: str, ckpt: str, *args: str, log: str | None = None) -> subprocess.CompletedProcess:
    return run_cli("dlrm.scripts.recommender_train", "--network", os.path.join(dataset, "network.json"), "--input",
                   os.path.join(dataset, "all"), "--checkpoint_path", ckpt, "--batch_size", "50", "--device", "cpu",
                   "--log_every_steps", "0", *(["--log_path", log] if log else []), *args, check=False)


def _records(log: str, kind: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "time"} for r in map(json.loads, open(log)) if r["type"] == kind]


def test_without_epochs_training_stops_by_validation_and_keeps_the_best(dataset, tmp_path):
    ckpt, log = str(tmp_path / "ck"), str(tmp_path / "log.json")
    proc = _train(dataset, ckpt, "--patience", "2", "--patience_steps", "0", "--max_epochs", "40", "--alpha", "0.05",
                  log=log)
    assert proc.returncode == 0, proc.stderr
    validations = _records(log, "validation")
    (summary,) = _records(log, "summary")
    ndcg = [v["ndcg"] for v in validations]
    best = int(np.argmax(ndcg))  # the first maximum: a tie is no improvement
    assert summary["stop_reason"] == "early_stopped" and len(ndcg) == best + 3  # 2 without a better one
    assert summary["best_validation_ndcg"] == ndcg[best] and summary["best_epoch"] == validations[best]["epoch"]
    best_meta = json.load(open(os.path.join(ckpt + ".best", "meta.json")))
    assert best_meta["train_state"]["step"] == validations[best]["step"]
    last_meta = json.load(open(os.path.join(ckpt, "meta.json")))
    assert last_meta["train_state"]["step"] == summary["steps"]
    # evaluate takes the best by default, the last with --nobest
    common = ["--input", os.path.join(dataset, "all"), "--heldout", os.path.join(dataset, "all"), "--baselines", "",
              "--k", "5"]
    best_eval = run_cli("dlrm.scripts.recommender_evaluate", "--checkpoint", ckpt, *common)
    assert f"{ckpt}.best (the best validation of its run" in best_eval.stdout
    last_eval = run_cli("dlrm.scripts.recommender_evaluate", "--checkpoint", ckpt, "--nobest", *common)
    assert f"model: {ckpt} (step {summary['steps']}" in last_eval.stdout


def test_patience_in_steps_keeps_a_run_of_few_steps_an_epoch_going(dataset, tmp_path):
    """8 steps an epoch: --patience 2 alone would stop 16 steps after the best; --patience_steps
    40 keeps the run going until both have passed, and the stop is the first validation where
    they have, recomputed here from the run's own validations."""
    log = str(tmp_path / "log.json")
    proc = _train(dataset, str(tmp_path / "ck"), "--patience", "2", "--patience_steps", "40", "--max_epochs", "40",
                  "--alpha", "0.05", log=log)
    assert proc.returncode == 0, proc.stderr
    validations = _records(log, "validation")
    (summary,) = _records(log, "summary")
    best_ndcg, best_step, stale, expected_stop, patience_alone = -1.0, 0, 0, None, None
    for i, v in enumerate(validations):
        if v["ndcg"] > best_ndcg:
            best_ndcg, best_step, stale = v["ndcg"], v["step"], 0
        else:
            stale += 1
        if stale >= 2 and patience_alone is None:
            patience_alone = i  # where --patience 2 alone would have stopped
        if stale >= 2 and v["step"] - best_step >= 40:
            expected_stop = i
            break
    assert expected_stop is not None and summary["stop_reason"] == "early_stopped"
    assert len(validations) == expected_stop + 1
    assert patience_alone < expected_stop, "the steps did not keep the run going: the test shows nothing"


def test_resume_with_validation_continues_exactly(dataset, tmp_path):
    whole_log, half_log = str(tmp_path / "whole.json"), str(tmp_path / "half.json")
    args = ("--epochs", "3", "--validation_users", "0.2")
    assert _train(dataset, str(tmp_path / "whole"), *args, log=whole_log).returncode == 0
    first = _train(dataset, str(tmp_path / "half"), *args, "--max_steps", "13", log=half_log)  # mid-epoch 2
    assert first.returncode == 0, first.stderr
    second = _train(dataset, str(tmp_path / "half"), *args, "--resume", log=half_log)
    assert second.returncode == 0, second.stderr
    assert _records(half_log, "validation") == _records(whole_log, "validation")
    for name in ("replicated.pt", "output_rows_0_50.pt"):
        a = torch.load(tmp_path / "whole" / name, weights_only=True)
        b = torch.load(tmp_path / "half" / name, weights_only=True)
        for key in a:
            if key != "state":
                assert torch.equal(a[key], b[key]) if torch.is_tensor(a[key]) else a[key].keys() == b[key].keys()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_saves_and_exits_128_plus_it_and_the_run_resumes_exactly(dataset, tmp_path, sig, code):
    ckpt, log = str(tmp_path / "ck"), str(tmp_path / "log.json")
    proc = warm_python.Popen(
        [sys.executable, "-m", "dlrm.scripts.recommender_train", "--network", os.path.join(dataset, "network.json"),
         "--input", os.path.join(dataset, "all"), "--checkpoint_path", ckpt, "--batch_size", "2", "--epochs", "50",
         "--validation_users", "0", "--log_every_steps", "1", "--device", "cpu", "--log_path", log],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:
            if line.startswith("epoch 0 step 3/"):
                break
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, err
    assert "stopping after this step" in out and "Traceback" not in err, err
    (summary,) = _records(log, "summary")
    assert summary["stop_reason"] == "interrupted" and summary["steps"] >= 3
    assert json.load(open(os.path.join(ckpt, "meta.json")))["train_state"]["step"] == summary["steps"]
    if sig != signal.SIGTERM:
        return  # the same save; its resume is checked once
    steps = summary["steps"]
    # The saved state resumes to what an uninterrupted run of the same length reaches.
    more = _train(dataset, ckpt, "--batch_size", "2", "--epochs", "50", "--validation_users", "0", "--resume",
                  "--max_steps", "2")
    assert more.returncode == 0 and f"resuming at step {steps}" in more.stdout, more.stderr
    straight = _train(dataset, str(tmp_path / "straight"), "--batch_size", "2", "--epochs", "50",
                      "--validation_users", "0", "--max_steps", str(steps + 2))
    assert straight.returncode == 0, straight.stderr
    a = torch.load(os.path.join(ckpt, "replicated.pt"), weights_only=True)["params"]
    b = torch.load(tmp_path / "straight" / "replicated.pt", weights_only=True)["params"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_empty_dataset_is_refused_in_one_line(tmp_path):
    from dlrm.recommender.csr_dataset import CsrRows

    write_csr(tmp_path / "empty", CsrRows(np.zeros(1, np.int64), np.zeros(0, np.int32), None, 30))
    (tmp_path / "network.json").write_text(json.dumps(NETWORK))
    proc = run_cli("dlrm.scripts.recommender_train", "--network", str(tmp_path / "network.json"), "--input",
                   str(tmp_path / "empty"), "--checkpoint_path", str(tmp_path / "ck"), "--epochs", "1",
                   "--validation_users", "0", check=False)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and "has no users" in lines[0], proc.stderr
    assert not os.path.exists(tmp_path / "ck" / "meta.json")


def test_kill_9_then_resume_from_the_last_checkpoint_equals_the_uninterrupted_run(dataset, tmp_path):
    ckpt = str(tmp_path / "ck")
    args = ("--batch_size", "2", "--epochs", "50", "--validation_users", "0", "--checkpoint_every_steps", "3")
    proc = warm_python.Popen(
        [sys.executable, "-m", "dlrm.scripts.recommender_train", "--network", os.path.join(dataset, "network.json"),
         "--input", os.path.join(dataset, "all"), "--checkpoint_path", ckpt, *args, "--log_every_steps", "1",
         "--device", "cpu"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for line in proc.stdout:
            if line.startswith("epoch 0 step 8/"):  # saved at steps 3 and 6, in the middle of what comes next
                break
        proc.kill()
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    steps = json.load(open(os.path.join(ckpt, "meta.json")))["train_state"]["step"]
    assert steps >= 6 and steps % 3 == 0
    more = _train(dataset, ckpt, *args, "--resume", "--max_steps", "4")
    assert more.returncode == 0 and f"resuming at step {steps}" in more.stdout, more.stderr
    straight = _train(dataset, str(tmp_path / "straight"), *args, "--max_steps", str(steps + 4))
    assert straight.returncode == 0, straight.stderr
    for name in ("replicated.pt", "input_rows_0_50.pt", "output_rows_0_50.pt"):
        a = torch.load(os.path.join(ckpt, name), weights_only=True)
        b = torch.load(tmp_path / "straight" / name, weights_only=True)
        flat_a, flat_b = torch.utils._pytree.tree_flatten(a), torch.utils._pytree.tree_flatten(b)
        assert flat_a[1] == flat_b[1]
        assert all(torch.equal(x, y) for x, y in zip(flat_a[0], flat_b[0])), name


def test_an_error_mid_run_saves_the_last_whole_step_and_the_fixed_data_resumes_exactly(dataset, tmp_path):
    from dlrm.engine.logger import RunLogger
    from dlrm.recommender import checkpoint
    from dlrm.recommender.train import TrainConfig, make_optimizer, train

    source = CsrDataset(os.path.join(dataset, "all"))
    offsets = np.asarray(source.offsets)
    bad = str(tmp_path / "bad")
    shutil.copytree(os.path.join(dataset, "all"), bad)
    indices_path = os.path.join(bad, "indices.bin")
    indices = np.fromfile(indices_path, dtype=np.int32)
    indices[offsets[7]] = 10**6  # user 7: batch 3 of 2 users, unshuffled
    indices.tofile(indices_path)
    network = parse_network(NETWORK).resolve(source.n_features, source.n_features)
    cfg = TrainConfig(batch_size=2, epochs=1, seed=3, shuffle=False, log_every_steps=1, max_steps=8,
                      save_checkpoint_path=str(tmp_path / "ck"))

    def run(data: str, cfg: TrainConfig, log: str, state=None) -> dict:
        model = SparseAutoencoder(network, seed=4)
        optimizer = make_optimizer(model, network.optimizer)
        if state == "resume":
            state = checkpoint.load(cfg.save_checkpoint_path, model, optimizer)
        # check=False: the opening check would refuse the bad index before any step; the loop's
        # handling of an error raised mid-run is what is tested here.
        with RunLogger(log, stream=open(os.devnull, "w")) as logger:
            return train(model, optimizer, CsrDataset(data, check=False), CsrDataset(data, check=False), cfg, logger,
                         torch.device("cpu"), state)

    with pytest.raises(Exception) as failure:
        run(bad, cfg, str(tmp_path / "bad.json"))
    (summary,) = _records(str(tmp_path / "bad.json"), "summary")
    assert summary["stop_reason"] == "error" and summary["steps"] == 3, summary
    assert summary["error"].startswith(type(failure.value).__name__)
    assert json.load(open(tmp_path / "ck" / "meta.json"))["train_state"]["step"] == 3
    resumed = run(os.path.join(dataset, "all"), dataclasses.replace(cfg, max_steps=5), str(tmp_path / "r.json"),
                  "resume")
    assert resumed["steps"] == 8
    straight_cfg = dataclasses.replace(cfg, save_checkpoint_path=str(tmp_path / "straight"))
    run(os.path.join(dataset, "all"), straight_cfg, str(tmp_path / "s.json"))
    assert ([r["loss"] for r in _records(str(tmp_path / "r.json"), "train")]
            == [r["loss"] for r in _records(str(tmp_path / "s.json"), "train")][3:])
    a = torch.load(tmp_path / "ck" / "replicated.pt", weights_only=True)["params"]
    b = torch.load(tmp_path / "straight" / "replicated.pt", weights_only=True)["params"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_best_checkpoint_left_by_a_replaced_run_is_never_taken_for_the_new_one(dataset, tmp_path):
    """--overwrite replaces a run whose PATH.best stays on disk until the new run validates (or
    for good, when it does not): predict and evaluate must then use the new run's checkpoint."""
    ckpt = str(tmp_path / "ck")
    assert _train(dataset, ckpt, "--epochs", "2").returncode == 0
    assert os.path.isdir(ckpt + ".best")
    recs = str(tmp_path / "recs.txt")

    def predicted_from() -> str:
        out = run_cli("dlrm.scripts.recommender_predict", "--load_checkpoint_path", ckpt, "--input",
                      os.path.join(dataset, "all"), "--k", "2", "--output", recs, "--overwrite")
        return out.stdout + out.stderr

    # A new autoencoder run without validation writes no .best: the latest checkpoint is the model.
    proc = _train(dataset, ckpt, "--epochs", "1", "--validation_users", "0", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    said = predicted_from()
    assert ".best" not in said and ckpt in said, said
    # Resuming keeps the run's name, so its own best stays the one predict takes.
    assert _train(dataset, ckpt + "2", "--epochs", "1").returncode == 0
    assert _train(dataset, ckpt + "2", "--epochs", "2", "--resume").returncode == 0
    out = run_cli("dlrm.scripts.recommender_predict", "--load_checkpoint_path", ckpt + "2", "--input",
                  os.path.join(dataset, "all"), "--k", "2", "--output", recs, "--overwrite")
    assert ckpt + "2.best" in out.stdout + out.stderr
    # A linear model replacing it keeps no best of its own.
    proc = run_cli("dlrm.scripts.recommender_train", "--input", os.path.join(dataset, "all"),
                   "--save_checkpoint_path", ckpt, "--overwrite", check=False)
    assert proc.returncode == 0, proc.stderr
    assert "linear item-item model" in predicted_from()
