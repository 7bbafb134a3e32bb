"""Placement strategies of the planner, as plain functions of a ``PlanRequest``.

``place`` puts every table that is not in host memory on the devices: a manual placement as
given, else the table-wise greedy (``greedy``), and with ``row_wise="auto"`` the largest
remaining table moves to row-wise, one at a time, until the rest fit whole. ``place_host_auto``
(one process) keeps the fewest largest tables in host memory so that the rest fit on the device.
``dlrm.distributed.planner.plan_tables`` checks the arguments and picks the strategy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dlrm.distributed.plan import (
    Plan,
    PlanError,
    block_bytes,
    format_bytes,
    ranks_word,
    row_bounds,
    table_index,
    table_names,
    tables_word,
)


@dataclass(frozen=True)
class PlanRequest:
    """``plan_tables``' arguments, checked: what every strategy reads.

    ``sizes`` and ``rows`` per table in global order; ``capacity`` bytes per rank; ``mode`` the
    row-wise choice (``"auto"``, ``"never"``, ``"all"`` or ``"list"``) and ``row_wise`` the
    tables row-wise from the start; ``override`` a manual placement of the whole tables or None;
    ``advice`` what a user can change when the tables do not fit.
    """

    sizes: list[int]
    rows: list[int]
    world_size: int
    capacity: list[int]
    mode: str
    row_wise: list[int]
    override: Sequence[Sequence[int]] | None
    advice: str


def host_advice(bytes_per_value: int) -> str:
    """What a user can change when the host tables do not fit in host memory."""
    dtype = ", store the tables in fp16/bf16 with `embedding_dtype`" if bytes_per_value > 2 else ""
    return (
        f"lower `embedding_dim`, cap rows with `max_table_size`{dtype}, or run several processes "
        "(`table_placement=row_wise` splits large tables across them)"
    )


def advice_for(bytes_per_value: int) -> str:
    """What a user can change when the tables do not fit."""
    if bytes_per_value > 2:
        return (
            "add ranks, lower `embedding_dim`, cap rows with `max_table_size`, or store the "
            "tables in fp16/bf16 with `embedding_dtype`"
        )
    return "add ranks, lower `embedding_dim`, or cap rows with `max_table_size`"


def check_assignment(
    assignment: object, num_tables: int, world_size: int, row_wise: Sequence[int] = (),
    host: Sequence[int] = (),
) -> list[list[int]]:
    """A manual placement: every table-wise table on exactly one rank, no row-wise table and
    no table kept in host memory, one list per rank; returns the lists sorted."""
    if isinstance(assignment, (str, bytes)) or not isinstance(assignment, Sequence):
        raise PlanError("the table placement must be a list with one list of tables per rank")
    if len(assignment) != world_size:
        raise PlanError(
            f"the table placement lists {ranks_word(len(assignment))} but the world size is "
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
            index = table_index(table, num_tables, "the table placement", f"table index on rank {rank}",
                                "the table placement puts", f" on rank {rank}")
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
            f"the table placement leaves table(s) {table_names(missing)} on no rank; every table needs "
            "a rank (or to be listed under `row_wise`)"
        )
    return result


def check_capacity(
    tables: list[list[int]], sizes: list[int], capacity: list[int], blocks: list[int]
) -> None:
    for rank, held in enumerate(tables):
        used = sum(sizes[t] for t in held) + blocks[rank]
        if used > capacity[rank]:
            what = f"tables {table_names(held)}" if held else "no whole table"
            extra = f" and {format_bytes(blocks[rank])} of row-wise blocks" if blocks[rank] else ""
            raise PlanError(
                f"the table placement overflows rank {rank}: {what}{extra} need {format_bytes(used)} but "
                f"the rank has {format_bytes(capacity[rank])} ({format_bytes(used - capacity[rank])} over); "
                "move a table to another rank or raise `capacity`"
            )


class NoRoom(Exception):
    """The greedy found no rank for ``table``; the caller words the message."""

    def __init__(self, table: int, free: list[int], held: list[list[int]], best: int, limit: int):
        super().__init__(table)
        self.table, self.free, self.held, self.best, self.limit = table, free, held, best, limit


def greedy(
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
            raise NoRoom(table, free, held, best, limit)
        free[best] -= sizes[table]
        held[best].append(table)
    return [sorted(ts) for ts in held]


def _totals(sizes: list[int], capacity: list[int], what: str = "") -> str:
    """``sizes``: the bytes of the tables on the devices; ``what`` qualifies them."""
    total, offered = sum(sizes), sum(capacity)
    return (
        f"the {tables_word(len(sizes))}{what} {'needs' if len(sizes) == 1 else 'need'} "
        f"{format_bytes(total)} in all and "
        f"{ranks_word(len(capacity))} {'offers' if len(capacity) == 1 else 'offer'} "
        f"{format_bytes(offered)}"
    )


def no_room(
    gap: NoRoom, sizes: list[int], rows: list[int], capacity: list[int], split: list[int],
    host: Sequence[int] = (),
) -> str:
    """The first clause and numbers of a table-wise failure (without the advice); the totals
    leave out the tables kept in host memory (``host``)."""
    table, free, best = gap.table, gap.free, gap.best
    size = sizes[table]
    after = f" (after the row-wise blocks of {table_names(split)})" if split else ""
    message = (
        f"table {table} ({rows[table]:,} rows, {format_bytes(size)}) fits on no rank: the most free "
        f"memory is {format_bytes(free[best])} on rank {best}{after}, {format_bytes(size - free[best])} short"
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


def blocks_overflow(
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
        f"with {'table' if len(split) == 1 else 'tables'} {table_names(split)} split row-wise, "
        f"rank {fullest} needs {format_bytes(blocks[fullest])} for its row blocks alone but "
        f"has {format_bytes(capacity[fullest])}, {format_bytes(short[fullest])} short; "
        f"{_totals(device, capacity, ' not in host memory' if host else '')}"
    )


def row_blocks(request: PlanRequest, split: Sequence[int]) -> tuple[dict[int, list[int]], list[int]]:
    """The row bounds of each table of ``split`` and the bytes of every rank's blocks of them."""
    bounds = {t: row_bounds(request.rows[t], request.world_size) for t in split}
    blocks = [sum(block_bytes(b, request.sizes[t], r) for t, b in bounds.items())
              for r in range(request.world_size)]
    return bounds, blocks


