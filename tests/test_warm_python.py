"""The suite's warm starts (tests/warm_python.py) behave as cold ``python`` starts: each case runs
once through ``subprocess`` (the reference) and once warm, and what a test can see must agree:
exit status, stdout, stderr, argv, sys.path[0], working directory, environment, signals, timeouts,
children, thread counts read at start, and a fresh string-hash seed per run."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

import warm_python
from conftest import REPO

PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                  "marker": os.environ.get("WARM_MARKER"), "main": sys.modules["__main__"].__dict__.get("__file__")}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("WARM_EXIT", "0")))
"""


def both(argv: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    cold = subprocess.run(argv, capture_output=True, text=True, timeout=120, **kwargs)
    warm = warm_python.run(argv, capture_output=True, text=True, timeout=120, **kwargs)
    assert not isinstance(warm, subprocess.Popen)
    return cold, warm


def same(cold: subprocess.CompletedProcess, warm: subprocess.CompletedProcess) -> None:
    assert (warm.returncode, warm.stdout, warm.stderr) == (cold.returncode, cold.stdout, cold.stderr)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


@pytest.mark.parametrize("exit_code", ["0", "2", "3"])
def test_a_script_sees_what_a_cold_start_sees(script, tmp_path, exit_code):
    env = {**os.environ, "WARM_MARKER": "x y", "WARM_EXIT": exit_code}
    same(*both([sys.executable, str(script), "--a", "b c"], cwd=tmp_path, env=env))


def test_a_module_and_a_command_see_what_a_cold_start_sees(script, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "WARM_MARKER": "m"}
    same(*both([sys.executable, "-m", "probe", "--flag"], cwd=REPO, env=env))
    same(*both([sys.executable, "-c", PROBE, "1", "2"], cwd=tmp_path, env=env))


def test_errors_end_as_a_cold_start_ends(tmp_path):
    for code in ("raise ValueError('bad')", "import sys; sys.exit('a message')", "import sys; sys.exit(None)",
                 "import sys; sys.exit(300)", "import os; os._exit(5)"):
        cold, warm = both([sys.executable, "-c", code], cwd=tmp_path)
        assert warm.returncode == cold.returncode, code
        assert warm.stdout == cold.stdout
        assert warm.stderr.splitlines()[-1:] == cold.stderr.splitlines()[-1:], code


def test_the_dlrm_command_line_gives_the_same_help_and_the_same_one_line_error():
    same(*both([sys.executable, "-m", "dlrm.scripts.main", "--help"], cwd=REPO))
    same(*both([sys.executable, "-m", "dlrm.scripts.main", "--mode", "nonsense"], cwd=REPO))


def test_stderr_into_stdout_and_output_to_a_file(tmp_path):
    code = "import sys; print('out'); sys.stdout.flush(); print('err', file=sys.stderr)"
    cold = subprocess.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    warm = warm_python.run([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert warm.stdout == cold.stdout == "out\nerr\n"
    with open(tmp_path / "log", "w") as f:
        warm_python.run([sys.executable, "-c", code], stdout=f, stderr=subprocess.DEVNULL)
    assert (tmp_path / "log").read_text() == "out\n"


@pytest.mark.parametrize("start", [subprocess.Popen, warm_python.Popen], ids=["cold", "warm"])
def test_signals_reach_the_process_and_its_handlers(start):
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGUSR1, lambda *a: (print('got it', flush=True), sys.exit(7)))\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    proc = start([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    assert proc.poll() is None
    proc.send_signal(signal.SIGUSR1)
    assert proc.wait(timeout=30) == 7
    assert proc.stdout.read() == "got it\n"
    proc.stdout.close()
    killed = start([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert killed.stdout.readline() == "ready\n"
    killed.terminate()
    assert killed.wait(timeout=30) == -signal.SIGTERM
    killed.stdout.close()


def test_a_timeout_raises_and_kills_as_subprocess_run_does():
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([sys.executable, "-c", "import time; time.sleep(60)"], capture_output=True, timeout=1)
    assert time.monotonic() - started < 30


def test_children_start_and_multiprocessing_spawns_from_a_module(tmp_path):
    (tmp_path / "spawner.py").write_text(
        "import multiprocessing as mp, subprocess, sys\n"
        "def square(x):\n    return x * x\n"
        "if __name__ == '__main__':\n"
        "    with mp.get_context('spawn').Pool(2) as pool:\n        print(pool.map(square, [1, 2, 3]))\n"
        "    print(subprocess.run([sys.executable, '-c', 'print(6)'], capture_output=True, text=True).stdout.strip())\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    same(*both([sys.executable, "-m", "spawner"], cwd=tmp_path, env=env))


def test_start_time_settings_are_those_of_the_environment_given():
    code = "import torch; print(torch.get_num_threads())"
    for threads in ("1", "2"):
        same(*both([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": threads}))


def test_two_runs_in_a_row_never_share_a_string_hash_seed():
    code = "print(hash('a string'))"
    seeds = {warm_python.run([sys.executable, "-c", code], capture_output=True, text=True).stdout
             for _ in range(4)}
    assert len(seeds) >= 2
    pinned = {**os.environ, "PYTHONHASHSEED": "3"}
    cold, warm = both([sys.executable, "-c", code], env=pinned)
    same(cold, warm)


def test_what_it_does_not_mirror_starts_cold():
    for argv, options in ((["true"], {}), ([sys.executable, "-X", "utf8", "-c", "pass"], {}),
                          ([sys.executable, "-c", "pass"], {"start_new_session": True})):
        proc = warm_python.Popen(argv, **options)
        assert isinstance(proc, subprocess.Popen)
        assert proc.wait(timeout=60) == 0


def test_commands_started_at_once_from_threads_all_finish():
    env = {**os.environ, "OMP_NUM_THREADS": "3"}  # a start-up setting no other test uses: servers start now
    with ThreadPoolExecutor(4) as pool:
        done = list(pool.map(lambda i: warm_python.run([sys.executable, "-c", f"print({i})"], capture_output=True,
                                                       text=True, env=env, timeout=120), range(8)))
    assert [(d.returncode, d.stdout) for d in done] == [(0, f"{i}\n") for i in range(8)]


_RUN_HERE = """
import os, sys
sys.path.insert(0, {tests!r})
import warm_python
sys.stdout.flush()
pid = os.fork()
if pid == 0:
    warm_python.run_here(sys.argv[1:])
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


@pytest.mark.parametrize("exit_code", ["0", "3"])
def test_run_here_makes_a_fork_the_command_a_cold_start_runs(script, tmp_path, exit_code):
    """``run_here``, which tests/in_tmpfs.py calls in the fork it prepares: the module's run is
    the cold start's (output, argv, sys.path[0], working directory, environment, exit status)."""
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "WARM_MARKER": "h", "WARM_EXIT": exit_code}
    cold = subprocess.run([sys.executable, "-m", "probe", "--x", "y z"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    here = subprocess.run([sys.executable, "-c", _RUN_HERE.format(tests=os.path.join(REPO, "tests")), "-m", "probe",
                           "--x", "y z"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    same(cold, here)


_PATH_PROBE = "import json, sys; print(json.dumps(sys.path))"


def test_pythonpath_entries_stand_where_a_cold_start_puts_them(tmp_path):
    """Relative, empty and repeated entries, in each mode: the whole ``sys.path`` is the cold
    start's; a PYTHONPATH that would shadow a preloaded library starts cold."""
    (tmp_path / "rel").mkdir()
    (tmp_path / "probe.py").write_text(_PATH_PROBE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(["", "rel", str(tmp_path), "rel", str(tmp_path / "x")])}
    for argv in ([sys.executable, "-c", _PATH_PROBE], [sys.executable, "-m", "probe"],
                 [sys.executable, str(tmp_path / "probe.py")]):
        same(*both(argv, cwd=tmp_path, env=env))
    (tmp_path / "shadow" / "numpy").mkdir(parents=True)
    (tmp_path / "shadow" / "numpy" / "__init__.py").write_text("raise SystemExit('the shadowing numpy')")
    env["PYTHONPATH"] = str(tmp_path / "shadow")
    cold, warm = both([sys.executable, "-c", "import numpy"], cwd=tmp_path, env=env)
    same(cold, warm)
    assert cold.returncode == 1 and "the shadowing numpy" in cold.stderr


def test_a_folder_named_like_a_preloaded_library_without_init_is_served_warm(tmp_path):
    """The repository's triton/ (no __init__.py) on PYTHONPATH: the installed triton is the one a
    cold start imports too, so the command is served warm, and sees what a cold start sees."""
    (tmp_path / "triton").mkdir()
    (tmp_path / "triton" / "client.py").write_text("")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    code = "import json, sys, triton; print(json.dumps([triton.__file__, sys.path]))"
    same(*both([sys.executable, "-c", code], cwd=REPO, env=env))
    assert not warm_python._shadows_a_start_up_import(str(tmp_path), REPO)
    (tmp_path / "triton" / "__init__.py").write_text("")
    assert warm_python._shadows_a_start_up_import(str(tmp_path), REPO)


@pytest.mark.parametrize("name", ["numpy.py", "numpy.so", "numpy.cpython-311-x86_64-linux-gnu.so", "sitecustomize.py"])
def test_a_module_or_extension_named_like_a_preloaded_one_starts_cold(tmp_path, name):
    (tmp_path / name).write_text("")
    assert warm_python._shadows_a_start_up_import(str(tmp_path), REPO)
    assert not warm_python._shadows_a_start_up_import(str(tmp_path / "elsewhere"), REPO)
