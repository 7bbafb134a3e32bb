"""The feature spec: which features a dataset has, their dtypes, and which file holds each.

The on-disk form is NVIDIA's ``feature_spec.yaml`` (top-level keys ``feature_spec``,
``channel_spec``, ``source_spec``, ``metadata``), so datasets prepared by their pipeline load
unchanged. Only the ``split_binary`` source type exists: one file per categorical feature, one
file for all numerical features (float16, in channel order), one file for the label (bool).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import yaml

from dlrm.data.atomic import write_text_atomically
from dlrm.data.errors import DatasetError, FeatureSpecError

SPEC_FILE_NAME = "feature_spec.yaml"
SPLIT_BINARY = "split_binary"
CATEGORICAL = "categorical"
NUMERICAL = "numerical"
LABEL = "label"
CHANNELS = (CATEGORICAL, NUMERICAL, LABEL)
TOP_LEVEL_KEYS = ("feature_spec", "channel_spec", "source_spec", "metadata")
CATEGORICAL_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64))


def dtype_for_cardinality(cardinality: int) -> np.dtype:
    """The smallest signed integer dtype that holds every id in [0, cardinality).

    Narrow id files cut disk reads and host-to-device copies; the model widens on the device.
    """
    cardinality = int(cardinality)
    if cardinality < 1:
        raise ValueError(f"cardinality must be at least 1, got {cardinality}")
    for dtype in CATEGORICAL_DTYPES:
        if cardinality - 1 <= np.iinfo(dtype).max:
            return dtype
    raise ValueError(f"cardinality {cardinality} does not fit in int64 (max id {np.iinfo(np.int64).max})")


def _first_bad_byte(path: str) -> str:
    """Where a file stops being UTF-8, for the message (the decoder's offset is within a chunk)."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return f"byte 0x{data[e.start]:02x} at offset {e.start}, line {line}"
    return "it changed while being read"


@dataclass
class SplitPaths:
    """Absolute file paths of one split; ``categorical`` follows the categorical channel order."""

    label: str
    numerical: str | None  # None when the dataset has no numerical features
    categorical: list[str]


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared lists in full instead of as ``&id001`` anchors, so the file reads plainly."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


@dataclass
class FeatureSpec:
    """A validated view of ``feature_spec.yaml``; relative file paths resolve against base_directory."""

    feature_spec: dict
    channel_spec: dict
    source_spec: dict
    metadata: dict = field(default_factory=dict)
    base_directory: str | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "FeatureSpec":
        """Load and validate a spec; ``path`` may also be the dataset directory."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, SPEC_FILE_NAME)
        try:
            with open(path, "r", encoding="utf-8") as f:
                raw = yaml.safe_load(f)
        except FileNotFoundError:
            raise DatasetError(
                f"{path}: feature spec not found; point the data path at a dataset directory that "
                f"holds {SPEC_FILE_NAME} (create one with `python -m dlrm.scripts.transcode`)"
            ) from None
        except UnicodeDecodeError:
            raise FeatureSpecError(
                f"{path}: not UTF-8 text ({_first_bad_byte(path)}); a feature spec is a YAML text file: "
                f"save it as UTF-8, or point the data path at the dataset's {SPEC_FILE_NAME}"
            ) from None
        except IsADirectoryError:
            raise FeatureSpecError(f"{path}: is a directory, not a feature spec file") from None
        except OSError as e:
            raise DatasetError(f"{path}: cannot read the feature spec: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise FeatureSpecError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(raw, dict):
            raise FeatureSpecError(f"{path}: expected a mapping with keys {list(TOP_LEVEL_KEYS)}, got {type(raw).__name__}")
        missing = [k for k in TOP_LEVEL_KEYS[:3] if k not in raw]
        unknown = sorted(set(raw) - set(TOP_LEVEL_KEYS))
        if missing:
            raise FeatureSpecError(f"{path}: missing top-level key(s) {missing}; a feature spec needs {list(TOP_LEVEL_KEYS)}")
        if unknown:
            raise FeatureSpecError(f"{path}: unknown top-level key(s) {unknown}; allowed: {list(TOP_LEVEL_KEYS)}")
        spec = cls(
            feature_spec=raw["feature_spec"],
            channel_spec=raw["channel_spec"],
            source_spec=raw["source_spec"],
            metadata=raw.get("metadata") or {},
            base_directory=os.path.dirname(os.path.abspath(path)),
        )
        try:
            spec.validate()
        except FeatureSpecError as e:
            raise FeatureSpecError(f"{path}: {e}") from None
        return spec

    @classmethod
    def default(
        cls,
        num_numerical: int,
        cardinalities: Sequence[int],
        splits: Sequence[str] = ("train", "test", "validation"),
        base_directory: str | None = None,
    ) -> "FeatureSpec":
        """NVIDIA's default naming: ``num_<i>``, ``cat_<i>.bin``, ``label``; files under ``<split>/``."""
        numerical = [f"num_{i}" for i in range(num_numerical)]
        categorical = [f"cat_{i}.bin" for i in range(len(cardinalities))]
        features: dict[str, dict] = {}
        for name, card in zip(categorical, cardinalities):
            features[name] = {"dtype": str(dtype_for_cardinality(card)), "cardinality": int(card)}
        for name in numerical:
            features[name] = {"dtype": "float16"}
        features[LABEL] = {"dtype": "bool"}
        source: dict[str, list] = {}
        for split in splits:
            chunks = []
            if numerical:
                chunks.append({"type": SPLIT_BINARY, "features": list(numerical), "files": [f"{split}/numerical.bin"]})
            chunks.append({"type": SPLIT_BINARY, "features": [LABEL], "files": [f"{split}/label.bin"]})
            for name in categorical:
                chunks.append({"type": SPLIT_BINARY, "features": [name], "files": [f"{split}/{name}"]})
            source[split] = chunks
        spec = cls(
            feature_spec=features,
            channel_spec={CATEGORICAL: categorical, NUMERICAL: numerical, LABEL: [LABEL]},
            source_spec=source,
            metadata={},
            base_directory=base_directory,
        )
        spec.validate()
        return spec

    def to_dict(self) -> dict:
        return {
            "channel_spec": copy.deepcopy(self.channel_spec),
            "feature_spec": copy.deepcopy(self.feature_spec),
            "metadata": copy.deepcopy(self.metadata),
            "source_spec": copy.deepcopy(self.source_spec),
        }

    def to_yaml(self, path: str | os.PathLike) -> None:
        """Write atomically (temp file + os.replace) so a crash never leaves half a spec.

        ``path`` may be the dataset directory, in which case ``feature_spec.yaml`` is written in it.
        """
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, SPEC_FILE_NAME)
        text = yaml.dump(self.to_dict(), Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=False)
        write_text_atomically(path, text)

    # ------------------------------------------------------------------ validation

    def validate(self) -> None:
        """Check structure and consistency; raises FeatureSpecError naming the feature or split."""
        for key in ("feature_spec", "channel_spec", "source_spec"):
            if not isinstance(getattr(self, key), dict):
                raise FeatureSpecError(f"'{key}' must be a mapping, got {type(getattr(self, key)).__name__}")
        if not isinstance(self.metadata, dict):
            raise FeatureSpecError(f"'metadata' must be a mapping, got {type(self.metadata).__name__}")
        channel_of = self._validate_channels()
        self._validate_features(channel_of)
        self._validate_sources(channel_of)

    def _validate_channels(self) -> dict[str, str]:
        missing = [c for c in CHANNELS if c not in self.channel_spec]
        unknown = sorted(set(self.channel_spec) - set(CHANNELS))
        if missing:
            raise FeatureSpecError(f"channel_spec is missing channel(s) {missing}; it needs {list(CHANNELS)} (lists may be empty except label)")
        if unknown:
            raise FeatureSpecError(f"channel_spec has unknown channel(s) {unknown}; allowed: {list(CHANNELS)}")
        labels = self.channel_spec[LABEL]
        if not isinstance(labels, list) or len(labels) != 1:
            raise FeatureSpecError(f"channel_spec.label must name exactly one feature, got {labels!r}")
        channel_of: dict[str, str] = {}
        for channel in CHANNELS:
            names = self.channel_spec[channel]
            if names is None:
                names = []
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise FeatureSpecError(f"channel_spec.{channel} must be a list of feature names, got {names!r}")
            for name in names:
                if name in channel_of:
                    raise FeatureSpecError(
                        f"feature '{name}' appears more than once in channel_spec "
                        f"({channel_of[name]} and {channel}); each feature belongs to one channel once"
                    )
                channel_of[name] = channel
                if name not in self.feature_spec:
                    raise FeatureSpecError(
                        f"feature '{name}' is listed in channel_spec.{channel} but missing from feature_spec; "
                        f"add it to feature_spec with its dtype" + (" and cardinality" if channel == CATEGORICAL else "")
                    )
        for name in self.feature_spec:
            if name not in channel_of:
                raise FeatureSpecError(
                    f"feature '{name}' is in feature_spec but in no channel of channel_spec; "
                    f"add it to one of {list(CHANNELS)} or remove it"
                )
        return channel_of

    def _validate_features(self, channel_of: dict[str, str]) -> None:
        for name, info in self.feature_spec.items():
            channel = channel_of[name]
            if not isinstance(info, dict) or "dtype" not in info:
                raise FeatureSpecError(f"feature '{name}': feature_spec entry needs a 'dtype', got {info!r}")
            try:
                dtype = np.dtype(info["dtype"])
            except TypeError:
                raise FeatureSpecError(f"feature '{name}': dtype {info['dtype']!r} is not a numpy dtype") from None
            if channel == LABEL and dtype != np.bool_:
                raise FeatureSpecError(f"label feature '{name}': dtype must be 'bool' (1 byte per sample), got '{dtype}'")
            if channel == NUMERICAL and dtype != np.float16:
                raise FeatureSpecError(f"numerical feature '{name}': dtype must be 'float16', got '{dtype}'")
            if channel == CATEGORICAL:
                if dtype not in CATEGORICAL_DTYPES:
                    raise FeatureSpecError(
                        f"categorical feature '{name}': dtype must be one of int8, int16, int32, int64, got '{dtype}'"
                    )
                card = info.get("cardinality")
                if isinstance(card, bool) or not isinstance(card, (int, np.integer)) or card < 1:
                    raise FeatureSpecError(
                        f"categorical feature '{name}': needs an integer 'cardinality' >= 1 (max id + 1), got {card!r}"
                    )
                if int(card) - 1 > np.iinfo(dtype).max:
                    raise FeatureSpecError(
                        f"categorical feature '{name}': dtype '{dtype}' cannot hold ids up to cardinality-1 = "
                        f"{int(card) - 1}; use dtype '{dtype_for_cardinality(int(card))}' (and files written with it)"
                    )

    def _validate_sources(self, channel_of: dict[str, str]) -> None:
        if not self.source_spec:
            raise FeatureSpecError("source_spec names no split; add at least one (e.g. 'train') with its files")
        numerical = self.numerical_names
        for split, chunks in self.source_spec.items():
            where = f"source_spec.{split}"
            if not isinstance(chunks, list):
                raise FeatureSpecError(f"{where} must be a list of chunks, got {type(chunks).__name__}")
            seen: set[str] = set()
            files: set[str] = set()
            for i, chunk in enumerate(chunks):
                at = f"{where}[{i}]"
                if not isinstance(chunk, dict):
                    raise FeatureSpecError(f"{at} must be a mapping with type, features, files; got {chunk!r}")
                if chunk.get("type") != SPLIT_BINARY:
                    raise FeatureSpecError(f"{at}: unknown chunk type {chunk.get('type')!r}; only '{SPLIT_BINARY}' is supported")
                feats = chunk.get("features")
                paths = chunk.get("files")
                if not isinstance(feats, list) or not feats or not all(isinstance(f, str) for f in feats):
                    raise FeatureSpecError(f"{at}: 'features' must be a non-empty list of names, got {feats!r}")
                if not isinstance(paths, list) or len(paths) != 1 or not isinstance(paths[0], str):
                    raise FeatureSpecError(f"{at} (features {feats}): 'files' must list exactly one path, got {paths!r}")
                if paths[0] in files:
                    raise FeatureSpecError(f"{at}: file '{paths[0]}' is used by two chunks of split '{split}'")
                files.add(paths[0])
                for name in feats:
                    if name not in channel_of:
                        raise FeatureSpecError(f"{at}: feature '{name}' is not declared in channel_spec/feature_spec")
                    if name in seen:
                        raise FeatureSpecError(f"{at}: feature '{name}' appears in more than one chunk of split '{split}'")
                    seen.add(name)
                channel = channel_of[feats[0]]
                if channel == NUMERICAL:
                    if feats != numerical:
                        raise FeatureSpecError(
                            f"{at}: the numerical chunk must hold all numerical features in channel order "
                            f"{numerical}, got {feats}"
                        )
                elif len(feats) != 1:
                    raise FeatureSpecError(
                        f"{at}: {channel} feature '{feats[0]}' must be alone in its file, but the chunk lists {feats}"
                    )
            absent = [n for n in channel_of if n not in seen]
            if absent:
                raise FeatureSpecError(f"split '{split}' has no file for feature(s) {absent}; add chunks for them to {where}")

    # ------------------------------------------------------------------ accessors

    @property
    def categorical_names(self) -> list[str]:
        return list(self.channel_spec.get(CATEGORICAL) or [])

    @property
    def numerical_names(self) -> list[str]:
        return list(self.channel_spec.get(NUMERICAL) or [])

    @property
    def label_name(self) -> str:
        return self.channel_spec[LABEL][0]

    @property
    def cardinalities(self) -> list[int]:
        return [int(self.feature_spec[n]["cardinality"]) for n in self.categorical_names]

    @property
    def categorical_dtypes(self) -> list[np.dtype]:
        return [np.dtype(self.feature_spec[n]["dtype"]) for n in self.categorical_names]

    @property
    def num_numerical(self) -> int:
        return len(self.numerical_names)

    @property
    def num_categorical(self) -> int:
        return len(self.categorical_names)

    @property
    def splits(self) -> list[str]:
        return list(self.source_spec)

    def paths(self, split: str) -> SplitPaths:
        """Absolute paths of a split's files; unknown splits fail listing the known ones."""
        if split not in self.source_spec:
            raise DatasetError(
                f"dataset {self.base_directory or '<no directory>'} has no split '{split}'; "
                f"known splits: {self.splits}"
            )
        if self.base_directory is None:
            raise DatasetError("feature spec has no base_directory; load it with FeatureSpec.from_yaml or set base_directory")
        by_feature = {}
        for chunk in self.source_spec[split]:
            path = os.path.abspath(os.path.join(self.base_directory, chunk["files"][0]))
            by_feature[chunk["features"][0]] = path
        numerical = by_feature[self.numerical_names[0]] if self.numerical_names else None
        return SplitPaths(
            label=by_feature[self.label_name],
            numerical=numerical,
            categorical=[by_feature[n] for n in self.categorical_names],
        )
