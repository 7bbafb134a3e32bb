"""Validation inside training: how many epochs to train is chosen on data the model never
trains on, never on the test split.

A seeded share of the users (``user_fraction``, at most ``max_users``) lends a seeded share of
its items (``item_fraction``, at least one, never the whole history) to a validation split.
Training leaves those entries out of every batch, as input and as target; validation ranks
every item for these users from the rest of their history, with the items they have seen
excluded, exactly as a test on a held-out split does, and reports NDCG@K, P@K and R@K. The
training loop keeps the checkpoint of the best NDCG@K and stops after ``patience`` validations
without a better one. The split depends on the seed and the dataset only, so a resumed run and
every process of an item-parallel run draw the same one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from dlrm.recommender.csr_dataset import CsrDataset
from dlrm.recommender.metrics import MetricsAccumulator, RankingMetrics
from dlrm.recommender.model import SparseAutoencoder
from dlrm.recommender.predict import rank
from dlrm.recommender.scorer import Scorer, model_scorer
from dlrm.recommender.csr_rows import take_rows


@dataclass(frozen=True)
class ValidationConfig:
    user_fraction: float = 0.1  # share of the users that lend items to validation
    max_users: int = 10_000  # at most this many validation users (validation time stays bounded)
    item_fraction: float = 0.2  # share of a validation user's items held out (as the test split does)
    k: int = 10  # cut-off of NDCG@K, the metric that picks the best checkpoint (and of P@K, R@K)
    patience: int = 5  # validations without a better NDCG@K before training stops
    batch_size: int = 1024  # users ranked at once

    def __post_init__(self) -> None:
        if not 0 < self.user_fraction <= 1:
            raise ValueError(f"`user_fraction` must be in (0, 1], got {self.user_fraction}")
        if not 0 < self.item_fraction < 1:
            raise ValueError(f"`item_fraction` must be in (0, 1), got {self.item_fraction}")
        for name in ("max_users", "k", "patience", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}")


@dataclass
class ValidationSplit:
    users: np.ndarray  # int64 [U], sorted sample ids of the validation users
    held: np.ndarray  # bool [nnz of the dataset]: True where a stored entry is a validation target

    @property
    def train_mask(self) -> np.ndarray:
        return ~self.held

    @property
    def n_held(self) -> int:
        return int(self.held.sum())


def make_split(dataset: CsrDataset, cfg: ValidationConfig, seed: int) -> ValidationSplit:
    """The seeded validation split of ``dataset`` (users with at least two items are eligible)."""
    offsets = np.asarray(dataset.offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    eligible = np.flatnonzero(lengths >= 2)
    n_users = min(cfg.max_users, max(1, round(cfg.user_fraction * len(dataset))), len(eligible))
    if n_users == 0:
        raise ValueError(f"the dataset {dataset.path} has no user with two or more items to validate on: train "
                         "with a fixed `epochs` and no validation")
    rng = np.random.default_rng([seed, 0x7A11D])
    users = np.sort(rng.choice(eligible, n_users, replace=False))
    user_lengths = lengths[users]
    take = np.clip(np.rint(cfg.item_fraction * user_lengths).astype(np.int64), 1, user_lengths - 1)
    # A random order of each user's entries; the first `take` of it are held out.
    owner = np.repeat(np.arange(n_users, dtype=np.int64), user_lengths)
    positions = np.repeat(offsets[users] - np.concatenate([[0], np.cumsum(user_lengths)[:-1]]), user_lengths) \
        + np.arange(int(user_lengths.sum()), dtype=np.int64)
    order = np.lexsort((rng.random(positions.shape[0]), owner))
    rank_in_user = np.arange(order.shape[0]) - np.repeat(np.cumsum(user_lengths) - user_lengths, user_lengths)
    held = np.zeros(int(offsets[-1]), dtype=bool)
    held[positions[order][rank_in_user < np.repeat(take, user_lengths)]] = True
    return ValidationSplit(users, held)


def validate(model: SparseAutoencoder, dataset: CsrDataset, split: ValidationSplit, cfg: ValidationConfig,
             amp_dtype: torch.dtype | None = None) -> RankingMetrics:
    """NDCG@K, P@K and R@K of ranking every item for the validation users from their training
    entries (which are excluded from the ranking) against their held-out entries. Leaves the
    model in eval mode (no dropout); the training loop turns it back."""
    return validate_scores(model_scorer(model, amp_dtype), dataset, split, cfg, model.output_range[0], model.parallel)


def validate_scores(score: Scorer, dataset: CsrDataset, split: ValidationSplit, cfg: ValidationConfig,
                    item_start: int = 0, parallel=None) -> RankingMetrics:
    """``validate`` for any model's scores (``score``: a batch of histories -> [B, n_local])."""
    accumulator = MetricsAccumulator([cfg.k], dataset.n_features)
    train_mask = split.train_mask
    for chunk in np.array_split(split.users, max(1, math.ceil(len(split.users) / cfg.batch_size))):
        history = take_rows(dataset, chunk, train_mask)
        _, items = rank(score, history, cfg.k, [history], item_start, parallel)
        offsets, indices, _ = take_rows(dataset, chunk, split.held)
        accumulator.add(items, offsets, indices)
    return accumulator.result()[0]
