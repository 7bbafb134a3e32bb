"""A DLRM run from Python (RunConfig -> build_run -> train) is the command line's run, and its
settings check themselves, in the library's terms."""

import pytest
import torch
from absl import flags

from dlrm.data.sources import DataConfig
from dlrm.engine.devices import resolve_device
from dlrm.scripts import cli
from dlrm.training.build import build_run, start_processes, start_training
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.optimizers import OptimizerConfig
from dlrm.training.run_config import CheckpointConfig, ModelSettings, ParallelConfig, RunConfig
from dlrm.training.train import TrainConfig, train
from test_recommender_cli import read_checkpoint

TABLES = [30, 300, 4, 70]
FLAGS = ["--synthetic_dataset_table_sizes", ",".join(map(str, TABLES)), "--synthetic_dataset_numerical_features", "5",
         "--synthetic_dataset_num_entries", "4096", "--synthetic_dataset_num_test_entries", "1024",
         "--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "32,16,1", "--batch_size", "256",
         "--test_batch_size", "1024", "--lr", "0.5", "--warmup_steps", "2", "--decay_start_step", "0",
         "--decay_steps", "0", "--optimizer", "rowwise_adagrad", "--max_steps", "7", "--seed", "11",
         "--base_device", "cpu", "--embedding_type", "joint"]


def test_a_python_run_is_the_command_lines_run(cli, tmp_path):
    """The same settings, once as flags of dlrm.scripts.main and once as a RunConfig built and
    trained in this process: the two checkpoints hold the same tensors, bit for bit."""
    by_flags, by_python = str(tmp_path / "flags"), str(tmp_path / "python")
    cli("dlrm.scripts.main", *FLAGS, "--save_checkpoint_path", by_flags, "--log_path", str(tmp_path / "log.json"))

    cfg = RunConfig(
        seed=11, base_device="cpu", batch_size=256, test_batch_size=1024,
        data=DataConfig(dataset_type="synthetic", synthetic_num_entries=4096, synthetic_num_test_entries=1024,
                        synthetic_table_sizes=TABLES, synthetic_num_numerical=5),
        model=ModelSettings(embedding_dim=8, bottom_mlp_sizes=[16, 8], top_mlp_sizes=[32, 16, 1]),
        optimizer=OptimizerConfig(embedding="rowwise_adagrad"),
        train=TrainConfig(LRSchedule(0.5, warmup_steps=2), max_steps=7, save_checkpoint_path=by_python),
    )
    # dlrm/training/build.py's recipe, line for line
    device = resolve_device(cfg.base_device)
    run = build_run(cfg, device, collectives=start_processes(cfg, None, device))
    optimizer, scaler, state = start_training(run)  # state: what `resume` continues, else None
    summary = train(run.model, optimizer, scaler, run.precision, run.source("train", cfg.batch_size),
                    run.source("test", cfg.test_batch_size), cfg.train, run.device, run.logger, state,
                    run_config=cfg.to_dict(), seed=cfg.seed)  # what the checkpoint records; the one seed
    assert summary["steps"] == 7 and state is None

    expected, got = read_checkpoint(by_flags), read_checkpoint(by_python)
    assert got.keys() == expected.keys() and any("optimizer" in key for key in got)
    for key, value in expected.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key


@pytest.mark.parametrize("settings,message", [
    (dict(batch_size=0), "`batch_size` must be positive, got 0"),
    (dict(model=ModelSettings(max_table_size=10)), "`max_table_size` needs `hash_indices=True`"),
    (dict(mode="test"), "pass `load_checkpoint_path`"),
    (dict(checkpoint=CheckpointConfig(resume=True)), "`resume` continues a training run"),
    (dict(data=DataConfig(dataset_type="split_binary")), "`dataset_type=split_binary` needs `dataset`"),
    (dict(data=DataConfig(dataset_type="synthetic", synthetic_table_sizes=[5, 0])), "`synthetic_table_sizes`"),
    (dict(train=TrainConfig(LRSchedule(-1.0))), "`lr` must be a finite number >= 0"),  # NaN: at LRSchedule
    (dict(train=TrainConfig(LRSchedule(1.0), auc_threshold=1.5)), "`auc_threshold` must be in (0, 1]"),
    (dict(model=ModelSettings(embedding_type="joint_fused"), optimizer=OptimizerConfig("adagrad")),
     "`embedding_type=joint_fused`"),
])
def test_bad_settings_are_refused_naming_the_setting(settings, message):
    with pytest.raises(ValueError) as raised:
        RunConfig(**settings)
    assert message in str(raised.value)


def test_parallel_and_device_settings_are_checked():
    with pytest.raises(ValueError, match="`gradient_sync` must be one of"):
        ParallelConfig(gradient_sync="sometimes")
    with pytest.raises(ValueError, match="`dist_timeout` must be positive"):
        ParallelConfig(dist_timeout=0)
    with pytest.raises(ValueError, match="`base_device` tpu: not a device"):
        resolve_device("tpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_our_flags_list_each_flag_once_under_its_own_name():
    """The run log's flags: no short names, no aliases (they repeat another flag's value)."""
    values = flags.FlagValues()
    flags.DEFINE_integer("print_freq", 100, "", flag_values=values, module_name="script")
    flags.DEFINE_boolean("shuffle_batch_order", False, "", short_name="shuffle", flag_values=values,
                         module_name="script")
    flags.DEFINE_alias("log_every_steps", "print_freq", flag_values=values, module_name="script")
    values(["script", "--log_every_steps", "7", "--shuffle"])
    assert values.print_freq == 7
    assert cli.our_flags(values) == {"print_freq": 7, "shuffle_batch_order": True}
