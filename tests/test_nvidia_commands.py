"""NVIDIA's own command lines and flags run here unchanged, on a CPU with small data.

The commands are written out below as NVIDIA's DLRM example (DeepLearningExamples,
PyTorch/Recommendation/DLRM: README.md and tests/*.sh) has them, with its data path replaced by
a tiny dataset written with this project's writer. Each runs with ``SMALL`` after it, flags the
commands leave at their defaults (model size, batch sizes, the CPU, the log), so that it runs in
a second. ``--cuda_graphs``, which NVIDIA's commands pass, is accepted on a CPU: the run notes
once that CUDA graphs are a CUDA feature and proceeds without them.

Most commands run in this process (absl parses the same argv the script would get; the one
multi-process command is a real launch), so that the whole flag matrix costs seconds.
"""

import csv
import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch
from absl import app, flags

from dlrm.inference.export import build_inference_model
from dlrm.scripts import main as dlrm_main
from dlrm.scripts.main import check_args
from dlrm.training.checkpoint import read_meta

from conftest import REPO, log_records
import warm_python

FLAGS = flags.FLAGS
DATA = "/data/dlrm/binary_dataset/"  # NVIDIA's path in the commands; replaced by the tiny dataset
CHECKPOINT = "`$CRITEO_DATASET_PARENT_DIRECTORY/checkpoints/checkpoint`"  # likewise, by a checkpoint

# NVIDIA's README (Quick Start Guide, steps 5 and 6; inference benchmark), as written there.
README_TRAIN = "python -m dlrm.scripts.main --mode train --dataset /data/dlrm/binary_dataset/ --amp --cuda_graphs"
README_TEST = ("python -m dlrm.scripts.main --mode test --dataset /data/dlrm/binary_dataset/ --load_checkpoint_path "
               "`$CRITEO_DATASET_PARENT_DIRECTORY/checkpoints/checkpoint`")
README_EVAL_MULTI_GPU = (  # DGX-1 and DGX-2 form: train mode, weights from the checkpoint
    "python -m torch.distributed.launch --no_python --use_env --nproc_per_node 8 "
    "bash  -c './bind.sh  --cpu=exclusive -- python -m dlrm.scripts.main "
    "--dataset /data/dlrm/binary_dataset/ --seed 0 --epochs 1 --amp --load_checkpoint_path "
    "`$CRITEO_DATASET_PARENT_DIRECTORY/checkpoints/checkpoint`'")
README_INFERENCE = "python -m dlrm.scripts.main --mode inference_benchmark --dataset /data"
# NVIDIA's README, "Provide a CSV containing preprocessed data ...": synthetic CSV files, their
# conversion, and training on the result, run from the repository root; /data is the data path.
README_CSV = [
    "python -m dlrm.scripts.gen_csv --feature_spec_in tests/transcoding/small_csv.yaml",
    "mkdir /data/conversion_output",
    "python -m dlrm.scripts.transcode --input /data --output /data/converted",
    "python -m dlrm.scripts.main --mode train --dataset /data/converted --amp --cuda_graphs",
]
CPU_GRAPHS_NOTE = "--cuda_graphs: CUDA graphs are a CUDA feature; this run is on the CPU and proceeds without them"

# tests/test_all_configs.sh: for mlp in True False, graphs in True, dot in cuda_dot dot, amp in True False
ALL_CONFIGS = ("python -m dlrm.scripts.main --mode train --dataset ${SYNTH_DATA_DIR} --optimized_mlp=${mlp} "
               "--cuda_graphs=${graphs} --interaction_op=${dot} --embedding_type=joint_sparse --amp=${amp}")
# tests/test_with_opts.sh, with the options of test_custom_dot.sh and of test_fspecs.sh
WITH_OPTS = "python -m dlrm.scripts.main --mode train --dataset ${SYNTH_DATA_DIR} ${OPTIONS}"
OPTIONS = {"test_custom_dot.sh": "--embedding_type=joint_sparse",
           "test_fspecs.sh": "--embedding_type=joint_sparse --interaction_op=dot"}