def _finish(request: PlanRequest, placed: list[list[int]], bounds: dict[int, list[int]],
            host: Sequence[int]) -> Plan:
    """The plan of whole tables ``placed`` per rank plus every rank's non-empty row-wise blocks."""
    tables = [
        sorted(held + [t for t, b in bounds.items() if b[r] < b[r + 1]])
        for r, held in enumerate(placed)
    ]
    return Plan(request.world_size, tables, request.sizes, request.capacity, rows=request.rows,
                row_wise=dict(sorted(bounds.items())), host=list(host))


def _table_wise_hint(request: PlanRequest, host: Sequence[int]) -> str:
    """What else to try when the table-wise greedy fails and no table is split automatically."""
    if request.world_size > 1 and request.mode == "never":
        return "; `table_placement=row_wise` (or `auto`) splits tables row-wise across ranks"
    if request.world_size > 1 and request.mode == "list":
        return "; list more tables as row-wise in `table_placement`, or use `table_placement=auto`"
    if host:
        return "; keep more tables in host memory with `host_tables`, or let `host_tables=auto` choose them"
    return ""


def place(request: PlanRequest, host: Sequence[int]) -> Plan:
    """The plan with ``host`` in host memory and every other table on the devices: the manual
    placement if there is one, else the greedy, splitting the largest remaining table row-wise
    while it fails (``mode="auto"``, several ranks)."""
    sizes, capacity, world_size = request.sizes, request.capacity, request.world_size
    split = [t for t in request.row_wise if t not in host]
    bounds, blocks = row_blocks(request, split)
    overflow = blocks_overflow(split, blocks, sizes, capacity, host)
    if overflow is not None:
        raise PlanError(f"the row-wise tables do not fit: {overflow}; {request.advice}")
    if request.override is not None:
        placed = check_assignment(request.override, len(sizes), world_size, split, host)
        check_capacity(placed, sizes, capacity, blocks)
        return _finish(request, placed, bounds, host)

    first: str | None = None  # the table-wise failure, named first if splitting does not help
    while True:
        whole = [t for t in range(len(sizes)) if t not in bounds and t not in host]
        free = [c - b for c, b in zip(capacity, blocks)]
        try:
            placed = greedy(whole, sizes, free, math.ceil(len(whole) / world_size))
        except NoRoom as gap:
            message = no_room(gap, sizes, request.rows, capacity, split, host)
            if request.mode != "auto" or world_size == 1:
                hint = _table_wise_hint(request, host)
                raise PlanError(f"{message}; {request.advice}{hint}") from None
            if first is None:
                table = gap.table
                first = (f"table {table} ({request.rows[table]:,} rows, "
                         f"{format_bytes(sizes[table])}) fits on no rank")
            split.append(max(whole, key=lambda t: (sizes[t], -t)))  # largest, ties: lowest
        else:
            return _finish(request, placed, bounds, host)
        bounds, blocks = row_blocks(request, split)
        overflow = blocks_overflow(split, blocks, sizes, capacity, host)
        if overflow is not None:
            raise PlanError(
                f"{first}, and splitting tables row-wise across the {world_size} ranks does "
                f"not help: {overflow}; {request.advice}"
            ) from None


def place_host_auto(request: PlanRequest, failure: str, host_limit: int | None,
                    bytes_per_value: int) -> Plan:
    """One process whose tables do not all fit on its device (``failure``: why): the largest
    tables, fewest first, go to host memory (never a table listed as row-wise)."""
    sizes = request.sizes
    candidates = sorted((t for t in range(len(sizes)) if t not in request.row_wise),
                        key=lambda t: (-sizes[t], t))
    for count in range(1, len(candidates) + 1):
        host = sorted(candidates[:count])
        try:
            plan = place(request, host)
        except PlanError:
            continue
        need = sum(sizes[t] for t in host)
        if host_limit is not None and need > host_limit:
            device = sum(sizes) - need
            raise PlanError(
                f"the tables do not fit on the device ({failure.split('; ')[0]}) nor in host "
                f"memory: keeping the fewest largest tables, "
                f"{'table' if count == 1 else 'tables'} {table_names(host)}, in host memory needs "
                f"{format_bytes(device)} on the device, which offers "
                f"{format_bytes(request.capacity[0])}, and {format_bytes(need)} on the host, but "
                f"{format_bytes(host_limit)} is offered; {host_advice(bytes_per_value)}"
            )
        return plan
    raise PlanError(
        f"{failure}; keeping tables in host memory does not help: the row-wise tables "
        f"{table_names(request.row_wise)} do not fit on the device alone"
    )
