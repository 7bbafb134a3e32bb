"""How a ratings file is laid out: its delimiter, whether its first line is a header, and which
field holds each role (user, item, rating, time), told from the first line and the settings.

``dlrm.recommender.ratings_file`` describes the accepted files; this module reads the first line
and decides the layout, and ``dlrm.recommender.ratings_columns`` reads the lines that follow.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from typing import BinaryIO

from dlrm.engine.errors import DatasetError, finite_number
from dlrm.engine.text_lines import MAX_LINE_BYTES

ROLES = ("user", "item", "rating", "time")
RECBOLE_NAMES = ("user_id", "item_id", "rating", "timestamp")
MOVIELENS_NAMES = ("userId", "movieId", "rating", "timestamp")
# Header names taken for a role whose column is not given.
DEFAULT_NAMES = {"user": ("user_id", "userId"), "item": ("item_id", "movieId", "itemId"), "rating": ("rating",),
                 "time": ("timestamp",)}
DELIMITER_NAMES = {"tab": "\t", "\\t": "\t", "comma": ",", "semicolon": ";", "pipe": "|", "space": " "}
_DETECTED = ("\t", ",", "::", ";", "|")  # tried in this order on the first line
INTEGER_NAME = re.compile(r"-?[0-9]+\Z")


@dataclass
class Layout:
    """A file's layout: what ``file_layout`` decides from its first line."""

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


def split_fields(line: str, delimiter: str) -> list[str]:
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


def read_first_line(path: str, f: BinaryIO) -> tuple[str, int]:
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


def file_layout(path: str, first: str, specs: dict[str, str | int | None], delimiter: str | None,
                header: bool | None) -> Layout:
    """The layout from the first line and the settings: the delimiter (told from the line when
    not given), whether the line is a header, each chosen role's field, and the file's kind."""
    if delimiter is None:
        delimiter = next((d for d in _DETECTED if d in first), None)
        if delimiter is None:
            raise DatasetError(f"{path}:1: cannot tell the delimiter from the first line {first[:80]!r} (no tab, "
                               f"comma, '::', ';' or '|'); give `delimiter`")
    try:
        fields = [x.strip() for x in split_fields(first, delimiter)]
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
    return Layout(path, delimiter, header, n_fields, columns, labels, _file_kind(fields, header))


def _file_kind(fields: list[str], header: bool) -> str:
    """How the summary names the file: by the layouts its header alone tells apart."""
    bare = tuple(_bare(name) for name in fields)
    if header and tuple(fields) == MOVIELENS_NAMES:
        return "MovieLens ratings.csv"
    if header and {"user_id", "item_id"} <= set(bare) and any(":" in name for name in fields):
        return "RecBole atomic file"
    return "ratings file"


def _looks_like_header(fields: list[str], specs: dict[str, str | int | None]) -> bool:
    """With columns given by number: the first line is a header when its rating or time field is
    not a number, or (neither chosen) when neither its user nor its item field is an integer."""
    numeric = [specs[r] for r in ("rating", "time") if isinstance(specs.get(r), int)]
    if numeric:
        return any(n < len(fields) and not _is_number(fields[n]) for n in numeric)
    ids = [specs[r] for r in ("user", "item") if isinstance(specs.get(r), int) and specs[r] < len(fields)]
    return bool(ids) and not any(INTEGER_NAME.match(fields[n]) for n in ids)
