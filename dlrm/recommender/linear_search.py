"""The linear model's settings, chosen on a validation split at a fraction of one solve's cost.

A trial is one closed-form solve, items^3 flops. Three choices keep the search cheap:

1. The search's catalogue. lambda and p are searched on the items of at least ``search_support``
   users: the smallest of the ``min_support`` grid that keeps at most half of the items with a
   user, so a trial costs at most 1/8 of the exact solve (less where the tail is long); a small
   catalogue (``SMALL_CATALOGUE``) is searched whole. The
   items left out get zero columns in the search (no product per trial); the chosen settings are
   then validated once more with their regression columns (``linear_catalogue``), kept when they
   beat zero columns by ``SUPPORT_MARGIN`` (they cost the refit a product).
2. Coordinate ascent: lambda climbs over its grid from the middle at p = 0 (EASE), p over its grid
   from 0 at that lambda, then lambda again at the chosen p. Validation curves over these grids
   are unimodal on the data measured (docs/recommender.md), so this finds the grid's best in
   about half the solves of a full sweep.
3. Then ``min_support`` steps down its grid at the chosen (lambda, p), each step a larger solve,
   while a step beats the last by more than ``SUPPORT_MARGIN`` (relative NDCG@K): learning an
   item of two users costs as much as learning any other, so it must pay for itself. A step's G
   is the last one extended by the items it lacks (``refit_gram``), and the search hands its G to
   the refit, which updates it by the validation users' rows.

Why not one eigendecomposition of G for every lambda: measured on 2 cores of an AVX2-only AMD
EPYC, torch's eigh takes 4.6x a Cholesky factorisation and inverse at 1,682 items and 8.8x at
4,000 (scipy's evd 4x and 6.9x): more than the whole search costs this way.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import scipy.sparse as sp
import torch

from dlrm.recommender.linear import LinearSettings, gram
from dlrm.recommender.linear_catalogue import (CatalogueModel, SearchGram, catalogue, item_support, learned_rows,
                                               refit_gram)
from dlrm.recommender.metrics import RankingMetrics

REGULARIZATIONS = (10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0)  # lambda's grid, as counts of users
DROPOUTS = (0.0, 0.1, 0.25, 0.4, 0.6)  # p's grid (0: EASE)
MIN_SUPPORTS = (1, 2, 5, 10, 20, 50)  # min_support's grid: 1 is the exact closed form
# A smaller min_support is kept only when its validation NDCG@K beats the larger one's by this
# share: below it the difference is noise, and the larger solve is paid at every refit.
SUPPORT_MARGIN = 1e-3
# Catalogues of at most this many items with a user are searched whole: a solve takes under a
# second on 2 CPU cores, and on MovieLens-100k (1,659 such items) the search on the 795 items of
# 20 users or more chose lambda 1,000 and dropout 0.1, test NDCG@10 0.4345 against the whole
# catalogue's lambda 300 and dropout 0.6, 0.4449: too few items to choose the settings on.
SMALL_CATALOGUE = 3000


@dataclass
class Trial:
    settings: LinearSettings
    metrics: RankingMetrics
    seconds: float
    learned_items: int = 0  # items in the trial's solve


@dataclass
class Choice:
    """What ``choose`` tried, in order, and the settings it chose."""

    trials: list[Trial] = field(default_factory=list)
    chosen: LinearSettings | None = None
    # (items, G over them) of the search's last catalogue, for the refit to update (take it: it is
    # the search's largest matrix)
    gram: tuple[np.ndarray, torch.Tensor] | None = None

    @property
    def best(self) -> Trial:
        if self.chosen is not None:
            return self.trial_of(self.chosen)
        return max(self.trials, key=lambda t: (t.metrics.ndcg, -self.trials.index(t)))

    def trial_of(self, settings: LinearSettings) -> Trial | None:
        return next((t for t in self.trials if t.settings == settings), None)


def search_support(support: np.ndarray, grid: tuple[int, ...] = MIN_SUPPORTS,
                   small_catalogue: int = SMALL_CATALOGUE) -> int:
    """The smallest value of ``grid`` that keeps at most half of the items with a user and at
    least half of ``small_catalogue``; the smallest value of ``grid`` (every item with a user) when
    none does, or when at most ``small_catalogue`` items have a user."""
    with_a_user = int((support >= 1).sum())
    if with_a_user <= small_catalogue:
        return min(grid)
    fits = (t for t in sorted(grid) if small_catalogue / 2 <= int((support >= t).sum()) <= with_a_user / 2)
    return next(fits, min(grid))


def _climb(grid: list, start: int, score: Callable[[object], float]):
    """The value of ``grid`` (sorted) where ``score`` stops rising, climbing from ``grid[start]``
    to the better of its neighbours while that one is better."""
    at, best = start, score(grid[start])
    while True:
        neighbours = [i for i in (at - 1, at + 1) if 0 <= i < len(grid)]
        scored = [(score(grid[i]), -abs(i - start), i) for i in neighbours]
        if not scored or max(scored)[0] <= best:
            return grid[at]
        best, _, at = max(scored)


def choose(users: sp.csr_matrix, validate: Callable[[object], RankingMetrics],
           regularizations: tuple[float, ...] = REGULARIZATIONS, dropouts: tuple[float, ...] = DROPOUTS,
           min_supports: tuple[int, ...] = MIN_SUPPORTS, report: Callable[[Trial], None] | None = None,
           allow_float64: bool = True, device: torch.device | str = "cpu",
           small_catalogue: int = SMALL_CATALOGUE) -> Choice:
    """The settings of the best validation NDCG@K (module docstring), from the 0/1 matrix
    ``users`` of the training part of a validation split and ``validate`` (the split's metrics of
    a model with ``scores``). A setting is solved once however often the search visits it;
    ``report`` is called after each trial."""
    choice = Choice()
    support = item_support(users)
    held: dict[int, object] = {}  # min_support -> (catalogue, G over its learned items): one at a time

    def ndcg(settings: LinearSettings) -> float:
        if (done := choice.trial_of(settings)) is not None:
            return done.metrics.ndcg
        started = time.perf_counter()
        if settings.min_support not in held:
            cat = catalogue(support, settings.min_support)
            if held:  # another min_support's G: extended by the items it lacks (refit_gram), not made anew
                (was, g), = held.values()
                held.clear()
                g = refit_gram(users, cat.learned, SearchGram(g, was.learned, users, np.empty(0, np.int64)))
            else:
                g = gram(None, device=device, items=cat.learned, users=users)
            held[settings.min_support] = (cat, g)
            del g
        cat, g = held[settings.min_support]
        metrics = validate(CatalogueModel(learned_rows(users, g, cat, settings, allow_float64), cat, settings))
        choice.trials.append(Trial(settings, metrics, time.perf_counter() - started, len(cat.learned)))
        if report is not None:
            report(choice.trials[-1])
        return metrics.ndcg

    grid, ps, supports = sorted(regularizations), sorted(dropouts), sorted(min_supports)
    t = search_support(support, tuple(supports), small_catalogue)
    lam = _climb(grid, (len(grid) - 1) // 2, lambda v: ndcg(LinearSettings(v, ps[0], t, "zero")))
    p = _climb(ps, 0, lambda v: ndcg(LinearSettings(lam, v, t, "zero")))
    if p != ps[0]:
        lam = _climb(grid, grid.index(lam), lambda v: ndcg(LinearSettings(v, p, t, "zero")))
    best = ndcg(LinearSettings(lam, p, t, "zero"))
    for smaller in reversed([s for s in supports if s < t]):
        score = ndcg(LinearSettings(lam, p, smaller, "zero"))
        if not score > best * (1 + SUPPORT_MARGIN):
            break
        t, best = smaller, score
    chosen = LinearSettings(lam, p, t, "zero")
    if t > 1:  # the rest's regression columns, measured once: kept when they pay for their product
        regression = dataclasses.replace(chosen, rest_columns="regression")
        if ndcg(regression) > best * (1 + SUPPORT_MARGIN):
            chosen = regression
    choice.chosen = chosen
    (cat, g), = held.values()
    choice.gram = (cat.learned, g)
    return choice
