"""NVIDIA's CSV source spec: a ``feature_spec.yaml`` whose chunks are CSV files.

It is the input of ``python -m dlrm.scripts.transcode --input DIR`` and what
``python -m dlrm.scripts.gen_csv`` fills with random rows (NVIDIA's ``tests/transcoding``
layout). The keys are those of a dataset's spec (``feature_spec``, ``channel_spec``,
``source_spec``, ``metadata``) with these differences:

- a chunk has ``type: csv`` and one file, and may hold several features of any channel, one
  column each in the chunk's order (no header; comma-separated);
- every split lists each feature of the channels exactly once, over its chunks, and all files
  of a split hold one line per sample, in the same order;
- a categorical feature's ``cardinality`` is an integer (ids must be below it) or ``auto``
  (max id + 1 over all splits; also when it is left out); ``dtype`` is not needed.
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import dataclass

import numpy as np

from dlrm.data.feature_spec import (CATEGORICAL, CHANNELS, LABEL, NUMERICAL, SPEC_FILE_NAME, dataset_file,
                                    read_spec_yaml)
from dlrm.engine.atomic import write_atomically
from dlrm.engine.errors import DatasetError, FeatureSpecError
from dlrm.engine.outputs import OutputError, OutputKind, head_lines, holds_only, inside

CSV = "csv"
AUTO = "auto"


@dataclass
class CsvChunk:
    path: str  # absolute
    file: str  # as the spec writes it
    features: list[str]


@dataclass
class CsvSource:
    """A validated CSV source spec; file paths resolve against ``base_directory``."""

    raw: dict
    path: str
    base_directory: str
    # Reading: files must lie inside the spec's folder unless allowed (``feature_spec.dataset_file``).
    # None: a writer's base directory (gen_csv), where ``csv_targets`` applies the writers' rule.
    allow_files_outside: bool | None = False

    @classmethod
    def from_yaml(cls, path: str, base_directory: str | None = None,
                  allow_files_outside: bool = False) -> "CsvSource":
        """Load and check ``path``; its files resolve against its directory (NVIDIA's rule) and
        must lie inside it unless ``allow_files_outside``, or against ``base_directory`` when
        given (gen_csv writes them under its --output; ``csv_targets`` checks them)."""
        path = os.path.abspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, SPEC_FILE_NAME)
        try:
            raw = read_spec_yaml(path)
        except FileNotFoundError:
            raise DatasetError(f"{path}: feature spec not found; give the CSV files' feature spec "
                               f"(NVIDIA's tests/transcoding/small_csv.yaml shows the layout)") from None
        except IsADirectoryError:
            raise DatasetError(f"{path}: is a directory, not a feature spec file") from None
        except UnicodeDecodeError:
            raise FeatureSpecError(f"{path}: not UTF-8 text; a feature spec is a YAML text file") from None
        except OSError as e:
            raise DatasetError(f"{path}: cannot read the feature spec: {e.strerror or e}") from None
        source = cls(raw, path, os.path.abspath(base_directory or os.path.dirname(path)),
                     None if base_directory is not None else bool(allow_files_outside))
        try:
            source._validate()
        except FeatureSpecError as e:
            raise FeatureSpecError(f"{path}: {e}") from None
        return source

    # ------------------------------------------------------------------ checks

    def _validate(self) -> None:
        raw = self.raw
        if not isinstance(raw, dict):
            raise FeatureSpecError(f"expected a mapping with keys feature_spec, channel_spec, source_spec, got "
                                   f"{type(raw).__name__}")
        missing = [k for k in ("feature_spec", "channel_spec", "source_spec") if not isinstance(raw.get(k), dict)]
        if missing:
            raise FeatureSpecError(f"missing or not a mapping: {missing}; a feature spec needs feature_spec, "
                                   f"channel_spec and source_spec")
        channels = raw["channel_spec"]
        if sorted(channels) != sorted(CHANNELS):
            raise FeatureSpecError(f"channel_spec has channels {sorted(channels)}; it needs exactly {list(CHANNELS)}")
        for channel in CHANNELS:
            names = channels[channel] or []
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise FeatureSpecError(f"channel_spec.{channel} must be a list of feature names, got {names!r}")
        if len(channels[LABEL] or []) != 1:
            raise FeatureSpecError(f"channel_spec.label must name exactly one feature, got {channels[LABEL]!r}")
        names = self.label_names + self.numerical_names + self.categorical_names
        for name in names:
            if names.count(name) > 1:
                raise FeatureSpecError(f"feature '{name}' appears more than once in channel_spec")
            if name not in raw["feature_spec"] or not isinstance(raw["feature_spec"][name] or {}, dict):
                raise FeatureSpecError(f"feature '{name}' is in channel_spec but has no mapping in feature_spec; "
                                       f"add `{name}: {{}}`")
        for name in self.categorical_names:
            card = (raw["feature_spec"][name] or {}).get("cardinality", AUTO)
            if card != AUTO and (isinstance(card, bool) or not isinstance(card, int) or card < 1):
                raise FeatureSpecError(f"categorical feature '{name}': cardinality must be an integer >= 1 (max id "
                                       f"+ 1) or '{AUTO}', got {card!r}")
        if not raw["source_spec"]:
            raise FeatureSpecError("source_spec names no split; add e.g. 'train' and 'test' with their CSV files")
        for split in raw["source_spec"]:
            self.chunks(split)

    def chunks(self, split: str) -> list[CsvChunk]:
        """The CSV files of a split, checked: csv chunks of one file, every feature once."""
        raw_chunks = self.raw["source_spec"].get(split)
        where = f"source_spec.{split}"
        if not isinstance(raw_chunks, list) or not raw_chunks:
            raise FeatureSpecError(f"{where} must be a non-empty list of chunks, got {raw_chunks!r}")
        known = set(self.label_names + self.numerical_names + self.categorical_names)
        seen: dict[str, int] = {}
        out = []
        for i, chunk in enumerate(raw_chunks):
            at = f"{where}[{i}]"
            if not isinstance(chunk, dict):
                raise FeatureSpecError(f"{at} must be a mapping with type, features, files; got {chunk!r}")
            if chunk.get("type") != CSV:
                hint = (": the data is a split-binary dataset already; train on its directory directly"
                        if chunk.get("type") == "split_binary" else "")
                raise FeatureSpecError(f"{at}: chunk type {chunk.get('type')!r}; a CSV feature spec has '{CSV}' "
                                       f"chunks{hint}")
            feats, files = chunk.get("features"), chunk.get("files")
            if not isinstance(feats, list) or not feats or not all(isinstance(f, str) for f in feats):
                raise FeatureSpecError(f"{at}: 'features' must be a non-empty list of names, got {feats!r}")
            if not isinstance(files, list) or len(files) != 1 or not isinstance(files[0], str):
                raise FeatureSpecError(f"{at}: 'files' must list exactly one CSV file, got {files!r}")
            for name in feats:
                if name not in known:
                    raise FeatureSpecError(f"{at}: feature '{name}' is in no channel of channel_spec")
                if name in seen:
                    raise FeatureSpecError(f"{at}: feature '{name}' is also in {where}[{seen[name]}]; each feature "
                                           f"has one column per split")
                seen[name] = i
            path = os.path.join(self.base_directory, files[0])
            if self.allow_files_outside is not None:  # read here: inside the folder, or allowed
                path = dataset_file(self.base_directory, files[0], self.path, feats[0], self.allow_files_outside,
                                    "`allow_files_outside=True` (CsvSource.from_yaml)")[0]
            out.append(CsvChunk(path, files[0], list(feats)))
        absent = [n for n in self.label_names + self.numerical_names + self.categorical_names if n not in seen]
        if absent:
            raise FeatureSpecError(f"split '{split}' has no column for feature(s) {absent}; add them to a chunk of {where}")
        return out

    # ------------------------------------------------------------------ accessors

    @property
    def label_names(self) -> list[str]:
        return list(self.raw["channel_spec"][LABEL] or [])

    @property
    def label_name(self) -> str:
        return self.label_names[0]

    @property
    def numerical_names(self) -> list[str]:
        return list(self.raw["channel_spec"][NUMERICAL] or [])

    @property
    def categorical_names(self) -> list[str]:
        return list(self.raw["channel_spec"][CATEGORICAL] or [])

    @property
    def splits(self) -> list[str]:
        return list(self.raw["source_spec"])

    def cardinality(self, name: str) -> int | None:
        """The declared cardinality of a categorical feature; None for ``auto``."""
        card = (self.raw["feature_spec"][name] or {}).get("cardinality", AUTO)
        return None if card == AUTO else int(card)

    def kind(self, name: str) -> str:
        if name in self.label_names:
            return LABEL
        return NUMERICAL if name in self.numerical_names else CATEGORICAL


def source_files(source: CsvSource) -> list[str]:
    """What a reader of ``source`` reads: its spec and every CSV file it names."""
    return [source.path] + [chunk.path for split in source.splits for chunk in source.chunks(split)]


# ---------------------------------------------------------------------------- writing (gen_csv)

_NUMBERS_LINE = re.compile(rb"[-+0-9.eE]+(?:,[-+0-9.eE]+)*")  # what write_random_csv writes per line


def is_random_csv(path: str) -> bool:
    """Whether file ``path`` reads as ``write_random_csv`` writes: lines of comma-separated
    numbers and nothing else (its first MiB, whole lines; an empty file too)."""
    lines = head_lines(path)
    return lines is not None and all(_NUMBERS_LINE.fullmatch(line) for line in lines)


def _is_csv_source_spec(path: str) -> bool:
    try:
        CsvSource.from_yaml(path)
    except DatasetError:
        return False
    return True


def is_random_csv_dir(path: str) -> bool:
    """Whether directory ``path`` holds what ``python -m dlrm.scripts.gen_csv`` writes and nothing
    else: a CSV source spec as ``feature_spec.yaml``, and CSV files of numbers (those the spec
    names, and ``*.csv`` ones an earlier spec named). Folders in it that hold a split-binary
    dataset count too: NVIDIA's commands transcode ``/data`` into ``/data/converted``, and gen_csv
    leaves them alone."""
    from dlrm.data.split_binary_writer import is_split_binary_dataset

    spec = os.path.join(path, SPEC_FILE_NAME)
    try:
        source = CsvSource.from_yaml(spec, base_directory=path)
    except DatasetError:
        return False
    named = [os.path.relpath(c.path, source.base_directory).replace(os.sep, "/")
             for split in source.splits for c in source.chunks(split)]
    datasets = [name for name in os.listdir(path) if os.path.isdir(os.path.join(path, name))
                and not os.path.islink(os.path.join(path, name)) and is_split_binary_dataset(os.path.join(path, name))]
    patterns = [SPEC_FILE_NAME, "*.csv"] + [glob.escape(f) for f in named] + [glob.escape(d) + "/**" for d in datasets]
    if not holds_only(path, patterns, required=[SPEC_FILE_NAME]):
        return False
    for directory, dirs, files in os.walk(path):
        if directory == path:
            dirs[:] = [d for d in dirs if d not in datasets]
        if not all(is_random_csv(os.path.join(directory, f)) for f in files
                   if os.path.join(directory, f) != spec and not f.endswith(".tmp")):
            return False
    return True


RANDOM_CSV = OutputKind("CSV dataset", directory=True, recognise=is_random_csv_dir)


def csv_targets(source: CsvSource, overwrite: bool = False) -> list[tuple[str, CsvChunk]]:
    """(split, chunk) of every CSV file ``write_random_csv`` would write, each checked first: its
    path stays inside the base directory (an absolute path, or one that climbs out with ``..``
    or through a link, is an ``OutputError``: reading follows such paths, writing never does),
    no file is named twice, and an existing file is replaced only with ``overwrite`` and only
    when it is a CSV file of numbers, as this writer writes (anything else never)."""
    targets, seen = [], {}
    for split in source.splits:
        for i, chunk in enumerate(source.chunks(split)):
            where = f"{source.path}: source_spec.{split}[{i}] file"
            path = inside(source.base_directory, chunk.file, where)
            key = os.path.normpath(path)
            if key in seen:
                raise OutputError(f"{where} {chunk.file!r} is also the file of {seen[key]}: each chunk needs its own "
                                  f"file; nothing was changed")
            seen[key] = f"source_spec.{split}[{i}]"
            if os.path.lexists(path):
                if os.path.islink(path) or not os.path.isfile(path):
                    raise OutputError(f"{path} ({where}) exists and is not an ordinary file: it is never replaced; "
                                      f"remove it yourself or write elsewhere; nothing was changed")
                if not is_random_csv(path):
                    raise OutputError(f"{path} ({where}) exists and is not a CSV file of numbers written by this "
                                      f"program: it is never replaced; remove it yourself or write elsewhere; "
                                      f"nothing was changed")
                if not overwrite:
                    raise OutputError(f"{path} ({where}) exists; pass `overwrite` to replace it, or write elsewhere; "
                                      f"nothing was changed")
            targets.append((split, CsvChunk(path, chunk.file, chunk.features)))
    return targets


def write_random_csv(source: CsvSource, rows: int, seed: int = 0, overwrite: bool = False) -> list[str]:
    """Fill every CSV file of ``source`` (under its base directory) with ``rows`` random lines:
    labels 0 or 1, numericals uniform in [0, 1), ids uniform in [0, cardinality); what NVIDIA's
    ``gen_csv`` writes, for trying transcode. Every categorical feature needs an integer
    cardinality. Every file is checked before any is written (``csv_targets``: inside the base
    directory; an existing one only with ``overwrite``, and only a CSV file this writer wrote)
    and written atomically. Returns the files written."""
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    auto = [n for n in source.categorical_names if source.cardinality(n) is None]
    if auto:
        raise FeatureSpecError(f"{source.path}: categorical feature '{auto[0]}' has cardinality '{AUTO}'; random ids "
                               f"need a bound: give it an integer cardinality")
    chunks = csv_targets(source, overwrite)
    rng = np.random.default_rng(seed)
    written = []
    block = 65536

    def write(chunk: CsvChunk, tmp: str) -> None:
        with open(tmp, "w", encoding="ascii") as f:
            for start in range(0, rows, block):
                n = min(block, rows - start)
                columns = []
                for name in chunk.features:
                    kind = source.kind(name)
                    if kind == LABEL:
                        columns.append([str(v) for v in rng.integers(0, 2, n).tolist()])
                    elif kind == NUMERICAL:
                        columns.append([repr(v) for v in rng.random(n).tolist()])
                    else:
                        columns.append([str(v) for v in rng.integers(0, source.cardinality(name), n).tolist()])
                f.write("".join(",".join(fields) + "\n" for fields in zip(*columns)))

    for _, chunk in chunks:
        write_atomically(chunk.path, lambda tmp, chunk=chunk: write(chunk, tmp), "the CSV file")
        written.append(chunk.path)
    return written
