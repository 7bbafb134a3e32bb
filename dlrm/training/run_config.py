"""A DLRM run as typed settings that check themselves: what ``dlrm.scripts.main`` does, without flags.

    run = RunConfig(data=DataConfig(dataset="/data/criteo"), model=ModelSettings(embedding_dim=64),
                    train=TrainConfig(LRSchedule(lr=0.5), epochs=2), batch_size=4096)

``RunConfig`` composes the library's own configs (``DataConfig``, ``OptimizerConfig``, the loop's
``TrainConfig`` with its ``LRSchedule``) with the settings no other config holds: the model's
shape before the data fixes its tables (``ModelSettings``), where the tables go
(``ParallelConfig``) and what to load (``CheckpointConfig``). Constructing one validates it
(``__post_init__``) and raises ``ValueError`` naming each setting in backquotes as it is spelled
here, so a script shows the message in its flags' names (``dlrm.scripts.cli.flag_terms``).
``dlrm.training.build`` turns a ``RunConfig`` into a model, optimizer, data sources and plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dlrm.data.sources import SPLIT_BINARY_TYPES, SYNTHETIC_TYPES, DataConfig
from dlrm.engine.collectives import GRADIENT_SYNC
from dlrm.model.dlrm import EMBEDDING_DTYPES
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.optimizers import OptimizerConfig
from dlrm.training.train import TrainConfig

MODES = ("train", "test", "inference_benchmark", "plan")
EXCHANGE_DTYPES = ("auto", "fp32", "fp16", "bf16")


def check_positive(**settings: float | None) -> None:
    """Each setting given (not None) must be > 0 (NaN is refused too)."""
    for name, value in settings.items():
        if value is not None and not value > 0:
            raise ValueError(f"`{name}` must be positive, got {value}")


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
    # Device rows caching the host tables (``DLRM(host_cache_rows=...)``); 0: looked up on the host.
    host_table_cache_rows: int = 0

    def __post_init__(self) -> None:
        check_positive(device_memory_gb=self.device_memory_gb, dist_timeout=self.dist_timeout,
                       gradient_bucket_mb=self.gradient_bucket_mb)
        rows = self.host_table_cache_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"`host_table_cache_rows` must be an integer >= 0, got {rows!r}")
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


@dataclass
class RunConfig:
    """One DLRM run: its mode and every setting it uses (module docstring)."""

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
    train: TrainConfig = field(default_factory=lambda: TrainConfig(LRSchedule(lr=24.0)))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"`mode` must be one of {MODES}, got {self.mode!r}")
        if self.model.max_table_size is not None and not self.data.hash_indices:
            raise ValueError("`max_table_size` needs `hash_indices=True` (ids above the cap must be mapped somewhere)")
        if self.mode == "test" and not self.checkpoint.load_checkpoint_path:
            raise ValueError("`mode=test` evaluates a trained model: pass `load_checkpoint_path`")
        if self.checkpoint.resume and not (self.mode == "train" and (self.train.save_checkpoint_path
                                                                     or self.checkpoint.load_checkpoint_path)):
            raise ValueError("`resume` continues a training run from a checkpoint: pass `save_checkpoint_path` (its "
                             "own, with `checkpoint_freq` to lose at most that many steps) or `load_checkpoint_path`")
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
    check_positive(epochs=cfg.epochs, print_freq=cfg.print_freq, max_steps=cfg.max_steps, test_freq=cfg.test_freq,
                   checkpoint_freq=cfg.checkpoint_freq)
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
