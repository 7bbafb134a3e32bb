"""Tables kept in host memory by the planner (``plan_tables(host_tables=...)``), single-process
runs only, checked against references computed here from the raw inputs (rows, dim, capacity)."""

import json
import random

import pytest

from dlrm.distributed.placement import load_placement
from dlrm.distributed.plan import GIB, Plan, PlanError
from dlrm.distributed.plan_report import format_plan
from dlrm.distributed.planner import plan_tables

from test_planner import FL15  # NVIDIA's Criteo 1TB cardinalities at frequency threshold 15

DIM = 128
CAPACITY = 8 * GIB

# ------------------------------------------------------------------------------------------------
# Independent references


def sizes_of(rows, dim, bytes_per_value=4):
    return [r * dim * bytes_per_value for r in rows]


def largest_first(sizes):
    """Tables by bytes, largest first, ties: lowest index."""
    return sorted(range(len(sizes)), key=lambda t: (-sizes[t], t))


def fewest_largest(sizes, capacity):
    """On one device every table fits iff their sum does: the smallest k such that all but the k
    largest tables fit, and those k tables."""
    order = largest_first(sizes)
    for k in range(len(sizes) + 1):
        if sum(sizes[t] for t in order[k:]) <= capacity:
            return sorted(order[:k])
    raise AssertionError("unreachable: no table left always fits")


def gib(num_bytes):
    return f"{num_bytes / GIB:.2f} GiB"


def assert_valid_host_plan(plan, rows, dim, capacity, host):
    """One rank holds every table but ``host``, whole; bytes recomputed from rows and dim."""
    sizes = sizes_of(rows, dim)
    device = [t for t in range(len(rows)) if t not in host]
    assert plan.world_size == 1
    assert plan.host == sorted(host)
    assert plan.tables == [device]
    assert plan.entries(0) == device
    assert plan.row_wise == {}
    assert plan.rank_bytes(0) == sum(sizes[t] for t in device) <= capacity
    assert plan.host_bytes() == sum(sizes[t] for t in host)
    assert plan.rank_bytes(0) + plan.host_bytes() == sum(sizes)
    for table in host:
        with pytest.raises(ValueError, match=f"table {table} is kept in host memory"):
            plan.rank_of(table)
    for table in device:
        assert plan.rank_of(table) == 0


# ------------------------------------------------------------------------------------------------
# auto


def test_auto_keeps_the_fewest_largest_fl15_tables_in_host_memory():
    sizes = sizes_of(FL15, DIM)
    assert sum(sizes) > CAPACITY  # the premise: FL15 at dim 128 does not fit one 8 GiB device
    host = fewest_largest(sizes, CAPACITY)
    plan = plan_tables(FL15, DIM, 1, CAPACITY, host_tables="auto")
    assert_valid_host_plan(plan, FL15, DIM, CAPACITY, host)
    # Fewest: with one table fewer in host memory (the smallest of them) the rest do not fit.
    order = largest_first(sizes)
    k = len(host)
    assert sorted(order[:k]) == host
    assert sum(sizes[t] for t in order[k - 1:]) > CAPACITY
    with pytest.raises(PlanError, match="fits on no rank"):
        plan_tables(FL15, DIM, 1, CAPACITY, host_tables=order[:k - 1])
    # The numbers as they stand today (tables 19 and 0, 7.67 GiB, leave 7.93 GiB on the device).
    assert host == [0, 19]
    assert gib(plan.host_bytes()) == "7.67 GiB" and gib(plan.rank_bytes(0)) == "7.93 GiB"


def test_auto_keeps_nothing_in_host_memory_when_the_tables_fit():
    plain = plan_tables(FL15, DIM, 1, 16 * GIB)
    plan = plan_tables(FL15, DIM, 1, 16 * GIB, host_tables="auto")
    assert plan == plain and plan.host == [] and plan.host_bytes() == 0
    assert "host" not in plan.to_json()


@pytest.mark.parametrize("seed", range(40))
def test_auto_matches_the_reference_on_random_tables(seed):
    rng = random.Random(seed)
    rows = [rng.choice([1, 7, 50, 300, 2000, 2000]) for _ in range(rng.randint(1, 9))]
    dim = rng.choice([1, 4, 16])
    sizes = sizes_of(rows, dim)
    capacity = rng.randint(0, sum(sizes))
    host = fewest_largest(sizes, capacity)
    plan = plan_tables(rows, dim, 1, capacity, host_tables="auto")
    assert_valid_host_plan(plan, rows, dim, capacity, host)
    format_plan(plan)  # prints, even when every table is in host memory


