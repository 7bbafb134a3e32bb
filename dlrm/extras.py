"""Optional dependencies and the pip extra that brings each, so that a command run on the base
install says in one line what to install instead of ending in a ``ModuleNotFoundError``."""

from __future__ import annotations

EXTRAS = {  # top-level module -> extra of pyproject.toml
    "onnx": "export", "onnxruntime": "export", "onnxscript": "export",
    "polars": "preproc", "pyarrow": "preproc", "pyspark": "spark", "pandas": "spark",
    "tritonclient": "serving",
    "matplotlib": "notebook", "nbclient": "notebook", "nbformat": "notebook",
    "triton": "kernels",
    "tensorboard": "tensorboard",
}


def missing_extra(error: ImportError) -> str | None:
    """One line naming the missing module and the extra to install, or None when ``error`` is
    not about an optional dependency (a bug, or a broken install: keep its traceback)."""
    name = (getattr(error, "name", None) or "").split(".")[0]
    extra = EXTRAS.get(name)
    if extra is None:
        return None
    return (f"this command needs {name}, which the base install does not bring: "
            f"pip install -e \".[{extra}]\" (from the repository root)")
