"""Recommendations: every item scored for a batch of users, the items they have seen removed,
the best K kept; across processes, each keeps the top K of its own item slice and the lists are
merged (``topk.merge_top_k``: exact, since the seen items go before the local top K).

The same path ranks the baselines (``baselines``), so the model and the baselines are compared
on identical exclusion and tie rules.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from dlrm.engine.atomic import write_atomically
from dlrm.recommender.csr_dataset import CsrDataset
from dlrm.recommender.csr_rows import Csr, take_rows
from dlrm.recommender.metrics import MetricsAccumulator, RankingMetrics
from dlrm.recommender.scorer import Scorer
from dlrm.recommender.topk import DEFAULT_SCORE_FORMAT, exclude_, format_recommendations, merge_top_k, top_k


def _padded(values: torch.Tensor, items: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of fewer than k (a small slice) padded with (-inf, -1), so every process sends the same shape."""
    missing = k - values.shape[1]
    if missing <= 0:
        return values, items
    return (torch.cat([values, values.new_full((values.shape[0], missing), -float("inf"))], 1),
            torch.cat([items, items.new_full((items.shape[0], missing), -1)], 1))


def recommend(score: Scorer, inputs: CsrDataset, k: int, batch_size: int, *, item_start: int = 0,
              exclude: Sequence[CsrDataset] = (), exclude_inputs: bool = True, parallel=None,
              start: int = 0, stop: int | None = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """(first sample, values [B, k], global item ids [B, k]) per batch of samples [start, stop),
    best first, without the samples' input items (``exclude_inputs``) and the items of every
    dataset in ``exclude`` (DSSTNE's filter files; the same samples in the same order). Every
    process gets the merged lists; -1 marks a slot with no item left to recommend."""
    if k < 1:
        raise ValueError(f"`k` must be >= 1, got {k}")
    for dataset in exclude:
        if len(dataset) != len(inputs):
            raise ValueError(f"the exclusion dataset {dataset.path} has {len(dataset)} samples, the input "
                             f"{inputs.path} {len(inputs)}: they must hold the same samples in the same order")
    stop = len(inputs) if stop is None else stop
    for first in range(start, stop, batch_size):
        ids = np.arange(first, min(first + batch_size, stop), dtype=np.int64)
        history = take_rows(inputs, ids)
        filters = ([history] if exclude_inputs else []) + [take_rows(d, ids) for d in exclude]
        values, items = rank(score, history, k, filters, item_start, parallel)
        yield first, values, items


def rank(score: Scorer, history: Csr, k: int, filters: Sequence[Csr], item_start: int = 0,
         parallel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch: (values [B, k], global item ids [B, k]) on the CPU, best first, of the items
    scored from ``history`` less those in each of ``filters``, merged across processes."""
    scores = score(history).float()
    for offsets, indices, _ in filters:
        exclude_(scores, offsets.to(scores.device), indices.to(scores.device), item_start)
    values, items = top_k(scores, k, item_start)
    if parallel is not None and parallel.distributed:
        values, items = _padded(values, items, k)
        values, items = merge_top_k(list(parallel.all_gather_same(values).cpu()),
                                    list(parallel.all_gather_same(items).cpu()), k)
    return values.cpu(), items.cpu()


def write_predictions(path: str | os.PathLike, batches: Iterator[tuple[int, torch.Tensor, torch.Tensor]],
                      sample_names: list[str], item_names: list[str], score_format: str = DEFAULT_SCORE_FORMAT) -> int:
    """DSSTNE's predict output, ``sample\titem,score:item,score:...`` per line (scores in
    ``score_format``), written under a temporary name and renamed when complete. Returns the
    number of lines."""
    lines = 0

    def write(tmp: str) -> None:
        nonlocal lines
        with open(tmp, "w", encoding="utf-8") as f:
            for first, values, items in batches:
                names = sample_names[first:first + values.shape[0]]
                f.writelines(format_recommendations(names, values, items, item_names, score_format))
                lines += len(names)

    write_atomically(path, write, "the predictions")
    return lines


def evaluate(batches: Iterator[tuple[int, torch.Tensor, torch.Tensor]], heldout: CsrDataset,
             ks: Sequence[int]) -> list[RankingMetrics]:
    """Ranking metrics of the recommendation lists against each user's held-out items, one per K."""
    accumulator = MetricsAccumulator(list(ks), heldout.n_features)
    for first, _, items in batches:
        rows = heldout.rows(first, first + items.shape[0])
        accumulator.add(items, rows.offsets, rows.indices)
    return accumulator.result()
