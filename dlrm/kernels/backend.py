"""When a Triton kernel may run: a CUDA tensor with Triton installed, or any tensor under
``TRITON_INTERPRET=1`` (Triton's interpreter, which is how CI checks the kernels on a CPU).

Every kernel in this package has a pure-torch reference with the same signature; callers ask
``triton_usable`` first and take the reference otherwise, so a missing Triton, an old GPU or a
CPU run never crashes, it only runs slower.
"""

from __future__ import annotations

import functools
import os

import torch

AUTOCAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts; float64 it leaves alone


@functools.cache
def triton_installed() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while importing
        return False
    return True


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``: kernels then run on CPU tensors, in numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_usable(*tensors: torch.Tensor) -> bool:
    """Whether a Triton kernel can take these tensors: all on one CUDA device (with a GPU
    Triton supports, compute capability 7.0 or newer), or all on the CPU under the interpreter."""
    if not tensors or not triton_installed():
        return False
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return False
    device = devices.pop()
    if interpreting():
        return device.type == "cpu"
    if device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (7, 0)


def tf32_allowed() -> bool:
    """Whether float32 matmuls may use TF32 (``torch.backends.cuda.matmul.allow_tf32``), which
    kernels follow as cuBLAS does. Torch 2.9+ refuses to read that flag once the newer
    ``fp32_precision`` setting was used; then that setting answers."""
    matmul = torch.backends.cuda.matmul
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return getattr(matmul, "fp32_precision", "ieee") == "tf32"


def exporting() -> bool:
    """Whether ``torch.jit.trace`` or ``torch.export`` (also under ``torch.onnx.export``) is
    recording a graph: kernels then step aside for plain torch ops the exporter can record."""
    is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)  # absent from older torch
    return torch.jit.is_tracing() or is_exporting()


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype a kernel computes and writes in, as the torch ops it replaces would: the
    autocast dtype when autocast is on for the tensors' device type (float64 stays float64,
    as autocast leaves it), else the promotion of the tensors' dtypes."""
    device_type = tensors[0].device.type
    promoted = functools.reduce(torch.promote_types, (t.dtype for t in tensors))
    if promoted in AUTOCAST_DTYPES and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return promoted
