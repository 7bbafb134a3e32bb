"""A run whose loss turns non-finite (nan or inf: it diverged) stops: one line naming the step and
the flags to change, exit code 3, summary stop_reason "non_finite_loss", and the checkpoint at
--save_checkpoint_path is the last finite one (or absent): nothing non-finite is ever saved.

Both products through their real command lines; the fp16 loss-scaling rule (a skipped step's
non-finite loss is no stop, unless it persists or the step was not skipped) through the run
loop with a real ``GradScaler``.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlrm.engine.logger import RunLogger
from dlrm.engine.loop import PERSISTENT_NON_FINITE, LoopParts, LoopSettings, NonFiniteLoss, run_loop
from dlrm.training.grad_scaler import DeviceScalerState

from conftest import REPO
import warm_python

NON_FINITE_EXIT = 3  # what the flags' help promises


def _run(module: str, *args: str) -> subprocess.CompletedProcess:
    return warm_python.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _stop_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    """Exit code 3 and one line on stderr, no traceback, holding every needle."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == NON_FINITE_EXIT, (proc.returncode, proc.stdout[-3000:], proc.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert lines[0].startswith("error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def _summary(log: Path) -> dict:
    (summary,) = [r for r in map(json.loads, open(log)) if r["type"] == "summary"]
    return summary


def _all_finite(obj, where: str = "") -> list[str]:
    """The names of the non-finite floating-point tensors anywhere in ``obj`` (nested dicts, lists)."""
    if torch.is_tensor(obj):
        return [where] if obj.is_floating_point() and not bool(torch.isfinite(obj).all()) else []
    if isinstance(obj, dict):
        return [bad for key, value in obj.items() for bad in _all_finite(value, f"{where}/{key}")]
    if isinstance(obj, (list, tuple)):
        return [bad for i, value in enumerate(obj) for bad in _all_finite(value, f"{where}/{i}")]
    return []


def _checkpoint_non_finite(path: Path) -> list[str]:
    """Every tensor of every file of a checkpoint, loaded back with torch: the non-finite ones."""
    files = sorted(path.glob("*.pt"))
    assert files, f"no tensor files in {path}"
    return [bad for f in files for bad in _all_finite(torch.load(f, map_location="cpu", weights_only=False), f.name)]


# --- the recommender: Mult-VAE (configs/recommender/mult_vae.json) with Adam at --alpha 1 diverges by step 3

@pytest.fixture(scope="module")
def histories(tmp_path_factory) -> Path:
    from dlrm.recommender.csr_dataset import write_csr
    from dlrm.recommender.user_histories import HistoryConfig, generate_user_histories

    root = tmp_path_factory.mktemp("histories")
    rows = generate_user_histories(HistoryConfig(n_users=300, n_items=60, n_interactions=9000), seed=0).rows
    write_csr(root / "input", rows)
    return root / "input"


