"""Amazon DSSTNE's text format for sparse samples, its features and samples indexes, and the
conversion to CSR datasets (what DSSTNE's ``generateNetCDF`` did, without NetCDF).

One sample per line::

    <sampleName>\\t<feature>[,<value>]:<feature>[,<value>]:...

Rules (DSSTNE's, made strict where DSSTNE silently dropped data):
- the sample name is everything before the first tab; the rest is the feature list, fields
  separated by ``:``, a field being a name with an optional ``,value`` (a finite float);
- empty lines and empty fields (``a::b``, a trailing ``:``) are skipped, as DSSTNE does;
  ``name\\t`` with nothing after the tab is a sample with no features;
- surrounding whitespace (and a Windows ``\\r``) is stripped from names and values;
- errors, naming file and line: no tab, empty sample name, a value with no feature name, more
  than one comma in a field, a value that is not a finite number, a sample given twice, a name
  (of a sample, a feature, or an index entry) holding a tab, a newline or another control
  character (``check_name``: it could not be written to an index file and read back);
- a line longer than ``MAX_SAMPLE_LINE`` characters (index files: ``MAX_LINE_BYTES``), or one
  holding a NUL, is refused before more than that is read (``dlrm.engine.text_lines``);
- a file whose fields carry values gives a dataset with values; a field without a value then
  counts as 1.0 (an indicator), where DSSTNE stored 0.

An index file has ``name\\tindex`` lines. ``generateNetCDF -f/-s`` wrote a *features index*
(names of the columns: items) and a *samples index* (names of the rows: users); the input and
output datasets of an autoencoder share both so that rows and columns line up. Loading an index
and parsing more data MERGES: names already there keep their index, new names get the next
ones. Rows of a parsed dataset are in samples-index order (DSSTNE's order too), one row per
sample of the index, so a sample absent from a file gets an empty row and the datasets parsed
with one samples index always align.
"""

from __future__ import annotations

import os
import re
from array import array
from dataclasses import dataclass
from typing import Iterable, Iterator, TextIO

import numpy as np

from dlrm.engine.atomic import write_atomically, write_text_atomically
from dlrm.engine.errors import DatasetError, finite_number
from dlrm.engine.text_lines import bounded_lines
from dlrm.recommender.csr_dataset import CsrRows, write_csr

# The longest sample line read: one user's whole history. A field is a name and maybe a value,
# about 20 characters; the heaviest user of the public sets (Netflix) has about 17,000 ratings,
# some 350 KB, so 16 MiB holds a history of some 800,000 items.
MAX_SAMPLE_LINE = 16 << 20


# What no name may hold: the separators of DSSTNE text and of the index files (tab, newline,
# carriage return) and every other control character (C0, DEL, C1, and the Unicode line and
# paragraph separators): a name with one could not be written back and read again.
_BAD_NAME_CHARACTER = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_CHARACTER_NAMES = {"\t": "a tab", "\n": "a newline", "\r": "a carriage return"}
# Files are read with errors="surrogateescape": a byte that is not UTF-8 becomes a lone surrogate,
# found per line, so the error names the line (a strict decoder fails a whole block of lines).
_NOT_UTF8 = re.compile("[\ud800-\udfff]")


def check_utf8(line: str) -> None:
    """Raises DatasetError if ``line`` (read with errors="surrogateescape") held bytes that are
    not UTF-8; the caller prefixes where it is."""
    bad = _NOT_UTF8.search(line)
    if bad is not None:
        c = ord(bad.group())
        what = f"byte 0x{c - 0xDC00:02x}" if 0xDC80 <= c <= 0xDCFF else f"the lone surrogate U+{c:04X}"
        raise DatasetError(f"not UTF-8 text: {what} at character {bad.start() + 1}; save the file as UTF-8")


def check_name(name: str, what: str) -> None:
    """Raises DatasetError if ``name`` (of a ``what``: "sample", "feature", "index entry") holds a
    character no name may hold (``_BAD_NAME_CHARACTER``); the caller prefixes where it is."""
    bad = _BAD_NAME_CHARACTER.search(name)
    if bad is not None:
        c = bad.group()
        shown = _CHARACTER_NAMES.get(c, "the control character")
        raise DatasetError(f"{what} name {name[:80]!r} holds {shown} (U+{ord(c):04X}) at character {bad.start() + 1}; "
                           f"names may not hold tabs, newlines or other control characters (they separate the "
                           f"fields of DSSTNE text and of the index files): rename it")


MAX_INDEX = 2**31  # an index numbers rows or columns of a CSR dataset, whose indices are int32


