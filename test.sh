#!/usr/bin/env bash
# The whole test suite, from a fresh clone, in one command:
#
#     bash test.sh [PYTEST ARGS...]
#
# 1. installs the project with its test extra (torch pinned to the CPU build, so pip never pulls
#    a CUDA build onto a machine without a GPU; on a GPU machine install torch first);
# 2. builds the local Triton Inference Server's own environment, .venv-tritonserver (its python
#    backend needs numpy < 2), unless a working one is already there;
# 3. runs pytest with DLRM_REQUIRE_TRITON_SERVER=1, so the real-server tests fail rather than
#    skip when the server cannot start.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
python=${PYTHON:-$(command -v python || command -v python3)}
"$python" -m pip install torch==2.13.0 -e ".[test]"
if ! .venv-tritonserver/bin/python -c 'import numpy, onnxruntime, pytriton, torch' 2>/dev/null; then
    rm -rf .venv-tritonserver
    PYTHON="$python" bash triton/setup_server_env.sh .venv-tritonserver --with-torch
fi
DLRM_REQUIRE_TRITON_SERVER=1 "$python" -m pytest "$@"
