"""CSV/TSV with integer-coded features -> split-binary dataset.

For data that is already numeric (label, numbers, non-negative ids); raw Criteo logs with hex
hashes go through preproc/ instead. Each file is parsed in chunks of ``chunk_rows`` lines with
numpy's C parser, so memory stays bounded and speed is that of numpy, not of a Python loop per
field. When cardinalities are not given, a first pass finds max id + 1 over all splits.
Numericals become float16 through float32 by default, as the torch cast in NVIDIA's transcoder
does, so the bytes are NVIDIA's; ``numerical_rounding="direct"`` rounds once
(``dlrm.data.numerical_rounding``). Nothing replaces an existing dataset unless every split
converts cleanly: the writers commit together at the end and the spec is written last. An
existing output directory is written into only when it holds a dataset of this program and
``overwrite`` is set (``dlrm.engine.outputs``: a folder holding anything else, a link, the
working directory or one of the inputs is refused).
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

from dlrm.data.batch import Batch
from dlrm.data.feature_spec import SPEC_FILE_NAME, FeatureSpec, dtype_for_cardinality
from dlrm.data.numerical_rounding import DEFAULT_ROUNDING, check_rounding, to_float16
from dlrm.data.split_binary_writer import SPLIT_BINARY_DATASET, SplitBinaryWriter
from dlrm.engine.storage import check_can_create, writing
from dlrm.engine.errors import DatasetError
from dlrm.engine.outputs import claim_output
from dlrm.engine.text_lines import MAX_LINE_BYTES, bounded_lines

_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


LABEL, NUMERICAL, CATEGORICAL = "label", "numerical", "categorical"


@dataclass
class _Chunk:
    """Parsed rows of one file, by kind, each in the file's column order."""

    label: np.ndarray | None  # [n] bool, None when the file has no label column
    numerical: np.ndarray  # [n, numerical columns] float16
    categorical: np.ndarray  # [n, categorical columns] int64

    def __len__(self) -> int:
        return self.numerical.shape[0]

    def rows(self, start: int, stop: int) -> "_Chunk":
        label = None if self.label is None else self.label[start:stop]
        return _Chunk(label, self.numerical[start:stop], self.categorical[start:stop])


@dataclass
class _Layout:
    """How to parse one line of a file: the kind and name of each column, the numpy record type.

    ``names[k]`` is how messages call column k (``numerical feature 0``, ``feature 'num_0'``);
    ``cardinalities`` holds one bound (or None) per categorical column. With
    ``integral_floats``, categorical ids may be written as integral floats (``5.0``), as
    pandas writes a column of ids that shares a file with floats. ``rounding`` turns the
    numericals into float16 (``dlrm.data.numerical_rounding``)."""

    path: str
    delimiter: str
    kinds: list[str]
    names: list[str]
    cardinalities: np.ndarray | None  # int64 per categorical column; -1 for none
    shape: str  # what a line holds, for the field-count message
    raise_fix: str = "raise its value in `cardinalities` or leave cardinalities out to compute them from the data"
    integral_floats: bool = False
    rounding: str = DEFAULT_ROUNDING  # float64 -> float16 of the numericals (dlrm.data.numerical_rounding)

    def __post_init__(self) -> None:
        self.width = len(self.kinds)
        self.dtype = self._record(np.int64)

    def _record(self, categorical_type) -> np.dtype:
        return np.dtype([(f"c{k}", categorical_type if kind == CATEGORICAL else np.float64)
                         for k, kind in enumerate(self.kinds)])

    def columns(self, kind: str) -> list[int]:
        return [k for k, c in enumerate(self.kinds) if c == kind]

    def field_name(self, k: int) -> str:
        return self.names[k]

    def where(self, line_no: int) -> str:
        return f"{self.path}, line {line_no}"


def _text_layout(path: str, delimiter: str, num_numerical: int, num_categorical: int,
                 cardinalities: np.ndarray | None, rounding: str) -> _Layout:
    """The layout of ``transcode``'s text files: label, numerical, categorical fields."""
    kinds = [LABEL] + [NUMERICAL] * num_numerical + [CATEGORICAL] * num_categorical
    names = ["label"] + [f"numerical feature {i}" for i in range(num_numerical)] + [
        f"categorical feature {j}" for j in range(num_categorical)]
    shape = f"label, {num_numerical} numerical, {num_categorical} categorical); check `delimiter` and the feature counts"
    return _Layout(path, delimiter, kinds, names, cardinalities, f"({shape}", rounding=rounding)


