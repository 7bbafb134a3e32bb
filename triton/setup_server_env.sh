#!/usr/bin/env bash
# Creates the virtual environment the local Triton server runs in (tests, CPU trials):
#
#     bash triton/setup_server_env.sh [DIR] [--with-torch]     # DIR defaults to .venv-tritonserver
#
# nvidia-pytriton bundles a tritonserver with the python backend; it needs numpy < 2, and the
# python backend's stub returns empty tensors under numpy 2, so the server gets its own
# environment instead of sharing the project's. ONNX Runtime runs model.onnx inside the python
# backend; --with-torch adds torch (CPU build, pinned as the project's) for model.pt.
# The environment is built from PYTHON (default: python, else python3 on the PATH),
# which must have a shared libpython: the backend's stub links it.
set -euo pipefail

dir=.venv-tritonserver
with_torch=0
for arg in "$@"; do
    case "$arg" in
        --with-torch) with_torch=1 ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        -*) echo "unknown option: $arg" >&2; exit 2 ;;
        *) dir=$arg ;;
    esac
done
python=${PYTHON:-$(command -v python || command -v python3)}

if [ "$("$python" -c 'import sysconfig; print(sysconfig.get_config_var("Py_ENABLE_SHARED") or 0)')" != 1 ]; then
    echo "$python has no shared libpython (the python backend's stub links it): use a Python built with" \
         "--enable-shared (distribution Pythons, pyenv with PYTHON_CONFIGURE_OPTS=--enable-shared)" >&2
    exit 1
fi

"$python" -m venv "$dir"
packages=("nvidia-pytriton==0.7.0" "numpy<2" "onnxruntime")
if [ "$with_torch" = 1 ]; then
    packages+=("torch==2.13.0")
fi
"$dir/bin/python" -m pip install --quiet "${packages[@]}"
"$dir/bin/python" -c 'import numpy, onnxruntime, pytriton; print("server environment ready: numpy", numpy.__version__, "onnxruntime", onnxruntime.__version__)'
