"""Each process's view of a split in hybrid-parallel training.

A process needs the ids of its own tables for the whole global batch (it looks them up for
everyone) and the label and numerical rows of its own samples only (it trains on those), so it
reads exactly that: its categorical files for the batch, and a row range of the other files.
Multi-hot ids (``Bags``) travel the same way: the bags of its tables for the whole batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from dlrm.data.batch import Bags, Batch
from dlrm.engine.partition import split_sizes


def local_batch_sizes(global_batch: int, world_size: int) -> list[int]:
    """Samples per process: contiguous rows, the first ``global_batch % world_size`` get one more
    (``dlrm.engine.partition``, the engine's one row-split convention)."""
    return split_sizes(global_batch, world_size)


class RankSource:
    """A batch source (``len`` and ``read_batch``) holding one process's share of each batch.

    ``make_reader(categorical_features, read_numerical, read_label)`` builds a source of the split
    that reads only the given columns. Sources with ``read_rows`` (the split-binary reader) are
    read column by column as above; others (synthetic data) are generated whole and sliced.
    """

    def __init__(self, make_reader: Callable[..., Any], tables: Sequence[int], rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.tables = list(tables)
        probe = make_reader(self.tables, True, True)
        if hasattr(probe, "read_rows"):
            probe.close()
            self._ids = make_reader(self.tables, False, False)
            self._dense = make_reader([], True, True)
            self._whole = None
        else:
            self._whole = probe
        base = self._whole if self._whole is not None else self._ids
        self.reads_any_rows = self._whole is None  # generated sources come in whole batches only
        self.batch_size = base.batch_size
        self.num_samples = base.num_samples
        self._len = len(base)

    def __len__(self) -> int:
        return self._len

    def _own_rows(self, start: int, count: int) -> tuple[int, int]:
        sizes = local_batch_sizes(count, self.world_size)
        return start + sum(sizes[: self.rank]), sizes[self.rank]

    def read_batch(self, index: int) -> Batch:
        start = index * self.batch_size
        count = min(self.batch_size, self.num_samples - start)
        if self._whole is not None:
            own_start, own_count = self._own_rows(start, count)
            whole = self._whole.read_batch(index)
            rows = slice(own_start - start, own_start - start + own_count)
            return Batch(whole.numerical[rows], self._own_tables(whole.categorical), whole.label[rows])
        return self.read_rows(start, count)

    def _own_tables(self, categorical: torch.Tensor | Bags) -> torch.Tensor | Bags:
        """This process's tables of a generated global batch: columns of ``[B, F]`` ids, or their
        bags (no tables: ``[B, 0]``, as the split-binary reader returns for an empty selection)."""
        if not isinstance(categorical, Bags):
            return categorical[:, self.tables]
        if not self.tables:
            return categorical.values.new_empty((categorical.batch_size, 0))
        return categorical.select(self.tables)

    def read_rows(self, start: int, count: int) -> Batch:
        """The global batch of rows [start, start+count): ids of this process's tables for every
        row, label and numerical values of its own share of the rows only."""
        if self._whole is not None:
            raise TypeError("a generated source is read in whole batches only (read_batch)")
        own_start, own_count = self._own_rows(start, count)
        ids = self._ids.read_rows(start, count).categorical
        dense = self._dense.read_rows(own_start, own_count)
        return Batch(dense.numerical, ids, dense.label)

    def validate(self) -> None:
        """Checks every value this process will read (see ``SplitBinaryReader.validate``)."""
        for source in (self._ids, self._dense) if self._whole is None else ():
            source.validate()

    def close(self) -> None:
        for source in (self._whole, getattr(self, "_ids", None), getattr(self, "_dense", None)):
            if source is not None and hasattr(source, "close"):
                source.close()
