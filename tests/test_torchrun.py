"""Hybrid-parallel training through the real launcher: torchrun starts N processes on gloo."""

import os
import signal
import subprocess
import sys
import time

import pytest

from dlrm.data.synthetic import write_synthetic_dataset

from conftest import REPO, log_records
import warm_python

TABLES = [30, 3000, 4, 1000, 70, 9, 500]
MODEL = ["--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "32,16,1"]
TRAIN = ["--batch_size", "500", "--test_batch_size", "700", "--lr", "0.5", "--warmup_steps", "5",
         "--decay_start_step", "0", "--decay_steps", "0", "--print_freq", "1", "--base_device", "cpu", "--epochs", "2"]


def launch(nproc, *args, launcher="torchrun", timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    if nproc == 0:
        cmd = [sys.executable, "-m", "dlrm.scripts.main", *args]
    elif launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "dlrm.scripts.main", *args]
    else:  # NVIDIA's users start with the legacy launcher
        cmd = [sys.executable, "-m", "torch.distributed.launch", "--use_env", "--standalone",
               f"--nproc_per_node={nproc}", "-m", "dlrm.scripts.main", *args]
    proc = warm_python.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("data"))
    write_synthetic_dataset(root, 6, TABLES, {"train": 6000, "test": 3000}, batch_size=1000, seed=5)
    return root


def test_world_sizes_match_single_device_and_checkpoints_move(dataset, tmp_path):
    """fp32 over 24 steps: losses agree with the single-device run to 1e-4 relative (float
    additions in another order); AUCs of the same weights agree to 1e-6 on any process count."""
    base = ["--dataset", dataset, *MODEL, *TRAIN]
    single_log = str(tmp_path / "single.json")
    launch(0, *base, "--log_path", single_log)
    single = [r["loss"] for r in log_records(single_log, "train")]
    assert len(single) == 24

    # 3 processes, uneven tables per rank, 500 samples not divisible by 3
    ckpt3, log3 = str(tmp_path / "ckpt3"), str(tmp_path / "w3.json")
    out = launch(3, *base, "--log_path", log3, "--save_checkpoint_path", ckpt3)
    assert "Embedding placement: 7 tables on 3 ranks" in out
    assert [r["loss"] for r in log_records(log3, "train")] == pytest.approx(single, rel=1e-4)
    auc3 = log_records(log3, "eval")[-1]["auc"]
    assert auc3 == pytest.approx(log_records(single_log, "eval")[-1]["auc"], abs=1e-4)

    # The 3-process checkpoint tested on 1 and on 2 processes (3 -> 1, 3 -> 2)
    for nproc in (0, 2):
        test_log = str(tmp_path / f"test{nproc}.json")
        launch(nproc, "--mode", "test", "--dataset", dataset, "--load_checkpoint_path", ckpt3, *MODEL,
               "--base_device", "cpu", "--test_batch_size", "999", "--log_path", test_log)
        assert log_records(test_log, "summary")[0]["auc"] == pytest.approx(auc3, abs=1e-6)

    # A single-device checkpoint resumed on 4 processes (1 -> 4), via the legacy launcher
    ckpt1, part_log = str(tmp_path / "ckpt1"), str(tmp_path / "part.json")
    launch(0, *base, "--max_steps", "10", "--log_path", part_log, "--save_checkpoint_path", ckpt1)
    launch(4, *base, "--resume", "--load_checkpoint_path", ckpt1, "--log_path", part_log, launcher="launch")
    resumed = [r["loss"] for r in log_records(part_log, "train")]
    assert resumed == pytest.approx(single, rel=1e-4)


