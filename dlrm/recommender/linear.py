"""The linear item-item recommender: one item x item weight matrix B, in closed form, with its
settings chosen on a validation split. It is the recommender's model where B fits in memory;
the item-parallel autoencoder is the model of catalogues too large for it.

Why it is a model of the product and not only a baseline: on real rating data of up to tens of
thousands of items, Steck's closed-form linear autoencoders rank better than trained deep
autoencoders (EASE, "Embarrassingly Shallow Autoencoders for Sparse Data", WWW 2019; EDLAE,
"Autoencoders that don't overfit towards the Identity", NeurIPS 2020), and fit in seconds.

With G = X^T X (X: users x items, 0/1) and the penalty Lambda = lambda + p / (1 - p) diag(G)
(``regularization`` lambda; ``dropout`` p, the emphasised denoising of EDLAE; p = 0 is EASE):

    P = (G + diag(Lambda))^-1,   B = -P / diag(P) (column j divided by P_jj),   diag(B) = 0

and a user's scores are their history (0/1) @ B. G + Lambda is factorised and inverted in
float64 (its condition number grows as lambda shrinks, and float32 loses the inverse first) by
torch's Cholesky, in place, on the GPU when there is one; a matrix that is not positive definite
is one line (``LinearFitError``), never a crash in LAPACK. G itself holds co-occurrence counts,
exact in float32 below 2^24 users, so it is kept in float32 between fits; B is float32.

``choose`` picks (lambda, p) by NDCG@K on a validation split of the training data
(``dlrm.recommender.validation``): lambda over a grid at p = 0, then p at the best lambda, then
lambda again around the best at that p; the model is then refitted on all the training data.
Memory: ``memory_bytes(n_items, n_users)`` at the peak: G, one float64 matrix and B.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import scipy.sparse as sp
import torch

from dlrm.recommender.csr_dataset import CsrDataset
from dlrm.recommender.metrics import RankingMetrics

REGULARIZATIONS = (10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0)  # lambda's grid, as counts of users
DROPOUTS = (0.0, 0.1, 0.25, 0.4, 0.6)  # p's grid (0: EASE)
# Elements of a dense block of G built at once from sparse products: a few hundred MB at most.
_BLOCK_ELEMENTS = 1 << 24


class LinearFitError(ValueError):
    """G + Lambda could not be factorised: the settings, not the code, must change."""


@dataclass(frozen=True)
class LinearSettings:
    regularization: float  # lambda, added to every diagonal entry of G
    dropout: float = 0.0  # p in [0, 1): adds p / (1 - p) G_jj to diagonal entry j (EDLAE); 0: EASE

    def __post_init__(self) -> None:
        if not (math.isfinite(self.regularization) and self.regularization > 0):
            raise ValueError(f"`regularization` must be a number > 0, got {self.regularization!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout!r}")

    def describe(self) -> str:
        return (f"lambda {self.regularization:g}" + (f", dropout {self.dropout:g} (EDLAE)" if self.dropout else
                                                      " (EASE)"))


# Counts up to 2^24 are exact in float32: G is float32 for fewer users than that.
_FLOAT32_EXACT_COUNTS = 1 << 24


def gram_dtype(n_users: int) -> torch.dtype:
    """G's dtype: float32 (half the memory) while every count it can hold is exact there."""
    return torch.float32 if n_users < _FLOAT32_EXACT_COUNTS else torch.float64


def memory_bytes(n_items: int, n_users: int = 0) -> int:
    """Peak bytes of a fit, n_items^2 x 16 (x 20 from 2^24 users on): G (float32, or float64),
    the float64 matrix factorised and inverted in place, and B in float32."""
    g_bytes = gram_dtype(n_users).itemsize
    return (g_bytes + 8 + 4) * int(n_items) ** 2


