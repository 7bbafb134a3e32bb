"""Training launched on Spark (TorchDistributor, a barrier stage in local mode) is the torchrun
run, with the same losses and AUCs, even when a worker is killed: the run resumes from its last
checkpoint and ends where the uninterrupted run ends. Launched from a RunConfig, it runs what the
config says (the flags the torchrun run was given, read into a config): the tasks get the config
itself (``RunConfig.to_dict``), not flags."""

import dataclasses
import json
import os
import re
import signal
import sys
import threading
import time

import pytest

from dlrm.scripts.dlrm_flags import check_args, run_config
from dlrm.spark import dlrm_training
from dlrm.spark.dlrm_training import train
from dlrm.spark.launch import local_session
from dlrm.training.run_config import CheckpointConfig, OutputConfig, RunConfig

from conftest import REPO, env_without_this_python, log_records, tree
from test_torchrun import MODEL, dataset, launch  # noqa: F401 (a fixture)
import warm_python

pytest.importorskip("pyspark")

# 240 steps of 500 samples on 2 processes; a checkpoint every 40 steps.
FLAGS = {
    "batch_size": 500, "test_batch_size": 700, "lr": 0.5, "warmup_steps": 5, "decay_start_step": 0,
    "decay_steps": 0, "print_freq": 40, "base_device": "cpu", "epochs": 20, "dist_timeout": 60,
}
STEPS, CHECKPOINT_FREQ = 240, 40


def flag_args(values):
    """{"lr": 0.5, "amp": True} -> ["--lr=0.5", "--amp"]: the test's command lines."""
    return [f"--{k}" if v is True else f"--{k}={v}" for k, v in values.items()]


@pytest.fixture(scope="module")
def spark():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    session = local_session("local[2]")
    yield session
    session.stop()


@pytest.fixture(scope="module")
def torchrun_log(dataset, tmp_path_factory):  # noqa: F811
    log = str(tmp_path_factory.mktemp("torchrun") / "log.json")
    launch(2, "--dataset", dataset, *MODEL, *flag_args(FLAGS), "--log_path", log)
    return log


def assert_same_records(got, want):
    """``(step, value)`` lists: the same steps, values equal to 1e-12 relative."""
    assert [step for step, _ in got] == [step for step, _ in want]
    assert [value for _, value in got] == pytest.approx([value for _, value in want], rel=1e-12)


def spark_flags(dataset, tmp_path):  # noqa: F811
    return {"dataset": dataset, **FLAGS, "checkpoint_freq": CHECKPOINT_FREQ,
            "save_checkpoint_path": str(tmp_path / "ckpt"), "log_path": str(tmp_path / "log.json")}


def _kill_rank_after_first_checkpoint(log_path: str, checkpoint: str, rank: int, killed: list) -> None:
    """Waits for the run's first checkpoint, then SIGKILLs the training process of ``rank``
    (found by its command line, which names this run's log, and its RANK)."""
    deadline = time.time() + 240
    while not os.path.isfile(os.path.join(checkpoint, "meta.json")):
        if time.time() > deadline:
            return
        time.sleep(0.02)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        is_worker = any(arg.endswith("dlrm/spark/dlrm_task.py") for arg in cmdline[:3])
        if is_worker and any(log_path in arg for arg in cmdline) and f"RANK={rank}".encode() in environ:
            os.kill(int(pid), signal.SIGKILL)
            killed.append(int(pid))


