"""The reference Criteo transform: plain Python loops and dicts, written to be obviously correct.

It is slow on purpose: every fast engine is tested by comparing its output with this one, so the
rules below live here in their simplest form. docs/preprocessing.md states the same rules.

Input: lines of ``label \\t I1..I13 \\t C1..C26`` (40 tab-separated fields; ``.gz`` files are
read transparently). A line is well formed when

- it has exactly 40 fields (the line ends at ``\\n``; nothing else is stripped),
- the label is ``0`` or ``1``,
- each count (I1..I13) is empty or an optional ``-`` followed by ASCII digits,
- each categorical (C1..C26) is empty or exactly 8 hex digits, either case.

Output (a split-binary dataset, see docs/data_format.md):

- label: the byte 0 or 1.
- numerical: ``ln(x + 3)`` for a count ``x >= -2``, and ``0`` for a missing count or one that is
  ``<= -3``, computed in float64. This is what NVIDIA's Spark pipeline computes (``log(x + 3)``
  on the raw integer, then nulls -- missing values, and the log of a non-positive number, which
  Spark returns as null -- filled with 0); the result is always finite and >= 0. It is stored
  as float16 by ``numerical_rounding`` (``numeric.ROUNDINGS``): ``nvidia`` (the default) rounds
  to float32 and then to float16 as NVIDIA's conversion scripts do, so the values match theirs
  bit for bit; ``direct`` rounds once to the nearest float16 (ties to even).
- categorical: per column, values are counted (after lowercasing) over the rows of
  ``vocabulary_days``: ``train`` (the default) counts the train files only, ``all`` the train,
  test and validation files, as NVIDIA's pipelines do. A value seen at least ``threshold``
  times gets an id in 1..K, ranked by descending count, ties broken by the 8-digit lowercase
  hex string in ascending order. Missing values, values seen fewer than ``threshold`` times, and
  values not counted map to 0. Cardinality = K + 1.
- thresholds: an int for every column, or a dict {TSV field index (14..39): threshold} as in
  NVIDIA's ``--frequency_limit`` (``14`` is C1), where the key ``None`` holds the default of the
  columns not listed (0, i.e. no threshold, when absent). Thresholds 0 and 1 keep every value.
- vocabulary: the kept values of each column in id order, saved as ``<output>/vocabulary``
  (``vocab.Vocabulary``, the engines' format) so raw rows can be mapped to the same ids later.
"""

from __future__ import annotations

import gzip
import math
import os
import re
import sys
from typing import IO, Iterator

import numpy as np

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.split_binary_writer import SplitBinaryWriter
from dlrm.engine.errors import DatasetError
from preproc.numeric import DEFAULT_ROUNDING, check_rounding, to_float16
from preproc.vocab import Vocabulary, save_dataset_vocabulary

NUM_NUMERICAL = 13
NUM_CATEGORICAL = 26
NUM_FIELDS = 1 + NUM_NUMERICAL + NUM_CATEGORICAL
FIRST_CATEGORICAL_FIELD = 1 + NUM_NUMERICAL  # 14: NVIDIA's --frequency_limit numbers columns by field
ERROR_REASONS = ("field_count", "label", "numerical", "categorical")
_COUNT = re.compile(r"-?[0-9]+")
_HASH = re.compile(r"[0-9a-fA-F]{8}")
_FIRST_LOCATIONS = 5
_WRITE_ROWS = 65536
VOCABULARY_DAYS = ("train", "all")  # the rows whose values are counted: train's, or every split's
NUMERICAL_RULE = "ln(x + 3); 0 for missing or x <= -3"


def check_vocabulary_days(vocabulary_days: str) -> str:
    if vocabulary_days not in VOCABULARY_DAYS:
        raise ValueError(f"vocabulary_days must be one of {list(VOCABULARY_DAYS)}, got {vocabulary_days!r}")
    return vocabulary_days


def preprocessing_metadata(thresholds: list[int], rows: dict[str, int], vocabulary_days: str,
                           numerical_rounding: str) -> dict:
    """The spec's ``metadata.preprocessing`` (the engines add ``shuffle`` when there is one)."""
    return {
        "numerical": NUMERICAL_RULE,
        "numerical_rounding": numerical_rounding,
        "frequency_thresholds": list(thresholds),
        "vocabulary_days": vocabulary_days,
        "rows": dict(rows),
    }

