"""Every flag of dlrm.scripts.main reaches its RunConfig, and every setting of the config has a
flag: the config is the whole run, so a Python caller (dlrm.api) can say anything the
command line can (the flags are generated from the config: tests/test_flags_from_config.py)."""

import pytest
from absl import flags

from dlrm.data.feature_spec import FeatureSpec
from dlrm.scripts import dlrm_flags, nvidia_flags, serving_flags
from dlrm.scripts.main import check_args
from dlrm.training.run_config import RunConfig

# NVIDIA's flags that change nothing in this program (nvidia_flags: the run header says so when
# one is given), so no config holds them.
CHANGE_NOTHING = {
    "optimized_mlp": "no fused MLP here: the torch MLP runs either way",
    "backend": "the torch.distributed backend follows the device",
    "bottom_features_ordered": "the features always join in the fixed order",
}

# A non-default value for the flags the generic rule below cannot pick one for, and the flags
# some need beside them (in both runs compared) to make a valid run.
VALUES = {
    "mode": ["--mode=plan"],
    "embedding_type": ["--embedding_type=multi_table"],  # the default resolves to joint on a CPU
    "dataset_type": ["--dataset_type=synthetic_gpu"],
    "top_mlp_sizes": ["--top_mlp_sizes=64,1"],
    "bottom_mlp_sizes": ["--bottom_mlp_sizes=64,32"],
    "synthetic_dataset_table_sizes": ["--synthetic_dataset_table_sizes=5,6"],
    "synthetic_multi_hot_sizes": ["--synthetic_multi_hot_sizes=mlperf"],
    "inference_benchmark_batch_sizes": ["--inference_benchmark_batch_sizes=2,3"],
    "quantize_tables": ["--quantize_tables=int8"],
    "dataset": ["--dataset=/data/criteo"],
    "feature_spec": ["--feature_spec=other.yaml"],
    "base_device": ["--base_device=cpu"],
    "load_checkpoint_path": ["--load_checkpoint_path=ckpt"],
    "save_checkpoint_path": ["--save_checkpoint_path=ckpt"],
    "log_path": ["--log_path=other.json"],
    "tensorboard_dir": ["--tensorboard_dir=board"],
    "table_placement": ["--table_placement=table_wise"],
    "host_tables": ["--host_tables=none"],
    "preset": ["--preset=mlperf_dlrmv2"],
    "backend": ["--backend=nccl"],
    "auc_device": ["--auc_device=CPU"],  # GPU: where the scores are, as unset
}
NEEDS = {
    "max_table_size": ["--hash_indices"],
    "resume": ["--save_checkpoint_path=ckpt"],
    "host_table_cache_rows": ["--embedding_type=joint_fused", "--host_tables=0"],
    "cuda_graphs": ["--base_device=cuda"],  # on a CPU the run proceeds without them (a header note)
    "quantize_tables": ["--mode=plan"],  # serving precision: test, inference_benchmark, plan
    "quantize_min_rows": ["--mode=plan"],
    "synthetic_dataset_use_feature_spec": ["--dataset_type=synthetic", "--dataset={spec_dir}"],
}


def main_flags() -> list[flags.Flag]:
    """The flags dlrm.scripts.main defines (its own, NVIDIA's and the serving ones), each once."""
    modules = (dlrm_flags.__name__, nvidia_flags.__name__, serving_flags.__name__)
    found = {}
    for module in modules:
        for flag in flags.FLAGS.get_flags_for_module(module):
            found[flag.name] = flag
    return list(found.values())


def changed(flag: flags.Flag) -> list[str]:
    """The command line giving ``flag`` a value other than its default."""
    if flag.name in VALUES:
        return VALUES[flag.name]
    default = flag.default
    if flag.boolean:
        return [f"--no{flag.name}" if default else f"--{flag.name}"]
    if isinstance(flag, flags.EnumFlag) or hasattr(flag.parser, "enum_values"):
        choices = getattr(flag.parser, "enum_values", None)
        return [f"--{flag.name}={next(c for c in choices if c != default)}"]
    if isinstance(default, bool):
        raise AssertionError(flag.name)
    if isinstance(default, int) or flag.flag_type() == "int":
        return [f"--{flag.name}={3 if default is None else default + 1}"]
    if isinstance(default, float) or flag.flag_type() == "float":
        return [f"--{flag.name}={0.5 if default is None else default * 2 + 1}"]
    raise AssertionError(f"--{flag.name}: give it a non-default value in VALUES")


