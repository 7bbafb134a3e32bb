r"""Ratings files (one rating a line: user, item, rating, time) -> the recommender's rows.

A ratings file is CSV or TSV (any one delimiter: told from the first line, or given), with a
header naming its columns or without one (columns by 0-based number). Two layouts are
recognised by their headers alone:

- RecBole's atomic files (``ml-100k.inter``): ``user_id:token<TAB>item_id:token<TAB>rating:float
  <TAB>timestamp:float``. The ``:type`` suffix of a header name is ignored when a column is
  matched by name;
- MovieLens ``ratings.csv``: ``userId,movieId,rating,timestamp``.

Elsewhere ``user_column``, ``item_column`` (and ``rating_column``, ``time_column``, both
optional; ``""`` for none) choose the columns by header name or number. Without them a header
column named ``user_id``/``userId``, ``item_id``/``movieId``/``itemId``, ``rating`` or
``timestamp`` is taken. ``header`` (None: told from the first line) says whether the first line
names the columns; it must when a column is chosen by name.

What becomes of the lines:

- users need not be contiguous: all lines are read, then grouped (one numpy sort); a user's
  items are in time order when there is a time column (equal times in file order), else in
  file order;
- users and items keep their names as written (the features and samples indexes carry them);
  users are in increasing order of name, compared as integers when every name is one;
- a (user, item) pair given more than once keeps its last rating in time order; the others
  are dropped and counted (``FileSummary.duplicates``);
- ``min_rating`` then keeps ratings >= it (a user left with none is dropped);
- the rating is the value of the item in the row (float32); without a rating column the rows
  have no values (indicators);
- blank lines are skipped; surrounding whitespace of a field and a Windows ``\r`` are stripped.

Any problem is a ``DatasetError`` of one line naming the file, the line and the column: a column
that is not there, a line with too few or too many fields, a rating or time that is not a finite
number, an empty user or item name, or one holding a control character, bytes that are not
UTF-8, an empty file.

Speed: the file is read in blocks of a few MiB and scanned with numpy; columns of plain integers
(and decimals such as ``3.5``) are converted without a Python object per field, others through
Python strings. A MovieLens-20M-size file (20 million lines, 0.5 GiB) reads in well under a
minute on one core (docs/recommender.md gives the figure).

Where the work is done: ``ratings_layout`` decides the layout from the first line,
``ratings_columns`` reads the lines into columns, and this module groups them into users' rows.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from dlrm.engine.errors import DatasetError
from dlrm.recommender.csr_dataset import CsrRows
from dlrm.recommender.dsstne_text import NameIndex
from dlrm.recommender.ratings_columns import RawColumns, read_columns
from dlrm.recommender.ratings_layout import INTEGER_NAME, ROLES

BLOCK_BYTES = 1 << 22


# ---------------------------------------------------------------------------- results


def _count(n: int, what: str) -> str:
    return f"{n:,} {what}{'' if n == 1 else 's'}"


@dataclass
class FileSummary:
    """What was read from one file, for the summary a command prints."""

    path: str
    layout: str  # "RecBole atomic file", "MovieLens ratings.csv" or "ratings file"
    delimiter: str
    header: bool
    columns: dict[str, str]  # role -> the column as the file names it (or "column N")
    lines: int = 0  # data lines (blank ones not counted)
    duplicates: int = 0  # (user, item) pairs given again; the last in time order kept
    below_min_rating: int = 0
    ratings: int = 0  # kept

    def describe(self) -> str:
        what = ", ".join(f"{role} {self.columns[role]}" for role in ROLES if role in self.columns)
        delimiter = {"\t": "tab", ",": "comma", " ": "space"}.get(self.delimiter, repr(self.delimiter))
        text = (f"{self.path}: {self.layout} ({delimiter}-separated, {'a header' if self.header else 'no header'}; "
                f"{what}): {_count(self.lines, 'line')}")
        if self.duplicates:
            text += (f"; {_count(self.duplicates, 'repeated (user, item) pair')} dropped (the last rating of a pair "
                     f"kept{', in time order' if 'time' in self.columns else ''})")
        if self.below_min_rating:
            text += f"; {_count(self.below_min_rating, 'rating')} below `min_rating` dropped"
        return text + f"; {_count(self.ratings, 'rating')} kept"


@dataclass
class Ratings:
    """Users' rows: row ``r`` (user ``users[r]``) holds item codes ``rows.row(r)`` (names:
    ``items``), with the ratings as values (or none) and, with a time column, each one's time
    (``times``, aligned with the indices). Map the codes to columns with ``to_csr``."""

    users: list[str]
    items: list[str]
    rows: CsrRows
    times: np.ndarray | None
    files: list[FileSummary] = field(default_factory=list)


# ---------------------------------------------------------------------------- names and grouping


def name_order(names: Sequence[str]) -> list[int]:
    """Positions of ``names`` in increasing order: as integers when every name is one, else as
    strings."""
    if all(INTEGER_NAME.match(name) for name in names):
        return sorted(range(len(names)), key=lambda i: (int(names[i]), names[i]))
    return sorted(range(len(names)), key=names.__getitem__)


class _Codes(dict):
    """Name -> code, new names numbered as they come."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __missing__(self, name: str) -> int:
        code = self[name] = len(self.names)
        self.names.append(name)
        return code


