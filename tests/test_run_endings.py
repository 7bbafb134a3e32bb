"""How a run ends and what it says then: a run with no timed step says so (never "nan"), a
signal after the last step changes neither the exit code nor the output, torchrun's own exit
code on SIGTERM is what docs/training.md says, and no message hints at a flag the script lacks."""

import glob
import json
import os
import signal
import subprocess
import sys

from conftest import REPO
import warm_python

TINY = ["--synthetic_dataset_table_sizes", "30,40", "--synthetic_dataset_num_entries", "4096",
        "--synthetic_dataset_num_test_entries", "1024", "--batch_size", "256", "--embedding_dim", "8",
        "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "16,1"]


def _main(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return warm_python.run([sys.executable, "-m", "dlrm.scripts.main", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_a_run_shorter_than_its_warmup_says_no_step_was_timed(tmp_path):
    proc = _main(*TINY, "--max_steps", "3", "--benchmark_warmup_steps", "10", "--log_path", str(tmp_path / "log"))
    assert proc.returncode == 0, proc.stderr
    (finished,) = [line for line in proc.stdout.splitlines() if line.startswith("Finished")]
    assert "nan" not in finished
    assert "no train step timed (the first 10 steps are warm-up" in finished
    assert "average test throughput" in finished  # the test at the end ran and was timed


def test_a_signal_after_the_last_step_changes_nothing():
    # The handlers stay installed until the process ends; once training is over they must
    # neither print "stopping after this step" nor turn a completed run into exit 143.
    code = (
        "import os, signal\n"
        "from dlrm.engine.signals import StopOnSignals\n"
        "stop = StopOnSignals()\n"
        "stop.over()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print('exit code', stop.exit_code)\n"
    )
    proc = warm_python.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "exit code 0", proc.stdout


def test_a_signal_during_training_still_stops_it_with_128_plus_the_signal():
    code = (
        "import os, signal\n"
        "from dlrm.engine.signals import StopOnSignals\n"
        "stop = StopOnSignals()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "stop.over()\n"
        "print('exit code', stop.exit_code, stop.event.is_set())\n"
    )
    proc = warm_python.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "stopping after this step" in proc.stdout and proc.stdout.strip().endswith("exit code 143 True")


def test_torchrun_on_sigterm_saves_on_every_process_and_exits_as_documented(tmp_path):
    ck, log = str(tmp_path / "ck"), str(tmp_path / "log.json")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    proc = warm_python.Popen(
        [torchrun, "--standalone", "--nproc_per_node", "2", "-m", "dlrm.scripts.main", *TINY, "--base_device", "cpu",
         "--synthetic_dataset_num_entries", str(1 << 24), "--print_freq", "1", "--save_checkpoint_path", ck,
         "--log_path", log],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    try:
        for line in proc.stdout:
            if line.startswith("Epoch:"):
                break
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    # torchrun forwards SIGTERM to its processes, which finish the step and save; torchrun itself
    # then exits 1 (its own SignalException), which docs/training.md states.
    assert proc.returncode == 1, out
    assert out.count("stopping after this step") == 2 and "Saved checkpoint" in out, out
    (summary,) = [r for r in map(json.loads, open(log)) if r["type"] == "summary"]
    assert summary["stop_reason"] == "interrupted" and summary["steps"] > 0
    assert os.path.exists(os.path.join(ck, "meta.json"))


def test_a_damaged_checkpoint_hints_only_at_flags_the_script_has(tmp_path):
    ck = str(tmp_path / "ck")
    assert _main(*TINY, "--max_steps", "2", "--save_checkpoint_path", ck, "--log_path", str(tmp_path / "log")
                 ).returncode == 0
    (table,) = sorted(glob.glob(os.path.join(ck, "table_0*.pt")))[:1]
    with open(table, "r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02\x03")
    main = _main(*TINY, "--mode", "test", "--load_checkpoint_path", ck, "--log_path", str(tmp_path / "log2"))
    assert main.returncode == 2 and "--skip_checkpoint_verify" in main.stderr, main.stderr
    export = warm_python.run([sys.executable, "-m", "dlrm.scripts.export", "--checkpoint", ck, "--output",
                             str(tmp_path / "out"), "--format", "torchscript"], cwd=REPO, capture_output=True,
                            text=True, timeout=180)
    lines = [line for line in export.stderr.splitlines() if line.strip()]
    assert export.returncode == 2 and len(lines) == 1 and "checksum" in lines[0], export.stderr
    assert "verify" not in lines[0], lines[0]
