import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from dlrm.engine.atomic import write_atomically, write_text_atomically


def test_replaces_the_whole_file_with_shared_permissions(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    write_text_atomically(path, "old")
    old_umask = os.umask(0o022)
    try:
        write_text_atomically(path, "new")
    finally:
        os.umask(old_umask)
    assert path.read_text() == "new"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644
    assert os.listdir(path.parent) == ["f.txt"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    write_text_atomically(path, "old")

    def half_then_fail(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_atomically(path, half_then_fail)
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["f.txt"]


# A child process that starts writing ``path`` and stays inside ``write`` until killed.
_SLOW_WRITER = """
import sys, time
from dlrm.engine.atomic import write_atomically

def write(tmp):
    with open(tmp, "w") as f:
        f.write("half")
    open(sys.argv[2], "w").close()  # tell the test the temporary file exists
    time.sleep(600)

write_atomically(sys.argv[1], write)
"""


def _start_slow_writer(path, tmp_path):
    ready = tmp_path / "ready"
    child = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(path), str(ready)])
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert child.poll() is None and time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.02)
    return child


def _temporaries(directory):
    return sorted(n for n in os.listdir(directory) if n.endswith(".tmp"))


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    path = tmp_path / "out" / "f.txt"
    write_text_atomically(path, "old")
    child = _start_slow_writer(path, tmp_path)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert len(_temporaries(path.parent)) == 1  # what kill -9 leaves
    write_text_atomically(path, "new")
    assert path.read_text() == "new"
    assert os.listdir(path.parent) == ["f.txt"]


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    path = tmp_path / "out" / "f.txt"
    child = _start_slow_writer(path, tmp_path)
    try:
        (live,) = _temporaries(path.parent)
        write_text_atomically(path, "mine")
        assert path.read_text() == "mine"
        assert _temporaries(path.parent) == [live]
        assert (path.parent / live).read_text() == "half"
    finally:
        child.kill()
        child.wait()


def test_only_our_own_naming_of_dead_writers_is_removed(tmp_path):
    path = tmp_path / "f.txt"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    others = [
        f".f.txt.{dead.pid}@elsewhere.abc123.tmp",  # another host: cannot tell whether it is alive
        f".g.txt.{dead.pid}@{socket.gethostname()}.abc123.tmp",  # another target
        ".f.txt.abc123.tmp",  # no owner in the name
        "f.txt.tmp",
    ]
    for name in others + [f".f.txt.{dead.pid}@{socket.gethostname()}.abc123.tmp"]:
        (tmp_path / name).write_text("x")
    write_text_atomically(path, "new")
    assert sorted(os.listdir(tmp_path)) == sorted(others + ["f.txt"])
