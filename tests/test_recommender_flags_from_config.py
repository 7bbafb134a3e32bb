"""The recommender's command lines (recommender_train, _predict, _evaluate) are generated from their
configs: every field has exactly one flag, every flag of a script is a field's or in its alias
table, each flag is defaulted by its field, and a config written as a command line reads back
as that config (dlrm.scripts.recommender_flags)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import typing

import pytest
from absl import app, flags

from conftest import REPO
from dlrm.recommender.run_config import (
    CheckpointConfig, DataConfig, EvaluateConfig, LinearConfig, ModelConfig, OptimizerOverrides, PredictConfig,
    RecommenderConfig, TrainSettings, ValidationSettings,
)
from dlrm.scripts import recommender_flags
from dlrm.scripts.recommender_flags import EVALUATE, PREDICT, TRAIN

COMMANDS = {"recommender_train": TRAIN, "recommender_predict": PREDICT, "recommender_evaluate": EVALUATE}
# Fields with no flag of their own, and why (none today: every setting has one).
FLAGLESS: dict[str, dict[str, str]] = {name: {} for name in COMMANDS}
# The other names each script keeps (alias -> the flag it sets), written out independently of the table.
ALIASES = {
    "recommender_train": {"checkpoint_path": "save_checkpoint_path", "log_every_steps": "print_freq",
                          "device": "base_device", "eval_every_steps": "validate_every_steps"},
    "recommender_predict": {"checkpoint": "load_checkpoint_path", "device": "base_device"},
    "recommender_evaluate": {"checkpoint": "load_checkpoint_path", "device": "base_device"},
}
# Flags whose name is not their field's (flag -> field), as the scripts' docs say.
RENAMED = {"print_freq": "log_every_steps", "validate_every_steps": "eval_every_steps", "lambda": "lambda_"}


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Every leaf field of the config ``cls`` as a dotted path, walked independently of the table."""
    paths = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            paths += field_paths(hints[f.name], f"{prefix}{f.name}.")
        else:
            paths.append(prefix + f.name)
    return paths


def defined(command: recommender_flags.Command) -> flags.FlagValues:
    """The command's flags, defined in a FlagValues of their own (the three scripts share names)."""
    values = flags.FlagValues()
    command.define("test_module", values)
    return values


_SCRIPT_FLAGS = r"""
import importlib, json, sys
from absl import flags
from dlrm.scripts import cli
script = importlib.import_module(sys.argv[1])
mine = flags.FLAGS.flags_by_module_dict()[script.__name__]
print(json.dumps({f.name: {"alias": cli.is_alias(f), "default": f.default, "help": f.help} for f in mine}))
"""


