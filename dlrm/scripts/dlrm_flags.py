"""The flags of ``dlrm.scripts.main``, generated from ``RunConfig`` (dlrm.training.run_config).

``SETTINGS`` declares each flag once: its name, the config field it sets, its help and its
``--help`` section; type and default come from the field (``dlrm.scripts.flag_table``). The
few flags whose form differs from their field (lists written comma-separated, ``--log_path ""``
for no log, ``--skip_checkpoint_verify`` for ``verify=False``, ``--dataset_type`` defaulted by
``--dataset``, ``--synthetic_multi_hot_sizes mlperf``, ``--host_tables``, ``--quantize_tables``,
``--auc_device``) declare their converters both ways in the same line. From that one table:
the flags are defined, ``run_config`` reads them into the config (after ``--preset`` and
NVIDIA's flags are applied; its errors name the flags, ``cli.flag_terms``), and ``config_args``
writes a config as the command line that reads back as it.

Flags follow NVIDIA's DLRM example where a flag of the same name exists there; NVIDIA's flags
that are no setting of the config (they map onto one, or change nothing here) are in
dlrm.scripts.nvidia_flags, with their alias table.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

from absl import app, flags

from dlrm.data.sources import SPLIT_BINARY_TYPES, SYNTHETIC_TYPES
from dlrm.data.synthetic import MLPERF_DLRMV2_CARDINALITIES, MLPERF_MULTI_HOT_SIZES
from dlrm.engine.collectives import GRADIENT_SYNC
from dlrm.scripts import cli, nvidia_flags, serving_flags
from dlrm.scripts.flag_table import Setting, ints
from dlrm.scripts import flag_table
from dlrm.training.optimizers import DENSE_OPTIMIZERS, EMBEDDING_OPTIMIZERS
from dlrm.training.run_config import (
    AMP_DTYPES, BENCHMARK_BACKENDS, EXCHANGE_DTYPES, LOG_FORMATS, MODES, RunConfig,
)

FLAGS = flags.FLAGS

# --help's sections, in its order.
MODEL, DATA, TRAINING, CHECKPOINTS = "model", "data", "training", "checkpoints"
DISTRIBUTED, SERVING, NVIDIA = "distributed", "serving", "NVIDIA compatibility"
SECTIONS = (MODEL, DATA, TRAINING, CHECKPOINTS, DISTRIBUTED, SERVING, NVIDIA)
# The parts of the config, built in this order (a part's own errors before the whole's).
BUILD_ORDER = ("data", "model", "train.schedule", "train", "parallel", "checkpoint", "output", "benchmark",
               "serving", "optimizer")
DEFAULTS = RunConfig()


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


# The converters of the flags whose form differs from their field: (flag value, all flags) -> field, field -> flag.
def _same(value: Any, values: Any = None) -> Any:
    return value


def _negated(value: bool, values: Any = None) -> bool:
    return not value


def _none_if_empty(value: str, values: flags.FlagValues) -> str | None:
    return value or None


def _empty_if_none(value: str | None) -> str:
    return "" if value is None else value


def _dataset_type(value: str | None, values: flags.FlagValues) -> str:
    """Unset: split_binary with --dataset, synthetic without."""
    return value or ("split_binary" if values.dataset else "synthetic")


def _multi_hot_sizes(value: list[str], values: flags.FlagValues) -> list[int] | None:
    """Empty: one-hot (None); "mlperf": MLPerf DLRMv2's sizes."""
    if not value:
        return None
    if value == ["mlperf"]:
        return list(MLPERF_MULTI_HOT_SIZES)
    return ints(value, "synthetic_multi_hot_sizes")


def _strings_or_empty(value: list[int] | None) -> list[str]:
    return [str(v) for v in value or []]


def _host_tables(value: str, values: flags.FlagValues) -> str | list[int]:
    return value if value in ("auto", "none") else ints(value.split(","), "host_tables")


