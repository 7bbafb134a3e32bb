#!/usr/bin/env bash
# The whole test suite, from a fresh clone, in one command:
#
#     bash test.sh [PYTEST ARGS...]
#
# 1. makes a venv of its own, .venv (once; or uses the active one: VIRTUAL_ENV, or PYTHON=...),
#    installs torch there unless it has one (2.13.0 from PyPI's CPU wheel index, so a machine
#    without a GPU never gets the CUDA build; where only the configured index answers, torch
#    2.13.0 from it), then the project with its test extra;
# 2. builds the local Triton Inference Server's own environment (its python backend needs
#    numpy < 2) in the user's cache, once per machine, unless a working one is already there;
# 3. starts the bare-install check (.ci/bare_install.sh: a fresh venv with the README's install
#    line alone, then the README's commands from the repository root) beside pytest, since the
#    prepared test environment cannot see what a new user's machine lacks; BARE_CHECK=0 skips it;
# 4. runs pytest (three workers, pytest-xdist) with DLRM_REQUIRE_TRITON_SERVER=1, so the
#    real-server tests fail rather than skip when the server cannot start; then waits for the
#    bare-install check.
# Fails if either fails.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if [ -n "${PYTHON:-}" ]; then
    python=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then
    python=$VIRTUAL_ENV/bin/python
else
    [ -x .venv/bin/python ] || "$(command -v python3 || command -v python)" -m venv .venv
    python=$PWD/.venv/bin/python
fi
echo "test.sh: testing with $python"
bash .ci/install_torch.sh "$python"
"$python" -m pip install -e ".[test]"
# The server's environment is built once per machine, not once per clone: it lives in the user's
# cache, named by a hash of the script that builds it (a changed package list builds a new one).
# DLRM_TRITON_SERVER_ENV, or a .venv-tritonserver built in this clone, is used as it is.
server_check=(-c 'import numpy, onnxruntime, pytriton, torch')
if [ -n "${DLRM_TRITON_SERVER_ENV:-}" ]; then
    "$DLRM_TRITON_SERVER_ENV/bin/python" "${server_check[@]}" || {
        echo "test.sh: DLRM_TRITON_SERVER_ENV=$DLRM_TRITON_SERVER_ENV is not a working server environment;" \
             "unset it, or build one there: bash triton/setup_server_env.sh DIR --with-torch" >&2
        exit 2
    }
elif [ -x .venv-tritonserver/bin/python ] && .venv-tritonserver/bin/python "${server_check[@]}" 2>/dev/null; then
    export DLRM_TRITON_SERVER_ENV=$PWD/.venv-tritonserver
else
    key=$("$python" -c 'import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest()[:12])' \
          <triton/setup_server_env.sh)
    export DLRM_TRITON_SERVER_ENV=${XDG_CACHE_HOME:-$HOME/.cache}/dlrm/tritonserver-$key
    mkdir -p "$(dirname "$DLRM_TRITON_SERVER_ENV")"
    exec 9>"$DLRM_TRITON_SERVER_ENV.lock"
    flock 9  # two clones testing at once build it once
    if ! "$DLRM_TRITON_SERVER_ENV/bin/python" "${server_check[@]}" 2>/dev/null; then
        rm -rf "$DLRM_TRITON_SERVER_ENV"  # ours: only this script writes under that name
        PYTHON="$python" bash triton/setup_server_env.sh "$DLRM_TRITON_SERVER_ENV" --with-torch
    fi
    exec 9>&-
fi
bare_pid=
if [ "${BARE_CHECK:-1}" != 0 ]; then
    bare_log=$(mktemp "${TMPDIR:-/tmp}/dlrm-bare-log.XXXXXX")
    PYTHON="$python" bash .ci/bare_install.sh >"$bare_log" 2>&1 &
    bare_pid=$!
fi
rc=0
# Three pytest workers (PYTEST_WORKERS) on two cores, a test file to a worker: most tests wait on
# subprocesses (torch start-up, Spark, torchrun): two workers kept 1.55 of 2 cores busy.
# The costliest files start first (tests/conftest.py's COSTLIEST_FILES), in collection order.
# One OpenMP thread per process (unless OMP_NUM_THREADS says otherwise): three workers and the
# commands they start already fill the cores, and torch's default of a thread per core would have
# each process's threads spin-wait for each other at every parallel region, time the others lose.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DLRM_REQUIRE_TRITON_SERVER=1 "$python" -m pytest -n "${PYTEST_WORKERS:-3}" --dist loadfile --no-loadscope-reorder "$@" \
    || rc=$?
if [ -n "$bare_pid" ]; then
    bare_rc=0
    wait "$bare_pid" || bare_rc=$?
    cat "$bare_log"
    rm -f "$bare_log"
    [ "$bare_rc" = 0 ] || { echo "test.sh: the bare-install check failed (exit $bare_rc)" >&2; rc=1; }
fi
exit "$rc"