def _integer_codes(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values ascending, each value's position among them): a table over the range
    when it is small (ids numbered 1..N), else one sort and a binary search (no argsort)."""
    if not values.size:
        return values, np.zeros(0, np.int64)
    low, high = int(values.min()), int(values.max())
    if high - low < max(4 * values.shape[0], 1 << 24):
        present = np.zeros(high - low + 1, bool)
        present[values - low] = True
        code = np.cumsum(present) - 1
        return np.flatnonzero(present) + low, code[values - low]
    unique = np.unique(values)
    return unique, np.searchsorted(unique, values)


def _encode(files: list[list[np.ndarray | list[str]]]) -> tuple[list[str], list[np.ndarray]]:
    """Codes for the names of several files' pieces, numbered in name order (``name_order``)."""
    pieces = [p for f in files for p in f]
    if all(isinstance(p, np.ndarray) for p in pieces):  # integers only: in numpy throughout
        unique, codes = _integer_codes(np.concatenate(pieces) if pieces else np.zeros(0, np.int64))
        names = [str(v) for v in unique.tolist()]
    else:
        table = _Codes()
        parts = []
        for piece in pieces:
            if isinstance(piece, np.ndarray):
                unique, inverse = _integer_codes(piece)
                parts.append(np.array([table[str(v)] for v in unique.tolist()], np.int64)[inverse])
            else:
                parts.append(np.fromiter(map(table.__getitem__, piece), np.int64, len(piece)))
        order = name_order(table.names)
        names = [table.names[i] for i in order]
        rank = np.empty(len(names), np.int64)
        rank[order] = np.arange(len(names))
        codes = rank[np.concatenate(parts)] if parts else np.zeros(0, np.int64)
    sizes = np.cumsum([sum(len(p) for p in f) for f in files])[:-1]
    return names, np.split(codes, sizes)


def _time_key(times: np.ndarray) -> tuple[np.ndarray, int]:
    """Non-negative int64 keys in the order of ``times`` (equal times, equal keys) and their bit
    width: the times themselves less the earliest when they are integers, else their ranks."""
    low, high = float(times.min()), float(times.max())
    if high - low < 2.0 ** 52 and bool((times == np.floor(times)).all()):
        key = (times - low).astype(np.int64)
    else:
        order = np.argsort(times, kind="stable")
        ordered = times[order]
        key = np.empty(times.shape[0], np.int64)
        key[order] = np.concatenate([[0], np.cumsum(ordered[1:] != ordered[:-1])])
    return key, max(int(key.max()), 1).bit_length()


def _group(user: np.ndarray, n_users: int, item: np.ndarray, n_items: int, values: np.ndarray | None,
           times: np.ndarray | None, min_rating: float | None) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Records -> (record indices in row order, offsets [n_users + 1], duplicates dropped, below
    min_rating dropped). Row order: by user, then time (when given), then record order; a repeated
    (user, item) keeps its last record in that order. Stable sorts of int64 keys (numpy's timsort
    takes the runs of a file already grouped by user), and a search for repeats that costs one
    plain sort when there are none."""
    n = int(user.shape[0])
    user = user.astype(np.int64, copy=False)
    if times is not None and n:
        key, bits = _time_key(times)
        if max(n_users, 1).bit_length() + bits <= 62:
            key |= user << bits
            order = np.argsort(key, kind="stable")
        else:
            order = np.lexsort((key, user))
        del key
    else:
        order = np.argsort(user, kind="stable")
    duplicates = 0
    if n > 1:
        pair = user[order] * max(n_items, 1) + item[order]
        ordered = np.sort(pair)
        again = ordered[1:][ordered[1:] == ordered[:-1]]
        del ordered
        if again.size:
            repeated = np.unique(again)
            at = np.minimum(np.searchsorted(repeated, pair), repeated.shape[0] - 1)
            involved = np.flatnonzero(repeated[at] == pair)  # positions (row order) of repeated pairs
            sub = pair[involved]
            by_pair = np.argsort(sub, kind="stable")  # each pair's records in row order
            sub = sub[by_pair]
            earlier = np.zeros(involved.shape[0], bool)
            earlier[:-1] = sub[1:] == sub[:-1]  # not the last of its pair
            keep = np.ones(n, bool)
            keep[involved[by_pair[earlier]]] = False
            duplicates = int(np.count_nonzero(earlier))
            order = order[keep]
        del pair
    below = 0
    if min_rating is not None and values is not None:
        liked = values[order] >= np.float32(min_rating)
        below = int(order.shape[0] - np.count_nonzero(liked))
        order = order[liked]
    offsets = np.concatenate([[0], np.cumsum(np.bincount(user[order], minlength=n_users))]).astype(np.int64)
    return order, offsets, duplicates, below


def _summary(raw: RawColumns) -> FileSummary:
    layout = raw.layout
    return FileSummary(layout.path, layout.description, layout.delimiter, layout.header,
                       {role: layout.labels[n] for role, n in layout.columns.items()}, raw.lines)


def read_ratings(path: str | os.PathLike, *, user_column: str | int | None = None,
                 item_column: str | int | None = None, rating_column: str | int | None = None,
                 time_column: str | int | None = None, delimiter: str | None = None, header: bool | None = None,
                 min_rating: float | None = None, block_bytes: int = BLOCK_BYTES) -> Ratings:
    """One ratings file -> one row per user who has a rating left (module docstring)."""
    specs = {"user": user_column, "item": item_column, "rating": rating_column, "time": time_column}
    return _read_files([path], specs, delimiter, header, min_rating, block_bytes)[0]


def read_ratings_split(train: str | os.PathLike, heldout: str | os.PathLike, *, user_column: str | int | None = None,
                       item_column: str | int | None = None, rating_column: str | int | None = None,
                       time_column: str | int | None = None, delimiter: str | None = None,
                       header: bool | None = None, min_rating: float | None = None,
                       block_bytes: int = BLOCK_BYTES) -> tuple[Ratings, Ratings, Ratings]:
    """A held-out split made elsewhere: (all, input, heldout) with the same users in the same
    order (every user of either file; a user absent from one has an empty row there) and the
    same item codes. ``all`` is each user's input and held-out items together, in time order
    when both files have times (else the input's, then the held-out ones); a pair in both is
    there once (its last rating in that order; ``all.files[0].duplicates`` counts them)."""
    specs = {"user": user_column, "item": item_column, "rating": rating_column, "time": time_column}
    kept, held = _read_files([train, heldout], specs, delimiter, header, min_rating, block_bytes)
    rows, times, n_both = _merge(kept.rows, held.rows, kept.times, held.times)
    first = kept.files[0]
    summary = FileSummary(f"{first.path} + {held.files[0].path}", "input and held-out ratings together",
                          first.delimiter, first.header, first.columns, first.lines + held.files[0].lines, n_both,
                          0, rows.nnz)
    return Ratings(kept.users, kept.items, rows, times, [summary]), kept, held


def _read_files(paths: list[str | os.PathLike], specs: dict[str, str | int | None], delimiter: str | None,
                header: bool | None, min_rating: float | None, block_bytes: int) -> list[Ratings]:
    """Files read with shared user and item names; every user of any file gets a row in each
    (empty where it has none), and users with no rating left in any file are dropped."""
    raws = [read_columns(path, specs, delimiter, header, min_rating, block_bytes) for path in paths]
    users, user_codes = _encode([raw.pieces["user"] for raw in raws])
    items, item_codes = _encode([raw.pieces["item"] for raw in raws])
    grouped = []
    for raw, user, item in zip(raws, user_codes, item_codes):
        values = np.concatenate(raw.pieces["rating"]).astype(np.float32) if "rating" in raw.pieces else None
        times = np.concatenate(raw.pieces["time"]) if "time" in raw.pieces else None
        order, offsets, duplicates, below = _group(user, len(users), item, len(items), values, times, min_rating)
        summary = _summary(raw)
        summary.duplicates, summary.below_min_rating, summary.ratings = duplicates, below, int(order.shape[0])
        if not order.size:
            why = f" >= {min_rating:g} (`min_rating`)" if below else ""
            raise DatasetError(f"{raw.layout.path}: no ratings{why} left of {raw.lines:,}; "
                               f"{'lower `min_rating`' if below else 'give a file with ratings'}")
        grouped.append((order, offsets, item, values, times, summary))
    lengths = sum(np.diff(offsets) for _, offsets, *_ in grouped)
    keep = np.flatnonzero(lengths > 0)  # users with a rating left somewhere
    kept_users = [users[i] for i in keep.tolist()]
    counts = sum(np.bincount(item[order], minlength=len(items)) for order, _, item, *_ in grouped)
    used = np.flatnonzero(counts)  # items with a rating left somewhere
    column = np.full(len(items), -1, np.int64)
    column[used] = np.arange(used.shape[0])
    kept_items = [items[i] for i in used.tolist()]
    any_values = any(values is not None for *_, values, _, _ in grouped)
    out = []
    for order, offsets, item, values, times, summary in grouped:
        counts = np.diff(offsets)[keep]
        new_offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        row_values = values[order] if values is not None else (np.ones(order.shape[0], np.float32) if any_values
                                                                and len(paths) > 1 else None)
        rows = CsrRows(new_offsets, column[item[order]], row_values, len(kept_items))
        out.append(Ratings(kept_users, kept_items, rows, None if times is None else times[order], [summary]))
    return out


# ---------------------------------------------------------------------------- rows


def pad_rows(rows: CsrRows, n_samples: int, n_features: int) -> CsrRows:
    """``rows`` with empty rows appended up to ``n_samples`` and ``n_features`` columns."""
    extra = n_samples - rows.n_samples
    if extra < 0 or n_features < rows.n_features:
        raise ValueError(f"cannot pad {rows.n_samples} x {rows.n_features} rows to {n_samples} x {n_features}")
    offsets = np.concatenate([rows.offsets, np.full(extra, rows.offsets[-1], np.int64)]) if extra else rows.offsets
    return CsrRows(offsets, rows.indices, rows.values, n_features)


def with_values(rows: CsrRows) -> CsrRows:
    """``rows``, with values 1.0 (an indicator's) if it has none."""
    if rows.values is not None:
        return rows
    return CsrRows(rows.offsets, rows.indices, np.ones(rows.nnz, np.float32), rows.n_features)


def _merge(a: CsrRows, b: CsrRows, a_times: np.ndarray | None,
           b_times: np.ndarray | None) -> tuple[CsrRows, np.ndarray | None, int]:
    if a.n_samples != b.n_samples or a.n_features != b.n_features:
        raise ValueError(f"rows of {a.n_samples} x {a.n_features} and {b.n_samples} x {b.n_features} do not align")
    row = np.concatenate([np.repeat(np.arange(r.n_samples), np.diff(r.offsets)) for r in (a, b)])
    indices = np.concatenate([a.indices, b.indices]).astype(np.int64)
    times = np.concatenate([a_times, b_times]) if a_times is not None and b_times is not None else None
    order, offsets, both, _ = _group(row, a.n_samples, indices, a.n_features, None, times, None)
    values = None
    if a.values is not None or b.values is not None:
        values = np.concatenate([r.values if r.values is not None else np.ones(r.nnz, np.float32)
                                 for r in (a, b)])[order]
    rows = CsrRows(offsets, indices[order].astype(np.int32), values, a.n_features)
    return rows, None if times is None else times[order], both


def merge_rows(a: CsrRows, b: CsrRows, a_times: np.ndarray | None = None,
               b_times: np.ndarray | None = None) -> tuple[CsrRows, int]:
    """Each row of ``a`` with the same row of ``b`` (same rows, same columns): in time order when
    both have times (equal times: ``a``'s first), else ``a``'s items then ``b``'s; an item in both
    rows once, with its last value in that order. Values: either's, 1.0 where a side has none (an
    indicator). Returns the rows and how many items were in both."""
    rows, _, both = _merge(a, b, a_times, b_times)
    return rows, both


def to_csr(ratings: Ratings, features: NameIndex) -> CsrRows:
    """``ratings``' rows with their items as columns of ``features``: items it already names keep
    their column, new ones are appended in name order (``name_order``)."""
    new = [name for name in ratings.items if name not in features]
    for i in name_order(new):
        features.add(new[i])
    column = np.array([features[name] for name in ratings.items], np.int64)
    rows = ratings.rows
    indices = column[rows.indices] if rows.nnz else np.zeros(0, np.int64)
    return CsrRows(rows.offsets, indices.astype(np.int32), rows.values, features.size)
