"""Runs a python command with a small tmpfs of its own: what a full or read-only disk does to it.

    FS=DIR AFTER=DIR [SEED=DIR] [RO=1] python tests/in_tmpfs.py SIZE -m MODULE ARGS...

Moves into a mount namespace of its own (as ``unshare -m`` does: root or CAP_SYS_ADMIN), mounts a
tmpfs of SIZE bytes at $FS there (seen by no other process), copies $SEED into it, remounts it
read-only if $RO is 1, runs ``python -m MODULE ARGS`` in a fork (exactly as the interpreter
would: tests/warm_python.py's ``run_here``), then copies what the tmpfs holds to $AFTER and exits
with the command's status. Exit 99: no tmpfs could be mounted here.

Why not ``unshare -m sh -c 'mount ...; python ...'``: that command is a fresh interpreter that
imports torch, seconds per case on two cores; this script can itself start as a fork of a process
that has (tests/warm_python.py), and so can the command it runs.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import warm_python  # noqa: E402

CLONE_NEWNS = 0x00020000  # <sched.h>; os.unshare exists from Python 3.12 only


def mount_private_tmpfs(path: str, size: str, seed: str = "", read_only: bool = False) -> None:
    """Moves this process (and the children it starts after) into a mount namespace of its own
    and mounts a tmpfs of ``size`` at ``path`` there, holding a copy of ``seed``, read-only if
    asked: a real full or read-only file system that no other process sees."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    # Private first: a namespace copied from a shared one would pass the mount back to the host's.
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)
    if seed:
        subprocess.run(["cp", "-a", f"{seed}/.", f"{path}/"], check=True)
    if read_only:
        subprocess.run(["mount", "-o", "remount,ro", path], check=True)


def main() -> int:
    size, command = sys.argv[1], sys.argv[2:]
    fs, after = os.environ["FS"], os.environ["AFTER"]
    try:
        mount_private_tmpfs(fs, size, os.environ.get("SEED", ""), os.environ.get("RO") == "1")
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"in_tmpfs: no tmpfs at {fs}: {e}", file=sys.stderr)
        return 99
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        warm_python.run_here(command)
    _, status = os.waitpid(pid, 0)
    subprocess.run(["cp", "-a", f"{fs}/.", f"{after}/"])
    code = os.waitstatus_to_exitcode(status)
    return 128 + signal.Signals(-code) if code < 0 else code  # as a shell reports a signalled command


if __name__ == "__main__":
    sys.exit(main())