def flag_configs(spec_dir) -> list[tuple[str, RunConfig, RunConfig]]:
    """(flag, config of the flags it needs, that config with the flag given another value), per flag of main."""
    found = []
    for flag in main_flags():
        base = [arg.format(spec_dir=spec_dir) for arg in NEEDS.get(flag.name, [])]
        found.append((flag.name, dlrm_flags.run_config(check_args(base)),
                      dlrm_flags.run_config(check_args(base + changed(flag)))))
    return found


def test_every_flag_of_main_changes_its_run_config_and_every_setting_has_a_flag(tmp_path):
    FeatureSpec.default(2, [5, 6]).to_yaml(tmp_path / "feature_spec.yaml")
    unmapped, names, reached = [], set(), set()
    for name, before, after in flag_configs(tmp_path):
        names.add(name)
        if before == after:
            unmapped.append(name)
        reached |= {setting for setting, value in after.settings().items() if before.settings()[setting] != value}
    assert sorted(unmapped) == sorted(CHANGE_NOTHING), f"flags that do not reach RunConfig: {unmapped}"
    # the seven that did not before, and the serving precision main read from FLAGS
    assert {"inference_benchmark_batch_sizes", "inference_benchmark_steps", "inference_benchmark_backend",
            "inference_benchmark_threads", "plan_max_processes", "log_path", "tensorboard_dir", "log_format",
            "quantize_tables", "quantize_min_rows"} <= names
    # ...and the other way: no setting of the config is out of the flags' reach
    assert sorted(set(RunConfig().settings()) - reached) == []


@pytest.mark.parametrize("args,setting", [
    (["--mode=inference_benchmark", "--inference_benchmark_batch_sizes=2,64"], "inference_benchmark_batch_sizes"),
    (["--mode=inference_benchmark", "--inference_benchmark_steps=7"], "inference_benchmark_steps"),
    (["--mode=inference_benchmark", "--inference_benchmark_backend=onnxruntime"], "inference_benchmark_backend"),
    (["--mode=inference_benchmark", "--inference_benchmark_threads=2"], "inference_benchmark_threads"),
    (["--mode=plan", "--plan_max_processes=5"], "plan_max_processes"),
    (["--log_path=a.json", "--log_format=dllogger"], "log_format"),
    (["--tensorboard_dir=board"], "tensorboard_dir"),
])
def test_the_flags_main_read_directly_are_settings_of_the_config(args, setting):
    """Each is a field of the config (so RunConfig(mode="inference_benchmark", ...) says it all),
    with the flag's value."""
    cfg = dlrm_flags.run_config(check_args(args))
    holders = [cfg, cfg.benchmark, cfg.output]
    value = next(getattr(h, setting) for h in holders if hasattr(h, setting))
    flag_value = check_args(args)[setting].value
    assert value == ([int(v) for v in flag_value] if isinstance(flag_value, list) else flag_value)


def test_the_loops_schedule_is_named_as_the_recommenders_and_shown_as_nvidias_flags(cli):
    """TrainConfig's log_every_steps, eval_every_steps, checkpoint_every_steps: the library's
    messages name them so, and main shows its flags (--print_freq, --test_freq, --checkpoint_freq);
    a script whose flag has the setting's own name (the recommender's) shows that one."""
    from dlrm.scripts.cli import flag_terms
    from dlrm.training.lr_schedule import LRSchedule
    from dlrm.training.run_config import RunConfig
    from dlrm.training.train import TrainConfig

    for setting, flag in (("log_every_steps", "print_freq"), ("eval_every_steps", "test_freq"),
                          ("checkpoint_every_steps", "checkpoint_freq")):
        with pytest.raises(ValueError, match=f"`{setting}` must be positive, got 0"):
            RunConfig(train=TrainConfig(LRSchedule(1.0), **{setting: 0}))
        assert flag_terms(f"`{setting}` must be positive") == f"--{flag} must be positive"  # main's flags
        own = flags.FlagValues()
        flags.DEFINE_integer(setting, 0, "", flag_values=own)
        assert flag_terms(f"raise `{setting}`", own) == f"raise --{setting}"
    proc = cli("dlrm.scripts.main", "--test_freq=0", "--log_path=/dev/null", check=False)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --test_freq must be positive, got 0", proc.stderr
