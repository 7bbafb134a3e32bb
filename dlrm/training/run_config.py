"""A DLRM run as typed settings that check themselves: what ``dlrm.scripts.main`` does, without flags.

    run = RunConfig(data=DataConfig(dataset="/data/criteo"), model=ModelSettings(embedding_dim=64),
                    train=TrainConfig(LRSchedule(lr=0.5), epochs=2), batch_size=4096)

``RunConfig`` composes the library's own configs (``DataConfig``, ``OptimizerConfig``, the loop's
``TrainConfig`` with its ``LRSchedule``) with the settings no other config holds: the model's
shape before the data fixes its tables (``ModelSettings``), where the tables go
(``ParallelConfig``), what to load (``CheckpointConfig``), where the run logs (``OutputConfig``),
what ``mode="inference_benchmark"`` times (``InferenceBenchmarkConfig``) and the tables' serving
precision (``ServingConfig``). It is everything a run of ``dlrm.scripts.main`` uses: every flag
of that script is declared from one of its fields (``dlrm.scripts.dlrm_flags.SETTINGS``), and ``RunConfig.seed`` is
the run's one seed (weights, batch order, synthetic data). Constructing one validates it
(``__post_init__``) and raises ``ValueError`` naming each setting in backquotes as it is spelled
here, so a script shows the message in its flags' names (``dlrm.scripts.cli.flag_terms``).
``dlrm.api`` runs one (``train``, ``evaluate``, ``benchmark_inference``, ``plan``);
``dlrm.training.build`` turns it into a model, optimizer, data sources and plan. ``to_dict`` and
``from_dict``: the config as plain data (what a checkpoint's meta.json records) and back.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from dlrm.data.sources import SPLIT_BINARY_TYPES, SYNTHETIC_TYPES, DataConfig
from dlrm.engine.collectives import GRADIENT_SYNC
from dlrm.engine.config_check import (ConfigValueError, check_float32, check_float32_positive, check_seed, check_types,
                                       shown)
from dlrm.model.dlrm import EMBEDDING_DTYPES, EMBEDDING_TYPES, INTERACTION_OPS
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.optimizers import OptimizerConfig
from dlrm.training.train import TrainConfig

MODES = ("train", "test", "inference_benchmark", "plan")
AMP_DTYPES = ("auto", "float16", "bfloat16")
EXCHANGE_DTYPES = ("auto", "fp32", "fp16", "bf16")
LOG_FORMATS = ("json", "dllogger")
BENCHMARK_BACKENDS = ("eager", "onnxruntime", "torchscript")
SERVING_MODES = ("test", "inference_benchmark", "plan")
# The key that marks a dict as ``RunConfig.to_dict``'s (a checkpoint's ``run_config`` before it
# was a flags dict); its value is the layout's version.
VERSION_KEY = "run_config_version"
VERSION = 1
# The longest a collective may wait (s): datetime.timedelta, which torch.distributed takes, ends
# at 999999999 days.
MAX_TIMEOUT_S = 1e9


def check_positive(**settings: float | None) -> None:
    """Each setting given (not None) must be > 0 (NaN is refused too)."""
    for name, value in settings.items():
        if value is not None and not value > 0:
            raise ValueError(f"`{name}` must be positive, got {value}")


def check_count(minimum: int, **settings: int | None) -> None:
    """Each setting given (not None) must be an integer >= ``minimum``."""
    for name, value in settings.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < minimum):
            raise ValueError(f"`{name}` must be an integer >= {minimum}, got {value!r}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    """The setting must be one of ``choices`` (its type checked first, so the message stays short)."""
    if value not in choices:
        raise ValueError(f"`{name}` must be one of {', '.join(choices)}, got {shown(value)}")


def check_at_most(most: float, **settings: float | None) -> None:
    """Each setting given (not None) must be <= ``most``."""
    for name, value in settings.items():
        if value is not None and value > most:
            raise ValueError(f"`{name}` must be at most {most:g}, got {value:g}")


def check_non_negative(**settings: float) -> None:
    """Each setting must be a finite number >= 0."""
    for name, value in settings.items():
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"`{name}` must be a finite number >= 0, got {value}")


@dataclass
class ModelSettings:
    """The model's shape as a run chooses it; the data gives the rest (its numerical features and
    table sizes, capped at ``max_table_size``), and ``build.model_config`` joins the two into a
    ``DLRMConfig``, which checks the whole. ``interaction_op="auto"``: cuda_dot on CUDA, else dot."""

    embedding_dim: int = 128
    bottom_mlp_sizes: list[int] = field(default_factory=lambda: [512, 256, 128])
    top_mlp_sizes: list[int] = field(default_factory=lambda: [1024, 1024, 512, 256, 1])
    interaction_op: str = "auto"
    dcn_num_layers: int = 3
    dcn_low_rank_dim: int = 512
    embedding_type: str = "joint"
    embedding_dtype: str = "fp32"
    max_table_size: int | None = None

    def __post_init__(self) -> None:
        check_types(self)
        check_choice("interaction_op", self.interaction_op, ("auto", *INTERACTION_OPS))
        check_choice("embedding_type", self.embedding_type, EMBEDDING_TYPES)
        check_positive(max_table_size=self.max_table_size)
        if self.embedding_dtype not in EMBEDDING_DTYPES:
            raise ValueError(f"`embedding_dtype` must be one of {list(EMBEDDING_DTYPES)}, got {self.embedding_dtype!r}")


@dataclass
class ParallelConfig:
    """Where the tables go and how processes talk (hybrid parallelism under torchrun)."""

    device_memory_gb: float | None = None  # per process, for tables; None: 90% of the device's
    host_tables: str | list[int] = "auto"  # one process: tables in host memory ("auto", "none" or indices)
    table_placement: str = "auto"  # dlrm.distributed.planner.load_placement's argument
    exchange_dtype: str = "auto"  # what the all-to-all carries; auto: the compute dtype
    gradient_sync: str = "after_backward"
    gradient_bucket_mb: float = 25.0
    dist_timeout: float = 300.0
    # Device rows caching the host tables (``DLRM(host_cache_rows=...)``); 0: looked up on the host;
    # "auto": as many as the device has room for beside the plan (``dlrm.distributed.planner.size_host_cache``).
    host_table_cache_rows: int | str = 0

    def __post_init__(self) -> None:
        rows = self.host_table_cache_rows  # first: its own message says both forms it takes
        if rows != "auto" and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 0):
            raise ConfigValueError(f"`host_table_cache_rows` must be an integer >= 0 or \"auto\", got {shown(rows)}")
        check_types(self, paths=("table_placement",))
        check_at_most(MAX_TIMEOUT_S, dist_timeout=self.dist_timeout)
        check_positive(device_memory_gb=self.device_memory_gb, dist_timeout=self.dist_timeout,
                       gradient_bucket_mb=self.gradient_bucket_mb)
        if self.exchange_dtype not in EXCHANGE_DTYPES:
            raise ValueError(f"`exchange_dtype` must be one of {EXCHANGE_DTYPES}, got {self.exchange_dtype!r}")
        if self.gradient_sync not in GRADIENT_SYNC:
            raise ValueError(f"`gradient_sync` must be one of {tuple(GRADIENT_SYNC)}, got {self.gradient_sync!r}")


@dataclass
class CheckpointConfig:
    """What a run loads; where it saves is the loop's (``TrainConfig.save_checkpoint_path``).

    ``resume``: continue a run exactly, from the save path when it holds a checkpoint, else from
    ``load_checkpoint_path``; without it ``load_checkpoint_path`` gives weights only (NVIDIA's).
    ``overwrite``: start afresh and replace the checkpoint at the save path; without ``resume`` or
    it, a checkpoint already there is refused (``dlrm.engine.outputs``)."""

    load_checkpoint_path: str | None = None
    resume: bool = False
    overwrite: bool = False
    verify: bool = True  # compare the files' checksums with meta.json's

    def __post_init__(self) -> None:
        check_types(self)


@dataclass
class OutputConfig:
    """What a run writes besides its checkpoint (each claimed before any work, ``dlrm.engine.outputs``).

    ``log_path``: the JSON-lines log the run appends to (None: none; ``dlrm.scripts.main``'s
    default is ./log.json); ``log_format``: json (this program's records) or dllogger (NVIDIA's
    DLLL lines); ``tensorboard_dir``: also the logged metrics as TensorBoard scalars."""

    log_path: str | None = None
    log_format: str = "json"
    tensorboard_dir: str | None = None

    def __post_init__(self) -> None:
        check_types(self)
        if self.log_format not in LOG_FORMATS:
            raise ValueError(f"`log_format` must be one of {LOG_FORMATS}, got {self.log_format!r}")


@dataclass
class InferenceBenchmarkConfig:
    """What ``mode="inference_benchmark"`` times: latency and throughput of each batch size over
    ``inference_benchmark_steps`` passes, of the eager model (its CUDA graphs with ``cuda_graphs``)
    or an export loaded as a server would (``inference_benchmark_backend``), on
    ``inference_benchmark_threads`` CPU threads (0: the libraries' defaults)."""

    inference_benchmark_batch_sizes: list[int] = field(default_factory=lambda: [1, 64, 4096])
    inference_benchmark_steps: int = 200
    inference_benchmark_backend: str = "eager"
    inference_benchmark_threads: int = 0

    def __post_init__(self) -> None:
        check_types(self)
        sizes = self.inference_benchmark_batch_sizes
        if not sizes:
            raise ValueError("`inference_benchmark_batch_sizes` is empty: give one batch size or more")
        for n in sizes:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"`inference_benchmark_batch_sizes`: {n!r} is not a batch size (a positive integer)")
        check_count(1, inference_benchmark_steps=self.inference_benchmark_steps)
        check_count(0, inference_benchmark_threads=self.inference_benchmark_threads)
        if self.inference_benchmark_backend not in BENCHMARK_BACKENDS:
            raise ValueError(f"`inference_benchmark_backend` must be one of {BENCHMARK_BACKENDS}, got "
                             f"{self.inference_benchmark_backend!r}")


@dataclass
class ServingConfig:
    """The tables' precision when a trained model is served (``mode`` test, inference_benchmark,
    plan): ``quantize_tables`` one of ``dlrm.kernels.quantized_rows.PRECISION_BITS`` for every
    table, or a list with one per table; tables under ``quantize_min_rows`` rows stay fp32."""

    quantize_tables: str | list[str] = "fp32"
    quantize_min_rows: int = 0

    def __post_init__(self) -> None:
        from dlrm.kernels.quantized_rows import PRECISION_BITS

        check_types(self)
        chosen = [self.quantize_tables] if isinstance(self.quantize_tables, str) else list(self.quantize_tables)
        bad = [p for p in chosen if p not in PRECISION_BITS] or ([] if chosen else ["(none)"])
        if bad:
            raise ValueError(f"`quantize_tables`: unknown precision {bad[0]!r}; choose from {list(PRECISION_BITS)}, "
                             "one for all tables or one per table")
        check_count(0, quantize_min_rows=self.quantize_min_rows)

    @property
    def quantizing(self) -> bool:
        chosen = [self.quantize_tables] if isinstance(self.quantize_tables, str) else self.quantize_tables
        return set(chosen) != {"fp32"} or bool(self.quantize_min_rows)


# RunConfig's fields that are configs themselves, and theirs (``from_dict``).
def _nested() -> dict[type, dict[str, type]]:
    return {RunConfig: {"data": DataConfig, "model": ModelSettings, "optimizer": OptimizerConfig,
                        "train": TrainConfig, "checkpoint": CheckpointConfig, "parallel": ParallelConfig,
                        "output": OutputConfig, "benchmark": InferenceBenchmarkConfig, "serving": ServingConfig},
            TrainConfig: {"schedule": LRSchedule}}


def _build(cls: type, values: dict[str, Any]) -> Any:
    nested = _nested().get(cls, {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{cls.__name__} has no setting {', '.join(f'`{name}`' for name in unknown)}")
    return cls(**{name: _build(nested[name], value) if name in nested and isinstance(value, dict) else value
                  for name, value in values.items()})


@dataclass
class RunConfig:
    """One DLRM run: its mode and every setting it uses (module docstring). ``seed`` seeds
    everything random in the run: the weights, the shuffled batch order and synthetic data."""

    mode: str = "train"
    seed: int = 12345
    base_device: str | None = None  # cuda, cuda:N or cpu; None: cuda if available
    amp: bool = False
    amp_dtype: str = "auto"
    allow_tf32: bool = True
    batch_size: int = 65536
    test_batch_size: int = 65536
    validate_dataset: bool = True  # read every value of the splits used before the first step
    data: DataConfig = field(default_factory=lambda: DataConfig(dataset_type="synthetic"))
    model: ModelSettings = field(default_factory=ModelSettings)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # NVIDIA's schedule, as dlrm.scripts.main's flags default to it
    train: TrainConfig = field(default_factory=lambda: TrainConfig(LRSchedule(
        lr=24.0, warmup_steps=8000, decay_start_step=48000, decay_steps=24000)))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    benchmark: InferenceBenchmarkConfig = field(default_factory=InferenceBenchmarkConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    plan_max_processes: int = 64  # mode plan: the most processes considered

    def settings(self) -> dict[str, Any]:
        """Every setting under its own name, the config's parts flattened (each name is one
        setting's, as ``RecommenderConfig.settings``): the run log's first record."""
        flat: dict[str, Any] = {}

        def walk(values: dict[str, Any]) -> None:
            for name, value in values.items():
                if isinstance(value, dict):
                    walk(value)
                else:
                    flat[name] = value

        walk(dataclasses.asdict(self))
        return flat

    def to_dict(self) -> dict[str, Any]:
        """The config as plain data (JSON), marked as a ``RunConfig``'s (``VERSION_KEY``)."""
        return {VERSION_KEY: VERSION, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "RunConfig":
        """The config ``to_dict`` gave (checked again); ``ValueError`` for anything else."""
        values = dict(values)
        if values.pop(VERSION_KEY, None) != VERSION:
            raise ValueError(f"not a RunConfig's settings (no `{VERSION_KEY}`={VERSION})")
        return _build(cls, values)

    def __post_init__(self) -> None:
        check_types(self)
        check_choice("mode", self.mode, MODES)
        check_choice("amp_dtype", self.amp_dtype, AMP_DTYPES)
        check_seed(self.seed)
        check_count(1, plan_max_processes=self.plan_max_processes)
        if self.serving.quantizing and self.mode not in SERVING_MODES:
            raise ValueError(f"`quantize_tables` and `quantize_min_rows` store a trained model's tables for serving: "
                             f"use them with `mode` {', '.join(SERVING_MODES)} (training keeps float tables; see "
                             "`embedding_dtype`)")
        backend = self.benchmark.inference_benchmark_backend
        if self.mode == "inference_benchmark" and backend != "eager" and (self.amp or self.train.cuda_graphs):
            raise ValueError(f"`inference_benchmark_backend={backend}` runs the exported float32 graph: drop `amp` "
                             "and `cuda_graphs`")
        if self.model.max_table_size is not None and not self.data.hash_indices:
            raise ValueError("`max_table_size` needs `hash_indices=True` (ids above the cap must be mapped somewhere)")
        if self.mode == "test" and not self.checkpoint.load_checkpoint_path:
            raise ValueError("`mode=test` evaluates a trained model: pass `load_checkpoint_path`")
        if self.checkpoint.resume and not (self.mode == "train" and (self.train.save_checkpoint_path
                                                                     or self.checkpoint.load_checkpoint_path)):
            raise ValueError("`resume` continues a training run from a checkpoint: pass `save_checkpoint_path` (its "
                             "own, with `checkpoint_every_steps` to lose at most that many steps) or "
                             "`load_checkpoint_path`")
        if self.checkpoint.resume and self.checkpoint.overwrite:
            raise ValueError("`resume` continues the checkpoint at `save_checkpoint_path` and `overwrite` starts over "
                             "in its place: pass one of them")
        if self.checkpoint.resume and self.train.checkpoint_format == "nvidia":
            raise ValueError("`resume` continues this program's checkpoints, and `checkpoint_format=nvidia` saves "
                             "NVIDIA's layout, which holds weights only: drop one of them")
        check_positive(batch_size=self.batch_size, test_batch_size=self.test_batch_size)
        _check_train(self.train)
        _check_data(self.data)
        self.optimizer.validate()
        check_float32_positive(optimizer_eps=self.optimizer.eps)
        check_float32(initial_accumulator_value=self.optimizer.initial_accumulator_value)
        self.optimizer.validate_table_dtype(EMBEDDING_DTYPES[self.model.embedding_dtype])
        if self.model.embedding_type == "joint_fused":  # its kernels' optimizers only
            self.optimizer.validate_fused()
        _check_host_cache(self)


def _check_host_cache(cfg: RunConfig) -> None:
    """A cache of host-table rows needs the fused embedding (its kernels run on the slots), host
    tables to cache, and no CUDA graphs (each step reads its number of misses on the host)."""
    if not cfg.parallel.host_table_cache_rows:
        return
    if cfg.model.embedding_type != "joint_fused":
        raise ValueError(f"`host_table_cache_rows` needs `embedding_type=joint_fused`, got "
                         f"`embedding_type={cfg.model.embedding_type}`")
    if cfg.train.cuda_graphs:
        raise ValueError("`host_table_cache_rows` cannot be captured in CUDA graphs (each step reads its number of "
                         "misses on the host): drop `cuda_graphs`")
    if cfg.parallel.host_tables == "none" or cfg.parallel.host_tables == []:
        raise ValueError("`host_table_cache_rows` caches tables kept in host memory, and `host_tables=none` keeps "
                         "none there: list them in `host_tables`")


def _check_train(cfg: TrainConfig) -> None:
    check_positive(epochs=cfg.epochs, log_every_steps=cfg.log_every_steps, max_steps=cfg.max_steps,
                   eval_every_steps=cfg.eval_every_steps, checkpoint_every_steps=cfg.checkpoint_every_steps)
    check_count(1, prefetch=cfg.prefetch)
    schedule = cfg.schedule
    check_non_negative(lr=schedule.lr, decay_end_lr=schedule.decay_end_lr, test_after=cfg.test_after,
                       benchmark_warmup_steps=cfg.benchmark_warmup_steps)
    if cfg.checkpoint_format not in ("dlrm", "nvidia"):
        raise ValueError(f"`checkpoint_format` must be dlrm or nvidia, got {cfg.checkpoint_format!r}")
    if cfg.auc_threshold is not None and not 0 < cfg.auc_threshold <= 1:
        raise ValueError(f"`auc_threshold` must be in (0, 1], got {cfg.auc_threshold}")


def _check_data(cfg: DataConfig) -> None:
    if cfg.dataset_type not in SPLIT_BINARY_TYPES + SYNTHETIC_TYPES:
        raise ValueError(f"`dataset_type` must be one of {SPLIT_BINARY_TYPES + SYNTHETIC_TYPES}, got "
                         f"{cfg.dataset_type!r}")
    if cfg.dataset_type in SPLIT_BINARY_TYPES and not cfg.dataset:
        raise ValueError(f"`dataset_type={cfg.dataset_type}` needs `dataset`")
    check_non_negative(synthetic_num_entries=cfg.synthetic_num_entries,
                       synthetic_num_test_entries=cfg.synthetic_num_test_entries,
                       synthetic_num_numerical=cfg.synthetic_num_numerical)
    check_positive(synthetic_zipf_exponent=cfg.synthetic_zipf_exponent)
    if any(not size >= 1 for size in cfg.synthetic_table_sizes):
        raise ValueError("`synthetic_table_sizes` must be positive integers")
    if cfg.synthetic_bag_sizes is not None and any(not size >= 1 for size in cfg.synthetic_bag_sizes):
        raise ValueError(f"`synthetic_bag_sizes` must be positive, got {cfg.synthetic_bag_sizes}")
