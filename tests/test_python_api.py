"""DLRM's Python API (dlrm.api, docs/python_api.md): the doc's code runs as written on a
checkpoint the command line trained; ``dlrm.load(ck).evaluate`` gives ``--mode test``'s AUC and
loss; ``predict`` on arrays in memory gives the exported TorchScript model's scores, and from
them the command line's loss and AUC; ``train`` returns a result that loads its model."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import yaml
from sklearn.metrics import roc_auc_score

import dlrm
import warm_python
from conftest import REPO, log_records
from dlrm import api
from dlrm.data.batch import Bags

DOC = os.path.join(REPO, "docs", "python_api.md")
TOLERANCE = 1e-6


def doc_blocks() -> list[tuple[str, str]]:
    """The doc's code blocks in order: (language, code)."""
    with open(DOC, encoding="utf-8") as f:
        return re.findall(r"```(bash|python)\n(.*?)```", f.read(), re.S)


def command_env() -> dict[str, str]:
    """This process's environment for a command run elsewhere than the repository root: this
    tree's ``dlrm`` first on the path, and no Triton interpreter (as ``conftest.run_cli``)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_command(line: str, cwd: str) -> str:
    """One ``python -m ...`` line, run in ``cwd`` as a user would; its output."""
    args = shlex.split(line)
    assert args[:2] == ["python", "-m"], line
    proc = warm_python.run([sys.executable, *args[1:]], cwd=cwd, env=command_env(), capture_output=True,
                           text=True, timeout=300)
    assert proc.returncode == 0, f"{line}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def walked(tmp_path_factory) -> dict:
    """The doc's blocks run in order in an empty folder; what its Python leaves, with ``workdir``."""
    workdir = str(tmp_path_factory.mktemp("python_api"))
    namespace: dict = {}
    here = os.getcwd()
    os.chdir(workdir)
    try:
        for i, (language, code) in enumerate(doc_blocks()):
            if language == "bash":
                for line in filter(str.strip, code.replace("\\\n", " ").splitlines()):
                    run_command(line, workdir)
            else:
                exec(compile(code, f"{DOC}, block {i}", "exec"), namespace)
    finally:
        os.chdir(here)
    namespace["workdir"] = workdir
    return namespace