NUMERICAL, TABLES = 13, [3, 40, 7, 200, 11, 5, 90, 13, 2, 60, 8, 30, 4, 17, 9, 120, 6, 25, 3, 70, 12, 5, 44, 10, 2, 33]
SMALL = ["--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "32,16,1", "--batch_size", "256",
         "--test_batch_size", "4096", "--print_freq", "1", "--inference_benchmark_steps", "3", "--base_device", "cpu"]

# Every flag of NVIDIA's main.py, with a value of its type and what the run then uses here
# (check_args: parsed, mapped onto this program's flags, validated). A flag missing here or
# refused there fails.
NVIDIA_FLAGS = {
    "mode": (["--mode=test", "--load_checkpoint_path=/ckpt"], {"mode": "test"}),
    "seed": (["--seed=0"], {"seed": 0}),
    "batch_size": (["--batch_size=1024"], {"batch_size": 1024}),
    "test_batch_size": (["--test_batch_size=2048"], {"test_batch_size": 2048}),
    "lr": (["--lr=24"], {"lr": 24.0}),
    "epochs": (["--epochs=2"], {"epochs": 2}),
    "max_steps": (["--max_steps=1000"], {"max_steps": 1000}),
    "warmup_factor": (["--warmup_factor=1"], {"warmup_factor": 1}),
    "warmup_steps": (["--warmup_steps=8000"], {"warmup_steps": 8000}),
    "decay_steps": (["--decay_steps=24000"], {"decay_steps": 24000}),
    "decay_start_step": (["--decay_start_step=48000"], {"decay_start_step": 48000}),
    "decay_power": (["--decay_power=2"], {"decay_power": 2.0}),
    "decay_end_lr": (["--decay_end_lr=0"], {"decay_end_lr": 0.0}),
    "embedding_type": (["--embedding_type=joint_sparse"], {"embedding_type": "joint"}),
    "embedding_dim": (["--embedding_dim=128"], {"embedding_dim": 128}),
    "top_mlp_sizes": (["--top_mlp_sizes=1024,1024,512,256,1"], {"top_mlp_sizes": ["1024", "1024", "512", "256", "1"]}),
    "bottom_mlp_sizes": (["--bottom_mlp_sizes=512,256,128"], {"bottom_mlp_sizes": ["512", "256", "128"]}),
    "interaction_op": (["--interaction_op=cuda_dot"], {"interaction_op": "cuda_dot"}),
    "dataset": (["--dataset=/data"], {"dataset": "/data"}),
    "feature_spec": (["--feature_spec=feature_spec.yaml"], {"feature_spec": "feature_spec.yaml"}),
    "dataset_type": (["--dataset_type=parametric", "--dataset=/data"], {"dataset_type": "parametric"}),
    "shuffle_batch_order": (["--shuffle"], {"shuffle_batch_order": True}),
    "max_table_size": (["--max_table_size=1000", "--hash_indices"], {"max_table_size": 1000}),
    "hash_indices": (["--hash_indices=True"], {"hash_indices": True}),
    "synthetic_dataset_num_entries": (["--synthetic_dataset_num_entries=4096"], {"synthetic_dataset_num_entries": 4096}),
    "synthetic_dataset_table_sizes": (["--synthetic_dataset_table_sizes=10,20"],
                                      {"synthetic_dataset_table_sizes": ["10", "20"]}),
    "synthetic_dataset_numerical_features": (["--synthetic_dataset_numerical_features=13"],
                                             {"synthetic_dataset_numerical_features": 13}),
    "synthetic_dataset_use_feature_spec": (  # the dataset's shape, read from its spec (fixture below)
        ["--synthetic_dataset_use_feature_spec", "--dataset_type=synthetic_gpu", "--dataset={dataset}"],
        {"synthetic_dataset_table_sizes": [str(n) for n in TABLES], "synthetic_dataset_numerical_features": NUMERICAL}),
    "load_checkpoint_path": (["--load_checkpoint_path=/ckpt"], {"load_checkpoint_path": "/ckpt", "resume": False}),
    "save_checkpoint_path": (["--save_checkpoint_path=/ckpt"], {"save_checkpoint_path": "/ckpt"}),
    "log_path": (["--log_path=./log.json"], {"log_path": "./log.json"}),
    "test_freq": (["--test_freq=100"], {"test_freq": 100}),
    "test_after": (["--test_after=0.5"], {"test_after": 0.5}),
    "print_freq": (["--print_freq=200"], {"print_freq": 200}),
    "benchmark_warmup_steps": (["--benchmark_warmup_steps=500"], {"benchmark_warmup_steps": 500}),
    "base_device": (["--base_device=cpu"], {"base_device": "cpu"}),
    "amp": (["--amp=True"], {"amp": True}),
    "cuda_graphs": (["--cuda_graphs=True", "--base_device=cuda"], {"cuda_graphs": True}),  # a CPU run: below
    "inference_benchmark_batch_sizes": (["--inference_benchmark_batch_sizes=1,64,4096"],
                                        {"inference_benchmark_batch_sizes": ["1", "64", "4096"]}),
    "inference_benchmark_steps": (["--inference_benchmark_steps=200"], {"inference_benchmark_steps": 200}),
    "auc_threshold": (["--auc_threshold=0.8025"], {"auc_threshold": 0.8025}),
    "optimized_mlp": (["--optimized_mlp=False"], {"optimized_mlp": False}),  # no fused MLP here either way
    "auc_device": (["--auc_device=CPU"], {"auc_device": "CPU"}),
    "backend": (["--backend=nccl"], {"backend": "nccl"}),  # follows the device here (a header note)
    "bottom_features_ordered": (["--bottom_features_ordered"], {"bottom_features_ordered": True}),  # always so here
    "freeze_mlps": (["--freeze_mlps"], {"freeze_mlps": True}),
    "freeze_embeddings": (["--freeze_embeddings"], {"freeze_embeddings": True}),
    "Adam_embedding_optimizer": (["--Adam_embedding_optimizer"], {"optimizer": "adam", "dense_optimizer": "sgd"}),
    "Adam_MLP_optimizer": (["--Adam_MLP_optimizer"], {"optimizer": "sgd", "dense_optimizer": "adam"}),
}


