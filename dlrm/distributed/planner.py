"""Placement of embedding tables on ranks for hybrid-parallel training.

Each rank holds whole tables and looks them up for the global batch; the planner decides which
rank holds which table. It balances bytes (fp32 weights), because memory is what runs out, and
it caps the number of tables per rank, because with one id per feature the number of tables a
rank holds is its share of lookups and of the all-to-all traffic.

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

GIB = 2**30
_MIB = 2**20
_BYTES_PER_VALUE = 4  # fp32 weights
_ADVICE = "add ranks, lower `embedding_dim`, or cap rows with `max_table_size`"


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


def _check_assignment(assignment: object, num_tables: int, world_size: int) -> list[list[int]]:
    """A manual placement: every table on exactly one rank, one list per rank; returns the lists
    sorted."""
    if isinstance(assignment, (str, bytes)) or not isinstance(assignment, Sequence):
        raise PlanError("the table placement must be a list with one list of tables per rank")
    if len(assignment) != world_size:
        raise PlanError(
            f"the table placement lists {_ranks_word(len(assignment))} but the world size is "
            f"{world_size}; give one list per rank, [] for a rank without tables"
        )
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
    missing = [t for t in range(num_tables) if t not in owner]
    if missing:
        names = ", ".join(map(str, missing))
        raise PlanError(
            f"the table placement leaves table(s) {names} on no rank; every table needs a rank"
        )
    return result


def _check_capacity(tables: list[list[int]], sizes: list[int], capacity: list[int]) -> None:
    for rank, held in enumerate(tables):
        used = sum(sizes[t] for t in held)
        if used > capacity[rank]:
            raise PlanError(
                f"the table placement overflows rank {rank}: tables "
                f"{', '.join(map(str, held))} need {_size(used)} but the rank has "
                f"{_size(capacity[rank])} ({_size(used - capacity[rank])} over); move a table to "
                "another rank or raise `capacity`"
            )


# --------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class Plan:
    """Which rank holds which table, with the numbers that justify it.

    ``tables[r]`` lists the global table indices on rank ``r`` in ascending order, the order in
    which the rank stores and exchanges them. ``table_bytes`` and ``rows`` are in global table
    order; ``rows`` may be empty when unknown (it only feeds ``format_plan``). ``plan_tables``
    builds plans and checks them; this class only holds the result.
    """

    world_size: int
    tables: list[list[int]]
    table_bytes: list[int]
    capacity: list[int]
    rows: list[int] = field(default_factory=list)

    @property
    def num_tables(self) -> int:
        return len(self.table_bytes)

    def rank_of(self, table: int) -> int:
        """The rank that holds ``table`` (a global index)."""
        for rank, held in enumerate(self.tables):
            if table in held:
                return rank
        raise IndexError(f"table {table} is not in this plan of {self.num_tables} tables")

    def rank_bytes(self, rank: int) -> int:
        """Bytes of the tables on ``rank`` (fp32 weights)."""
        return sum(self.table_bytes[t] for t in self.tables[rank])

    def rank_lookup_share(self, rank: int) -> float:
        """Share of all lookups that ``rank`` serves (its share of gather work and exchange):
        with one id per feature and sample, every table costs the same lookups."""
        return len(self.tables[rank]) / self.num_tables


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


# --------------------------------------------------------------------------------------------
# Planning


def _greedy(
    sizes: list[int], rows: list[int], capacity: list[int], limit: int
) -> list[list[int]]:
    """Largest table first onto the rank with the most free memory that still has a slot."""
    world_size = len(capacity)
    free = list(capacity)
    held: list[list[int]] = [[] for _ in range(world_size)]
    for table in sorted(range(len(sizes)), key=lambda t: (-sizes[t], t)):
        best = -1
        for rank in range(world_size):
            if len(held[rank]) < limit and (best < 0 or free[rank] > free[best]):
                best = rank
        if sizes[table] > free[best]:
            raise PlanError(_no_room(table, sizes, rows, capacity, free, held, best, limit))
        free[best] -= sizes[table]
        held[best].append(table)
    return [sorted(tables) for tables in held]


def _no_room(
    table: int,
    sizes: list[int],
    rows: list[int],
    capacity: list[int],
    free: list[int],
    held: list[list[int]],
    best: int,
    limit: int,
) -> str:
    size = sizes[table]
    message = (
        f"table {table} ({rows[table]:,} rows, {_size(size)}) fits on no rank: the most free "
        f"memory is {_size(free[best])} on rank {best}, {_size(size - free[best])} short"
    )
    capped = [r for r in range(len(free)) if len(held[r]) >= limit and free[r] >= size]
    if capped:
        message += (
            f" (rank {capped[0]} has room but already holds {limit} tables, the cap per rank;"
            " give an `override` placement)"
        )
    total, offered = sum(sizes), sum(capacity)
    if total > offered:
        message += (
            f"; the {len(sizes)} tables need {_size(total)} in all and "
            f"{_ranks_word(len(capacity))} {'offers' if len(capacity) == 1 else 'offer'} "
            f"{_size(offered)}"
        )
    return f"{message}; {_ADVICE}"


def plan_tables(
    rows: Sequence[int],
    dim: int,
    world_size: int,
    capacity: int | Sequence[int],
    override: Sequence[Sequence[int]] | None = None,
    state_bytes_per_row: int = 0,
    bytes_per_value: int = _BYTES_PER_VALUE,
) -> Plan:
    """Place whole tables on ranks; see docs/distributed.md for the algorithm and the flags.

    ``capacity`` is bytes per rank available for tables (one number for all, or one per rank);
    ``state_bytes_per_row`` the embedding optimizer's state per row, counted with the weights,
    ``bytes_per_value`` the size of one weight (4 for fp32 tables, 2 for fp16/bf16).
    The greedy balances bytes with at most ``ceil(tables / ranks)`` tables per rank.
    ``override`` (``override[r]`` = tables on rank ``r``) replaces the greedy; it is validated
    and must fit, but the cap on tables per rank does not apply to it.
    Raises ``ValueError`` for malformed inputs and ``PlanError`` for placements that cannot work.
    """
    sizes = table_bytes(rows, dim, state_bytes_per_row, bytes_per_value)
    row_counts = [int(r) for r in rows]
    world_size = _whole(world_size, "world size", minimum=1)
    capacities = _capacities(capacity, world_size)
    if override is not None:
        tables = _check_assignment(override, len(sizes), world_size)
        _check_capacity(tables, sizes, capacities)
    else:
        tables = _greedy(sizes, row_counts, capacities, math.ceil(len(sizes) / world_size))
    return Plan(world_size, tables, sizes, capacities, rows=row_counts)


# --------------------------------------------------------------------------------------------
# Manual placement


def _parse_placement(data: object) -> list[list[int]]:
    """JSON value -> one list of table indices per rank (not yet checked against a model)."""
    if isinstance(data, dict) and "tables" in data and "world_size" in data:
        data = data["tables"]  # a saved plan works as a placement
    if isinstance(data, dict):
        by_rank: dict[int, object] = {}
        for key, tables in data.items():
            if not (isinstance(key, str) and key.isdigit() and key.isascii()):
                raise PlanError(
                    f"table placement key {key!r} is not a rank; use \"0\", \"1\", ... as keys"
                )
            by_rank[int(key)] = tables
        data = [by_rank.get(rank, []) for rank in range(max(by_rank) + 1)] if by_rank else []
    if not isinstance(data, list):
        raise PlanError(
            'a table placement is {"0": [0, 3], "1": [1, 2]} or [[0, 3], [1, 2]] '
            "(tables per rank), or a saved plan"
        )
    placement = []
    for rank, tables in enumerate(data):
        if not isinstance(tables, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in tables
        ):
            raise PlanError(f"rank {rank} of the table placement must be a list of table indices")
        placement.append(list(tables))
    return placement


def load_override(path_or_text: str) -> list[list[int]]:
    """Read a manual placement from JSON text or a JSON file (``--table_placement``).

    Accepted: ``{"0": [0, 3], "1": [1, 2]}`` (rank -> tables; ranks left out hold nothing, but
    the highest rank must be there), ``[[0, 3], [1, 2]]``, or a saved plan (an object with
    ``world_size`` and ``tables``; only ``tables`` is used). Text starting with ``{`` or ``[``
    is JSON; anything else is a path. Checks against the model (every table once, capacity)
    happen in ``plan_tables``.
    """
    text = path_or_text.strip()
    if not text:
        raise PlanError("the table placement is empty")
    if text[0] in "[{":
        source = "the table placement"
    else:
        source = f"table placement file {path_or_text!r}"
        if not os.path.isfile(text):
            raise PlanError(f"{source} does not exist (and the text is not JSON)")
        with open(text, encoding="utf-8") as handle:
            text = handle.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(f"{source} is not valid JSON: {error}") from None
    return _parse_placement(data)


# --------------------------------------------------------------------------------------------
# Printing


def format_plan(plan: Plan) -> str:
    """A table for logs: per rank its tables, rows, GiB, % of capacity and % of lookups."""
    lines = []
    caps = set(plan.capacity)
    per_rank = f", {_size(plan.capacity[0])} per rank" if len(caps) == 1 else ""
    total_bytes = sum(plan.table_bytes)
    lines.append(
        f"Embedding placement: {_tables_word(plan.num_tables)} on "
        f"{_ranks_word(plan.world_size)}{per_rank}, {_size(total_bytes)} in all"
    )
    names = [", ".join(map(str, held)) or "-" for held in plan.tables]
    width = max(len("tables"), *(len(n) for n in names))
    header = (
        f"{'rank':>5}  {'tables':<{width}}  {'rows':>13}  {'GiB':>8}  {'capacity':>8}  "
        f"{'lookups':>7}"
    )
    lines += [header, "-" * len(header)]

    def row_count(tables: Sequence[int]) -> str:
        return f"{sum(plan.rows[t] for t in tables):,}" if plan.rows else "-"

    def percent(part: float, whole: float) -> str:
        return f"{100 * part / whole:.1f}%" if whole else "-"

    for rank, held in enumerate(plan.tables):
        used = plan.rank_bytes(rank)
        lines.append(
            f"{rank:>5}  {names[rank]:<{width}}  {row_count(held):>13}  {used / GIB:>8.2f}  "
            f"{percent(used, plan.capacity[rank]):>8}  "
            f"{percent(plan.rank_lookup_share(rank), 1):>7}"
        )
    lines.append("-" * len(header))
    everything = range(plan.num_tables)
    lines.append(
        f"{'total':>5}  {_tables_word(plan.num_tables):<{width}}  {row_count(everything):>13}  "
        f"{total_bytes / GIB:>8.2f}  {percent(total_bytes, sum(plan.capacity)):>8}  "
        f"{percent(plan.num_tables, plan.num_tables):>7}"
    )
    heaviest = max(range(plan.world_size), key=plan.rank_bytes)
    mean = total_bytes / plan.world_size
    lines.append(
        f"fullest rank: {heaviest} with {_size(plan.rank_bytes(heaviest))}, "
        f"{plan.rank_bytes(heaviest) / mean:.2f}x the mean of {_size(round(mean))}"
    )
    return "\n".join(lines)
