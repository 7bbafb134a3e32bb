"""The recommender's typed config and Python API (dlrm/recommender/run_config.py, api.py and its
job modules; the model in memory is tests/test_recommender_python_api.py's):
every flag of recommender_train lands in the config; docs/recommender.md's "From Python" example
runs and writes what its command-line twin writes; the API keeps the commands' guarantees
(claims, errors as exceptions, a checkpoint and the handlers back on SIGTERM)."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest
import torch

from conftest import REPO, run_cli
import warm_python

from dlrm.recommender import api

# recommender_train's flags -> (a value on the command line, the setting it sets, its value there).
# Each value differs from the flag's default, so a flag that set nothing would show.
FLAG_VALUES = {
    "model": ("autoencoder", "model", "autoencoder"),
    "linear_max_memory_gb": ("3.5", "linear_max_memory_gb", 3.5),
    "network": ("other.json", "network", "other.json"),
    "input": ("in2", "input", "in2"),
    "output": ("out2", "output", "out2"),
    "batch_size": ("7", "batch_size", 7),
    "epochs": ("5", "epochs", 5),
    "max_epochs": ("9", "max_epochs", 9),
    "validation_users": ("0.3", "validation_users", 0.3),
    "validation_max_users": ("17", "validation_max_users", 17),
    "validation_items": ("0.4", "validation_items", 0.4),
    "validation_k": ("4", "validation_k", 4),
    "patience": ("2", "patience", 2),
    "patience_steps": ("11", "patience_steps", 11),
    "validate_every_steps": ("13", "eval_every_steps", 13),  # DLRM's name for the setting
    "seed": ("19", "seed", 19),
    "save_checkpoint_path": ("ck2", "save_checkpoint_path", "ck2"),
    "resume": ("true", "resume", True),
    "overwrite": ("true", "overwrite", True),
    "checkpoint_every_steps": ("23", "checkpoint_every_steps", 23),
    "max_steps": ("29", "max_steps", 29),
    "base_device": ("cpu", "base_device", "cpu"),
    "amp": ("true", "amp", True),
    "amp_dtype": ("bf16", "amp_dtype", "bf16"),
    "dist_timeout": ("31", "dist_timeout", 31.0),
    "negatives": ("37", "negatives", 37),
    "optimizer": ("adam", "optimizer", "adam"),
    "alpha": ("0.5", "alpha", 0.5),
    "mu": ("0.25", "mu", 0.25),
    "lambda": ("0.125", "lambda_", 0.125),  # a Python keyword
    "log_path": ("l.jsonl", "log_path", "l.jsonl"),
    "tensorboard_dir": ("tb", "tensorboard_dir", "tb"),
    "print_freq": ("41", "log_every_steps", 41),  # DLRM's name for the setting
}
# Flags of the script that deliberately set no config setting, with why: none.
NOT_IN_CONFIG: dict[str, str] = {}
# The other names of flags (kept earlier names, DLRM's names) set what their flag sets.
ALIASES = {"checkpoint_path": "save_checkpoint_path", "log_every_steps": "print_freq", "device": "base_device",
           "eval_every_steps": "validate_every_steps"}

_PROBE = r"""
import json, re, sys
from absl import flags
from dlrm.scripts import cli, recommender_train as script
from dlrm.recommender.run_config import leaves

FLAGS = flags.FLAGS
own = sorted(f.name for f in FLAGS.flags_by_module_dict()[script.__name__] if not cli.is_alias(f))
aliases = {f.name: re.match(r"Alias of --(\w+)", f.help).group(1) for f in FLAGS.flags_by_module_dict()[script.__name__] if cli.is_alias(f)}
base = json.loads(sys.argv[1])
out = {"own": own, "aliases": aliases, "base": None, "set": {}}
def config(args):
    FLAGS.unparse_flags()
    FLAGS(["prog", *base, *args])
    return {k: v for k, v in leaves(script.config_from_flags()).items()}
out["base"] = config([])
for name, value in json.loads(sys.argv[2]).items():
    out["set"][name] = config([f"--{name}={value}"])
