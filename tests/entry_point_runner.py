"""Runs many command lines of one entry point cheaply, each as ``python -m MODULE ARGS`` would.

    python tests/entry_point_runner.py CASES.json RESULTS.json

CASES.json: {"module": "dlrm.scripts.main" (or a script's absolute path), "preload": [modules], "cases": [{"args": [...],
"cwd": "..."}], "read_only_mount": "/path" (optional)}. The heavy imports (torch, the library) are done once; then each case runs in a
forked child that executes the script module as ``__main__`` (``runpy``, so its flags are defined
and parsed afresh, exactly as under ``python -m``) in its own working directory, with stdout and
stderr captured. RESULTS.json gets each case's exit code, stdout and stderr. Why: one start of
python with torch takes seconds on a small machine, and the hostile-user suite runs hundreds of
command lines that each end at their first check.

With "read_only_mount", the runner first moves into a mount namespace of its own (as
``unshare -m`` would, which needs root or CAP_SYS_ADMIN) and mounts a read-only tmpfs at that
path, seen by its cases only: a real read-only file system, with no trace outside.
"""

from __future__ import annotations

import importlib
import json
import ctypes
import os
import runpy
import subprocess
import sys
import tempfile

CLONE_NEWNS = 0x00020000  # <sched.h>; os.unshare exists from Python 3.12 only


def _mount_read_only_tmpfs(path: str) -> None:
    """A private mount namespace for this process and its children, and a read-only tmpfs at
    ``path`` in it. Done by the runner itself (not ``unshare -m sh -c 'mount ...'`` around a fresh
    interpreter), so the runner can be a fork of a process that has imported torch already."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")
    # Private first: a namespace copied from a shared one would pass the mount back to the host's.
    subprocess.run(["mount", "--make-rprivate", "/"], check=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", path], check=True)


def _run_child(module: str, args: list[str], cwd: str, out_path: str, err_path: str) -> None:
    os.chdir(cwd)
    out = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.argv = [module, *args]
    code = 0
    try:
        if module.endswith(".py"):  # a script run by its path, e.g. triton/client.py
            runpy.run_path(module, run_name="__main__")
        else:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:  # a traceback, as python -m would print it
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    if spec.get("read_only_mount"):
        _mount_read_only_tmpfs(spec["read_only_mount"])
    sys.path.insert(0, os.getcwd())
    for name in spec.get("preload", []):
        importlib.import_module(name)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        for i, case in enumerate(spec["cases"]):
            out_path, err_path = os.path.join(scratch, f"{i}.out"), os.path.join(scratch, f"{i}.err")
            pid = os.fork()
            if pid == 0:
                _run_child(spec["module"], case["args"], case["cwd"], out_path, err_path)
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
            results.append({"returncode": code, "stdout": open(out_path).read(), "stderr": open(err_path).read()})
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