@pytest.fixture(scope="module")
def script_flags() -> dict[str, dict]:
    """Each script's own flags as its module defines them on import (what its --help lists)."""
    out = {}
    for script in COMMANDS:
        proc = subprocess.run([sys.executable, "-c", _SCRIPT_FLAGS, f"dlrm.scripts.{script}"], cwd=REPO,
                              capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
        assert proc.returncode == 0, proc.stderr
        out[script] = json.loads(proc.stdout)
    return out


@pytest.mark.parametrize("script", COMMANDS)
def test_every_field_has_exactly_one_flag_and_every_flag_a_field_or_an_alias(script, script_flags):
    command = COMMANDS[script]
    paths = [s.path for s in command.settings]
    assert len(paths) == len(set(paths)), "a field with two flags"
    assert sorted(set(field_paths(command.config_cls)) - set(FLAGLESS[script])) == sorted(paths)
    for s in command.settings:  # a flag has its field's name, but for the declared renames
        assert RENAMED.get(s.flag, s.flag) == s.path.rpartition(".")[2], s.flag
    own = script_flags[script]
    assert {name for name, f in own.items() if not f["alias"]} == {s.flag for s in command.settings}
    assert {name: f["help"] for name, f in own.items() if f["alias"]} == {
        alias: f"Alias of --{flag} ({command.aliases[alias][1]})." for alias, flag in ALIASES[script].items()}


@pytest.mark.parametrize("script", COMMANDS)
def test_each_flag_is_defaulted_by_its_field(script, script_flags):
    """The script's flag defaults are its config's field defaults (sequences as comma-separated lists)."""
    command, own = COMMANDS[script], script_flags[script]
    for s in command.settings:
        owner, value = command.config_cls, None
        for part in s.path.split("."):
            field = {f.name: f for f in dataclasses.fields(owner)}[part]
            value = field.default if field.default is not dataclasses.MISSING else None
            owner = typing.get_type_hints(owner)[part]
        default = own[s.flag]["default"]
        if isinstance(value, tuple):
            assert default == [str(v) for v in value], s.flag
        else:
            assert default == value and type(default) is type(value), s.flag


def _train(**parts) -> RecommenderConfig:
    return RecommenderConfig(**{"data": DataConfig("in"), "checkpoint": CheckpointConfig("ck"), **parts})


CONFIGS = [
    (TRAIN, _train()),
    (TRAIN, _train(data=DataConfig("a dir/in", output="out"), seed=7, batch_size=3, base_device="cpu",
                   model=ModelConfig("autoencoder", "net.json", optimizer=OptimizerOverrides("adam", 0.5, 0.25, 0.125)),
                   validation=ValidationSettings(0, 17, 0.4, 4, 2, 11),
                   train=TrainSettings(5, 9, 29, 41, 13, 23, 37, amp=True, amp_dtype="bf16"),
                   checkpoint=CheckpointConfig("ck2", resume=True), dist_timeout=31.5, log_path="l.jsonl",
                   tensorboard_dir="tb")),
    (TRAIN, _train(model=ModelConfig("linear", linear=LinearConfig(3.5)), validation=ValidationSettings(0.5),
                   checkpoint=CheckpointConfig("ck", overwrite=True))),
    (PREDICT, PredictConfig("ck", "in", "out")),
    (PREDICT, PredictConfig("ck", "in", "out", k=3, best=False, features_index="", samples_index="s.txt",
                            filter=("f1", "f2"), exclude_inputs=False, score_format="4.3f", batch_size=2,
                            scores_path="s.npy", overwrite=True, base_device="cpu", amp=True, amp_dtype="fp16",
                            dist_timeout=9.0)),
    (EVALUATE, EvaluateConfig("in", "ho")),
    (EVALUATE, EvaluateConfig("in", "ho", load_checkpoint_path="ck", best=False, baselines=(), k=7, batch_size=5,
                              output="m.json", overwrite=True, mf_factors=3, mf_iterations=0, knn_neighbours=4,
                              seed=5, ease_lambda=20.0, ease_max_memory_gb=1.5, amp_dtype="bf16")),
    (EVALUATE, EvaluateConfig("in", "ho", baselines=("mf", "ease"), k=(20, 1))),
]


@pytest.mark.parametrize("command, cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_a_config_written_as_flags_reads_back_as_itself(command, cfg):
    values = defined(command)
    args = command.args(cfg)
    assert command.config(command.parse(args, values)) == cfg
    assert {a.split("=")[0].lstrip("-") for a in args} <= {n for s in command.settings for n in (s.flag, f"no{s.flag}")}
    assert values["input"].value is None  # parsed into a copy: the defined flags keep their values


def test_the_script_reads_the_written_command_line_as_the_config():
    """The script's own reading (config_from_flags, in a process of its own) of args() gives the
    config back, for a config of every part."""
    cfg = CONFIGS[1][1]
    probe = ("import dataclasses, json, sys; from absl import flags; from dlrm.scripts import recommender_train as s;"
             " flags.FLAGS(['prog', *json.loads(sys.argv[1])]);"
             " print(json.dumps(dataclasses.asdict(s.config_from_flags())))")
    proc = subprocess.run([sys.executable, "-c", probe, json.dumps(TRAIN.args(cfg))], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == dataclasses.asdict(cfg)


def test_bounds_and_errors_are_the_flags():
    values = defined(TRAIN)
    with pytest.raises(app.UsageError, match="validation_users"):
        TRAIN.parse(["--input=in", "--save_checkpoint_path=ck", "--validation_users=1.5"], values)
    values = defined(EVALUATE)
    with pytest.raises(app.UsageError, match="--k 5,x: 'x' is not an integer"):
        EVALUATE.config(EVALUATE.parse(["--input=in", "--heldout=ho", "--k=5,x"], values))
