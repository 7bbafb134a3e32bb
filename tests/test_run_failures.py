"""What a user sees when a run meets bad data or a bad checkpoint: one clear line, exit code 2,
a checkpoint saved when work would be lost, and a ``summary`` record that says why it stopped."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.synthetic import write_synthetic_dataset
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.training.checkpoint import load_checkpoint

from conftest import REPO
import warm_python

TABLES = [30, 300, 4, 1000, 70]
SMALL = ["--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "16,1", "--base_device", "cpu",
         "--lr", "0.5", "--warmup_steps", "0", "--decay_start_step", "0", "--decay_steps", "0"]


def _model() -> DLRM:
    return DLRM(DLRMConfig(num_numerical_features=4, table_sizes=TABLES, embedding_dim=8,
                           bottom_mlp_sizes=[16, 8], top_mlp_sizes=[16, 1]))


def _run(*args: str) -> subprocess.CompletedProcess:
    return warm_python.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=180)


def _main(*args: str) -> subprocess.CompletedProcess:
    return _run("-m", "dlrm.scripts.main", *args)


def _one_clear_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert len(lines) == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _summaries(log: str) -> list[dict]:
    return [r for r in map(json.loads, open(log)) if r["type"] == "summary"]


def _put_id(dataset: str, split: str, feature: int, row: int, value: int) -> str:
    spec = FeatureSpec.from_yaml(os.path.join(dataset, "feature_spec.yaml"))
    path = spec.paths(split).categorical[feature]
    ids = np.fromfile(path, dtype=spec.categorical_dtypes[feature])
    ids[row] = value
    ids.tofile(path)
    return path


@pytest.fixture
def dataset(tmp_path):
    root = str(tmp_path / "data")
    write_synthetic_dataset(root, 4, TABLES, {"train": 8_000, "test": 2_000}, batch_size=4096, seed=7)
    return root


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A dataset and a checkpoint trained on it (read-only for the tests that use it)."""
    root = tmp_path_factory.mktemp("trained")
    data = str(root / "data")
    write_synthetic_dataset(data, 4, TABLES, {"train": 4_000, "test": 1_000}, batch_size=4096, seed=7)
    ck = str(root / "ck")
    proc = _main("--dataset", data, "--batch_size", "1000", "--save_checkpoint_path", ck,
                 "--log_path", str(root / "log.json"), *SMALL)
    assert proc.returncode == 0, proc.stderr
    return data, ck


def test_bad_id_in_the_test_split_stops_the_run_before_the_first_step(dataset, tmp_path):
    bad = _put_id(dataset, "test", 1, 1500, 5000)  # cardinality 300
    log = str(tmp_path / "log.json")
    proc = _main("--dataset", dataset, "--batch_size", "500", "--log_path", log,
                 "--save_checkpoint_path", str(tmp_path / "ck"), *SMALL)
    _one_clear_line(proc, bad, "id 5000 at row 1500", "--hash_indices")
    assert "Epoch:" not in proc.stdout  # no step was taken
    (summary,) = _summaries(log)
    assert summary["stop_reason"] == "error" and "id 5000" in summary["error"]
    assert not os.path.exists(tmp_path / "ck") and not os.path.exists(tmp_path / "ck.lock")


def test_error_mid_run_saves_a_checkpoint_and_writes_the_summary(dataset, tmp_path):
    _put_id(dataset, "train", 3, 4999, 1000)  # batch 9 of 500 rows; cardinality 1000
    ck, log = str(tmp_path / "ck"), str(tmp_path / "log.json")
    proc = _main("--dataset", dataset, "--batch_size", "500", "--novalidate_dataset", "--log_path", log,
                 "--save_checkpoint_path", ck, *SMALL)
    _one_clear_line(proc, "cat_3.bin", "id 1000 at row 4999")
    assert "Saved checkpoint at step 9" in proc.stdout
    assert load_checkpoint(ck, _model()).step == 9
    (summary,) = _summaries(log)
    assert summary["stop_reason"] == "error" and summary["steps"] == 9 and "DatasetError" in summary["error"]
    # The saved run resumes once the data is fixed, at the batch that failed.
    _put_id(dataset, "train", 3, 4999, 7)
    proc = _main("--dataset", dataset, "--batch_size", "500", "--resume", "--load_checkpoint_path", ck, "--log_path", log,
                 *SMALL)
    assert proc.returncode == 0, proc.stderr
    assert _summaries(log)[-1]["steps"] == 16