@pytest.fixture(scope="module")
def dataset(synthetic_dataset):
    """NVIDIA's default shape (13 numerical, 26 categorical features), tiny: 512 training samples
    (2 steps of 256) and 4096 test samples (the inference benchmark's largest default batch)."""
    return synthetic_dataset(NUMERICAL, TABLES, {"train": 512, "test": 4096}, batch_size=4096, seed=3)


def args_of(command: str, dataset: str, checkpoint: str | None = None) -> list[str]:
    """The flags of one of NVIDIA's commands, its paths replaced."""
    command = command.replace(DATA, dataset).replace("${SYNTH_DATA_DIR}", dataset).replace(" /data", f" {dataset}")
    if checkpoint:
        command = command.replace(CHECKPOINT, checkpoint)
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "dlrm.scripts.main"], words
    return words[3:]


def run(args: list[str], log: str, capsys) -> str:
    """Runs dlrm.scripts.main with ``args`` in this process, as its command line would; returns stdout."""
    FLAGS.unparse_flags()
    try:
        FLAGS(["dlrm.scripts.main", *args, *SMALL, "--log_path", log])
        assert dlrm_main.main(["dlrm.scripts.main"]) == 0
    finally:
        FLAGS.unparse_flags()
    return capsys.readouterr().out


@pytest.fixture(autouse=True)
def torch_references(monkeypatch):
    """A CPU user's run: the kernels' torch references, not Triton's interpreter (too slow for runs)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("name", sorted(NVIDIA_FLAGS))
def test_every_flag_of_nvidias_main_parses_with_its_meaning(name, dataset):
    args, expected = NVIDIA_FLAGS[name]
    values = check_args([a.format(dataset=dataset) for a in args])
    assert {key: values[key].value for key in expected} == expected
    assert name in FLAGS


def test_help_states_what_each_nvidia_flag_maps_to():
    own = {f.name for f in FLAGS.get_flags_for_module("dlrm.scripts.nvidia_flags")}
    assert own == {"optimized_mlp", "auc_device", "backend", "bottom_features_ordered", "freeze_mlps",
                   "freeze_embeddings", "Adam_embedding_optimizer", "Adam_MLP_optimizer",
                   "synthetic_dataset_use_feature_spec"}
    for name in own:
        assert FLAGS[name].help.split(": ", 1)[-1].startswith("NVIDIA's") or FLAGS[name].help.startswith("NVIDIA's"), name
    assert "custom_cuda" in FLAGS["embedding_type"].help and "joint_sparse" in FLAGS["embedding_type"].help
    assert FLAGS["shuffle_batch_order"].short_name == "shuffle"
    assert "NVIDIA's main.py turns --amp off" in FLAGS["amp"].help
    assert "--resume" in FLAGS["load_checkpoint_path"].help


@pytest.mark.parametrize("args,embedding_type", [
    (["--embedding_type=custom_cuda", "--base_device=cpu"], "joint"),
    (["--base_device=cpu"], "joint"),  # custom_cuda is the default, as NVIDIA's
    (["--embedding_type=custom_cuda", "--base_device=cuda"], "joint_fused"),
    (["--base_device=cuda", "--optimizer=rowwise_adagrad"], "joint_fused"),
    (["--embedding_type=custom_cuda", "--base_device=cuda", "--Adam_MLP_optimizer"], "joint"),  # no fused Adam
    (["--embedding_type=custom_cuda", "--base_device=cuda", "--optimizer=adagrad"], "joint"),
    (["--embedding_type=joint_sparse", "--base_device=cuda"], "joint"),
    (["--embedding_type=multi_table", "--base_device=cuda"], "multi_table"),
])
def test_custom_cuda_is_the_fastest_embedding_that_supports_the_run(args, embedding_type):
    assert check_args(args).embedding_type == embedding_type  # no GPU needed: only the flags are resolved


@pytest.mark.parametrize("args,message", [
    (["--Adam_MLP_optimizer", "--dense_optimizer=adagrad"], "--Adam_MLP_optimizer selects --dense_optimizer adam"),
    (["--Adam_embedding_optimizer", "--optimizer=rowwise_adagrad"], "drop one of them"),
    (["--synthetic_dataset_use_feature_spec", "--dataset_type=synthetic_gpu"], "pass --dataset"),
    (["--resume"], "--resume continues a training run from a checkpoint"),
])
def test_contradictions_are_one_line_usage_errors(args, message):
    with pytest.raises(app.UsageError, match=message):
        check_args(args)


def test_readme_train_test_evaluate_and_benchmark(dataset, tmp_path, capsys):
    """NVIDIA's README, in its order: train (saving a checkpoint), test the checkpoint, the
    evaluation command (train mode with --load_checkpoint_path: NVIDIA loads the weights and
    trains and tests a whole epoch from step 0), and the inference benchmark."""
    ckpt, log = str(tmp_path / "checkpoint"), str(tmp_path / "log.json")
    out = run([*args_of(README_TRAIN, dataset), "--save_checkpoint_path", ckpt], log, capsys)
    assert log_records(log, "summary")[-1]["steps"] == 2 and "precision" in out
    assert out.count(CPU_GRAPHS_NOTE) == 1  # --cuda_graphs as written: the CPU run goes on without graphs

    run(args_of(README_TEST, dataset, ckpt), log, capsys)
    tested = log_records(log, "summary")[-1]["auc"]

    # The multi-GPU evaluation command's flags in one process: weights loaded, a whole epoch
    # trained from step 0 and tested (here the saved run had finished its epoch: resuming it
    # would train and test nothing).
    evaluation = args_of(README_EVAL_MULTI_GPU.split("-- ", 1)[1].rstrip("'"), dataset, ckpt)
    out = run(evaluation, log, capsys)
    assert f"Weights from {ckpt}; training starts at step 0" in out
    summary = log_records(log, "summary")[-1]
    assert summary["steps"] == 2 and summary["stop_reason"] == "completed" and summary["best_auc"] > 0
    # With lr 0 the tested weights are the checkpoint's: the AUC of --mode test (with --amp, as here)
    run([*args_of(README_TEST, dataset, ckpt), "--amp"], log, capsys)
    tested_amp = log_records(log, "summary")[-1]["auc"]
    run([*evaluation, "--lr", "0"], log, capsys)
    assert log_records(log, "eval")[-1]["auc"] == pytest.approx(tested_amp, abs=1e-12)
    assert tested_amp == pytest.approx(tested, abs=0.02)  # bf16 or fp32 autocast of the same weights

    # Exact resume stays: --resume continues the saved run (its epoch is done: nothing left to train)
    out = run([*evaluation, "--resume"], log, capsys)
    assert f"Resuming from {ckpt} at step 2" in out and log_records(log, "summary")[-1]["steps"] == 2

    out = run(args_of(README_INFERENCE, dataset), log, capsys)
    assert [r["batch_size"] for r in log_records(log, "inference_benchmark")] == [1, 64, 4096]


@pytest.mark.parametrize("script,options", [("test_all_configs.sh", None), *OPTIONS.items()])
def test_nvidia_test_scripts_flag_matrix(script, options, dataset, tmp_path, capsys):
    """NVIDIA's test scripts' training commands on the dataset (the scripts first generate data
    from each of NVIDIA's feature spec files with prepare_synthetic_dataset, which is not run
    here): test_all_configs.sh's matrix (--optimized_mlp, --interaction_op, --amp, and
    --cuda_graphs=True, which a CPU run notes and goes without), and test_with_opts.sh with the
    options of test_custom_dot.sh and test_fspecs.sh."""
    log = str(tmp_path / "log.json")
    if options is not None:
        commands = [WITH_OPTS.replace("${OPTIONS}", options)]
    else:
        commands = [ALL_CONFIGS.replace("${mlp}", mlp).replace("${graphs}", "True").replace("${dot}", dot)
                    .replace("${amp}", amp) for mlp in ("True", "False") for dot in ("cuda_dot", "dot")
                    for amp in ("True", "False")]
    for command in commands:
        args = args_of(command, dataset)
        out = run(args, log, capsys)
        summary = log_records(log, "summary")[-1]
        assert summary["steps"] == 2 and summary["stop_reason"] == "completed", command
        assert "--embedding_type joint_sparse: joint (one table, sparse gradients)" in out
        assert ("--optimized_mlp: this engine has no fused MLP" in out) == ("--optimized_mlp=True" in args)
        if "--amp=False" in args:
            assert "precision float32," in out
        assert out.count(CPU_GRAPHS_NOTE) == ("--cuda_graphs=True" in args)
    assert len(log_records(log, "summary")) == len(commands)


def test_readme_csv_flow_gen_csv_transcode_train(tmp_path, cli):
    """NVIDIA's README commands for CSV data, as written there but for the data path, with the
    repository's tests/transcoding/small_csv.yaml, as real runs of the modules from the
    repository root; the training command keeps its --cuda_graphs (the run says, once, that a
    CPU has none). The numericals are NVIDIA's bytes: float64 -> float32 -> float16 of the CSV."""
    data = str(tmp_path / "data")
    words = [shlex.split(command.replace("/data", data)) for command in README_CSV]
    words[0] += ["--output", data]  # gen_csv's default --output is NVIDIA's /data
    words[3] += ["--log_path", str(tmp_path / "log.json")]  # its default, ./log.json, is in the repository
    cli(*words[0][2:])
    subprocess.run(words[1], cwd=REPO, check=True)
    assert "cardinalities [5000, 20000, 300, 4, 24]" in cli(*words[2][2:]).stdout
    out = cli(*words[3][2:]).stdout
    assert out.count(CPU_GRAPHS_NOTE) == (0 if torch.cuda.is_available() else 1)
    summary = log_records(str(tmp_path / "log.json"), "summary")[-1]
    assert summary["stop_reason"] == "completed" and 0 <= summary["best_auc"] <= 1

    columns = {}  # the CSV files' numericals, read with the csv module
    for name, features in (("events.csv", ["clicked", "price", "age_days"]),
                           ("context.csv", ["hour", "dwell_seconds", "device", "position"])):
        with open(os.path.join(data, "train", name), newline="") as f:
            rows = [row for row in csv.reader(f) if row]
        columns.update({feature: [float(row[k]) for row in rows] for k, feature in enumerate(features)})
    table = np.array([columns[f] for f in ("price", "age_days", "dwell_seconds", "position")]).T
    written = np.fromfile(os.path.join(data, "converted", "train", "numerical.bin"), dtype=np.uint16)
    assert written.tobytes() == table.astype(np.float32).astype(np.float16).view(np.uint16).tobytes()