def gram(dataset: CsrDataset, keep: np.ndarray | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """G = X^T X, [n_items, n_items] on ``device`` (dtype ``gram_dtype``), of the 0/1 matrix of ``dataset``'s
    rows (an item repeated in a row counts once), leaving out the stored entries where ``keep``
    (bool per entry) is False."""
    n = dataset.n_features
    offsets = np.asarray(dataset.offsets, dtype=np.int64)
    indices = np.asarray(dataset.indices, dtype=np.int64)
    rows = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))
    if keep is not None:
        rows, indices = rows[keep], indices[keep]
    users = sp.csr_matrix((np.ones(indices.shape[0], np.float64), (rows, indices)), shape=(len(offsets) - 1, n))
    users.sum_duplicates()
    users.data[:] = 1.0
    by_item = users.T.tocsr()
    result = torch.empty((n, n), dtype=gram_dtype(len(offsets) - 1), device=device)
    block = max(1, _BLOCK_ELEMENTS // max(n, 1))
    for lo in range(0, n, block):
        result[lo:lo + block] = torch.from_numpy((by_item[lo:lo + block] @ users).toarray()).to(device, result.dtype)
    return result


def solve(g: torch.Tensor, settings: LinearSettings) -> torch.Tensor:
    """B (float32, on g's device) of the Gram matrix ``g`` (left unchanged)."""
    matrix = g.to(torch.float64, copy=True)
    diagonal = matrix.diagonal()
    diagonal.add_(settings.regularization + settings.dropout / (1 - settings.dropout) * diagonal)
    # The matrix is symmetric, so its transpose is the same matrix in the column-major order
    # LAPACK works in: torch then factorises and inverts it in place, without a copy of n^2.
    lapack_view = matrix.mT
    info = torch.empty((), dtype=torch.int32, device=g.device)
    torch.linalg.cholesky_ex(lapack_view, out=(lapack_view, info))
    if int(info) != 0:
        raise LinearFitError(f"the item x item matrix G + lambda is not positive definite in float64 (its leading "
                             f"minor {int(info)} is not; {settings.describe()}): raise `regularization`")
    torch.cholesky_inverse(lapack_view, out=lapack_view)
    p = matrix  # symmetric: P, whichever order it is read in
    p.div_(-p.diagonal().clone())
    weights = p.to(torch.float32)
    del p, matrix, lapack_view
    weights.diagonal().zero_()
    block = max(1, _BLOCK_ELEMENTS // max(weights.shape[1], 1))  # isfinite's temporaries take 7 bytes an entry
    if not all(bool(torch.isfinite(weights[lo:lo + block]).all()) for lo in range(0, weights.shape[0], block)):
        raise LinearFitError(f"the linear model's weights overflow float32 ({settings.describe()}): raise "
                             "`regularization`")
    return weights


@dataclass
class LinearModel:
    """The item x item weights of the items [item_start, item_start + n_local) this process
    scores (all of them on one process): ``weights`` float32 [n_items, n_local]."""

    weights: torch.Tensor
    settings: LinearSettings
    item_start: int = 0

    @property
    def n_items(self) -> int:
        return self.weights.shape[0]

    def scores(self, history: tuple) -> torch.Tensor:
        """[B, n_local] float32: the sum of B's rows over each user's distinct history items (a
        bag of rows: the cost is the history's length, not the catalogue's, per user)."""
        offsets, indices = history[0].to(torch.int64), history[1].to(torch.int64)
        device = self.weights.device
        lengths = offsets[1:] - offsets[:-1]
        rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths.cpu())
        keys = torch.unique(rows * self.n_items + indices.cpu())  # sorted: by row, a repeated item once
        counts = torch.bincount(keys // self.n_items, minlength=len(lengths))
        starts = torch.cumsum(counts, 0) - counts
        return torch.nn.functional.embedding_bag((keys % self.n_items).to(device), self.weights,
                                                 starts.to(device), mode="sum")

    def column_slice(self, start: int, stop: int) -> "LinearModel":
        """The items [start, stop) of this model's: what one process of several scores."""
        return LinearModel(self.weights[:, start:stop].contiguous(), self.settings, self.item_start + start)

    def to(self, device: torch.device | str) -> "LinearModel":
        return LinearModel(self.weights.to(device), self.settings, self.item_start)


@dataclass
class Trial:
    settings: LinearSettings
    metrics: RankingMetrics
    seconds: float


@dataclass
class Choice:
    """What ``choose`` tried, in order, and the best of it by validation NDCG@K."""

    trials: list[Trial] = field(default_factory=list)

    @property
    def best(self) -> Trial:
        return max(self.trials, key=lambda t: (t.metrics.ndcg, -self.trials.index(t)))

    def tried(self, settings: LinearSettings) -> bool:
        return any(t.settings == settings for t in self.trials)


def choose(g: torch.Tensor, validate: Callable[[LinearModel], RankingMetrics],
           regularizations: tuple[float, ...] = REGULARIZATIONS, dropouts: tuple[float, ...] = DROPOUTS,
           report: Callable[[Trial], None] | None = None) -> Choice:
    """The settings of the best validation NDCG@K, from the Gram matrix ``g`` of the training
    part of a validation split and ``validate`` (the split's NDCG@K of a model): lambda over
    ``regularizations`` at p = 0 (EASE), p over ``dropouts`` at the best lambda, then lambda's
    grid neighbours of the best at that p. ``report`` is called after each trial."""
    choice = Choice()

    def trial(settings: LinearSettings) -> None:
        if choice.tried(settings):
            return
        started = time.perf_counter()
        metrics = validate(LinearModel(solve(g, settings), settings))
        choice.trials.append(Trial(settings, metrics, time.perf_counter() - started))
        if report is not None:
            report(choice.trials[-1])

    grid = sorted(regularizations)
    for lam in grid:
        trial(LinearSettings(lam))
    lam = choice.best.settings.regularization
    for p in dropouts:
        trial(LinearSettings(lam, p))
    best = choice.best.settings
    if best.dropout:
        at = grid.index(best.regularization)
        for neighbour in grid[max(0, at - 1):at + 2]:
            trial(LinearSettings(neighbour, best.dropout))
    return choice
