"""The result of placing embedding tables: a ``Plan`` (which rank holds which table, whole or
as a row-wise block), its error ``PlanError``, and the sizes it is built from.

Kept apart from the planner (``dlrm.distributed.planner``) so that the model, the report and the
placement parser read a plan without the placement strategies.
"""

from __future__ import annotations

import numbers
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

from dlrm.engine.partition import split_bounds
from dlrm.nn.table_spec import TableShard

GIB = 2**30
_MIB = 2**20
BYTES_PER_VALUE = 4  # fp32 weights


class PlanError(ValueError):
    """A placement that cannot work; the message names the table or rank and what to change."""


def whole_number(value: object, what: str, minimum: int = 0) -> int:
    """``value`` as an int >= minimum; integral floats pass (byte counts come from GiB * 2**30)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    try:
        number = operator.index(value)  # int, numpy integers
    except TypeError:
        if isinstance(value, numbers.Real) and float(value).is_integer():
            number = int(value)
        else:
            raise ValueError(f"{what} must be an integer, got {value!r}") from None
    if number < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {number}")
    return number


def table_index(value: object, num_tables: int, name: str, item: str, says: str, where: str = "") -> int:
    """``value`` as a table index below ``num_tables``; errors call the list ``name`` and an
    entry ``item``, and read ``{says} table {index}{where}, but there are only ...``."""
    try:
        index = whole_number(value, item)
    except ValueError as error:
        raise PlanError(f"{name} is invalid: {error}") from None
    if index >= num_tables:
        raise PlanError(
            f"{says} table {index}{where}, but there are only {num_tables} tables (0 to {num_tables - 1})"
        )
    return index


def format_bytes(num_bytes: int) -> str:
    """Bytes for people: GiB with 2 decimals, or MiB / bytes when GiB would print as 0.00."""
    if num_bytes == 0 or abs(num_bytes) >= GIB / 100:
        return f"{num_bytes / GIB:.2f} GiB"
    if abs(num_bytes) >= _MIB:
        return f"{num_bytes / _MIB:.2f} MiB"
    return f"{num_bytes:,} bytes"


def ranks_word(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def tables_word(count: int) -> str:
    return f"{count} table" if count == 1 else f"{count} tables"


def table_names(tables: Sequence[int]) -> str:
    return ", ".join(map(str, tables))

def row_bounds(rows: int, world_size: int) -> list[int]:
    """Row-wise split of a table of ``rows`` rows by the engine's one convention
    (``dlrm.engine.partition``): rank ``r`` holds rows ``[b[r], b[r+1])``, the first
    ``rows % world_size`` ranks one row more (a block is empty when ``rows < world_size`` leaves
    that rank nothing). Checkpoints store blocks by row range, so ones written under another
    split load all the same."""
    return split_bounds(rows, world_size)


def block_bytes(bounds: Sequence[int], size: int, rank: int) -> int:
    """Bytes of ``rank``'s block of a row-wise table of ``size`` bytes (``bounds[-1]`` rows)."""
    return (bounds[rank + 1] - bounds[rank]) * (size // bounds[-1])


# --------------------------------------------------------------------------------------------
# The plan


Entry = Union[int, TableShard]


@dataclass(frozen=True)
class Plan:
    """Which rank holds which table, with the numbers that justify it.

    ``tables[r]`` lists the global table indices on rank ``r`` in ascending order, the order in
    which the rank stores and exchanges them: whole tables and tables of which it holds a
    non-empty row-wise block. ``row_wise`` maps each row-wise table to its ``world_size + 1``
    row bounds (rank ``r`` holds rows ``[b[r], b[r+1])``); ``entries(r)`` tells the two kinds
    apart. ``table_bytes`` and ``rows`` are in global table order; ``rows`` may be empty when
    unknown (it only feeds ``format_plan``). ``host`` lists, ascending, the tables kept in host
    (CPU) memory and looked up on the host, single-process runs only: they are in no
    ``tables[r]`` and no ``entries(r)``, and ``rank_bytes`` leaves them out (``host_bytes``
    counts them). ``plan_tables`` builds plans and checks them; this class only holds the result.
    """

    world_size: int
    tables: list[list[int]]
    table_bytes: list[int]
    capacity: list[int]
    rows: list[int] = field(default_factory=list)
    row_wise: dict[int, list[int]] = field(default_factory=dict)
    host: list[int] = field(default_factory=list)
    # Device rows caching the host tables, and their device bytes (``cache_bytes``), counted
    # on rank 0 with its tables (``device_bytes``).
    host_cache_rows: int = 0
    host_cache_bytes: int = 0

    @property
    def num_tables(self) -> int:
        return len(self.table_bytes)

    def rank_of(self, table: int) -> int:
        """The rank that holds ``table`` (a global index), a whole table."""
        if table in self.host:
            raise ValueError(
                f"table {table} is kept in host memory: no rank holds it on the device"
            )
        if table in self.row_wise:
            raise ValueError(
                f"table {table} is split row-wise across {ranks_word(self.world_size)}: no single "
                "rank holds it; use entries() for the blocks each rank holds"
            )
        for rank, held in enumerate(self.tables):
            if table in held:
                return rank
        raise IndexError(f"table {table} is not in this plan of {self.num_tables} tables")

    def entries(self, rank: int) -> list[Entry]:
        """What ``rank`` holds, in the order of ``tables[rank]``: a whole table as its index, a
        row-wise block as ``TableShard(table, start, stop)``."""
        result: list[Entry] = []
        for table in self.tables[rank]:
            bounds = self.row_wise.get(table)
            if bounds is None:
                result.append(table)
            else:
                result.append(TableShard(table, bounds[rank], bounds[rank + 1]))
        return result

    def rank_bytes(self, rank: int) -> int:
        """Bytes of what ``rank`` holds: whole tables and its rows of row-wise tables."""
        total = 0
        for table in self.tables[rank]:
            bounds = self.row_wise.get(table)
            if bounds is None:
                total += self.table_bytes[table]
            else:
                total += block_bytes(bounds, self.table_bytes[table], rank)
        return total

    def device_bytes(self, rank: int) -> int:
        """``rank_bytes`` plus, on the one rank of a run with host tables, their device cache."""
        return self.rank_bytes(rank) + self.host_cache_bytes

    def host_bytes(self) -> int:
        """Bytes of the tables kept in host memory."""
        return sum(self.table_bytes[t] for t in self.host)

    def rank_lookup_share(self, rank: int) -> float:
        """Share of the device lookups that ``rank`` serves (its share of gather work and
        exchange; tables in host memory are not counted): with one id per feature and sample,
        every entry (a whole table, or a row-wise block, looked up for the whole batch) costs
        the same. 0 when the devices hold no table at all."""
        entries = sum(len(held) for held in self.tables)
        return len(self.tables[rank]) / entries if entries else 0.0

    def to_json(self) -> dict:
        """The plan as JSON-ready data; ``load_placement`` reads it back as a placement.
        ``"host"`` (the tables in host memory) is there only when some are."""
        data = {
            "world_size": self.world_size,
            "tables": [list(held) for held in self.tables],
            "row_wise": {str(t): list(b) for t, b in sorted(self.row_wise.items())},
        }
        if self.host:
            data["host"] = list(self.host)
        if self.host_cache_rows:
            data["host_cache_rows"] = self.host_cache_rows
        return data

# --------------------------------------------------------------------------------------------
# Sizes


def cache_bytes(cache_rows: int, host_rows: int, dim: int, state_bytes_per_row: int = 0,
                bytes_per_value: int = BYTES_PER_VALUE) -> int:
    """Device bytes of a cache of ``cache_rows`` rows in front of ``host_rows`` host rows
    (``dlrm.nn.cached_embedding``): each slot holds a row and its optimizer state, and the slot
    map holds 4 bytes (int32) per host row."""
    return cache_rows * (dim * bytes_per_value + state_bytes_per_row) + 4 * host_rows


def table_bytes(rows: Sequence[int], dim: int, state_bytes_per_row: int = 0,
                bytes_per_value: int = BYTES_PER_VALUE) -> list[int]:
    """Bytes each table needs on its rank: rows * (dim values of ``bytes_per_value`` bytes, 4 for
    fp32 tables and 2 for fp16/bf16 ones, + the optimizer state of a row: 0 for SGD, 4 for
    row-wise Adagrad, 4 * dim for Adagrad)."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise ValueError("rows must be a list with the number of rows of each table")
    if len(rows) == 0:
        raise ValueError("rows is empty: a model needs at least one embedding table")
    per_row = whole_number(dim, "embedding dim", minimum=1) * whole_number(bytes_per_value, "bytes per value", minimum=1)
    per_row += whole_number(state_bytes_per_row, "optimizer state bytes per row")
    return [whole_number(r, f"rows of table {i}", minimum=1) * per_row for i, r in enumerate(rows)]

