"""The printed placement report: per rank its tables, rows, bytes, share of capacity and of
lookups, then the row-wise tables and the tables in host memory."""

from __future__ import annotations

from collections.abc import Sequence

from dlrm.distributed.plan import GIB, Entry, Plan, format_bytes, ranks_word, table_names, tables_word
from dlrm.nn.table_spec import TableShard


def _span(low: str, high: str) -> str:
    return low if low == high else f"{low}-{high}"


def _size_span(low: int, high: int) -> str:
    """``format_bytes`` of a range of block bytes; an empty block reads 0 (not 0.00 GiB-4 bytes)."""
    return _span("0" if low == 0 and high else format_bytes(low), format_bytes(high))


def _percent(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _row_count(plan: Plan, held: Sequence[Entry]) -> str:
    """The rows of ``held`` (whole tables and row-wise blocks), or "-" when the plan has no rows."""
    if not plan.rows:
        return "-"
    return f"{sum(e.rows if isinstance(e, TableShard) else plan.rows[e] for e in held):,}"


def _headline(plan: Plan) -> str:
    per_rank = f", {format_bytes(plan.capacity[0])} per rank" if len(set(plan.capacity)) == 1 else ""
    split = f", {len(plan.row_wise)} split row-wise" if plan.row_wise else ""
    host = f", {len(plan.host)} in host memory" if plan.host else ""
    return (
        f"Embedding placement: {tables_word(plan.num_tables)} on "
        f"{ranks_word(plan.world_size)}{per_rank}, {format_bytes(sum(plan.table_bytes))} in all{split}{host}"
    )


def _rank_table(plan: Plan) -> list[str]:
    """The table's header, a row per rank (and ``host``), and the total: tables, rows, GiB, % of
    capacity and % of lookups."""
    entries = [plan.entries(rank) for rank in range(plan.world_size)]
    names = [
        ", ".join(f"{e.table}r" if isinstance(e, TableShard) else str(e) for e in held) or "-"
        for held in entries
    ]
    host_names = table_names(plan.host)
    width = max(len("tables"), len(host_names), *(len(n) for n in names))
    header = (
        f"{'rank':>5}  {'tables':<{width}}  {'rows':>13}  {'GiB':>8}  {'capacity':>8}  "
        f"{'lookups':>7}"
    )
    lines = [header, "-" * len(header)]
    # Lookups: share of all entries, the host tables' among them (with none, rank_lookup_share).
    lookups = sum(len(held) for held in entries) + len(plan.host)
    for rank in range(plan.world_size):
        used = plan.rank_bytes(rank)
        lines.append(
            f"{rank:>5}  {names[rank]:<{width}}  {_row_count(plan, entries[rank]):>13}  "
            f"{used / GIB:>8.2f}  {_percent(used, plan.capacity[rank]):>8}  "
            f"{_percent(len(entries[rank]), lookups):>7}"
        )
    if plan.host:
        used = plan.host_bytes()
        lines.append(
            f"{'host':>5}  {host_names:<{width}}  {_row_count(plan, plan.host):>13}  "
            f"{used / GIB:>8.2f}  {'-':>8}  {_percent(len(plan.host), lookups):>7}"
        )
    lines.append("-" * len(header))
    total_bytes = sum(plan.table_bytes)
    # With host tables the devices' capacity does not bound the total: no % of capacity.
    total_capacity = "-" if plan.host else _percent(total_bytes, sum(plan.capacity))
    lines.append(
        f"{'total':>5}  {tables_word(plan.num_tables):<{width}}  "
        f"{_row_count(plan, range(plan.num_tables)):>13}  {total_bytes / GIB:>8.2f}  "
        f"{total_capacity:>8}  {_percent(1, 1):>7}"
    )
    return lines


def _placement_lines(plan: Plan) -> list[str]:
    """A line per row-wise table (rows and bytes per rank), then one for the host tables."""
    lines = []
    for table, bounds in plan.row_wise.items():
        counts = [bounds[r + 1] - bounds[r] for r in range(plan.world_size)]
        per_row = plan.table_bytes[table] // bounds[-1]
        low, high = min(counts), max(counts)
        lines.append(
            f"table {table} ({bounds[-1]:,} rows, {format_bytes(plan.table_bytes[table])}): row-wise "
            f"over {ranks_word(plan.world_size)}, {_span(f'{low:,}', f'{high:,}')} rows "
            f"({_size_span(low * per_row, high * per_row)}) each"
        )
    if plan.host:
        rows = f"{sum(plan.rows[t] for t in plan.host):,} rows, " if plan.rows else ""
        lines.append(
            f"host memory: {'table' if len(plan.host) == 1 else 'tables'} {table_names(plan.host)} "
            f"({rows}{format_bytes(plan.host_bytes())}), looked up on the host"
            + (f" through {plan.host_cache_rows:,} rows cached on the device ({format_bytes(plan.host_cache_bytes)} "
               "with the slot map)" if plan.host_cache_rows else "")
        )
    return lines


def _fullest_line(plan: Plan) -> str:
    heaviest = max(range(plan.world_size), key=plan.rank_bytes)
    mean = (sum(plan.table_bytes) - plan.host_bytes()) / plan.world_size
    if not mean:  # every table in host memory
        return "fullest rank: none, the devices hold no table"
    return (
        f"fullest rank: {heaviest} with {format_bytes(plan.rank_bytes(heaviest))}, "
        f"{plan.rank_bytes(heaviest) / mean:.2f}x the mean of {format_bytes(round(mean))}"
    )


def format_plan(plan: Plan) -> str:
    """A table for logs: per rank its tables (``9r``: a row-wise block of table 9), rows, GiB,
    % of capacity and % of lookups; a row ``host`` for the tables kept in host memory, if any;
    then a line per row-wise table, and one for the host tables."""
    return "\n".join([_headline(plan), *_rank_table(plan), *_placement_lines(plan), _fullest_line(plan)])