class NameIndex:
    """Names <-> dense indices (DSSTNE's features index or samples index). Appending never
    renumbers: an existing name keeps its index, a new one gets ``size`` (max index + 1)."""

    def __init__(self, names: Iterable[str] = ()):
        self._index: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self.size = 0  # max index + 1: the width of a dataset indexed by this
        for name in names:
            self.add(name)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "NameIndex":
        """Read an index file (``name\\tindex`` lines; blank lines skipped)."""
        index = cls()
        index.merge_file(path)
        return index

    def merge_file(self, path: str | os.PathLike) -> None:
        """Add the entries of an index file; an entry must agree with what is already known
        (same name, same index), so two indexes that number differently fail loudly."""
        path = os.fspath(path)
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            for number, line in enumerate(bounded_lines(f, path), 1):
                line = line.rstrip("\r\n")
                try:
                    check_utf8(line)
                except DatasetError as e:
                    raise DatasetError(f"{path}:{number}: {e}") from None
                if not line.strip():
                    continue
                parts = line.split("\t")
                if len(parts) != 2:
                    raise DatasetError(f"{path}:{number}: malformed index line {line[:80]!r}: expected "
                                       f"'name<TAB>index'")
                name, text = parts[0].strip(), parts[1].strip()
                if not name:
                    raise DatasetError(f"{path}:{number}: empty name in index line {line[:80]!r}")
                try:
                    check_name(name, "index entry")
                except DatasetError as e:
                    raise DatasetError(f"{path}:{number}: {e}") from None
                if not (text.isascii() and text.isdigit()) or len(text) > 10 or int(text) >= MAX_INDEX:
                    raise DatasetError(f"{path}:{number}: index {text[:40]!r} of '{name}' is not an integer in "
                                       f"[0, {MAX_INDEX:,}) (a column or row of a CSR dataset, int32)")
                value = int(text)
                if self._index.get(name, value) != value:
                    raise DatasetError(f"{path}:{number}: '{name}' has index {value} here but {self._index[name]} "
                                       f"already; indexes that number names differently cannot be merged")
                if self._names.get(value, name) != name:
                    raise DatasetError(f"{path}:{number}: index {value} is given to '{name}' here but belongs to "
                                       f"'{self._names[value]}' already; each index must name one entry")
                self._set(name, value)

    def _set(self, name: str, value: int) -> None:
        self._index[name] = value
        self._names[value] = name
        self.size = max(self.size, value + 1)

    def add(self, name: str) -> int:
        """The index of ``name``, appending it with the next index if new."""
        value = self._index.get(name)
        if value is None:
            value = self.size
            self._set(name, value)
        return value

    def get(self, name: str, default: int | None = None) -> int | None:
        return self._index.get(name, default)

    def __getitem__(self, name: str) -> int:
        return self._index[name]

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def __len__(self) -> int:
        return len(self._index)

    def name(self, value: int) -> str:
        return self._names[value]

    def names(self) -> list[str | None]:
        """Names by index, 0..size-1 (None where an index is unused)."""
        return [self._names.get(i) for i in range(self.size)]

    def labels(self, count: int) -> list[str]:
        """What the first ``count`` indices are written as (predict's output): their names, the
        index itself in decimal where unused."""
        return [str(i) if self._names.get(i) is None else self._names[i] for i in range(count)]

    def items(self) -> Iterator[tuple[str, int]]:
        """(name, index) in index order."""
        return ((self._names[i], i) for i in sorted(self._names))

    def save(self, path: str | os.PathLike) -> None:
        """Write ``name\\tindex`` lines in index order, atomically."""
        text = "".join(f"{name}\t{value}\n" for name, value in self.items())
        write_text_atomically(path, text)


@dataclass
class ParsedSamples:
    """The result of parsing text files: rows in samples-index order, and what was dropped."""

    rows: CsrRows
    features: NameIndex
    samples: NameIndex
    skipped_features: int = 0  # fields whose name was not in a closed features index


class _Accumulator:
    """Rows as parsed, in file order, in compact typed arrays (no per-field Python objects kept)."""

    def __init__(self) -> None:
        self.sample = array("q")
        self.lengths = array("q")
        self.indices = array("q")
        self.values = array("f")
        self.any_value = False
        self.line_of: dict[int, int] = {}  # sample index -> "path:line" of its row
        self.where: list[str] = []


