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

and a user's scores are their history (0/1) @ B. G + Lambda is factorised and inverted in place
by torch's Cholesky, on the GPU when there is one, in float32: twice float64's speed on a CPU
(many times on a GPU) and half its memory. Whether float32 kept the inverse is measured, not
assumed: the residual (G + Lambda) P - I of a sample of P's columns, in float64, bounds their
relative error (P~ - P = P R). On rating data at the grid's smallest lambda it is about 1e-6; above
``RESIDUAL_TOLERANCE`` the fit is redone in float64 (where the memory allows), so an
ill-conditioned matrix costs time, never accuracy. A matrix that is not positive definite is one
line (``LinearFitError``), never a crash in LAPACK. G itself holds co-occurrence counts, exact in
float32 below 2^24 users, so it is kept in float32 between fits; B is float32.

The settings (lambda, p and which items the solve learns) are chosen on a validation split by
``dlrm.recommender.linear_search``; items by support are ``dlrm.recommender.linear_catalogue``'s.
Memory: ``memory_bytes(n_items, n_users)`` at the peak: G and the matrix inverted in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from dlrm.recommender.csr_dataset import CsrDataset

# Elements of a dense block of G built at once from sparse products: a few hundred MB at most.
_BLOCK_ELEMENTS = 1 << 24


class LinearFitError(ValueError):
    """G + Lambda could not be factorised: the settings, not the code, must change."""


REST_COLUMNS = ("regression", "zero")


@dataclass(frozen=True)
class LinearSettings:
    regularization: float  # lambda, added to every diagonal entry of G
    dropout: float = 0.0  # p in [0, 1): adds p / (1 - p) G_jj to diagonal entry j (EDLAE); 0: EASE
    # Items with fewer users than this leave the item x item solve and get a fallback column
    # (dlrm.recommender.linear_catalogue); 0 and 1 are the exact closed form over every item.
    min_support: int = 0
    rest_columns: str = "regression"  # the columns of those items: "regression" on the learned ones, or "zero"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.regularization) and self.regularization > 0):
            raise ValueError(f"`regularization` must be a number > 0, got {self.regularization!r}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.min_support, bool) or not isinstance(self.min_support, int) or self.min_support < 0:
            raise ValueError(f"`min_support` must be an integer >= 0, got {self.min_support!r}")
        if self.rest_columns not in REST_COLUMNS:
            raise ValueError(f"`rest_columns` must be one of {', '.join(REST_COLUMNS)}, got {self.rest_columns!r}")

    def describe(self) -> str:
        support = (f", items of >= {self.min_support} users (the rest: {self.rest_columns} columns)"
                   if self.min_support > 1 else "")
        return (f"lambda {self.regularization:g}" + (f", dropout {self.dropout:g} (EDLAE)" if self.dropout else
                                                      " (EASE)") + support)


# Counts up to 2^24 are exact in float32: G is float32 for fewer users than that.
_FLOAT32_EXACT_COUNTS = 1 << 24


def gram_dtype(n_users: int) -> torch.dtype:
    """G's dtype: float32 (half the memory) while every count it can hold is exact there."""
    return torch.float32 if n_users < _FLOAT32_EXACT_COUNTS else torch.float64


def memory_bytes(n_items: int, n_users: int = 0, dtype: torch.dtype = torch.float32) -> int:
    """Peak bytes of a fit solved in ``dtype``: G (float32, or float64 from 2^24 users on) and the
    matrix factorised and inverted in place, which becomes B (n_items^2 x 8 in float32); in
    float64 B is a float32 copy beside it (x 16)."""
    g_bytes = gram_dtype(n_users).itemsize
    work = 4 if dtype == torch.float32 else 8 + 4
    return (g_bytes + work) * int(n_items) ** 2


def user_matrix(dataset: CsrDataset, keep: np.ndarray | None = None) -> sp.csr_matrix:
    """X, users x items (float64 0/1, scipy CSR) of ``dataset``'s rows (an item repeated in a row
    counts once), leaving out the stored entries where ``keep`` (bool per entry) is False."""
    offsets = np.asarray(dataset.offsets, dtype=np.int64)
    indices = np.asarray(dataset.indices, dtype=np.int64)
    rows = np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))
    if keep is not None:
        rows, indices = rows[keep], indices[keep]
    users = sp.csr_matrix((np.ones(indices.shape[0], np.float64), (rows, indices)),
                          shape=(len(offsets) - 1, dataset.n_features))
    users.sum_duplicates()
    users.data[:] = 1.0
    return users


