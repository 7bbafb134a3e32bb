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
"""

from __future__ import annotations

import csv
import os
import re
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator, Sequence

import numpy as np

from dlrm.engine.errors import DatasetError, finite_number
from dlrm.engine.text_lines import MAX_LINE_BYTES, LineBound
from dlrm.recommender.csr_dataset import CsrRows
from dlrm.recommender.dsstne_text import _BAD_NAME_CHARACTER, NameIndex, check_name

ROLES = ("user", "item", "rating", "time")
RECBOLE_NAMES = ("user_id", "item_id", "rating", "timestamp")
MOVIELENS_NAMES = ("userId", "movieId", "rating", "timestamp")
# Header names taken for a role whose column is not given.
DEFAULT_NAMES = {"user": ("user_id", "userId"), "item": ("item_id", "movieId", "itemId"), "rating": ("rating",),
                 "time": ("timestamp",)}
DELIMITER_NAMES = {"tab": "\t", "\\t": "\t", "comma": ",", "semicolon": ";", "pipe": "|", "space": " "}
_DETECTED = ("\t", ",", "::", ";", "|")  # tried in this order on the first line
_INTEGER_NAME = re.compile(r"-?[0-9]+\Z")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_UNIT_SEPARATOR = b"\x1f"  # a multi-character delimiter is scanned as this byte
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


# ---------------------------------------------------------------------------- layout


@dataclass
class _Layout:
    path: str
    delimiter: str
    header: bool
    n_fields: int
    columns: dict[str, int]  # role -> field number
    labels: list[str]  # field number -> how messages name it
    description: str


def parse_delimiter(text: str) -> str:
    """A `delimiter` setting: a character or string, or one of the names in DELIMITER_NAMES."""
    delimiter = DELIMITER_NAMES.get(text.lower(), text)
    if not delimiter or any(c in delimiter for c in "\r\n\""):
        raise DatasetError(f"`delimiter` {text!r} cannot separate fields: give a character such as ',' or one of "
                           f"{', '.join(DELIMITER_NAMES)}")
    return delimiter


def _split(line: str, delimiter: str) -> list[str]:
    """One line's fields; quoted fields (CSV's ``"a,b"``) with a one-character delimiter."""
    if len(delimiter) == 1 and '"' in line:
        try:
            return next(csv.reader([line], delimiter=delimiter, strict=True))
        except csv.Error as e:
            raise DatasetError(f"malformed quoting ({e})") from None
    return line.split(delimiter)


def _column_spec(value: str | int | None) -> str | int | None:
    if isinstance(value, str) and value.strip().isdigit() and value.strip().isascii():
        return int(value.strip())
    return value


def _bare(name: str) -> str:
    """A header name without RecBole's ``:type`` suffix."""
    return name.rpartition(":")[0] if ":" in name else name


def _is_number(text: str) -> bool:
    return finite_number(text) is not None


def _read_first_line(path: str, f: BinaryIO) -> tuple[str, int]:
    """The first line (BOM and line end stripped) and the byte offset after it."""
    raw = f.readline(MAX_LINE_BYTES)
    if not raw.strip():
        what = "empty" if not raw else "blank on its first line"
        raise DatasetError(f"{path}:1: the file is {what}; a ratings file starts with a header (user, item, rating, "
                           f"time columns) or its first rating")
    if not raw.endswith(b"\n") and len(raw) == MAX_LINE_BYTES:
        raise DatasetError(f"{path}:1: the first line is longer than 1 MiB; this is not a ratings file")
    end = len(raw)
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}:1: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {e.start + 1}); save the "
                           f"file as UTF-8") from None
    return text.rstrip("\r\n"), end


