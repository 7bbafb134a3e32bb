"""Placement of embedding tables on ranks for hybrid-parallel training.

Each rank looks up the tables it holds for the whole global batch and sends the results to the
ranks that own the samples through one all-to-all. A table is held in one of two ways:

* table-wise (the default): the whole table lives on one rank. The planner balances bytes
  (weights plus optimizer state), because memory is what runs out, and caps the number of tables
  per rank, because with one id per feature the number of tables a rank holds is its share of
  lookups and of the all-to-all traffic.
* row-wise: the table is split across all ranks in contiguous blocks of rows, rank ``r`` holding
  rows ``[b[r], b[r+1])`` with ``b[r] = r * rows // world_size``. Every rank looks up its block
  for every sample of the global batch and sends partial results through the same all-to-all,
  so a row-wise table costs every rank that holds a (non-empty) block one entry of lookups and of
  exchange traffic, as much as a whole table: W entries instead of one in all. It is what lets a
  table larger than any one rank's memory be trained at all.

A single-process run has a third place for a table, host (CPU) memory (``host_tables``): host
memory is about 10x larger than GPU memory and 10-50x slower, so keeping the largest tables
there, looked up on the host, lets a model larger than one GPU train on one GPU, at the price
of copying those tables' ids to the host and their embeddings back every step. With several
processes, row-wise splitting is the answer instead, so host tables are for one process only.

Because a row-wise table multiplies its lookup and exchange work by the number of ranks, the
default (``row_wise="auto"``) splits tables only when memory demands it: it tries the table-wise
greedy first, and only when that fails moves the largest remaining tables, one at a time, to
row-wise until the rest fit whole. ``"never"``, ``"all"`` or an explicit list of tables choose
by hand; so does a manual placement read by ``load_placement``.

Everything here is a pure function of its arguments: the same inputs give the same plan on every
rank, so ranks need not exchange the plan.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Union

from dlrm.nn.embeddings import TableShard

GIB = 2**30
_MIB = 2**20
_BYTES_PER_VALUE = 4  # fp32 weights
_ROW_WISE_MODES = ("auto", "never", "all")
_HOST_MODES = ("none", "auto")
_PLACEMENT_WORDS = {"auto": "auto", "table_wise": "never", "row_wise": "all"}
_PLACEMENT_FORMS = (
    'auto, table_wise, row_wise, JSON such as {"0": [0, 3], "1": [1, 2]} or [[0, 3], [1, 2]] '
    '(tables per rank, the dict may add "row_wise": [4, 5]), {"row_wise": [4, 5]} alone, '
    "a saved plan, or a path to a JSON file with one of these"
)


class PlanError(ValueError):
    """A placement that cannot work; the message names the table or rank and what to change."""


# --------------------------------------------------------------------------------------------
# Small validators and formatters


def _whole(value: object, what: str, minimum: int = 0) -> int:
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


def _size(num_bytes: int) -> str:
    """Bytes for people: GiB with 2 decimals, or MiB / bytes when GiB would print as 0.00."""
    if num_bytes == 0 or abs(num_bytes) >= GIB / 100:
        return f"{num_bytes / GIB:.2f} GiB"
    if abs(num_bytes) >= _MIB:
        return f"{num_bytes / _MIB:.2f} MiB"
    return f"{num_bytes:,} bytes"


def _ranks_word(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def _tables_word(count: int) -> str:
    return f"{count} table" if count == 1 else f"{count} tables"


def _names(tables: Sequence[int]) -> str:
    return ", ".join(map(str, tables))


def _host_advice(bytes_per_value: int) -> str:
    """What a user can change when the host tables do not fit in host memory."""
    dtype = ", store the tables in fp16/bf16 with `embedding_dtype`" if bytes_per_value > 2 else ""
    return (
        f"lower `embedding_dim`, cap rows with `max_table_size`{dtype}, or run several processes "
        "(`table_placement=row_wise` splits large tables across them)"
    )


def _single_process(world_size: int) -> str:
    return (
        "tables in host memory (`host_tables`) are for single-process runs, and this run has "
        f"{world_size} processes; with several processes `table_placement=row_wise` splits "
        "large tables across them instead"
    )


def _advice(bytes_per_value: int) -> str:
    """What a user can change when the tables do not fit."""
    if bytes_per_value > 2:
        return (
            "add ranks, lower `embedding_dim`, cap rows with `max_table_size`, or store the "
            "tables in fp16/bf16 with `embedding_dtype`"
        )
    return "add ranks, lower `embedding_dim`, or cap rows with `max_table_size`"


def row_bounds(rows: int, world_size: int) -> list[int]:
    """Equal row-wise split of a table of ``rows`` rows: rank ``r`` holds rows
    ``[b[r], b[r+1])`` with ``b[r] = r * rows // world_size`` (a block is empty when
    ``rows < world_size`` leaves that rank nothing)."""
    return [r * rows // world_size for r in range(world_size + 1)]


def _block_bytes(bounds: Sequence[int], size: int, rank: int) -> int:
    """Bytes of ``rank``'s block of a row-wise table of ``size`` bytes (``bounds[-1]`` rows)."""
    return (bounds[rank + 1] - bounds[rank]) * (size // bounds[-1])


def _check_assignment(
    assignment: object, num_tables: int, world_size: int, row_wise: Sequence[int] = (),
    host: Sequence[int] = (),
) -> list[list[int]]:
    """A manual placement: every table-wise table on exactly one rank, no row-wise table and
    no table kept in host memory, one list per rank; returns the lists sorted."""
    if isinstance(assignment, (str, bytes)) or not isinstance(assignment, Sequence):
        raise PlanError("the table placement must be a list with one list of tables per rank")
    if len(assignment) != world_size:
        raise PlanError(
            f"the table placement lists {_ranks_word(len(assignment))} but the world size is "
            f"{world_size}; give one list per rank, [] for a rank without tables"
        )
    split = set(row_wise)
    on_host = set(host)
    owner: dict[int, int] = {}
    result = []
    for rank, tables in enumerate(assignment):
        if isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence):
            raise PlanError(f"the table placement for rank {rank} must be a list of table indices")
        ranked = []
        for table in tables:
            try:
                index = _whole(table, f"table index on rank {rank}")
            except ValueError as error:
                raise PlanError(f"the table placement is invalid: {error}") from None
            if index >= num_tables:
                raise PlanError(
                    f"the table placement puts table {index} on rank {rank}, but there are only "
                    f"{num_tables} tables (0 to {num_tables - 1})"
                )
            if index in split:
                raise PlanError(
                    f"the table placement puts table {index} on rank {rank}, but table {index} is "
                    "split row-wise across all ranks; leave it out of the lists of tables per rank"
                )
            if index in on_host:
                raise PlanError(
                    f"the table placement puts table {index} on rank {rank}, but table {index} is "
                    "kept in host memory (`host_tables`); leave it out of the lists of tables per "
                    "rank"
                )
            if index in owner:
                where = (
                    f"twice on rank {rank}"
                    if owner[index] == rank
                    else f"on ranks {owner[index]} and {rank}"
                )
                raise PlanError(
                    f"the table placement puts table {index} {where}; each table goes on one rank"
                )
            owner[index] = rank
            ranked.append(index)
        result.append(sorted(ranked))
    missing = [t for t in range(num_tables) if t not in owner and t not in split
               and t not in on_host]
    if missing:
        raise PlanError(
            f"the table placement leaves table(s) {_names(missing)} on no rank; every table needs "
            "a rank (or to be listed under `row_wise`)"
        )
    return result


