"""Train, test and benchmark a DLRM on one device, or hybrid-parallel on several.

    python -m dlrm.scripts.main                                  # synthetic data with signal
    torchrun --nproc_per_node 8 -m dlrm.scripts.main --dataset /data/criteo_fl15 --amp
    python -m dlrm.scripts.main --dataset /data/criteo_fl15      # a split-binary dataset
    python -m dlrm.scripts.main --mode test --dataset ... --load_checkpoint_path ckpt/
    python -m dlrm.scripts.main --mode inference_benchmark --inference_benchmark_batch_sizes 1,64,4096

Flags follow NVIDIA's DLRM example where a flag of the same name exists there, and every flag of
NVIDIA's main.py is accepted: those this program adds for them are in dlrm.scripts.nvidia_flags
(--helpfull lists them with what each maps to).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import torch
from absl import app, flags

from dlrm.data.atomic import StorageError
from dlrm.data.errors import DatasetError
from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.sources import (
    SPLIT_BINARY_TYPES, SYNTHETIC_TYPES, DataConfig, load_feature_spec, make_rank_source, make_source, table_sizes,
)
from dlrm.data.synthetic import MLPERF_DLRMV2_CARDINALITIES, MLPERF_MULTI_HOT_SIZES
from dlrm.distributed.collectives import GRADIENT_SYNC, Collectives, process_group_collectives
from dlrm.distributed.parallelize import parallelize
from dlrm.distributed.planner import PlanError, format_plan, load_placement, plan_tables
from dlrm.distributed.process_group import DistEnv, device_memory_bytes, dist_env, init_process_group
from dlrm.distributed.sizing import format_sizing, size_processes
from dlrm.inference.benchmark import benchmark_inference, exported_forward, format_table
from dlrm.model.dlrm import DLRM, EMBEDDING_DTYPES, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.embeddings import TableShard
from dlrm.scripts import cli, nvidia_flags
from dlrm.training.checkpoint import CheckpointError, CheckpointLock, latest_checkpoint, load_checkpoint
from dlrm.training.cuda_graphs import GraphedInference, check_cuda_graphs_supported
from dlrm.training.logger import LogOpenError, RunLogger
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.signals import StopOnSignals
from dlrm.training.train import TrainConfig, evaluate, train
from dlrm.training.optimizers import DENSE_OPTIMIZERS, EMBEDDING_OPTIMIZERS, OptimizerConfig, make_optimizer

FLAGS = flags.FLAGS

# Run
flags.DEFINE_enum("mode", "train", ["train", "test", "inference_benchmark", "plan"],
                  "train: train (and test as scheduled); test: evaluate --load_checkpoint_path on the test split; "
                  "inference_benchmark: latency and throughput per batch size; plan: the memory per process and "
                  "the fewest processes (GPUs, Spark tasks) the model and --batch_size need on devices of "
                  "--device_memory_gb, without building the model.")
flags.DEFINE_integer("plan_max_processes", 64, "--mode plan: the most processes considered.", lower_bound=1)
flags.DEFINE_integer("seed", 12345, "Random seed for initialisation, batch order and synthetic data.")
flags.DEFINE_string("base_device", None, "Device to run on: cuda, cuda:N or cpu. Default: cuda if available, else cpu.")
flags.DEFINE_boolean("amp", False, "Automatic mixed precision through torch.amp (see --amp_dtype). On a CPU it "
                     "autocasts as --amp_dtype says, where NVIDIA's main.py turns --amp off.")
flags.DEFINE_enum("amp_dtype", "auto", ["auto", "float16", "bfloat16"],
                  "Autocast dtype with --amp. auto: float16 (with dynamic loss scaling) on CUDA; bfloat16 on a CPU with bf16 "
                  "instructions (AVX512-BF16, AMX), float32 on one without, where bf16 is slower (the run header says so).")
flags.DEFINE_boolean("allow_tf32", True, "Use TF32 for float32 matmuls on GPUs that have it.")

# Training
flags.DEFINE_integer("batch_size", 65536, "Training batch size.")
flags.DEFINE_integer("test_batch_size", 65536, "Batch size for testing.")
flags.DEFINE_float("lr", 24.0, "Base learning rate (embeddings and MLPs).")
flags.DEFINE_enum("optimizer", "sgd", list(EMBEDDING_OPTIMIZERS),
                  "Optimizer of the embedding tables: sgd, adagrad (an accumulator per weight), rowwise_adagrad "
                  "(one per row, as FBGEMM/TorchRec/MLPerf DLRMv2) or adam (torch SparseAdam's lazy rule). Each "
                  "updates only the rows a batch used.")
flags.DEFINE_enum("dense_optimizer", None, list(DENSE_OPTIMIZERS),
                  "Optimizer of the MLPs (and interaction weights). Default: sgd with --optimizer sgd, adagrad with "
                  "adagrad or rowwise_adagrad, adam with adam.")
flags.DEFINE_float("optimizer_eps", 1e-8, "Epsilon of Adagrad, row-wise Adagrad and Adam.")
flags.DEFINE_integer("epochs", 1, "Number of epochs.")
flags.DEFINE_integer("max_steps", None, "Stop after this many optimizer steps.")

# Learning-rate schedule (NVIDIA's definitions)
flags.DEFINE_integer("warmup_factor", 0, "Warmup starts at lr * (1 - 1/2**warmup_factor); non-negative integer.")
flags.DEFINE_integer("warmup_steps", 8000, "Steps of linear learning-rate warmup.")
flags.DEFINE_integer("decay_steps", 24000, "Steps of polynomial decay; 0 disables decay.")
flags.DEFINE_integer("decay_start_step", 48000, "Step after which the decay starts (not before warmup ends).")
flags.DEFINE_float("decay_power", 2, "Power of the polynomial decay.")
flags.DEFINE_float("decay_end_lr", 0, "Learning rate at the end of the decay and after it.")

# Model
flags.DEFINE_enum("embedding_type", "custom_cuda", ["joint", "multi_table", "joint_fused", *nvidia_flags.EMBEDDINGS],
                  "joint: one table for all features with offsets; multi_table: one table per feature; "
                  "joint_fused: joint, with a fused gather and an in-place update kernel, SGD or row-wise Adagrad "
                  "(no sparse gradient; needed by --cuda_graphs). NVIDIA's names: custom_cuda (the default), the "
                  "fastest that supports the run: joint_fused on CUDA when the optimizers allow it, else joint; "
                  "joint_sparse: joint.")
flags.DEFINE_enum("embedding_dtype", "fp32", ["fp32", "fp16", "bf16"],
                  "How the embedding tables are stored. fp16/bf16 take half the memory of fp32 (the planner counts "
                  "2 bytes a value); their updates are computed in fp32 and rounded once per row. With "
                  "--optimizer sgd or rowwise_adagrad.")
flags.DEFINE_boolean("stochastic_rounding", True,
                     "bf16 tables: round each updated row stochastically (unbiased, so updates smaller than bf16's "
                     "spacing still move the weights on average); --nostochastic_rounding rounds to nearest. fp16 "
                     "tables always round to nearest.")
flags.DEFINE_integer("embedding_dim", 128, "Embedding dimension (the bottom MLP's last size must equal it for dot).")
flags.DEFINE_list("top_mlp_sizes", ["1024", "1024", "512", "256", "1"], "Top MLP layer sizes; the last must be 1.")
flags.DEFINE_list("bottom_mlp_sizes", ["512", "256", "128"], "Bottom MLP layer sizes.")
flags.DEFINE_enum("interaction_op", "auto", ["auto", "cuda_dot", "dot", "cat", "dcn"],
                  "Feature interaction: pairwise dot products (cuda_dot: the fused Triton kernel, falling back to dot "
                  "where it cannot run), concatenation, or dcn: DCNv2 low-rank cross layers over the concatenation "
                  "(MLPerf DLRMv2). auto: cuda_dot on CUDA, dot elsewhere.")
flags.DEFINE_integer("dcn_num_layers", 3, "Cross layers of --interaction_op dcn.")
flags.DEFINE_integer("dcn_low_rank_dim", 512, "Rank of each cross layer of --interaction_op dcn (MLPerf DLRMv2: 512).")
flags.DEFINE_boolean("cuda_graphs", False,
                     "Capture the training step and the test forward as CUDA graphs (CUDA, one process, "
                     "--embedding_type joint_fused).")

# Data
flags.DEFINE_string("dataset", None, "Split-binary dataset directory. Without it, trains on synthetic data.")
flags.DEFINE_string("feature_spec", "feature_spec.yaml", "Feature spec file name inside --dataset (or an absolute path).")
flags.DEFINE_enum("dataset_type", None, list(SPLIT_BINARY_TYPES + SYNTHETIC_TYPES),
                  "split_binary (NVIDIA: parametric) or synthetic (NVIDIA: synthetic_gpu; generated in device memory). "
                  "Default: split_binary with --dataset, synthetic without.")
flags.DEFINE_boolean("shuffle_batch_order", False, "Read training batches in a seeded random order each epoch.",
                     short_name="shuffle")
flags.DEFINE_integer("max_table_size", None, "Cap every table at this many rows (needs --hash_indices).")
flags.DEFINE_boolean("hash_indices", False, "Map ids with id % table_size instead of refusing out-of-range ids.")
flags.DEFINE_integer("synthetic_dataset_num_entries", 1 << 20, "Training samples per epoch of synthetic data.")
flags.DEFINE_integer("synthetic_dataset_num_test_entries", 1 << 18, "Test samples of synthetic data.")
flags.DEFINE_list("synthetic_dataset_table_sizes", [str(10**5)] * 26, "Table sizes of synthetic data.")
flags.DEFINE_integer("synthetic_dataset_numerical_features", 13, "Numerical features of synthetic data.")
flags.DEFINE_list("synthetic_multi_hot_sizes", [],
                  "Multi-hot synthetic data: ids per sample of each table (comma-separated, one per table), or "
                  "'mlperf' for MLPerf DLRMv2's sizes. Empty: one id per feature.")
flags.DEFINE_enum("synthetic_pooling", "sum", ["sum", "mean"], "How the model pools each synthetic bag.")
flags.DEFINE_enum("preset", "none", ["none", "mlperf_dlrmv2"],
                  "mlperf_dlrmv2: the MLPerf Training DLRM-DCNv2 shape on synthetic multi-hot data (dim 128, "
                  "bottom 512-256-128, top 1024-1024-512-256-1, DCNv2 3 layers of rank 512, row-wise Adagrad with "
                  "Adagrad for the MLPs at lr 0.005, MLPerf's multi-hot sizes and 40M-capped cardinalities). Flags "
                  "given on the command line win; on a CPU add --max_table_size 100000 --hash_indices.")

# Checkpoints
flags.DEFINE_string("load_checkpoint_path", None,
                    "Checkpoint directory to load. In train mode, as NVIDIA's: its weights, then a fresh run from "
                    "step 0 (optimizer, learning-rate schedule and data order start anew); with --resume the run "
                    "continues exactly where that checkpoint stopped.")
flags.DEFINE_string("save_checkpoint_path", None, "Directory to save the checkpoint to (atomically) at the end.")
flags.DEFINE_integer("checkpoint_freq", None, "Also save every this many steps.")
flags.DEFINE_boolean("resume", False,
                     "Continue a run exactly (weights, optimizer and scaler state, step, data position, RNG): from "
                     "--save_checkpoint_path when it holds a checkpoint, else from --load_checkpoint_path when "
                     "given, else start afresh: one command for the first start and every restart (Spark stage "
                     "retries, torchrun --max_restarts, a requeued job).")
flags.DEFINE_boolean("skip_checkpoint_verify", False,
                     "Load --load_checkpoint_path without comparing its files' checksums with those saved in "
                     "meta.json (sizes, shapes and safe unpickling are still checked). For a damaged checkpoint "
                     "you mean to load anyway.")
flags.DEFINE_boolean("validate_dataset", True,
                     "Before the first step, read every value of every split the run uses and stop with a clear "
                     "error on a bad label, numerical value or id (see docs/training.md for its speed).")

# Output
flags.DEFINE_string("log_path", "./log.json", "JSON-lines log: the flags, periodic metrics and a final summary.")
flags.DEFINE_string("tensorboard_dir", None, "Also write the logged metrics (train/loss, eval/auc, ...) as TensorBoard "
                    "scalars to this directory, to watch with `tensorboard --logdir DIR` (pip extra: tensorboard).")
flags.DEFINE_integer("test_freq", None, "Steps between tests; by default test at the end of each epoch.")
flags.DEFINE_float("test_after", 0, "Do not test before this many epochs are done.")
flags.DEFINE_integer("print_freq", 200, "Steps between progress lines.")
flags.DEFINE_integer("benchmark_warmup_steps", 0,
                     "Steps left out of throughput figures (inference_benchmark uses at least 10 untimed passes).")
flags.DEFINE_float("auc_threshold", None, "Stop training once a test reaches this AUC.")

# Hybrid parallelism (under torchrun)
flags.DEFINE_float("device_memory_gb", None,
                   "Memory per process for embedding tables, in GB. Default: 90% of the GPU's memory, or an equal "
                   "share of 90% of the host's RAM on CPU.")
flags.DEFINE_string("host_tables", "auto",
                    "One-process runs: embedding tables kept in host memory and looked up on the host (their ids go "
                    "to the host and their embeddings come back every step), so that a model whose tables do not all "
                    "fit on the GPU trains on one GPU. auto: the fewest largest tables that let the rest fit, only when "
                    "they do not (GPU runs); none; or comma-separated table indices.")
flags.DEFINE_string("table_placement", "auto",
                    "Where the embedding tables go. auto: whole tables balanced by bytes, a table split row-wise "
                    "across every process only when memory demands it; table_wise: whole tables only; row_wise: every "
                    'table split row-wise; or JSON such as {"0": [0, 3], "1": [1, 2], "row_wise": [4]} (rank -> '
                    "global table indices, the optional row_wise tables split; {\"row_wise\": [4]} alone lets the "
                    "planner place the rest), a saved plan, or a path to a file holding either.")
flags.DEFINE_enum("exchange_dtype", "auto", ["auto", "fp32", "fp16", "bf16"],
                  "What the embedding all-to-all carries. auto: the compute dtype (the --amp dtype with --amp, "
                  "else fp32), half the bytes of fp32 under AMP; fp32 exchanges exactly.")
flags.DEFINE_enum("gradient_sync", "after_backward", list(GRADIENT_SYNC),
                  "How the replicated MLP gradients are summed across processes. after_backward: one all-reduce "
                  "once the backward is done; overlap: buckets of --gradient_bucket_mb all-reduced while the "
                  "backward runs, as DDP does (for GPUs, where NCCL runs beside the compute; on CPU it measured "
                  "no faster). Both give the same sums.")
flags.DEFINE_float("gradient_bucket_mb", 25, "Bucket size for --gradient_sync overlap, in MiB (DDP's default: 25).",
                   lower_bound=0.001)
flags.DEFINE_float("dist_timeout", 300, "Seconds a collective may wait for a peer before every process stops with an error.")

# Inference benchmark
flags.DEFINE_list("inference_benchmark_batch_sizes", ["1", "64", "4096"], "Batch sizes for --mode inference_benchmark.")
flags.DEFINE_integer("inference_benchmark_steps", 200, "Timed forward passes per batch size.")
flags.DEFINE_enum("inference_benchmark_backend", "eager", ["eager", "onnxruntime", "torchscript"],
                  "What --mode inference_benchmark times: the eager model (with --cuda_graphs: its CUDA graphs), or "
                  "the model exported and loaded as a server would (onnxruntime: CPU only; both float32, no --amp).")
flags.DEFINE_integer("inference_benchmark_threads", 0,
                     "CPU threads for --mode inference_benchmark (torch's and ONNX Runtime's intra-op threads); "
                     "0: the libraries' defaults (one per core).", lower_bound=0)


def _ints(values: list[str], flag: str) -> list[int]:
    try:
        return [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{flag} must be a comma-separated list of integers, got {','.join(values)}")


# --preset: flag -> value, applied to every flag the command line does not set.
PRESETS: dict[str, dict[str, Any]] = {
    "mlperf_dlrmv2": {
        "embedding_dim": 128,
        "bottom_mlp_sizes": ["512", "256", "128"],
        "top_mlp_sizes": ["1024", "1024", "512", "256", "1"],
        "interaction_op": "dcn",
        "dcn_num_layers": 3,
        "dcn_low_rank_dim": 512,
        "optimizer": "rowwise_adagrad",
        "dense_optimizer": "adagrad",
        "lr": 0.005,
        "warmup_steps": 0,
        "decay_steps": 0,
        "synthetic_dataset_table_sizes": [str(n) for n in MLPERF_DLRMV2_CARDINALITIES],
        "synthetic_multi_hot_sizes": ["mlperf"],
        "synthetic_pooling": "sum",
    },
}


def _apply_preset(values: flags.FlagValues = FLAGS) -> None:
    for name, value in PRESETS.get(values.preset, {}).items():
        if not values[name].present:
            values[name].value = value


def _multi_hot_sizes() -> list[int] | None:
    """--synthetic_multi_hot_sizes as a list (None: one-hot)."""
    values = FLAGS.synthetic_multi_hot_sizes
    if not values:
        return None
    if values == ["mlperf"]:
        return list(MLPERF_MULTI_HOT_SIZES)
    sizes = _ints(values, "synthetic_multi_hot_sizes")
    if any(size < 1 for size in sizes):
        raise app.UsageError(f"--synthetic_multi_hot_sizes must be positive, got {','.join(values)}")
    return sizes


def _interaction_op(flag: str, device: torch.device) -> str:
    if flag != "auto":
        return flag
    return "cuda_dot" if device.type == "cuda" else "dot"


def _validate_flags(values: flags.FlagValues = FLAGS) -> None:
    if values.max_table_size is not None and not values.hash_indices:
        raise app.UsageError("--max_table_size needs --hash_indices (ids above the cap must be mapped somewhere)")
    if values.mode == "test" and not values.load_checkpoint_path:
        raise app.UsageError("--mode test evaluates a trained model: pass --load_checkpoint_path")
    if values.resume and not (values.mode == "train" and (values.save_checkpoint_path or values.load_checkpoint_path)):
        raise app.UsageError("--resume continues a training run from a checkpoint: pass --save_checkpoint_path (its "
                             "own, with --checkpoint_freq to lose at most that many steps) or --load_checkpoint_path")
    for name in ("batch_size", "test_batch_size", "epochs", "print_freq", "inference_benchmark_steps", "max_steps",
                 "test_freq", "checkpoint_freq", "max_table_size", "device_memory_gb", "dist_timeout"):
        if values[name].value is not None and not values[name].value > 0:  # "not >": NaN fails too
            raise app.UsageError(f"--{name} must be positive, got {values[name].value}")
    for name in ("lr", "test_after", "decay_end_lr", "benchmark_warmup_steps",
                 "synthetic_dataset_num_entries", "synthetic_dataset_num_test_entries",
                 "synthetic_dataset_numerical_features"):
        if not (values[name].value >= 0 and math.isfinite(values[name].value)):
            raise app.UsageError(f"--{name} must be a finite number >= 0, got {values[name].value}")
    if values.auc_threshold is not None and not 0 < values.auc_threshold <= 1:
        raise app.UsageError(f"--auc_threshold must be in (0, 1], got {values.auc_threshold}")
    for name in ("top_mlp_sizes", "bottom_mlp_sizes", "inference_benchmark_batch_sizes"):
        _ints(values[name].value, name)
    if any(size < 1 for size in _ints(values.synthetic_dataset_table_sizes, "synthetic_dataset_table_sizes")):
        raise app.UsageError("--synthetic_dataset_table_sizes must be positive integers")
    if values.dataset_type in SPLIT_BINARY_TYPES and not values.dataset:
        raise app.UsageError(f"--dataset_type {values.dataset_type} needs --dataset")
    config = _optimizer_config(values)
    try:
        config.validate()
        config.validate_table_dtype(EMBEDDING_DTYPES[values.embedding_dtype])
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if values.embedding_type == "joint_fused":
        try:  # its kernels: sgd or rowwise_adagrad tables, an sgd or adagrad dense part
            config.validate_fused()
        except ValueError as e:
            raise app.UsageError(str(e)) from None
    try:
        _schedule(values)
    except ValueError as e:
        raise app.UsageError(str(e)) from None


def _schedule(values: flags.FlagValues = FLAGS) -> LRSchedule:
    return LRSchedule(values.lr, values.warmup_steps, values.warmup_factor, values.decay_start_step,
                      values.decay_steps, values.decay_power, values.decay_end_lr)


def check_args(args: list[str]) -> flags.FlagValues:
    """Parses ``args`` as this script's flags and validates them as a run does first, without
    running anything, so that a launcher (dlrm.scripts.spark_train) refuses a bad flag before it
    starts workers. Raises ``app.UsageError`` with the message this script would print; returns
    the flags as a run would use them (NVIDIA's mapped onto this script's)."""
    values = flags.FlagValues()  # a copy of this script's flags: the caller's FLAGS stay as they are
    for module in (__name__, nvidia_flags.__name__):
        for flag in FLAGS.get_flags_for_module(module):
            values[flag.name] = copy.deepcopy(flag)
    try:
        values([sys.argv[0], *args])
    except flags.Error as e:
        raise app.UsageError(cli.flags_error_message(e)) from None
    _apply_preset(values)
    nvidia_flags.apply(values)
    _validate_flags(values)
    return values


def _device(env: DistEnv | None) -> torch.device:
    name = FLAGS.base_device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise app.UsageError(f"--base_device {name}: not a device; use cuda, cuda:N or cpu") from None
    if device.type not in ("cuda", "cpu"):
        raise app.UsageError(f"--base_device {name}: this program runs on cuda or cpu")
    if env is not None and device.type == "cuda":
        device = torch.device("cuda", env.local_rank)  # one GPU per process
    if device.type == "cuda" and not torch.cuda.is_available():
        raise app.UsageError(f"--base_device {name}: CUDA is not available on this machine; use --base_device cpu")
    if device.type == "cuda" and device.index is None:  # torch.cuda.set_device needs an index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _our_flags() -> dict:
    return {
        name: FLAGS[name].value
        for name in FLAGS
        if FLAGS[name].name == name and not FLAGS.find_module_defining_flag(name, default="").startswith("absl")
    }


def _exit_now(code: int) -> None:
    """Ends a finished distributed process without interpreter finalization.

    Everything is written, flushed and the process group destroyed by now. gloo's C++ threads can
    still abort the process ("terminate called without an active exception") while the
    interpreter tears down, turning a successful run into a failed job. So leave directly."""
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _rank_prefix() -> str:
    env = dist_env()
    return f"rank {env.rank}: " if env is not None else ""


def main(argv: list[str]) -> int:
    env = dist_env()
    try:
        code = _main(argv, env)
    except (app.UsageError, DatasetError, CheckpointError, PlanError, StorageError, LogOpenError):
        raise  # bad input or a refused write: cli.run prints one line naming what and how to fix, and exits 2
    except Exception as e:
        if env is not None:  # say which process failed; the launcher stops the others
            print(f"{_rank_prefix()}failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise
    if env is not None:
        _exit_now(code)
    return code


def _optimizer_config(values: flags.FlagValues = FLAGS) -> OptimizerConfig:
    return OptimizerConfig(embedding=values.optimizer, dense=values.dense_optimizer, eps=values.optimizer_eps,
                           stochastic_rounding=values.stochastic_rounding, freeze_dense=values.freeze_mlps,
                           freeze_embeddings=values.freeze_embeddings)


def _capacity(device: torch.device, local_world_size: int) -> int:
    if FLAGS.device_memory_gb is not None:
        return int(FLAGS.device_memory_gb * 2**30)
    return int(0.9 * device_memory_bytes(device, local_world_size))


def _state_bytes(model_cfg: DLRMConfig) -> int:
    return _optimizer_config().state_bytes_per_row(model_cfg.embedding_dim) if FLAGS.mode == "train" else 0


def _bytes_per_value(model_cfg: DLRMConfig) -> int:
    return EMBEDDING_DTYPES[model_cfg.embedding_dtype].itemsize


def _host_tables() -> str | list[int]:
    if FLAGS.host_tables in ("auto", "none"):
        return FLAGS.host_tables
    return _ints(FLAGS.host_tables.split(","), "host_tables")


def _plan_one_device(model_cfg: DLRMConfig, device: torch.device, logger: RunLogger) -> list[int]:
    """Every table on this device, or the largest in host memory when they do not all fit there
    (--host_tables): print the bytes, and stop with the numbers (not an out-of-memory crash
    half-way through building the model) when they do not fit. Returns the host tables."""
    host_tables = _host_tables()
    if device.type != "cuda" and host_tables == "auto":
        host_tables = "none"  # on the CPU the host's memory is the device's: nothing to gain
    plan = plan_tables(model_cfg.table_sizes, model_cfg.embedding_dim, 1, _capacity(device, 1),
                       state_bytes_per_row=_state_bytes(model_cfg), bytes_per_value=_bytes_per_value(model_cfg),
                       host_tables=host_tables, host_capacity=int(0.9 * device_memory_bytes(torch.device("cpu"), 1)))
    logger.print(format_plan(plan))
    if plan.host:
        logger.record("plan", **plan.to_json(), bytes=[plan.rank_bytes(0)], host_bytes=plan.host_bytes())
    return plan.host


def _plan(model_cfg: DLRMConfig, env: DistEnv, device: torch.device, logger: RunLogger) -> list[list[int | TableShard]]:
    """Tables (or row blocks of tables) per rank: the memory-balancing planner, as --table_placement says."""
    placement = load_placement(FLAGS.table_placement)
    plan = plan_tables(model_cfg.table_sizes, model_cfg.embedding_dim, env.world_size,
                       _capacity(device, env.local_world_size), override=placement.tables,
                       row_wise=placement.row_wise, host_tables=_host_tables(), state_bytes_per_row=_state_bytes(model_cfg),
                       bytes_per_value=_bytes_per_value(model_cfg))
    logger.print(format_plan(plan))
    logger.record("plan", **plan.to_json(), bytes=[plan.rank_bytes(r) for r in range(env.world_size)])
    return [plan.entries(rank) for rank in range(env.world_size)]


def _validate(collectives: Collectives, *sources: object) -> None:
    """Reads every value the run will read before the first step (``--validate_dataset``). Each
    process checks the columns it reads; all stop together if any finds bad data, rather than
    the others waiting for it in the first exchange until --dist_timeout."""
    error = None
    try:
        for source in sources:
            if FLAGS.validate_dataset and hasattr(source, "validate"):
                source.validate()
    except DatasetError as e:
        error = e
    if collectives.any(error is not None):
        raise error or DatasetError("another process found bad data in the dataset: its error says where")


@dataclass
class _Run:
    """What every mode works with: built once from the flags by ``_build``."""

    device: torch.device
    precision: Precision
    collectives: Collectives
    data_cfg: DataConfig
    spec: FeatureSpec
    model: DLRM
    source: Callable[[str, int], Any]  # (split, batch size) -> this process's source of the split, or None
    logger: RunLogger

    def load(self, *args: Any, path: str | None = None, **kwargs: Any) -> Any:
        return load_checkpoint(path or FLAGS.load_checkpoint_path, self.model, *args,
                               verify=not FLAGS.skip_checkpoint_verify, **kwargs)


def _config(device: torch.device) -> tuple[DataConfig, FeatureSpec, DLRMConfig]:
    """The data and the model the flags describe (nothing built, nothing read but the spec)."""
    dataset_type = FLAGS.dataset_type or ("split_binary" if FLAGS.dataset else "synthetic")
    data_cfg = DataConfig(
        dataset=FLAGS.dataset,
        feature_spec=FLAGS.feature_spec,
        dataset_type=dataset_type,
        hash_indices=FLAGS.hash_indices,
        synthetic_num_entries=FLAGS.synthetic_dataset_num_entries,
        synthetic_num_test_entries=FLAGS.synthetic_dataset_num_test_entries,
        synthetic_table_sizes=_ints(FLAGS.synthetic_dataset_table_sizes, "synthetic_dataset_table_sizes"),
        synthetic_num_numerical=FLAGS.synthetic_dataset_numerical_features,
        synthetic_bag_sizes=_multi_hot_sizes(),
        synthetic_pooling=FLAGS.synthetic_pooling,
        seed=FLAGS.seed,
    )
    spec = load_feature_spec(data_cfg)
    if FLAGS.cuda_graphs and spec.multi_hot_features:
        raise app.UsageError(f"--cuda_graphs needs one-hot data: the multi-hot features ({', '.join(spec.multi_hot_features)}) "
                             "hold a different number of ids in every batch, which a captured graph cannot take; "
                             "drop --cuda_graphs")
    model_cfg = DLRMConfig(
        num_numerical_features=spec.num_numerical,
        table_sizes=table_sizes(spec, FLAGS.max_table_size),
        embedding_dim=FLAGS.embedding_dim,
        bottom_mlp_sizes=_ints(FLAGS.bottom_mlp_sizes, "bottom_mlp_sizes"),
        top_mlp_sizes=_ints(FLAGS.top_mlp_sizes, "top_mlp_sizes"),
        interaction_op=_interaction_op(FLAGS.interaction_op, device),
        dcn_num_layers=FLAGS.dcn_num_layers,
        dcn_low_rank_dim=FLAGS.dcn_low_rank_dim,
        embedding_type=FLAGS.embedding_type,
        hash_indices=FLAGS.hash_indices,
        poolings=[pooling or "sum" for pooling in spec.poolings],  # one-hot: a bag of one, either pooling
        embedding_dtype=FLAGS.embedding_dtype,
    )
    try:
        model_cfg.validate()
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    return data_cfg, spec, model_cfg


def _build(env: DistEnv | None, device: torch.device, collectives: Collectives, logger: RunLogger) -> _Run:
    """Precision, data and the model (placed by the planner in a multi-process run)."""
    try:
        precision = Precision.parse(FLAGS.amp, FLAGS.amp_dtype, device)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    data_cfg, spec, model_cfg = _config(device)
    logger.record("flags", **_our_flags())
    if env is None:
        host_tables = _plan_one_device(model_cfg, device, logger)
        model = DLRM(model_cfg, device=device, host_tables=host_tables)
        source = lambda split, batch_size: make_source(data_cfg, spec, split, batch_size, device)  # noqa: E731
    else:
        exchange_dtype = {"auto": None, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        model, parallel = parallelize(model_cfg, _plan(model_cfg, env, device, logger), device, collectives,
                                      exchange_dtype[FLAGS.exchange_dtype])
        source = lambda split, batch_size: make_rank_source(  # noqa: E731
            data_cfg, spec, split, batch_size, device, parallel.tables, parallel.rank, parallel.world_size)
    n_params = sum(p.numel() for p in model.parameters())
    held = "" if env is None else f" on rank 0 of {env.world_size}"
    note = f" ({precision.note}{'; --amp_dtype bfloat16 forces bf16' if precision.dtype is None else ''})" \
        if precision.note else ""
    logger.print(f"DLRM: {len(model_cfg.table_sizes)} tables, {n_params:,} parameters{held}, device {device}, "
                 f"precision {precision}{note}, data {data_cfg.dataset_type}{' ' + FLAGS.dataset if FLAGS.dataset else ''}")
    if FLAGS.cuda_graphs:  # before any data is read; the training step checks again as a library guard
        try:
            check_cuda_graphs_supported(model, device, collectives.world_size, training=FLAGS.mode == "train")
        except ValueError as e:
            raise app.UsageError(str(e)) from None
    return _Run(device, precision, collectives, data_cfg, spec, model, source, logger)


def _run_train(run: _Run) -> int:
    """Trains (from --load_checkpoint_path's weights, or continuing a run with --resume); returns
    the exit code: 0, or 128 + the signal that stopped the run after its checkpoint was saved."""
    optimizer = make_optimizer(run.model, FLAGS.lr, _optimizer_config())
    scaler = run.precision.grad_scaler(process_group=run.collectives.process_group)
    train_cfg = TrainConfig(
        schedule=_schedule(),  # checked by _validate_flags
        epochs=FLAGS.epochs, max_steps=FLAGS.max_steps, test_freq=FLAGS.test_freq,
        test_after=FLAGS.test_after, print_freq=FLAGS.print_freq,
        benchmark_warmup_steps=FLAGS.benchmark_warmup_steps, auc_threshold=FLAGS.auc_threshold,
        shuffle_batch_order=FLAGS.shuffle_batch_order, seed=FLAGS.seed,
        save_checkpoint_path=FLAGS.save_checkpoint_path, checkpoint_freq=FLAGS.checkpoint_freq,
        cuda_graphs=FLAGS.cuda_graphs, auc_device=nvidia_flags.auc_device(),
    )
    saves = FLAGS.save_checkpoint_path and run.collectives.rank == 0  # the first process renames into place
    with CheckpointLock(FLAGS.save_checkpoint_path) if saves else contextlib.nullcontext():
        state = None
        own = latest_checkpoint(FLAGS.save_checkpoint_path) if FLAGS.resume and FLAGS.save_checkpoint_path else None
        resume_from = own or (FLAGS.load_checkpoint_path if FLAGS.resume else None)
        if resume_from:
            state = run.load(optimizer, scaler, restore_rng=True, path=resume_from)
            run.logger.print(f"Resuming from {resume_from} at step {state.step}")
        elif FLAGS.load_checkpoint_path:  # NVIDIA's meaning: the weights, then a fresh run
            run.load()
            run.logger.print(f"Weights from {FLAGS.load_checkpoint_path}; training starts at step 0 (--resume "
                             "would continue that run)")
        train_source = run.source("train", FLAGS.batch_size)
        test_source = run.source("test", FLAGS.test_batch_size)
        _validate(run.collectives, train_source, test_source)
        stop = StopOnSignals()
        try:
            summary = train(run.model, optimizer, scaler, run.precision, train_source, test_source, train_cfg,
                            run.device, run.logger, state=state, run_config=_our_flags(),
                            should_stop=stop.event.is_set, collectives=run.collectives)
        finally:
            stop.over()
    return stop.exit_code_of(summary["stop_reason"])


def _run_test(run: _Run) -> int:
    """AUC and loss of --load_checkpoint_path on the test split."""
    run.load()
    test_source = run.source("test", FLAGS.test_batch_size)
    if test_source is None:
        raise app.UsageError(f"the dataset at {FLAGS.dataset} has no test split")
    _validate(run.collectives, test_source)
    forward = GraphedInference(run.model, run.precision) if FLAGS.cuda_graphs else None
    result = evaluate(run.model, test_source, run.device, run.precision, collectives=run.collectives, forward=forward,
                      auc_device=nvidia_flags.auc_device())
    run.logger.print(f"Test: auc {result.auc:.6f}  loss {result.loss:.6f}  samples {result.samples}  "
                     f"throughput {result.throughput:,.0f} samples/s")
    run.logger.record("summary", auc=result.auc, loss=result.loss, samples=result.samples,
                      average_test_throughput=result.throughput)
    return 0


def _run_inference_benchmark(run: _Run) -> int:
    """Latency and throughput per batch size, of the eager model, its CUDA graphs or an export."""
    if FLAGS.load_checkpoint_path:
        run.load()
    batch_sizes = _ints(FLAGS.inference_benchmark_batch_sizes, "inference_benchmark_batch_sizes")
    split = "test" if run.data_cfg.synthetic or "test" in run.spec.splits else "train"
    available = make_source(run.data_cfg, run.spec, split, 1, run.device).num_samples
    for batch_size in batch_sizes:
        if not 0 < batch_size <= available:
            raise app.UsageError(
                f"--inference_benchmark_batch_sizes: {batch_size} is not between 1 and the {available} "
                f"samples of the {split} split; choose batch sizes in that range")

    def batches_for(batch_size: int) -> list:
        source = make_source(run.data_cfg, run.spec, split, batch_size, run.device)
        full = [i for i in range(len(source)) if i < len(source) - 1 or source.num_samples % batch_size == 0]
        return [source.read_batch(i) for i in full[:8]]

    backend = FLAGS.inference_benchmark_backend
    if backend != "eager" and (FLAGS.amp or FLAGS.cuda_graphs):
        raise app.UsageError(f"--inference_benchmark_backend {backend} runs the exported float32 graph: "
                             "drop --amp and --cuda_graphs")
    if FLAGS.inference_benchmark_threads:
        torch.set_num_threads(FLAGS.inference_benchmark_threads)
    with tempfile.TemporaryDirectory(prefix="dlrm-benchmark-") as export_dir:
        if backend != "eager":
            try:
                forward = exported_forward(run.model, backend, export_dir, run.device, FLAGS.inference_benchmark_threads)
            except ValueError as e:
                raise app.UsageError(str(e)) from None
        elif FLAGS.cuda_graphs:
            forward, backend = GraphedInference(run.model, run.precision), "cuda_graphs"
        else:
            forward = None
        results = benchmark_inference(
            run.model, batches_for, batch_sizes, FLAGS.inference_benchmark_steps,
            max(FLAGS.benchmark_warmup_steps, 10), run.device, run.precision, forward=forward, backend=backend,
        )
    threads = torch.get_num_threads()
    run.logger.print(f"Inference benchmark ({run.precision}, device {run.device}, CPU threads {threads}):\n"
                     f"{format_table(results)}")
    for r in results:
        run.logger.record("inference_benchmark", precision=str(run.precision), device=str(run.device),
                          threads=threads, **r.as_dict())
    run.logger.record("summary", inference=[r.as_dict() for r in results])
    return 0


def _run_plan(device: torch.device) -> int:
    """--mode plan: per-process memory for 1, 2, 4, ... processes and the fewest that fit."""
    if FLAGS.device_memory_gb is None and device.type != "cuda":
        raise app.UsageError("--mode plan sizes for the devices the run will use: pass --device_memory_gb "
                             "(e.g. 80 for an H100)")
    _, _, model_cfg = _config(device)
    device_bytes = int(FLAGS.device_memory_gb * 2**30) if FLAGS.device_memory_gb else device_memory_bytes(device, 1)
    optimizer = _optimizer_config()
    common = dict(state_bytes_per_row=optimizer.state_bytes_per_row(model_cfg.embedding_dim),
                  bytes_per_value=_bytes_per_value(model_cfg), dense_state_bytes=optimizer.dense_state_bytes(),
                  compute_bytes=2 if FLAGS.amp else 4)
    counts = list(range(1, FLAGS.plan_max_processes + 1))
    sizings = size_processes(model_cfg, FLAGS.batch_size, device_bytes, counts, **common)
    fits = [s for s in sizings if s.plan is not None]
    shown = [s for s in sizings if s.processes & (s.processes - 1) == 0 or (fits and s is fits[0])]
    print(f"DLRM: {len(model_cfg.table_sizes)} tables, {sum(model_cfg.table_sizes):,} rows, dim "
          f"{model_cfg.embedding_dim}, batch {FLAGS.batch_size}, {optimizer.embedding} tables, "
          f"{'AMP' if FLAGS.amp else 'fp32'} compute")
    print(format_sizing(shown, device_bytes))
    if not fits:
        print(f"No number of processes up to {FLAGS.plan_max_processes} fits: raise --plan_max_processes, lower "
              "--batch_size, or use --embedding_dtype bf16")
        return 1
    best = fits[0]
    print(f"\nFewest processes: {best.processes}. Their placement:\n{format_plan(best.plan)}")
    print(f"\nOn Spark: python -m dlrm.scripts.spark_train --num_processes {best.processes} --use_gpu "
          f"--spark_conf spark.task.resource.gpu.amount=1 -- <these flags>: {best.processes} task"
          f"{'s' if best.processes > 1 else ''} of one GPU "
          "(spark.executor.resource.gpu.amount = GPUs per executor, spark.executor.cores at least that many)")
    return 0


MODES = {"train": _run_train, "test": _run_test, "inference_benchmark": _run_inference_benchmark}


def _main(argv: list[str], env: DistEnv | None) -> int:
    """Flags -> device and process group -> model and data -> the mode's run."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    _apply_preset()
    notes = nvidia_flags.apply()
    _validate_flags()
    device = _device(env)
    if FLAGS.mode == "plan":
        if env is not None:
            raise app.UsageError("--mode plan sizes a run without running it: start it without torchrun")
        return _run_plan(device)
    collectives = Collectives()
    if env is not None:
        if FLAGS.mode == "inference_benchmark":
            raise app.UsageError("--mode inference_benchmark runs on one process: start it without torchrun")
        init_process_group(env, device, FLAGS.dist_timeout)
        collectives = process_group_collectives(device, gradient_sync=FLAGS.gradient_sync,
                                                bucket_bytes=int(FLAGS.gradient_bucket_mb * 2**20))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = FLAGS.allow_tf32
        torch.backends.cudnn.allow_tf32 = FLAGS.allow_tf32
    torch.manual_seed(FLAGS.seed)
    logger = RunLogger(FLAGS.log_path, enabled=collectives.rank == 0, tensorboard_dir=FLAGS.tensorboard_dir)
    with logger:
        for note in notes:
            logger.print(note)
        exit_code = MODES[FLAGS.mode](_build(env, device, collectives, logger))
    if env is not None:
        torch.distributed.barrier()  # tear down together: gloo aborts if peers vanish mid-teardown
        torch.distributed.destroy_process_group()
    return exit_code


def run() -> None:
    cli.run(main, prefix=_rank_prefix)


if __name__ == "__main__":
    run()
