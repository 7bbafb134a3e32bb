"""notebooks/: every notebook runs headless from top to bottom (nbclient, a fresh kernel, the
repository root as working directory) and draws its plots; then its own checks read what it
printed and wrote."""

import glob
import json
import os
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("ipykernel")
pytest.importorskip("onnxruntime")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(REPO, "notebooks", "*.ipynb")))


def _check_dlrm(text, images, workdir):
    assert len(images) >= 2  # the learning curve / AUC figure, and latency against throughput
    auc = float(text.split("final test AUC ")[1].split()[0])
    assert auc > 0.6, text[-2000:]
    assert os.path.isfile(workdir / "bench.json")


def _check_recommender(text, images, workdir):
    assert len(images) >= 2  # precision@K against K, recall@K against K
    line = text.split("P@10 model ")[1].splitlines()[0]  # "X baseline-best Y (name) popularity Z"
    words = line.split()
    model, best = float(words[0]), float(words[words.index("baseline-best") + 1])
    popularity = float(words[words.index("popularity") + 1])
    assert model > 1.2 * popularity, line
    assert 0 < popularity <= best <= 1, line
    assert os.path.isdir(workdir / "input") and os.path.isdir(workdir / "heldout")


CHECKS = {"dlrm_walkthrough.ipynb": _check_dlrm, "recommender_walkthrough.ipynb": _check_recommender}


def test_there_is_a_notebook():
    assert [os.path.basename(p) for p in NOTEBOOKS] == sorted(CHECKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_executes(path, tmp_path, monkeypatch):
    notebook = nbformat.read(path, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        "commit notebooks without outputs (they would hold machine paths and timings)"
    # The kernel runs in this interpreter, whatever "python" is on the PATH.
    spec_dir = tmp_path / "jupyter" / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("DLRM_NOTEBOOK_WORKDIR", str(tmp_path / "work"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": REPO}})
    client.execute()  # raises CellExecutionError with the failing cell's traceback
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    text = "".join(o.get("text", "") for o in outputs)
    CHECKS[os.path.basename(path)](text, images, tmp_path / "work")
