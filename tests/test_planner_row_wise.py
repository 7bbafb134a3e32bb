"""Row-wise sharding in the planner: tables split across all ranks in equal blocks of rows,
checked against references computed here from the raw inputs (bounds, bytes, brute force)."""

import itertools
import json
import math
import random

import numpy as np
import pytest

from dlrm.distributed.placement import load_placement, Placement
from dlrm.distributed.plan import GIB, Plan, PlanError
from dlrm.distributed.plan_report import format_plan
from dlrm.distributed.planner import plan_tables
from dlrm.nn.table_spec import TableShard
from test_planner import FL15, parse_rows

# ------------------------------------------------------------------------------------------------
# Independent references


def equal_bounds(rows, world_size):
    """Block r holds the rows numpy.array_split gives part r (the first rows % W one more)."""
    return [0] + list(itertools.accumulate(len(part) for part in np.array_split(np.arange(rows), world_size)))


def block_bytes(rows, world_size, rank, per_row):
    bounds = equal_bounds(rows, world_size)
    return (bounds[rank + 1] - bounds[rank]) * per_row


def blocks_per_rank(rows, split, world_size, per_row):
    return [sum(block_bytes(rows[t], world_size, r, per_row) for t in split)
            for r in range(world_size)]


def by_size(rows):
    """Tables largest first, ties: lowest index (the order auto makes tables row-wise)."""
    return sorted(range(len(rows)), key=lambda t: (-rows[t], t))


def assert_valid_row_wise(plan, rows, dim, world_size, capacity, bytes_per_value=4, cap=None):
    """The plan's contract, recomputed from rows, dim and capacity (not from the plan's own
    bookkeeping): every table whole on one rank or split row-wise in equal blocks that cover
    [0, rows) exactly; bytes per rank within capacity; tables[r] consistent with entries(r)."""
    per_row = dim * bytes_per_value
    assert plan.world_size == world_size and len(plan.tables) == world_size
    assert plan.table_bytes == [r * per_row for r in rows]
    capacity = capacity if isinstance(capacity, list) else [capacity] * world_size
    holders = {t: [r for r in range(world_size) if t in plan.tables[r]] for t in range(len(rows))}
    for table, count in enumerate(rows):
        if table in plan.row_wise:
            bounds = plan.row_wise[table]
            assert bounds == equal_bounds(count, world_size)
            assert bounds[0] == 0 and bounds[-1] == count
            assert all(a <= b for a, b in zip(bounds, bounds[1:]))
            assert sum(bounds[r + 1] - bounds[r] for r in range(world_size)) == count
            assert holders[table] == [r for r in range(world_size) if bounds[r] < bounds[r + 1]]
            with pytest.raises(ValueError, match=f"table {table} is split row-wise"):
                plan.rank_of(table)
        else:
            assert len(holders[table]) == 1, (table, holders[table])
            assert plan.rank_of(table) == holders[table][0]
    entries_total = 0
    for rank, held in enumerate(plan.tables):
        assert held == sorted(held)
        entries = plan.entries(rank)
        entries_total += len(entries)
        assert [e.table if isinstance(e, TableShard) else e for e in entries] == held
        expected = 0
        whole = 0
        for entry in entries:
            if isinstance(entry, TableShard):
                bounds = equal_bounds(rows[entry.table], world_size)
                assert (entry.start, entry.stop) == (bounds[rank], bounds[rank + 1])
                assert entry.rows > 0
                expected += entry.rows * per_row
            else:
                assert isinstance(entry, int) and entry not in plan.row_wise
                expected += rows[entry] * per_row
                whole += 1
        assert plan.rank_bytes(rank) == expected
        assert expected <= capacity[rank], (rank, expected, capacity[rank])
        if cap is not None:
            assert whole <= cap, (rank, whole, cap)
    for rank in range(world_size):
        assert plan.rank_lookup_share(rank) == len(plan.entries(rank)) / entries_total
    assert sum(plan.rank_bytes(r) for r in range(world_size)) == sum(plan.table_bytes)