def split_line(line: str) -> tuple[str, list[str], list[float], bool] | None:
    """One line of DSSTNE text: (sample name, feature names, values, whether any field carried a
    value), a field without one counting 1.0; None for a blank line. A malformed line raises a
    ``DatasetError`` whose message the caller prefixes with where the line is (``path:line``)."""
    line = line.rstrip("\r\n")
    if not line.strip():
        return None
    tab = line.find("\t")
    if tab < 0:
        raise DatasetError(f"malformed line {line[:80]!r}: no tab between the sample name and its features "
                           f"(expected '<sample>\\t<feature>[,<value>]:...')")
    name = line[:tab].strip()
    if not name:
        raise DatasetError("empty sample name (the line starts with a tab)")
    check_name(name, "sample")
    names_checked = _BAD_NAME_CHARACTER.search(line, tab + 1) is None  # the common case: no name to check
    features: list[str] = []
    values: list[float] = []
    any_value = False
    for field in line[tab + 1:].split(":"):
        parts = field.split(",")
        feature = parts[0].strip()
        if len(parts) > 2:
            raise DatasetError(f"malformed field {field[:80]!r}: more than one ',' (expected '<feature>' or "
                               f"'<feature>,<value>')")
        if not feature:
            if len(parts) == 1 and not field.strip():
                continue  # empty field: skipped, as DSSTNE does
            raise DatasetError(f"empty feature name in field {field[:80]!r}")
        if not names_checked:
            check_name(feature, "feature")
        value = 1.0
        if len(parts) == 2:
            value = finite_number(parts[1])
            if value is None:
                raise DatasetError(f"bad value {parts[1].strip()!r} of feature '{feature}': not a finite number")
            any_value = True
        features.append(feature)
        values.append(value)
    return name, features, values, any_value


def _parse_lines(lines: Iterable[str], path: str, features: NameIndex, samples: NameIndex,
                 add_features: bool, acc: _Accumulator) -> int:
    skipped = 0
    for number, raw in enumerate(lines, 1):
        try:
            check_utf8(raw)
            parsed = split_line(raw)
        except DatasetError as e:
            raise DatasetError(f"{path}:{number}: {e}") from None
        if parsed is None:
            continue
        name, names, values, any_value = parsed
        sample = samples.add(name)
        if sample in acc.line_of:
            raise DatasetError(f"{path}:{number}: sample '{name}' appears again (first at "
                               f"{acc.where[acc.line_of[sample]]}); give each sample one line")
        acc.line_of[sample] = len(acc.where)
        acc.where.append(f"{path}:{number}")
        acc.any_value |= any_value
        count = 0
        for feature, value in zip(names, values):
            index = features.add(feature) if add_features else features.get(feature)
            if index is None:
                skipped += 1
                continue
            acc.indices.append(index)
            acc.values.append(value)
            count += 1
        acc.sample.append(sample)
        acc.lengths.append(count)
    return skipped


def parse_text(paths: str | os.PathLike | Iterable[str | os.PathLike], features: NameIndex | None = None,
               samples: NameIndex | None = None, *, add_features: bool = True) -> ParsedSamples:
    """Parse DSSTNE text files into CSR rows, extending (merging into) the given indexes.

    ``add_features=False`` keeps the features index closed: features not in it are dropped
    and counted (DSSTNE's generateNetCDF without feature-index updates, used for an output
    dataset restricted to the input's items). Rows come in samples-index order, one per
    sample of the index (empty for samples with no line here).
    """
    features = NameIndex() if features is None else features
    samples = NameIndex() if samples is None else samples
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    acc = _Accumulator()
    skipped = 0
    for path in paths:
        path = os.fspath(path)
        with open(path, encoding="utf-8", errors="surrogateescape", newline="") as f:
            skipped += _parse_lines(bounded_lines(f, path, MAX_SAMPLE_LINE), path, features, samples, add_features, acc)
    return ParsedSamples(_to_rows(acc, features.size, samples.size), features, samples, skipped)


def parse_lines(lines: Iterable[str], features: NameIndex | None = None, samples: NameIndex | None = None, *,
                add_features: bool = True, source: str = "<lines>") -> ParsedSamples:
    """``parse_text`` for lines already in memory; errors name ``source``."""
    features = NameIndex() if features is None else features
    samples = NameIndex() if samples is None else samples
    acc = _Accumulator()
    skipped = _parse_lines(lines, source, features, samples, add_features, acc)
    return ParsedSamples(_to_rows(acc, features.size, samples.size), features, samples, skipped)


