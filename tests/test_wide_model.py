"""The third model (dlrm/wide/, docs/adding_a_model.md) trains through the engine: it matches a
plain float64 logistic regression, two gloo processes train as one, a resumed run equals the
uninterrupted one bit for bit, and checkpoints move between process counts exactly."""

import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from conftest import REPO, run_entry_points, spawn
from dlrm.engine.collectives import ProcessGroupCollectives
from dlrm.wide import checkpoint
from dlrm.wide.data import epoch_order, make_data
from dlrm.wide.model import WideModel
from dlrm.wide.train import WideConfig, train

SMALL = dict(field_sizes=(300, 40, 7), num_samples=1000, batch_size=100, epochs=2, lr=0.5, seed=3)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole weight and the bias of a checkpoint, read by one process."""
    model = WideModel(sum(SMALL["field_sizes"]), seed=SMALL["seed"])
    checkpoint.load(path, model)
    return model.weight.detach().clone(), model.bias.detach().clone()


def test_one_process_is_plain_logistic_regression_in_float64():
    """The same batches, the same SGD, written plainly over one-hot rows in float64."""
    model, summary = train(WideConfig(**SMALL))
    assert summary["stop_reason"] == "completed" and summary["steps"] == 20
    data = make_data(SMALL["num_samples"], SMALL["field_sizes"], SMALL["seed"])
    n_ids = sum(SMALL["field_sizes"])
    x = np.zeros((len(data.labels), n_ids))
    np.put_along_axis(x, data.ids.numpy(), 1.0, axis=1)
    y = data.labels.double().numpy()
    w = WideModel(n_ids, seed=SMALL["seed"]).weight.detach().double().numpy()  # the same initial weights
    b = 0.0
    for epoch in range(SMALL["epochs"]):
        order = epoch_order(len(y), SMALL["seed"], epoch).numpy()
        for start in range(0, len(y), SMALL["batch_size"]):
            rows = order[start:start + SMALL["batch_size"]]
            p = 1 / (1 + np.exp(-(x[rows] @ w + b)))
            grad = (p - y[rows]) / len(rows)
            w, b = w - SMALL["lr"] * x[rows].T @ grad, b - SMALL["lr"] * grad.sum()
    np.testing.assert_allclose(model.weight.detach().double().numpy(), w, rtol=0, atol=2e-6)
    assert abs(model.bias.item() - b) < 2e-6


def _worker(rank: int, world: int, port: int, root: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    collectives = ProcessGroupCollectives(torch.device("cpu"))
    whole = os.path.join(root, "two_whole")
    train(WideConfig(**SMALL, save_checkpoint_path=whole), collectives)
    cut = os.path.join(root, "two_cut")
    train(WideConfig(**SMALL, save_checkpoint_path=cut, max_steps=7), collectives)  # stopped mid-epoch
    train(WideConfig(**SMALL, save_checkpoint_path=cut, resume=True), collectives)
    # A one-process checkpoint loaded by two processes and saved again in their layout.
    model = WideModel(sum(SMALL["field_sizes"]), collectives, seed=SMALL["seed"])
    state = checkpoint.load(os.path.join(root, "one"), model)
    checkpoint.save(os.path.join(root, "one_via_two"), model, state)
    dist.destroy_process_group()


def test_two_gloo_processes_train_as_one_resume_exactly_and_move_between_process_counts(tmp_path):
    one, _ = train(WideConfig(**SMALL, save_checkpoint_path=str(tmp_path / "one")))
    spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2)
    meta = checkpoint.FORMAT.read_meta(str(tmp_path / "two_whole"))
    assert meta["world_size"] == 2 and sorted(n for n in meta["files"] if n.startswith("weight_rows")) == \
        ["weight_rows_0_174.pt", "weight_rows_174_347.pt"]
    two_weight, two_bias = _weights(str(tmp_path / "two_whole"))  # written by 2, read by 1
    # Two processes add each sample's partial sums in another order than one: equal to rounding.
    torch.testing.assert_close(two_weight, one.weight.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(two_bias, one.bias.detach(), rtol=0, atol=1e-6)
    cut_weight, cut_bias = _weights(str(tmp_path / "two_cut"))
    assert torch.equal(cut_weight, two_weight) and torch.equal(cut_bias, two_bias)  # resumed = uninterrupted
    assert checkpoint.FORMAT.read_meta(str(tmp_path / "two_cut"))["train_state"] == meta["train_state"]
    moved_weight, moved_bias = _weights(str(tmp_path / "one_via_two"))  # 1 -> 2 -> 1
    assert torch.equal(moved_weight, one.weight.detach()) and torch.equal(moved_bias, one.bias.detach())


def test_a_checkpoint_of_other_data_is_refused_in_one_line(tmp_path):
    train(WideConfig(**SMALL, save_checkpoint_path=str(tmp_path / "c")))
    other = WideModel(10)
    with pytest.raises(checkpoint.CheckpointError, match=r"holds a model of 347 ids, this one has 10"):
        checkpoint.load(str(tmp_path / "c"), other)


def test_the_guide_builds_this_model_and_its_example_runs(tmp_path, monkeypatch):
    """docs/adding_a_model.md names the files of dlrm/wide/ and its Python example runs as written."""
    guide = open(os.path.join(REPO, "docs", "adding_a_model.md"), encoding="utf-8").read()
    for name in ("data.py", "model.py", "checkpoint.py", "train.py"):
        assert f"dlrm/wide/{name}" in guide
    examples = re.findall(r"```python\n(.*?)```", guide, re.DOTALL)
    assert examples
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(examples[-1], "adding_a_model.md", "exec"), scope)
    assert scope["summary"]["stop_reason"] == "completed"


# The fields whose flag keeps the name dlrm.scripts.main gives the same setting (docs/adding_a_model.md,
# section 6); every other field's flag is the field's own name.
RENAMED_FLAGS = {"log_every_steps": "print_freq", "checkpoint_every_steps": "checkpoint_freq"}


def _loss_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.fullmatch(r"step \d+ loss [\d.]+", line)]


def _one_line_error(result: dict) -> str:
    lines = [line for line in result["stderr"].splitlines() if line.strip()]
    assert result["returncode"] == 2 and len(lines) == 1 and "Traceback" not in result["stderr"], result
    return lines[0]


def test_the_guides_command_and_python_call_are_the_same_run(tmp_path, capsys, monkeypatch):
    """The command and the Python call of the guide's section 6, run as written: the same loss
    lines, the same summary, the same checkpoint bit for bit; --help lists a flag for every field
    of WideConfig; bad values are one line, exit 2."""
    guide = open(os.path.join(REPO, "docs", "adding_a_model.md"), encoding="utf-8").read()
    commands = [c for c in re.findall(r"```sh\n(.*?)```", guide, re.DOTALL) if "dlrm.scripts.wide_train" in c]
    table = [b for b in re.findall(r"```python\n(.*?)```", guide, re.DOTALL) if "SETTINGS: tuple[Setting" in b]
    script = open(os.path.join(REPO, "dlrm", "scripts", "wide_train.py"), encoding="utf-8").read()
    assert len(table) == 1 and table[0] in script, "the guide's Setting table is not the script's"
    args = shlex.split(commands[0])
    assert args[:3] == ["python", "-m", "dlrm.scripts.wide_train"]
    (tmp_path / "cli").mkdir()
    cases = [{"args": args[3:], "cwd": str(tmp_path / "cli")}, ["--help"], ["--batch_size=0"],
             ["--field_sizes=10,x"], ["--max_steps=0"], ["--resume"]]
    run, shown, *bad = run_entry_points("dlrm.scripts.wide_train", cases, tmp_path, preload=("dlrm.wide.train",))
    assert run["returncode"] == 0, run["stderr"][-3000:]

    (tmp_path / "py").mkdir()
    monkeypatch.chdir(tmp_path / "py")
    scope: dict = {}
    exec(compile(re.findall(r"```python\n(.*?)```", guide, re.DOTALL)[-1], "adding_a_model.md", "exec"), scope)
    printed = capsys.readouterr().out
    assert _loss_lines(run["stdout"]) == _loss_lines(printed) and len(_loss_lines(printed)) == 2
    assert json.loads(run["stdout"].strip().splitlines()[-1]) == scope["summary"]
    num_ids = scope["model"].num_ids
    from_cli, from_python = WideModel(num_ids), WideModel(num_ids)
    checkpoint.load(str(tmp_path / "cli" / "wide_checkpoint"), from_cli)
    checkpoint.load(str(tmp_path / "py" / "wide_checkpoint"), from_python)
    assert torch.equal(from_cli.weight, from_python.weight) and torch.equal(from_cli.bias, from_python.bias)
    assert torch.equal(from_python.weight, scope["model"].weight)  # the checkpoint is the trained model

    assert shown["returncode"] == 0 and shown["stdout"].startswith("Train the wide logistic model"), shown
    for field in dataclasses.fields(WideConfig):
        flag = RENAMED_FLAGS.get(field.name, field.name)
        assert re.search(rf"--(\[no\])?{flag}:", shown["stdout"]), f"--help lacks the flag of {field.name}"
    assert "(default: '1000,300,50,7')" in shown["stdout"]  # the tuple field's default, as its flag says it
    expected = ["--batch_size must be >= 1", "--field_sizes must be a comma-separated list of integers",
                "--max_steps=0", "--resume continues the checkpoint at --save_checkpoint_path"]
    for case, result, fragment in zip(cases[2:], bad, expected, strict=True):
        assert fragment in _one_line_error(result), case


def test_the_command_under_torchrun_trains_as_one_process(tmp_path, capsys):
    """Two processes started by torchrun print the losses of one process (to rounding) and save
    its weights, in two row blocks."""
    flags = ["--field_sizes=300,40,7", "--num_samples=1000", "--batch_size=100", "--epochs=2", "--lr=0.5", "--seed=3",
             "--print_freq=5", f"--save_checkpoint_path={tmp_path / 'two'}"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
         "dlrm.scripts.wide_train", *flags], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    one, summary = train(WideConfig(**SMALL, log_every_steps=5))
    printed = capsys.readouterr().out
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == summary  # printed once, by the first process
    two_losses = [float(line.split()[-1]) for line in _loss_lines(proc.stdout)]
    one_losses = [float(line.split()[-1]) for line in _loss_lines(printed)]
    assert len(one_losses) == 4 and np.allclose(two_losses, one_losses, rtol=0, atol=2e-5)
    assert sorted(n for n in checkpoint.FORMAT.read_meta(str(tmp_path / "two"))["files"] if n.startswith("weight")) \
        == ["weight_rows_0_174.pt", "weight_rows_174_347.pt"]
    weight, bias = _weights(str(tmp_path / "two"))
    torch.testing.assert_close(weight, one.weight.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(bias, one.bias.detach(), rtol=0, atol=1e-6)