def gram(dataset: CsrDataset, keep: np.ndarray | None = None, device: torch.device | str = "cpu",
         items: np.ndarray | None = None, users: sp.csr_matrix | None = None) -> torch.Tensor:
    """G = X^T X on ``device`` (dtype ``gram_dtype``) of ``user_matrix(dataset, keep)`` (or
    ``users``, that matrix made already), over the columns ``items`` (sorted ids; default all):
    [len(items), len(items)]."""
    users = user_matrix(dataset, keep) if users is None else users
    if items is not None:
        users = users[:, items]
    n = users.shape[1]
    by_item = users.T.tocsr()
    result = torch.empty((n, n), dtype=gram_dtype(users.shape[0]), device=device)
    block = max(1, _BLOCK_ELEMENTS // max(n, 1))
    for lo in range(0, n, block):
        result[lo:lo + block] = torch.from_numpy((by_item[lo:lo + block] @ users).toarray()).to(device, result.dtype)
    return result


# Largest 2-norm of a sampled column of (G + Lambda) P~ - I accepted from a float32 inverse P~:
# it bounds that column's error relative to |P| (P~ - P = P R). Measured on rating data: ~1e-6.
RESIDUAL_TOLERANCE = 1e-4
_RESIDUAL_COLUMNS = 64
_RESIDUAL_BLOCK = 1 << 20  # elements of G taken to float64 at once while checking (8 MiB)


def _penalty(g: torch.Tensor, settings: LinearSettings) -> torch.Tensor:
    """Lambda's diagonal, float64: lambda + p / (1 - p) G_jj."""
    return settings.regularization + settings.dropout / (1 - settings.dropout) * g.diagonal().double()


def _inverse(g: torch.Tensor, settings: LinearSettings, dtype: torch.dtype) -> torch.Tensor:
    """(G + diag(Lambda))^-1 in ``dtype``, factorised and inverted in one matrix, in place."""
    matrix = g.to(dtype, copy=True)
    matrix.diagonal().copy_(g.diagonal().double() + _penalty(g, settings))
    # The matrix is symmetric, so its transpose is the same matrix in the column-major order
    # LAPACK works in: torch then factorises and inverts it in place, without a copy of n^2.
    lapack_view = matrix.mT
    info = torch.empty((), dtype=torch.int32, device=g.device)
    torch.linalg.cholesky_ex(lapack_view, out=(lapack_view, info))
    if int(info) != 0:
        raise LinearFitError(f"the item x item matrix G + lambda is not positive definite in "
                             f"{str(dtype).removeprefix('torch.')} (its leading minor {int(info)} is not; "
                             f"{settings.describe()}): raise `regularization`")
    torch.cholesky_inverse(lapack_view, out=lapack_view)
    return matrix  # symmetric: P, whichever order it is read in


def residual(g: torch.Tensor, settings: LinearSettings, p: torch.Tensor, columns: torch.Tensor) -> float:
    """max over ``columns`` j of |(G + diag(Lambda)) P[:, j] - e_j|_2, computed in float64 a block
    of G's rows at a time (P symmetric: its columns are its rows)."""
    n = g.shape[0]
    taken = p[columns].double().T  # [n, c]: the sampled columns of P
    out = torch.empty((n, len(columns)), dtype=torch.float64, device=g.device)
    block = max(1, _RESIDUAL_BLOCK // max(n, 1))
    for lo in range(0, n, block):
        out[lo:lo + block] = g[lo:lo + block].double() @ taken
    out += _penalty(g, settings)[:, None] * taken
    out[columns, torch.arange(len(columns), device=g.device)] -= 1.0
    return float(torch.linalg.vector_norm(out, dim=0).max())


def solve(g: torch.Tensor, settings: LinearSettings, allow_float64: bool = True) -> torch.Tensor:
    """B (float32, on g's device) of the Gram matrix ``g`` (left unchanged): solved in float32, and
    again in float64 when float32's residual is over ``RESIDUAL_TOLERANCE`` or its factorisation
    fails (``allow_float64``: the memory of ``memory_bytes(.., float64)`` is there)."""
    return solve_with_diagonal(g, settings, allow_float64)[0]


def solve_with_diagonal(g: torch.Tensor, settings: LinearSettings,
                        allow_float64: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``solve``'s B and diag(P) (float64): with them P = (I - B) diag(P), so a regression on these
    items (P G_Kj) needs no second inverse."""
    n = g.shape[0]
    columns = torch.unique(torch.linspace(0, n - 1, min(n, _RESIDUAL_COLUMNS), device=g.device).round().long())
    try:
        p = _inverse(g, settings, torch.float32)
        error = residual(g, settings, p, columns)
    except LinearFitError:
        if not allow_float64:
            raise
        error = math.inf
    if not error <= RESIDUAL_TOLERANCE:
        if not allow_float64:
            raise LinearFitError(f"the float32 inverse of G + lambda is off by {error:.1e} (over "
                                 f"{RESIDUAL_TOLERANCE:g}; {settings.describe()}) and float64 does not fit the "
                                 "memory budget: raise `regularization`")
        p = None  # free float32's matrix before float64's is made
        p = _inverse(g, settings, torch.float64)
    diagonal = p.diagonal().to(torch.float64, copy=True)
    p.div_(-p.diagonal().clone())
    weights = p.to(torch.float32)  # p itself in float32: no copy
    del p
    weights.diagonal().zero_()
    block = max(1, _BLOCK_ELEMENTS // max(weights.shape[1], 1))  # isfinite's temporaries take 7 bytes an entry
    if not all(bool(torch.isfinite(weights[lo:lo + block]).all()) for lo in range(0, weights.shape[0], block)):
        raise LinearFitError(f"the linear model's weights overflow float32 ({settings.describe()}): raise "
                             "`regularization`")
    return weights, diagonal


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
