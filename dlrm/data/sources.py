"""Turns a data configuration into batch sources for each split."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.rank_source import RankSource
from dlrm.data.split_binary import SplitBinaryReader
from dlrm.data.hidden_model import ZIPF_EXPONENT
from dlrm.data.synthetic import SyntheticDataset
from dlrm.engine.config_check import check_types
from dlrm.engine.errors import DatasetError

SPLIT_BINARY_TYPES = ("split_binary", "parametric")  # "parametric" is NVIDIA's name for it
SYNTHETIC_TYPES = ("synthetic", "synthetic_gpu")  # generated in the base device's memory


@dataclass
class DataConfig:
    dataset: str | None = None
    feature_spec: str = "feature_spec.yaml"
    dataset_type: str = "split_binary"
    hash_indices: bool = False
    synthetic_num_entries: int = 1 << 20
    synthetic_num_test_entries: int = 1 << 18
    synthetic_table_sizes: list[int] = field(default_factory=lambda: [100_000] * 26)
    synthetic_num_numerical: int = 13
    # Multi-hot synthetic data: ids per sample for every table (e.g. MLPERF_MULTI_HOT_SIZES) and
    # the pooling of all of them; None keeps one id per table.
    synthetic_bag_sizes: list[int] | None = None
    synthetic_pooling: str = "sum"
    synthetic_zipf_exponent: float = ZIPF_EXPONENT  # P(id) ~ (id + 1) ** -exponent in every table
    # Read files the feature spec names outside the dataset folder ('..', absolute paths, links
    # leading out); refused by default: a dataset is handed in from outside (``feature_spec.dataset_file``).
    allow_files_outside_dataset: bool = False

    def __post_init__(self) -> None:
        check_types(self, paths=("dataset", "feature_spec"))  # the bounds: RunConfig's, with the run's

    @property
    def synthetic(self) -> bool:
        return self.dataset_type in SYNTHETIC_TYPES


def load_feature_spec(cfg: DataConfig) -> FeatureSpec:
    """The spec of ``cfg``'s data; a split-binary dataset's is checked before anything else is
    read: every file it names lies in its folder (unless ``allow_files_outside_dataset``) and it
    has a numerical feature (the model's bottom MLP takes them)."""
    if cfg.synthetic:
        return FeatureSpec.default(cfg.synthetic_num_numerical, cfg.synthetic_table_sizes,
                                   bag_sizes=cfg.synthetic_bag_sizes, pooling=cfg.synthetic_pooling)
    if cfg.dataset_type not in SPLIT_BINARY_TYPES:
        raise ValueError(f"unknown `dataset_type` {cfg.dataset_type!r}; use one of {SPLIT_BINARY_TYPES + SYNTHETIC_TYPES}")
    if not cfg.dataset:
        raise DatasetError("`dataset` is required for a split-binary dataset (or use `dataset_type=synthetic`)")
    path = cfg.feature_spec if os.path.isabs(cfg.feature_spec) else os.path.join(cfg.dataset, cfg.feature_spec)
    if not os.path.isfile(path):
        raise DatasetError(f"feature spec {path} not found: pass the dataset directory as `dataset` "
                           "and, if the spec has another name, `feature_spec`")
    spec = FeatureSpec.from_yaml(path, allow_files_outside=cfg.allow_files_outside_dataset)
    for split in spec.splits:
        spec.paths(split)  # DatasetError naming the spec, the feature and the opt-in
    if spec.num_numerical == 0:
        raise DatasetError(
            f"{path}: the dataset has no numerical feature, and the DLRM model needs at least one (the input of "
            f"its bottom MLP); write the dataset with one, e.g. a constant column (synthetic data: python -m "
            f"dlrm.scripts.prepare_synthetic_dataset with `num_numerical_features=1`)")
    return spec


def make_source(
    cfg: DataConfig,
    spec: FeatureSpec,
    split: str,
    batch_size: int,
    device: torch.device,
    categorical_features: Sequence[int] | None = None,
    seed: int = 12345,
) -> Any | None:
    """A source with ``len()`` and ``read_batch(i)``; None when the dataset lacks the split.
    ``seed``: synthetic data's (a run's one seed, ``RunConfig.seed``)."""
    if cfg.synthetic:
        entries = cfg.synthetic_num_entries if split == "train" else cfg.synthetic_num_test_entries
        return SyntheticDataset(
            cfg.synthetic_num_numerical, cfg.synthetic_table_sizes, entries, batch_size,
            device=device, seed=seed, split=split,
            bag_sizes=cfg.synthetic_bag_sizes, pooling=cfg.synthetic_pooling,
            zipf_exponent=cfg.synthetic_zipf_exponent,
        )
    if split not in spec.splits:
        return None
    return SplitBinaryReader(
        spec, split, batch_size, categorical_features=categorical_features, check_ids=not cfg.hash_indices
    )


def make_rank_source(
    cfg: DataConfig, spec: FeatureSpec, split: str, batch_size: int, device: torch.device,
    tables: Sequence[int], rank: int, world_size: int, seed: int = 12345,
) -> Any | None:
    """One process's share of a split in hybrid-parallel training (see ``RankSource``)."""
    if not cfg.synthetic and split not in spec.splits:
        return None

    def make_reader(categorical_features: Sequence[int], read_numerical: bool, read_label: bool) -> Any:
        if cfg.synthetic:
            return make_source(cfg, spec, split, batch_size, device, seed=seed)
        return SplitBinaryReader(spec, split, batch_size, categorical_features=categorical_features,
                                 read_numerical=read_numerical, read_label=read_label,
                                 check_ids=not cfg.hash_indices)

    return RankSource(make_reader, tables, rank, world_size)


def table_sizes(spec: FeatureSpec, max_table_size: int | None) -> list[int]:
    """Rows per embedding table: the cardinalities, capped by ``max_table_size`` when given."""
    sizes = list(spec.cardinalities)
    return [min(s, max_table_size) for s in sizes] if max_table_size else sizes
