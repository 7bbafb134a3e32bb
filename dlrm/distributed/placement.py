"""Manual table placements (``table_placement``): words, JSON text or files, and saved plans,
read into a ``Placement`` that ``plan_tables`` checks against the model."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from dlrm.distributed.plan import PlanError

_PLACEMENT_WORDS = {"auto": "auto", "table_wise": "never", "row_wise": "all"}
_PLACEMENT_FORMS = (
    'auto, table_wise, row_wise, JSON such as {"0": [0, 3], "1": [1, 2]} or [[0, 3], [1, 2]] '
    '(tables per rank, the dict may add "row_wise": [4, 5]), {"row_wise": [4, 5]} alone, '
    "a saved plan, or a path to a JSON file with one of these"
)


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
