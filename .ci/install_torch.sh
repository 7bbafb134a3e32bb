#!/usr/bin/env bash
# torch for a machine without a GPU, as the README installs it: the CPU build from PyTorch's
# wheel index; where that index does not answer (a machine that reaches only a configured
# mirror), torch 2.13.0 from the configured index. A Python that has torch already keeps it (a
# GPU machine's CUDA build).
#
#     bash .ci/install_torch.sh PYTHON
set -euo pipefail
python=$1
if "$python" -c 'import torch' 2>/dev/null; then
    exit 0
fi
"$python" -m pip install --retries 1 --timeout 30 torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
    || "$python" -m pip install torch==2.13.0