def _recommender(histories: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return _run("dlrm.scripts.recommender_train", "--network", "configs/recommender/mult_vae.json", "--input",
                str(histories), "--save_checkpoint_path", str(tmp_path / "ck"), "--alpha", "1", "--batch_size", "50",
                "--base_device", "cpu", "--log_path", str(tmp_path / "log.json"), *args)


def test_diverging_recommender_keeps_its_last_finite_checkpoint(histories, tmp_path):
    from dlrm.recommender.checkpoint import read_meta

    proc = _recommender(histories, tmp_path, "--epochs", "3", "--checkpoint_every_steps", "1", "--print_freq", "1")
    line = _stop_line(proc, "--alpha", f"kept at {tmp_path / 'ck'}")
    assert "loss nan" not in proc.stdout and "loss inf" not in proc.stdout  # no progress line of a diverged window
    saved = [int(s.split()[4]) for s in proc.stdout.splitlines() if s.startswith("Saved checkpoint at step")]
    summary = _summary(tmp_path / "log.json")
    assert summary["stop_reason"] == "non_finite_loss" and summary["non_finite_step"] > saved[-1]
    assert f"step {summary['non_finite_step']}" in line and f"of step {saved[-1]}," in line
    assert read_meta(str(tmp_path / "ck"))["train_state"]["step"] == saved[-1]
    assert _checkpoint_non_finite(tmp_path / "ck") == []
    assert not os.path.exists(tmp_path / "ck.best")  # the first validation (epoch end) was never reached
    predict = _run("dlrm.scripts.recommender_predict", "--load_checkpoint_path", str(tmp_path / "ck"), "--input",
                   str(histories), "--k", "5", "--output", str(tmp_path / "recs.txt"), "--base_device", "cpu")
    assert predict.returncode == 0, predict.stderr
    assert len(open(tmp_path / "recs.txt").read().splitlines()) == 300


def test_diverging_recommender_without_validation_or_checkpoint_saves_nothing(histories, tmp_path):
    """The case that ended "completed", exit 0, with a nan checkpoint: now nothing is saved."""
    proc = _recommender(histories, tmp_path, "--epochs", "3", "--validation_users", "0")
    _stop_line(proc, "--alpha", "training stopped, and no checkpoint was saved")
    assert not os.path.exists(tmp_path / "ck")
    assert _summary(tmp_path / "log.json")["stop_reason"] == "non_finite_loss"


def test_diverging_recommender_with_validation_stops_before_validating(histories, tmp_path):
    """Validation at the end of the first epoch (where the nan scores raised a traceback after a
    nan checkpoint was saved) is never reached with a non-finite model."""
    proc = _recommender(histories, tmp_path, "--epochs", "3")
    _stop_line(proc, "--alpha")
    assert "validation at step" not in proc.stdout and "Saved checkpoint" not in proc.stdout
    assert not os.path.exists(tmp_path / "ck") and not os.path.exists(tmp_path / "ck.best")


# --- DLRM: synthetic data at --lr 1e6 diverges by step 3

TINY = ["--synthetic_dataset_table_sizes", "30,40", "--synthetic_dataset_num_entries", "4096",
        "--synthetic_dataset_num_test_entries", "1024", "--batch_size", "256", "--test_batch_size", "512",
        "--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "16,1", "--base_device", "cpu",
        "--warmup_steps", "0", "--decay_steps", "0"]


def test_diverging_dlrm_keeps_its_last_finite_checkpoint(tmp_path):
    from dlrm.model.dlrm import DLRM, DLRMConfig
    from dlrm.training.checkpoint import load_checkpoint, read_meta

    ck, log = tmp_path / "ck", tmp_path / "log.json"
    proc = _run("dlrm.scripts.main", *TINY, "--lr", "1e6", "--checkpoint_freq", "1", "--print_freq", "4",
                "--test_freq", "8", "--save_checkpoint_path", str(ck), "--log_path", str(log))
    line = _stop_line(proc, "--lr", "--warmup_steps", f"kept at {ck}")
    saved = [int(s.split()[4]) for s in proc.stdout.splitlines() if s.startswith("Saved checkpoint at step")]
    summary = _summary(log)
    assert summary["stop_reason"] == "non_finite_loss" and f"step {summary['non_finite_step']}" in line
    assert summary["non_finite_step"] <= 4 and "Epoch:" not in proc.stdout  # stopped at the first read
    assert f"of step {saved[-1]}," in line
    model = DLRM(DLRMConfig(**read_meta(str(ck))["model_config"]))
    assert load_checkpoint(str(ck), model).step == saved[-1]
    assert [n for n, p in model.state_dict().items() if p.is_floating_point() and not torch.isfinite(p).all()] == []
    assert _checkpoint_non_finite(ck) == []
    test = _run("dlrm.scripts.main", *TINY, "--mode", "test", "--load_checkpoint_path", str(ck))
    assert test.returncode == 0 and "Test: auc" in test.stdout, test.stderr


def test_diverging_dlrm_without_a_save_path_still_stops(tmp_path):
    """No checkpoint and no test: the read at the last step's progress line stops it (it used to
    end "completed", exit 0)."""
    proc = _run("dlrm.scripts.main", *TINY, "--lr", "1e6", "--print_freq", "1000",
                "--synthetic_dataset_num_test_entries", "0", "--log_path", str(tmp_path / "log.json"))
    _stop_line(proc, "--lr", "training stopped: lower --lr")
    assert _summary(tmp_path / "log.json")["stop_reason"] == "non_finite_loss"


def test_the_exit_code_is_in_both_scripts_help():
    for module in ("dlrm.scripts.main", "dlrm.scripts.recommender_train"):
        proc = _run(module, "--help")
        assert proc.returncode == 0 and "exit code 3" in proc.stdout, module


# --- the rule with fp16 loss scaling, through the run loop with a real GradScaler

class _State:
    step = 0


def _scaled_run(bad: dict[int, str], steps: int, log_every: int = 5) -> tuple[dict | None, NonFiniteLoss | None,
                                                                             list[float]]:
    """Trains w (4 weights) on a fixed batch with SGD under a real GradScaler for ``steps`` steps;
    at step s in ``bad`` the loss is made non-finite: "input" (an inf input: non-finite gradients,
    which the scaler skips) or "constant" (an inf added to the loss: finite gradients, applied)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(4))
    optimizer = torch.optim.SGD([w], lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x = torch.randn(8, 4)
    state = _State()
    scales = []

    def step(_):
        s = state.step + 1
        inputs = x.clone()
        if bad.get(s) == "input":
            inputs[0, 0] = float("inf")
        loss = ((inputs @ w) ** 2).mean()
        if bad.get(s) == "constant":
            loss = loss + float("inf")
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        state.step = s
        return loss.detach(), 8, False

    def scale():  # as DLRM's run reads it
        try:
            return DeviceScalerState(scaler).scale_tensor()
        except RuntimeError:  # before the first step
            return scaler.get_scale()

    parts = LoopParts(state=state, samples_per_epoch=8, empty="", ended=lambda: "completed" if state.step >= steps
                      else None, batches=lambda: range(steps - state.step), step=step, progress=lambda w, e: None,
                      steps_left=lambda: steps - state.step, summary=lambda meter: {"steps": state.step},
                      state_tensors=lambda: [w], loss_scale=scale)
    try:
        return run_loop(parts, LoopSettings(log_every=log_every), torch.device("cpu"),
                        RunLogger(stream=io.StringIO())), None, scales
    except NonFiniteLoss as e:
        return None, e, scales


def test_a_skipped_non_finite_step_does_not_stop_a_scaled_run():
    summary, stop, scales = _scaled_run({3: "input", 7: "input", 8: "input"}, steps=12)
    assert stop is None and summary["stop_reason"] == "completed" and summary["steps"] == 12
    assert scales[2] == scales[1] / 2 and scales[7] == scales[5] / 4  # the scaler did skip them


def test_persistent_skipped_non_finite_steps_stop_a_scaled_run():
    first = 4
    streak = {s: "input" for s in range(first, first + PERSISTENT_NON_FINITE + 5)}
    summary, stop, _ = _scaled_run(streak, steps=40)
    assert stop is not None and stop.step == first + PERSISTENT_NON_FINITE - 1, stop
    assert f"steps {first}-{first + PERSISTENT_NON_FINITE - 1}" in str(stop)
    assert stop.summary["stop_reason"] == "non_finite_loss"


def test_a_non_finite_step_the_scaler_did_not_skip_stops_a_scaled_run():
    summary, stop, scales = _scaled_run({2: "input", 6: "constant"}, steps=12)
    assert scales[5] >= scales[4]  # not skipped: the scale did not back off
    assert stop is not None and stop.step == 6 and "did not skip" in str(stop), stop
    assert stop.summary["steps"] == 10  # found at the next read of the losses (every 5 steps here)
