"""The flags of ``dlrm.scripts.main`` and their mapping onto a ``RunConfig`` (dlrm.training.run_config).

Flags follow NVIDIA's DLRM example where a flag of the same name exists there; those this
program adds for the rest of NVIDIA's flags are in dlrm.scripts.nvidia_flags. ``run_config``
reads the flags once, after ``--preset`` and NVIDIA's flags are applied, into the typed config
that checks itself; its errors name the flags (``cli.flag_terms``).
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from absl import app, flags

from dlrm.data.sources import SPLIT_BINARY_TYPES, SYNTHETIC_TYPES, DataConfig
from dlrm.data.synthetic import MLPERF_DLRMV2_CARDINALITIES, MLPERF_MULTI_HOT_SIZES, ZIPF_EXPONENT
from dlrm.engine.collectives import GRADIENT_SYNC
from dlrm.scripts import cli, nvidia_flags, serving_flags
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.optimizers import DENSE_OPTIMIZERS, EMBEDDING_OPTIMIZERS, OptimizerConfig
from dlrm.training.run_config import (
    CheckpointConfig, InferenceBenchmarkConfig, ModelSettings, OutputConfig, ParallelConfig, RunConfig, ServingConfig,
)
from dlrm.training.train import TrainConfig

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
flags.DEFINE_float("lr", 24.0, "Base learning rate (embeddings and MLPs). Too high, and the loss diverges: a run "
                   "whose training loss turns non-finite (nan, inf) stops with exit code 3 and one line naming the "
                   "step and the flags to change, keeping its last finite checkpoint.")
flags.DEFINE_enum("optimizer", "sgd", list(EMBEDDING_OPTIMIZERS),
                  "Optimizer of the embedding tables: sgd, adagrad (an accumulator per weight), rowwise_adagrad "
                  "(one per row, as FBGEMM/TorchRec/MLPerf DLRMv2) or adam (torch SparseAdam's lazy rule). Each "
                  "updates only the rows a batch used.")
flags.DEFINE_enum("dense_optimizer", None, list(DENSE_OPTIMIZERS),
                  "Optimizer of the MLPs (and interaction weights). Default: sgd with --optimizer sgd, adagrad with "
                  "adagrad or rowwise_adagrad, adam with adam.")
flags.DEFINE_float("optimizer_eps", 1e-8, "Epsilon of Adagrad, row-wise Adagrad and Adam.")
flags.DEFINE_float("initial_accumulator_value", 0.0,
                   "Starting value of every Adagrad and row-wise Adagrad accumulator (torch.optim.Adagrad's and "
                   "TorchRec's name; 0 as theirs). A positive value damps the first updates of each row.")
flags.DEFINE_integer("epochs", 1, "Number of epochs.")
flags.DEFINE_integer("max_steps", None, "Stop after this many optimizer steps.")
flags.DEFINE_integer("prefetch", 2, "Batches read and copied to the device ahead of the step, on a background "
                     "thread (training and tests).")

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
                     "--embedding_type joint_fused). On a CPU the run proceeds without them (a header note).")

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
flags.DEFINE_boolean("allow_files_outside_dataset", False,
                     "Read files the feature spec names outside the --dataset folder (absolute paths, '..', links "
                     "leading out). Off: such a spec is refused before anything is read (docs/data_format.md).")
flags.DEFINE_integer("synthetic_dataset_num_entries", 1 << 20, "Training samples per epoch of synthetic data.")
flags.DEFINE_integer("synthetic_dataset_num_test_entries", 1 << 18, "Test samples of synthetic data.")
flags.DEFINE_list("synthetic_dataset_table_sizes", [str(10**5)] * 26, "Table sizes of synthetic data.")
flags.DEFINE_integer("synthetic_dataset_numerical_features", 13, "Numerical features of synthetic data.")
flags.DEFINE_list("synthetic_multi_hot_sizes", [],
                  "Multi-hot synthetic data: ids per sample of each table (comma-separated, one per table), or "
                  "'mlperf' for MLPerf DLRMv2's sizes. Empty: one id per feature.")
flags.DEFINE_enum("synthetic_pooling", "sum", ["sum", "mean"], "How the model pools each synthetic bag.")
flags.DEFINE_float("synthetic_zipf_exponent", ZIPF_EXPONENT,
                   "Skew of the synthetic ids: id i of every table is drawn with probability ~ (i + 1) ** -exponent "
                   "(1.2: a few rows take most lookups, as in Criteo's tables; 1.1: flatter). Must be > 0.")
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
flags.DEFINE_string("save_checkpoint_path", None,
                    "Directory to save the checkpoint to (atomically) at the end: absent or empty, or holding this "
                    "program's checkpoint with --resume (continue it) or --overwrite (start over in its place). "
                    "A folder holding anything else is never replaced. Nothing non-finite is ever saved: a run "
                    "whose loss or weights turn nan or inf stops (exit code 3) with the last finite checkpoint "
                    "kept here.")
flags.DEFINE_integer("checkpoint_freq", None, "Also save every this many steps.")
flags.DEFINE_enum("checkpoint_format", "dlrm", ["dlrm", "nvidia"],
                  "How --save_checkpoint_path is laid out. dlrm: this program's (weights, optimizer state, step and "
                  "data position: --resume continues it). nvidia: NVIDIA's DLRM example's (metadata.pt, "
                  "bottom_model.mlp.pt, top_model.*.pt, one bottom_model.embeddings.<i>.bin per table), which "
                  "NVIDIA's main.py loads with --load_checkpoint_path on one GPU (for N GPUs: dlrm.scripts.convert_checkpoint "
                  "--nvidia_gpus N); weights only. --load_checkpoint_path reads either layout.")
flags.DEFINE_boolean("resume", False,
                     "Continue a run exactly (weights, optimizer and scaler state, step, data position, RNG): from "
                     "--save_checkpoint_path when it holds a checkpoint, else from --load_checkpoint_path when "
                     "given, else start afresh: one command for the first start and every restart (Spark stage "
                     "retries, torchrun --max_restarts, a requeued job).")
flags.DEFINE_boolean("overwrite", False,
                     "Start a new run and replace the checkpoint already at --save_checkpoint_path (without it, or "
                     "--resume, a run refuses to replace one).")
flags.DEFINE_boolean("skip_checkpoint_verify", False,
                     "Load --load_checkpoint_path without comparing its files' checksums with those saved in "
                     "meta.json (sizes, shapes and safe unpickling are still checked). For a damaged checkpoint "
                     "you mean to load anyway.")
flags.DEFINE_boolean("validate_dataset", True,
                     "Before the first step, read every value of every split the run uses and stop with a clear "
                     "error on a bad label, numerical value or id (see docs/training.md for its speed).")

# Output
flags.DEFINE_string("log_path", "./log.json", "JSON-lines log: the flags, periodic metrics and a final summary.")
flags.DEFINE_enum("log_format", "json", ["json", "dllogger"],
                  "Form of --log_path: json (this program's records) or dllogger (the DLLL lines NVIDIA's DLRM "
                  "example writes: PARAMETER, METADATA and the final best_auc, ... record; docs/nvidia_migration.md).")
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


class _CacheRowsParser(flags.ArgumentParser):
    """--host_table_cache_rows: an integer >= 0, or auto."""

    def parse(self, argument: Any) -> int | str:
        if argument == "auto":
            return "auto"
        text = str(argument).strip()
        if isinstance(argument, bool) or not (text.isascii() and text.isdigit()):
            raise ValueError(f"{argument} is not a non-negative integer or auto")
        return int(text)

    def flag_type(self) -> str:
        return "int or auto"


flags.DEFINE(_CacheRowsParser(), "host_table_cache_rows", 0,
             "One-process runs with --embedding_type joint_fused: rows of the host tables cached on the device (hot "
             "rows in device memory, misses fetched from the host in one copy per step and the next batch's ahead "
             "of it, LRU eviction, changed rows written back); 0: host tables are looked up on the host. Costs per "
             "row the row and its optimizer state on the device, plus 4 bytes per host row (the slot map). auto: as "
             "many rows as fit in the device memory left after the device tables, the MLPs with their optimizer "
             "state and a batch's activations (--device_memory_gb, else 90% of the GPU's; on a CPU run the same "
             "budget of host RAM), at most every host row; the run log shows the arithmetic.")
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


flags.adopt_module_key_flags(serving_flags)  # --quantize_tables, --quantize_min_rows


def _ints(values: list[str], flag: str) -> list[int]:
    try:
        return [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{flag} must be a comma-separated list of integers, got {','.join(values)}") from None


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


def apply_preset(values: flags.FlagValues = FLAGS) -> None:
    for name, value in PRESETS.get(values.preset, {}).items():
        if not values[name].present:
            values[name].value = value


def _multi_hot_sizes(values: flags.FlagValues) -> list[int] | None:
    """--synthetic_multi_hot_sizes as a list (None: one-hot)."""
    if not values.synthetic_multi_hot_sizes:
        return None
    if values.synthetic_multi_hot_sizes == ["mlperf"]:
        return list(MLPERF_MULTI_HOT_SIZES)
    return _ints(values.synthetic_multi_hot_sizes, "synthetic_multi_hot_sizes")


def _host_tables(values: flags.FlagValues) -> str | list[int]:
    if values.host_tables in ("auto", "none"):
        return values.host_tables
    return _ints(values.host_tables.split(","), "host_tables")


def optimizer_config(values: flags.FlagValues = FLAGS) -> OptimizerConfig:
    return OptimizerConfig(embedding=values.optimizer, dense=values.dense_optimizer, eps=values.optimizer_eps,
                           initial_accumulator_value=values.initial_accumulator_value,
                           stochastic_rounding=values.stochastic_rounding, freeze_dense=values.freeze_mlps,
                           freeze_embeddings=values.freeze_embeddings)


def _run_config(v: flags.FlagValues) -> RunConfig:
    data = DataConfig(
        dataset=v.dataset, feature_spec=v.feature_spec,
        dataset_type=v.dataset_type or ("split_binary" if v.dataset else "synthetic"), hash_indices=v.hash_indices,
        allow_files_outside_dataset=v.allow_files_outside_dataset,
        synthetic_num_entries=v.synthetic_dataset_num_entries,
        synthetic_num_test_entries=v.synthetic_dataset_num_test_entries,
        synthetic_table_sizes=_ints(v.synthetic_dataset_table_sizes, "synthetic_dataset_table_sizes"),
        synthetic_num_numerical=v.synthetic_dataset_numerical_features, synthetic_bag_sizes=_multi_hot_sizes(v),
        synthetic_pooling=v.synthetic_pooling, synthetic_zipf_exponent=v.synthetic_zipf_exponent,
    )
    model = ModelSettings(
        embedding_dim=v.embedding_dim, bottom_mlp_sizes=_ints(v.bottom_mlp_sizes, "bottom_mlp_sizes"),
        top_mlp_sizes=_ints(v.top_mlp_sizes, "top_mlp_sizes"), interaction_op=v.interaction_op,
        dcn_num_layers=v.dcn_num_layers, dcn_low_rank_dim=v.dcn_low_rank_dim, embedding_type=v.embedding_type,
        embedding_dtype=v.embedding_dtype, max_table_size=v.max_table_size,
    )
    schedule = LRSchedule(v.lr, v.warmup_steps, v.warmup_factor, v.decay_start_step, v.decay_steps, v.decay_power,
                          v.decay_end_lr)
    train = TrainConfig(
        schedule=schedule, epochs=v.epochs, max_steps=v.max_steps, eval_every_steps=v.test_freq,
        test_after=v.test_after, log_every_steps=v.print_freq, benchmark_warmup_steps=v.benchmark_warmup_steps,
        auc_threshold=v.auc_threshold, shuffle_batch_order=v.shuffle_batch_order,
        save_checkpoint_path=v.save_checkpoint_path, checkpoint_every_steps=v.checkpoint_freq, prefetch=v.prefetch,
        cuda_graphs=v.cuda_graphs,
        auc_device=nvidia_flags.auc_device(v),
        checkpoint_format=v.checkpoint_format,
    )
    parallel = ParallelConfig(
        device_memory_gb=v.device_memory_gb, host_tables=_host_tables(v), table_placement=v.table_placement,
        exchange_dtype=v.exchange_dtype, gradient_sync=v.gradient_sync, gradient_bucket_mb=v.gradient_bucket_mb,
        dist_timeout=v.dist_timeout, host_table_cache_rows=v.host_table_cache_rows,
    )
    checkpoint = CheckpointConfig(load_checkpoint_path=v.load_checkpoint_path, resume=v.resume,
                                  overwrite=v.overwrite, verify=not v.skip_checkpoint_verify)
    output = OutputConfig(log_path=v.log_path or None, log_format=v.log_format, tensorboard_dir=v.tensorboard_dir)
    benchmark = InferenceBenchmarkConfig(
        inference_benchmark_batch_sizes=_ints(v.inference_benchmark_batch_sizes, "inference_benchmark_batch_sizes"),
        inference_benchmark_steps=v.inference_benchmark_steps,
        inference_benchmark_backend=v.inference_benchmark_backend,
        inference_benchmark_threads=v.inference_benchmark_threads,
    )
    serving = ServingConfig(quantize_tables=serving_flags.quantize_tables(v, mode=v.mode),
                            quantize_min_rows=v.quantize_min_rows)
    return RunConfig(mode=v.mode, seed=v.seed, base_device=v.base_device, amp=v.amp, amp_dtype=v.amp_dtype,
                     allow_tf32=v.allow_tf32, batch_size=v.batch_size, test_batch_size=v.test_batch_size,
                     validate_dataset=v.validate_dataset, data=data, model=model, optimizer=optimizer_config(v),
                     train=train, checkpoint=checkpoint, parallel=parallel, output=output, benchmark=benchmark,
                     serving=serving, plan_max_processes=v.plan_max_processes)


def run_config(values: flags.FlagValues = FLAGS) -> RunConfig:
    """The run the flags describe, checked (``RunConfig``: every flag of ``dlrm.scripts.main`` is
    in it, but for those that change nothing here, ``nvidia_flags``' notes); ``app.UsageError``
    naming the flags. Call after ``apply_preset`` and ``nvidia_flags.apply``."""
    try:
        return _run_config(values)
    except ValueError as e:
        raise app.UsageError(cli.flag_terms(str(e), values)) from None


def parse_args(args: list[str]) -> flags.FlagValues:
    """``args`` parsed as dlrm.scripts.main's flags, into a copy of them (the caller's FLAGS stay
    as they are); ``app.UsageError`` with the message the script would print."""
    values = flags.FlagValues()
    for module in (__name__, nvidia_flags.__name__, serving_flags.__name__):
        for flag in FLAGS.get_flags_for_module(module):
            values[flag.name] = copy.deepcopy(flag)
    try:
        values([sys.argv[0], *args])
    except flags.Error as e:
        raise app.UsageError(cli.flags_error_message(e)) from None
    return values


def check_args(args: list[str]) -> flags.FlagValues:
    """Parses ``args`` as dlrm.scripts.main's flags and validates them as a run does first, without
    running anything, so that a launcher (dlrm.scripts.spark_train) refuses a bad flag before it
    starts workers. Raises ``app.UsageError`` with the message the script would print; returns
    the flags as a run would use them (NVIDIA's mapped onto this script's)."""
    values = parse_args(args)
    apply_preset(values)
    nvidia_flags.apply(values)
    run_config(values)
    return values


def config_flags(cfg: RunConfig) -> dict[str, Any]:
    """The flags of dlrm.scripts.main that describe ``cfg``: the inverse of ``run_config``, for
    what runs the script from a config (Spark's tasks run it under torchrun). Every setting is
    given, so neither the flags' defaults nor ``--preset`` change the run; None leaves a flag
    unset where unset means None. As ``dlrm.spark.launch.flag_args`` turns them into a command
    line, that line is read back here and must give ``cfg`` again: a setting no flag can say
    raises ``ValueError`` naming it. The devices are not looked at (NVIDIA's flags, which
    resolve ``custom_cuda`` by the device, are not used): the tasks may run on GPUs this
    process does not have."""
    data, model, train, schedule = cfg.data, cfg.model, cfg.train, cfg.train.schedule
    optimizer, parallel, checkpoint, output = cfg.optimizer, cfg.parallel, cfg.checkpoint, cfg.output
    benchmark, serving = cfg.benchmark, cfg.serving
    if train.auc_device not in (None, "cpu"):
        raise ValueError(f"`auc_device` {train.auc_device!r}: dlrm.scripts.main's flags say \"cpu\" (--auc_device CPU) "
                         "or None (where the scores are: the run's device), and nothing else")
    values = {
        "mode": cfg.mode, "seed": cfg.seed, "base_device": cfg.base_device, "amp": cfg.amp,
        "amp_dtype": cfg.amp_dtype, "allow_tf32": cfg.allow_tf32, "batch_size": cfg.batch_size,
        "test_batch_size": cfg.test_batch_size, "validate_dataset": cfg.validate_dataset,
        "plan_max_processes": cfg.plan_max_processes,
        # data
        "dataset": data.dataset, "feature_spec": data.feature_spec, "dataset_type": data.dataset_type,
        "hash_indices": data.hash_indices, "synthetic_dataset_num_entries": data.synthetic_num_entries,
        "allow_files_outside_dataset": data.allow_files_outside_dataset,
        "synthetic_dataset_num_test_entries": data.synthetic_num_test_entries,
        "synthetic_dataset_table_sizes": data.synthetic_table_sizes,
        "synthetic_dataset_numerical_features": data.synthetic_num_numerical,
        "synthetic_multi_hot_sizes": data.synthetic_bag_sizes or [], "synthetic_pooling": data.synthetic_pooling,
        "synthetic_zipf_exponent": data.synthetic_zipf_exponent,
        # model
        "embedding_dim": model.embedding_dim, "bottom_mlp_sizes": model.bottom_mlp_sizes,
        "top_mlp_sizes": model.top_mlp_sizes, "interaction_op": model.interaction_op,
        "dcn_num_layers": model.dcn_num_layers, "dcn_low_rank_dim": model.dcn_low_rank_dim,
        "embedding_type": model.embedding_type, "embedding_dtype": model.embedding_dtype,
        "max_table_size": model.max_table_size,
        # optimizers and schedule
        "optimizer": optimizer.embedding, "dense_optimizer": optimizer.dense, "optimizer_eps": optimizer.eps,
        "initial_accumulator_value": optimizer.initial_accumulator_value,
        "stochastic_rounding": optimizer.stochastic_rounding, "freeze_mlps": optimizer.freeze_dense,
        "freeze_embeddings": optimizer.freeze_embeddings,
        "lr": schedule.lr, "warmup_steps": schedule.warmup_steps, "warmup_factor": schedule.warmup_factor,
        "decay_start_step": schedule.decay_start_step, "decay_steps": schedule.decay_steps,
        "decay_power": schedule.decay_power, "decay_end_lr": schedule.decay_end_lr,
        # the loop
        "epochs": train.epochs, "max_steps": train.max_steps, "test_freq": train.eval_every_steps,
        "test_after": train.test_after, "print_freq": train.log_every_steps,
        "benchmark_warmup_steps": train.benchmark_warmup_steps, "auc_threshold": train.auc_threshold,
        "shuffle_batch_order": train.shuffle_batch_order, "save_checkpoint_path": train.save_checkpoint_path,
        "checkpoint_freq": train.checkpoint_every_steps, "prefetch": train.prefetch,
        "cuda_graphs": train.cuda_graphs, "checkpoint_format": train.checkpoint_format,
        "auc_device": "CPU" if train.auc_device else None,
        # checkpoint, output, parallelism, inference benchmark, serving
        "load_checkpoint_path": checkpoint.load_checkpoint_path, "resume": checkpoint.resume,
        "overwrite": checkpoint.overwrite, "skip_checkpoint_verify": not checkpoint.verify,
        "log_path": output.log_path or "", "log_format": output.log_format,
        "tensorboard_dir": output.tensorboard_dir,
        "device_memory_gb": parallel.device_memory_gb, "host_tables": parallel.host_tables,
        "table_placement": parallel.table_placement, "exchange_dtype": parallel.exchange_dtype,
        "gradient_sync": parallel.gradient_sync, "gradient_bucket_mb": parallel.gradient_bucket_mb,
        "dist_timeout": parallel.dist_timeout, "host_table_cache_rows": parallel.host_table_cache_rows,
        "inference_benchmark_batch_sizes": benchmark.inference_benchmark_batch_sizes,
        "inference_benchmark_steps": benchmark.inference_benchmark_steps,
        "inference_benchmark_backend": benchmark.inference_benchmark_backend,
        "inference_benchmark_threads": benchmark.inference_benchmark_threads,
        "quantize_tables": serving.quantize_tables, "quantize_min_rows": serving.quantize_min_rows,
    }
    _check_round_trip(cfg, values)
    return values


def _check_round_trip(cfg: RunConfig, values: dict[str, Any]) -> None:
    """``ValueError`` naming each setting of ``cfg`` that ``values``' command line does not give back."""
    from dlrm.spark.launch import flag_args  # the command line a launcher runs

    try:
        back = _run_config(parse_args(flag_args(values)))
    except (app.UsageError, ValueError) as e:
        back, error = None, str(e)
    if back == cfg:
        return
    if back is None:
        raise ValueError(f"dlrm.scripts.main's flags cannot say this RunConfig: {error}")
    want, got = cfg.settings(), back.settings()
    differ = [f"`{name}` {want[name]!r}" for name in want if want[name] != got.get(name)]
    raise ValueError(f"dlrm.scripts.main's flags cannot say {', '.join(differ)} (they give "
                     f"{', '.join(repr(got.get(name.split('`')[1])) for name in differ)})")
