"""Settings of the wrong type or past their bounds are refused when a config is built, in one
line naming the setting, before anything is written: at the command line (exit 2, no log, no
checkpoint folder), through the Python APIs (before any file) and for every field of every
config part (hypothesis draws the hostile values)."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlrm.engine.config_check import FLOAT32_MAX, SEED_MAX
from dlrm.recommender import api as rapi
from dlrm import api
from dlrm.training.run_config import RunConfig

TINY = ["--base_device", "cpu", "--batch_size", "64", "--synthetic_dataset_num_entries", "256",
        "--synthetic_dataset_table_sizes", "10,10", "--embedding_dim", "4", "--bottom_mlp_sizes", "8,4",
        "--top_mlp_sizes", "4,1", "--max_steps", "2"]


@pytest.mark.parametrize("args, flag, bound", [
    (["--lr", "1e308"], "--lr", "3.403e+38"),
    (["--seed", "1180591620717411303424"], "--seed", str(SEED_MAX)),
])
def test_cli_refuses_in_one_line_before_any_output(cli, tmp_path, args, flag, bound):
    log, ckpt = tmp_path / "log.json", tmp_path / "ckpt"
    proc = cli("dlrm.scripts.main", *TINY, *args, "--log_path", str(log), "--save_checkpoint_path", str(ckpt),
               check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.splitlines()
    assert line.startswith("error: ") and flag in line and bound in line, line
    assert not log.exists() and not ckpt.exists() and os.listdir(tmp_path) == []


def _small_run(tmp_path, **changes) -> RunConfig:
    settings = dict(base_device="cpu", batch_size=64, test_batch_size=64,
                    data=api.DataConfig(dataset_type="synthetic", synthetic_table_sizes=[10, 10],
                                        synthetic_num_entries=256, synthetic_num_test_entries=64),
                    model=api.ModelSettings(embedding_dim=4, bottom_mlp_sizes=[8, 4], top_mlp_sizes=[4, 1]),
                    train=api.TrainConfig(api.LRSchedule(lr=0.1), max_steps=2,
                                          save_checkpoint_path=str(tmp_path / "ckpt")),
                    output=api.OutputConfig(log_path=str(tmp_path / "log.json")))
    return api.RunConfig(**{**settings, **changes})


@pytest.mark.parametrize("build, name", [
    (lambda p: _small_run(p, batch_size=256.5), "batch_size"),
    (lambda p: _small_run(p, batch_size=True), "batch_size"),
    (lambda p: _small_run(p, seed=2**64), "seed"),
    (lambda p: _small_run(p, output=api.OutputConfig(log_path=123)), "log_path"),
    (lambda p: _small_run(p, train=api.TrainConfig(api.LRSchedule(lr=1e308))), "lr"),
    (lambda p: _small_run(p, train=api.TrainConfig(api.LRSchedule(lr=math.inf))), "lr"),
    (lambda p: _small_run(p, optimizer=api.OptimizerConfig(eps=float("nan"))), "eps"),
])
def test_dlrm_api_refuses_at_construction(tmp_path, build, name):
    with pytest.raises(ValueError) as raised:
        build(tmp_path)
    _assert_one_line_naming(raised.value, name)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("part, name, value", [
    (None, "batch_size", 256.5), (None, "batch_size", True), (None, "seed", -5), ("output", "log_path", 123),
    ("train", "epochs", 1.5),
])
def test_dlrm_api_refuses_a_setting_changed_after_construction(tmp_path, part, name, value):
    cfg = _small_run(tmp_path)
    setattr(getattr(cfg, part) if part else cfg, name, value)
    with pytest.raises(ValueError) as raised:
        api.train(cfg)
    _assert_one_line_naming(raised.value, name)
    assert os.listdir(tmp_path) == []


def _recommender(tmp_path, **changes) -> rapi.RecommenderConfig:
    return rapi.RecommenderConfig(**{"data": rapi.DataConfig(str(tmp_path / "in")),
                                     "checkpoint": rapi.CheckpointConfig(str(tmp_path / "ck")),
                                     "log_path": str(tmp_path / "log.json"), **changes})


@pytest.mark.parametrize("changes, name", [
    (lambda: dict(batch_size=256.5), "batch_size"), (lambda: dict(batch_size=True), "batch_size"),
    (lambda: dict(log_path=123), "log_path"), (lambda: dict(seed=2**63), "seed"),
    (lambda: dict(train=rapi.TrainSettings(epochs=1.5)), "epochs"),
    (lambda: dict(model=rapi.ModelConfig(network="n.json", optimizer=rapi.OptimizerOverrides(alpha=1e39))), "alpha"),
    (lambda: dict(model=rapi.ModelConfig(network="n.json", optimizer=rapi.OptimizerOverrides(lambda_=math.nan))),
     "lambda"),
])
def test_recommender_api_refuses_at_construction(tmp_path, changes, name):
    with pytest.raises(rapi.ConfigError) as raised:
        _recommender(tmp_path, **changes())
    _assert_one_line_naming(raised.value, name)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("part, name, value", [
    (None, "batch_size", 256.5), (None, "log_path", 123), ("train", "epochs", 1.5), (None, "seed", True),
])
def test_recommender_api_refuses_a_setting_changed_after_construction(tmp_path, part, name, value):
    cfg = _recommender(tmp_path, model=rapi.ModelConfig(network="n.json"), train=rapi.TrainSettings(epochs=1))
    setattr(getattr(cfg, part) if part else cfg, name, value)
    with pytest.raises(rapi.ConfigError) as raised:
        rapi.train(cfg)
    _assert_one_line_naming(raised.value, name)
    assert os.listdir(tmp_path) == []


def test_from_dict_checks_types_and_takes_ints_for_floats():
    values = RunConfig().to_dict()
    values["train"]["schedule"]["lr"] = 24  # an int where a float is declared: as older checkpoints hold
    assert RunConfig.from_dict(values).train.schedule.lr == 24
    for path, bad in ((("seed",), True), (("batch_size",), 1.5), (("train", "schedule", "lr"), 1e308),
                      (("optimizer", "eps"), "1e-8"), (("data", "synthetic_table_sizes"), [10, True])):
        changed = RunConfig().to_dict()
        where = changed
        for key in path[:-1]:
            where = where[key]
        where[path[-1]] = bad
        with pytest.raises(ValueError) as raised:
            RunConfig.from_dict(changed)
        _assert_one_line_naming(raised.value, path[-1])


def test_paths_may_be_path_objects_and_are_kept_as_str(tmp_path):
    cfg = api.OutputConfig(log_path=tmp_path / "log.json", tensorboard_dir=tmp_path / "tb")
    assert cfg.log_path == str(tmp_path / "log.json") and cfg.tensorboard_dir == str(tmp_path / "tb")
    assert rapi.DataConfig(tmp_path / "in").input == str(tmp_path / "in")


# ---- every field of every part, hostile values drawn by hypothesis --------------------------

HOSTILE = st.one_of(
    st.booleans(), st.none(), st.text(max_size=8), st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e39]),
    st.floats(allow_nan=False, allow_infinity=False), st.integers(min_value=2**63 - 2, max_value=2**70),
    st.integers(max_value=-(2**63) + 1, min_value=-(2**70)), st.integers(-3, 3),
    st.lists(st.one_of(st.booleans(), st.integers(-2, 2), st.floats(allow_nan=True)), max_size=3),
    st.just(object()), st.just(FLOAT32_MAX * 2),
)


def _dlrm_parts() -> dict[str, tuple[type, dict]]:
    """Each part of a RunConfig (and the schedule inside its train part): class and defaults."""
    cfg = RunConfig()
    parts = {f.name: (type(getattr(cfg, f.name)), dataclasses.asdict(getattr(cfg, f.name)))
             for f in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, f.name))}
    parts["schedule"] = (type(cfg.train.schedule), dataclasses.asdict(cfg.train.schedule))
    return parts


DLRM_FIELDS = [(part, f.name) for part, (cls, _) in _dlrm_parts().items() for f in dataclasses.fields(cls)] + \
              [(None, f.name) for f in dataclasses.fields(RunConfig) if f.name not in _dlrm_parts()]


def _build_dlrm(part: str | None, name: str, value: object) -> RunConfig:
    if part is None:
        return RunConfig(**{name: value})
    cls, defaults = _dlrm_parts()[part]
    fields = {k: v for k, v in defaults.items() if k != "schedule"}
    if part == "train":
        fields["schedule"] = RunConfig().train.schedule
    built = cls(**{**fields, name: value})
    if part == "schedule":
        return RunConfig(train=dataclasses.replace(RunConfig().train, schedule=built))
    return RunConfig(**{part: built})


# Fields whose messages name them as dlrm.scripts.main's flags do.
SHOWN_AS = {"embedding": "optimizer", "dense": "dense_optimizer", "eps": "optimizer_eps", "freeze_dense": "freeze_mlps"}


def _assert_one_line_naming(error: BaseException, name: str) -> None:
    message = str(error)
    assert isinstance(error, ValueError), repr(error)
    assert "\n" not in message and len(message) < 600 and message.isprintable(), message
    assert f"`{SHOWN_AS.get(name, name.rstrip('_'))}" in message, message


def _refused_or_accepted(build, name: str, value: object) -> None:
    try:
        build()
    except ValueError as e:
        _assert_one_line_naming(e, name)
    # anything else (TypeError, OverflowError, ...) escapes and fails the test


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(DLRM_FIELDS), value=HOSTILE)
def test_every_run_config_field_refuses_hostile_values_in_one_line(field, value):
    part, name = field
    _refused_or_accepted(lambda: _build_dlrm(part, name, value), name, value)


REC_PARTS = {"data": rapi.DataConfig, "model": rapi.ModelConfig, "validation": rapi.ValidationSettings,
             "train": rapi.TrainSettings, "checkpoint": rapi.CheckpointConfig}
REC_FIELDS = [(part, f.name) for part, cls in REC_PARTS.items() for f in dataclasses.fields(cls)] + \
             [(None, f.name) for f in dataclasses.fields(rapi.RecommenderConfig) if f.name not in REC_PARTS] + \
             [("optimizer", f.name) for f in dataclasses.fields(rapi.OptimizerOverrides)] + \
             [("linear", f.name) for f in dataclasses.fields(rapi.LinearConfig)]


def _build_recommender(part: str | None, name: str, value: object) -> rapi.RecommenderConfig:
    base = dict(data=rapi.DataConfig("in"), checkpoint=rapi.CheckpointConfig("ck"),
                model=rapi.ModelConfig(network="n.json"), train=rapi.TrainSettings(epochs=1))
    if part is None:
        return rapi.RecommenderConfig(**{**base, name: value})
    if part in ("optimizer", "linear"):
        inner = {"optimizer": rapi.OptimizerOverrides, "linear": rapi.LinearConfig}[part](**{name: value})
        return rapi.RecommenderConfig(**{**base, "model": rapi.ModelConfig(network="n.json", **{part: inner})})
    current = dataclasses.asdict(base[part]) if part in base else {}
    if part == "model":
        current = {"network": "n.json"}
    return rapi.RecommenderConfig(**{**base, part: REC_PARTS[part](**{**current, name: value})})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(REC_FIELDS), value=HOSTILE)
def test_every_recommender_config_field_refuses_hostile_values_in_one_line(field, value):
    part, name = field
    _refused_or_accepted(lambda: _build_recommender(part, name, value), name, value)


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from([f.name for f in dataclasses.fields(rapi.PredictConfig) if f.name != "_"]),
       value=HOSTILE)
def test_every_predict_config_field_refuses_hostile_values_in_one_line(name, value):
    base = {"load_checkpoint_path": "ck", "input": "in", "output": "out"}
    _refused_or_accepted(lambda: rapi.PredictConfig(**{**base, name: value}), name, value)


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from([f.name for f in dataclasses.fields(rapi.EvaluateConfig) if f.name != "_"]),
       value=HOSTILE)
def test_every_evaluate_config_field_refuses_hostile_values_in_one_line(name, value):
    base = {"input": "in", "heldout": "ho"}
    _refused_or_accepted(lambda: rapi.EvaluateConfig(**{**base, name: value}), name, value)