def test_auto_with_several_processes_is_none():
    # Two ranks of 7.81 GiB: FL15 does not fit whole, auto splits row-wise, nothing goes to host.
    capacity = int(7.81 * GIB)
    plain = plan_tables(FL15, DIM, 2, capacity)
    assert plain.row_wise  # the premise: split row-wise
    assert plan_tables(FL15, DIM, 2, capacity, host_tables="auto") == plain
    with pytest.raises(PlanError) as plain_error:
        plan_tables(FL15, DIM, 2, capacity, row_wise="never")
    with pytest.raises(PlanError) as auto_error:
        plan_tables(FL15, DIM, 2, capacity, row_wise="never", host_tables="auto")
    assert str(auto_error.value) == str(plain_error.value)


# ------------------------------------------------------------------------------------------------
# Explicit lists, none, validation


def test_explicit_list_keeps_exactly_those_tables_in_host_memory():
    plan = plan_tables(FL15, DIM, 1, CAPACITY, host_tables=[19, 0, 21])
    assert_valid_host_plan(plan, FL15, DIM, CAPACITY, [0, 19, 21])
    # A list that is not needed is still honoured.
    small = plan_tables(FL15, DIM, 1, 64 * GIB, host_tables=[5])
    assert_valid_host_plan(small, FL15, DIM, 64 * GIB, [5])
    # An empty list is no host tables, with any number of processes.
    assert plan_tables(FL15, DIM, 2, 80 * GIB, host_tables=[]) == plan_tables(FL15, DIM, 2, 80 * GIB)


@pytest.mark.parametrize("host_tables", [None, "none"])
def test_none_gives_the_existing_error(host_tables):
    with pytest.raises(PlanError) as plain:
        plan_tables(FL15, DIM, 1, CAPACITY)
    with pytest.raises(PlanError) as error:
        plan_tables(FL15, DIM, 1, CAPACITY, host_tables=host_tables)
    assert str(error.value) == str(plain.value)
    assert str(error.value).startswith("table 21 (7,156,453 rows, 3.41 GiB) fits on no rank")


def test_explicit_list_that_leaves_too_much_on_the_device_says_so():
    sizes = sizes_of(FL15, DIM)
    device = sum(sizes) - sizes[19]
    with pytest.raises(PlanError) as error:
        plan_tables(FL15, DIM, 1, CAPACITY, host_tables=[19])
    message = str(error.value)
    # the first table, largest first, that no longer fits (tables 0 and 21 do, 9 does not)
    used, first = 0, None
    for table in largest_first(sizes):
        if table != 19:
            if used + sizes[table] > CAPACITY:
                first = table
                break
            used += sizes[table]
    assert first == 9
    assert message.startswith(
        f"table 9 (5,554,114 rows, {gib(sizes[9])}) fits on no rank: the most free memory is "
        f"{gib(CAPACITY - used)} on rank 0, {gib(sizes[9] - (CAPACITY - used))} short"
    )
    assert f"the 25 tables not in host memory need {gib(device)} in all and 1 rank offers 8.00 GiB" in message
    assert message.endswith(
        "keep more tables in host memory with `host_tables`, or let `host_tables=auto` choose them"
    )


def test_host_tables_need_a_single_process():
    with pytest.raises(PlanError) as error:
        plan_tables(FL15, DIM, 2, 80 * GIB, host_tables=[0, 19])
    assert str(error.value) == (
        "tables in host memory (`host_tables`) are for single-process runs, and this run has 2 "
        "processes; with several processes `table_placement=row_wise` splits large tables "
        "across them instead"
    )


@pytest.mark.parametrize(
    "host_tables, message",
    [
        ([0, 0], "`host_tables` names table 0 twice"),
        ([26], r"`host_tables` names table 26, but there are only 26 tables \(0 to 25\)"),
        ([-1], "the list of `host_tables` is invalid: a host table index must be >= 0"),
        ([True], "the list of `host_tables` is invalid: a host table index must be an integer"),
        ([1.5], "the list of `host_tables` is invalid: a host table index must be an integer"),
        (7, "`host_tables` must be a list of table indices"),
    ],
)
def test_invalid_lists_are_plan_errors(host_tables, message):
    with pytest.raises(PlanError, match=message):
        plan_tables(FL15, DIM, 1, 64 * GIB, host_tables=host_tables)


def test_unknown_word_is_a_value_error():
    with pytest.raises(ValueError, match="host_tables must be one of none, auto"):
        plan_tables(FL15, DIM, 1, 64 * GIB, host_tables="all")


