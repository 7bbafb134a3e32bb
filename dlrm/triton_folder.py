"""Keeps the repository's ``triton/`` folder from passing for the Triton compiler.

The top-level ``triton/`` folder (the Triton Inference Server deployer) has no ``__init__.py``.
When the working directory is on ``sys.path`` (``python -m ...`` from the repository root) and
the real ``triton`` package is not installed, ``import triton`` finds that folder as an empty
namespace package. torch then believes Triton is installed (``torch.utils._triton`` only checks
that the import succeeds) and fails later, e.g. ``torch.optim.SGD`` importing ``torch._dynamo``:
``module 'triton' has no attribute 'language'``.

``hide_namespace_triton`` makes that import fail as it would on a machine without Triton. It is
safe because the real package is a regular package (it has ``__init__.py``): the import system
prefers a regular package anywhere on ``sys.path`` to a namespace portion, so when the search
ends in a namespace package, the real Triton is not installed, and nothing is hidden that exists.
It must run before anything imports ``torch._dynamo``, so ``dlrm`` and ``preproc`` call it first
thing in their ``__init__``; it imports nothing heavy.
"""

from __future__ import annotations

import importlib.util
import sys


def namespace_triton() -> bool:
    """Whether ``import triton`` would give a namespace package (a bare folder), not Triton."""
    if "triton" in sys.modules:
        module = sys.modules["triton"]
        return module is not None and getattr(module, "__file__", None) is None
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin in (None, "namespace") and spec.submodule_search_locations is not None


def hide_namespace_triton() -> None:
    """Makes ``import triton`` raise ImportError when it would only find a bare ``triton/`` folder."""
    if namespace_triton():
        sys.modules["triton"] = None  # type: ignore[assignment]  # the import system's "not importable" mark