def brute_force_fits(sizes, tables, world_size, cap, free):
    """Is there any assignment of ``tables`` (whole) within cap and free bytes per rank?"""
    for assignment in itertools.product(range(world_size), repeat=len(tables)):
        counts = [0] * world_size
        loads = [0] * world_size
        for table, rank in zip(tables, assignment):
            counts[rank] += 1
            loads[rank] += sizes[table]
        if max(counts, default=0) <= cap and all(loads[r] <= free[r] for r in range(world_size)):
            return True
    return False


# ------------------------------------------------------------------------------------------------
# Bounds and the Plan


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 1000, 8165896])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_all_row_wise_uses_equal_split_bounds(rows, world_size):
    plan = plan_tables([rows], 2, world_size, rows * 8, row_wise="all")
    bounds = plan.row_wise[0]
    assert bounds == equal_bounds(rows, world_size)
    sizes = [bounds[r + 1] - bounds[r] for r in range(world_size)]
    assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1
    assert_valid_row_wise(plan, [rows], 2, world_size, rows * 8)


def test_row_wise_blocks_may_be_empty_when_rows_are_fewer_than_ranks():
    # 4 ranks, the first rows % 4 ranks one row more. Table 0 (3 rows): bounds [0, 1, 2, 3, 3],
    # rank 3 holds none of it. Table 1 (10 rows): [0, 3, 6, 8, 10]. Table 2 (1 row):
    # [0, 1, 1, 1, 1], only rank 0.
    plan = plan_tables([3, 10, 1], 1, 4, 100, row_wise="all")
    assert plan.row_wise == {0: [0, 1, 2, 3, 3], 1: [0, 3, 6, 8, 10], 2: [0, 1, 1, 1, 1]}
    assert plan.tables == [[0, 1, 2], [0, 1], [0, 1], [1]]
    assert plan.entries(0) == [TableShard(0, 0, 1), TableShard(1, 0, 3), TableShard(2, 0, 1)]
    assert plan.entries(3) == [TableShard(1, 8, 10)]
    assert [plan.rank_bytes(r) for r in range(4)] == [20, 16, 12, 8]  # 4 bytes a row
    assert [plan.rank_lookup_share(r) for r in range(4)] == [3 / 8, 2 / 8, 2 / 8, 1 / 8]
    assert_valid_row_wise(plan, [3, 10, 1], 1, 4, 100)


def test_plan_counts_blocks_from_the_bounds_alone():
    """A Plan built by hand without rows: block bytes come from the bounds (rows = bounds[-1])."""
    plan = Plan(2, [[0, 1], [1]], [400, 3000], [5000, 5000], row_wise={1: [0, 20, 30]})
    assert plan.entries(0) == [0, TableShard(1, 0, 20)]
    assert plan.entries(1) == [TableShard(1, 20, 30)]
    assert [plan.rank_bytes(0), plan.rank_bytes(1)] == [400 + 2000, 1000]
    assert plan.rank_of(0) == 0
    with pytest.raises(ValueError, match=r"table 1 is split row-wise .* use entries\(\)"):
        plan.rank_of(1)
    with pytest.raises(IndexError):
        plan.rank_of(2)
    assert plan.to_json() == {"world_size": 2, "tables": [[0, 1], [1]],
                              "row_wise": {"1": [0, 20, 30]}}


# ------------------------------------------------------------------------------------------------
# auto


def test_auto_keeps_whole_tables_when_they_fit():
    for world_size in (2, 4, 8):
        auto = plan_tables(FL15, 128, world_size, 80 * GIB)
        assert auto.row_wise == {}
        assert auto == plan_tables(FL15, 128, world_size, 80 * GIB, row_wise="never")
    # 4 ranks of 4 GiB: tight (15.60 of 16 GiB) but every table fits whole
    tight = plan_tables(FL15, 128, 4, 4 * GIB)
    assert tight.row_wise == {}
    assert_valid_row_wise(tight, FL15, 128, 4, 4 * GIB, cap=7)