def test_hash_indices_other_than_the_checkpoints_is_refused(trained, tmp_path):
    data, ck = trained
    proc = _main("--mode", "test", "--dataset", data, "--load_checkpoint_path", ck, "--hash_indices",
                 "--log_path", str(tmp_path / "log.json"), *SMALL)
    _one_clear_line(proc, "--hash_indices contradicts the checkpoint", "trained without it", "leave it out")


@pytest.mark.parametrize("sizes, why", [("0", "0 is not a batch size (a positive integer)"),
                                        ("1,64,4096", "1000 samples of the test split")])
def test_inference_benchmark_batch_size_outside_the_split_is_a_usage_error(trained, tmp_path, sizes, why):
    data, ck = trained
    proc = _main("--mode", "inference_benchmark", "--dataset", data, "--load_checkpoint_path", ck,
                 "--inference_benchmark_batch_sizes", sizes, "--log_path", str(tmp_path / "log.json"), *SMALL)
    _one_clear_line(proc, "--inference_benchmark_batch_sizes", why)


def _flip_table_byte(ck: str, dst: str) -> None:
    import shutil

    shutil.copytree(ck, dst)
    table = os.path.join(dst, "table_3.pt")
    data = bytearray(open(table, "rb").read())
    data[-3000] ^= 0xFF  # inside the 1000 x 8 float32 weights, not the zip directory at the end
    open(table, "wb").write(bytes(data))


@pytest.mark.parametrize("command", ["test", "export", "deploy"])
def test_flipped_checkpoint_bytes_are_refused_by_every_reader(trained, tmp_path, command):
    data, ck = trained
    damaged = str(tmp_path / "damaged")
    _flip_table_byte(ck, damaged)
    out = str(tmp_path / "out")
    if command == "test":
        proc = _main("--mode", "test", "--dataset", data, "--load_checkpoint_path", damaged,
                     "--log_path", str(tmp_path / "log.json"), *SMALL)
    elif command == "export":
        proc = _run("-m", "dlrm.scripts.export", "--checkpoint", damaged, "--output", out)
    else:
        proc = _run("triton/deployer.py", "--checkpoint", damaged, "--model_repository", out)
    _one_clear_line(proc, "table_3.pt: checksum", "damaged")
    assert not os.path.exists(out)
    if command == "test":  # the escape hatch loads it anyway
        proc = _main("--mode", "test", "--dataset", data, "--load_checkpoint_path", damaged,
                     "--skip_checkpoint_verify", "--log_path", str(tmp_path / "log.json"), *SMALL)
        assert proc.returncode == 0, proc.stderr


def test_second_run_saving_to_the_same_path_fails_at_its_start(trained, tmp_path):
    data, _ = trained
    ck = str(tmp_path / "ck")
    holder = warm_python.Popen(
        [sys.executable, "-m", "dlrm.scripts.main", "--dataset", data, "--batch_size", "32", "--epochs", "100",
         "--print_freq", "1", "--save_checkpoint_path", ck, "--log_path", str(tmp_path / "a.json"), *SMALL],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        for line in holder.stdout:
            if line.startswith("Epoch:"):
                break
        proc = _main("--dataset", data, "--batch_size", "500", "--save_checkpoint_path", ck,
                     "--log_path", str(tmp_path / "b.json"), *SMALL)
        _one_clear_line(proc, f"pid {holder.pid}", "is saving checkpoints to", "--save_checkpoint_path")
        assert "Epoch:" not in proc.stdout
    finally:
        holder.kill()
        holder.wait()
