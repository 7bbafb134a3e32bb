"""Placement of embedding tables on ranks for hybrid-parallel training.

Each rank looks up the tables it holds for the whole global batch and sends the results to the
ranks that own the samples through one all-to-all. A table is held in one of two ways:

* table-wise (the default): the whole table lives on one rank. The planner balances bytes
  (weights plus optimizer state), because memory is what runs out, and caps the number of tables
  per rank, because with one id per feature the number of tables a rank holds is its share of
  lookups and of the all-to-all traffic.
* row-wise: the table is split across all ranks in contiguous blocks of rows, rank ``r`` holding
  rows ``[b[r], b[r+1])``, the first ``rows % world_size`` ranks one row more (``row_bounds``, the
  engine's one row-split convention, ``dlrm.engine.partition``). Every rank looks up its block
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

The plan itself lives in ``dlrm.distributed.plan``, the strategies in
``dlrm.distributed.placement_strategies``, the parsing of manual placements in
``dlrm.distributed.placement`` and the printed report in ``dlrm.distributed.plan_report``; the
names are importable from here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from dlrm.distributed.placement import Placement, load_placement
from dlrm.distributed.placement_strategies import (
    PlanRequest,
    advice_for,
    host_advice,
    place,
    place_host_auto,
)
from dlrm.distributed.plan import (
    BYTES_PER_VALUE,
    GIB,
    Entry,
    Plan,
    PlanError,
    cache_bytes,
    format_bytes,
    ranks_word,
    row_bounds,
    table_bytes,
    table_index,
    table_names,
    whole_number,
)
from dlrm.distributed.plan_report import format_plan
from dlrm.nn.cached_embedding import SLOT_BOOKKEEPING_BYTES, SLOT_STATE_BYTES

__all__ = [
    "GIB", "Entry", "HostCacheSizing", "Placement", "Plan", "PlanError", "format_plan", "load_placement",
    "plan_tables", "row_bounds", "size_host_cache", "table_bytes",
]

_ROW_WISE_MODES = ("auto", "never", "all")
_HOST_MODES = ("none", "auto")


def _single_process(world_size: int) -> str:
    return (
        "tables in host memory (`host_tables`) are for single-process runs, and this run has "
        f"{world_size} processes; with several processes `table_placement=row_wise` splits "
        "large tables across them instead"
    )


def _capacities(capacity: int | Sequence[int], world_size: int) -> list[int]:
    if isinstance(capacity, Sequence) and not isinstance(capacity, (str, bytes)):
        if len(capacity) != world_size:
            raise ValueError(
                f"capacity lists {ranks_word(len(capacity))} but the world size is {world_size}"
            )
        return [whole_number(c, f"capacity of rank {r} (bytes)") for r, c in enumerate(capacity)]
    return [whole_number(capacity, "capacity per rank (bytes)")] * world_size


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
        index = table_index(table, num_tables, name, item, f"{name} names")
        if index in tables:
            raise PlanError(f"{name} names table {index} twice")
        tables.append(index)
    return tables


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
    bytes_per_value: int = BYTES_PER_VALUE,
    row_wise: str | Sequence[int] = "auto",
    host_tables: str | Sequence[int] | None = None,
    host_capacity: int | None = None,
    host_cache_rows: int | str = 0,
    host_cache_reserve: int = 0,
    host_cache_batch_rows: Sequence[int] = (),
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
    ``host_cache_rows``: device rows caching the host tables (at most their rows), which with
    their slot map (``cache_bytes``) must fit on the device beside its tables; or ``"auto"``:
    as many as fit in what the device has left (``size_host_cache``: the capacity less the
    device tables, ``host_cache_reserve`` bytes for the dense part and a batch's activations,
    and the slot map), at least the sum over the host tables of ``host_cache_batch_rows`` (per
    table, the most distinct rows one batch may look up), at most the host tables' rows.
    Raises ``ValueError`` for malformed inputs and ``PlanError`` for placements that cannot work.
    """
    sizes = table_bytes(rows, dim, state_bytes_per_row, bytes_per_value)
    world_size = whole_number(world_size, "world size", minimum=1)
    capacities = _capacities(capacity, world_size)
    mode, listed = _row_wise_tables(row_wise, len(sizes))
    host_mode, host_listed = _host_tables(host_tables, len(sizes))
    host_limit = None if host_capacity is None else whole_number(host_capacity, "host capacity (bytes)")
    if host_listed and world_size > 1:
        raise PlanError(_single_process(world_size))
    if mode == "list":
        both = [t for t in host_listed if t in listed]
        if both:
            raise PlanError(
                f"table {both[0]} is listed both as row-wise and in `host_tables`; a table is "
                "either split row-wise on the devices or kept whole in host memory"
            )

    request = PlanRequest(sizes, [int(r) for r in rows], world_size, capacities, mode, listed, override,
                          advice_for(bytes_per_value))
    plan = _place_host(request, host_mode, host_listed, host_limit, bytes_per_value)
    if host_cache_rows == "auto":
        if not plan.host:
            return plan
        sizing = size_host_cache(plan, dim, bytes_per_value, host_cache_reserve, host_cache_batch_rows)
        return dataclasses.replace(plan, host_cache_rows=sizing.rows, host_cache_bytes=sizing.cache_bytes)
    cache_rows = whole_number(host_cache_rows, "host cache rows")
    if cache_rows and plan.host:
        return _with_host_cache(plan, cache_rows, dim, state_bytes_per_row, bytes_per_value)
    return plan


