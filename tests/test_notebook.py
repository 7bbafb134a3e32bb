"""notebooks/: each is saved with its outputs (a reader on the web sees the plots), and runs
headless from top to bottom (``notebooks/execute.py``: nbclient, a fresh kernel of this Python,
the repository root as working directory): it draws as many plots as were saved, its own checks
pass on what it printed, and its figures agree with the saved ones within a tolerance that
leaves room for another CPU's arithmetic."""

import os
import re
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("matplotlib")
pytest.importorskip("ipykernel")
pytest.importorskip("onnxruntime")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "notebooks"))
from execute import execute  # noqa: E402  (notebooks/execute.py: the same run that saved them)

NOTEBOOKS = sorted(os.path.join(REPO, "notebooks", n) for n in os.listdir(os.path.join(REPO, "notebooks"))
                   if n.endswith(".ipynb"))


def _check_dlrm(text, images, workdir):
    assert len(images) >= 2  # the learning curve / AUC figure, and latency against throughput
    auc = float(text.split("final test AUC ")[1].split()[0])
    assert auc > 0.6, text[-2000:]
    assert "may not be successful" not in text  # the ONNX export's chatter stays out
    assert workdir is None or os.path.isfile(workdir / "bench.json")


def _check_recommender(text, images, workdir):
    assert len(images) >= 2  # precision@K against K, recall@K against K
    line = text.split("P@10 model ")[1].splitlines()[0]  # "X baseline-best Y (name) popularity Z autoencoder W"
    words = line.split()
    model, best = float(words[0]), float(words[words.index("baseline-best") + 1])
    popularity = float(words[words.index("popularity") + 1])
    assert model > 1.2 * popularity and model >= 0.98 * best, line  # the default is at least the best baseline
    assert 0 < popularity <= best <= 1, line
    assert workdir is None or (os.path.isdir(workdir / "input") and os.path.isdir(workdir / "heldout"))


CHECKS = {"dlrm_walkthrough.ipynb": _check_dlrm, "recommender_walkthrough.ipynb": _check_recommender}
# The figures compared with the saved run: a pattern with one number, and how far it may move.
FIGURES = {
    "dlrm_walkthrough.ipynb": [(r"final test AUC (\d\.\d+)", 0.01)],
    "recommender_walkthrough.ipynb": [(r"P@10 model (\d\.\d+)", 0.01), (r"baseline-best (\d\.\d+)", 0.01),
                                      (r"popularity (\d\.\d+)", 0.005), (r"autoencoder (\d\.\d+)", 0.015)],
}


def _outputs(notebook) -> tuple[str, list]:
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    text = "".join(o.get("text", "") for o in outputs)
    return text, images


def test_each_notebook_has_its_checks():
    assert [os.path.basename(p) for p in NOTEBOOKS] == sorted(CHECKS) == sorted(FIGURES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_the_saved_notebook_shows_its_plots_and_no_machine_paths(path):
    text, images = _outputs(nbformat.read(path, as_version=4))
    CHECKS[os.path.basename(path)](text, images, None)
    assert not re.search(r"/tmp/|/home/|/root/|" + re.escape(REPO), text), "a machine's path in the saved outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_the_notebook_runs_and_agrees_with_what_is_saved(path, tmp_path):
    name = os.path.basename(path)
    saved_text, saved_images = _outputs(nbformat.read(path, as_version=4))
    notebook = execute(path, env={"DLRM_NOTEBOOK_WORKDIR": str(tmp_path / "work")})
    text, images = _outputs(notebook)
    CHECKS[name](text, images, tmp_path / "work")
    assert len(images) == len(saved_images)
    for pattern, tolerance in FIGURES[name]:
        now, then = float(re.search(pattern, text).group(1)), float(re.search(pattern, saved_text).group(1))
        assert abs(now - then) <= tolerance, (pattern, now, then)
