"""Baselines for the sparse autoencoder recommender: item popularity, item-item kNN, implicit
matrix factorisation (ALS) and EASE, fitted on the input part of a held-out split.

Why: an autoencoder's precision@K means little alone; these are the standard yardsticks for
top-K recommendation from implicit feedback. Each baseline turns a batch of user histories
(batch-relative CSR ``offsets`` [B + 1], ``indices``, as ``CsrDataset.batch`` gives them) into
scores [B, n_items] (float32 torch), so the same ``exclude_`` + ``top_k`` + metrics path that
evaluates the autoencoder evaluates them. All run on the CPU with numpy, scipy and torch.

Interactions are binary: values (ratings) are ignored and an item repeated in a history counts
once (except for ``Popularity``, which counts interactions).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch

from dlrm.recommender.csr_dataset import CsrRows
from dlrm.recommender.topk import top_k

# Elements of the dense temporaries that a fit step builds at once (similarity blocks, padded
# factor gathers): bounds memory to a few hundred MB whatever the catalogue size.
_BLOCK_ELEMENTS = 1 << 24


def _as_numpy(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").numpy()
    return np.asarray(x)


def _binary_csr(offsets: np.ndarray | torch.Tensor, indices: np.ndarray | torch.Tensor, n_items: int) -> sp.csr_matrix:
    """Users x items 0/1 matrix (float32, duplicates merged, column ids sorted) of a CSR batch."""
    offsets = _as_numpy(offsets).astype(np.int64, copy=False).reshape(-1)
    indices = _as_numpy(indices).astype(np.int64, copy=False).reshape(-1)
    if offsets.shape[0] < 1:
        raise ValueError("`offsets` must have at least one entry (batch size + 1)")
    offsets = offsets - offsets[0]
    if offsets[-1] != indices.shape[0] or (np.diff(offsets) < 0).any():
        raise ValueError(f"`offsets` must be non-decreasing and span the {indices.shape[0]} `indices`")
    if indices.size and (indices.min() < 0 or indices.max() >= n_items):
        raise ValueError(f"`indices` must be item ids in [0, {n_items}) (the fitted catalogue), got "
                         f"{indices.min()} .. {indices.max()}")
    matrix = sp.csr_matrix((np.ones(indices.shape[0], np.float32), indices, offsets),
                           shape=(offsets.shape[0] - 1, n_items))
    matrix.sum_duplicates()  # also sorts the column ids of each row
    matrix.data[:] = 1.0
    return matrix


def _check_rows(rows: CsrRows) -> None:
    if not isinstance(rows, CsrRows):
        raise ValueError(f"`rows` must be CsrRows (e.g. CsrDataset(path).rows()), got {type(rows).__name__}")
    if rows.n_features < 1:
        raise ValueError(f"`rows` must have n_features >= 1 (the catalogue size), got {rows.n_features}")


def _check_number(name: str, value: float, low: float, strict: bool = False, integer: bool = False) -> None:
    kind = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    bad = isinstance(value, bool) or not isinstance(value, kind) or not np.isfinite(value) \
        or (value <= low if strict else value < low)
    if bad:
        raise ValueError(f"`{name}` must be {'an integer' if integer else 'a number'} {'>' if strict else '>='} "
                         f"{low}, got {value!r}")


class Popularity:
    """Every user gets the same scores: how often each item occurs in the training rows."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # float32 [n_items]
        self.n_items = 0

    def fit(self, rows: CsrRows) -> "Popularity":
        _check_rows(rows)
        indices = np.asarray(rows.indices, dtype=np.int64)
        if indices.size and (indices.min() < 0 or indices.max() >= rows.n_features):
            raise ValueError(f"`rows` holds item ids outside [0, {rows.n_features})")
        self.n_items = rows.n_features
        self.counts = torch.from_numpy(np.bincount(indices, minlength=self.n_items).astype(np.float32))
        return self

    def scores(self, offsets: np.ndarray | torch.Tensor, indices: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[B, n_items]: the counts in every row (a fresh tensor: ``exclude_`` may write into it)."""
        if self.counts is None:
            raise RuntimeError("Popularity is not fitted; call `fit(rows)` first")
        batch = _binary_csr(offsets, indices, self.n_items).shape[0]
        return self.counts.unsqueeze(0).repeat(batch, 1)


class ItemKNN:
    """Item-item kNN on the binary user x item matrix.

    Similarity s(i, j) = |U_i & U_j| / (sqrt(|U_i|) sqrt(|U_j|) + shrink) (cosine, shrunk towards
    0 for rarely seen items). Each item j keeps its ``neighbours`` most similar other items N(j)
    (positive similarity only; ties to the lower id); a user's score for j is the sum of
    s(i, j) over the items i of their history that are in N(j) (the item-based prediction of
    Sarwar et al. 2001, unnormalised, as in top-N kNN recommenders).

    The fit never holds the n_items x n_items similarity: it takes target items in blocks, gets
    their co-occurrence counts with every item by one sparse product (cost: the sum over users
    of |block items in the history| x |history|), prunes each block to its top neighbours and
    keeps only those. ``weights`` is the pruned matrix W (scipy CSR, W[i, j] = s(i, j) for
    i in N(j)), so scores = history (0/1) @ W. At MovieLens-20M size (16 M training interactions,
    27,278 items) the fit takes about 60 s on 2 CPU cores (mostly scipy's single-threaded sparse
    products) and peaks at 1.6 GB.
    """

    def __init__(self) -> None:
        self.weights: sp.csr_matrix | None = None
        self.n_items = 0

    def fit(self, rows: CsrRows, neighbours: int = 100, shrink: float = 10.0) -> "ItemKNN":
        _check_rows(rows)
        _check_number("neighbours", neighbours, 1, integer=True)
        _check_number("shrink", shrink, 0.0)
        n = self.n_items = rows.n_features
        users = _binary_csr(rows.offsets, rows.indices, n)
        by_item = users.T.tocsr()  # items x users
        norms = np.sqrt(np.diff(by_item.indptr).astype(np.float32))
        block = max(1, _BLOCK_ELEMENTS // n)
        keep_rows, keep_cols, keep_values = [], [], []
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            counts = (by_item[lo:hi] @ users).toarray()  # [targets, items] co-occurrences
            denominator = norms[lo:hi, None] * norms[None, :] + np.float32(shrink)
            similarity = torch.from_numpy(counts / np.where(denominator > 0, denominator, np.float32(1.0)))
            similarity[similarity <= 0] = float("-inf")  # never seen together: not a neighbour
            similarity[torch.arange(hi - lo), torch.arange(lo, hi)] = float("-inf")  # nor the item itself
            values, ids = top_k(similarity, int(neighbours))
            kept = ids >= 0
            keep_rows.append(ids[kept].numpy())  # the neighbour i ...
            keep_cols.append(torch.arange(lo, hi).unsqueeze(1).expand_as(ids)[kept].numpy())  # ... of target j
            keep_values.append(values[kept].numpy())
        cat = (lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype))
        self.weights = sp.csr_matrix((cat(keep_values, np.float32), (cat(keep_rows, np.int64), cat(keep_cols, np.int64))),
                                     shape=(n, n))
        return self

    def scores(self, offsets: np.ndarray | torch.Tensor, indices: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[B, n_items]: sum of the similarities of each user's items to every item."""
        if self.weights is None:
            raise RuntimeError("ItemKNN is not fitted; call `fit(rows)` first")
        history = _binary_csr(offsets, indices, self.n_items)
        return torch.from_numpy(np.ascontiguousarray((history @ self.weights).toarray(), dtype=np.float32))


def _als_solve(fixed: torch.Tensor, offsets: np.ndarray, indices: np.ndarray, regularization: float,
               alpha: float) -> torch.Tensor:
    """One ALS half-step: for each row r of the CSR (items or users it interacted with), the exact
    minimiser x_r of sum_j c_rj (p_rj - x_r . f_j)^2 + reg |x_r|^2 over all j, with p = 1 and
    c = 1 + alpha on the row's entries, p = 0 and c = 1 elsewhere:

        (F^T F + alpha F_r^T F_r + reg I) x_r = (1 + alpha) sum_{j in row} f_j

    F^T F is shared (Hu, Koren & Volinsky's trick), so a row costs |row| f^2 + f^3 / 3. Rows are
    sorted by length and solved in chunks: their factors are gathered into a zero-padded
    [chunk, longest, f] block (similar lengths, little padding), the Gram matrices come from one
    batched matmul and the systems from one batched Cholesky solve. Empty rows get 0. At
    MovieLens-20M size with f = 64 on 2 CPU cores a full iteration (both half-steps) takes about
    10 s (100 s for the default 10 iterations), much of it in the batched Cholesky solves."""
    n_fixed, f = fixed.shape
    lengths = np.diff(offsets)
    out = torch.zeros((lengths.shape[0], f), dtype=torch.float32)
    base = (fixed.double().T @ fixed.double() + regularization * torch.eye(f, dtype=torch.float64)).float()
    # A column of ones makes one batched matmul give both the Gram matrix and the sum of the
    # row's factors; id n_fixed is the padding row (all zeros, ones column included).
    padded_fixed = torch.cat([torch.cat([fixed, fixed.new_ones((n_fixed, 1))], 1), fixed.new_zeros((1, f + 1))])
    order = np.argsort(lengths, kind="stable")
    order = order[lengths[order] > 0]
    max_rows = max(1, _BLOCK_ELEMENTS // (4 * f * f))
    p = 0
    while p < order.shape[0]:
        count = min(max_rows, order.shape[0] - p)
        while count > 1 and count * int(lengths[order[p + count - 1]]) * f > _BLOCK_ELEMENTS:
            count = max(1, count // 2)
        rows = order[p:p + count]
        longest = int(lengths[rows[-1]])
        column = np.arange(longest)
        present = column[None, :] < lengths[rows, None]
        where = np.where(present, offsets[rows, None] + column[None, :], 0)
        ids = torch.from_numpy(np.where(present, indices[where], n_fixed))
        gathered = padded_fixed[ids]  # [count, longest, f + 1]
        gram = torch.bmm(gathered.transpose(1, 2), gathered)  # [count, f + 1, f + 1]
        system = base + alpha * gram[:, :f, :f]
        rhs = (1.0 + alpha) * gram[:, :f, f:]  # sum of the row's factors, [count, f, 1]
        factor, info = torch.linalg.cholesky_ex(system)
        if bool((info != 0).any()):  # not positive definite in float32 (reg ~ 0): a general solve
            out[torch.from_numpy(rows)] = torch.linalg.solve(system, rhs).squeeze(2)
        else:
            out[torch.from_numpy(rows)] = torch.cholesky_solve(rhs, factor).squeeze(2)
        p += count
    return out


class ImplicitMF:
    """Implicit-feedback matrix factorisation by alternating least squares (Hu, Koren & Volinsky
    2008): preference p = 1 on observed items, 0 elsewhere; confidence 1 + alpha on observed,
    1 elsewhere; loss sum c (p - x_u . y_i)^2 + regularization (|X|^2 + |Y|^2). Exact solves
    (batched Cholesky, float32) rather than conjugate gradient: each half-step is the exact
    minimiser, so the loss never goes up, and plain torch suffices. Item factors start as
    N(0, 0.01^2); each iteration solves users, then items.

    ``scores`` computes each user's factor from the history it is given (one least-squares solve
    against the fixed item factors, the same equation as a fit step), so users outside the
    fitted set, or with a changed history, are scored without refitting.
    """

    def __init__(self) -> None:
        self.user_factors: torch.Tensor | None = None  # [n_users, factors], from the last user step
        self.item_factors: torch.Tensor | None = None  # [n_items, factors]
        self.regularization = 0.05
        self.alpha = 10.0
        self.n_items = 0

    def fit(self, rows: CsrRows, factors: int = 64, iterations: int = 10, regularization: float = 0.05,
            alpha: float = 10.0, seed: int = 0) -> "ImplicitMF":
        _check_rows(rows)
        _check_number("factors", factors, 1, integer=True)
        _check_number("iterations", iterations, 0, integer=True)
        _check_number("regularization", regularization, 0.0, strict=True)
        _check_number("alpha", alpha, 0.0)
        self.n_items, self.regularization, self.alpha = rows.n_features, float(regularization), float(alpha)
        users = _binary_csr(rows.offsets, rows.indices, self.n_items)
        by_item = users.T.tocsr()
        user_csr = (users.indptr.astype(np.int64), users.indices.astype(np.int64))
        item_csr = (by_item.indptr.astype(np.int64), by_item.indices.astype(np.int64))
        generator = torch.Generator().manual_seed(int(seed))
        item_factors = 0.01 * torch.randn((self.n_items, int(factors)), generator=generator)
        user_factors = torch.zeros((users.shape[0], int(factors)))
        for _ in range(int(iterations)):
            user_factors = _als_solve(item_factors, *user_csr, self.regularization, self.alpha)
            item_factors = _als_solve(user_factors, *item_csr, self.regularization, self.alpha)
        self.user_factors, self.item_factors = user_factors, item_factors
        return self

    def user_factors_for(self, offsets: np.ndarray | torch.Tensor, indices: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[B, factors]: each history's least-squares user factor against the item factors."""
        if self.item_factors is None:
            raise RuntimeError("ImplicitMF is not fitted; call `fit(rows)` first")
        history = _binary_csr(offsets, indices, self.n_items)
        return _als_solve(self.item_factors, history.indptr.astype(np.int64), history.indices.astype(np.int64),
                          self.regularization, self.alpha)

    def scores(self, offsets: np.ndarray | torch.Tensor, indices: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[B, n_items]: user factor (from the history) @ item factors.T."""
        return self.user_factors_for(offsets, indices) @ self.item_factors.T


# EASE's default bound on its item x item matrices: 12 GiB is a catalogue of up to 32,768 items,
# which covers MovieLens-20M (27,278 items, 8.3 GiB).
EASE_MAX_MEMORY_BYTES = 12 << 30


def ease_memory_bytes(n_items: int) -> int:
    """Peak bytes of ``EASE.fit``'s dense matrices for ``n_items``: the float64 Gram matrix,
    inverted in place, and the float32 B built from it, n_items^2 x (8 + 4). (Beside them: the
    sparse histories and block temporaries, a few hundred MB.)"""
    return 12 * int(n_items) ** 2


def memory_size(size: float) -> str:
    """``size`` bytes for a message, in the largest binary unit it reaches (8.3 GiB, 2.9 MiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size:.0f} bytes"


class EASE:
    """Steck's EASE ("Embarrassingly Shallow Autoencoders for Sparse Data", WWW 2019): an item x
    item weight matrix B with a zero diagonal, the minimiser of |X - X B|^2 + lambda |B|^2, in
    closed form:

        G = X^T X + lambda I,  P = G^-1,  B = -P / diag(P) (column j divided by P_jj),  diag(B) = 0

    and a user's scores are their history (0/1) @ B. ``regularization`` is lambda.

    G is built from sparse products in blocks of items and held in float64: this baseline is the
    plain float64 reference beside the product's linear model (``dlrm.recommender.linear``),
    which solves in float32 and checks its residual. It is factorised (Cholesky) and
    inverted in place by torch's LAPACK, so the inverse costs no second float64 matrix; B is kept in
    float32 (the scores are float32 anyway, and ranking reads a row of B per history item: half
    the bytes of float64). Memory: ``ease_memory_bytes`` (n_items^2 x 12 bytes at the peak, n_items^2 x 4 after
    the fit); ``fit`` refuses a catalogue above ``max_memory_bytes``. Time: the inverse is about
    n_items^3 flops, the Gram matrix about the sum over users of |history|^2.
    """

    def __init__(self) -> None:
        self.weights: torch.Tensor | None = None  # B, float32 [n_items, n_items]
        self.n_items = 0

    def fit(self, rows: CsrRows, regularization: float = 250.0,
            max_memory_bytes: int = EASE_MAX_MEMORY_BYTES) -> "EASE":
        _check_rows(rows)
        _check_number("regularization", regularization, 0.0, strict=True)
        _check_number("max_memory_bytes", max_memory_bytes, 0.0)
        n = rows.n_features
        need = ease_memory_bytes(n)
        if need > max_memory_bytes:
            raise ValueError(f"EASE on a catalogue of {n:,} items needs {memory_size(need)} (n_items^2 x 12 bytes: a "
                             f"float64 and a float32 item x item matrix), over the limit of "
                             f"{memory_size(max_memory_bytes)} (`max_memory_bytes`); raise the limit if the machine "
                             f"has the memory, leave EASE out, or use a smaller catalogue")
        users = _binary_csr(rows.offsets, rows.indices, n)
        by_item = users.T.tocsr()
        gram = np.empty((n, n), np.float64)
        block = max(1, _BLOCK_ELEMENTS // n)
        for lo in range(0, n, block):
            gram[lo:lo + block] = (by_item[lo:lo + block] @ users).toarray()  # co-occurrence counts
        gram.flat[::n + 1] += regularization
        # torch's LAPACK, not scipy's: scipy's bundled OpenBLAS crashes the process (a segmentation
        # fault, nothing to catch) in its threaded dpotrf on catalogues of tens of thousands of
        # items. LAPACK works on the column-major view gram.T, the same symmetric matrix, in place.
        lapack_view = torch.from_numpy(gram).mT
        info = torch.empty((), dtype=torch.int32)
        torch.linalg.cholesky_ex(lapack_view, out=(lapack_view, info))
        if int(info) != 0:
            raise ValueError(f"EASE: X^T X + `regularization` I is not positive definite in float64 (LAPACK info "
                             f"{int(info)}); raise `regularization` (now {regularization})")
        torch.cholesky_inverse(lapack_view, out=lapack_view)
        inverse = gram  # P, symmetric, in place of G
        del lapack_view
        diagonal = inverse.diagonal().copy()
        weights = np.empty((n, n), np.float32)
        for lo in range(0, n, block):
            hi = min(lo + block, n)
            weights[lo:hi] = inverse[lo:hi] / -diagonal  # torch's inverse fills both triangles
            weights[np.arange(lo, hi), np.arange(lo, hi)] = 0.0
        del inverse
        self.n_items, self.weights = n, torch.from_numpy(weights)
        return self

    def scores(self, offsets: np.ndarray | torch.Tensor, indices: np.ndarray | torch.Tensor) -> torch.Tensor:
        """[B, n_items]: history (0/1) @ B, as a sum of B's rows per user (``embedding_bag``)."""
        if self.weights is None:
            raise RuntimeError("EASE is not fitted; call `fit(rows)` first")
        history = _binary_csr(offsets, indices, self.n_items)
        return torch.nn.functional.embedding_bag(torch.from_numpy(history.indices.astype(np.int64)), self.weights,
                                                 torch.from_numpy(history.indptr[:-1].astype(np.int64)), mode="sum")


Baseline = Popularity | ItemKNN | ImplicitMF | EASE


def fit_baseline(name: str, rows: CsrRows, **kwargs) -> Baseline:
    """A fitted baseline by name: "popularity", "itemknn" (kwargs: neighbours, shrink), "mf"
    (kwargs: factors, iterations, regularization, alpha, seed) or "ease" (kwargs:
    regularization, max_memory_bytes)."""
    kinds = {"popularity": Popularity, "itemknn": ItemKNN, "mf": ImplicitMF, "ease": EASE}
    if name not in kinds:
        raise ValueError(f"`name` must be one of {', '.join(repr(k) for k in kinds)}, got {name!r}")
    return kinds[name]().fit(rows, **kwargs)