def _layout(path: str, first: str, specs: dict[str, str | int | None], delimiter: str | None,
            header: bool | None) -> _Layout:
    if delimiter is None:
        delimiter = next((d for d in _DETECTED if d in first), None)
        if delimiter is None:
            raise DatasetError(f"{path}:1: cannot tell the delimiter from the first line {first[:80]!r} (no tab, "
                               f"comma, '::', ';' or '|'); give `delimiter`")
    try:
        fields = [x.strip() for x in _split(first, delimiter)]
    except DatasetError as e:
        raise DatasetError(f"{path}:1: {e}") from None
    n_fields = len(fields)
    specs = {role: _column_spec(value) for role, value in specs.items()}
    named = [role for role, value in specs.items() if isinstance(value, str) and value]
    if header is None:
        if named or specs.get("user") is None or specs.get("item") is None:
            header = True  # names to match: the first line must hold them
        else:
            header = _looks_like_header(fields, specs)
    elif not header and named:
        role = named[0]
        raise DatasetError(f"`{role}_column` {specs[role]!r} names a column, but the file has no header (`header` "
                           f"is false): give its 0-based number")
    labels = [f"'{name}'" for name in fields] if header else [f"{i}" for i in range(n_fields)]
    columns: dict[str, int] = {}
    for role in ROLES:
        spec = specs.get(role)
        if spec == "" and role in ("user", "item"):
            raise DatasetError(f"`{role}_column` is empty: every rating needs a {role}; give its column")
        if spec == "":
            continue
        if spec is None:
            if not header:
                if role in ("user", "item"):
                    raise DatasetError(f"{path}: no header: give `{role}_column` as a 0-based number")
                continue
            found = [i for i, name in enumerate(fields)
                     if name in DEFAULT_NAMES[role] or _bare(name) in DEFAULT_NAMES[role]]
            if not found:
                if role in ("user", "item"):
                    raise DatasetError(
                        f"{path}:1: no {role} column in the first line {first[:120]!r} (looked for "
                        f"{' or '.join(DEFAULT_NAMES[role])}, as RecBole's .inter files and MovieLens's ratings.csv "
                        f"name it); give `user_column` and `item_column` by name, or by 0-based number for a file "
                        f"without a header")
                continue
            columns[role] = found[0]
        elif isinstance(spec, int):
            if spec >= n_fields:
                raise DatasetError(f"{path}:1: `{role}_column` {spec} is past the last column: the first line has "
                                   f"{n_fields} fields (numbered from 0)")
            columns[role] = spec
        else:
            found = [i for i, name in enumerate(fields) if name == spec] or \
                    [i for i, name in enumerate(fields) if _bare(name) == spec]
            if len(found) != 1:
                what = "no column" if not found else f"{len(found)} columns"
                raise DatasetError(f"{path}:1: {what} named {spec!r} (`{role}_column`) in the header "
                                   f"({', '.join(fields)[:200]}); give a name of the header or a 0-based number")
            columns[role] = found[0]
    taken: dict[int, str] = {}
    for role, number in columns.items():
        if number in taken:
            raise DatasetError(f"{path}: `{taken[number]}_column` and `{role}_column` are the same column "
                               f"({labels[number]}); give each its own")
        taken[number] = role
    bare = tuple(_bare(name) for name in fields)
    if header and tuple(fields) == MOVIELENS_NAMES:
        description = "MovieLens ratings.csv"
    elif header and {"user_id", "item_id"} <= set(bare) and any(":" in name for name in fields):
        description = "RecBole atomic file"
    else:
        description = "ratings file"
    return _Layout(path, delimiter, header, n_fields, columns, labels, description)


def _looks_like_header(fields: list[str], specs: dict[str, str | int | None]) -> bool:
    """With columns given by number: the first line is a header when its rating or time field is
    not a number, or (neither chosen) when neither its user nor its item field is an integer."""
    numeric = [specs[r] for r in ("rating", "time") if isinstance(specs.get(r), int)]
    if numeric:
        return any(n < len(fields) and not _is_number(fields[n]) for n in numeric)
    ids = [specs[r] for r in ("user", "item") if isinstance(specs.get(r), int) and specs[r] < len(fields)]
    return bool(ids) and not any(_INTEGER_NAME.match(fields[n]) for n in ids)