class _Malformed(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _column_name(field: int) -> str:
    return f"I{field}" if field <= NUM_NUMERICAL else f"C{field - NUM_NUMERICAL}"


def parse_line(line: str) -> tuple[int, list[int | None], list[str | None]]:
    """One line -> (label, counts with None for missing, lowercase hashes with None for missing)."""
    fields = line.split("\t")
    if len(fields) != NUM_FIELDS:
        raise _Malformed("field_count", f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}")
    if fields[0] not in ("0", "1"):
        raise _Malformed("label", f"label must be '0' or '1', got {fields[0][:20]!r}")
    counts: list[int | None] = []
    for k in range(1, 1 + NUM_NUMERICAL):
        text = fields[k]
        if text == "":
            counts.append(None)
        elif _COUNT.fullmatch(text):
            try:
                counts.append(int(text))
            except ValueError:  # over sys.get_int_max_str_digits() digits: no int to value
                raise _Malformed("numerical", f"{_column_name(k)} has {len(text.lstrip('-'))} digits, more than "
                                 f"an integer is read with ({sys.get_int_max_str_digits()})") from None
        else:
            raise _Malformed("numerical", f"{_column_name(k)} must be empty or an integer, got {text[:20]!r}")
    hashes: list[str | None] = []
    for k in range(FIRST_CATEGORICAL_FIELD, NUM_FIELDS):
        text = fields[k]
        if text == "":
            hashes.append(None)
        elif _HASH.fullmatch(text):
            hashes.append(text.lower())
        else:
            raise _Malformed("categorical", f"{_column_name(k)} must be empty or 8 hex digits, got {text[:20]!r}")
    return int(fields[0]), counts, hashes


def log_transform(count: int | None) -> float:
    """ln(count + 3) as NVIDIA's pipeline computes it; 0 where that is undefined or the count is missing."""
    if count is None or count + 3 <= 0:
        return 0.0
    return math.log(count + 3)


def parse_threshold(text: str) -> int | dict[int | None, int]:
    """NVIDIA's ``--frequency_limit`` syntax: ``15`` (all columns) or ``14:3,15`` (C1 -> 3, others 15).

    Columns are numbered by TSV field, 14 (C1) .. 39 (C26); the entry without a column is the
    default, stored under the key ``None``.
    """
    text = text.strip()
    if re.fullmatch(r"[0-9]+", text):
        return int(text)
    result: dict[int | None, int] = {}
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(?:([0-9]+):)?([0-9]+)", part)
        if not m:
            raise ValueError(f"frequency threshold {text!r}: cannot parse {part!r}; use e.g. '15' or '14:3,15'")
        column = None if m.group(1) is None else int(m.group(1))
        if column is not None and not FIRST_CATEGORICAL_FIELD <= column < NUM_FIELDS:
            raise ValueError(
                f"frequency threshold {text!r}: column {column} is not a categorical field "
                f"({FIRST_CATEGORICAL_FIELD}..{NUM_FIELDS - 1})"
            )
        if column in result:
            what = "the default" if column is None else f"column {column}"
            raise ValueError(f"frequency threshold {text!r}: {what} is given twice")
        result[column] = int(m.group(2))
    return result


def column_thresholds(frequency_threshold: int | dict[int | None, int]) -> list[int]:
    """The threshold of each categorical column (index 0 = C1)."""
    if isinstance(frequency_threshold, dict):
        default = frequency_threshold.get(None, 0)
        for key in frequency_threshold:
            if key is not None and not FIRST_CATEGORICAL_FIELD <= key < NUM_FIELDS:
                raise ValueError(f"frequency threshold key {key} is not a categorical field ({FIRST_CATEGORICAL_FIELD}..{NUM_FIELDS - 1})")
        return [frequency_threshold.get(FIRST_CATEGORICAL_FIELD + j, default) for j in range(NUM_CATEGORICAL)]
    return [int(frequency_threshold)] * NUM_CATEGORICAL


def _open_text(path: str) -> IO[str]:
    # newline="\n": only \n ends a line, so a stray \r makes the line malformed instead of splitting it.
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="ascii", errors="replace", newline="\n")
    return open(path, "r", encoding="ascii", errors="replace", newline="\n")