def test_auto_on_fl15_splits_the_biggest_tables_and_no_more_than_needed():
    """8 ranks of 3 GiB: tables 19 (3.89 GiB), 0 (3.77) and 21 (3.41) cannot sit whole on any
    rank, so they must be split; auto splits a prefix of the tables by size, and one table fewer
    does not fit."""
    capacity = 3 * GIB
    sizes = [r * 512 for r in FL15]
    too_big = [t for t in range(26) if sizes[t] > capacity]
    assert sorted(too_big) == [0, 19, 21]
    plan = plan_tables(FL15, 128, 8, capacity)
    order = by_size(FL15)
    k = len(plan.row_wise)
    assert set(plan.row_wise) == set(order[:k])
    assert set(too_big) <= set(plan.row_wise)
    assert_valid_row_wise(plan, FL15, 128, 8, capacity, cap=math.ceil((26 - k) / 8))
    # no more than needed: the same greedy with the last-added table whole fails
    with pytest.raises(PlanError, match="fits on no rank"):
        plan_tables(FL15, 128, 8, capacity, row_wise=order[:k - 1])
    # and the list reproduces the plan
    assert plan_tables(FL15, 128, 8, capacity, row_wise=order[:k]) == plan
    # table-wise only, the biggest table fits nowhere
    with pytest.raises(PlanError, match="^table 19 .* fits on no rank"):
        plan_tables(FL15, 128, 8, capacity, row_wise="never")


def test_fl15_on_4_ranks_of_3_gib_does_not_fit_even_row_wise():
    """15.60 GiB of tables cannot fit in 4 x 3 GiB, split or not; the error says so with the
    totals and the fullest rank's shortfall."""
    sizes = [r * 512 for r in FL15]
    assert sum(sizes) > 4 * 3 * GIB
    with pytest.raises(PlanError) as error:
        plan_tables(FL15, 128, 4, 3 * GIB)
    text = str(error.value)
    assert text.startswith(
        "table 19 (8,165,896 rows, 3.89 GiB) fits on no rank, and splitting tables row-wise "
        "across the 4 ranks does not help: with tables 19, 0, 21, 9"
    )
    # reproduce the shortfall: the prefix of tables by size whose blocks first overflow a rank
    order = by_size(FL15)
    for k in range(1, 27):
        blocks = blocks_per_rank(FL15, order[:k], 4, 512)
        if max(blocks) > 3 * GIB:
            break
    fullest = max(range(4), key=lambda r: (blocks[r], -r))
    assert f"tables {', '.join(map(str, order[:k]))} split row-wise, rank {fullest} needs " in text
    assert f"{(blocks[fullest] - 3 * GIB) / GIB:.2f} GiB short" in text
    assert "the 26 tables need 15.60 GiB in all and 4 ranks offer 12.00 GiB" in text
    assert text.endswith(
        "add ranks, lower `embedding_dim`, cap rows with `max_table_size`, or store the tables "
        "in fp16/bf16 with `embedding_dtype`"
    )


