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

import os
from dataclasses import dataclass

import numpy as np
import yaml

from dlrm.data.errors import DatasetError, FeatureSpecError
from dlrm.data.feature_spec import CATEGORICAL, CHANNELS, LABEL, NUMERICAL, SPEC_FILE_NAME, read_spec_yaml

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

    @classmethod
    def from_yaml(cls, path: str, base_directory: str | None = None) -> "CsvSource":
        """Load and check ``path``; its files resolve against its directory (NVIDIA's rule), or
        against ``base_directory`` when given (gen_csv writes them under its --output)."""
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
        except yaml.YAMLError as e:
            raise FeatureSpecError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
        except OSError as e:
            raise DatasetError(f"{path}: cannot read the feature spec: {e.strerror or e}") from None
        source = cls(raw, path, os.path.abspath(base_directory or os.path.dirname(path)))
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
            out.append(CsvChunk(os.path.join(self.base_directory, files[0]), files[0], list(feats)))
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


def write_random_csv(source: CsvSource, rows: int, seed: int = 0, overwrite: bool = False) -> list[str]:
    """Fill every CSV file of ``source`` (under its base directory) with ``rows`` random lines:
    labels 0 or 1, numericals uniform in [0, 1), ids uniform in [0, cardinality); what NVIDIA's
    ``gen_csv`` writes, for trying transcode. Every categorical feature needs an integer
    cardinality. Existing files are refused unless ``overwrite``. Returns the files written."""
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    auto = [n for n in source.categorical_names if source.cardinality(n) is None]
    if auto:
        raise FeatureSpecError(f"{source.path}: categorical feature '{auto[0]}' has cardinality '{AUTO}'; random ids "
                               f"need a bound: give it an integer cardinality")
    chunks = [(split, chunk) for split in source.splits for chunk in source.chunks(split)]
    if not overwrite:
        for _, chunk in chunks:
            if os.path.exists(chunk.path):
                raise FileExistsError(f"{chunk.path} exists; remove it, write elsewhere, or pass overwrite")
    rng = np.random.default_rng(seed)
    written = []
    block = 65536
    for split, chunk in chunks:
        os.makedirs(os.path.dirname(chunk.path), exist_ok=True)
        with open(chunk.path, "w", encoding="ascii") as f:
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
        written.append(chunk.path)
    return written