def test_synthetic_data_shaped_by_the_datasets_feature_spec(dataset, tmp_path, capsys):
    log = str(tmp_path / "log.json")
    out = run(["--dataset", dataset, "--dataset_type", "synthetic_gpu", "--synthetic_dataset_use_feature_spec",
               "--synthetic_dataset_num_entries", "512", "--synthetic_dataset_num_test_entries", "512"], log, capsys)
    assert f"synthetic data shaped by {os.path.join(dataset, 'feature_spec.yaml')} (13 numerical features, 26 tables)" \
        in out
    assert "DLRM: 26 tables" in out and "data synthetic_gpu" in out
    assert log_records(log, "summary")[-1]["steps"] == 2


def test_freeze_and_adam_flags_through_the_command_line(dataset, tmp_path, capsys):
    """--freeze_embeddings with --Adam_MLP_optimizer, from the weights of a checkpoint: the tables
    stay those of the checkpoint, the MLPs move."""
    log, initial, trained = str(tmp_path / "log.json"), str(tmp_path / "initial"), str(tmp_path / "trained")
    common = ["--dataset", dataset, "--lr", "0.01", "--warmup_steps", "0", "--decay_start_step", "0",
              "--decay_steps", "0"]
    run([*common, "--lr", "0", "--max_steps", "1", "--save_checkpoint_path", initial], log, capsys)
    out = run([*common, "--freeze_embeddings", "--Adam_MLP_optimizer", "--load_checkpoint_path", initial,
               "--save_checkpoint_path", trained], log, capsys)
    assert "--freeze_embeddings: the embedding tables are never updated" in out
    assert read_meta(trained)["optimizer"] == {"embedding": "sgd", "dense": "adam"}
    before, after = build_inference_model(initial).state_dict(), build_inference_model(trained).state_dict()
    for name, value in after.items():
        assert torch.equal(value, before[name]) == name.startswith("embeddings."), name