@dataclass(frozen=True)
class HostCacheSizing:
    """How ``host_cache_rows="auto"`` sizes the device cache of the host tables: as many rows as
    fit in what the device has left once the plan's device tables, the dense part and a batch's
    activations (``reserve``) and the slot map have their bytes, at most the host tables' rows.
    A cached row costs its values, the fp32 accumulator every slot keeps (row-wise Adagrad's
    state) and the slot's bookkeeping (``dlrm.nn.cached_embedding``)."""

    capacity: int  # the device's bytes (the plan's capacity of rank 0)
    device_tables: int  # the tables the plan keeps on the device, with their optimizer state
    reserve: int  # the dense part (weights, gradients, optimizer state) and a batch's activations
    host_rows: int  # rows of the host tables: the slot map holds 4 bytes for each
    value_bytes: int  # a row's values: dim x bytes per value
    batch_rows: int  # the most distinct host rows one batch may look up: the fewest the cache may hold

    state_bytes = SLOT_STATE_BYTES
    slot_bytes = SLOT_BOOKKEEPING_BYTES

    @property
    def row_bytes(self) -> int:
        return self.value_bytes + self.state_bytes + self.slot_bytes

    @property
    def slot_map_bytes(self) -> int:
        return 4 * self.host_rows

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.device_tables - self.reserve - self.slot_map_bytes

    @property
    def fitting_rows(self) -> int:
        return max(self.free_bytes, 0) // self.row_bytes

    @property
    def rows(self) -> int:
        return min(self.host_rows, self.fitting_rows)

    @property
    def cache_bytes(self) -> int:
        return self.rows * self.row_bytes + self.slot_map_bytes

    def describe(self) -> str:
        """One line for the run log: the rows chosen and the arithmetic behind them."""
        capped = self.fitting_rows > self.host_rows
        return (
            f"host_table_cache_rows=auto: {self.rows:,} rows cached on the device"
            + (", every row of the host tables" if capped else "")
            + f" = ({format_bytes(self.capacity)} of device - {format_bytes(self.device_tables)} of device tables"
            f" - {format_bytes(self.reserve)} for the dense part and a batch's activations"
            f" - {format_bytes(self.slot_map_bytes)} of slot map, 4 bytes x {self.host_rows:,} host rows)"
            f" / {self.row_bytes} bytes a row ({self.value_bytes} of values, {self.state_bytes} of row-wise "
            f"Adagrad accumulator, {self.slot_bytes} of slot bookkeeping)"
            + (f", capped at the host tables' {self.host_rows:,} rows" if capped else "")
            + f"; one batch looks up at most {self.batch_rows:,} of them"
        )

    def to_json(self) -> dict:
        return {"rows": self.rows, "row_bytes": self.row_bytes, "value_bytes": self.value_bytes,
                "state_bytes": self.state_bytes, "slot_bytes": self.slot_bytes, "capacity": self.capacity,
                "device_tables": self.device_tables, "reserve": self.reserve, "slot_map_bytes": self.slot_map_bytes,
                "free_bytes": self.free_bytes, "host_rows": self.host_rows, "batch_rows": self.batch_rows}