def test_a_spark_run_is_the_torchrun_run_and_a_killed_worker_costs_only_the_steps_since_its_checkpoint(
        spark, dataset, torchrun_log, tmp_path):  # noqa: F811
    """One Spark run of a RunConfig (torchrun's flags read into one), rank 1 SIGKILLed after the
    first checkpoint: the barrier stage fails, the second attempt resumes; before the kill and
    after the resume, every loss and AUC is the torchrun run's (same processes, same gloo
    reductions: equal to 1e-12)."""
    flags = spark_flags(dataset, tmp_path)
    cfg = run_config(check_args([*MODEL, *flag_args(flags)]))
    killed = []
    killer = threading.Thread(target=_kill_rank_after_first_checkpoint,
                              args=(flags["log_path"], flags["save_checkpoint_path"], 1, killed))
    killer.start()
    summary = dlrm_training.train(cfg, num_processes=2, spark=spark, attempts=2)
    killer.join()
    assert len(killed) == 1, "no training process of rank 1 was found to kill"
    summaries = log_records(flags["log_path"], "summary")
    assert [s["stop_reason"] for s in summaries] == ["error", "completed"] and summary == summaries[-1]
    resumed_at = summaries[0]["steps"] // CHECKPOINT_FREQ * CHECKPOINT_FREQ  # the first attempt's last checkpoint
    assert CHECKPOINT_FREQ <= resumed_at < STEPS
    log = [json.loads(line) for line in open(flags["log_path"])]
    end_of_first = next(i for i, r in enumerate(log) if r["type"] == "summary")
    for kind, key in (("train", "loss"), ("eval", "auc")):
        want = [(r["step"], r[key]) for r in log_records(torchrun_log, kind)]
        # The first attempt's records, then the second's from the checkpoint on.
        first = [(r["step"], r[key]) for r in log[:end_of_first] if r["type"] == kind]
        second = [(r["step"], r[key]) for r in log[end_of_first:] if r["type"] == kind and r["step"] > resumed_at]
        assert first and second
        assert_same_records(first, want[:len(first)])
        assert_same_records(second, [w for w in want if w[0] > resumed_at])
        assert len(want) >= 6 and second[-1][0] == want[-1][0]
    assert summary["best_auc"] == pytest.approx(log_records(torchrun_log, "summary")[0]["best_auc"], rel=1e-12)


def test_bad_launches_are_refused_before_spark_starts(tmp_path):
    def cfg(**output):
        made = RunConfig(output=OutputConfig(**{"log_path": str(tmp_path / "log.json"), **output}))
        made.train.save_checkpoint_path = str(tmp_path / "ckpt")
        return made

    with pytest.raises(ValueError, match="`log_path` is needed"):
        train(cfg(log_path=None), 2)
    relative = cfg()
    relative.train.save_checkpoint_path = "ckpt"
    with pytest.raises(ValueError, match="`save_checkpoint_path` is 'ckpt': give an absolute path"):
        train(relative, 2)
    with pytest.raises(ValueError, match="resumes from its own `save_checkpoint_path`"):
        train(dataclasses.replace(cfg(), checkpoint=CheckpointConfig(load_checkpoint_path="/elsewhere")), 2)
    # a relative TensorBoard folder would be written in each task's working directory, which Spark removes
    with pytest.raises(ValueError, match="`tensorboard_dir` is 'board': give an absolute path"):
        train(cfg(tensorboard_dir="board"), 2)


def test_a_run_config_is_refused_before_spark_starts_naming_the_setting(tmp_path):
    shared = RunConfig(output=OutputConfig(log_path=str(tmp_path / "log.json")))
    shared.train.save_checkpoint_path = str(tmp_path / "ckpt")
    with pytest.raises(ValueError, match="`save_checkpoint_path` is needed"):
        dlrm_training.train(RunConfig(output=shared.output), 2)
    with pytest.raises(ValueError, match="`log_path` is needed"):
        dlrm_training.train(RunConfig(train=shared.train), 2)
    with pytest.raises(ValueError, match="`log_path` is 'log.json': give an absolute path"):
        dlrm_training.train(RunConfig(train=shared.train, output=OutputConfig(log_path="log.json")), 2)
    with pytest.raises(ValueError, match="resumes from its own `save_checkpoint_path`"):
        dlrm_training.train(RunConfig(train=shared.train, output=shared.output,
                                      checkpoint=CheckpointConfig(load_checkpoint_path="/elsewhere")), 2)
    with pytest.raises(ValueError, match="`overwrite` cannot start over there"):
        dlrm_training.train(RunConfig(train=shared.train, output=shared.output,
                                      checkpoint=CheckpointConfig(overwrite=True)), 2)
    shared.train.checkpoint_format = "nvidia"  # weights only: nothing to resume from
    with pytest.raises(ValueError, match="`resume` continues this program's checkpoints"):
        dlrm_training.train(shared, 2)
    assert not os.path.exists(tmp_path / "ckpt") and not os.path.exists(tmp_path / "log.json")