def test_auto_against_brute_force_on_small_instances():
    """auto returns a valid plan whenever splitting every table would fit (row blocks only grow
    as tables are split, so that is when a plan exists at all); it splits a prefix of the tables
    by size, never fewer than the fewest with which some placement of the rest exists (brute
    force), and one fewer fails its greedy."""
    rng = random.Random(31)
    outcomes = {"plan": 0, "split": 0, "minimal": 0, "error": 0}
    for _ in range(300):
        num_tables = rng.randint(1, 5)
        world_size = rng.randint(2, 3)
        rows = [rng.randint(1, 40) for _ in range(num_tables)]
        sizes = [4 * r for r in rows]
        low = sum(sizes) // (2 * world_size)
        capacity = [rng.randint(low, sum(sizes)) for _ in range(world_size)]
        order = by_size(rows)
        all_blocks = blocks_per_rank(rows, order, world_size, 4)
        feasible = all(all_blocks[r] <= capacity[r] for r in range(world_size))
        try:
            plan = plan_tables(rows, 1, world_size, capacity)
        except PlanError as error:
            assert not feasible, (rows, world_size, capacity)
            assert "row blocks alone" in str(error)
            outcomes["error"] += 1
            continue
        k = len(plan.row_wise)
        assert set(plan.row_wise) == set(order[:k])
        assert_valid_row_wise(plan, rows, 1, world_size, capacity,
                              cap=math.ceil((num_tables - k) / world_size))
        if k:
            outcomes["split"] += 1
            with pytest.raises(PlanError):
                plan_tables(rows, 1, world_size, capacity, row_wise=order[:k - 1])
        fewest = None
        for j in range(num_tables + 1):
            blocks = blocks_per_rank(rows, order[:j], world_size, 4)
            free = [capacity[r] - blocks[r] for r in range(world_size)]
            rest = order[j:]
            if min(free) >= 0 and brute_force_fits(
                sizes, rest, world_size, math.ceil(len(rest) / world_size), free
            ):
                fewest = j
                break
        assert fewest is not None and k >= fewest
        outcomes["minimal"] += k == fewest
        outcomes["plan"] += 1
    assert outcomes["split"] > 30 and outcomes["error"] > 20, outcomes
    assert outcomes["minimal"] >= 0.9 * outcomes["plan"], outcomes  # the greedy is a heuristic


# ------------------------------------------------------------------------------------------------
# all, explicit lists, override


def test_all_splits_every_table():
    rows = [7, 100, 30, 1]
    plan = plan_tables(rows, 2, 3, 10_000, row_wise="all")
    assert plan.row_wise == {t: equal_bounds(rows[t], 3) for t in range(4)}
    assert_valid_row_wise(plan, rows, 2, 3, 10_000)
    # one rank: a row-wise table is a single block of all its rows
    single = plan_tables(rows, 2, 1, 10_000, row_wise="all")
    assert single.entries(0) == [TableShard(t, 0, rows[t]) for t in range(4)]
    assert single.rank_bytes(0) == sum(rows) * 8


def test_explicit_list_splits_exactly_those_tables():
    # 4 bytes a row. Table 1 (100 rows) split over 2 ranks: 200 bytes each. The rest by the
    # greedy on 300 bytes free per rank, cap ceil(3 / 2) = 2: t2 (50) -> r0, t0 (20) -> r1,
    # t3 (10) -> r1 (free 220 > 120)
    rows = [20, 100, 50, 10]
    plan = plan_tables(rows, 1, 2, 500, row_wise=[1])
    assert plan.row_wise == {1: [0, 50, 100]}
    assert plan.tables == [[1, 2], [0, 1, 3]]
    assert plan.entries(0) == [TableShard(1, 0, 50), 2]
    assert plan.entries(1) == [0, TableShard(1, 50, 100), 3]
    assert [plan.rank_bytes(0), plan.rank_bytes(1)] == [400, 320]
    assert_valid_row_wise(plan, rows, 1, 2, 500, cap=2)
    never = plan_tables(rows, 1, 2, 500, row_wise="never")
    assert plan_tables(rows, 1, 2, 500, row_wise=[]) == never