def _fill_empty(text: str, sep: str) -> str:
    """Write 0 into empty fields with plain string replaces (several times faster than a regex)."""
    text = f"\n{text}\n"
    pair = sep + sep
    if pair in text:
        # Non-overlapping replace fills every other gap in a run of separators; twice fills all.
        text = text.replace(pair, f"{sep}0{sep}").replace(pair, f"{sep}0{sep}")
    text = text.replace(f"\n{sep}", f"\n0{sep}").replace(f"{sep}\n", f"{sep}0\n")
    return text[1:-1]


def _load(lines: list[str], layout: _Layout, dtype: np.dtype | None = None) -> np.ndarray:
    return np.loadtxt(
        io.StringIO("\n".join(lines)),
        dtype=layout.dtype if dtype is None else dtype,
        delimiter=layout.delimiter,
        comments=None,
        quotechar=None,
        ndmin=1,
    )


def _load_integral_floats(lines: list[str], numbers: list[int], layout: _Layout) -> np.ndarray:
    """Rows whose ids are written as integral floats (``5.0``): parsed as float64, checked to be
    whole numbers that float64 holds exactly, then turned into the int64 record."""
    rec = _load(lines, layout, layout._record(np.float64))
    out = np.empty(rec.shape[0], dtype=layout.dtype)
    for k, kind in enumerate(layout.kinds):
        column = rec[f"c{k}"]
        if kind == CATEGORICAL:
            bad = (column != np.floor(column)) | (np.abs(column) > 2**53)
            if bad.any():
                i = int(np.argmax(bad))
                value = lines[i].split(layout.delimiter)[k]
                raise DatasetError(
                    f"{layout.where(numbers[i])}: field {k + 1} ({layout.field_name(k)}) is {value!r}, expected "
                    f"a non-negative integer id; fix or drop the line"
                )
            column = column.astype(np.int64)
        out[f"c{k}"] = column
    return out


def _locate_parse_error(lines: list[str], numbers: list[int], layout: _Layout, cause: Exception) -> DatasetError:
    """Find the first line numpy rejects (halving, so about one extra parse of the chunk)."""
    lo, hi = 0, len(lines)  # invariant: lines[lo:hi] fails to parse
    dtype = layout._record(np.float64) if layout.integral_floats else None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            _load(lines[lo:mid], layout, dtype)
            lo = mid
        except (ValueError, OverflowError):
            hi = mid
    fields = lines[lo].split(layout.delimiter)
    for k, value in enumerate(fields):
        integer = layout.kinds[k] == CATEGORICAL and not layout.integral_floats
        try:
            np.loadtxt(io.StringIO(value), dtype=np.int64 if integer else np.float64, comments=None, quotechar=None,
                       ndmin=1)
        except (ValueError, OverflowError):
            expected = "a non-negative integer id" if layout.kinds[k] == CATEGORICAL else "a number"
            return DatasetError(
                f"{layout.where(numbers[lo])}: field {k + 1} ({layout.field_name(k)}) is {value!r}, expected "
                f"{expected}; fix or drop the line"
            )
    return DatasetError(f"{layout.where(numbers[lo])}: cannot parse the line ({cause}); fix or drop the line")