def test_a_table_too_large_for_a_rank_is_split_row_wise_and_its_checkpoint_moves(dataset, tmp_path):
    """86 KB per process cannot hold table 1 (96 KB) whole: the planner splits it row-wise across
    the 2 processes. Training (with the MLP gradients summed in buckets during the backward)
    equals one process (fp32, 1e-4 relative); the checkpoint, holding
    table 1 as two blocks, is tested on one process and on 3 processes with every table split."""
    base = ["--dataset", dataset, *MODEL, *TRAIN, "--epochs", "1"]
    single_log = str(tmp_path / "single.json")
    launch(0, *base, "--log_path", single_log)
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "rw.json")
    out = launch(2, *base, "--device_memory_gb", "0.00008", "--log_path", log, "--save_checkpoint_path", ckpt,
                 "--gradient_sync", "overlap", "--gradient_bucket_mb", "0.005")  # several 5 KiB buckets
    assert "7 tables on 2 ranks" in out and "1 split row-wise" in out
    assert "table 1 (3,000 rows" in out
    plan = log_records(log, "plan")[0]
    assert plan["row_wise"] == {"1": [0, 1500, 3000]}
    assert {"table_1_rows_0_1500.pt", "table_1_rows_1500_3000.pt"} <= set(os.listdir(ckpt))
    assert [r["loss"] for r in log_records(log, "train")] == pytest.approx(
        [r["loss"] for r in log_records(single_log, "train")], rel=1e-4)
    auc = log_records(log, "eval")[-1]["auc"]
    for nproc, placement in ((0, []), (3, ["--table_placement", "row_wise"])):
        test_log = str(tmp_path / f"test{nproc}.json")
        launch(nproc, "--mode", "test", "--dataset", dataset, "--load_checkpoint_path", ckpt, *MODEL, *placement,
               "--base_device", "cpu", "--test_batch_size", "999", "--log_path", test_log)
        assert log_records(test_log, "summary")[0]["auc"] == pytest.approx(auc, abs=1e-6)


def test_plan_error_names_the_table(dataset):
    proc = warm_python.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dlrm.scripts.main",
         "--dataset", dataset, *MODEL, *TRAIN, "--device_memory_gb", "0.00005"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0
    assert "table 1" in proc.stderr and "fits on no rank" in proc.stderr


def test_a_killed_rank_ends_the_job(tmp_path):
    """SIGKILL one worker mid-training: the launcher stops the others; no hang."""
    args = ["--synthetic_dataset_table_sizes", ",".join(map(str, TABLES)), "--synthetic_dataset_numerical_features",
            "6", "--synthetic_dataset_num_entries", str(10**8), *MODEL, *TRAIN, "--dist_timeout", "20",
            "--log_path", str(tmp_path / "log.json"), "--print_freq", "5"]
    proc = warm_python.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
         "dlrm.scripts.main", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"},
    )
    try:
        for line in proc.stdout:  # wait until training runs
            if line.startswith("Epoch:"):
                break
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(workers) == 2, workers
        os.kill(int(workers[-1]), signal.SIGKILL)
        killed = time.monotonic()
        proc.wait(timeout=90)
        ended = time.monotonic() - killed
        rest = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    assert ended < 60, f"the job took {ended:.0f}s to stop"
    assert "Signals.SIGKILL" in rest or "SIGKILL" in rest or "exitcode" in rest


def test_bad_data_of_one_rank_stops_every_rank_before_training(tmp_path):
    """A bad id in a column only rank 1 reads: every rank stops at once with exit code 2 and the
    message (rank 0 says another process found it), instead of waiting out --dist_timeout."""
    import numpy as np

    from dlrm.data.feature_spec import FeatureSpec

    root = str(tmp_path / "data")
    write_synthetic_dataset(root, 6, TABLES, {"train": 3000, "test": 1000}, batch_size=1000, seed=5)
    spec = FeatureSpec.from_yaml(os.path.join(root, "feature_spec.yaml"))
    path = spec.paths("test").categorical[1]
    ids = np.fromfile(path, dtype=spec.categorical_dtypes[1])
    ids[999] = 3000  # cardinality 3000
    ids.tofile(path)
    start = time.monotonic()
    proc = warm_python.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dlrm.scripts.main",
         "--dataset", root, *MODEL, *TRAIN, "--table_placement", '{"0": [0, 2, 3, 4], "1": [1, 5, 6]}',
         "--dist_timeout", "120", "--log_path", str(tmp_path / "log.json")],
        cwd=REPO, capture_output=True, text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode != 0 and time.monotonic() - start < 100
    assert f"rank 1: error: {path}: categorical feature" in proc.stderr, proc.stderr
    assert "rank 0: error: another process found bad data" in proc.stderr, proc.stderr
    assert "Epoch:" not in proc.stdout
    assert "failed:" not in proc.stderr  # no rank crashed (the launcher's own report may follow)
    (summary,) = log_records(str(tmp_path / "log.json"), "summary")
    assert summary["stop_reason"] == "error"