class _Errors:
    """Counts malformed lines per reason (skip mode) or raises on the first one (fail mode)."""

    def __init__(self, on_error: str):
        if on_error not in ("fail", "skip"):
            raise ValueError(f"on_error must be 'fail' or 'skip', got {on_error!r}")
        self.on_error = on_error
        self.counts = {reason: 0 for reason in ERROR_REASONS}
        self.first: dict[str, list[str]] = {reason: [] for reason in ERROR_REASONS}

    def report(self, path: str, line_no: int, error: _Malformed) -> None:
        if self.on_error == "fail":
            raise DatasetError(
                f"{path}, line {line_no}: {error.detail}; fix or drop the line, or pass on_error='skip'"
            )
        self.counts[error.reason] += 1
        if len(self.first[error.reason]) < _FIRST_LOCATIONS:
            self.first[error.reason].append(f"{path}:{line_no}")

    def summary(self) -> dict:
        return {r: {"count": self.counts[r], "first": list(self.first[r])} for r in ERROR_REASONS if self.counts[r]}


def _rows(paths: list[str], errors: _Errors | None) -> Iterator[tuple[int, list[int | None], list[str | None]]]:
    """Parsed well-formed lines of ``paths``; malformed ones go to ``errors`` (or are dropped if None)."""
    for path in paths:
        with _open_text(path) as f:
            for line_no, line in enumerate(f, start=1):
                if line.endswith("\n"):
                    line = line[:-1]
                try:
                    yield parse_line(line)
                except _Malformed as e:
                    if errors is not None:
                        errors.report(path, line_no, e)


def build_vocabularies(train_files: list[str], thresholds: list[int], on_error: str = "fail") -> list[dict[str, int]]:
    """Per column: {hash: id} for the values kept, ids 1..K by descending count, ties by hash.

    Values are counted over ``train_files``: the train files, or every file for
    ``vocabulary_days='all'``."""
    counts: list[dict[str, int]] = [{} for _ in range(NUM_CATEGORICAL)]
    # Malformed train lines are reported (or counted) in the transform pass; here fail mode raises
    # early, before anything is written, and skip mode just leaves them out of the counts.
    errors = _Errors("fail") if on_error == "fail" else None
    for _, _, hashes in _rows(train_files, errors):
        for j, value in enumerate(hashes):
            if value is not None:
                counts[j][value] = counts[j].get(value, 0) + 1
    vocabularies = []
    for j in range(NUM_CATEGORICAL):
        kept = [(c, v) for v, c in counts[j].items() if c >= thresholds[j]]
        kept.sort(key=lambda cv: (-cv[0], cv[1]))
        vocabularies.append({v: i + 1 for i, (_, v) in enumerate(kept)})
    return vocabularies


def criteo_day_split(day_files: list[str]) -> tuple[list[str], str]:
    """NVIDIA's split of the 24 days: days 0-22 are train, day 23 is the source of test and validation.

    ``day_files`` are the 24 files named ``day_<n>`` (optionally ``.gz``) in any order; the
    result is (train files ordered by day, the day 23 file). Pass the latter to split_day_23.
    """
    by_day: dict[int, str] = {}
    for path in day_files:
        m = re.fullmatch(r"day_([0-9]+)(\.gz)?", os.path.basename(path))
        if not m:
            raise ValueError(f"{path}: not a Criteo day file (expected day_<n> or day_<n>.gz)")
        day = int(m.group(1))
        if day in by_day:
            raise ValueError(f"day {day} given twice: {by_day[day]} and {path}")
        by_day[day] = path
    if sorted(by_day) != list(range(24)):
        missing = sorted(set(range(24)) - set(by_day))
        extra = sorted(set(by_day) - set(range(24)))
        raise ValueError(f"need exactly days 0..23; missing {missing}, unexpected {extra}")
    return [by_day[d] for d in range(23)], by_day[23]


