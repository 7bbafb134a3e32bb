"""Synthetic clicks for the wide model: each sample has one id per field and a label drawn from a
hidden logistic model over those ids, so there is something to learn and a loss to watch fall."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WideData:
    """``ids`` ``[samples, fields]`` in one id space (field f's ids follow field f-1's), ``labels``
    ``[samples]`` of 0.0 / 1.0. Every process makes the same data from the seed: in hybrid
    parallelism each reads the ids of the whole batch (it looks up its own rows for everyone)
    and the labels of its own samples."""

    ids: torch.Tensor
    labels: torch.Tensor

    @property
    def num_ids(self) -> int:
        return int(self.ids.max()) + 1 if len(self.ids) else 0


def make_data(num_samples: int, field_sizes: tuple[int, ...], seed: int) -> WideData:
    """Ids Zipf-like within each field (small ids are frequent), labels from a hidden model."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *field_sizes[:-1]]).cumsum(0)
    columns = []
    for size in field_sizes:
        u = torch.rand(num_samples, generator=generator)
        columns.append((size ** u - 1).long().clamp_(0, size - 1))  # log-uniform over [0, size)
    ids = torch.stack(columns, 1) + offsets
    hidden = torch.randn(sum(field_sizes), generator=generator) * 1.5
    clicked = torch.rand(num_samples, generator=generator) < torch.sigmoid(hidden[ids].sum(1) - 0.5)
    return WideData(ids, clicked.float())


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    """The samples of epoch ``epoch`` in the order they are read: a function of the seed and the
    epoch alone, so a resumed run reads the batches the uninterrupted one would have."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