def test_override_with_row_wise_tables():
    rows = [20, 100, 50, 10]  # 80, 400, 200, 40 bytes on ranks of 600
    plan = plan_tables(rows, 1, 2, 600, override=[[0, 2, 3], []], row_wise=[1])
    assert plan.tables == [[0, 1, 2, 3], [1]]
    assert plan.entries(1) == [TableShard(1, 50, 100)]
    assert_valid_row_wise(plan, rows, 1, 2, 600)  # no cap: an override ignores it
    # "all" with an override: every list empty
    every = plan_tables(rows, 1, 2, 600, override=[[], []], row_wise="all")
    assert every == plan_tables(rows, 1, 2, 600, row_wise="all")
    # "auto" with an override: the override lists every table, none is split
    assert plan_tables(rows, 1, 2, 600, override=[[1], [0, 2, 3]]).row_wise == {}


@pytest.mark.parametrize(
    "override, row_wise, words",
    [
        ([[0, 1, 2], [3]], [1],
         "the table placement puts table 1 on rank 0, but table 1 is split row-wise across all "
         "ranks; leave it out"),
        ([[0], [3]], [1], r"leaves table\(s\) 2 on no rank"),
        ([[0, 2, 3], []], [1, 0], "puts table 0 on rank 0, but table 0 is split row-wise"),
        # blocks count toward capacity: rank 0 holds 200 bytes of table 1 + 320 bytes of whole
        # tables on 500 bytes
        ([[0, 2, 3], []], [1],
         r"the table placement overflows rank 0: tables 0, 2, 3 and 200 bytes of row-wise blocks "
         r"need 520 bytes but the rank has 500 bytes \(20 bytes over\)"),
    ],
)
def test_override_errors_with_row_wise_tables(override, row_wise, words):
    with pytest.raises(PlanError, match=words):
        plan_tables([20, 100, 50, 10], 1, 2, 500, override=override, row_wise=row_wise)


@pytest.mark.parametrize(
    "row_wise, words",
    [
        ([4], r"names table 4, but there are only 4 tables \(0 to 3\)"),
        ([1, 1], "names table 1 twice"),
        ([-1], "must be >= 0"),
        ([1.5], "must be an integer"),
        ([True], "must be an integer"),
        (7, "must be a list of table indices"),
    ],
)
def test_bad_row_wise_lists_are_plan_errors(row_wise, words):
    with pytest.raises(PlanError, match=words):
        plan_tables([20, 100, 50, 10], 1, 2, 500, row_wise=row_wise)


def test_an_unknown_row_wise_mode_is_a_value_error():
    with pytest.raises(ValueError, match="row_wise must be one of auto, never, all") as error:
        plan_tables([20, 100], 1, 2, 500, row_wise="sometimes")
    assert type(error.value) is ValueError


def test_row_wise_blocks_that_overflow_a_rank_name_the_numbers():
    # table 1 (100 rows, 400 bytes) over ranks of 150 and 300 bytes: 200 bytes a rank
    with pytest.raises(PlanError) as error:
        plan_tables([20, 100], 1, 2, [150, 300], row_wise=[1])
    assert str(error.value) == (
        "the row-wise tables do not fit: with table 1 split row-wise, rank 0 needs 200 bytes for "
        "its row blocks alone but has 150 bytes, 50 bytes short; the 2 tables need 480 bytes in "
        "all and 2 ranks offer 450 bytes; add ranks, lower `embedding_dim`, cap rows with "
        "`max_table_size`, or store the tables in fp16/bf16 with `embedding_dtype`"
    )
    with pytest.raises(PlanError, match="with tables 0, 1 split row-wise, rank 0 needs 240 bytes"):
        plan_tables([20, 100], 1, 2, [150, 300], row_wise="all")


