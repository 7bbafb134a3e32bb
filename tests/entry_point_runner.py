"""Runs many command lines of one entry point cheaply, each as ``python -m MODULE ARGS`` would.

    python tests/entry_point_runner.py CASES.json RESULTS.json

CASES.json: {"module": "dlrm.scripts.main" (or a script's absolute path), "preload": [modules],
"cases": [{"args": [...], "cwd": "..."}], "read_only_mount": "/path" (optional)}. The heavy
imports (torch, the library) are done once; then each case runs in a forked child that executes
the script module as ``__main__`` (``runpy``, so its flags are defined and parsed afresh, exactly
as under ``python -m``) in its own working directory, with stdout and stderr captured.
RESULTS.json gets each case's exit code, stdout and stderr. Why: one start of python with torch
takes seconds on a small machine, and the hostile-user suite runs hundreds of command lines that
each end at their first check.

With "read_only_mount", the runner first moves into a mount namespace of its own (as
``unshare -m`` would, which needs root or CAP_SYS_ADMIN) and mounts a read-only tmpfs at that
path, seen by its cases only (tests/in_tmpfs.py): a real read-only file system, no trace outside.
Done by the runner itself, not by ``unshare -m sh -c 'mount ...'`` around a fresh interpreter, so
that the runner can start as a fork of a process that has imported torch (tests/warm_python.py).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import tempfile

from in_tmpfs import mount_private_tmpfs


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
        mount_private_tmpfs(spec["read_only_mount"], "64k", read_only=True)
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