# ---------------------------------------------------------------------------- reading


def _blocks(f: BinaryIO, size: int, bound: LineBound) -> Iterator[bytes]:
    """The rest of the file in blocks of whole lines, each ending with a newline; ``bound``
    refuses a line over its length or a NUL byte before the partial line kept grows past it."""
    rest = b""
    while True:
        data = f.read(size)
        if not data:
            if rest:
                yield rest + b"\n"
            return
        bound.feed(data)
        data = rest + data if rest else data
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            rest = data
            continue
        rest = data[cut:]
        yield data[:cut]


@dataclass
class _Raw:
    """One file's columns as read: per role a list of pieces (int64 arrays of integer names or
    lists of str for user/item; float arrays for rating/time)."""

    layout: _Layout
    pieces: dict[str, list]
    lines: int = 0


class _Block:
    """One block of lines: the fields of each wanted column, as byte ranges (the fast scan) or
    as strings (lines with quotes), and the line number of each data row."""

    def __init__(self, buf: bytes, first_line: int, layout: _Layout):
        self.buf, self.first_line, self.layout = buf, first_line, layout
        self.path = layout.path
        self.bounds: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.strings: dict[int, list[str]] = {}
        delimiter = layout.delimiter
        arr = np.frombuffer(buf, np.uint8)
        if arr.size and int(arr.max()) >= 0x80:  # not ASCII: must be UTF-8
            try:
                buf.decode("utf-8")
            except UnicodeDecodeError as e:
                line, column = self._where(arr, e.start)
                raise DatasetError(f"{self.path}:{line}: column {column}: not UTF-8 text (byte 0x{buf[e.start]:02x}); "
                                   f"save the file as UTF-8") from None
        scan = delimiter.encode()
        if len(scan) > 1:
            if _UNIT_SEPARATOR in buf:
                self._by_lines()
                return
            buf = self.buf = buf.replace(scan, _UNIT_SEPARATOR)
            arr = np.frombuffer(buf, np.uint8)
            scan = _UNIT_SEPARATOR
        elif b'"' in buf:
            self._by_lines()
            return
        self._scan(arr, scan[0])

    def _where(self, arr: np.ndarray, position: int) -> tuple[int, str]:
        """(line number, column label) of byte ``position`` of the block."""
        before = arr[:position]
        newlines = np.flatnonzero(before == 10)
        start = int(newlines[-1]) + 1 if newlines.size else 0
        line_text = bytes(arr[start:position]).decode("utf-8", "replace")
        number = len(line_text.split(self.layout.delimiter)) - 1
        label = self.layout.labels[number] if number < len(self.layout.labels) else str(number)
        return self.first_line + int(newlines.size), label

    def _fields_error(self, line: int, count: int) -> DatasetError:
        layout = self.layout
        expected = f"{layout.n_fields}" + (" (as the header has)" if layout.header else " (as the first line has)")
        if count < layout.n_fields:
            missing = [role for role, n in layout.columns.items() if n >= count]
            what = ""
            if missing:
                what = f"no field for the {missing[0]} column {layout.labels[layout.columns[missing[0]]]}; "
            return DatasetError(f"{self.path}:{line}: {what}{count} fields, expected {expected}")
        return DatasetError(f"{self.path}:{line}: {count} fields, expected {expected}; is `delimiter` right?")

    def _scan(self, arr: np.ndarray, delimiter: int) -> None:
        newline = np.flatnonzero(arr == 10)
        start = np.concatenate([[0], newline[:-1] + 1])
        end = newline - ((newline > start) & (arr[np.maximum(newline - 1, 0)] == 13))  # a Windows \r
        marks = np.flatnonzero(arr == delimiter)
        first_mark = np.searchsorted(marks, start)
        counts = np.searchsorted(marks, end) - first_mark
        wrong = counts != self.layout.n_fields - 1
        rows = np.arange(start.shape[0])
        if wrong.any():
            blank = np.zeros(start.shape[0], bool)
            for k in np.flatnonzero(wrong).tolist():
                if not self.buf[start[k]:end[k]].strip():
                    blank[k] = True
                    continue
                raise self._fields_error(self.first_line + k, int(counts[k]) + 1)
            rows = np.flatnonzero(~blank)
        self.lines = self.first_line + rows
        for number in self.layout.columns.values():
            lo = start[rows] if number == 0 else marks[first_mark[rows] + number - 1] + 1
            hi = end[rows] if number == self.layout.n_fields - 1 else marks[first_mark[rows] + number]
            self.bounds[number] = (lo.astype(np.int64), hi.astype(np.int64))

    def _by_lines(self) -> None:
        """Line by line with the csv module: a block holding quotes (or the scanned byte)."""
        layout = self.layout
        wanted = sorted(layout.columns.values())
        columns: dict[int, list[str]] = {n: [] for n in wanted}
        lines: list[int] = []
        for k, line in enumerate(self.buf.decode("utf-8").split("\n")[:-1]):
            line = line.rstrip("\r")
            if not line.strip():
                continue
            try:
                fields = _split(line, layout.delimiter)
            except DatasetError as e:
                raise DatasetError(f"{self.path}:{self.first_line + k}: {e}") from None
            if len(fields) != layout.n_fields:
                raise self._fields_error(self.first_line + k, len(fields))
            for n in wanted:
                columns[n].append(fields[n])
            lines.append(self.first_line + k)
        self.strings = columns
        self.lines = np.array(lines, np.int64)

    @property
    def size(self) -> int:
        return int(self.lines.shape[0])

    def texts(self, number: int) -> list[str]:
        """The fields of column ``number`` as strings (as written: not stripped)."""
        if number in self.strings:
            return self.strings[number]
        lo, hi = self.bounds[number]
        buf = self.buf
        return [buf[a:b].decode("utf-8") for a, b in zip(lo.tolist(), hi.tolist())]

    def error(self, row: int, number: int, message: str) -> DatasetError:
        return DatasetError(f"{self.path}:{int(self.lines[row])}: column {self.layout.labels[number]}: {message}")