def size_host_cache(plan: Plan, dim: int, bytes_per_value: int = BYTES_PER_VALUE, reserve: int = 0,
                    batch_rows: Sequence[int] = ()) -> HostCacheSizing:
    """The ``"auto"`` cache of ``plan``'s host tables (``HostCacheSizing``; ``plan_tables``
    documents the arguments), or ``PlanError`` when fewer rows fit than one batch may look up."""
    reserve = whole_number(reserve, "host cache reserve (bytes)")
    if batch_rows and len(batch_rows) != plan.num_tables:
        raise ValueError(f"batch_rows lists {len(batch_rows)} tables but the plan has {plan.num_tables}")
    host_rows = sum(plan.rows[t] for t in plan.host)
    need = sum(min(plan.rows[t], whole_number(batch_rows[t], f"batch rows of table {t}")) for t in plan.host) \
        if batch_rows else 1
    sizing = HostCacheSizing(plan.capacity[0], plan.rank_bytes(0), reserve, host_rows,
                             whole_number(dim, "embedding dim", minimum=1) * bytes_per_value, max(need, 1))
    if sizing.rows < sizing.batch_rows:
        raise PlanError(
            f"`host_table_cache_rows=auto` finds room for {sizing.fitting_rows:,} cached rows of "
            f"{sizing.row_bytes} bytes ({format_bytes(max(sizing.free_bytes, 0))} of the device's "
            f"{format_bytes(sizing.capacity)} after {format_bytes(sizing.device_tables)} of device tables, "
            f"{format_bytes(sizing.reserve)} for the dense part and a batch's activations and "
            f"{format_bytes(sizing.slot_map_bytes)} of slot map), fewer than the {sizing.batch_rows:,} rows one "
            "batch may look up in the host tables; lower `batch_size` (and `test_batch_size`), give "
            "`host_table_cache_rows` a number, or 0 to look the host tables up on the host"
        )
    return sizing


def _with_host_cache(plan: Plan, cache_rows: int, dim: int, state_bytes_per_row: int, bytes_per_value: int) -> Plan:
    """``plan`` with the host tables' device cache (on rank 0), or ``PlanError`` when it does not fit."""
    host_rows = sum(plan.rows[t] for t in plan.host)
    rows = min(cache_rows, host_rows)
    plan = dataclasses.replace(plan, host_cache_rows=rows, host_cache_bytes=cache_bytes(
        rows, host_rows, dim, state_bytes_per_row, bytes_per_value))
    if plan.device_bytes(0) > plan.capacity[0]:
        raise PlanError(
            f"the device cache of {plan.host_cache_rows:,} host-table rows needs "
            f"{format_bytes(plan.host_cache_bytes)} beside the device tables' {format_bytes(plan.rank_bytes(0))}, "
            f"more than the device's {format_bytes(plan.capacity[0])}; lower `host_table_cache_rows`"
        )
    return plan


def _place_host(request: PlanRequest, host_mode: str, host_listed: list[int], host_limit: int | None,
                bytes_per_value: int) -> Plan:
    """The placement with the host tables ``host_mode`` asks for (``plan_tables``)."""
    sizes, world_size, override = request.sizes, request.world_size, request.override
    if host_mode == "list":
        need = sum(sizes[t] for t in host_listed)
        if host_limit is not None and need > host_limit:
            raise PlanError(
                f"host {'table' if len(host_listed) == 1 else 'tables'} {table_names(host_listed)} "
                f"need {format_bytes(need)} of host memory but {format_bytes(host_limit)} is offered; keep "
                f"fewer tables in host memory (`host_tables`), {host_advice(bytes_per_value)}"
            )
        return place(request, host_listed)
    if host_mode != "auto" or world_size > 1 or override is not None:
        return place(request, [])
    try:
        return place(request, [])
    except PlanError as error:
        failure = str(error)
    return place_host_auto(request, failure, host_limit, bytes_per_value)