def read_split(workdir: str, split: str = "test") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels, numerical and categorical columns of a split, read with numpy from the files."""
    with open(os.path.join(workdir, "data", "feature_spec.yaml"), encoding="utf-8") as f:
        spec = yaml.safe_load(f)
    folder = os.path.join(workdir, "data", split)
    labels = np.fromfile(os.path.join(folder, "label.bin"), dtype=np.uint8).astype(np.float64)
    numerical = np.fromfile(os.path.join(folder, "numerical.bin"), dtype=np.float16).reshape(len(labels), -1)
    categorical = np.stack([np.fromfile(os.path.join(folder, name), dtype=spec["feature_spec"][name]["dtype"])
                            for name in spec["channel_spec"]["categorical"]], axis=1)
    return labels, numerical, categorical



def cli_test_summary(workdir: str) -> dict:
    (summary,) = log_records(os.path.join(workdir, "test.json"), "summary")
    return summary


def test_evaluate_gives_the_command_lines_test_auc_and_loss(walked):
    cli = cli_test_summary(walked["workdir"])
    tested = walked["tested"]
    assert isinstance(tested, api.Evaluation) and tested.samples == cli["samples"] == 700
    assert abs(tested.auc - cli["auc"]) <= TOLERANCE and abs(tested.loss - cli["loss"]) <= TOLERANCE
    assert walked["cli"]["auc"] == cli["auc"]  # the doc read the same record


def test_predict_gives_the_exported_models_scores_and_the_command_lines_loss_and_auc(walked):
    workdir = walked["workdir"]
    run_command("python -m dlrm.scripts.export --checkpoint ckpt --output exported --format torchscript "
                "--check_batch_sizes 1", workdir)
    labels, numerical, categorical = read_split(workdir)
    scores = dlrm.load(os.path.join(workdir, "ckpt")).predict(numerical, categorical, batch_size=100)
    assert isinstance(scores, np.ndarray) and scores.dtype == np.float32 and scores.shape == (len(labels),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load's notice; servers still load it
        served = torch.jit.load(os.path.join(workdir, "exported", "model.pt"))
    with torch.no_grad():
        expected = served(torch.from_numpy(numerical.astype(np.float32)),
                          torch.from_numpy(categorical.astype(np.int64))).reshape(-1).numpy()
    np.testing.assert_allclose(scores, expected, rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(walked["test_scores"], scores, rtol=0, atol=TOLERANCE)  # the doc's own read

    cli = cli_test_summary(workdir)
    p = scores.astype(np.float64)
    loss = float(np.mean(-(labels * np.log(p) + (1 - labels) * np.log1p(-p))))
    assert abs(loss - cli["loss"]) <= TOLERANCE
    assert abs(roc_auc_score(labels, p) - cli["auc"]) <= TOLERANCE


def test_predict_keeps_the_kind_of_its_inputs_in_any_batch_size(walked):
    model = walked["model"]
    numerical, categorical = walked["numerical"], walked["categorical"]
    scores = model.predict(numerical, categorical)
    for batch_size in (1, 2, 5):
        np.testing.assert_allclose(model.predict(numerical, categorical, batch_size=batch_size), scores,
                                   rtol=0, atol=TOLERANCE)
    as_torch = model.predict(torch.from_numpy(numerical).double(), torch.from_numpy(categorical).to(torch.int32))
    assert isinstance(as_torch, torch.Tensor) and as_torch.dtype == torch.float32 and as_torch.device.type == "cpu"
    np.testing.assert_allclose(as_torch.numpy(), scores, rtol=0, atol=TOLERANCE)
    assert model.module.training is False and torch.is_grad_enabled()
    assert model.predict(numerical[:0], categorical[:0]).shape == (0,)
    bags = model.predict(torch.from_numpy(numerical), Bags.from_one_hot(torch.from_numpy(categorical)))  # multi-hot
    np.testing.assert_allclose(bags.numpy(), scores, rtol=0, atol=TOLERANCE)
    assert model.config.table_sizes == [20, 300, 7] and model.config.num_numerical_features == 3


FOUR = np.zeros((4, 3), np.float32)
IDS = np.zeros((4, 3), np.int64)


@pytest.mark.parametrize("numerical, categorical, says", [
    (np.zeros((4, 2), np.float32), IDS, r"`numerical`: shape \(4, 2\); the model takes \[N, 3\]"),
    (FOUR, np.zeros((3, 3), np.int64), r"`categorical`: shape \(3, 3\); the model takes \[4, 3\]"),
    (FOUR, FOUR, "`categorical`: ids must be integers, got torch.float32"),
    ([[0.0] * 3] * 4, IDS, "`numerical`: a numpy array or a torch tensor, got list"),
    (FOUR, Bags.from_one_hot(torch.zeros(3, 3, dtype=torch.int64)), "`categorical`: bags of 3 samples and 3 features"),
    # ids past a table (its cardinality 300) or negative: torch would fail with "index out of range in self"
    (FOUR, np.array([[0, 0, 0], [0, 300, 0], [0, 0, 0], [0, 0, 0]]), r"`categorical`: row 1, table 1 has id 300; "
     r"the table's ids run from 0 to 299"),
    (FOUR, np.array([[0, 0, -1]] * 4), "`categorical`: row 0, table 2 has id -1"),
    (np.array([[0, 0, 0]] * 3 + [[0, np.inf, 0]], np.float32), IDS, "`numerical`: row 3 holds a value that is not "
     r"finite \(nan or inf\)"),
])
def test_wrong_inputs_are_setting_errors_naming_the_argument(walked, numerical, categorical, says):
    with pytest.raises(dlrm.SettingError, match=says):
        walked["model"].predict(numerical, categorical)
    with pytest.raises(dlrm.SettingError, match="`batch_size` must be at least 1"):
        walked["model"].predict(walked["numerical"], walked["categorical"], batch_size=0)


def test_train_returns_its_summary_checkpoint_and_model(walked):
    result, workdir = walked["result"], walked["workdir"]
    assert isinstance(result, dlrm.TrainResult) and result.checkpoint_path == "ckpt2"
    (logged,) = log_records(os.path.join(workdir, "train2.json"), "summary")
    assert result.steps == result["steps"] == result.summary["steps"] == logged["steps"] == 4
    assert result.best_auc == logged["best_auc"] and result.stop_reason == "completed"
    with pytest.raises(AttributeError, match="no attribute or summary field 'nonsense'"):
        result.nonsense
    again = dlrm.load(os.path.join(workdir, "ckpt2")).predict(walked["numerical"], walked["categorical"])
    np.testing.assert_array_equal(walked["retrained"].predict(walked["numerical"], walked["categorical"]), again)
    with pytest.raises(dlrm.SettingError, match="`save_checkpoint_path`"):
        api.TrainResult(summary={}, checkpoint_path=None).load()


def test_import_dlrm_is_light_and_names_the_whole_api():
    """A cold interpreter: ``import dlrm`` loads no torch (the API's names load it on first use)."""
    code = "import sys, dlrm; print('torch' in sys.modules, 'dlrm.api' in sys.modules, dlrm.__version__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=command_env(), capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    from dlrm.version import __version__

    assert out == ["False", "False", __version__]
    assert set(dlrm.__all__) == set(api.__all__) | {"__version__"}
    assert all(getattr(dlrm, name) is getattr(api, name) for name in api.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        dlrm.nonsense
    assert importlib.util.find_spec("dlrm.training.api") is None  # moved, no second name


def test_load_serves_quantized_tables_and_refuses_a_missing_checkpoint(walked, tmp_path):
    from dlrm.engine.errors import CheckpointError

    path = os.path.join(walked["workdir"], "ckpt")
    half = dlrm.load(path, quantize_tables="fp16")
    assert type(half.module.embeddings).__name__ == "QuantizedEmbedding"
    np.testing.assert_allclose(half.predict(walked["numerical"], walked["categorical"]), walked["scores"], atol=1e-2)
    with pytest.raises(CheckpointError):
        dlrm.load(str(tmp_path / "missing"))