def _check_capacity(
    tables: list[list[int]], sizes: list[int], capacity: list[int], blocks: list[int]
) -> None:
    for rank, held in enumerate(tables):
        used = sum(sizes[t] for t in held) + blocks[rank]
        if used > capacity[rank]:
            what = f"tables {_names(held)}" if held else "no whole table"
            extra = f" and {_size(blocks[rank])} of row-wise blocks" if blocks[rank] else ""
            raise PlanError(
                f"the table placement overflows rank {rank}: {what}{extra} need {_size(used)} but "
                f"the rank has {_size(capacity[rank])} ({_size(used - capacity[rank])} over); "
                "move a table to another rank or raise `capacity`"
            )


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
                f"table {table} is split row-wise across {_ranks_word(self.world_size)}: no single "
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
                total += _block_bytes(bounds, self.table_bytes[table], rank)
        return total

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
        return data


# --------------------------------------------------------------------------------------------
# Sizes


def table_bytes(rows: Sequence[int], dim: int, state_bytes_per_row: int = 0,
                bytes_per_value: int = _BYTES_PER_VALUE) -> list[int]:
    """Bytes each table needs on its rank: rows * (dim values of ``bytes_per_value`` bytes, 4 for
    fp32 tables and 2 for fp16/bf16 ones, + the optimizer state of a row: 0 for SGD, 4 for
    row-wise Adagrad, 4 * dim for Adagrad)."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise ValueError("rows must be a list with the number of rows of each table")
    if len(rows) == 0:
        raise ValueError("rows is empty: a model needs at least one embedding table")
    per_row = _whole(dim, "embedding dim", minimum=1) * _whole(bytes_per_value, "bytes per value", minimum=1)
    per_row += _whole(state_bytes_per_row, "optimizer state bytes per row")
    return [_whole(r, f"rows of table {i}", minimum=1) * per_row for i, r in enumerate(rows)]


def _capacities(capacity: int | Sequence[int], world_size: int) -> list[int]:
    if isinstance(capacity, Sequence) and not isinstance(capacity, (str, bytes)):
        if len(capacity) != world_size:
            raise ValueError(
                f"capacity lists {_ranks_word(len(capacity))} but the world size is {world_size}"
            )
        return [_whole(c, f"capacity of rank {r} (bytes)") for r, c in enumerate(capacity)]
    return [_whole(capacity, "capacity per rank (bytes)")] * world_size


def _row_wise_tables(row_wise: object, num_tables: int) -> tuple[str, list[int]]:
    """``row_wise`` -> (mode, the tables row-wise from the start)."""
    if isinstance(row_wise, str):
        if row_wise not in _ROW_WISE_MODES:
            raise ValueError(
                f"row_wise must be one of {', '.join(_ROW_WISE_MODES)} or a list of table "
                f"indices, got {row_wise!r}"
            )
        return row_wise, list(range(num_tables)) if row_wise == "all" else []
    if isinstance(row_wise, bytes) or not isinstance(row_wise, Sequence):
        raise PlanError(
            f"the row-wise tables must be a list of table indices, got {row_wise!r}"
        )
    return "list", _table_list(row_wise, num_tables, "the list of row-wise tables", "a row-wise table index")


def _table_list(values: Sequence[object], num_tables: int, name: str, item: str) -> list[int]:
    """``values`` as table indices, each in range and once; errors call the list ``name`` and
    an entry ``item``."""
    tables: list[int] = []
    for table in values:
        try:
            index = _whole(table, item)
        except ValueError as error:
            raise PlanError(f"{name} is invalid: {error}") from None
        if index >= num_tables:
            raise PlanError(
                f"{name} names table {index}, but there are only {num_tables} tables "
                f"(0 to {num_tables - 1})"
            )
        if index in tables:
            raise PlanError(f"{name} names table {index} twice")
        tables.append(index)
    return tables


# --------------------------------------------------------------------------------------------
# Planning


class _NoRoom(Exception):
    """The greedy found no rank for ``table``; the caller words the message."""

    def __init__(self, table: int, free: list[int], held: list[list[int]], best: int, limit: int):
        super().__init__(table)
        self.table, self.free, self.held, self.best, self.limit = table, free, held, best, limit


def _greedy(
    tables: Sequence[int], sizes: list[int], capacity: list[int], limit: int
) -> list[list[int]]:
    """Largest table first onto the rank with the most free memory that still has a slot."""
    world_size = len(capacity)
    free = list(capacity)
    held: list[list[int]] = [[] for _ in range(world_size)]
    for table in sorted(tables, key=lambda t: (-sizes[t], t)):
        best = -1
        for rank in range(world_size):
            if len(held[rank]) < limit and (best < 0 or free[rank] > free[best]):
                best = rank
        if sizes[table] > free[best]:
            raise _NoRoom(table, free, held, best, limit)
        free[best] -= sizes[table]
        held[best].append(table)
    return [sorted(ts) for ts in held]


def _totals(sizes: list[int], capacity: list[int], what: str = "") -> str:
    """``sizes``: the bytes of the tables on the devices; ``what`` qualifies them."""
    total, offered = sum(sizes), sum(capacity)
    return (
        f"the {_tables_word(len(sizes))}{what} {'needs' if len(sizes) == 1 else 'need'} "
        f"{_size(total)} in all and "
        f"{_ranks_word(len(capacity))} {'offers' if len(capacity) == 1 else 'offer'} "
        f"{_size(offered)}"
    )


def _no_room(
    gap: _NoRoom, sizes: list[int], rows: list[int], capacity: list[int], split: list[int],
    host: Sequence[int] = (),
) -> str:
    """The first clause and numbers of a table-wise failure (without the advice); the totals
    leave out the tables kept in host memory (``host``)."""
    table, free, best = gap.table, gap.free, gap.best
    size = sizes[table]
    after = f" (after the row-wise blocks of {_names(split)})" if split else ""
    message = (
        f"table {table} ({rows[table]:,} rows, {_size(size)}) fits on no rank: the most free "
        f"memory is {_size(free[best])} on rank {best}{after}, {_size(size - free[best])} short"
    )
    capped = [r for r in range(len(free)) if len(gap.held[r]) >= gap.limit and free[r] >= size]
    if capped:
        message += (
            f" (rank {capped[0]} has room but already holds {gap.limit} tables, the cap per rank;"
            " give an `override` placement)"
        )
    device = [size for t, size in enumerate(sizes) if t not in host]
    if sum(device) > sum(capacity):
        message += f"; {_totals(device, capacity, ' not in host memory' if host else '')}"
    return message


def _blocks_overflow(
    split: list[int], blocks: list[int], sizes: list[int], capacity: list[int],
    host: Sequence[int] = (),
) -> str | None:
    """None when every rank can hold its row-wise blocks, else the numbers of the fullest rank."""
    short = [blocks[r] - capacity[r] for r in range(len(capacity))]
    fullest = max(range(len(capacity)), key=lambda r: (short[r], -r))
    if short[fullest] <= 0:
        return None
    device = [size for t, size in enumerate(sizes) if t not in host]
    return (
        f"with {'table' if len(split) == 1 else 'tables'} {_names(split)} split row-wise, "
        f"rank {fullest} needs {_size(blocks[fullest])} for its row blocks alone but "
        f"has {_size(capacity[fullest])}, {_size(short[fullest])} short; "
        f"{_totals(device, capacity, ' not in host memory' if host else '')}"
    )


def _host_tables(host_tables: object, num_tables: int) -> tuple[str, list[int]]:
    """``host_tables`` -> (mode: ``"none"``, ``"auto"`` or ``"list"``, the listed tables)."""
    if host_tables is None:
        return "none", []
    if isinstance(host_tables, str):
        if host_tables not in _HOST_MODES:
            raise ValueError(
                f"host_tables must be one of {', '.join(_HOST_MODES)}, None or a list of table "
                f"indices, got {host_tables!r}"
            )
        return host_tables, []
    if isinstance(host_tables, bytes) or not isinstance(host_tables, Sequence):
        raise PlanError(
            f"`host_tables` must be a list of table indices, got {host_tables!r}"
        )
    return "list", sorted(_table_list(host_tables, num_tables, "the list of `host_tables`", "a host table index"))


def plan_tables(
    rows: Sequence[int],
    dim: int,
    world_size: int,
    capacity: int | Sequence[int],
    override: Sequence[Sequence[int]] | None = None,
    state_bytes_per_row: int = 0,
    bytes_per_value: int = _BYTES_PER_VALUE,
    row_wise: str | Sequence[int] = "auto",
    host_tables: str | Sequence[int] | None = None,
    host_capacity: int | None = None,
) -> Plan:
    """Place tables on ranks, whole or split row-wise, or (one process) in host memory; see
    docs/distributed.md for the algorithm and the flags.

    ``capacity`` is bytes per rank available for tables (one number for all, or one per rank);
    ``state_bytes_per_row`` the embedding optimizer's state per row, counted with the weights,
    ``bytes_per_value`` the size of one weight (4 for fp32 tables, 2 for fp16/bf16).
    ``row_wise`` chooses the tables split row-wise across all ranks (equal blocks,
    ``row_bounds``): ``"never"``, ``"all"``, a list of table indices, or ``"auto"``: none
    unless the table-wise greedy fails, then the largest remaining table, one at a time, until
    the rest fit whole. The greedy balances bytes, after every rank's row-wise blocks, with at
    most ``ceil(table-wise tables / ranks)`` tables per rank.
    ``override`` (``override[r]`` = whole tables on rank ``r``) replaces the greedy; it lists
    every table that is not row-wise or in host memory once (with ``"auto"`` none is
    row-wise), it is validated and must fit, but the cap on tables per rank does not apply to it.

    ``host_tables`` keeps tables in host (CPU) memory, looked up on the host (``Plan.host``):
    host memory is about 10x larger and 10-50x slower than GPU memory, so keeping the largest
    tables there lets a model larger than one GPU train on one GPU, each step copying their ids
    to the host and their embeddings back. ``None`` or ``"none"``: no table; a list of table
    indices: exactly these (``world_size`` must be 1); ``"auto"``: none when the tables fit on
    the devices, else, with one process, the fewest largest tables (by bytes, ties: lowest
    index) such that the rest fit on the device; with several processes ``"auto"`` is
    ``None`` (row-wise splitting is their answer), and with ``override`` too (it places every
    table). ``host_capacity`` bounds the host tables' bytes (None: no bound).
    Raises ``ValueError`` for malformed inputs and ``PlanError`` for placements that cannot work.
    """
    sizes = table_bytes(rows, dim, state_bytes_per_row, bytes_per_value)
    row_counts = [int(r) for r in rows]
    world_size = _whole(world_size, "world size", minimum=1)
    capacities = _capacities(capacity, world_size)
    mode, listed = _row_wise_tables(row_wise, len(sizes))
    host_mode, host_listed = _host_tables(host_tables, len(sizes))
    host_limit = None if host_capacity is None else _whole(host_capacity, "host capacity (bytes)")
    advice = _advice(bytes_per_value)
    if host_listed and world_size > 1:
        raise PlanError(_single_process(world_size))
    if mode == "list":
        both = [t for t in host_listed if t in listed]
        if both:
            raise PlanError(
                f"table {both[0]} is listed both as row-wise and in `host_tables`; a table is "
                "either split row-wise on the devices or kept whole in host memory"
            )

    def blocks_of(split: list[int]) -> tuple[dict[int, list[int]], list[int]]:
        bounds = {t: row_bounds(row_counts[t], world_size) for t in split}
        blocks = [sum(_block_bytes(b, sizes[t], r) for t, b in bounds.items())
                  for r in range(world_size)]
        return bounds, blocks

    def place(host: list[int]) -> Plan:
        """The plan with ``host`` in host memory and every other table on the devices."""

        def finish(placed: list[list[int]], bounds: dict[int, list[int]]) -> Plan:
            tables = [
                sorted(held + [t for t, b in bounds.items() if b[r] < b[r + 1]])
                for r, held in enumerate(placed)
            ]
            return Plan(world_size, tables, sizes, capacities, rows=row_counts,
                        row_wise=dict(sorted(bounds.items())), host=list(host))

        split = [t for t in listed if t not in host]
        bounds, blocks = blocks_of(split)
        overflow = _blocks_overflow(split, blocks, sizes, capacities, host)
        if overflow is not None:
            raise PlanError(f"the row-wise tables do not fit: {overflow}; {advice}")
        if override is not None:
            placed = _check_assignment(override, len(sizes), world_size, split, host)
            _check_capacity(placed, sizes, capacities, blocks)
            return finish(placed, bounds)

        first: str | None = None  # the table-wise failure, named first if splitting does not help
        while True:
            whole = [t for t in range(len(sizes)) if t not in bounds and t not in host]
            free = [c - b for c, b in zip(capacities, blocks)]
            try:
                placed = _greedy(whole, sizes, free, math.ceil(len(whole) / world_size))
            except _NoRoom as gap:
                message = _no_room(gap, sizes, row_counts, capacities, split, host)
                if mode != "auto" or world_size == 1:
                    hint = ""
                    if world_size > 1 and mode == "never":
                        hint = ("; `table_placement=row_wise` (or `auto`) splits tables row-wise "
                                "across ranks")
                    elif world_size > 1 and mode == "list":
                        hint = ("; list more tables as row-wise in `table_placement`, or use "
                                "`table_placement=auto`")
                    elif host:
                        hint = ("; keep more tables in host memory with `host_tables`, or let "
                                "`host_tables=auto` choose them")
                    raise PlanError(f"{message}; {advice}{hint}") from None
                if first is None:
                    table = gap.table
                    first = (f"table {table} ({row_counts[table]:,} rows, {_size(sizes[table])}) "
                             "fits on no rank")
                split.append(max(whole, key=lambda t: (sizes[t], -t)))  # largest, ties: lowest
            else:
                return finish(placed, bounds)
            bounds, blocks = blocks_of(split)
            overflow = _blocks_overflow(split, blocks, sizes, capacities, host)
            if overflow is not None:
                raise PlanError(
                    f"{first}, and splitting tables row-wise across the {world_size} ranks does "
                    f"not help: {overflow}; {advice}"
                ) from None

    def host_need(host: list[int]) -> int:
        return sum(sizes[t] for t in host)

    if host_mode == "list":
        need = host_need(host_listed)
        if host_limit is not None and need > host_limit:
            raise PlanError(
                f"host {'table' if len(host_listed) == 1 else 'tables'} {_names(host_listed)} "
                f"need {_size(need)} of host memory but {_size(host_limit)} is offered; keep "
                f"fewer tables in host memory (`host_tables`), {_host_advice(bytes_per_value)}"
            )
        return place(host_listed)
    if host_mode != "auto" or world_size > 1 or override is not None:
        return place([])
    try:
        return place([])
    except PlanError as error:
        failure = str(error)
    # One process and the tables do not all fit on its device: the largest tables, fewest first,
    # go to host memory (never a table listed as row-wise).
    candidates = sorted((t for t in range(len(sizes)) if t not in listed),
                        key=lambda t: (-sizes[t], t))
    for count in range(1, len(candidates) + 1):
        host = sorted(candidates[:count])
        try:
            plan = place(host)
        except PlanError:
            continue
        need = host_need(host)
        if host_limit is not None and need > host_limit:
            device = sum(sizes) - need
            raise PlanError(
                f"the tables do not fit on the device ({failure.split('; ')[0]}) nor in host "
                f"memory: keeping the fewest largest tables, "
                f"{'table' if count == 1 else 'tables'} {_names(host)}, in host memory needs "
                f"{_size(device)} on the device, which offers {_size(capacities[0])}, and "
                f"{_size(need)} on the host, but {_size(host_limit)} is offered; "
                f"{_host_advice(bytes_per_value)}"
            )
        return plan
    raise PlanError(
        f"{failure}; keeping tables in host memory does not help: the row-wise tables "
        f"{_names(listed)} do not fit on the device alone"
    )


# --------------------------------------------------------------------------------------------
# Manual placement


@dataclass(frozen=True)
class Placement:
    """A placement read by ``load_placement``, the arguments of the same names of
    ``plan_tables``: ``tables`` (``override``; None: the planner places the whole tables) and
    ``row_wise`` (``"auto"``, ``"never"``, ``"all"`` or a list of table indices); ``host``
    (``host_tables``) the tables a saved plan kept in host memory, None when it says nothing."""

    tables: list[list[int]] | None = None
    row_wise: str | list[int] = "auto"
    host: list[int] | None = None


def _index_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise PlanError(f"{what} must be a list of table indices")
    return list(value)


def _parse_placement(data: object) -> Placement:
    """JSON value -> a placement (not yet checked against a model)."""
    row_wise: list[int] = []
    host: list[int] | None = None
    if isinstance(data, dict) and "tables" in data and "world_size" in data:  # a saved plan
        saved = data.get("row_wise", {})
        if isinstance(saved, dict):
            for key in saved:
                if not (isinstance(key, str) and key.isdigit() and key.isascii()):
                    raise PlanError(
                        f"the saved plan's row_wise key {key!r} is not a table index"
                    )
            row_wise = sorted(int(key) for key in saved)
        else:
            row_wise = _index_list(saved, "the saved plan's row_wise")
        host = _index_list(data["host"], "the saved plan's host") if "host" in data else None
        data = data["tables"]
        if isinstance(data, list):
            split = set(row_wise)
            data = [
                [t for t in tables if t not in split] if isinstance(tables, list) else tables
                for tables in data
            ]
    elif isinstance(data, dict):
        if "row_wise" in data:
            data = dict(data)
            row_wise = _index_list(data.pop("row_wise"), "row_wise in the table placement")
            if not data:  # only the row-wise tables: the planner places the rest
                return Placement(None, row_wise)
        by_rank: dict[int, object] = {}
        for key, tables in data.items():
            if not (isinstance(key, str) and key.isdigit() and key.isascii()):
                raise PlanError(
                    f"table placement key {key!r} is not a rank; use \"0\", \"1\", ... as keys "
                    'and "row_wise" for the tables split row-wise'
                )
            by_rank[int(key)] = tables
        data = [by_rank.get(rank, []) for rank in range(max(by_rank) + 1)] if by_rank else []
    if not isinstance(data, list):
        raise PlanError(f"a table placement is one of: {_PLACEMENT_FORMS}")
    placement = []
    for rank, tables in enumerate(data):
        placement.append(_index_list(tables, f"rank {rank} of the table placement"))
    return Placement(placement, row_wise, host)


def load_placement(path_or_text: str) -> Placement:
    """Read a placement (``table_placement``): a word, JSON text or a JSON file.

    Words: ``auto`` (the planner, splitting tables row-wise only when memory demands it),
    ``table_wise`` (whole tables only) and ``row_wise`` (every table split row-wise).
    JSON: ``{"0": [0, 3], "1": [1, 2]}`` (rank -> whole tables; ranks left out hold nothing,
    but the highest rank must be there), ``[[0, 3], [1, 2]]``, either dict form with
    ``"row_wise": [4, 5]`` (these tables split row-wise; without rank keys the planner places
    the rest), or a saved plan (``Plan.to_json()``: its row-wise tables stay row-wise and the
    rest stay where they were; its tables in host memory, ``"host"``, come back as
    ``Placement.host``). Text starting with ``{`` or ``[`` is JSON; any other text that is not
    a word is a path. Checks against the model (every table once, capacity) happen in
    ``plan_tables(override=placement.tables, row_wise=placement.row_wise,
    host_tables=placement.host)``.
    """
    text = path_or_text.strip()
    if not text:
        raise PlanError(f"the table placement is empty; give one of: {_PLACEMENT_FORMS}")
    if text in _PLACEMENT_WORDS:
        return Placement(None, _PLACEMENT_WORDS[text])
    if text[0] in "[{":
        source = "the table placement"
    else:
        source = f"table placement file {path_or_text!r}"
        if not os.path.isfile(text):
            raise PlanError(
                f"{source} does not exist (and the text is not JSON); a table placement is one "
                f"of: {_PLACEMENT_FORMS}"
            )
        with open(text, encoding="utf-8") as handle:
            text = handle.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(f"{source} is not valid JSON: {error}") from None
    return _parse_placement(data)


# --------------------------------------------------------------------------------------------
# Printing


def _span(low: str, high: str) -> str:
    return low if low == high else f"{low}-{high}"


def _size_span(low: int, high: int) -> str:
    """``_size`` of a range of block bytes; an empty block reads 0 (not 0.00 GiB-4 bytes)."""
    return _span("0" if low == 0 and high else _size(low), _size(high))


def format_plan(plan: Plan) -> str:
    """A table for logs: per rank its tables (``9r``: a row-wise block of table 9), rows, GiB,
    % of capacity and % of lookups; a row ``host`` for the tables kept in host memory, if any;
    then a line per row-wise table, and one for the host tables."""
    lines = []
    caps = set(plan.capacity)
    per_rank = f", {_size(plan.capacity[0])} per rank" if len(caps) == 1 else ""
    total_bytes = sum(plan.table_bytes)
    split = f", {len(plan.row_wise)} split row-wise" if plan.row_wise else ""
    host = f", {len(plan.host)} in host memory" if plan.host else ""
    lines.append(
        f"Embedding placement: {_tables_word(plan.num_tables)} on "
        f"{_ranks_word(plan.world_size)}{per_rank}, {_size(total_bytes)} in all{split}{host}"
    )
    entries = [plan.entries(rank) for rank in range(plan.world_size)]
    names = [
        ", ".join(f"{e.table}r" if isinstance(e, TableShard) else str(e) for e in held) or "-"
        for held in entries
    ]
    host_names = _names(plan.host)
    width = max(len("tables"), len(host_names), *(len(n) for n in names))
    header = (
        f"{'rank':>5}  {'tables':<{width}}  {'rows':>13}  {'GiB':>8}  {'capacity':>8}  "
        f"{'lookups':>7}"
    )
    lines += [header, "-" * len(header)]

    def row_count(held: Sequence[Entry]) -> str:
        if not plan.rows:
            return "-"
        return f"{sum(e.rows if isinstance(e, TableShard) else plan.rows[e] for e in held):,}"

    def percent(part: float, whole: float) -> str:
        return f"{100 * part / whole:.1f}%" if whole else "-"

    # Lookups: share of all entries, the host tables' among them (with none, rank_lookup_share).
    lookups = sum(len(held) for held in entries) + len(plan.host)
    for rank in range(plan.world_size):
        used = plan.rank_bytes(rank)
        lines.append(
            f"{rank:>5}  {names[rank]:<{width}}  {row_count(entries[rank]):>13}  "
            f"{used / GIB:>8.2f}  {percent(used, plan.capacity[rank]):>8}  "
            f"{percent(len(entries[rank]), lookups):>7}"
        )
    if plan.host:
        used = plan.host_bytes()
        lines.append(
            f"{'host':>5}  {host_names:<{width}}  {row_count(plan.host):>13}  "
            f"{used / GIB:>8.2f}  {'-':>8}  {percent(len(plan.host), lookups):>7}"
        )
    lines.append("-" * len(header))
    # With host tables the devices' capacity does not bound the total: no % of capacity.
    total_capacity = "-" if plan.host else percent(total_bytes, sum(plan.capacity))
    lines.append(
        f"{'total':>5}  {_tables_word(plan.num_tables):<{width}}  "
        f"{row_count(range(plan.num_tables)):>13}  {total_bytes / GIB:>8.2f}  "
        f"{total_capacity:>8}  {percent(1, 1):>7}"
    )
    for table, bounds in plan.row_wise.items():
        counts = [bounds[r + 1] - bounds[r] for r in range(plan.world_size)]
        per_row = plan.table_bytes[table] // bounds[-1]
        low, high = min(counts), max(counts)
        lines.append(
            f"table {table} ({bounds[-1]:,} rows, {_size(plan.table_bytes[table])}): row-wise "
            f"over {_ranks_word(plan.world_size)}, {_span(f'{low:,}', f'{high:,}')} rows "
            f"({_size_span(low * per_row, high * per_row)}) each"
        )
    if plan.host:
        rows = f"{sum(plan.rows[t] for t in plan.host):,} rows, " if plan.rows else ""
        lines.append(
            f"host memory: {'table' if len(plan.host) == 1 else 'tables'} {host_names} "
            f"({rows}{_size(plan.host_bytes())}), looked up on the host"
        )
    heaviest = max(range(plan.world_size), key=plan.rank_bytes)
    mean = (total_bytes - plan.host_bytes()) / plan.world_size
    if not mean:  # every table in host memory
        lines.append("fullest rank: none, the devices hold no table")
        return "\n".join(lines)
    lines.append(
        f"fullest rank: {heaviest} with {_size(plan.rank_bytes(heaviest))}, "
        f"{plan.rank_bytes(heaviest) / mean:.2f}x the mean of {_size(round(mean))}"
    )
    return "\n".join(lines)
