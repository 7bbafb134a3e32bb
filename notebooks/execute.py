r"""Runs the notebooks from the repository root, top to bottom, in a fresh kernel of this Python,
and saves them with their outputs (the plots and figures a reader sees on the web):

    python notebooks/execute.py                      # every notebook, in place
    python notebooks/execute.py notebooks/dlrm_walkthrough.ipynb

The test suite runs the same function on a copy and compares its figures with the saved ones
(tests/test_notebook.py). Needs the notebook and export extras.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def execute(path: str, env: dict[str, str] | None = None, timeout: int = 600):
    """The notebook at ``path`` run in a kernel of this interpreter (whatever ``python`` is on
    PATH), from the repository root, with ``env`` set for the kernel: its outputs filled in."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory() as jupyter:
        spec = os.path.join(jupyter, "kernels", "python3")
        os.makedirs(spec)
        with open(os.path.join(spec, "kernel.json"), "w") as f:
            json.dump({"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                       "display_name": "Python 3", "language": "python"}, f)
        before = {k: os.environ.get(k) for k in ("JUPYTER_PATH", "PYTHONPATH", *(env or {}))}
        os.environ.update({"JUPYTER_PATH": jupyter,
                           "PYTHONPATH": os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p),
                           **(env or {})})
        try:
            client = nbclient.NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                                             resources={"metadata": {"path": REPO}})
            client.execute()  # raises CellExecutionError with the failing cell's traceback
        finally:
            for key, value in before.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
    return notebook


def main(paths: list[str]) -> int:
    import nbformat

    for path in paths or sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb"))):
        notebook = execute(path)
        nbformat.write(notebook, path)
        print(f"ran and saved {os.path.relpath(path, REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