def split_day_23(path: str, out_test: str, out_validation: str) -> tuple[int, int]:
    """Write the first half of ``path``'s lines to ``out_test`` and the rest to ``out_validation``.

    With n lines, test gets n // 2 and validation n - n // 2 (the odd line goes to validation).
    Lines are copied byte for byte; a ``.gz`` input is decompressed. Returns the two line counts.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        total = sum(1 for _ in f)
    half = total // 2
    with opener(path, "rb") as f, open(out_test, "wb") as test, open(out_validation, "wb") as validation:
        for i, line in enumerate(f):
            (test if i < half else validation).write(line)
    return half, total - half


def _flush(writer: SplitBinaryWriter, labels: list[int], numerical: list[list[float]], ids: list[list[int]],
           rounding: str) -> None:
    if not labels:
        return
    from dlrm.data.batch import Batch  # torch: not for the command line's checks (preproc.cli imports this module)

    writer.write(
        Batch(
            numerical=to_float16(numerical, rounding),  # type: ignore[arg-type]
            categorical=np.array(ids, dtype=np.int64),  # type: ignore[arg-type]
            label=np.array(labels, dtype=np.uint8),  # type: ignore[arg-type]
        )
    )
    labels.clear()
    numerical.clear()
    ids.clear()


def reference_preprocess(
    train_files: list[str],
    test_files: list[str],
    validation_files: list[str],
    output_dir: str,
    frequency_threshold: int | dict[int | None, int] = 0,
    on_error: str = "fail",
    vocabulary_days: str = "train",
    numerical_rounding: str = DEFAULT_ROUNDING,
) -> FeatureSpec:
    """Raw Criteo TSV files -> split-binary dataset in ``output_dir``, by the rules in the module docstring.

    ``train_files`` and ``test_files`` must be non-empty; an empty ``validation_files`` list means
    the dataset has no validation split. A split whose files hold no (well-formed) line is an
    error. ``on_error='fail'`` raises DatasetError at the first malformed line (file, 1-based line
    number, reason); ``'skip'`` drops such lines, prints a summary to stderr and records the count
    per reason with the first few ``file:line`` locations in ``metadata['skipped_lines']``.
    Nothing in ``output_dir`` is replaced unless every split succeeds; the spec is written last.
    ``vocabulary_days`` and ``numerical_rounding`` are explained in the module docstring.
    """
    check_vocabulary_days(vocabulary_days)
    check_rounding(numerical_rounding)
    splits = {"train": list(train_files), "test": list(test_files)}
    if validation_files:
        splits["validation"] = list(validation_files)
    for name in ("train", "test"):
        if not splits[name]:
            raise DatasetError(f"split '{name}' has no input files")
    thresholds = column_thresholds(frequency_threshold)
    errors = _Errors(on_error)
    counted = splits["train"] if vocabulary_days == "train" else [p for files in splits.values() for p in files]
    vocabularies = build_vocabularies(counted, thresholds, on_error)
    cardinalities = [len(v) + 1 for v in vocabularies]

    os.makedirs(output_dir, exist_ok=True)
    spec = FeatureSpec.default(NUM_NUMERICAL, cardinalities, splits=list(splits), base_directory=os.path.abspath(output_dir))
    writers = [SplitBinaryWriter(spec, name) for name in splits]
    try:
        for name, writer in zip(splits, writers):
            labels: list[int] = []
            numerical: list[list[float]] = []
            ids: list[list[int]] = []
            for label, counts, hashes in _rows(splits[name], errors):
                labels.append(label)
                numerical.append([log_transform(c) for c in counts])
                ids.append([0 if h is None else vocabularies[j].get(h, 0) for j, h in enumerate(hashes)])
                if len(labels) == _WRITE_ROWS:
                    _flush(writer, labels, numerical, ids, numerical_rounding)
            _flush(writer, labels, numerical, ids, numerical_rounding)
            if writer.num_rows == 0:
                raise DatasetError(
                    f"split '{name}' has no rows: its files {splits[name]} hold no well-formed line"
                    + (" (see the skipped-line counts)" if errors.summary() else "")
                )
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    for writer in writers:
        writer.close()
    by_id = [sorted(v, key=v.__getitem__) for v in vocabularies]  # each column's kept values in id order
    save_dataset_vocabulary(output_dir, Vocabulary.build([[int(h, 16) for h in values] for values in by_id]))

    skipped = errors.summary()
    rows = {name: w.num_rows for name, w in zip(splits, writers)}
    spec.metadata = {"preprocessing": preprocessing_metadata(thresholds, rows, vocabulary_days, numerical_rounding)}
    if skipped:
        spec.metadata["skipped_lines"] = skipped
        total = sum(v["count"] for v in skipped.values())
        detail = "; ".join(f"{r}: {v['count']} (first at {', '.join(v['first'])})" for r, v in skipped.items())
        print(f"skipped {total} malformed line(s): {detail}", file=sys.stderr)
    spec.to_yaml(output_dir)
    return spec