def test_a_list_whose_rest_does_not_fit_points_at_more_row_wise_tables():
    # 80, 400 and 200 bytes on ranks of 350. Table 1 split: 200 bytes a rank, 150 left on
    # each; table 2 (200 bytes) fits nowhere whole
    with pytest.raises(PlanError) as error:
        plan_tables([20, 100, 50], 1, 2, 350, row_wise=[1])
    text = str(error.value)
    assert text.startswith(
        "table 2 (50 rows, 200 bytes) fits on no rank: the most free memory is 150 bytes on rank 0 "
        "(after the row-wise blocks of 1), 50 bytes short;"
    )
    assert text.endswith("`table_placement=auto`")
    # auto: 1 split (150 free), 2 fails -> 2 split (blocks 300, 50 free), 0 (80) fails -> 0 split
    # (blocks 340 of 350)
    plan = plan_tables([20, 100, 50], 1, 2, 350)
    assert plan.row_wise == {0: [0, 10, 20], 1: [0, 50, 100], 2: [0, 25, 50]}
    assert_valid_row_wise(plan, [20, 100, 50], 1, 2, 350)


def test_one_rank_cannot_split_so_auto_gives_the_table_wise_error():
    with pytest.raises(PlanError) as error:
        plan_tables([20, 100], 1, 1, 300)
    assert str(error.value) == (
        "table 1 (100 rows, 400 bytes) fits on no rank: the most free memory is 300 bytes on "
        "rank 0, 100 bytes short; the 2 tables need 480 bytes in all and 1 rank offers 300 bytes; "
        "add ranks, lower `embedding_dim`, cap rows with `max_table_size`, or store the tables "
        "in fp16/bf16 with `embedding_dtype`"
    )
    with pytest.raises(PlanError) as never:
        plan_tables([20, 100], 1, 1, 300, row_wise="never")
    assert str(never.value) == str(error.value)  # no row-wise hint with one rank


# ------------------------------------------------------------------------------------------------
# Printing


def test_format_plan_marks_row_wise_blocks():
    capacity = 3 * GIB
    plan = plan_tables(FL15, 128, 8, capacity)
    text = format_plan(plan)
    lines = text.splitlines()
    k = len(plan.row_wise)
    assert lines[0] == (
        f"Embedding placement: 26 tables on 8 ranks, 3.00 GiB per rank, 15.60 GiB in all, "
        f"{k} split row-wise"
    )
    rows = parse_rows(text)
    assert set(rows) == {str(r) for r in range(8)} | {"total"}
    for rank in range(8):
        tables, row_count, gib, used, lookups = rows[str(rank)]
        names = [f"{t}r" if t in plan.row_wise else str(t) for t in plan.tables[rank]]
        assert tables == ", ".join(names)
        held_rows = sum(
            (equal_bounds(FL15[t], 8)[rank + 1] - equal_bounds(FL15[t], 8)[rank])
            if t in plan.row_wise else FL15[t]
            for t in plan.tables[rank]
        )
        assert row_count == f"{held_rows:,}"
        assert gib == f"{held_rows * 512 / GIB:.2f}"
        assert used == f"{100 * held_rows * 512 / capacity:.1f}%"
        entries = sum(len(held) for held in plan.tables)
        assert lookups == f"{100 * len(plan.tables[rank]) / entries:.1f}%"
    assert rows["total"][:2] == ["26 tables", f"{sum(FL15):,}"]
    # table 19: 8,165,896 rows = 8 x 1,020,737, equal blocks
    assert "table 19 (8,165,896 rows, 3.89 GiB): row-wise over 8 ranks, 1,020,737 rows " \
           "(0.49 GiB) each" in lines
    # table 0: 7,912,889 rows, blocks of 989,111 and 989,112
    assert "table 0 (7,912,889 rows, 3.77 GiB): row-wise over 8 ranks, 989,111-989,112 rows " \
           "(0.47 GiB) each" in lines
    assert sum(line.startswith("table ") for line in lines) == k
    assert lines[-1].startswith("fullest rank: ")
    assert len(lines) == 8 + 6 + k


