"""DLRM's Python API (dlrm.api) is the command line's run: docs/training.md's example
gives the CLI's logs and checkpoint, RunConfig.seed is the one seed, and the calls keep the
CLI's guarantees (output claims, library errors, a checkpoint that records the config)."""

import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_cli, tree
from dlrm.engine.outputs import OutputError
from dlrm.scripts import dlrm_flags
from dlrm.scripts.main import check_args
from dlrm import api
from dlrm.training.checkpoint import read_meta
from test_recommender_cli import read_checkpoint
import warm_python

DOC = os.path.join(REPO, "docs", "training.md")


def doc_example() -> tuple[str, list[str]]:
    """The Python block and the command line's flags of docs/training.md's "From Python"."""
    text = open(DOC, encoding="utf-8").read()
    section = text[text.index("## From Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    command = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "dlrm.scripts.main"]
    return code, args[3:]


def records(path: str, kind: str) -> list[dict]:
    return [r for r in map(json.loads, open(path)) if r["type"] == kind]


def small(tmp_path, seed: int = 7, **train) -> api.RunConfig:
    return api.RunConfig(
        seed=seed, base_device="cpu", batch_size=256, test_batch_size=1024,
        data=api.DataConfig(dataset_type="synthetic", synthetic_table_sizes=[30, 300, 4, 70],
                            synthetic_num_numerical=5, synthetic_num_entries=4096, synthetic_num_test_entries=1024),
        model=api.ModelSettings(embedding_dim=8, bottom_mlp_sizes=[16, 8], top_mlp_sizes=[32, 16, 1]),
        train=api.TrainConfig(api.LRSchedule(lr=0.5), **{"max_steps": 6, **train}),
        output=api.OutputConfig(log_path=str(tmp_path / f"log{seed}.json")),
    )


def test_the_docs_python_example_is_the_command_line_run(tmp_path, monkeypatch, capsys):
    """docs/training.md's example, run as written (in a fresh folder), and its command line: the
    same progress, tests and summary in the logs, and the same checkpoint, tensor for tensor."""
    code, args = doc_example()
    monkeypatch.chdir(tmp_path)
    exec(compile(code, DOC, "exec"), {})
    printed = capsys.readouterr().out
    assert re.search(r"12 steps, best test AUC 0\.\d+, checkpoint's AUC 0\.\d+", printed), printed[-500:]

    cli_dir = tmp_path / "cli"
    cli_dir.mkdir()
    given = {"ckpt": str(cli_dir / "ckpt"), "log.json": str(cli_dir / "log.json")}
    run_cli("dlrm.scripts.main", *[given.get(a, a) for a in args])

    python_log, cli_log = str(tmp_path / "log.json"), given["log.json"]
    for kind, fields in (("train", ("step", "loss", "lr")), ("eval", ("step", "auc", "loss"))):
        ours = [[r[f] for f in fields] for r in records(python_log, kind)]
        assert ours and ours == [[r[f] for f in fields] for r in records(cli_log, kind)], kind
    (python_summary, _), (cli_summary,) = records(python_log, "summary"), records(cli_log, "summary")
    assert python_summary["steps"] == cli_summary["steps"] == 12
    assert python_summary["best_auc"] == cli_summary["best_auc"]
    expected, got = read_checkpoint(given["ckpt"]), read_checkpoint(str(tmp_path / "ckpt"))
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key


def test_run_config_defaults_and_seed_are_the_command_lines():
    """RunConfig(seed=7) is --seed=7: the flags' defaults are the config's (but for the log the
    script writes by default), and the seed is one setting, not one per part of the run."""
    by_flags = dlrm_flags.run_config(check_args(["--seed=7", "--base_device=cpu", "--log_path="]))
    assert api.RunConfig(seed=7, base_device="cpu") == by_flags
    assert not hasattr(by_flags.data, "seed") and not hasattr(by_flags.train, "seed")


def test_the_run_seed_seeds_weights_synthetic_data_and_batch_order(tmp_path):
    """Two runs differing only in RunConfig.seed differ in their first weights, their synthetic
    data and their shuffled batch order; the same seed twice gives the same run."""
    from dlrm.training.build import build_run, start_processes

    def first(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = small(tmp_path, seed)
        device = torch.device("cpu")
        run = build_run(cfg, device, collectives=start_processes(cfg, None, device))
        return next(run.model.parameters()).detach().clone(), run.source("train", 256).read_batch(0).numerical

    (w7, x7), (w7_again, x7_again), (w8, x8) = first(7), first(7), first(8)
    assert torch.equal(w7, w7_again) and torch.equal(x7, x7_again)
    assert not torch.equal(w7, w8) and not torch.equal(x7, x8)

    def losses(seed: int, init_seed: int, name: str) -> list[float]:
        """Training losses of ``seed``'s data and batch order from ``init_seed``'s weights."""
        start = small(tmp_path, init_seed, save_checkpoint_path=str(tmp_path / f"init{name}"), max_steps=1)
        start = dataclasses.replace(start, train=dataclasses.replace(start.train, schedule=api.LRSchedule(lr=0.0)),
                                    output=api.OutputConfig())
        api.train(start)  # a learning rate of 0: the checkpoint holds init_seed's weights
        cfg = small(tmp_path, seed, shuffle_batch_order=True, log_every_steps=1, max_steps=4)
        cfg = dataclasses.replace(cfg, output=api.OutputConfig(log_path=str(tmp_path / f"losses{name}.json")),
                                  checkpoint=api.CheckpointConfig(load_checkpoint_path=str(tmp_path / f"init{name}")))
        api.train(cfg)
        return [r["loss"] for r in records(str(tmp_path / f"losses{name}.json"), "train")]

    # the same weights (seed 7's) and the same synthetic data... of two seeds: only the data and
    # the batch order differ, and they do
    assert losses(7, 7, "a") != losses(8, 7, "b")


def test_a_checkpoint_records_the_run_config(tmp_path):
    cfg = small(tmp_path, save_checkpoint_path=str(tmp_path / "ckpt"), log_every_steps=3, checkpoint_every_steps=2)
    result = api.train(cfg)
    assert isinstance(result, api.TrainResult) and result.checkpoint_path == str(tmp_path / "ckpt")
    assert result["steps"] == result.steps == result.summary["steps"] == 6
    assert result.stop_reason == "completed" and result.signal is None and result.log_path == cfg.output.log_path
    (logged,) = records(cfg.output.log_path, "summary")
    assert (logged["steps"], logged["best_auc"]) == (result.steps, result.best_auc)  # the summary the run logs
    recorded = read_meta(str(tmp_path / "ckpt"))["run_config"]
    assert recorded == json.loads(json.dumps(cfg.to_dict()))  # as meta.json holds it
    assert api.RunConfig.from_dict(recorded) == cfg
    assert recorded["batch_size"] == 256  # what TrainState.from_meta reads of older checkpoints too


def test_evaluate_and_benchmark_from_python(tmp_path):
    cfg = small(tmp_path, save_checkpoint_path=str(tmp_path / "ckpt"))
    summary = api.train(cfg)
    load = api.CheckpointConfig(load_checkpoint_path=str(tmp_path / "ckpt"))
    scored = api.evaluate(dataclasses.replace(cfg, checkpoint=load))
    last_eval = records(str(tmp_path / "log7.json"), "eval")[-1]
    assert scored["auc"] == last_eval["auc"] == summary["best_auc"] and scored["samples"] == 1024
    timed = api.benchmark_inference(dataclasses.replace(
        cfg, checkpoint=load, benchmark=api.InferenceBenchmarkConfig(inference_benchmark_batch_sizes=[1, 32],
                                                                    inference_benchmark_steps=3)))
    assert [row["batch_size"] for row in timed["inference"]] == [1, 32]
    with pytest.raises(api.SettingError, match="`inference_benchmark_batch_sizes`: 4096 is not between 1 and"):
        api.benchmark_inference(dataclasses.replace(cfg, benchmark=api.InferenceBenchmarkConfig([4096])))


def test_plan_from_python_and_its_setting_errors():
    # 4 tables of a million rows of 128 float32 values: 1.9 GiB, on devices of 1 GiB
    cfg = api.RunConfig(base_device="cpu", batch_size=1024, parallel=api.ParallelConfig(device_memory_gb=1),
                        plan_max_processes=4,
                        data=api.DataConfig(dataset_type="synthetic", synthetic_table_sizes=[10**6] * 4))
    sized = api.plan(cfg)
    assert sized["processes"] == 3 and "Fewest processes: 3" in sized["report"]
    too_few = api.plan(dataclasses.replace(cfg, plan_max_processes=2))
    assert too_few["processes"] is None and "up to 2 fits: raise `plan_max_processes`" in too_few["report"]
    with pytest.raises(api.SettingError, match="pass `device_memory_gb`"):
        api.plan(api.RunConfig(base_device="cpu"))
    with pytest.raises(ValueError, match="`plan_max_processes` must be an integer >= 1"):
        api.RunConfig(mode="plan", plan_max_processes=0)
    with pytest.raises(ValueError, match="`inference_benchmark_backend=onnxruntime` runs the exported float32"):
        api.RunConfig(mode="inference_benchmark", amp=True,
                      benchmark=api.InferenceBenchmarkConfig(inference_benchmark_backend="onnxruntime"))


def test_python_runs_claim_their_outputs_before_any_work(tmp_path):
    """A checkpoint path holding something else is refused as the CLI refuses it (OutputError),
    with nothing changed and nothing written."""
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    before = tree(tmp_path)
    with pytest.raises(OutputError, match="save_checkpoint_path"):
        api.train(small(tmp_path, save_checkpoint_path=str(foreign)))
    assert tree(tmp_path) == before


@pytest.mark.parametrize("change,says", [
    (lambda c: setattr(c, "batch_size", 0), "`batch_size` must be positive, got 0"),
    (lambda c: setattr(c.model, "embedding_dtype", "fp8"), "`embedding_dtype` must be one of"),
    (lambda c: setattr(c.train, "prefetch", 0), "`prefetch` must be an integer >= 1, got 0"),
    (lambda c: setattr(c.checkpoint, "overwrite", True) or setattr(c.checkpoint, "resume", True),
     "`resume` continues"),  # train: resume or overwrite; the benchmark: resume is for training
])
def test_a_setting_changed_after_the_config_was_built_is_checked_when_the_job_starts(tmp_path, change, says):
    """The configs are not frozen: each job checks the config it is given again, so a setting
    set afterwards is refused as at construction (ValueError naming it), before any work, and
    the caller's config is left as it is."""
    cfg = small(tmp_path, save_checkpoint_path=str(tmp_path / "ckpt"))
    change(cfg)
    kept = repr(cfg)
    before = tree(tmp_path)
    for job in (api.train, api.benchmark_inference):
        with pytest.raises(ValueError, match=says):
            job(cfg)
    assert tree(tmp_path) == before and repr(cfg) == kept


def test_sigterm_stops_a_python_run_with_its_checkpoint(tmp_path):
    """api.train in a process of its own, stopped with SIGTERM: the step in flight finishes, the
    checkpoint is saved, the summary says interrupted by signal 15, and the caller's handler is
    back afterwards."""
    ckpt = str(tmp_path / "ckpt")
    script = f"""
import signal, sys
from dlrm import api
cfg = api.RunConfig(base_device="cpu", batch_size=64, test_batch_size=1024, seed=3, validate_dataset=False,
    data=api.DataConfig(dataset_type="synthetic", synthetic_table_sizes=[30, 40], synthetic_num_numerical=2,
                        synthetic_num_entries=1 << 17, synthetic_num_test_entries=1024),
    model=api.ModelSettings(embedding_dim=4, bottom_mlp_sizes=[8, 4], top_mlp_sizes=[8, 1]),
    train=api.TrainConfig(api.LRSchedule(lr=0.1), log_every_steps=20, save_checkpoint_path={ckpt!r}))
summary = api.train(cfg)
print("SUMMARY", summary["stop_reason"], summary["signal"], summary["steps"], flush=True)
print("HANDLER", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = warm_python.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**env, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:
        if line.startswith("Epoch:"):
            proc.send_signal(signal.SIGTERM)
            break
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    reason, signum, steps = re.search(r"SUMMARY (\w+) (\S+) (\d+)", out).groups()
    assert (reason, signum) == ("interrupted", str(int(signal.SIGTERM)))
    assert read_meta(ckpt)["train_state"]["step"] == int(steps) > 0
    assert "HANDLER True" in out