def test_nvidias_multi_gpu_evaluation_command_on_two_cpu_processes(dataset, tmp_path, capsys):
    """The README's DGX-1/DGX-2 evaluation command as a real launch (2 processes for 8 GPUs;
    numactl is a stand-in that runs the command unbound, as a machine without numactl needs)."""
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.json")
    run(["--dataset", dataset, "--save_checkpoint_path", ckpt], log, capsys)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "TRITON_INTERPRET": "0"}
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "numactl").write_text('#!/bin/sh\nwhile [ "$1" != "--" ]; do shift; done\nshift\nexec "$@"\n')
    (fake / "numactl").chmod(0o755)
    # A script, not a symlink: Python started through a link outside its venv finds no pyvenv.cfg
    # beside the link and runs as the base interpreter, without this project's packages.
    (fake / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (fake / "python").chmod(0o755)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    command = README_EVAL_MULTI_GPU.replace(DATA, dataset).replace(CHECKPOINT, ckpt).replace(
        "--nproc_per_node 8", "--nproc_per_node 2")
    command = command[:-1] + f" {shlex.join([*SMALL, '--log_path', log])}'"  # inside bash -c '...'
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", "torch.distributed.launch"]
    proc = warm_python.run([sys.executable, *words[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"Weights from {ckpt}; training starts at step 0" in proc.stdout
    summary = log_records(log, "summary")[-1]
    assert summary["steps"] == 2 and summary["stop_reason"] == "completed"
    assert "parameters on rank 0 of 2" in proc.stdout