print(json.dumps(out))
"""


def _probe(base: list[str], settings: dict[str, str]) -> dict:
    proc = warm_python.run([sys.executable, "-c", _PROBE, json.dumps(base), json.dumps(settings)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_every_flag_of_recommender_train_lands_in_its_setting_of_the_config():
    base = ["--network=net.json", "--input=in", "--save_checkpoint_path=ck", "--epochs=2"]
    values = {name: value for name, (value, _, _) in FLAG_VALUES.items()}
    values["epochs"] = "5"
    found = _probe(base, {**values, **{alias: values[flag] for alias, flag in ALIASES.items()}})
    assert sorted(found["own"]) == sorted([*FLAG_VALUES, *NOT_IN_CONFIG]), "a flag is not mapped (or gone)"
    assert found["aliases"] == ALIASES
    for flag, (_, setting, expected) in FLAG_VALUES.items():
        got = found["set"][flag]
        assert got[setting] == expected, (flag, setting, got[setting])
        assert found["base"][setting] != expected, f"--{flag}'s value is the default: the test shows nothing"
        changed = {k for k in got if got[k] != found["base"][k]}
        assert changed == {setting}, (flag, changed)  # it sets its setting and nothing else
    for alias, flag in ALIASES.items():
        assert found["set"][alias] == found["set"][flag], alias


@pytest.mark.parametrize("make, says", [
    (lambda: dict(model=api.ModelConfig(network="n.json", optimizer=api.OptimizerOverrides(alpha=0))),
     "`alpha` 0: the learning rate must be > 0"),
    (lambda: dict(train=api.TrainSettings(epochs=3)), "`epochs` applies to the autoencoder"),
    (lambda: dict(checkpoint=api.CheckpointConfig("ck", resume=True, overwrite=True)), "pass one of them"),
    (lambda: dict(model=api.ModelConfig(network="n.json"), data=api.DataConfig("in", output="out")),
     "give `epochs` (and `validation_users` 0)"),
    (lambda: dict(model=api.ModelConfig(network="n.json"), validation=api.ValidationSettings(validation_users=0)),
     "`validation_users` 0: without validation, give `epochs`"),
    (lambda: dict(model=api.ModelConfig(model="autoencoder")), "`model` autoencoder needs `network`"),
    (lambda: dict(batch_size=0), "`batch_size` 0: must be >= 1"),
    (lambda: dict(batch_size="64"), "`batch_size` must be an integer, got '64' (str)"),
])
def test_a_config_refuses_what_no_run_can_do_naming_the_setting(make, says):
    with pytest.raises(api.ConfigError) as refused:
        api.RecommenderConfig(**{"data": api.DataConfig("in"), "checkpoint": api.CheckpointConfig("ck"), **make()})
    assert says in str(refused.value) and isinstance(refused.value, ValueError)


# recommender_predict's and recommender_evaluate's flags -> (a value on the command line, its value in the
# config's field of the same name, as JSON). Each value differs from the flag's default.
PREDICT_FLAG_VALUES = {
    "load_checkpoint_path": ("ck2", "ck2"),
    "input": ("in2", "in2"),
    "output": ("out2", "out2"),
    "k": ("7", 7),
    "best": ("false", False),
    "features_index": ("f.txt", "f.txt"),
    "samples_index": ("s.txt", "s.txt"),
    "filter": ("a,b", ["a", "b"]),
    "exclude_inputs": ("false", False),
    "score_format": ("4.3f", "%4.3f"),  # kept with its %
    "batch_size": ("9", 9),
    "scores_path": ("sc.npy", "sc.npy"),
    "overwrite": ("true", True),
    "base_device": ("cpu", "cpu"),
    "amp": ("true", True),
    "amp_dtype": ("fp16", "fp16"),
    "dist_timeout": ("31", 31.0),
}
EVALUATE_FLAG_VALUES = {
    "input": ("in2", "in2"),
    "heldout": ("ho2", "ho2"),
    "load_checkpoint_path": ("ck2", "ck2"),
    "best": ("false", False),
    "baselines": ("mf,popularity,mf", ["mf", "popularity"]),  # without repeats
    "k": ("10,5,10", [5, 10]),  # integers, sorted, without repeats
    "batch_size": ("9", 9),
    "output": ("m.json", "m.json"),
    "overwrite": ("true", True),
    "mf_factors": ("3", 3),
    "mf_iterations": ("0", 0),
    "knn_neighbours": ("4", 4),
    "seed": ("5", 5),
    "ease_lambda": ("20", 20.0),
    "ease_max_memory_gb": ("1.5", 1.5),
    "base_device": ("cpu", "cpu"),
    "amp": ("true", True),
    "amp_dtype": ("bf16", "bf16"),
    "dist_timeout": ("31", 31.0),
}
# The earlier names of the flags (recommender_common's aliases) set what their flag sets.
SCORING_ALIASES = {"checkpoint": "load_checkpoint_path", "device": "base_device"}

_SCORING_PROBE = r"""
import dataclasses, importlib, json, re, sys
from absl import flags
from dlrm.scripts import cli
from dlrm.recommender import run_config