def _check(rec: np.ndarray, numbers: np.ndarray, layout: _Layout) -> _Chunk:
    """Value checks, vectorised; the first offending line is named."""
    n = rec.shape[0]
    label = None
    for k in layout.columns(LABEL):
        label = rec[f"c{k}"]
        bad = (label != 0) & (label != 1)
        if bad.any():
            i = int(np.argmax(bad))
            raise DatasetError(f"{layout.where(int(numbers[i]))}: {layout.names[k]} is {float(label[i])!r}, "
                               f"expected 0 or 1")
        label = label.astype(np.bool_)

    columns = layout.columns(NUMERICAL)
    numerical = np.zeros((n, len(columns)), np.float16)
    for j, k in enumerate(columns):
        with np.errstate(over="ignore", invalid="ignore"):
            numerical[:, j] = to_float16(rec[f"c{k}"], layout.rounding)
        bad = ~np.isfinite(numerical[:, j])
        if bad.any():
            i = int(np.argmax(bad))
            raise DatasetError(
                f"{layout.where(int(numbers[i]))}: {layout.names[k]} is {float(rec[f'c{k}'][i])!r}, which is not "
                f"finite in float16 (max 65504); log-transform numerical features before transcoding"
            )

    columns = layout.columns(CATEGORICAL)
    categorical = np.zeros((n, len(columns)), np.int64)
    for j, k in enumerate(columns):
        categorical[:, j] = rec[f"c{k}"]
    if columns and n:
        bad = categorical < 0
        if layout.cardinalities is not None:
            bad |= (categorical >= layout.cardinalities) & (layout.cardinalities >= 0)
        if bad.any():
            i, j = (int(x[0]) for x in np.nonzero(bad))
            value, name = int(categorical[i, j]), layout.names[columns[j]]
            if value < 0:
                raise DatasetError(
                    f"{layout.where(int(numbers[i]))}: {name} is {value}; ids must be "
                    f"non-negative integers (0 is the missing/rare bucket)"
                )
            raise DatasetError(
                f"{layout.where(int(numbers[i]))}: {name} is {value}, outside "
                f"[0, {int(layout.cardinalities[j])}); {layout.raise_fix}"
            )
    return _Chunk(label=label, numerical=numerical, categorical=categorical)


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
        lines_of_f = bounded_lines(f, layout.path, MAX_LINE_BYTES)  # a line of numbers is under 1 KB
        while True:
            try:
                block = list(itertools.islice(lines_of_f, chunk_rows))
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
                    raise DatasetError(f"{layout.where(line_no)}: {count} fields, expected {layout.width} {layout.shape}")
                lines.append(line)
                numbers.append(line_no)
            if not lines:
                continue
            lines = _fill_empty("\n".join(lines), sep).split("\n")
            try:
                rec = _load(lines, layout)
            except (ValueError, OverflowError) as e:
                rec = None
                if layout.integral_floats:
                    try:
                        rec = _load_integral_floats(lines, numbers, layout)
                    except DatasetError:
                        raise  # an id that is not a whole number, named
                    except (ValueError, OverflowError):
                        pass
                if rec is None:
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
    spec_name: str = SPEC_FILE_NAME,
    overwrite: bool = False,
    numerical_rounding: str = DEFAULT_ROUNDING,
) -> FeatureSpec:
    """Convert delimited text files (one per split) into a split-binary dataset in ``output_dir``.

    Each line: label (0/1), ``num_numerical`` numbers, ``num_categorical`` non-negative integer
    ids; empty fields mean 0. Returns the spec that was written to ``output_dir/spec_name``.
    ``overwrite``: write over a dataset this program wrote there before (module docstring).
    ``numerical_rounding``: float64 -> float16 of the numericals, ``nvidia`` (through float32, as
    NVIDIA's tools) or ``direct`` (``dlrm.data.numerical_rounding``).
    """
    _check_text_settings(inputs, num_numerical, num_categorical, delimiter, chunk_rows)
    check_rounding(numerical_rounding)
    _check_spec_name(spec_name)
    claim_output(output_dir, SPLIT_BINARY_DATASET, "output_dir", inputs={"inputs": list(inputs.values())},
                 replace=overwrite)
    check_can_create(output_dir, "the dataset", inside=True)  # a read-only file system fails before any reading

    def layout(path: str, cards: np.ndarray | None) -> _Layout:
        return _text_layout(os.fspath(path), delimiter, num_numerical, num_categorical, cards, numerical_rounding)

    if cardinalities is None:
        cards = _text_cardinalities([layout(path, None) for path in inputs.values()], num_categorical, chunk_rows)
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
    spec = FeatureSpec.default(num_numerical, cards, splits=tuple(inputs), base_directory=os.path.abspath(output_dir))
    card_array = np.asarray(cards, dtype=np.int64)
    with writing(output_dir, "the dataset", cleanup=lambda: _remove_dirs(created)):  # a full disk: a StorageError
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
            _remove_old_spec(output_dir, spec_name)
    spec.to_yaml(os.path.join(output_dir, spec_name))
    return spec


def _check_text_settings(inputs: dict[str, str], num_numerical: int, num_categorical: int, delimiter: str,
                         chunk_rows: int) -> None:
    """``transcode``'s settings that need no file: split names, counts, the delimiter, the chunk."""
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


def _text_cardinalities(layouts: list[_Layout], num_categorical: int, chunk_rows: int) -> list[int]:
    """Max id + 1 of each categorical feature over every file (1 for a feature with no rows): a
    first pass over the files, for ``transcode`` without ``cardinalities``."""
    max_ids = np.full(num_categorical, -1, dtype=np.int64)
    for layout in layouts:
        for chunk in _read_chunks(layout, chunk_rows):
            if len(chunk.label) and num_categorical:
                np.maximum(max_ids, chunk.categorical.max(axis=0), out=max_ids)
    return [int(m) + 1 if m >= 0 else 1 for m in max_ids]


