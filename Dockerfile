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
# with --no-deps and its few other dependencies are named here (none of them depends on torch).
RUN pip install --no-cache-dir absl-py scikit-learn pyyaml \
        onnx onnxruntime onnxscript "tritonclient[grpc,http]" \
        matplotlib nbclient nbformat ipykernel pytest

COPY pyproject.toml README.md bind.sh ./
COPY dlrm/ dlrm/
COPY preproc/ preproc/
COPY triton/ triton/
COPY notebooks/ notebooks/
COPY docs/ docs/
COPY tests/ tests/
RUN pip install --no-cache-dir --no-deps -e . \
    && python -c "import torch, dlrm.model.dlrm; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
