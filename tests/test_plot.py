"""``python -m dlrm.scripts.plot LOG --output run.png`` draws a run's log without TensorBoard: the
curves it reads are those TensorBoard's own reader finds in the event files of the same run, it
writes an image matplotlib reads back, and a bad request is one line, exit 2, with nothing written."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_cli, tensorboard_scalars

from dlrm.engine.errors import DatasetError
from dlrm.engine.log_plot import log_curves

SMALL = ["--synthetic_dataset_table_sizes", "100,200", "--synthetic_dataset_num_entries", "8192",
         "--synthetic_dataset_num_test_entries", "1024", "--batch_size", "64", "--test_batch_size", "512",
         "--max_steps", "24", "--print_freq", "4", "--test_freq", "8", "--embedding_dim", "4",
         "--bottom_mlp_sizes", "8,4", "--top_mlp_sizes", "8,1", "--base_device", "cpu"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("plot")
    run_cli("dlrm.scripts.main", *SMALL, "--log_path", str(root / "log.json"), "--tensorboard_dir", str(root / "tb"))
    return root


def test_the_curves_are_those_tensorboard_finds(run):
    curves = log_curves(str(run / "log.json"))
    board = tensorboard_scalars(str(run / "tb"))
    assert {"train/loss", "eval/auc"} <= set(curves) and set(curves) == set(board)
    for tag, points in board.items():
        assert [s for s, _ in curves[tag]] == [s for s, _ in points], tag
        np.testing.assert_allclose([v for _, v in curves[tag]], [v for _, v in points], rtol=1e-6,
                                   err_msg=tag)  # TensorBoard keeps float32
    assert [s for s, _ in curves["eval/auc"]] == [8, 16, 24]


def test_the_command_writes_an_image_of_the_curves_asked_for(run, tmp_path):
    import matplotlib.image

    proc = run_cli("dlrm.scripts.plot", str(run / "log.json"), "--output", str(tmp_path / "run.png"),
                   "--tags", "train/loss,eval/auc")
    assert "Wrote 2 curves" in proc.stdout
    image = matplotlib.image.imread(str(tmp_path / "run.png"))
    assert image.shape[0] == 300 and image.shape[1] == 1200  # one row of two 6 x 3 inch panels at 100 dpi
    assert image[..., :3].std() > 0.05  # not a blank canvas


@pytest.mark.parametrize("args, needle", [
    (["{log}", "--output", "{out}/run.txt"], "an image is written as .png, .svg or .pdf, not .txt"),
    (["{log}", "--output", "{existing}"], "is not a plot written by this program"),
    (["{log}", "--output", "{existing}", "--overwrite"], "is not a plot written by this program"),
    (["{log}", "--output", "{out}/run.png", "--tags", "train/nothing"], "--tags train/nothing: not in"),
    (["{other}", "--output", "{out}/run.png"], "not a run log of this program"),
    (["{out}/absent.json", "--output", "{out}/run.png"], "no such log file"),
    (["--output", "{out}/run.png"], "give one log file"),
])
def test_a_bad_request_is_one_line_and_writes_nothing(run, tmp_path, args, needle):
    (tmp_path / "existing.png").write_bytes(b"mine")
    (tmp_path / "other.json").write_text('{"type": "Feature", "geometry": null}\n')
    paths = {"log": run / "log.json", "out": tmp_path, "existing": tmp_path / "existing.png",
             "other": tmp_path / "other.json"}
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = run_cli("dlrm.scripts.plot", *[a.format(**paths) for a in args], check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before and (tmp_path / "existing.png").read_bytes() == b"mine"


def test_a_log_cut_short_names_its_line(tmp_path):
    log = tmp_path / "log.json"
    log.write_text('{"type": "header", "time": 1.0, "program": "dlrm-engine", "version": "0"}\n'
                   '{"type": "train", "step": 2, "loss": 0.5}\n{"type": "tra')
    with pytest.raises(DatasetError, match=r"log.json:3: not a JSON record"):
        log_curves(str(log))


def test_its_own_image_is_replaced_only_when_asked(run, tmp_path):
    """An image this command drew carries its mark (PNG text, SVG and PDF creator): a second run
    refuses it without --overwrite and replaces it with, in every format."""
    from dlrm.engine.log_plot import is_plot

    for name in ("run.png", "run.svg", "run.pdf"):
        out = tmp_path / name
        run_cli("dlrm.scripts.plot", str(run / "log.json"), "--output", str(out))
        assert is_plot(str(out)), name
        again = run_cli("dlrm.scripts.plot", str(run / "log.json"), "--output", str(out), check=False)
        assert again.returncode == 2 and "already holds a plot" in again.stderr, again.stderr
        run_cli("dlrm.scripts.plot", str(run / "log.json"), "--output", str(out), "--overwrite")
