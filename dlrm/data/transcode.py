"""CSV/TSV with integer-coded features -> split-binary dataset.

For data that is already numeric (label, numbers, non-negative ids); raw Criteo logs with hex
hashes go through preproc/ instead. Each file is parsed in chunks of ``chunk_rows`` lines with
numpy's C parser, so memory stays bounded and speed is that of numpy, not of a Python loop per
field. When cardinalities are not given, a first pass finds max id + 1 over all splits. Nothing
replaces an existing dataset unless every split converts cleanly: the writers commit together
at the end and the spec is written last.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import re
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np
import torch

from dlrm.data.atomic import check_can_create, writing
from dlrm.data.batch import Batch
from dlrm.data.errors import DatasetError
from dlrm.data.feature_spec import SPEC_FILE_NAME, FeatureSpec, dtype_for_cardinality
from dlrm.data.split_binary import SplitBinaryWriter

_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass
class _Chunk:
    label: np.ndarray  # [n] bool
    numerical: np.ndarray  # [n, num_numerical] float16
    categorical: np.ndarray  # [n, num_categorical] int64


@dataclass
class _Layout:
    """How to parse one line: field names and the numpy record type of a row."""

    path: str
    delimiter: str
    num_numerical: int
    num_categorical: int
    cardinalities: np.ndarray | None

    def __post_init__(self) -> None:
        fields = [("label", np.float64)]
        if self.num_numerical:
            fields.append(("num", np.float64, (self.num_numerical,)))
        if self.num_categorical:
            fields.append(("cat", np.int64, (self.num_categorical,)))
        self.dtype = np.dtype(fields)
        self.width = 1 + self.num_numerical + self.num_categorical

    def field_name(self, k: int) -> str:
        if k == 0:
            return "label"
        if k <= self.num_numerical:
            return f"numerical feature {k - 1}"
        return f"categorical feature {k - 1 - self.num_numerical}"

    def where(self, line_no: int) -> str:
        return f"{self.path}, line {line_no}"


def _fill_empty(text: str, sep: str) -> str:
    """Write 0 into empty fields with plain string replaces (several times faster than a regex)."""
    text = f"\n{text}\n"
    pair = sep + sep
    if pair in text:
        # Non-overlapping replace fills every other gap in a run of separators; twice fills all.
        text = text.replace(pair, f"{sep}0{sep}").replace(pair, f"{sep}0{sep}")
    text = text.replace(f"\n{sep}", f"\n0{sep}").replace(f"{sep}\n", f"{sep}0\n")
    return text[1:-1]


def _load(lines: list[str], layout: _Layout) -> np.ndarray:
    return np.loadtxt(
        io.StringIO("\n".join(lines)),
        dtype=layout.dtype,
        delimiter=layout.delimiter,
        comments=None,
        quotechar=None,
        ndmin=1,
    )


def _locate_parse_error(lines: list[str], numbers: list[int], layout: _Layout, cause: Exception) -> DatasetError:
    """Find the first line numpy rejects (halving, so about one extra parse of the chunk)."""
    lo, hi = 0, len(lines)  # invariant: lines[lo:hi] fails to parse
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            _load(lines[lo:mid], layout)
            lo = mid
        except (ValueError, OverflowError):
            hi = mid
    fields = lines[lo].split(layout.delimiter)
    for k, value in enumerate(fields):
        kind = np.int64 if k > layout.num_numerical else np.float64
        try:
            np.loadtxt(io.StringIO(value), dtype=kind, comments=None, quotechar=None, ndmin=1)
        except (ValueError, OverflowError):
            expected = "a non-negative integer id" if kind is np.int64 else "a number"
            return DatasetError(
                f"{layout.where(numbers[lo])}: field {k + 1} ({layout.field_name(k)}) is {value!r}, expected "
                f"{expected}; fix or drop the line"
            )
    return DatasetError(f"{layout.where(numbers[lo])}: cannot parse the line ({cause}); fix or drop the line")


def _check(rec: np.ndarray, numbers: np.ndarray, layout: _Layout) -> _Chunk:
    """Value checks, vectorised; the first offending line is named."""
    n = rec.shape[0]
    label = rec["label"]
    bad = (label != 0) & (label != 1)
    if bad.any():
        i = int(np.argmax(bad))
        raise DatasetError(f"{layout.where(int(numbers[i]))}: label is {float(label[i])!r}, expected 0 or 1")

    numerical = np.zeros((n, 0), np.float16)
    if layout.num_numerical:
        with np.errstate(over="ignore", invalid="ignore"):
            numerical = rec["num"].astype(np.float16)
        bad = ~np.isfinite(numerical)
        if bad.any():
            i, j = (int(x[0]) for x in np.nonzero(bad))
            raise DatasetError(
                f"{layout.where(int(numbers[i]))}: numerical feature {j} is {float(rec['num'][i, j])!r}, which is not "
                f"finite in float16 (max 65504); log-transform numerical features before transcoding"
            )

    categorical = np.zeros((n, 0), np.int64)
    if layout.num_categorical:
        categorical = np.ascontiguousarray(rec["cat"])
        bad = categorical < 0
        if layout.cardinalities is not None:
            bad |= categorical >= layout.cardinalities
        if bad.any():
            i, j = (int(x[0]) for x in np.nonzero(bad))
            value = int(categorical[i, j])
            if value < 0:
                raise DatasetError(
                    f"{layout.where(int(numbers[i]))}: categorical feature {j} is {value}; ids must be "
                    f"non-negative integers (0 is the missing/rare bucket)"
                )
            raise DatasetError(
                f"{layout.where(int(numbers[i]))}: categorical feature {j} is {value}, outside "
                f"[0, {int(layout.cardinalities[j])}); raise its value in `cardinalities` or leave "
                f"cardinalities out to compute them from the data"
            )
    return _Chunk(label=label.astype(np.bool_), numerical=numerical, categorical=categorical)


def _read_chunks(layout: _Layout, chunk_rows: int) -> Iterator[_Chunk]:
    """Parse a file ``chunk_rows`` lines at a time; blank lines are skipped."""
    sep = layout.delimiter
    try:
        f = open(layout.path, "r", encoding="utf-8")
    except FileNotFoundError:
        raise DatasetError(f"{layout.path}: input file not found; check the path passed for this split") from None
    except IsADirectoryError:
        raise DatasetError(f"{layout.path}: is a directory; pass the text file of this split") from None
    with f:
        line_no = 0
        while True:
            try:
                block = list(itertools.islice(f, chunk_rows))
            except UnicodeDecodeError as e:
                raise DatasetError(
                    f"{layout.path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} in or after line {line_no + 1}); "
                    f"transcode reads CSV/TSV text of numbers: check the path, or save the file as UTF-8"
                ) from None
            if not block:
                return
            lines: list[str] = []
            numbers: list[int] = []
            for raw in block:
                line_no += 1
                line = raw.rstrip("\r\n")
                if not line:
                    continue
                count = line.count(sep) + 1
                if count != layout.width:
                    raise DatasetError(
                        f"{layout.where(line_no)}: {count} fields, expected {layout.width} (label, "
                        f"{layout.num_numerical} numerical, {layout.num_categorical} categorical); check "
                        f"`delimiter` and the feature counts"
                    )
                lines.append(line)
                numbers.append(line_no)
            if not lines:
                continue
            lines = _fill_empty("\n".join(lines), sep).split("\n")
            try:
                rec = _load(lines, layout)
            except (ValueError, OverflowError) as e:
                raise _locate_parse_error(lines, numbers, layout, e) from None
            yield _check(rec, np.asarray(numbers, dtype=np.int64), layout)


def transcode(
    inputs: dict[str, str],
    output_dir: str,
    num_numerical: int,
    num_categorical: int,
    delimiter: str = "\t",
    cardinalities: Sequence[int] | None = None,
    chunk_rows: int = 1_000_000,
) -> FeatureSpec:
    """Convert delimited text files (one per split) into a split-binary dataset in ``output_dir``.

    Each line: label (0/1), ``num_numerical`` numbers, ``num_categorical`` non-negative integer
    ids; empty fields mean 0. Returns the spec that was written to ``output_dir/feature_spec.yaml``.
    """
    if not inputs:
        raise ValueError("inputs is empty; give at least one split, e.g. {'train': 'train.tsv'}")
    for split in inputs:
        if not _SPLIT_NAME.match(split):
            raise ValueError(f"split name {split!r} must be a plain directory name (letters, digits, _ . -)")
    if num_numerical < 0 or num_categorical < 0:
        raise ValueError("num_numerical and num_categorical must be >= 0")
    if len(delimiter) != 1 or delimiter in "\r\n.+-" or delimiter.isalnum():
        raise ValueError(f"delimiter must be one character that cannot occur in a number, got {delimiter!r}")
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    check_can_create(output_dir, "the dataset", inside=True)  # a read-only file system fails before any reading

    def layout(path: str, cards: np.ndarray | None) -> _Layout:
        return _Layout(os.fspath(path), delimiter, num_numerical, num_categorical, cards)

    if cardinalities is None:
        max_ids = np.full(num_categorical, -1, dtype=np.int64)
        for path in inputs.values():
            for chunk in _read_chunks(layout(path, None), chunk_rows):
                if len(chunk.label) and num_categorical:
                    np.maximum(max_ids, chunk.categorical.max(axis=0), out=max_ids)
        cards = [int(m) + 1 if m >= 0 else 1 for m in max_ids]
    else:
        cards = [int(c) for c in cardinalities]
        if len(cards) != num_categorical:
            raise ValueError(f"{len(cards)} cardinalities given for {num_categorical} categorical features")
        if any(c < 1 for c in cards):
            raise ValueError(f"cardinalities must be >= 1, got {cards}")
    for j, c in enumerate(cards):
        try:
            dtype_for_cardinality(c)
        except ValueError as e:
            raise DatasetError(f"categorical feature {j}: {e}") from None

    created = _missing_dirs(output_dir, tuple(inputs))  # removed again if a split fails

    def remove_created() -> None:
        for d in created:  # deepest first: only directories this call made, and only if still empty
            with contextlib.suppress(OSError):
                os.rmdir(d)

    spec = FeatureSpec.default(num_numerical, cards, splits=tuple(inputs), base_directory=os.path.abspath(output_dir))
    card_array = np.asarray(cards, dtype=np.int64)
    with writing(output_dir, "the dataset", cleanup=remove_created):  # a full disk: a StorageError naming it
        os.makedirs(output_dir, exist_ok=True)
        with contextlib.ExitStack() as writers:  # all splits commit together, or none does
            for split, path in inputs.items():
                writer = writers.enter_context(SplitBinaryWriter(spec, split))
                for chunk in _read_chunks(layout(path, card_array), chunk_rows):
                    writer.write(
                        Batch(
                            numerical=torch.from_numpy(chunk.numerical),
                            categorical=torch.from_numpy(chunk.categorical),
                            label=torch.from_numpy(chunk.label),
                        )
                    )
                if writer.num_rows == 0:
                    raise DatasetError(f"{path}: no data lines; each split needs at least one row")
    spec.to_yaml(os.path.join(output_dir, SPEC_FILE_NAME))
    return spec


def _missing_dirs(output_dir: str, splits: tuple[str, ...]) -> list[str]:
    """The directories writing ``splits`` under ``output_dir`` would create, deepest first."""
    missing = [os.path.join(output_dir, s) for s in splits if not os.path.exists(os.path.join(output_dir, s))]
    d = os.path.abspath(output_dir)
    while not os.path.exists(d):
        missing.append(d)
        d = os.path.dirname(d)
    return missing