def _to_rows(acc: _Accumulator, n_features: int, n_samples: int) -> CsrRows:
    """File-order rows -> one row per sample index, in index order."""
    sample = np.frombuffer(acc.sample, np.int64) if acc.sample else np.zeros(0, np.int64)
    lengths = np.frombuffer(acc.lengths, np.int64) if acc.lengths else np.zeros(0, np.int64)
    indices = np.frombuffer(acc.indices, np.int64) if acc.indices else np.zeros(0, np.int64)
    values = (np.frombuffer(acc.values, np.float32) if acc.values else np.zeros(0, np.float32)) if acc.any_value else None
    full = np.zeros(n_samples, np.int64)
    full[sample] = lengths
    offsets = np.concatenate([[0], np.cumsum(full)]).astype(np.int64)
    if sample.size and not (sample == np.arange(sample.size)).all():  # not already in index order
        take = np.argsort(np.repeat(sample, lengths), kind="stable")  # each field to its sample's place
        indices = indices[take]
        values = values[take] if values is not None else None
    return CsrRows(offsets, indices.astype(np.int32), None if values is None else values.copy(), n_features)


def text_to_csr(paths: str | os.PathLike | Iterable[str | os.PathLike], output: str | os.PathLike, *,
                features_index: str | os.PathLike | None = None, samples_index: str | os.PathLike | None = None,
                add_features: bool = True, overwrite: bool = False) -> ParsedSamples:
    """generateNetCDF's job: text files -> a CSR dataset, with both indexes loaded from and
    saved back to their files (merged: existing entries keep their indices). The dataset is
    written before the indexes, so an index never names rows a dataset lacks."""
    features = NameIndex.load(features_index) if features_index and os.path.exists(features_index) else NameIndex()
    samples = NameIndex.load(samples_index) if samples_index and os.path.exists(samples_index) else NameIndex()
    parsed = parse_text(paths, features, samples, add_features=add_features)
    write_csr(output, parsed.rows, overwrite=overwrite)
    if features_index:
        features.save(features_index)
    if samples_index:
        samples.save(samples_index)
    return parsed


# ---------------------------------------------------------------------------- writer


def format_lines(rows: CsrRows, features: NameIndex | list[str], samples: NameIndex | list[str] | None = None,
                 with_values: bool | None = None) -> Iterator[str]:
    """DSSTNE text lines (with '\\n') for ``rows``: sample ``r`` is named ``samples``'s entry
    ``r`` (or ``r`` itself), features by name. Values are written in float32's shortest form,
    so a parse gives back the same float32."""
    feature_names = features.names() if isinstance(features, NameIndex) else list(features)
    sample_names = samples.names() if isinstance(samples, NameIndex) else samples
    if len(feature_names) < rows.n_features:
        raise ValueError(f"the features index names {len(feature_names)} features, the rows have {rows.n_features}")
    for name in feature_names:
        if name is not None and (not name or any(c in name for c in "\t\n:,") or name != name.strip()):
            raise ValueError(f"feature name {name!r} cannot be written in DSSTNE text (empty, surrounding "
                             f"whitespace, or one of tab, newline, ':' or ',')")
    with_values = rows.values is not None if with_values is None else with_values
    names = np.asarray(feature_names, dtype=object)
    base = int(rows.offsets[0])
    for r in range(rows.n_samples):
        lo, hi = int(rows.offsets[r]) - base, int(rows.offsets[r + 1]) - base
        sample = str(r) if sample_names is None else sample_names[r]
        if sample is None or not sample or any(c in sample for c in "\t\n") or sample != sample.strip():
            raise ValueError(f"sample name {sample!r} of row {r} cannot be written in DSSTNE text")
        fields = names[rows.indices[lo:hi]]
        if None in fields:
            raise ValueError(f"row {r} uses a feature index the features index does not name")
        if with_values and rows.values is not None:
            vals = rows.values[lo:hi].astype(np.float32).astype(str)
            fields = [f"{n},{v}" for n, v in zip(fields, vals)]
        yield f"{sample}\t{':'.join(fields)}\n"


def write_text(path: str | os.PathLike, rows: CsrRows, features: NameIndex | list[str],
               samples: NameIndex | list[str] | None = None, with_values: bool | None = None) -> None:
    """Write ``rows`` as a DSSTNE text file, atomically (a failure leaves an old file intact)."""
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            _write_all(f, format_lines(rows, features, samples, with_values))

    write_atomically(path, write)


def _write_all(f: TextIO, lines: Iterable[str], block: int = 4096) -> None:
    buffer: list[str] = []
    for line in lines:
        buffer.append(line)
        if len(buffer) >= block:
            f.write("".join(buffer))
            buffer.clear()
    f.write("".join(buffer))