def _plain_integers(arr: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray | None:
    """The fields as int64 when each is 1..18 ASCII digits without a leading zero (so that the
    number written back is the field itself); else None."""
    length = hi - lo
    if not length.size:
        return np.zeros(0, np.int64)
    if int(length.min()) < 1 or int(length.max()) > 18 or ((arr[lo] == 48) & (length > 1)).any():
        return None
    value = np.zeros(length.shape[0], np.int64)
    last = hi - 1
    for j in range(int(length.max())):
        live = j < length
        digit = arr[np.minimum(lo + j, last)].astype(np.int64) - 48
        if ((digit < 0) | (digit > 9)).any():
            return None
        value = np.where(live, value * 10 + digit, value) if not live.all() else value * 10 + digit
    return value


def _plain_decimals(arr: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray | None:
    """The fields as float64 when each is an optional '-', digits and at most one '.' (15 digits
    at most): exactly what ``float`` gives (an exact integer over an exact power of ten, divided
    once, rounds as the decimal does); else None."""
    length = hi - lo
    n = length.shape[0]
    if not n:
        return np.zeros(0, np.float64)
    if int(length.min()) < 1 or int(length.max()) > 17:
        return None
    negative = arr[lo] == 45
    lo = lo + negative
    value = np.zeros(n, np.int64)
    digits = np.zeros(n, np.int64)
    decimals = np.zeros(n, np.int64)
    dots = np.zeros(n, np.int64)
    last = hi - 1
    for j in range(int((hi - lo).max(initial=0))):
        live = lo + j < hi
        byte = arr[np.minimum(lo + j, last)]
        is_digit = (byte >= 48) & (byte <= 57) & live
        is_dot = (byte == 46) & live
        if (live & ~is_digit & ~is_dot).any():
            return None
        value = np.where(is_digit, value * 10 + (byte.astype(np.int64) - 48), value)
        digits += is_digit
        decimals += is_digit & (dots > 0)
        dots += is_dot
    if int(dots.max()) > 1 or int(digits.min()) < 1 or int(digits.max()) > 15:
        return None
    result = value / np.power(10.0, decimals)
    return np.where(negative, -result, result)


def _names(block: _Block, number: int, role: str) -> np.ndarray | list[str]:
    """A user or item column: int64 where every field is a plain integer, else the names."""
    if number in block.bounds:
        values = _plain_integers(np.frombuffer(block.buf, np.uint8), *block.bounds[number])
        if values is not None:
            return values
    names = [text.strip() for text in block.texts(number)]
    if "" in names:
        raise block.error(names.index(""), number, f"empty {role} name")
    if _BAD_NAME_CHARACTER.search("".join(names)):
        for row, name in enumerate(names):
            try:
                check_name(name, role)
            except DatasetError as e:
                raise block.error(row, number, str(e)) from None
    return names


def _numbers(block: _Block, number: int, role: str) -> np.ndarray:
    """A rating or time column as float64 (finite; a rating within float32's range)."""
    values = None
    if number in block.bounds:
        values = _plain_decimals(np.frombuffer(block.buf, np.uint8), *block.bounds[number])
    if values is None:
        texts = block.texts(number)
        values = np.empty(len(texts), np.float64)
        for row, text in enumerate(texts):
            value = finite_number(text)
            if value is None:
                raise block.error(row, number, f"{role} {text.strip()[:40]!r} is not a finite number")
            values[row] = value
    if role == "rating" and values.size and float(np.abs(values).max()) > _FLOAT32_MAX:
        row = int(np.argmax(np.abs(values) > _FLOAT32_MAX))
        raise block.error(row, number, f"rating {values[row]!r} is outside float32's range (ratings are kept as "
                                       f"float32)")
    return values


def _read(path: str | os.PathLike, specs: dict[str, str | int | None], delimiter: str | None,
          header: bool | None, min_rating: float | None, block_bytes: int) -> _Raw:
    path = os.fspath(path)
    if delimiter is not None:
        delimiter = parse_delimiter(delimiter)
    with open(path, "rb") as f:
        first, _ = _read_first_line(path, f)
        layout = _layout(path, first, specs, delimiter, header)
        if min_rating is not None and "rating" not in layout.columns:
            raise DatasetError(f"{path}: `min_rating` needs a rating column, and none is chosen; give "
                               f"`rating_column`, or drop `min_rating`")
        raw = _Raw(layout, {role: [] for role in layout.columns})
        line = 2
        if not layout.header:
            f.seek(0)
            if f.read(3) != b"\xef\xbb\xbf":
                f.seek(0)
            line = 1
        for buf in _blocks(f, block_bytes, LineBound(path, MAX_LINE_BYTES, line)):
            block = _Block(buf, line, layout)
            line += buf.count(b"\n")
            for role, number in layout.columns.items():
                piece = _names(block, number, role) if role in ("user", "item") else _numbers(block, number, role)
                raw.pieces[role].append(piece)
            raw.lines += block.size
    if not raw.lines:
        raise DatasetError(f"{path}: no ratings: the file holds {'its header only' if layout.header else 'no lines'}")
    return raw


# ---------------------------------------------------------------------------- names and grouping


def name_order(names: Sequence[str]) -> list[int]:
    """Positions of ``names`` in increasing order: as integers when every name is one, else as
    strings."""
    if all(_INTEGER_NAME.match(name) for name in names):
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


def _summary(raw: _Raw) -> FileSummary:
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
    raws = [_read(path, specs, delimiter, header, min_rating, block_bytes) for path in paths]
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
