"""Every writer on a file system that refuses: read-only, full, or not one files can be made on
(/proc). The user sees one line on stderr naming the path, the cause and the fix, exit code 2;
the previous checkpoint or output is intact and nothing half written is left beside it.

Each case runs the real command line in a private mount namespace (as ``unshare -m`` makes) with
a small tmpfs of its own, seeded with the previous output, and copies out what the tmpfs held
after (tests/in_tmpfs.py).
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
import warm_python

PAGE = resource.getpagesize()  # tmpfs gives every file whole pages
DLRM = ["dlrm.scripts.main", "--synthetic_dataset_table_sizes", "100,100", "--synthetic_dataset_num_entries", "2000",
        "--synthetic_dataset_num_test_entries", "500", "--batch_size", "500", "--test_batch_size", "500",
        "--embedding_dim", "4", "--bottom_mlp_sizes", "8,4", "--top_mlp_sizes", "8,1", "--base_device", "cpu",
        "--print_freq", "1"]

def _namespaces() -> str | None:
    """Why a private tmpfs cannot be mounted here, or None when it can."""
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    try:
        probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"],
                               capture_output=True, text=True, timeout=30)
    except OSError as e:
        return f"unshare cannot run: {e}"
    return None if probe.returncode == 0 else f"unshare -m and mount need root: {probe.stderr.strip()}"


@pytest.fixture(scope="module")
def tmpfs_ok():
    reason = _namespaces()
    if reason:
        pytest.skip(reason)


def on_tmpfs(tmp_path: Path, size: int, *args: str, seed: Path | None = None,
             read_only: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    """Runs ``python -m args`` (where ``{fs}`` in an argument is the tmpfs) with a tmpfs of ``size``
    bytes seeded with a copy of ``seed``; returns the process and a copy of the tmpfs after it."""
    fs, after = tmp_path / "fs", tmp_path / "after"
    fs.mkdir()
    after.mkdir()
    command = [sys.executable, os.path.join(REPO, "tests", "in_tmpfs.py"), str(size), "-m",
               *(a.format(fs=fs) for a in args)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "FS": str(fs), "AFTER": str(after), "SEED": str(seed or ""),
           "RO": "1" if read_only else "0"}
    proc = warm_python.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 99, proc.stderr
    return proc, after


def one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 2 and a single line on stderr, no traceback, holding every needle."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-4000:])
    assert len(lines) == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-4000:]
    assert lines[0].startswith("error: cannot write"), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` by relative path, with its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def pages(root: Path) -> int:
    """Bytes the files under ``root`` take on a tmpfs."""
    return sum(math.ceil(len(data) / PAGE) * PAGE for data in tree(root).values())


FULL = ("no space left on device", "free space on that file system")
READ_ONLY = ("read-only file system", "write to a writable file system")


@pytest.fixture(scope="module")
def dlrm_checkpoint(tmp_path_factory) -> Path:
    """A good checkpoint of the DLRM of ``DLRM``, on the real disk: ``<root>/ck``."""
    root = tmp_path_factory.mktemp("dlrm")
    proc = warm_python.run([sys.executable, "-m", *DLRM, "--max_steps", "1", "--save_checkpoint_path", str(root / "ck")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return root


def test_checkpoint_on_a_read_only_file_system_fails_before_training(tmpfs_ok, dlrm_checkpoint, tmp_path):
    proc, after = on_tmpfs(tmp_path, 1 << 20, *DLRM, "--max_steps", "2", "--save_checkpoint_path", "{fs}/ck",
                           "--overwrite", seed=dlrm_checkpoint, read_only=True)
    one_line(proc, f"{tmp_path}/fs/ck", *READ_ONLY)
    assert "Epoch:" not in proc.stdout
    assert tree(after) == tree(dlrm_checkpoint)


def test_checkpoint_under_proc_fails_before_training(tmp_path):
    proc = warm_python.run([sys.executable, "-m", *DLRM, "--max_steps", "2", "--save_checkpoint_path",
                           "/proc/dlrm/ck"], cwd=REPO, capture_output=True, text=True, timeout=300)
    one_line(proc, "/proc/dlrm/ck", "nothing can be created there", "ordinary writable file system")
    assert "Epoch:" not in proc.stdout


def test_no_room_for_a_second_checkpoint_fails_before_training(tmpfs_ok, dlrm_checkpoint, tmp_path):
    size = pages(dlrm_checkpoint) + 3 * PAGE  # the lock's page and not half a checkpoint more
    proc, after = on_tmpfs(tmp_path, size, *DLRM, "--max_steps", "2", "--save_checkpoint_path", "{fs}/ck",
                           "--overwrite", seed=dlrm_checkpoint)
    line = one_line(proc, f"{tmp_path}/fs/ck", *FULL)
    needed = sum(len(data) for data in tree(dlrm_checkpoint / "ck").values())
    assert f"({needed:,} bytes needed, {2 * PAGE:,} free)" in line
    assert "Epoch:" not in proc.stdout
    assert tree(after) == tree(dlrm_checkpoint)


def test_disk_full_at_a_periodic_checkpoint_keeps_the_last_one(tmpfs_ok, dlrm_checkpoint, tmp_path):
    """The first save fits, the second does not: torch's opaque zip-writer error is reported as the
    full disk it is, the first checkpoint stays, and the run does not try to save again."""
    from dlrm.model.dlrm import DLRM as Model, DLRMConfig
    from dlrm.training.checkpoint import load_checkpoint, read_meta

    size = pages(dlrm_checkpoint) + PAGE + pages(dlrm_checkpoint) // PAGE // 2 * PAGE
    log = tmp_path / "log.json"
    proc, after = on_tmpfs(tmp_path, size, *DLRM, "--max_steps", "4", "--checkpoint_freq", "1",
                           "--save_checkpoint_path", "{fs}/ck", "--log_path", str(log))
    one_line(proc, f"{tmp_path}/fs/ck", *FULL, "bytes needed")
    assert "Saved checkpoint at step 1" in proc.stdout and "Could not save" not in proc.stdout
    assert os.listdir(after) == ["ck"]  # no ck.tmp, ck.old or ck.lock
    model = Model(DLRMConfig(**read_meta(str(after / "ck"))["model_config"]))
    assert load_checkpoint(str(after / "ck"), model).step == 1  # complete: sizes and checksums hold
    summary = [r for r in map(json.loads, open(log)) if r["type"] == "summary"]
    assert summary[-1]["stop_reason"] == "error" and summary[-1]["error"].startswith("StorageError")


NETWORK = {"Kind": "AutoEncoder",
           "Layers": [{"Kind": "Input", "N": "auto", "DataSet": "input", "Sparse": True},
                      {"Kind": "Hidden", "N": 8, "Activation": "Sigmoid"},
                      {"Kind": "Output", "N": "auto", "DataSet": "output", "Activation": "Sigmoid"}],
           "ErrorFunction": "ScaledMarginalCrossEntropy", "Optimizer": {"Kind": "SGD", "Alpha": 0.05}}


@pytest.fixture(scope="module")
def recommender(tmp_path_factory) -> dict[str, Path]:
    """A CSR dataset, a network file and a checkpoint trained one step on them (real disk)."""
    from dlrm.recommender.csr_dataset import write_csr
    from dlrm.recommender.user_histories import HistoryConfig, generate_user_histories

    root = tmp_path_factory.mktemp("recommender")
    histories = generate_user_histories(HistoryConfig(n_users=100, n_items=60, n_interactions=2500), seed=0)
    write_csr(root / "input", histories.rows)
    (root / "network.json").write_text(json.dumps(NETWORK))
    proc = warm_python.run([sys.executable, "-m", "dlrm.scripts.recommender_train", "--network",
                           str(root / "network.json"), "--input", str(root / "input"), "--checkpoint_path",
                           str(root / "ck"), "--device", "cpu", "--batch_size", "50", "--max_steps", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return {"input": root / "input", "network": root / "network.json", "ck": root / "ck"}


def test_recommender_disk_full_at_a_checkpoint_keeps_the_last_one(tmpfs_ok, recommender, tmp_path):
    from dlrm.recommender.checkpoint import read_meta

    size = pages(recommender["ck"]) + PAGE + pages(recommender["ck"]) // PAGE // 2 * PAGE
    proc, after = on_tmpfs(tmp_path, size, "dlrm.scripts.recommender_train", "--network", str(recommender["network"]),
                           "--input", str(recommender["input"]), "--checkpoint_path", "{fs}/ck", "--device", "cpu",
                           "--batch_size", "50", "--max_steps", "3", "--checkpoint_every_steps", "1")
    one_line(proc, f"{tmp_path}/fs/ck", *FULL)
    assert os.listdir(after) == ["ck"]
    assert read_meta(str(after / "ck"))["train_state"]["step"] == 1


def test_predictions_on_a_full_disk_keep_the_old_ones(tmpfs_ok, recommender, tmp_path):
    seed = tmp_path / "seed"
    seed.mkdir()
    (seed / "recs.txt").write_text("0\t1,0.5\n")
    proc, after = on_tmpfs(tmp_path, 2 * PAGE, "dlrm.scripts.recommender_predict", "--checkpoint",
                           str(recommender["ck"]), "--input", str(recommender["input"]), "--output", "{fs}/recs.txt",
                           "--overwrite", "--device", "cpu", seed=seed)
    one_line(proc, f"{tmp_path}/fs/recs.txt", *FULL)
    assert tree(after) == tree(seed)


@pytest.mark.parametrize("read_only", [True, False], ids=["read_only", "full"])
def test_export_keeps_the_old_model(tmpfs_ok, dlrm_checkpoint, tmp_path, read_only):
    """A full disk is refused before torch.jit.save starts: a write failing inside it aborts the process."""
    seed = tmp_path / "seed"
    (seed / "m").mkdir(parents=True)
    (seed / "m" / "model.pt").write_bytes(b"an older export")
    proc, after = on_tmpfs(tmp_path, 64 * PAGE, "dlrm.scripts.export", "--checkpoint", str(dlrm_checkpoint / "ck"),
                           "--output", "{fs}/m", "--format", "torchscript", "--overwrite", seed=seed,
                           read_only=read_only)
    one_line(proc, f"{tmp_path}/fs/m" if read_only else f"{tmp_path}/fs/m/model.pt", *(READ_ONLY if read_only else FULL))
    assert tree(after) == tree(seed)


def test_generate_on_a_full_disk_leaves_nothing(tmpfs_ok, tmp_path):
    proc, after = on_tmpfs(tmp_path, 6 * PAGE, "dlrm.scripts.recommender_generate", "--synthetic", "--users", "100",
                           "--items", "60", "--interactions", "2500", "--heldout_fraction", "0.2", "--output",
                           "{fs}/data")
    one_line(proc, f"{tmp_path}/fs/data", *FULL)
    assert tree(after) == {} and os.listdir(after) == []


def test_synthetic_dataset_on_a_full_disk_keeps_the_old_one(tmpfs_ok, tmp_path):
    from dlrm.data.synthetic import write_synthetic_dataset

    seed = tmp_path / "seed"
    write_synthetic_dataset(str(seed / "d"), 2, [10, 10], {"train": 100}, seed=1)
    proc, after = on_tmpfs(tmp_path, pages(seed) + 4 * PAGE, "dlrm.scripts.prepare_synthetic_dataset",
                           "--synthetic_dataset_dir", "{fs}/d", "--overwrite", "--num_numerical_features", "2",
                           "--synthetic_dataset_table_sizes", "10,10", "--synthetic_dataset_num_entries", "20000",
                           "--num_test_entries", "0", "--num_validation_entries", "0", seed=seed)
    one_line(proc, f"{tmp_path}/fs/d", *FULL)
    assert tree(after) == tree(seed)


def test_transcode_on_a_full_disk_leaves_nothing(tmpfs_ok, tmp_path):
    text = tmp_path / "train.tsv"
    text.write_text("1\t0.5\t3\n" * 20_000)
    proc, after = on_tmpfs(tmp_path, 4 * PAGE, "dlrm.scripts.transcode", "--train", str(text), "--output",
                           "{fs}/data", "--num_numerical", "1", "--num_categorical", "1")
    one_line(proc, f"{tmp_path}/fs/data", *FULL)
    assert os.listdir(after) == []


def test_preprocessing_on_a_full_disk_keeps_the_old_dataset(tmpfs_ok, tmp_path):
    from preproc.generate import generate_criteo_tsv, tsv_line

    train, test = tmp_path / "train.tsv", tmp_path / "test.tsv"
    generate_criteo_tsv(str(train), 3000, seed=1)
    generate_criteo_tsv(str(test), 500, seed=2)
    seed, old = tmp_path / "seed", [tmp_path / "old_train.tsv", tmp_path / "old_test.tsv"]
    for path in old:
        path.write_text(tsv_line("1", {0: "3"}, {0: "0123abcd"}) + "\n")
    assert warm_python.run([sys.executable, "-m", "preproc", "--train", str(old[0]), "--test", str(old[1]),
                           "--output", str(seed / "out"), "--workers", "1", "--progress", "off"], cwd=REPO,
                          capture_output=True).returncode == 0
    proc, after = on_tmpfs(tmp_path, pages(seed) + 32 * PAGE, "preproc", "--train", str(train), "--test", str(test),
                           "--output", "{fs}/out", "--overwrite", "--workers", "1", "--progress", "off", seed=seed)
    one_line(proc, f"{tmp_path}/fs/out", *FULL)
    assert {k: v for k, v in tree(after).items() if ".preproc_work" not in k} == tree(seed)
    assert not [name for name in tree(after) if name.endswith(".tmp") or "/.tmp" in name]


def _whole_json_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert data.endswith(b"\n"), data[-200:]
    return [json.loads(line) for line in data.splitlines()]


def test_log_on_a_disk_that_fills_mid_run_is_one_line_and_the_checkpoint_is_saved(tmpfs_ok, tmp_path):
    """The log's disk fills after some progress records; the checkpoint is on another disk. One
    line naming --log_path and the fix, exit 2; the checkpoint of the last whole step is saved and
    said so (never "Could not save"); the log keeps whole lines."""
    from dlrm.model.dlrm import DLRM as Model, DLRMConfig
    from dlrm.training.checkpoint import load_checkpoint, read_meta

    ck = tmp_path / "ck"
    proc, after = on_tmpfs(tmp_path, 2 * PAGE, *DLRM, "--synthetic_dataset_num_entries", "100000",
                           "--max_steps", "150", "--log_path", "{fs}/log.json", "--save_checkpoint_path", str(ck))
    one_line(proc, f"the log file (--log_path) {tmp_path}/fs/log.json", *FULL)
    (saved,) = [line for line in proc.stdout.splitlines() if line.startswith("Saved checkpoint")]
    step = int(saved.split()[4])
    assert 0 < step < 150 and "Could not save" not in proc.stdout and "Traceback" not in proc.stdout
    model = Model(DLRMConfig(**read_meta(str(ck))["model_config"]))
    assert load_checkpoint(str(ck), model).step == step
    records = _whole_json_lines(after / "log.json")
    assert [r["type"] for r in records[:2]] == ["header", "flags"] and records[-1]["type"] == "train" and records[-1]["step"] < step


def test_tensorboard_on_a_disk_that_fills_mid_run_is_one_line_and_the_checkpoint_is_saved(tmpfs_ok, recommender,
                                                                                         tmp_path):
    """The same for --tensorboard_dir, whose writer thread meets the full disk: no thread
    traceback, one line naming the folder, the checkpoint saved, the log (elsewhere) complete."""
    from dlrm.recommender.checkpoint import read_meta

    ck, log = tmp_path / "ck", tmp_path / "log.json"
    proc, after = on_tmpfs(tmp_path, PAGE, "dlrm.scripts.recommender_train", "--network", str(recommender["network"]),
                           "--input", str(recommender["input"]), "--save_checkpoint_path", str(ck), "--device", "cpu",
                           "--batch_size", "50", "--epochs", "200", "--validation_users", "0", "--print_freq", "1",
                           "--checkpoint_every_steps", "1000", "--tensorboard_dir", "{fs}/board", "--log_path", str(log))
    one_line(proc, f"the TensorBoard folder (--tensorboard_dir) {tmp_path}/fs/board", *FULL)
    (saved,) = [line for line in proc.stdout.splitlines() if line.startswith("Saved checkpoint")]
    step = int(saved.split()[4])
    assert 0 < step < 400 and "Could not save" not in proc.stdout
    assert read_meta(str(ck))["train_state"]["step"] == step
    records = _whole_json_lines(log)
    assert records[-2] == {**records[-2], "type": "checkpoint", "step": step}
    assert records[-1]["type"] == "summary" and records[-1]["stop_reason"] == "error"
    assert "TensorBoard folder" in records[-1]["error"]
    assert os.listdir(after / "board")  # the events written before the disk filled are there
