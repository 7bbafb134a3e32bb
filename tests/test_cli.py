"""The main entry point run as a user runs it: one subprocess per mode."""

import os

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from dlrm.data.batch import Batch
from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.split_binary_writer import SplitBinaryWriter
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.training.checkpoint import load_checkpoint
from conftest import log_records, logged_scalars, tensorboard_scalars

TABLES = [30, 300, 4, 1000, 70]
SMALL_MODEL = ["--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "32,16,1"]
FAST = ["--base_device", "cpu", "--lr", "0.5", "--warmup_steps", "10", "--decay_start_step", "0",
        "--decay_steps", "0", "--print_freq", "20"]


@pytest.fixture(scope="module")
def dataset(synthetic_dataset):
    """A small split-binary dataset with learnable labels, written with the project's writer."""
    return synthetic_dataset(4, TABLES, {"train": 20_000, "test": 5_000}, batch_size=4096, seed=7)


def test_help_lists_nvidia_flags(cli):
    out = cli("dlrm.scripts.main", "--helpfull", check=False).stdout  # absl exits 1 after help
    for flag in ["mode", "seed", "batch_size", "test_batch_size", "lr", "epochs", "max_steps", "warmup_factor",
                 "warmup_steps", "decay_steps", "decay_start_step", "decay_power", "decay_end_lr", "embedding_type",
                 "embedding_dim", "top_mlp_sizes", "bottom_mlp_sizes", "interaction_op", "dataset", "feature_spec",
                 "dataset_type", "shuffle_batch_order", "max_table_size", "hash_indices",
                 "synthetic_dataset_num_entries", "synthetic_dataset_table_sizes",
                 "synthetic_dataset_numerical_features", "load_checkpoint_path", "save_checkpoint_path", "log_path",
                 "test_freq", "test_after", "print_freq", "benchmark_warmup_steps", "base_device", "amp",
                 "inference_benchmark_batch_sizes", "inference_benchmark_steps", "auc_threshold"]:
        assert f"--{flag}" in out or f"--[no]{flag}" in out, flag


def test_train_then_test_then_benchmark(cli, dataset, tmp_path):
    ckpt, log, board = str(tmp_path / "ckpt"), str(tmp_path / "train.json"), str(tmp_path / "board")
    out = cli("dlrm.scripts.main", "--dataset", dataset, "--batch_size", "256", "--test_batch_size", "1000",
              "--epochs", "2", "--shuffle_batch_order", "--save_checkpoint_path", ckpt, "--log_path", log,
              "--tensorboard_dir", board, *SMALL_MODEL, *FAST).stdout
    assert "Epoch:[0/2] [20/79]" in out and "eta:" in out and "step_time:" in out
    (flags_record,) = log_records(log, "flags")
    assert flags_record["dataset"] == dataset and flags_record["batch_size"] == 256
    assert "verbosity" not in flags_record  # only the program's own flags
    (summary,) = log_records(log, "summary")
    assert summary["steps"] == 158 and summary["best_auc"] > 0.65
    assert [e["step"] for e in log_records(log, "eval")] == [79, 158]  # once per epoch by default
    scalars = tensorboard_scalars(board)  # --tensorboard_dir: the log's curves, read back by TensorBoard
    assert {"train/loss", "train/lr", "eval/auc", "eval/loss"} <= set(scalars)
    for tag, points in logged_scalars(log, ("train", "eval")).items():
        assert [s for s, _ in scalars[tag]] == [s for s, _ in points], tag
        np.testing.assert_allclose([v for _, v in scalars[tag]], [v for _, v in points], rtol=1e-6, err_msg=tag)

    # --mode test: the AUC of the saved weights, checked against sklearn on an in-process forward
    test_log = str(tmp_path / "test.json")
    cli("dlrm.scripts.main", "--mode", "test", "--dataset", dataset, "--load_checkpoint_path", ckpt,
        "--test_batch_size", "999", "--log_path", test_log, *SMALL_MODEL, "--base_device", "cpu")
    (test_summary,) = log_records(test_log, "summary")
    spec = FeatureSpec.from_yaml(os.path.join(dataset, "feature_spec.yaml"))
    model = DLRM(DLRMConfig(4, TABLES, 8, [16, 8], [32, 16, 1]))
    load_checkpoint(ckpt, model)
    reader = SplitBinaryReader(spec, "test", 5000)
    batch = reader.read_batch(0)
    with torch.no_grad():
        scores = model(batch.numerical, batch.categorical).numpy()
    assert test_summary["samples"] == 5000
    assert test_summary["auc"] == pytest.approx(roc_auc_score(batch.label.numpy(), scores), abs=1e-6)
    assert test_summary["auc"] == pytest.approx(log_records(log, "eval")[-1]["auc"], abs=1e-6)

    # --mode inference_benchmark on the trained checkpoint
    bench_log = str(tmp_path / "bench.json")
    out = cli("dlrm.scripts.main", "--mode", "inference_benchmark", "--dataset", dataset,
              "--load_checkpoint_path", ckpt, "--inference_benchmark_batch_sizes", "1,64,512",
              "--inference_benchmark_steps", "30", "--log_path", bench_log, *SMALL_MODEL, "--base_device", "cpu").stdout
    assert "p99 ms" in out and "none (cpu)" in out
    rows = log_records(bench_log, "inference_benchmark")
    assert [r["batch_size"] for r in rows] == [1, 64, 512]
    for r in rows:
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert r["throughput"] == pytest.approx(r["batch_size"] / (r["mean_ms"] / 1e3))


def test_synthetic_default_with_amp_and_resume(cli, tmp_path):
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.json")
    common = ["--synthetic_dataset_table_sizes", ",".join(map(str, TABLES)), "--synthetic_dataset_numerical_features",
              "13", "--synthetic_dataset_num_entries", "16384", "--synthetic_dataset_num_test_entries", "4096",
              "--batch_size", "512", "--test_batch_size", "4096", "--amp", "--log_path", log, *SMALL_MODEL, *FAST]
    cli("dlrm.scripts.main", *common, "--max_steps", "12", "--save_checkpoint_path", ckpt)
    out = cli("dlrm.scripts.main", *common, "--resume", "--save_checkpoint_path", ckpt).stdout
    from dlrm.engine.devices import cpu_has_native_bf16

    expected = "precision bfloat16" if cpu_has_native_bf16() else "precision float32"  # --amp: bf16 where it is fast
    assert expected in out and "Resuming from" in out and "at step 12" in out
    summaries = log_records(log, "summary")
    assert [s["steps"] for s in summaries] == [12, 32]


def test_fused_kernels_train_and_their_checkpoint_loads_into_the_plain_model(cli, dataset, tmp_path, monkeypatch):
    """``joint_fused`` + ``cuda_dot`` learn as the plain path does from the same initial weights,
    and the checkpoint they write is an ordinary one: ``joint`` + ``dot`` resume from it. The
    kernels' torch references run here (the interpreter is too slow for a whole run;
    tests/test_kernel_*.py check the kernels themselves)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ckpt, fused_log, plain_log = str(tmp_path / "ckpt"), str(tmp_path / "fused.json"), str(tmp_path / "plain.json")
    common = ["--dataset", dataset, "--batch_size", "512", "--test_batch_size", "5000", "--amp", *SMALL_MODEL, *FAST]
    cli("dlrm.scripts.main", *common, "--max_steps", "39", "--embedding_type", "joint_fused",
        "--interaction_op", "cuda_dot", "--save_checkpoint_path", ckpt, "--log_path", fused_log)
    cli("dlrm.scripts.main", *common, "--max_steps", "39", "--log_path", plain_log)
    (fused,), (plain,) = log_records(fused_log, "summary"), log_records(plain_log, "summary")
    assert fused["steps"] == plain["steps"] == 39
    assert plain["best_auc"] > 0.6
    assert fused["best_auc"] == pytest.approx(plain["best_auc"], abs=0.01)  # bf16 rounding differs, not learning
    out = cli("dlrm.scripts.main", *common, "--epochs", "2", "--max_steps", "45", "--embedding_type", "joint", "--interaction_op",
              "dot", "--resume", "--load_checkpoint_path", ckpt, "--log_path", fused_log).stdout
    assert "at step 39" in out
    assert log_records(fused_log, "summary")[-1]["steps"] == 45


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--max_table_size", "10"], "--max_table_size needs --hash_indices"),
        (["--mode", "test"], "--load_checkpoint_path"),
        (["--dataset_type", "split_binary"], "needs --dataset"),
        (["--dataset", "/nonexistent/dir"], "feature_spec.yaml not found"),
        (["--bottom_mlp_sizes", "16,4", "--embedding_dim", "8"], "bottom_mlp_sizes"),
        (["--top_mlp_sizes", "16,x"], "comma-separated list of integers"),
        (["--load_checkpoint_path", "/nonexistent/ckpt"], "No checkpoint at /nonexistent/ckpt"),
    ],
)
def test_bad_flags_give_clear_errors(cli, args, needle):
    proc = cli("dlrm.scripts.main", *args, "--base_device", "cpu", "--log_path", os.devnull,
               "--synthetic_dataset_table_sizes", "10,10", check=False)
    assert proc.returncode != 0
    assert needle in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_out_of_range_ids_are_refused_unless_hashed(cli, tmp_path):
    root = str(tmp_path)
    spec = FeatureSpec.default(2, [10, 10], splits=("train", "test"), base_directory=root)
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        with SplitBinaryWriter(spec, split) as w:
            w.write(Batch(torch.rand(256, 2).half(), torch.from_numpy(rng.integers(0, 10, (256, 2))).to(torch.int8),
                          torch.from_numpy(rng.random(256) < 0.5)))
    spec.to_yaml(os.path.join(root, "feature_spec.yaml"))
    # Declare a smaller cardinality than the data holds: the ids no longer fit.
    spec.feature_spec["cat_1.bin"]["cardinality"] = 5
    spec.to_yaml(os.path.join(root, "feature_spec.yaml"))
    args = ["dlrm.scripts.main", "--dataset", root, "--batch_size", "64", "--log_path", os.devnull, *FAST,
            "--embedding_dim", "4", "--bottom_mlp_sizes", "4", "--top_mlp_sizes", "4,1"]
    proc = cli(*args, check=False)
    assert proc.returncode == 2 and "cat_1.bin" in proc.stderr and "--hash_indices" in proc.stderr
    assert "Traceback" not in proc.stderr
    cli(*args, "--hash_indices")


def test_checkpoint_of_another_model_is_refused(cli, dataset, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    base = ["dlrm.scripts.main", "--dataset", dataset, "--batch_size", "2048", "--max_steps", "2",
            "--log_path", os.devnull, *FAST]
    cli(*base, *SMALL_MODEL, "--save_checkpoint_path", ckpt)
    proc = cli(*base, "--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "64,16,1",
               "--load_checkpoint_path", ckpt, check=False)
    assert proc.returncode == 2 and "top_mlp.layers.0.weight" in proc.stderr


def test_library_settings_are_shown_as_the_scripts_flags():
    from absl import flags as absl_flags

    from dlrm.scripts.cli import flag_terms

    values = absl_flags.FlagValues()
    absl_flags.DEFINE_integer("batch_size", 1, "", flag_values=values)
    absl_flags.DEFINE_boolean("hash_indices", False, "", flag_values=values)
    absl_flags.DEFINE_boolean("skip_checkpoint_verify", False, "", flag_values=values)
    absl_flags.DEFINE_float("device_memory_gb", 1.0, "", flag_values=values)
    cases = {
        "resume with `batch_size=512` (or not)": "resume with --batch_size=512 (or not)",
        "pass `hash_indices=True` to map ids": "pass --hash_indices to map ids",
        "set `hash_indices=False`": "set --nohash_indices",
        "drop `hash_indices`": "drop --hash_indices",
        "or load it anyway with `verify=False`": "or load it anyway with --skip_checkpoint_verify",
        "or raise `capacity`": "or raise --device_memory_gb",
        "`embedding_dim` and `cardinalities`": "embedding_dim and cardinalities",  # no such flags here
        "plain `text with spaces` stays": "plain `text with spaces` stays",
    }
    for library, shown in cases.items():
        assert flag_terms(library, values) == shown