def _remove_dirs(created: list[str]) -> None:
    """After a failed write: the directories this call made, deepest first, each only if still empty."""
    for d in created:
        with contextlib.suppress(OSError):
            os.rmdir(d)


def _remove_old_spec(output_dir: str, spec_name: str) -> None:
    """Before the new files replace an earlier dataset's: its spec goes first, so a crash while
    they are renamed leaves no spec rather than one that describes other files."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(output_dir, spec_name))


def _check_spec_name(name: str) -> None:
    if os.sep in name or name in ("", ".", ".."):
        raise ValueError(f"the feature spec's name {name!r} must be a file name (it is written in the output directory)")


def _missing_dirs(output_dir: str, splits: tuple[str, ...]) -> list[str]:
    """The directories writing ``splits`` under ``output_dir`` would create, deepest first."""
    missing = [os.path.join(output_dir, s) for s in splits if not os.path.exists(os.path.join(output_dir, s))]
    d = os.path.abspath(output_dir)
    while not os.path.exists(d):
        missing.append(d)
        d = os.path.dirname(d)
    return missing


# ---------------------------------------------------------------------------- NVIDIA's CSV layout


def _csv_layout(source, chunk, cardinalities: dict[str, int | None], rounding: str) -> _Layout:
    kinds = [source.kind(name) for name in chunk.features]
    names = [f"{'label' if kind == LABEL else 'feature'} '{name}'" for name, kind in zip(chunk.features, kinds)]
    bounds = [cardinalities.get(name) for name, kind in zip(chunk.features, kinds) if kind == CATEGORICAL]
    cards = np.array([-1 if b is None else b for b in bounds], dtype=np.int64)
    shape = f"(the chunk's features {chunk.features}); fields are comma-separated"
    return _Layout(chunk.path, ",", kinds, names, cards, shape,
                   raise_fix="raise its cardinality in the feature spec or set it to auto", integral_floats=True,
                   rounding=rounding)


def _aligned(split: str, chunks, readers) -> Iterator[list[_Chunk]]:
    """Blocks of the same rows from every file of a split (files may hold blank lines elsewhere,
    so blocks are re-cut to the shortest); a file that ends before the others is an error."""
    pending: list[_Chunk | None] = [None] * len(readers)
    ended = [False] * len(readers)
    done = 0
    while True:
        for i, reader in enumerate(readers):
            while not ended[i] and (pending[i] is None or len(pending[i]) == 0):
                block = next(reader, None)
                if block is None:
                    ended[i] = True
                else:
                    pending[i] = block
        sizes = [0 if p is None else len(p) for p in pending]
        if not any(sizes):
            return
        if not all(sizes):
            short = chunks[sizes.index(0)].path
            longer = chunks[next(i for i, n in enumerate(sizes) if n)].path
            raise DatasetError(f"split '{split}': {short} ends after {done} rows but {longer} has more; every file of "
                               f"a split holds one line per sample")
        n = min(sizes)
        yield [p.rows(0, n) for p in pending]
        pending = [p.rows(n, len(p)) for p in pending]
        done += n


def _csv_cardinalities(source, chunk_rows: int, rounding: str) -> dict[str, int]:
    """Each categorical feature's cardinality: the spec's, or for ``auto`` max id + 1 over all
    splits (a first pass over the files that hold them); each checked to fit an id dtype."""
    names = source.categorical_names
    cards: dict[str, int | None] = {n: source.cardinality(n) for n in names}
    auto = [n for n in names if cards[n] is None]
    if auto:
        found = {n: 0 for n in auto}
        for split in source.splits:
            for chunk in source.chunks(split):
                mine = [n for n in chunk.features if n in found]
                if not mine:
                    continue
                layout = _csv_layout(source, chunk, {}, rounding)
                columns = [n for n in chunk.features if source.kind(n) == CATEGORICAL]
                for block in _read_chunks(layout, chunk_rows):
                    if len(block):
                        for n in mine:
                            found[n] = max(found[n], int(block.categorical[:, columns.index(n)].max()) + 1)
        cards.update({n: max(found[n], 1) for n in auto})
    for n in names:
        try:
            dtype_for_cardinality(cards[n])
        except ValueError as e:
            raise DatasetError(f"categorical feature '{n}': {e}") from None
    return cards


def _csv_dataset_spec(source, cards: dict[str, int], output_dir: str, rounding: str) -> FeatureSpec:
    """The written dataset's spec: NVIDIA's default names, and in its metadata the source spec,
    which source feature each default name holds, and the rounding."""
    names = source.categorical_names
    spec = FeatureSpec.default(len(source.numerical_names), [cards[n] for n in names], splits=tuple(source.splits),
                               base_directory=os.path.abspath(output_dir))
    spec.metadata = {"transcoded_from": {
        "feature_spec": source.path,
        "features": dict(zip(spec.numerical_names + spec.categorical_names + [spec.label_name],
                             source.numerical_names + names + [source.label_name])),
        "numerical_rounding": rounding,
    }}
    return spec


def _csv_batches(source, split: str, chunks, cards: dict[str, int], chunk_rows: int, rounding: str) -> Iterator[Batch]:
    """A split's rows as batches in the spec's channel order, gathered from the split's files
    (each holds some of the features) block by aligned block."""
    # Where each feature is: (file index, column among that file's columns of its kind).
    where = {}
    for i, chunk in enumerate(chunks):
        for kind in (LABEL, NUMERICAL, CATEGORICAL):
            of_kind = [n for n in chunk.features if source.kind(n) == kind]
            where.update({n: (i, k) for k, n in enumerate(of_kind)})
    names = source.categorical_names
    readers = [_read_chunks(_csv_layout(source, c, cards, rounding), chunk_rows) for c in chunks]
    for blocks in _aligned(split, chunks, readers):
        n = len(blocks[0])
        numerical = np.empty((n, len(source.numerical_names)), np.float16)
        for j, name in enumerate(source.numerical_names):
            i, k = where[name]
            numerical[:, j] = blocks[i].numerical[:, k]
        categorical = np.empty((n, len(names)), np.int64)
        for j, name in enumerate(names):
            i, k = where[name]
            categorical[:, j] = blocks[i].categorical[:, k]
        label = blocks[where[source.label_name][0]].label
        yield Batch(numerical=torch.from_numpy(numerical), categorical=torch.from_numpy(categorical),
                    label=torch.from_numpy(label))


def transcode_csv_source(spec_path: str, output_dir: str, spec_out_name: str = SPEC_FILE_NAME,
                         chunk_rows: int = 1_000_000, overwrite: bool = False,
                         numerical_rounding: str = DEFAULT_ROUNDING) -> FeatureSpec:
    """NVIDIA's transcode: the CSV files a CSV source spec (``csv_source``) describes -> a
    split-binary dataset in ``output_dir`` with NVIDIA's default feature names (``num_<i>`` and
    ``cat_<i>.bin`` in channel order, ``label``), one directory per split of the source spec,
    and the spec as ``output_dir/spec_out_name``. Cardinalities ``auto`` become max id + 1 over
    all splits (a first pass over the files that hold them); given ones bound the ids. Ids may
    be written as integral floats (``5.0``). Nothing replaces an existing dataset unless every
    split converts cleanly; the spec is written last. ``overwrite``: write over a dataset this
    program wrote there before (module docstring); the output never holds the spec or its files.
    ``numerical_rounding`` as in ``transcode``: the default, ``nvidia``, writes NVIDIA's bytes."""
    from dlrm.data.csv_source import CsvSource, source_files

    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    check_rounding(numerical_rounding)
    _check_spec_name(spec_out_name)
    source = CsvSource.from_yaml(spec_path)
    for split in source.splits:
        if not _SPLIT_NAME.match(split):
            raise DatasetError(f"{source.path}: split name {split!r} must be a plain directory name (letters, digits, _ . -)")
    claim_output(output_dir, SPLIT_BINARY_DATASET, "output_dir", inputs={"spec_path": source_files(source)},
                 replace=overwrite)
    check_can_create(output_dir, "the dataset", inside=True)
    cards = _csv_cardinalities(source, chunk_rows, numerical_rounding)
    created = _missing_dirs(output_dir, tuple(source.splits))
    spec = _csv_dataset_spec(source, cards, output_dir, numerical_rounding)
    with writing(output_dir, "the dataset", cleanup=lambda: _remove_dirs(created)):
        os.makedirs(output_dir, exist_ok=True)
        with contextlib.ExitStack() as writers:  # all splits commit together, or none does
            for split in source.splits:
                chunks = source.chunks(split)
                writer = writers.enter_context(SplitBinaryWriter(spec, split))
                for batch in _csv_batches(source, split, chunks, cards, chunk_rows, numerical_rounding):
                    writer.write(batch)
                if writer.num_rows == 0:
                    raise DatasetError(f"split '{split}': {chunks[0].path} holds no data lines; each split needs at "
                                       f"least one row")
            _remove_old_spec(output_dir, spec_out_name)
        spec.to_yaml(os.path.join(output_dir, spec_out_name))
    return spec