def test_a_table_cannot_be_row_wise_and_in_host_memory():
    with pytest.raises(PlanError, match="table 19 is listed both as row-wise and in `host_tables`"):
        plan_tables(FL15, DIM, 1, 64 * GIB, row_wise=[19], host_tables=[0, 19])
    # row_wise="all" splits the tables that stay on the device (one block each on one rank)
    plan = plan_tables([10, 20, 30], 2, 1, 1000, row_wise="all", host_tables=[2])
    assert plan.host == [2] and plan.tables == [[0, 1]] and sorted(plan.row_wise) == [0, 1]
    assert plan.rank_bytes(0) == (10 + 20) * 8 and plan.host_bytes() == 30 * 8


def test_override_leaves_out_the_host_tables():
    rows = [100, 200, 300]
    plan = plan_tables(rows, 4, 1, 10**6, override=[[0, 2]], host_tables=[1])
    assert plan.tables == [[0, 2]] and plan.host == [1]
    with pytest.raises(PlanError, match=r"puts table 1 on rank 0, but table 1 is kept in host memory"):
        plan_tables(rows, 4, 1, 10**6, override=[[0, 1, 2]], host_tables=[1])
    with pytest.raises(PlanError, match="leaves table"):
        plan_tables(rows, 4, 1, 10**6, override=[[0]], host_tables=[1])
    # auto does not second-guess an override: it places every table
    with pytest.raises(PlanError, match="overflows rank 0"):
        plan_tables(rows, 4, 1, 1000, override=[[0, 1, 2]], host_tables="auto")


# ------------------------------------------------------------------------------------------------
# host_capacity


def test_explicit_list_over_host_capacity():
    sizes = sizes_of(FL15, DIM)
    need = sizes[0] + sizes[19]
    offered = 6 * GIB
    assert need > offered
    with pytest.raises(PlanError) as error:
        plan_tables(FL15, DIM, 1, CAPACITY, host_tables=[19, 0], host_capacity=offered)
    assert str(error.value) == (
        f"host tables 0, 19 need {gib(need)} of host memory but {gib(offered)} is offered; keep "
        "fewer tables in host memory (`host_tables`), lower `embedding_dim`, cap rows with "
        "`max_table_size`, store the tables in fp16/bf16 with `embedding_dtype`, or run several "
        "processes (`table_placement=row_wise` splits large tables across them)"
    )
    assert "7.67 GiB of host memory but 6.00 GiB is offered" in str(error.value)
    # exactly enough is enough
    plan = plan_tables(FL15, DIM, 1, CAPACITY, host_tables=[19, 0], host_capacity=need)
    assert plan.host_bytes() == need


def test_auto_over_host_capacity_names_device_and_host_bytes():
    sizes = sizes_of(FL15, DIM)
    host = fewest_largest(sizes, CAPACITY)
    need = sum(sizes[t] for t in host)
    device = sum(sizes) - need
    with pytest.raises(PlanError) as error:
        plan_tables(FL15, DIM, 1, CAPACITY, host_tables="auto", host_capacity=4 * GIB)
    message = str(error.value)
    assert message.startswith(
        "the tables do not fit on the device (table 21 (7,156,453 rows, 3.41 GiB) fits on no rank"
    )
    assert (
        f"keeping the fewest largest tables, tables 0, 19, in host memory needs {gib(device)} on "
        f"the device, which offers 8.00 GiB, and {gib(need)} on the host, but 4.00 GiB is offered"
    ) in message
    assert "`max_table_size`" in message and "`embedding_dim`" in message
    assert "`embedding_dtype`" in message and "several processes" in message
    # fp16 tables: the advice leaves `embedding_dtype` out
    with pytest.raises(PlanError) as half:
        plan_tables(FL15, DIM, 1, 4 * GIB, bytes_per_value=2, host_tables="auto", host_capacity=GIB)
    assert "`embedding_dtype`" not in str(half.value)
    # enough host memory: the plan as without a bound
    assert plan_tables(FL15, DIM, 1, CAPACITY, host_tables="auto", host_capacity=need) == \
        plan_tables(FL15, DIM, 1, CAPACITY, host_tables="auto")


# ------------------------------------------------------------------------------------------------
# Printing and saving