def test_a_foreign_log_or_checkpoint_folder_is_refused_before_spark_starts(tmp_path):
    """The hostile user on Spark: --log_path at a file of theirs, --save_checkpoint_path at a
    folder of theirs, --log_path at a folder. Each is main's one-line refusal, exit 2, from the
    driver before any session starts (the driver would otherwise read their file as the run's
    log), with nothing changed; from Python, the same OutputError."""
    from dlrm.engine.outputs import OutputError

    (tmp_path / "notes.txt").write_text("my notes\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "a.txt").write_text("keep\n")
    before = tree(tmp_path)
    base = [sys.executable, "-m", "dlrm.scripts.spark_train", "--num_processes", "1", "--", "--max_steps", "2",
            "--base_device", "cpu"]
    for paths, says in ((["--save_checkpoint_path", tmp_path / "ck", "--log_path", tmp_path / "notes.txt"],
                         "--log_path .* is not a run log written by this program"),
                        (["--save_checkpoint_path", tmp_path / "mine", "--log_path", tmp_path / "log.json"],
                         "--save_checkpoint_path .* is not a checkpoint written by this program"),
                        (["--save_checkpoint_path", tmp_path / "ck", "--log_path", tmp_path / "mine"],
                         "--log_path .* is a folder")):
        proc = warm_python.run([*base, *map(str, paths)], capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and re.match(f"error: {says}", lines[-1]), proc.stderr
        assert not any("Spark" in line or "WARN" in line for line in lines), proc.stderr  # no session started
    cfg = RunConfig(output=OutputConfig(log_path=str(tmp_path / "notes.txt")))
    cfg.train.save_checkpoint_path = str(tmp_path / "ck")
    with pytest.raises(OutputError, match="`log_path` .* is not a run log written by this program"):
        dlrm_training.train(cfg, 1)
    assert tree(tmp_path) == before


def test_the_command_line_needs_training_flags_and_shared_paths():
    base = [sys.executable, "-m", "dlrm.scripts.spark_train", "--num_processes", "2"]
    proc = warm_python.run(base, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give dlrm.scripts.main's flags after --" in proc.stderr
    proc = warm_python.run([*base, "--", "--log_path", "/tmp/x.json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--save_checkpoint_path is needed" in proc.stderr


def test_resume_needs_a_checkpoint_path(cli):
    proc = cli("dlrm.scripts.main", "--resume", "--max_steps", "1", check=False)
    assert proc.returncode == 2 and "--resume continues a training run from a checkpoint" in proc.stderr
    assert "--save_checkpoint_path" in proc.stderr and "--load_checkpoint_path" in proc.stderr


def test_the_tasks_run_this_python_and_an_input_error_ends_the_run_at_once(tmp_path):
    """Started by a python not on PATH, the tasks still run it (they get as far as main's
    dataset check), and that error, the user's, is not retried: exit 2, its line last."""
    missing = str(tmp_path / "missing")
    proc = warm_python.run(
        [sys.executable, "-m", "dlrm.scripts.spark_train", "--num_processes", "1", "--", "--dataset", missing,
         *MODEL, "--base_device", "cpu", "--save_checkpoint_path", str(tmp_path / "ckpt"),
         "--log_path", str(tmp_path / "log.json")],
        cwd=REPO, env=env_without_this_python(tmp_path), capture_output=True, text=True, timeout=300)
    report = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 2, report
    assert proc.stderr.splitlines()[-1].startswith(f"error: feature spec {missing}/feature_spec.yaml not found"), report
    assert "attempt 1 of 2 failed" not in proc.stdout, report
    assert not os.path.exists(tmp_path / "ckpt")
