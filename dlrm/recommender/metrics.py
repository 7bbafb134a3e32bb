"""Ranking metrics of top-K recommendations against a held-out split: precision, recall, NDCG
and catalogue coverage at several K, computed batch by batch.

Why these definitions (stated so numbers compare with published top-K results):
- precision@k = hits / k, with k fixed even when fewer than k items were recommended;
- recall@k = hits / min(k, |held-out|): the usual top-K form (also called "R-precision capped
  at k"), so a user with more held-out items than k can still reach 1.0;
- NDCG@k: binary relevance, gain 1 / log2(rank + 1) for a hit at rank 1..k, divided by the
  ideal DCG over min(k, |held-out|) hits;
- coverage@k = distinct items in any user's top k / n_items, over every user passed (also those
  without held-out items: their recommendations are still shown to them).
Users with no held-out items are skipped from precision, recall and NDCG and not counted in
``users``; with no user left the three are 0.0. Held-out items are taken as a set per user.
The recommended ids of a row are assumed distinct (``top_k`` gives distinct ids); -1 = none.

The accumulator keeps each user's values and sums them once at the end, so the result equals
the one-shot computation on the concatenated batches exactly, not just to rounding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass
class RankingMetrics:
    k: int
    precision: float
    recall: float
    ndcg: float
    coverage: float
    users: int


def _as_numpy(x: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu").numpy()
    return np.asarray(x)


def _check_k(k: int) -> int:
    if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"`k` must be an integer >= 1, got {k!r}")
    return int(k)


class MetricsAccumulator:
    """Ranking metrics at each k of ``ks``, accumulated batch by batch: ``add(recommended,
    heldout_offsets, heldout_indices)`` per batch, then ``result()`` (one ``RankingMetrics`` per
    k, in the order of ``ks``). See the module docstring for the definitions."""

    def __init__(self, ks: Sequence[int] | int, n_items: int):
        ks = [ks] if isinstance(ks, (int, np.integer)) else list(ks)
        if not ks:
            raise ValueError("`ks` must name at least one k, e.g. [10]")
        self.ks = [_check_k(k) for k in ks]
        if isinstance(n_items, bool) or not isinstance(n_items, (int, np.integer)) or n_items < 1:
            raise ValueError(f"`n_items` must be an integer >= 1 (the catalogue size), got {n_items!r}")
        self.n_items = int(n_items)
        self._per_user: dict[int, list[np.ndarray]] = {k: [] for k in self.ks}  # [users, 3] per batch
        self._covered = {k: np.zeros(self.n_items, bool) for k in self.ks}

    def add(self, recommended: np.ndarray | torch.Tensor, heldout_offsets: np.ndarray | torch.Tensor,
            heldout_indices: np.ndarray | torch.Tensor) -> None:
        """One batch: ``recommended`` [U, K] global ids best first (-1 = none; fewer than k
        columns count as none beyond them), held-out CSR for the same U users."""
        rec = _as_numpy(recommended)
        if rec.ndim != 2:
            raise ValueError(f"`recommended` must be [users, K], got shape {list(rec.shape)}")
        if not np.issubdtype(rec.dtype, np.integer):
            raise ValueError(f"`recommended` must hold integer item ids, got dtype {rec.dtype}")
        rec = rec.astype(np.int64, copy=False)
        users = rec.shape[0]
        offsets = _as_numpy(heldout_offsets).astype(np.int64, copy=False).reshape(-1)
        indices = _as_numpy(heldout_indices).astype(np.int64, copy=False).reshape(-1)
        if offsets.shape[0] != users + 1:
            raise ValueError(f"`heldout_offsets` must have {users + 1} entries (one more than the rows of "
                             f"`recommended`), got {offsets.shape[0]}")
        offsets = offsets - offsets[0]
        if offsets[-1] != indices.shape[0] or (np.diff(offsets) < 0).any():
            raise ValueError(f"`heldout_offsets` must be non-decreasing and span the {indices.shape[0]} "
                             f"`heldout_indices`")
        n = self.n_items
        if indices.size and (indices.min() < 0 or indices.max() >= n):
            raise ValueError(f"`heldout_indices` must be item ids in [0, n_items = {n}); got "
                             f"{indices.min()} .. {indices.max()}; pass the catalogue size as `n_items`")
        if rec.size and (rec.min() < -1 or rec.max() >= n):
            raise ValueError(f"`recommended` must hold item ids in [0, n_items = {n}) or -1, got "
                             f"{rec.min()} .. {rec.max()}")
        # Held-out as a set per user: sorted distinct keys user * n + item.
        row = np.repeat(np.arange(users, dtype=np.int64), np.diff(offsets))
        held = np.unique(row * n + indices)
        n_held = np.bincount(held // n, minlength=users)
        evaluated = n_held > 0
        for k in self.ks:
            top = rec[:, :k]
            if top.shape[1] < k:
                top = np.concatenate([top, np.full((users, k - top.shape[1]), -1, np.int64)], axis=1)
            valid = top >= 0
            keys = np.arange(users, dtype=np.int64)[:, None] * n + np.where(valid, top, 0)
            pos = np.minimum(np.searchsorted(held, keys), max(held.shape[0] - 1, 0))
            hit = valid & (held[pos] == keys) if held.size else np.zeros_like(valid)
            hits = hit.sum(1)
            discount = 1.0 / np.log2(np.arange(2, k + 2, dtype=np.float64))
            dcg = hit @ discount
            ideal = np.concatenate([[0.0], np.cumsum(discount)])[np.minimum(n_held, k)]
            denominator = np.maximum(np.minimum(n_held, k), 1)
            per_user = np.stack([hits / k, hits / denominator, dcg / np.where(ideal > 0, ideal, 1.0)], axis=1)
            self._per_user[k].append(per_user[evaluated])
            self._covered[k][top[valid]] = True

    def result(self) -> list[RankingMetrics]:
        """One ``RankingMetrics`` per k, in the order of ``ks``."""
        out = []
        for k in self.ks:
            per_user = np.concatenate(self._per_user[k]) if self._per_user[k] else np.zeros((0, 3))
            users = per_user.shape[0]
            means = per_user.sum(0) / users if users else np.zeros(3)
            out.append(RankingMetrics(k, float(means[0]), float(means[1]), float(means[2]),
                                      float(self._covered[k].sum()) / self.n_items, int(users)))
        return out


def ranking_metrics(recommended: np.ndarray | torch.Tensor, heldout_offsets: np.ndarray, heldout_indices: np.ndarray,
                    k: int, n_items: int) -> RankingMetrics:
    """Precision, recall, NDCG and coverage at ``k`` for ``recommended`` [U, >= k] global item ids
    best first (-1 = none) against the held-out CSR (``heldout_offsets`` [U + 1],
    ``heldout_indices``) of the same U users. precision@k = hits / k; recall@k =
    hits / min(k, |held-out|); NDCG@k binary, log2 discount, ideal DCG over min(k, |held-out|)
    items; coverage = distinct recommended items in the top k of all U users / ``n_items``.
    Users with no held-out item are skipped and not counted in ``users``."""
    accumulator = MetricsAccumulator([k], n_items)
    accumulator.add(recommended, heldout_offsets, heldout_indices)
    return accumulator.result()[0]