def test_format_plan_shows_differing_block_sizes():
    plan = plan_tables([3, 10], 1, 4, 100, row_wise=[0])
    text = format_plan(plan)
    assert text.splitlines()[0].endswith(", 1 split row-wise")
    assert "table 0 (3 rows, 12 bytes): row-wise over 4 ranks, 0-1 rows (0-4 bytes) each" in text
    # bounds [0, 1, 2, 3, 3]: rank 3 holds nothing of table 0; table 1 goes whole to rank 3
    # (all ranks have 100 - 0 or 100 - 4 bytes free: rank 3 is the freest)
    assert plan.tables == [[0], [0], [0], [1]]
    rows = parse_rows(text)
    assert [rows[str(r)][:2] for r in range(4)] == [["0r", "1"], ["0r", "1"], ["0r", "1"],
                                                   ["1", "10"]]


# ------------------------------------------------------------------------------------------------
# load_placement


def test_load_placement_words_and_forms(tmp_path):
    assert load_placement("auto") == Placement(None, "auto")
    assert load_placement(" table_wise ") == Placement(None, "never")
    assert load_placement("row_wise") == Placement(None, "all")
    assert load_placement('{"0": [0, 3], "1": [1], "row_wise": [2, 4]}') == \
        Placement([[0, 3], [1]], [2, 4])
    assert load_placement('{"row_wise": [4]}') == Placement(None, [4])
    assert load_placement('[[0], [1, 2]]') == Placement([[0], [1, 2]], [])
    saved = {"world_size": 2, "tables": [[0, 1, 2], [1, 3]], "row_wise": {"1": [0, 5, 9]}}
    assert load_placement(json.dumps(saved)) == Placement([[0, 2], [3]], [1])
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(saved))
    assert load_placement(str(path)) == Placement([[0, 2], [3]], [1])
    # each maps directly onto plan_tables
    rows = [20, 100, 50, 10]
    for text, expected in [
        ("auto", plan_tables(rows, 1, 2, 500)),
        ("table_wise", plan_tables(rows, 1, 2, 500, row_wise="never")),
        ("row_wise", plan_tables(rows, 1, 2, 500, row_wise="all")),
        ('{"row_wise": [1]}', plan_tables(rows, 1, 2, 500, row_wise=[1])),
        ('{"0": [0, 2], "1": [3], "row_wise": [1]}',
         plan_tables(rows, 1, 2, 500, override=[[0, 2], [3]], row_wise=[1])),
    ]:
        placement = load_placement(text)
        got = plan_tables(rows, 1, 2, 500, override=placement.tables, row_wise=placement.row_wise)
        assert got == expected, text


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rows=FL15, dim=128, world_size=8, capacity=3 * GIB),
        dict(rows=FL15, dim=128, world_size=4, capacity=80 * GIB),
        dict(rows=[3, 10, 1], dim=1, world_size=4, capacity=100, row_wise="all"),
        dict(rows=[20, 100, 50, 10], dim=1, world_size=2, capacity=500, row_wise=[1]),
    ],
)
def test_a_saved_plan_loads_back_as_the_same_plan(kwargs):
    plan = plan_tables(**kwargs)
    placement = load_placement(json.dumps(plan.to_json()))
    args = {k: v for k, v in kwargs.items() if k != "row_wise"}
    again = plan_tables(**args, override=placement.tables, row_wise=placement.row_wise)
    assert again == plan


@pytest.mark.parametrize(
    "text, words",
    [
        ('{"row_wise": [1, "2"]}', "row_wise in the table placement must be a list"),
        ('{"row_wise": 3}', "row_wise in the table placement must be a list"),
        ('{"world_size": 2, "tables": [[0], [1]], "row_wise": {"x": [0]}}',
         "row_wise key 'x' is not a table index"),
        ('{"0": [0], "rowwise": [1]}', "key 'rowwise' is not a rank"),
        ("sometimes", "auto, table_wise, row_wise"),
        ("   ", "the table placement is empty; give one of: auto, table_wise, row_wise"),
        ('"auto"', "a table placement is one of: auto, table_wise, row_wise"),
    ],
)
def test_load_placement_errors_name_the_accepted_forms(text, words):
    with pytest.raises(PlanError, match=words):
        load_placement(text)
