"""A trained recommender in memory: ``load(checkpoint)`` gives a ``Recommender`` whose
``recommend(histories, k)`` returns the top K items of each history as arrays, with no files
written. It serves either model kind a checkpoint holds (the linear item-item model or the
autoencoder), built from the checkpoint alone.

Why it scores through ``dlrm.recommender.predict.rank`` and ``checkpoint.load_scorer``: those are
what the predict job runs, so a list from here is the list ``recommender_predict`` writes for the
same history (same scores, same exclusion, same tie rule), not a second implementation.

    from dlrm.recommender import load

    rec = load("ckpt/rec")
    ids, scores = rec.recommend([[3, 17, 42], [5]], k=10)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

# Users scored at once: the predict job's default (``PredictConfig.batch_size``).
DEFAULT_BATCH_SIZE = 1024


@dataclass(frozen=True)
class Recommender:
    """The model of one checkpoint, scoring on one process.

    ``path``: the checkpoint directory it was read from; ``kind``: "linear" or "autoencoder";
    ``n_items``: the items it scores and recommends (ids 0 .. n_items - 1); ``n_inputs``: the
    items a history may hold (``n_items`` but for an autoencoder trained on a separate target
    dataset)."""

    path: str
    kind: str
    n_items: int
    n_inputs: int
    score: Callable[[Any], Any] = field(repr=False)  # a batch's CSR -> scores [B, n_items]

    def recommend(self, histories: Sequence[Sequence[int]], k: int = 10, exclude_seen: bool = True, *,
                  values: Sequence[Sequence[float]] | None = None, exclude: Sequence[Sequence[int]] | None = None,
                  batch_size: int = DEFAULT_BATCH_SIZE) -> tuple[np.ndarray, np.ndarray]:
        """(ids [n, k] int64, scores [n, k] float32), best first, for each of the n ``histories``.

        A history is a list or 1-D array of item ids: column numbers of the checkpoint's items,
        as in the CSR datasets the predict job reads (item names are not taken here, as the
        predict job takes none: map them with the dataset's features index,
        ``dlrm.recommender.dsstne_text.NameIndex.load(path)[name]``, and back with its
        ``labels``). ``values`` gives each history's values (ratings) where the dataset has them;
        without it every item counts 1. ``exclude_seen`` leaves each history's own items out,
        ``exclude`` (a list of ids per history) further items, as the predict job's ``filter``.
        Ties go to the lower id; where fewer than k items are left, the rest of the row is
        id -1 with score -inf."""
        from dlrm.recommender.predict import rank

        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"`k` must be an integer >= 1, got {k!r}")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"`batch_size` must be an integer >= 1, got {batch_size!r}")
        if values is not None and len(values) != len(histories):
            raise ValueError(f"`values` has {len(values)} rows for {len(histories)} `histories`: give one per history")
        if exclude is not None and len(exclude) != len(histories):
            raise ValueError(f"`exclude` has {len(exclude)} rows for {len(histories)} `histories`: give one per "
                             "history")
        ids = np.full((len(histories), k), -1, np.int64)
        scores = np.full((len(histories), k), -np.inf, np.float32)
        for lo in range(0, len(histories), batch_size):
            hi = min(lo + batch_size, len(histories))
            history = _csr("histories", histories[lo:hi], self.n_inputs, None if values is None else values[lo:hi])
            filters = [history] if exclude_seen else []
            if exclude is not None:
                filters.append(_csr("exclude", exclude[lo:hi], self.n_items))
            top_values, top_items = rank(self.score, history, k, filters)
            width = top_items.shape[1]  # fewer than k when the catalogue is smaller
            ids[lo:hi, :width] = top_items.numpy()
            scores[lo:hi, :width] = top_values.numpy()
        return ids, scores


def load(checkpoint: str | os.PathLike, device: str = "cpu", best: bool = True) -> Recommender:
    """The model of the checkpoint at ``checkpoint`` (a ``save_checkpoint_path`` of a training
    run) as a ``Recommender`` on ``device``. With ``best`` the run's best validation
    (PATH.best) is taken when it kept one, as the predict job takes it; ``best=False`` takes its
    latest checkpoint."""
    import torch

    from dlrm.recommender import checkpoint as store
    from dlrm.recommender.item_parallel import ItemParallel

    path = store.model_path(os.fspath(checkpoint), best)
    kind = store.model_kind(path)
    n_input, n_output = store.sizes_of(path)
    score, _ = store.load_scorer(path, ItemParallel(), torch.device(device))
    return Recommender(path, kind, n_output, n_input, score)


def histories_of(dataset: str | os.PathLike) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """(each user's item ids, their values or None where the dataset has none) of the CSR dataset
    at ``dataset``, in its order: ``recommend``'s ``histories`` and ``values`` for the users the
    predict job reads from there."""
    from dlrm.recommender.csr_dataset import CsrDataset

    rows = CsrDataset(dataset).rows()
    bounds = list(zip(rows.offsets[:-1].tolist(), rows.offsets[1:].tolist()))
    histories = [np.asarray(rows.indices[a:b], np.int64) for a, b in bounds]
    values = None if rows.values is None else [np.asarray(rows.values[a:b], np.float32) for a, b in bounds]
    return histories, values


def _csr(setting: str, rows: Sequence[Sequence[int]], n_items: int, values: Sequence[Sequence[float]] | None = None):
    """The CSR tensors (offsets, indices, values or None) of ``rows`` of item ids, checked: each a
    1-D list of integers in [0, n_items)."""
    import torch

    arrays = []
    for r, row in enumerate(rows):
        array = np.asarray(row)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise ValueError(f"`{setting}` row {r} must be a list of integer item ids, got {_shown(row)}")
        outside = array[(array < 0) | (array >= n_items)]
        if outside.size:
            raise ValueError(f"`{setting}` row {r} holds item {int(outside[0])}, outside the model's {n_items:,} "
                             f"items (ids 0 to {n_items - 1})")
        arrays.append(array.astype(np.int64))
    offsets = np.zeros(len(arrays) + 1, np.int64)
    np.cumsum([a.size for a in arrays], out=offsets[1:])
    indices = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    weights = None
    if values is not None:
        weights = [np.asarray(v, np.float32) for v in values]
        if any(w.shape != a.shape for w, a in zip(weights, arrays)):
            raise ValueError("`values` must give one value per item of each history")
        weights = torch.from_numpy(np.concatenate(weights) if weights else np.zeros(0, np.float32))
    return torch.from_numpy(offsets), torch.from_numpy(indices), weights


def _shown(row: object) -> str:
    text = repr(row)
    return text if len(text) <= 60 else text[:57] + "..."