def _host_tables_flag(value: str | list[int]) -> str:
    return value if isinstance(value, str) else ",".join(map(str, value))


def _quantize_tables(value: list[str], values: flags.FlagValues) -> str | list[str]:
    return serving_flags.quantize_tables(values, mode=values.mode)


def _strings(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


SETTINGS: tuple[Setting, ...] = (
    Setting("mode", "mode", TRAINING,
      "train: train (and test as scheduled); test: evaluate --load_checkpoint_path on the test split; "
      "inference_benchmark: latency and throughput per batch size; plan: the memory per process and the "
      "fewest processes (GPUs, Spark tasks) the model and --batch_size need on devices of "
      "--device_memory_gb, without building the model.", choices=MODES),
    Setting("seed", "seed", TRAINING,
      "Random seed for initialisation, batch order and synthetic data."),
    Setting("base_device", "base_device", TRAINING,
      "Device to run on: cuda, cuda:N or cpu. Default: cuda if available, else cpu."),
    Setting("amp", "amp", TRAINING,
      "Automatic mixed precision through torch.amp (see --amp_dtype). On a CPU it autocasts as --amp_dtype "
      "says, where NVIDIA's main.py turns --amp off."),
    Setting("amp_dtype", "amp_dtype", TRAINING,
      "Autocast dtype with --amp. auto: float16 (with dynamic loss scaling) on CUDA; bfloat16 on a CPU with"
      " bf16 instructions (AVX512-BF16, AMX), float32 on one without, where bf16 is slower (the run header "
      "says so).", choices=AMP_DTYPES),
    Setting("allow_tf32", "allow_tf32", TRAINING,
      "Use TF32 for float32 matmuls on GPUs that have it."),
    Setting("batch_size", "batch_size", TRAINING,
      "Training batch size."),
    Setting("test_batch_size", "test_batch_size", TRAINING,
      "Batch size for testing."),
    Setting("lr", "train.schedule.lr", TRAINING,
      "Base learning rate (embeddings and MLPs). Too high, and the loss diverges: a run whose training loss"
      " turns non-finite (nan, inf) stops with exit code 3 and one line naming the step and the flags to "
      "change, keeping its last finite checkpoint."),
    Setting("optimizer", "optimizer.embedding", TRAINING,
      "Optimizer of the embedding tables: sgd, adagrad (an accumulator per weight), rowwise_adagrad (one "
      "per row, as FBGEMM/TorchRec/MLPerf DLRMv2) or adam (torch SparseAdam's lazy rule). Each updates only"
      " the rows a batch used.", choices=list(EMBEDDING_OPTIMIZERS)),
    Setting("dense_optimizer", "optimizer.dense", TRAINING,
      "Optimizer of the MLPs (and interaction weights). Default: sgd with --optimizer sgd, adagrad with "
      "adagrad or rowwise_adagrad, adam with adam.", choices=list(DENSE_OPTIMIZERS)),
    Setting("optimizer_eps", "optimizer.eps", TRAINING,
      "Epsilon of Adagrad, row-wise Adagrad and Adam."),
    Setting("initial_accumulator_value", "optimizer.initial_accumulator_value", TRAINING,
      "Starting value of every Adagrad and row-wise Adagrad accumulator (torch.optim.Adagrad's and "
      "TorchRec's name; 0 as theirs). A positive value damps the first updates of each row."),
    Setting("epochs", "train.epochs", TRAINING,
      "Number of epochs."),
    Setting("max_steps", "train.max_steps", TRAINING,
      "Stop after this many optimizer steps."),
    Setting("prefetch", "train.prefetch", TRAINING,
      "Batches read and copied to the device ahead of the step, on a background thread (training and "
      "tests)."),
    Setting("warmup_factor", "train.schedule.warmup_factor", TRAINING,
      "Warmup starts at lr * (1 - 1/2**warmup_factor); non-negative integer."),
    Setting("warmup_steps", "train.schedule.warmup_steps", TRAINING,
      "Steps of linear learning-rate warmup."),
    Setting("decay_steps", "train.schedule.decay_steps", TRAINING,
      "Steps of polynomial decay; 0 disables decay."),
    Setting("decay_start_step", "train.schedule.decay_start_step", TRAINING,
      "Step after which the decay starts (not before warmup ends)."),
    Setting("decay_power", "train.schedule.decay_power", TRAINING,
      "Power of the polynomial decay."),
    Setting("decay_end_lr", "train.schedule.decay_end_lr", TRAINING,
      "Learning rate at the end of the decay and after it."),
    Setting("log_path", "output.log_path", TRAINING,
      "JSON-lines log: the flags, periodic metrics and a final summary.", default="./log.json", to_config=_none_if_empty, to_flag=_empty_if_none),
    Setting("log_format", "output.log_format", TRAINING,
      "Form of --log_path: json (this program's records) or dllogger (the DLLL lines NVIDIA's DLRM example "
      "writes: PARAMETER, METADATA and the final best_auc, ... record; docs/nvidia_migration.md).", choices=LOG_FORMATS),
    Setting("tensorboard_dir", "output.tensorboard_dir", TRAINING,
      "Also write the logged metrics (train/loss, eval/auc, ...) as TensorBoard scalars to this directory, "
      "to watch with `tensorboard --logdir DIR` (pip extra: tensorboard)."),
    Setting("test_freq", "train.eval_every_steps", TRAINING,
      "Steps between tests; by default test at the end of each epoch."),
    Setting("test_after", "train.test_after", TRAINING,
      "Do not test before this many epochs are done."),
    Setting("print_freq", "train.log_every_steps", TRAINING,
      "Steps between progress lines."),
    Setting("benchmark_warmup_steps", "train.benchmark_warmup_steps", TRAINING,
      "Steps left out of throughput figures (inference_benchmark uses at least 10 untimed passes)."),
    Setting("auc_threshold", "train.auc_threshold", TRAINING,
      "Stop training once a test reaches this AUC."),
    Setting("embedding_type", "model.embedding_type", MODEL,
      "joint: one table for all features with offsets; multi_table: one table per feature; joint_fused: "
      "joint, with a fused gather and an in-place update kernel, SGD or row-wise Adagrad (no sparse "
      "gradient; needed by --cuda_graphs). NVIDIA's names: custom_cuda (the default), the fastest that "
      "supports the run: joint_fused on CUDA when the optimizers allow it, else joint; joint_sparse: joint.", choices=["joint", "multi_table", "joint_fused", *nvidia_flags.EMBEDDINGS], default="custom_cuda"),
    Setting("embedding_dtype", "model.embedding_dtype", MODEL,
      "How the embedding tables are stored. fp16/bf16 take half the memory of fp32 (the planner counts 2 "
      "bytes a value); their updates are computed in fp32 and rounded once per row. With --optimizer sgd or"
      " rowwise_adagrad.", choices=["fp32", "fp16", "bf16"]),
    Setting("stochastic_rounding", "optimizer.stochastic_rounding", MODEL,
      "bf16 tables: round each updated row stochastically (unbiased, so updates smaller than bf16's spacing"
      " still move the weights on average); --nostochastic_rounding rounds to nearest. fp16 tables always "
      "round to nearest."),
    Setting("embedding_dim", "model.embedding_dim", MODEL,
      "Embedding dimension (the bottom MLP's last size must equal it for dot)."),
    Setting("top_mlp_sizes", "model.top_mlp_sizes", MODEL,
      "Top MLP layer sizes; the last must be 1."),
    Setting("bottom_mlp_sizes", "model.bottom_mlp_sizes", MODEL,
      "Bottom MLP layer sizes."),
    Setting("interaction_op", "model.interaction_op", MODEL,
      "Feature interaction: pairwise dot products (cuda_dot: the fused Triton kernel, falling back to dot "
      "where it cannot run), concatenation, or dcn: DCNv2 low-rank cross layers over the concatenation "
      "(MLPerf DLRMv2). auto: cuda_dot on CUDA, dot elsewhere.", choices=["auto", "cuda_dot", "dot", "cat", "dcn"]),
    Setting("dcn_num_layers", "model.dcn_num_layers", MODEL,
      "Cross layers of --interaction_op dcn."),
    Setting("dcn_low_rank_dim", "model.dcn_low_rank_dim", MODEL,
      "Rank of each cross layer of --interaction_op dcn (MLPerf DLRMv2: 512)."),
    Setting("cuda_graphs", "train.cuda_graphs", MODEL,
      "Capture the training step and the test forward as CUDA graphs (CUDA, one process, --embedding_type "
      "joint_fused). On a CPU the run proceeds without them (a header note)."),
    Setting("max_table_size", "model.max_table_size", MODEL,
      "Cap every table at this many rows (needs --hash_indices)."),
    Setting("dataset", "data.dataset", DATA,
      "Split-binary dataset directory. Without it, trains on synthetic data."),
    Setting("feature_spec", "data.feature_spec", DATA,
      "Feature spec file name inside --dataset (or an absolute path)."),
    Setting("dataset_type", "data.dataset_type", DATA,
      "split_binary (NVIDIA: parametric) or synthetic (NVIDIA: synthetic_gpu; generated in device memory). "
      "Default: split_binary with --dataset, synthetic without.", choices=SPLIT_BINARY_TYPES + SYNTHETIC_TYPES, default=None, to_config=_dataset_type, to_flag=_same),
    Setting("shuffle_batch_order", "train.shuffle_batch_order", DATA,
      "Read training batches in a seeded random order each epoch.", short_name="shuffle"),
    Setting("hash_indices", "data.hash_indices", DATA,
      "Map ids with id % table_size instead of refusing out-of-range ids."),
    Setting("allow_files_outside_dataset", "data.allow_files_outside_dataset", DATA,
      "Read files the feature spec names outside the --dataset folder (absolute paths, '..', links leading "
      "out). Off: such a spec is refused before anything is read (docs/data_format.md)."),
    Setting("validate_dataset", "validate_dataset", DATA,
      "Before the first step, read every value of every split the run uses and stop with a clear error on a"
      " bad label, numerical value or id (see docs/training.md for its speed)."),
    Setting("synthetic_dataset_num_entries", "data.synthetic_num_entries", DATA,
      "Training samples per epoch of synthetic data."),
    Setting("synthetic_dataset_num_test_entries", "data.synthetic_num_test_entries", DATA,
      "Test samples of synthetic data."),
    Setting("synthetic_dataset_table_sizes", "data.synthetic_table_sizes", DATA,
      "Table sizes of synthetic data."),
    Setting("synthetic_dataset_numerical_features", "data.synthetic_num_numerical", DATA,
      "Numerical features of synthetic data."),
    Setting("synthetic_multi_hot_sizes", "data.synthetic_bag_sizes", DATA,
      "Multi-hot synthetic data: ids per sample of each table (comma-separated, one per table), or 'mlperf'"
      " for MLPerf DLRMv2's sizes. Empty: one id per feature.", to_config=_multi_hot_sizes, to_flag=_strings_or_empty),
    Setting("synthetic_pooling", "data.synthetic_pooling", DATA,
      "How the model pools each synthetic bag.", choices=["sum", "mean"]),
    Setting("synthetic_zipf_exponent", "data.synthetic_zipf_exponent", DATA,
      "Skew of the synthetic ids: id i of every table is drawn with probability ~ (i + 1) ** -exponent "
      "(1.2: a few rows take most lookups, as in Criteo's tables; 1.1: flatter). Must be > 0."),
    Setting("load_checkpoint_path", "checkpoint.load_checkpoint_path", CHECKPOINTS,
      "Checkpoint directory to load. In train mode, as NVIDIA's: its weights, then a fresh run from step 0 "
      "(optimizer, learning-rate schedule and data order start anew); with --resume the run continues "
      "exactly where that checkpoint stopped."),
    Setting("save_checkpoint_path", "train.save_checkpoint_path", CHECKPOINTS,
      "Directory to save the checkpoint to (atomically) at the end: absent or empty, or holding this "
      "program's checkpoint with --resume (continue it) or --overwrite (start over in its place). A folder "
      "holding anything else is never replaced. Nothing non-finite is ever saved: a run whose loss or "
      "weights turn nan or inf stops (exit code 3) with the last finite checkpoint kept here."),
    Setting("checkpoint_freq", "train.checkpoint_every_steps", CHECKPOINTS,
      "Also save every this many steps."),
    Setting("checkpoint_format", "train.checkpoint_format", CHECKPOINTS,
      "How --save_checkpoint_path is laid out. dlrm: this program's (weights, optimizer state, step and "
      "data position: --resume continues it). nvidia: NVIDIA's DLRM example's (metadata.pt, "
      "bottom_model.mlp.pt, top_model.*.pt, one bottom_model.embeddings.<i>.bin per table), which NVIDIA's "
      "main.py loads with --load_checkpoint_path on one GPU (for N GPUs: dlrm.scripts.convert_checkpoint "
      "--nvidia_gpus N); weights only. --load_checkpoint_path reads either layout.", choices=["dlrm", "nvidia"]),
    Setting("resume", "checkpoint.resume", CHECKPOINTS,
      "Continue a run exactly (weights, optimizer and scaler state, step, data position, RNG): from "
      "--save_checkpoint_path when it holds a checkpoint, else from --load_checkpoint_path when given, else"
      " start afresh: one command for the first start and every restart (Spark stage retries, torchrun "
      "--max_restarts, a requeued job)."),
    Setting("overwrite", "checkpoint.overwrite", CHECKPOINTS,
      "Start a new run and replace the checkpoint already at --save_checkpoint_path (without it, or "
      "--resume, a run refuses to replace one)."),
    Setting("skip_checkpoint_verify", "checkpoint.verify", CHECKPOINTS,
      "Load --load_checkpoint_path without comparing its files' checksums with those saved in meta.json "
      "(sizes, shapes and safe unpickling are still checked). For a damaged checkpoint you mean to load "
      "anyway.", to_config=_negated, to_flag=_negated),
    Setting("plan_max_processes", "plan_max_processes", DISTRIBUTED,
      "--mode plan: the most processes considered.", lower_bound=1),
    Setting("device_memory_gb", "parallel.device_memory_gb", DISTRIBUTED,
      "Memory per process for embedding tables, in GB. Default: 90% of the GPU's memory, or an equal share "
      "of 90% of the host's RAM on CPU."),
    Setting("host_tables", "parallel.host_tables", DISTRIBUTED,
      "One-process runs: embedding tables kept in host memory and looked up on the host (their ids go to "
      "the host and their embeddings come back every step), so that a model whose tables do not all fit on "
      "the GPU trains on one GPU. auto: the fewest largest tables that let the rest fit, only when they do "
      "not (GPU runs); none; or comma-separated table indices.", to_config=_host_tables, to_flag=_host_tables_flag),
    Setting("host_table_cache_rows", "parallel.host_table_cache_rows", DISTRIBUTED,
      "One-process runs with --embedding_type joint_fused: rows of the host tables cached on the device "
      "(hot rows in device memory, misses fetched from the host in one copy per step and the next batch's "
      "ahead of it, LRU eviction, changed rows written back); 0: host tables are looked up on the host. "
      "Costs per row the row and its optimizer state on the device, plus 4 bytes per host row (the slot "
      "map). auto: as many rows as fit in the device memory left after the device tables, the MLPs with "
      "their optimizer state and a batch's activations (--device_memory_gb, else 90% of the GPU's; on a CPU"
      " run the same budget of host RAM), at most every host row; the run log shows the arithmetic.", parser=_CacheRowsParser(), to_config=_same, to_flag=_same),
    Setting("table_placement", "parallel.table_placement", DISTRIBUTED,
      "Where the embedding tables go. auto: whole tables balanced by bytes, a table split row-wise across "
      "every process only when memory demands it; table_wise: whole tables only; row_wise: every table "
      "split row-wise; or JSON such as {\"0\": [0, 3], \"1\": [1, 2], \"row_wise\": [4]} (rank -> global "
      "table indices, the optional row_wise tables split; {\"row_wise\": [4]} alone lets the planner place "
      "the rest), a saved plan, or a path to a file holding either."),
    Setting("exchange_dtype", "parallel.exchange_dtype", DISTRIBUTED,
      "What the embedding all-to-all carries. auto: the compute dtype (the --amp dtype with --amp, else "
      "fp32), half the bytes of fp32 under AMP; fp32 exchanges exactly.", choices=EXCHANGE_DTYPES),
    Setting("gradient_sync", "parallel.gradient_sync", DISTRIBUTED,
      "How the replicated MLP gradients are summed across processes. after_backward: one all-reduce once "
      "the backward is done; overlap: buckets of --gradient_bucket_mb all-reduced while the backward runs, "
      "as DDP does (for GPUs, where NCCL runs beside the compute; on CPU it measured no faster). Both give "
      "the same sums.", choices=list(GRADIENT_SYNC)),
    Setting("gradient_bucket_mb", "parallel.gradient_bucket_mb", DISTRIBUTED,
      "Bucket size for --gradient_sync overlap, in MiB (DDP's default: 25).", lower_bound=0.001),
    Setting("dist_timeout", "parallel.dist_timeout", DISTRIBUTED,
      "Seconds a collective may wait for a peer before every process stops with an error."),
    Setting("inference_benchmark_batch_sizes", "benchmark.inference_benchmark_batch_sizes", SERVING,
      "Batch sizes for --mode inference_benchmark."),
    Setting("inference_benchmark_steps", "benchmark.inference_benchmark_steps", SERVING,
      "Timed forward passes per batch size."),
    Setting("inference_benchmark_backend", "benchmark.inference_benchmark_backend", SERVING,
      "What --mode inference_benchmark times: the eager model (with --cuda_graphs: its CUDA graphs), or the"
      " model exported and loaded as a server would (onnxruntime: CPU only; both float32, no --amp).", choices=BENCHMARK_BACKENDS),
    Setting("inference_benchmark_threads", "benchmark.inference_benchmark_threads", SERVING,
      "CPU threads for --mode inference_benchmark (torch's and ONNX Runtime's intra-op threads); 0: the "
      "libraries' defaults (one per core).", lower_bound=0),
    Setting("quantize_tables", "serving.quantize_tables", SERVING,
      FLAGS["quantize_tables"].help, defined_elsewhere=True, to_config=_quantize_tables, to_flag=_strings),
    Setting("quantize_min_rows", "serving.quantize_min_rows", SERVING,
      FLAGS["quantize_min_rows"].help, defined_elsewhere=True),
)

PRESET_HELP = (
    "mlperf_dlrmv2: the MLPerf Training DLRM-DCNv2 shape on synthetic multi-hot data (dim 128, bottom "
    "512-256-128, top 1024-1024-512-256-1, DCNv2 3 layers of rank 512, row-wise Adagrad with Adagrad for "
    "the MLPs at lr 0.005, MLPerf's multi-hot sizes and 40M-capped cardinalities). Flags given on the "
    "command line win; on a CPU add --max_table_size 100000 --hash_indices.")
flag_table.define(SETTINGS, RunConfig, DEFAULTS, __name__)
flags.DEFINE_enum("preset", "none", ["none", "mlperf_dlrmv2"],
                  PRESET_HELP)
flags.adopt_module_key_flags(serving_flags)  # --quantize_tables, --quantize_min_rows
# Every setting of RunConfig: this table and NVIDIA's settings (nvidia_flags.SETTINGS).
ALL_SETTINGS: tuple[Setting, ...] = SETTINGS + nvidia_flags.SETTINGS

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


def run_config(values: flags.FlagValues = FLAGS) -> RunConfig:
    """The run the flags describe, checked: ``ALL_SETTINGS`` walked, each flag's value put at its
    field; ``app.UsageError`` naming the flags. Call after ``apply_preset`` and ``nvidia_flags.apply``."""
    try:
        return flag_table.build(RunConfig, flag_table.read_values(ALL_SETTINGS, RunConfig, values), BUILD_ORDER)
    except ValueError as e:
        raise app.UsageError(cli.flag_terms(str(e), values)) from None


def config_args(cfg: RunConfig) -> list[str]:
    """The command line of dlrm.scripts.main that reads back as ``cfg`` (``parse_args`` then
    ``run_config``), every setting spelled out, derived from ``ALL_SETTINGS``; ``ValueError``
    naming a setting no flag can say. NVIDIA's mapping flags are not used (they resolve by the
    device, and these flags say the resolved settings)."""
    args = flag_table.args(ALL_SETTINGS, RunConfig, DEFAULTS, cfg)
    want, back = cfg.settings(), run_config(parse_args(args)).settings()
    differ = [f"`{name}` {value!r}" for name, value in want.items() if back[name] != value]
    if differ:  # a value the flag's form cannot hold, e.g. a one-item list read back as one name
        raise ValueError(f"dlrm.scripts.main's flags cannot say {', '.join(differ)}")
    return args


def short_help() -> str:
    """``--help``'s flags: each one or two lines, grouped by section (``--helpfull``: the whole text)."""
    rows = [(s.section, *flag_table.shown(FLAGS, s.flag)) for s in ALL_SETTINGS]
    rows.insert(0, (MODEL, *flag_table.shown(FLAGS, "preset")))
    rows += [(NVIDIA, flag_table.shown(FLAGS, name)[0], f"here {maps_to}") for name, maps_to in nvidia_flags.ALIASES.items()]
    return flag_table.short_help(SECTIONS, rows)


def parse_args(args: list[str]) -> flags.FlagValues:
    """``args`` parsed as dlrm.scripts.main's flags, into a copy of them (the caller's FLAGS stay
    as they are); ``app.UsageError`` with the message the script would print."""
    values = flags.FlagValues()
    for module in (__name__, nvidia_flags.__name__, serving_flags.__name__):
        for flag in FLAGS.get_flags_for_module(module):
            values[flag.name] = copy.deepcopy(flag)
    try:
        rest = values([sys.argv[0], *args])[1:]
    except flags.Error as e:
        raise app.UsageError(cli.flags_error_message(e)) from None
    if rest:
        raise app.UsageError(f"unexpected arguments: {' '.join(rest)}")
    return values


def check_args(args: list[str], device_type: str | None = None) -> flags.FlagValues:
    """Parses ``args`` as dlrm.scripts.main's flags and validates them as a run does first, without
    running anything, so that a launcher (dlrm.scripts.spark_train) refuses a bad flag before it
    starts workers. Raises ``app.UsageError`` with the message the script would print; returns
    the flags as a run would use them (NVIDIA's mapped onto this script's, for ``device_type``'s
    devices when given: ``nvidia_flags.apply``)."""
    values = parse_args(args)
    apply_preset(values)
    nvidia_flags.apply(values, device_type)
    run_config(values)
    return values