script = importlib.import_module(sys.argv[1])
cls = getattr(run_config, sys.argv[2])
FLAGS = flags.FLAGS
mine = FLAGS.flags_by_module_dict()[script.__name__]
out = {"own": sorted(f.name for f in mine if not cli.is_alias(f)),
       "aliases": {f.name: re.match(r"Alias of --(\w+)", f.help).group(1) for f in mine if cli.is_alias(f)},
       "fields": [f.name for f in dataclasses.fields(cls)],
       "defaults": {f.name: f.default for f in dataclasses.fields(cls)}, "set": {}}
base = json.loads(sys.argv[3])
def config(args):
    FLAGS.unparse_flags()
    FLAGS(["prog", *base, *args])
    cfg = script.config_from_flags(FLAGS)
    assert type(cfg) is cls, type(cfg)
    return dataclasses.asdict(cfg)
out["base"] = config([])
for name, value in json.loads(sys.argv[4]).items():
    out["set"][name] = config([f"--{name}={value}"])
print(json.dumps(out))
"""


@pytest.mark.parametrize("script, config, base, values", [
    ("recommender_predict", "PredictConfig", ["--load_checkpoint_path=ck", "--input=in", "--output=out"],
     PREDICT_FLAG_VALUES),
    ("recommender_evaluate", "EvaluateConfig", ["--input=in", "--heldout=ho"], EVALUATE_FLAG_VALUES),
])
def test_every_flag_of_predict_and_evaluate_lands_in_its_field_of_the_config(script, config, base, values):
    settings = {name: value for name, (value, _) in values.items()}
    settings.update({alias: settings[flag] for alias, flag in SCORING_ALIASES.items()})
    proc = warm_python.run([sys.executable, "-c", _SCORING_PROBE, f"dlrm.scripts.{script}", config, json.dumps(base),
                            json.dumps(settings)], cwd=REPO, capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout)
    # One to one: the script's own flags are the config's fields, by name (and in the test's table).
    assert found["own"] == sorted(found["fields"]) == sorted(values), "a flag without its field, or the reverse"
    assert found["aliases"] == SCORING_ALIASES
    given = {arg[2:].split("=")[0] for arg in base}
    for name, default in found["defaults"].items():  # the flags' defaults are the config's
        if name not in given:
            assert found["base"][name] == (list(default) if isinstance(default, tuple) else default), name
    for flag, (_, expected) in values.items():
        got = found["set"][flag]
        assert got[flag] == expected, (flag, got[flag])
        assert found["base"][flag] != expected, f"--{flag}'s value is the default: the test shows nothing"
        changed = {k for k in got if got[k] != found["base"][k]}
        assert changed == {flag}, (flag, changed)  # it sets its field and nothing else
    for alias, flag in SCORING_ALIASES.items():
        assert found["set"][alias] == found["set"][flag], alias


@pytest.mark.parametrize("settings, says", [
    (dict(load_checkpoint_path=None), "`load_checkpoint_path` is required"),
    (dict(input=None), "`input` is required"),
    (dict(output=""), "`output` is required"),
    (dict(k=0), "`k` 0: must be >= 1"),
    (dict(batch_size=0), "`batch_size` 0: must be >= 1"),
    (dict(k="10"), "`k` must be an integer, got '10' (str)"),
    (dict(score_format="%d"), "`score_format` '%d': give a printf format of one float"),
    (dict(amp_dtype="fp8"), "`amp_dtype` 'fp8': must be one of auto, bf16, fp16"),
    (dict(dist_timeout=0.5), "`dist_timeout` 0.5: must be >= 1"),
    (dict(filter=5), "`filter` must be a list of strings, got 5 (int)"),
])
def test_a_predict_config_refuses_what_no_run_can_do_naming_the_setting(settings, says):
    with pytest.raises(api.ConfigError) as refused:
        api.PredictConfig(**{"load_checkpoint_path": "ck", "input": "in", "output": "out", **settings})
    assert says in str(refused.value) and isinstance(refused.value, ValueError)


@pytest.mark.parametrize("settings, says", [
    (dict(input=None), "`input` is required"),
    (dict(heldout=""), "`heldout` is required"),
    (dict(k=[]), "`k` is empty; give at least one cut-off"),
    (dict(k=[5, 0]), "`k` 5,0: every K must be >= 1, got 0"),
    (dict(k=["5"]), "`k` must be an integer or a list of integers, got ['5'] (list)"),
    (dict(baselines=["pop", "mf"]), "`baselines`: unknown 'pop'; choose from popularity,itemknn,mf,ease"),
    (dict(ease_lambda=0), "`ease_lambda` 0: must be > 0"),
    (dict(baselines=["mf"], ease_lambda="x"), "`ease_lambda` must be a finite number, got 'x' (str)"),
    (dict(baselines=[]), "nothing to evaluate: give `load_checkpoint_path`"),
    (dict(batch_size=0), "`batch_size` 0: must be >= 1"),
    (dict(mf_factors=0), "`mf_factors` 0: must be >= 1"),
    (dict(knn_neighbours=0), "`knn_neighbours` 0: must be >= 1"),
    (dict(mf_iterations=-1), "`mf_iterations` -1: must be >= 0"),
    (dict(ease_max_memory_gb=-1), "`ease_max_memory_gb` -1: must be >= 0"),
    (dict(amp_dtype="fp8"), "`amp_dtype` 'fp8': must be one of auto, bf16, fp16"),
    (dict(dist_timeout=0.5), "`dist_timeout` 0.5: must be >= 1"),
])
def test_an_evaluate_config_refuses_what_no_run_can_do_naming_the_setting(settings, says):
    with pytest.raises(api.ConfigError) as refused:
        api.EvaluateConfig(**{"input": "in", "heldout": "ho", **settings})
    assert says in str(refused.value) and isinstance(refused.value, ValueError)


def test_predict_and_evaluate_configs_hold_their_sequences_as_the_run_uses_them():
    cfg = api.EvaluateConfig("in", "ho", baselines=["mf", "ease", "mf"], k=[20, 5, 5])
    assert cfg.k == (5, 20) and cfg.baselines == ("mf", "ease")
    assert api.EvaluateConfig("in", "ho").baselines == api.BASELINES
    assert api.EvaluateConfig("in", "ho", baselines=["mf"], ease_lambda=0).ease_lambda == 0  # ease's only
    assert api.PredictConfig("ck", "in", "out", filter=["a", "b"], score_format="4.3f").filter == ("a", "b")
    assert api.PredictConfig("ck", "in", "out", score_format="4.3f").score_format == "%4.3f"
    with pytest.raises(TypeError):  # as predict's arguments were: the settings after the paths by name
        api.PredictConfig("ck", "in", "out", 5)


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    run_cli("dlrm.scripts.recommender_generate", "--synthetic", "--users", "300", "--items", "60", "--interactions",
            "9000", "--output", str(root / "data"), "--heldout_fraction", "0.2")
    return root


def _from_python_section() -> tuple[str, list[list[str]]]:
    """docs/recommender.md's "From Python": its Python example and its command-line twin."""
    text = open(os.path.join(REPO, "docs", "recommender.md"), encoding="utf-8").read()
    section = text.split("### From Python\n", 1)[1].split("\n### ", 1)[0]
    python = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    bash = re.search(r"```bash\n(.*?)```", section, re.S).group(1).replace("\\\n", " ")
    return python, [shlex.split(line) for line in bash.splitlines() if line.strip()]


