import os
import subprocess
import sys

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors, so CI checks every
# kernel against its torch reference. Set before anything imports triton: the interpreter is
# chosen when a kernel is defined. On a GPU machine the real kernels run.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(module: str, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``python -m module args`` as a user would, from the repository root."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{module} {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def cli():
    return run_cli


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` skip themselves on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
