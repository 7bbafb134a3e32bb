# Training image: NVIDIA's NGC PyTorch container (CUDA, cuDNN, NCCL, PyTorch, the Triton
# compiler) with this project installed on top.
#
#   docker build -t dlrm .
#   docker run --gpus all --ipc=host -it --rm -v /data:/data dlrm \
#       python -m dlrm.scripts.main --dataset /data/criteo_fl15 --amp
#   docker run --gpus all --ipc=host -it --rm -v /data:/data dlrm \
#       torchrun --nproc_per_node 8 -m dlrm.scripts.main --dataset /data/criteo_fl15 --amp
#
# Serving runs in NVIDIA's Triton container of the same release (nvcr.io/nvidia/tritonserver:
# <same YY.MM>-py3), whose PyTorch backend then has the libtorch this image's torch matches:
# see triton/README.md.
ARG FROM_IMAGE_NAME=nvcr.io/nvidia/pytorch:26.04-py3
FROM ${FROM_IMAGE_NAME}

ENV PYTHONUNBUFFERED=1
WORKDIR /workspace/dlrm

# Dependencies first, so editing the sources does not re-run this layer. The base image's torch
# is CUDA-enabled and built for it: nothing below may replace it, so the project is installed
# with --no-deps and its other dependencies come pinned from docker/requirements.txt (none of
# them depends on torch).
COPY docker/requirements.txt docker/requirements.txt
RUN pip install --no-cache-dir --requirement docker/requirements.txt

# Everything the README's commands and the tests read (.dockerignore keeps local venvs and
# outputs out).
COPY pyproject.toml README.md CHANGELOG.md LICENSE bind.sh test.sh ./
COPY .ci/ .ci/
COPY dlrm/ dlrm/
COPY preproc/ preproc/
COPY triton/ triton/
COPY configs/ configs/
COPY benchmarks/ benchmarks/
COPY notebooks/ notebooks/
COPY docs/ docs/
COPY tests/ tests/
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import torch, dlrm.model.dlrm; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
