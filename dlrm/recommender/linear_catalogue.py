"""Items by support: which items the linear model's item x item solve learns, and how the others
are scored.

Why: a solve costs items^3, and most items of a long-tailed catalogue have one or two users.
Their rows and columns of G are almost empty, they cost as much of the solve as any other, and
their weights can hardly be learned. An item with ``min_support`` users or more in the fitted
data is *learned* (its weights are the closed form over the learned items); the *rest* leave the
solve. A rest item, in a history, adds nothing to the scores (its row of B is 0); as a
recommendation its column (``rest_columns``) is either the closed form's regression of that item on
the learned items, with the same penalty (the exact column were it alone outside the solve), made
from the learned solve by one product, or 0. The search tries its settings with zero columns (no
product per trial) and then measures the regression columns once on validation.

Items with no user have an empty row and column of G, so the exact closed form gives them a zero
row and column: ``min_support`` 1 is exact, and removes those items' share of the cost for free.
The fitted model is the same full [n, n] matrix B as the exact fit's (checkpoints, predict and
evaluate do not change); a trial of the search scores without making it (``CatalogueModel``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from dlrm.recommender.linear import LinearModel, LinearSettings, gram, solve_with_diagonal

# Elements of a band of G's rows made at once from sparse products (a few hundred MB at most).
_BLOCK_ELEMENTS = 1 << 24

def item_support(users: sp.csr_matrix) -> np.ndarray:
    """Users per item (int64 [n_items]) of the 0/1 matrix ``users`` (``linear.user_matrix``)."""
    return np.bincount(users.indices, minlength=users.shape[1]).astype(np.int64)


@dataclass(frozen=True)
class Catalogue:
    learned: np.ndarray  # int64, sorted: the items in the item x item solve
    rest: np.ndarray  # int64, sorted: the others, scored by their fallback column
    n_items: int

    @property
    def exact(self) -> bool:
        return len(self.learned) == self.n_items


def catalogue(support: np.ndarray, min_support: int) -> Catalogue:
    """The items of at least ``min_support`` users and the rest (0: every item is learned)."""
    learned = np.flatnonzero(support >= min_support) if min_support > 0 else np.arange(len(support))
    return Catalogue(learned.astype(np.int64), np.setdiff1d(np.arange(len(support)), learned), len(support))


def learned_rows(users: sp.csr_matrix, g: torch.Tensor, cat: Catalogue, settings: LinearSettings,
                 allow_float64: bool = True) -> torch.Tensor:
    """B's rows of the learned items, [learned, n_items] float32 on g's device, from G over them
    (``g``, left unchanged): the closed form among the learned items, and the rest's columns by
    ``settings.rest_columns``: "regression", each rest item j's column P G_Kj = (I - B) diag(P) G_Kj,
    the regression of j on the learned items with the same penalty, made from the solve's B and
    diagonal by one product; "zero", none (a rest item is not recommended, but for ties at 0)."""
    solved, diagonal = solve_with_diagonal(g, settings, allow_float64)
    if cat.exact:
        return solved
    device = solved.device
    rows = torch.zeros((len(cat.learned), cat.n_items), dtype=torch.float32, device=device)
    rows.index_copy_(1, torch.from_numpy(cat.learned).to(device), solved)
    rest = cat.rest[users[:, cat.rest].getnnz(axis=0) > 0]  # an item of no user has a zero column
    if len(rest) and settings.rest_columns == "regression":
        # Dense: measured faster than torch's and scipy's sparse products even at 5% density.
        co = torch.from_numpy((users[:, cat.learned].T @ users[:, rest]).toarray()).to(device)
        scaled = (co * diagonal[:, None]).float()
        del co
        columns = scaled - solved @ scaled
        rows.index_copy_(1, torch.from_numpy(rest).to(device), columns)
    return rows


@dataclass
class CatalogueModel:
    """A trial's model: B's rows of the learned items (``learned_rows``), scoring a batch of
    histories as the full B would without making B (the rest's rows are 0)."""

    rows: torch.Tensor
    cat: Catalogue
    settings: LinearSettings

    def __post_init__(self) -> None:
        self._position = np.full(self.cat.n_items, -1, np.int64)
        self._position[self.cat.learned] = np.arange(len(self.cat.learned))

    def scores(self, history: tuple) -> torch.Tensor:
        offsets = history[0].to(torch.int64).cpu().numpy()
        position = self._position[history[1].to(torch.int64).cpu().numpy()]
        rows = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
        kept = position >= 0
        learned_offsets = np.concatenate([[0], np.cumsum(np.bincount(rows[kept], minlength=len(offsets) - 1))])
        return LinearModel(self.rows, self.settings).scores((torch.from_numpy(learned_offsets),
                                                             torch.from_numpy(position[kept])))


@dataclass
class SearchGram:
    """What the search leaves for the refit: G of the training part (``users_train``) over the
    items ``learned``, and the users whose rows differ from all of the data (validation's)."""

    g: torch.Tensor
    learned: np.ndarray
    users_train: sp.csr_matrix
    changed_users: np.ndarray


def refit_gram(users: sp.csr_matrix, learned: np.ndarray, search: SearchGram) -> torch.Tensor:
    """G of ``users`` over ``learned`` from the search's G, without the product over every user:
    the search's items keep their block, corrected by the changed users' rows (their training rows
    out, their whole rows in); items the search did not learn get their rows and columns afresh.
    Equal to ``gram(users, items=learned)`` (the counts are exact). Made a band of rows at a time:
    the peak is the two matrices, and the search's is updated in place when the items are the same."""
    device, dtype = search.g.device, search.g.dtype
    kept = np.isin(learned, search.learned)
    old, new = learned[kept], learned[~kept]
    same = len(old) == len(learned) == len(search.learned)
    g = search.g if same else torch.zeros((len(learned), len(learned)), dtype=dtype, device=device)
    at_search = torch.from_numpy(np.searchsorted(search.learned, old)).to(device)
    old_pos = torch.from_numpy(np.flatnonzero(kept)).to(device)
    now, before = users[search.changed_users][:, old], search.users_train[search.changed_users][:, old]
    now_t, before_t = now.T.tocsr(), before.T.tocsr()
    band = max(1, _BLOCK_ELEMENTS // max(len(learned), 1))
    for lo in range(0, len(old), band):
        rows = (torch.from_numpy((now_t[lo:lo + band] @ now - before_t[lo:lo + band] @ before).toarray())
                .to(device, dtype))
        if same:
            g[lo:lo + band] += rows
        else:
            rows += search.g[at_search[lo:lo + band]].index_select(1, at_search)
            wide = torch.zeros((rows.shape[0], len(learned)), dtype=dtype, device=device)
            g.index_copy_(0, old_pos[lo:lo + band], wide.index_copy_(1, old_pos, rows))
    if len(new):
        new_pos = torch.from_numpy(np.flatnonzero(~kept)).to(device)
        cross = torch.from_numpy((users[:, learned].T @ users[:, new]).toarray()).to(device, dtype)  # [learned, new]
        g.index_copy_(1, new_pos, cross)
        g.index_copy_(0, new_pos, cross.T.contiguous())
    return g


def fit(users: sp.csr_matrix, settings: LinearSettings, device: torch.device | str = "cpu",
        allow_float64: bool = True, search: SearchGram | None = None) -> LinearModel:
    """The full model B [n, n] of ``settings`` on the 0/1 matrix ``users``: the closed form over the
    items of at least ``settings.min_support`` users, zero rows and fallback columns for the rest.
    With ``search`` (the search's G), G is updated from it rather than made anew (``refit_gram``).
    Peak memory: G and the solve over the learned items, then their rows and B."""
    cat = catalogue(item_support(users), settings.min_support)
    n_search, n = len(search.learned) if search is not None else 0, len(cat.learned)
    n_new = n - int(np.isin(cat.learned, search.learned).sum()) if search is not None else 0
    # refit_gram's peak (the search's G, the new G, the new items' columns) within the 8 n^2 bytes
    # of a fit (linear.memory_bytes); else G is made anew.
    if search is not None and n_search**2 + n**2 + n * n_new <= 2 * cat.n_items**2:
        g = refit_gram(users, cat.learned, search)
        search.g = None  # consumed: its memory is the solve's
    else:
        g = gram(None, device=device, items=None if cat.exact else cat.learned, users=users)
    rows = learned_rows(users, g, cat, settings, allow_float64)
    del g
    if cat.exact:
        return LinearModel(rows, settings)
    weights = torch.zeros((cat.n_items, cat.n_items), dtype=torch.float32, device=rows.device)
    weights.index_copy_(0, torch.from_numpy(cat.learned).to(rows.device), rows)
    return LinearModel(weights, settings)