def _workdir(root, name: str):
    work = root / name
    work.mkdir()
    (work / "data").symlink_to(root / "data")
    (work / "configs").symlink_to(os.path.join(REPO, "configs"))
    return work


def _weights(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".pt"):
            loaded = torch.load(os.path.join(path, name), weights_only=True)
            out.update({f"{name}/{k}": v for k, v in _flat(loaded).items()})
    return out


def _flat(obj, prefix: str = "") -> dict:
    if torch.is_tensor(obj):
        return {prefix: obj}
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _flat(value, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, value in enumerate(obj) for k, v in _flat(value, f"{prefix}/{i}").items()}
    return {prefix: obj}


def test_the_documented_python_example_writes_what_its_commands_write(generated):
    python, commands = _from_python_section()
    assert [c[:3] for c in commands] == [["python", "-m", f"dlrm.scripts.recommender_{s}"] for s in
                                         ("train", "train", "predict", "evaluate")]
    by_python, by_cli = _workdir(generated, "python"), _workdir(generated, "cli")
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"}
    proc = warm_python.run([sys.executable, "-c", python], cwd=by_python, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "chose lambda" in proc.stdout and "NDCG@10" in proc.stdout, proc.stdout
    for command in commands:
        done = warm_python.run([sys.executable, *command[1:]], cwd=by_cli, capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    for ckpt in ("ckpt/rec", "ckpt/ae", "ckpt/ae.best"):
        ours, theirs = _weights(str(by_python / ckpt)), _weights(str(by_cli / ckpt))
        assert ours.keys() == theirs.keys() and ours, ckpt
        for key, value in theirs.items():
            assert torch.equal(ours[key], value) if torch.is_tensor(value) else ours[key] == value, (ckpt, key)
    assert (by_python / "recs.txt").read_text() == (by_cli / "recs.txt").read_text()
    metrics = [json.loads((work / "metrics.json").read_text())["results"] for work in (by_python, by_cli)]
    for results in metrics:
        for row in results.values():
            row.pop("seconds", None), row.pop("fit_seconds", None)
    assert metrics[0] == metrics[1]


_LONG_RUN = r"""
import json, signal, sys
from dlrm.recommender import api

before = signal.getsignal(signal.SIGTERM)
cfg = api.RecommenderConfig(data=api.DataConfig(input=sys.argv[1]),
                            model=api.ModelConfig(network="configs/recommender/mult_dae.json"),
                            train=api.TrainSettings(epochs=100000, log_every_steps=1), batch_size=8,
                            validation=api.ValidationSettings(validation_users=0),
                            checkpoint=api.CheckpointConfig(save_checkpoint_path=sys.argv[2]))
summary = api.train(cfg).summary
print(json.dumps({"summary": summary, "handler_restored": signal.getsignal(signal.SIGTERM) is before}))
"""


def test_sigterm_stops_an_api_run_with_a_checkpoint_and_gives_the_handlers_back(generated, tmp_path):
    ckpt = str(tmp_path / "ck")
    proc = warm_python.Popen([sys.executable, "-c", _LONG_RUN, str(generated / "data" / "input"), ckpt], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1"})
    lines = []
    for line in proc.stdout:  # the first step's line: training is under way
        lines.append(line)
        if line.startswith("epoch "):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, "".join(lines) + out + err  # the API returns; only a script exits 143
    result = json.loads(out.strip().splitlines()[-1])
    summary = result["summary"]
    assert summary["stop_reason"] == "interrupted" and summary["signal"] == signal.SIGTERM, summary
    assert result["handler_restored"]
    meta = json.load(open(os.path.join(ckpt, "meta.json")))
    assert meta["train_state"]["step"] == summary["steps"] >= 1


def test_api_refusals_are_the_librarys_exceptions_and_change_nothing(generated, tmp_path):
    from dlrm.engine.checkpoint_store import CheckpointError, CheckpointLock
    from dlrm.engine.outputs import OutputError

    data = str(generated / "data" / "input")
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    cfg = api.RecommenderConfig(data=api.DataConfig(data), checkpoint=api.CheckpointConfig(str(taken)))
    with pytest.raises(OutputError, match="save_checkpoint_path"):
        api.train(cfg)
    assert os.listdir(taken) == ["notes.txt"]
    with pytest.raises(api.ConfigError, match="`input` .* does not exist"):
        api.train(api.RecommenderConfig(data=api.DataConfig(str(tmp_path / "missing")),
                                        checkpoint=api.CheckpointConfig(str(tmp_path / "ck"))))
    # A second run saving to the same path while one holds it is refused (the checkpoint's lock).
    ckpt = str(tmp_path / "locked")
    with CheckpointLock(ckpt):
        with pytest.raises(CheckpointError, match="another run"):
            api.train(api.RecommenderConfig(data=api.DataConfig(data), checkpoint=api.CheckpointConfig(ckpt)))
    assert not os.path.exists(os.path.join(ckpt, "meta.json"))
    with pytest.raises(api.ConfigError, match="nothing to evaluate"):
        api.evaluate(data, str(generated / "data" / "heldout"), baselines=[])


def test_a_setting_changed_after_the_config_was_built_is_checked_when_the_call_starts(generated, tmp_path):
    """Each call checks the config it is given again: a setting set after construction is
    refused as at construction, naming it, with nothing written."""
    data, heldout = str(generated / "data" / "input"), str(generated / "data" / "heldout")
    cfg = api.RecommenderConfig(data=api.DataConfig(data), checkpoint=api.CheckpointConfig(str(tmp_path / "ck")))
    cfg.batch_size = 0
    with pytest.raises(api.ConfigError, match="`batch_size` 0: must be >= 1"):
        api.train(cfg)
    cfg.batch_size, cfg.checkpoint.resume, cfg.checkpoint.overwrite = 256, True, True
    with pytest.raises(api.ConfigError, match="pass one of them"):
        api.train(cfg)
    predict = api.PredictConfig(str(tmp_path / "ck"), data, str(tmp_path / "recs.txt"))
    predict.k = 0
    with pytest.raises(api.ConfigError, match="`k` 0: must be >= 1"):
        api.predict(predict)
    evaluate = api.EvaluateConfig(data, heldout, baselines=["popularity"], output=str(tmp_path / "m.json"))
    evaluate.baselines = ("popularity", "svd")
    with pytest.raises(api.ConfigError, match="`baselines`: unknown 'svd'"):
        api.evaluate(evaluate)
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_of_the_earlier_flag_names_resumes(generated, tmp_path):
    """A checkpoint whose run_config holds the earlier record (our_flags(): print_freq,
    validate_every_steps: the flags' names) resumes, and a different seed in it is
    still refused."""
    from dlrm.recommender import checkpoint

    data = str(generated / "data" / "input")
    cfg = dict(data=api.DataConfig(data), model=api.ModelConfig(network="configs/recommender/mult_dae.json"),
               validation=api.ValidationSettings(validation_users=0), batch_size=64, seed=2)
    whole = str(tmp_path / "whole")
    api.train(api.RecommenderConfig(**cfg, train=api.TrainSettings(epochs=2, log_every_steps=0),
                                    checkpoint=api.CheckpointConfig(whole)))
    half = str(tmp_path / "half")
    first = api.train(api.RecommenderConfig(**cfg, train=api.TrainSettings(epochs=2, max_steps=3, log_every_steps=0),
                                            checkpoint=api.CheckpointConfig(half)))
    assert first["stop_reason"] == "max_steps"
    meta_path = os.path.join(half, "meta.json")
    meta = json.load(open(meta_path))
    run_id = meta["run_config"][checkpoint.RUN_ID]
    meta["run_config"] = {"network": "configs/recommender/mult_dae.json", "input": data, "batch_size": 64,
                          "epochs": 2, "validation_users": 0.0, "validation_max_users": 10000,
                          "validation_items": 0.2, "seed": 2, "print_freq": 0, "validate_every_steps": 0,
                          "save_checkpoint_path": half, "run_id": run_id}
    json.dump(meta, open(meta_path, "w"))
    resumed = api.RecommenderConfig(**cfg, train=api.TrainSettings(epochs=2, log_every_steps=0),
                                    checkpoint=api.CheckpointConfig(half, resume=True))
    assert api.train(resumed)["stop_reason"] == "completed"
    ours, theirs = _weights(half), _weights(whole)
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(ours[key], value) if torch.is_tensor(value) else ours[key] == value, key
    meta["run_config"]["seed"] = 3
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(api.ConfigError, match="trained with `seed` 3"):
        api.train(resumed)


@pytest.fixture(scope="module")
def linear_checkpoint(generated):
    ckpt = str(generated / "linear_ckpt")
    api.train(api.RecommenderConfig(data=api.DataConfig(str(generated / "data" / "input")),
                                    checkpoint=api.CheckpointConfig(save_checkpoint_path=ckpt)))
    return ckpt


def _timeless(result: dict) -> dict:
    out = {k: v for k, v in result.items() if k != "seconds"}
    if "results" in out:
        out["results"] = {name: {k: v for k, v in row.items() if not k.endswith("seconds")}
                          for name, row in out["results"].items()}
    return out


def test_predict_and_evaluate_take_a_config_or_its_settings_alike(generated, linear_checkpoint, tmp_path):
    data, heldout = str(generated / "data" / "input"), str(generated / "data" / "heldout")
    recs = {form: str(tmp_path / f"recs_{form}.txt") for form in ("config", "positional", "keyword")}
    done = {
        "config": api.predict(api.PredictConfig(linear_checkpoint, data, recs["config"], k=5, base_device="cpu")),
        "positional": api.predict(linear_checkpoint, data, recs["positional"], k=5, base_device="cpu"),
        "keyword": api.predict(load_checkpoint_path=linear_checkpoint, input=data, output=recs["keyword"], k=5,
                               base_device="cpu"),
    }
    written = {form: open(path, encoding="utf-8").read() for form, path in recs.items()}
    assert written["config"] and written["config"].count("\n") == done["config"]["users"] > 0
    assert written["positional"] == written["config"] == written["keyword"]
    assert _timeless(done["positional"]) == _timeless(done["config"]) == _timeless(done["keyword"])

    settings = dict(load_checkpoint_path=linear_checkpoint, baselines=["popularity", "itemknn"], k=(10, 5),
                    base_device="cpu")
    by_config = api.evaluate(api.EvaluateConfig(data, heldout, **settings))
    by_arguments = api.evaluate(data, heldout, **settings)
    assert by_config["k"] == [5, 10] and list(by_config["results"]) == ["model", "popularity", "itemknn"]
    assert _timeless(by_arguments) == _timeless(by_config)

    cfg = api.PredictConfig(linear_checkpoint, data, str(tmp_path / "never.txt"))
    with pytest.raises(TypeError, match="not both"):
        api.predict(cfg, k=3)
    with pytest.raises(TypeError, match="not both"):
        api.evaluate(api.EvaluateConfig(data, heldout), "x")
    with pytest.raises(TypeError, match="takes a PredictConfig"):
        api.predict(api.EvaluateConfig(data, heldout))
    with pytest.raises(api.ConfigError, match="`k` 0: must be >= 1"):  # the short form checks as the config does
        api.predict(linear_checkpoint, data, str(tmp_path / "never.txt"), k=0)
    assert not os.path.exists(tmp_path / "never.txt")
