"""dlrm.scripts.main's flags are generated from RunConfig: every field has exactly one flag (none is
left without one), every flag is a field's or in NVIDIA's alias table, and a config written as
a command line reads back as that config."""

import dataclasses
import subprocess
import sys
import typing

import pytest
from absl import flags

from dlrm.scripts import dlrm_flags, nvidia_flags, serving_flags
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.run_config import (
    DataConfig, ModelSettings, OutputConfig, ParallelConfig, RunConfig, ServingConfig, TrainConfig,
)

# Fields of RunConfig with no flag of their own, and why (none today: every setting has one).
FLAGLESS: dict[str, str] = {}
# Flags of main that are no field: the preset (a set of other flags' values).
NOT_SETTINGS = {"preset": "sets other flags' defaults (dlrm_flags.PRESETS)"}


def field_paths(cls: type, prefix: str = "") -> list[str]:
    """Every leaf field of the config ``cls`` as a dotted path, walked independently of the table."""
    paths = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            paths += field_paths(hint, f"{prefix}{f.name}.")
        else:
            paths.append(prefix + f.name)
    return paths


def main_flag_names() -> set[str]:
    modules = (dlrm_flags.__name__, nvidia_flags.__name__, serving_flags.__name__)
    return {flag.name for module in modules for flag in flags.FLAGS.get_flags_for_module(module)}


def test_every_field_has_exactly_one_flag_and_every_flag_a_field_or_an_alias():
    paths = [s.path for s in dlrm_flags.ALL_SETTINGS]
    assert len(paths) == len(set(paths)), "a field with two flags"
    assert sorted(set(field_paths(RunConfig)) - set(FLAGLESS)) == sorted(paths)
    table_flags = {s.flag for s in dlrm_flags.ALL_SETTINGS}
    assert table_flags | set(nvidia_flags.ALIASES) | set(NOT_SETTINGS) == main_flag_names()
    assert not table_flags & set(nvidia_flags.ALIASES)
    for name, maps_to in nvidia_flags.ALIASES.items():  # the alias help says what it maps to
        assert flags.FLAGS[name].help.startswith("NVIDIA's") and maps_to


def test_each_flag_is_typed_and_defaulted_by_its_field():
    """A flag's default is its field's default in flag form, but for the declared exceptions."""
    declared = {"embedding_type": "custom_cuda", "log_path": "./log.json", "dataset_type": None}
    defaults = RunConfig()
    for s in dlrm_flags.ALL_SETTINGS:
        flag, value = flags.FLAGS[s.flag], defaults
        for part in s.path.split("."):
            value = getattr(value, part)
        if s.flag in declared:
            assert flag.default == declared[s.flag], s.flag
        elif isinstance(value, bool):
            assert flag.boolean and flag.default == (not value if s.flag == "skip_checkpoint_verify" else value)
        elif isinstance(value, list):
            assert [int(v) for v in flag.default] == value, s.flag
        elif s.flag not in ("quantize_tables", "host_tables", "synthetic_multi_hot_sizes"):
            assert flag.default == value, s.flag


CONFIGS = [
    RunConfig(),
    RunConfig(mode="plan", seed=7, data=DataConfig(dataset_type="synthetic", synthetic_table_sizes=[9, 8, 7],
                                                 synthetic_bag_sizes=[2, 1, 3], synthetic_pooling="mean"),
              model=ModelSettings(embedding_dim=16, bottom_mlp_sizes=[32, 16], top_mlp_sizes=[8, 1]),
              parallel=ParallelConfig(host_tables=[0, 2], table_placement='{"0": [0, 1], "row_wise": [2]}'),
              serving=ServingConfig(quantize_tables=["int8", "fp16", "fp32"], quantize_min_rows=3),
              output=OutputConfig(log_path="a dir/log.json", tensorboard_dir="board", log_format="dllogger")),
    RunConfig(train=TrainConfig(LRSchedule(lr=0.25, warmup_steps=3, decay_power=1.5), auc_device="cpu",
                                save_checkpoint_path="/x/ckpt", checkpoint_every_steps=5, prefetch=4,
                                cuda_graphs=True, shuffle_batch_order=True),
              data=DataConfig(dataset="/data/criteo", dataset_type="parametric", hash_indices=True),
              model=ModelSettings(max_table_size=1000, embedding_type="multi_table"), amp=True,
              base_device="cuda"),
    RunConfig(model=ModelSettings(embedding_type="joint_fused"), parallel=ParallelConfig(
        host_tables=[1], host_table_cache_rows="auto", gradient_sync="overlap", dist_timeout=12.5),
        validate_dataset=False, allow_tf32=False),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=range(len(CONFIGS)))
def test_a_config_written_as_flags_reads_back_as_itself(cfg):
    args = dlrm_flags.config_args(cfg)
    assert dlrm_flags.run_config(dlrm_flags.parse_args(args)) == cfg
    assert {a.split("=")[0].lstrip("-").removeprefix("no") for a in args} <= main_flag_names()


def test_a_config_no_command_line_can_say_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="`auc_device` 'cuda:1'"):
        dlrm_flags.config_args(dataclasses.replace(RunConfig(), train=dataclasses.replace(
            RunConfig().train, auc_device="cuda:1")))
    with pytest.raises(ValueError, match=r"flags cannot say `quantize_tables` \['int8'\]"):
        dlrm_flags.config_args(dataclasses.replace(RunConfig(), mode="plan",
                                                   serving=ServingConfig(quantize_tables=["int8"])))


def test_help_is_short_and_grouped_by_section_and_helpfull_keeps_every_text():
    run = [sys.executable, "-m", "dlrm.scripts.main"]
    short = subprocess.run([*run, "--help"], capture_output=True, text=True, timeout=120)
    full = subprocess.run([*run, "--helpfull"], capture_output=True, text=True, timeout=120)
    assert short.returncode == 0 and full.returncode == 0
    lines = short.stdout.splitlines()
    headers = [line[:-1] for line in lines if line.endswith(":") and not line.startswith(" ")]
    assert headers[-len(dlrm_flags.SECTIONS):] == list(dlrm_flags.SECTIONS)
    for name in main_flag_names():  # each flag listed once, on one or two lines
        at = [i for i, line in enumerate(lines) if line.startswith((f"  --{name}", f"  --[no]{name}"))
              and line[len(f"  --{name}"):][:1] in ("=", ":", " ") or line.startswith(f"  --[no]{name}:")
              or line.startswith(f"  --[no]{name} ")]
        assert len(at) == 1, name
        assert at[0] + 1 == len(lines) or not lines[at[0] + 1].startswith("      ") or \
            at[0] + 2 == len(lines) or not lines[at[0] + 2].startswith("      "), name
        assert flags.FLAGS[name].help.split(". ")[-1][:30] in " ".join(full.stdout.split()), name
    assert len(lines) < 200 < len(full.stdout.splitlines())