def test_format_plan_shows_the_host_tables():
    sizes = sizes_of(FL15, DIM)
    plan = plan_tables(FL15, DIM, 1, CAPACITY, host_tables="auto")
    host = [0, 19]
    device = [t for t in range(26) if t not in host]
    host_rows = FL15[0] + FL15[19]
    host_bytes = sizes[0] + sizes[19]
    device_bytes = sum(sizes) - host_bytes
    lines = format_plan(plan).splitlines()
    assert lines[0] == (
        f"Embedding placement: 26 tables on 1 rank, 8.00 GiB per rank, {gib(sum(sizes))} in all, "
        "2 in host memory"
    )
    rank0 = lines[3].split()
    assert rank0[0] == "0" and rank0[-4:] == [
        f"{sum(FL15[t] for t in device):,}", f"{device_bytes / GIB:.2f}",
        f"{100 * device_bytes / CAPACITY:.1f}%", f"{100 * 24 / 26:.1f}%",
    ]
    host_row = lines[4].split()
    assert host_row == ["host", "0,", "19", f"{host_rows:,}", f"{host_bytes / GIB:.2f}", "-",
                        f"{100 * 2 / 26:.1f}%"]
    total = lines[6].split()
    assert total == ["total", "26", "tables", f"{sum(FL15):,}", f"{sum(sizes) / GIB:.2f}", "-",
                     "100.0%"]
    assert lines[7] == (
        f"host memory: tables 0, 19 ({host_rows:,} rows, {gib(host_bytes)}), looked up on the host"
    )
    assert lines[8] == (
        f"fullest rank: 0 with {gib(device_bytes)}, 1.00x the mean of {gib(device_bytes)}"
    )
    assert len(lines) == 9


def test_format_plan_without_host_tables_has_no_host_lines():
    text = format_plan(plan_tables(FL15, DIM, 1, 16 * GIB, host_tables="auto"))
    assert "host" not in text


def test_format_plan_of_one_host_table_and_of_every_table_on_the_host():
    plan = plan_tables([10, 20], 4, 1, 160, host_tables=[1])
    assert "host memory: table 1 (20 rows, 320 bytes), looked up on the host" in format_plan(plan)
    everything = plan_tables([10, 20], 4, 1, 0, host_tables="auto")
    assert everything.host == [0, 1] and everything.tables == [[]]
    assert everything.rank_lookup_share(0) == 0.0
    assert format_plan(everything).splitlines()[-1] == "fullest rank: none, the devices hold no table"


def test_to_json_lists_the_host_tables_and_load_placement_reads_them(tmp_path):
    plan = plan_tables(FL15, DIM, 1, CAPACITY, host_tables="auto")
    data = plan.to_json()
    assert data["host"] == [0, 19]
    assert data["tables"] == [[t for t in range(26) if t not in (0, 19)]]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    placement = load_placement(str(path))
    assert placement.host == [0, 19] and placement.tables == data["tables"]
    again = plan_tables(FL15, DIM, 1, CAPACITY, override=placement.tables,
                        row_wise=placement.row_wise, host_tables=placement.host)
    assert again == plan
    assert load_placement("auto").host is None


def test_plan_by_hand_defaults_to_no_host_tables():
    plan = Plan(1, [[0, 1]], [8, 16], [100])
    assert plan.host == [] and plan.host_bytes() == 0 and "host" not in plan.to_json()
    with_host = Plan(1, [[0]], [8, 16], [100], host=[1])
    assert with_host.rank_bytes(0) == 8 and with_host.host_bytes() == 16
    assert with_host.to_json()["host"] == [1]


def test_host_cache_is_counted_on_the_device_and_must_fit_there():
    """``host_cache_rows``: per cached row its values and optimizer state, per host row 4 bytes
    of slot map, on the device beside its tables; capped at the host tables' rows."""
    rows, dim, state = [100, 1000, 50], 8, 4
    per_row = dim * 2 + state  # bf16 values, row-wise Adagrad
    device = (100 + 50) * per_row
    cache = 200 * per_row + 4 * 1000
    plan = plan_tables(rows, dim, 1, device + cache, host_tables=[1], host_cache_rows=200,
                       state_bytes_per_row=state, bytes_per_value=2)
    assert (plan.host, plan.host_cache_rows, plan.host_cache_bytes) == ([1], 200, cache)
    assert plan.device_bytes(0) == device + cache and plan.rank_bytes(0) == device
    assert plan.to_json()["host_cache_rows"] == 200
    assert "through 200 rows cached on the device" in format_plan(plan)
    with pytest.raises(PlanError, match="lower `host_table_cache_rows`"):
        plan_tables(rows, dim, 1, device + cache - 1, host_tables=[1], host_cache_rows=200,
                    state_bytes_per_row=state, bytes_per_value=2)
    capped = plan_tables(rows, dim, 1, 10**9, host_tables=[1], host_cache_rows=5000, state_bytes_per_row=state,
                         bytes_per_value=2)
    assert capped.host_cache_rows == 1000
    uncached = plan_tables(rows, dim, 1, 10**9, host_tables=[1])
    assert uncached.host_cache_rows == 0 and "host_cache_rows" not in uncached.to_json()
