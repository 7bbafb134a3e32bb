"""What an embedding table is, apart from its storage: its index, rows, the row-wise block a
process holds and its pooling (``TableSpec``), and a plan's entry for a block (``TableShard``).

Kept apart from the modules so that the planner, the exchange and the model config can speak
about tables without importing the embedding layouts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from dlrm.data.feature_spec import POOLINGS


class TableShard(NamedTuple):
    """A contiguous block of a table's rows, ``[start, stop)`` of global table ``table``: what a
    process holds of a table split row-wise across processes (a whole table is just its index)."""

    table: int
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def table_of(entry: int | TableShard) -> int:
    """The global table index of a plan entry: a whole table's index, or a block's table."""
    return entry.table if isinstance(entry, TableShard) else entry


@dataclass(frozen=True)
class TableSpec:
    """One table held by an embedding module, or a row-wise block of it: global index ``index``,
    the whole table's ``rows``, the block ``[start, stop)`` of them held here (default: all) and
    how its bags pool (``"sum"`` or ``"mean"``). One record per table instead of parallel lists,
    so a table's facts travel together from the model config to the module."""

    index: int
    rows: int
    start: int = 0
    stop: int | None = None  # None: rows
    pooling: str = "sum"

    def __post_init__(self) -> None:
        if self.stop is None:
            object.__setattr__(self, "stop", self.rows)

    @property
    def block_rows(self) -> int:
        """Rows held here: ``stop - start``."""
        return self.stop - self.start


def table_specs(table_sizes: Sequence[int], poolings: Sequence[str] | None = None) -> list[TableSpec]:
    """Whole tables ``0 .. len(table_sizes) - 1`` with their poolings ("sum" for all when None)."""
    poolings = check_poolings(poolings, len(table_sizes))
    return [TableSpec(i, int(rows), pooling=pooling) for i, (rows, pooling) in enumerate(zip(table_sizes, poolings))]

def check_poolings(poolings: Sequence[str] | None, num_tables: int) -> list[str]:
    """One pooling per table, "sum" for all when None."""
    if poolings is None:
        return ["sum"] * num_tables
    poolings = list(poolings)
    if len(poolings) != num_tables or any(p not in POOLINGS for p in poolings):
        raise ValueError(
            f"`poolings` must give one of {list(POOLINGS)} per table ({num_tables} tables), got {poolings}"
        )
    return poolings
