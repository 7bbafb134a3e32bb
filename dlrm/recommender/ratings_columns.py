"""One ratings file's lines -> its wanted columns, read in blocks of a few MiB and scanned with
numpy: plain integers and decimals are converted without a Python object per field, other
fields through Python strings. Every problem is a ``DatasetError`` naming the file, the line and
the column.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import numpy as np

from dlrm.engine.errors import DatasetError, finite_number
from dlrm.engine.text_lines import MAX_LINE_BYTES, LineBound
from dlrm.recommender.dsstne_text import _BAD_NAME_CHARACTER, check_name
from dlrm.recommender.ratings_layout import Layout, file_layout, parse_delimiter, read_first_line, split_fields

_FLOAT32_MAX = float(np.finfo(np.float32).max)
_UNIT_SEPARATOR = b"\x1f"  # a multi-character delimiter is scanned as this byte


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
class RawColumns:
    """One file's columns as read: per role a list of pieces (int64 arrays of integer names or
    lists of str for user/item; float arrays for rating/time)."""

    layout: Layout
    pieces: dict[str, list]
    lines: int = 0


class _Block:
    """One block of lines: the fields of each wanted column, as byte ranges (the fast scan) or
    as strings (lines with quotes), and the line number of each data row."""

    def __init__(self, buf: bytes, first_line: int, layout: Layout):
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
                fields = split_fields(line, layout.delimiter)
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


def read_columns(path: str | os.PathLike, specs: dict[str, str | int | None], delimiter: str | None,
                 header: bool | None, min_rating: float | None, block_bytes: int) -> RawColumns:
    """The columns ``specs`` chooses of every data line (``min_rating`` only to refuse it without
    a rating column: the ratings are filtered after grouping)."""
    path = os.fspath(path)
    if delimiter is not None:
        delimiter = parse_delimiter(delimiter)
    with open(path, "rb") as f:
        first, _ = read_first_line(path, f)
        layout = file_layout(path, first, specs, delimiter, header)
        if min_rating is not None and "rating" not in layout.columns:
            raise DatasetError(f"{path}: `min_rating` needs a rating column, and none is chosen; give "
                               f"`rating_column`, or drop `min_rating`")
        raw = RawColumns(layout, {role: [] for role in layout.columns})
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
