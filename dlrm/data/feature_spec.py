"""The feature spec: which features a dataset has, their dtypes, and which file holds each.

The on-disk form is NVIDIA's ``feature_spec.yaml`` (top-level keys ``feature_spec``,
``channel_spec``, ``source_spec``, ``metadata``), so datasets prepared by their pipeline load
unchanged. Only the ``split_binary`` source type exists: one file per categorical feature, one
file for all numerical features (float16, in channel order), one file for the label (bool).

A categorical feature may be multi-hot (a bag of ids per sample), an extension NVIDIA's files
never use, so they read as before: ``bag_size: L`` stores ``L`` ids per sample in one
``[rows, L]`` file padded with -1, ``bag_size: variable`` a values file plus an int64 offsets
file; ``pooling`` (``sum`` or ``mean``) says how the model pools the bag. See
docs/data_format.md.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import yaml

from dlrm.engine.atomic import write_text_atomically
from dlrm.engine.errors import DatasetError, FeatureSpecError
from dlrm.engine.outputs import inside

SPEC_FILE_NAME = "feature_spec.yaml"
SPLIT_BINARY = "split_binary"
CATEGORICAL = "categorical"
NUMERICAL = "numerical"
LABEL = "label"
CHANNELS = (CATEGORICAL, NUMERICAL, LABEL)
TOP_LEVEL_KEYS = ("feature_spec", "channel_spec", "source_spec", "metadata")
CATEGORICAL_DTYPES = tuple(np.dtype(t) for t in (np.int8, np.int16, np.int32, np.int64))

# Multi-hot (bag) features: keys of a categorical feature's entry in ``feature_spec``.
BAG_SIZE = "bag_size"  # an int L >= 1 (fixed-size bags, -1 padded) or VARIABLE (values + offsets)
POOLING = "pooling"  # how the model pools a bag: one of POOLINGS
VARIABLE = "variable"
POOLINGS = ("sum", "mean")
PADDING_ID = -1  # fills the unused slots of a fixed-size bag; readers drop it
OFFSETS_DTYPE = np.dtype("<i8")  # offsets files: int64, rows + 1 values, a leading 0
ALLOW_OUTSIDE = "`allow_files_outside_dataset=True`"  # the opt-in of ``dataset_file`` (DataConfig's setting)
# Keys that other tools use for multi-hot features: a spec that uses one is refused with the fix
# rather than read as one-hot. (Other unknown keys are kept, as before, for compatibility.)
_FOREIGN_MULTI_HOT_KEYS = ("max_hotness", "hotness", "multi_hot", "multi_hot_size", "multihot",
                           "pooling_mode", "pooling_type", "combiner", "mode", "offsets", "bag_sizes")


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


# Bounds of a feature spec file, checked before its YAML becomes Python objects. A spec of 10,000
# features over three splits takes about 2 MiB; a YAML alias costs a few bytes where it stands
# but is written out in full when the spec is saved (and walked in full by whoever reads the
# metadata), so a few nested aliases (a "billion laughs") stand for gigabytes: the size the spec
# has with its aliases expanded is bounded too. Deep nesting would overflow PyYAML's recursion.
MAX_SPEC_BYTES = 8 << 20
MAX_SPEC_DEPTH = 64


def _alias_sizes(text: str, path: str) -> None:
    """Walks the YAML events of ``text`` (an iterative parse: no recursion, no objects built) and
    refuses nesting deeper than MAX_SPEC_DEPTH, an alias inside its own anchor (a recursive
    structure, which has no full form) and aliases that expand the spec past MAX_SPEC_BYTES,
    each with a FeatureSpecError naming the file and line. Syntax errors raise yaml.YAMLError."""
    written = 0  # bytes of the spec written out in full, so far (about: one per collection)
    starts: list[tuple[int, str | None]] = []  # open collections: (written at their start, anchor)
    sizes: dict[str, int] = {}  # anchor -> its expanded size
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        line = event.start_mark.line + 1 if event.start_mark is not None else 0
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            if len(starts) >= MAX_SPEC_DEPTH:
                raise FeatureSpecError(f"{path}:{line}: nested more than {MAX_SPEC_DEPTH} levels deep; a feature spec "
                                       f"is a few levels of mappings and lists: fix the file")
            starts.append((written, event.anchor))
            written += 1
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            begin, anchor = starts.pop()
            if anchor is not None:
                sizes[anchor] = written - begin
        elif isinstance(event, yaml.ScalarEvent):
            written += 1 + len(event.value)
            if event.anchor is not None:
                sizes[event.anchor] = 1 + len(event.value)
        elif isinstance(event, yaml.AliasEvent):
            if any(anchor == event.anchor for _, anchor in starts):
                raise FeatureSpecError(f"{path}:{line}: the alias *{event.anchor} stands inside its own anchor "
                                       f"&{event.anchor}, a structure without end; write the value out in full")
            written += sizes.get(event.anchor, 0)  # an undefined alias: yaml.load names it
            if written > MAX_SPEC_BYTES:
                raise FeatureSpecError(f"{path}:{line}: its YAML aliases (such as *{event.anchor}) expand the spec to "
                                       f"more than {MAX_SPEC_BYTES >> 20} MiB (nested aliases, a 'billion laughs'?); "
                                       f"a feature spec is far smaller: write its values out without nested aliases")


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML syntax error on one line: what is wrong and where (PyYAML's own text spans lines
    and quotes the document as "<unicode string>")."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem:
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        return f"{e.context + ': ' if e.context else ''}{e.problem}{where}"
    if isinstance(e, yaml.reader.ReaderError):
        return f"{e.reason} (character {e.character!r} at offset {e.position})"
    return " ".join(str(e).split())


def read_spec_yaml(path: str) -> Any:
    """The YAML of a feature spec file, read safely: at most MAX_SPEC_BYTES, nested at most
    MAX_SPEC_DEPTH deep, aliases that do not blow up when written out (``_alias_sizes``), plain
    YAML types only (``yaml.SafeLoader``). Refusals, syntax errors and values that do not convert
    (an integer of thousands of digits, a date that does not exist) are FeatureSpecErrors naming
    the file, on one line; a file that cannot be read raises OSError and one that is not UTF-8
    UnicodeDecodeError, for the caller to word. Shared by every reader of a spec (this module's
    and ``dlrm.data.csv_source``'s)."""
    with open(path, "rb") as f:
        data = f.read(MAX_SPEC_BYTES + 1)
    if len(data) > MAX_SPEC_BYTES:
        raise FeatureSpecError(f"{path}: larger than {MAX_SPEC_BYTES >> 20} MiB; a feature spec is far smaller (10,000 "
                               f"features take about 2 MiB): is this the dataset's {SPEC_FILE_NAME}?")
    text = data.decode("utf-8")
    try:
        _alias_sizes(text, path)
        return yaml.load(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as e:
        raise FeatureSpecError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    except FeatureSpecError:
        raise
    except (ValueError, OverflowError) as e:  # a constructor's: int("9" * 5000), a 31st of February
        raise FeatureSpecError(f"{path}: a value cannot be read: {str(e).split('; ')[0]}") from None
    except (TypeError, AttributeError, IndexError, KeyError) as e:  # PyYAML's constructors on "!!int " and the like
        raise FeatureSpecError(f"{path}: a value cannot be read (PyYAML: {type(e).__name__}: {e}); check the "
                               f"values with an explicit tag (!!int, !!timestamp, ...)") from None


def _first_bad_byte(path: str) -> str:
    """Where a file stops being UTF-8, for the message (the decoder's offset is within a chunk)."""
    with open(path, "rb") as f:
        data = f.read(MAX_SPEC_BYTES + 1)  # what read_spec_yaml decoded
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        return f"byte 0x{data[e.start]:02x} at offset {e.start}, line {line}"
    return "it changed while being read"


def _looks_multi_hot(key: Any) -> bool:
    """An entry key meant to declare a multi-hot feature but not ours: another tool's name, or a
    misspelling of `bag_size` / `pooling` (close by difflib's ratio)."""
    key = str(key)
    if key in (BAG_SIZE, POOLING):
        return False
    return key in _FOREIGN_MULTI_HOT_KEYS or bool(difflib.get_close_matches(key, (BAG_SIZE, POOLING), n=1, cutoff=0.75))


def default_offsets_file(values_file: str) -> str:
    """Where ``FeatureSpec.default`` puts the offsets of a variable-length feature: beside its
    values file, ``cat_3.bin`` -> ``cat_3.offsets.bin``."""
    stem = values_file[: -len(".bin")] if values_file.endswith(".bin") else values_file
    return f"{stem}.offsets.bin"


def dataset_file(base_directory: str, name: str, spec_path: str, feature: str, allow_outside: bool = False,
                 opt_in: str = ALLOW_OUTSIDE) -> tuple[str, bool]:
    """The absolute path of file ``name`` that the spec ``spec_path`` gives ``feature``, and
    whether it lies outside ``base_directory``. A dataset is a folder handed in from outside:
    a spec naming ``../home/.ssh/id_rsa``, an absolute path or a link leading out would make
    training read (and its messages quote) any file the user can read. So such a name is a
    ``DatasetError`` before anything is opened, unless ``allow_outside`` (``opt_in`` says how a
    user asks for it). The rule is the writers' (``dlrm.engine.outputs.inside``: links resolved)."""
    path = os.path.abspath(os.path.join(base_directory, name))
    try:
        inside(base_directory, name, "")
    except ValueError:  # OutputError, or a name os.path cannot take (a NUL byte)
        if not allow_outside:
            shown = repr(name) if len(name) <= 120 else repr(name[:120]) + "..."
            raise DatasetError(
                f"{spec_path}: the file {shown} of feature '{feature}' lies outside the dataset folder "
                f"{base_directory} (an absolute path, '..' or a link leading out); nothing was read: move the file "
                f"into the folder and name it relative to it, or pass {opt_in} if you trust this spec") from None
        return path, True
    return path, False


@dataclass
class SplitPaths:
    """Absolute file paths of one split; ``categorical`` follows the categorical channel order
    (for a variable-length bag feature, its values file)."""

    label: str
    numerical: str | None  # None when the dataset has no numerical features
    categorical: list[str]
    # categorical channel index -> offsets file, for the ``bag_size: variable`` features only
    offsets: dict[int, str] = field(default_factory=dict)
    # files outside the dataset folder (read by choice: ``allow_files_outside``); messages never quote their values
    outside: set[str] = field(default_factory=set)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared lists in full instead of as ``&id001`` anchors, so the file reads plainly."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


@dataclass
class FeatureSpec:
    """A validated view of ``feature_spec.yaml``; relative file paths resolve against base_directory,
    and must stay inside it unless ``allow_files_outside`` (``dataset_file``)."""

    feature_spec: dict
    channel_spec: dict
    source_spec: dict
    metadata: dict = field(default_factory=dict)
    base_directory: str | None = None
    allow_files_outside: bool = False
    source_path: str | None = None  # the spec file read, for messages (from_yaml)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, allow_files_outside: bool = False) -> "FeatureSpec":
        """Load and validate a spec; ``path`` may also be the dataset directory.
        ``allow_files_outside``: its files may lie outside its folder (``dataset_file``)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, SPEC_FILE_NAME)
        try:
            raw = read_spec_yaml(path)
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
            allow_files_outside=bool(allow_files_outside),
            source_path=path,
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
        bag_sizes: Sequence[int | str | None] | None = None,
        pooling: str | Sequence[str | None] = "sum",
    ) -> "FeatureSpec":
        """NVIDIA's default naming: ``num_<i>``, ``cat_<i>.bin``, ``label``; files under ``<split>/``.

        ``bag_sizes`` (one entry per categorical feature) makes features multi-hot: an int ``L``
        for fixed-size bags, ``"variable"`` for variable-length ones (offsets in
        ``cat_<i>.offsets.bin``), None for one-hot; ``pooling`` is one mode for all of them or
        one per feature."""
        numerical = [f"num_{i}" for i in range(num_numerical)]
        categorical = [f"cat_{i}.bin" for i in range(len(cardinalities))]
        if bag_sizes is None:
            bag_sizes = [None] * len(categorical)
        if len(bag_sizes) != len(categorical):
            raise FeatureSpecError(f"{len(bag_sizes)} `bag_sizes` given for {len(categorical)} categorical features")
        poolings = [pooling] * len(categorical) if isinstance(pooling, str) or pooling is None else list(pooling)
        if len(poolings) != len(categorical):
            raise FeatureSpecError(f"{len(poolings)} `pooling` modes given for {len(categorical)} categorical features")
        features: dict[str, dict] = {}
        for name, card, bag, pool in zip(categorical, cardinalities, bag_sizes, poolings):
            features[name] = {"dtype": str(dtype_for_cardinality(card)), "cardinality": int(card)}
            if bag is not None:
                features[name][BAG_SIZE] = bag if isinstance(bag, str) else int(bag)
                features[name][POOLING] = pool
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
                files = [f"{split}/{name}"]
                if features[name].get(BAG_SIZE) == VARIABLE:
                    files.append(default_offsets_file(files[0]))
                chunks.append({"type": SPLIT_BINARY, "features": [name], "files": files})
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
            try:  # a name only: numpy would also build dtypes from lists and mappings
                if not isinstance(info["dtype"], str):
                    raise TypeError
                dtype = np.dtype(info["dtype"])
            except (TypeError, ValueError, KeyError, SyntaxError):
                raise FeatureSpecError(f"feature '{name}': dtype {info['dtype']!r} is not a numpy dtype") from None
            if channel != CATEGORICAL and (BAG_SIZE in info or POOLING in info):
                raise FeatureSpecError(
                    f"{channel} feature '{name}': `{BAG_SIZE}` and `{POOLING}` apply to categorical features "
                    f"only; remove them"
                )
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
                self._validate_bags(name, info)

    @staticmethod
    def _validate_bags(name: str, info: dict) -> None:
        """A multi-hot feature names both its bag layout and its pooling; nothing else is guessed."""
        foreign = [k for k in info if _looks_multi_hot(k)]
        if foreign:
            raise FeatureSpecError(
                f"categorical feature '{name}': unknown key(s) {foreign}; a multi-hot feature is declared with "
                f"`{BAG_SIZE}` (ids per sample: an integer for fixed-size bags, '{VARIABLE}' for variable-length "
                f"ones) and `{POOLING}` ({' or '.join(POOLINGS)}); see docs/data_format.md"
            )
        bag, pooling = info.get(BAG_SIZE), info.get(POOLING)
        if bag is None and BAG_SIZE in info:
            raise FeatureSpecError(
                f"categorical feature '{name}': `{BAG_SIZE}` is empty; give an integer >= 1 or '{VARIABLE}', "
                f"or remove it (and `{POOLING}`) for a one-hot feature"
            )
        if bag is None and POOLING in info:
            raise FeatureSpecError(
                f"categorical feature '{name}' has `{POOLING}: {pooling}` but no `{BAG_SIZE}`; a one-hot feature has "
                f"no pooling: add `{BAG_SIZE}` (an integer for fixed-size bags, '{VARIABLE}' for variable-length "
                f"ones) or remove `{POOLING}`"
            )
        if bag is None:
            return
        if bag != VARIABLE and (isinstance(bag, bool) or not isinstance(bag, (int, np.integer)) or bag < 1):
            raise FeatureSpecError(
                f"categorical feature '{name}': `{BAG_SIZE}` must be an integer >= 1 (ids per sample, in a "
                f"[rows, {BAG_SIZE}] file padded with {PADDING_ID}) or '{VARIABLE}' (a values file and an offsets "
                f"file), got {bag!r}"
            )
        if pooling not in POOLINGS:
            raise FeatureSpecError(
                f"categorical feature '{name}' is multi-hot (`{BAG_SIZE}: {bag}`) "
                + (f"but has no `{POOLING}`" if pooling is None else f"with an unknown `{POOLING}: {pooling!r}`")
                + f"; set `{POOLING}` to one of {list(POOLINGS)}"
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
                variable = len(feats) == 1 and self._is_variable(feats[0])
                if variable:
                    if not isinstance(paths, list) or len(paths) != 2 or not all(isinstance(p, str) for p in paths):
                        raise FeatureSpecError(
                            f"{at} (feature '{feats[0]}', `{BAG_SIZE}: {VARIABLE}`): 'files' must list two paths, "
                            f"the values file then the offsets file (int64, rows + 1 values), e.g. "
                            f"[{split}/{feats[0]}, {split}/{default_offsets_file(feats[0])}]; got {paths!r}"
                        )
                elif not isinstance(paths, list) or len(paths) != 1 or not isinstance(paths[0], str):
                    hint = (f" (only `{BAG_SIZE}: {VARIABLE}` features have a second file, of offsets)"
                            if isinstance(paths, list) and len(paths) == 2 else "")
                    raise FeatureSpecError(f"{at} (features {feats}): 'files' must list exactly one path{hint}, got {paths!r}")
                if len(set(paths)) != len(paths):
                    raise FeatureSpecError(f"{at}: the values and offsets files of '{feats[0]}' must differ, got {paths!r}")
                for path in paths:
                    if path in files:
                        raise FeatureSpecError(f"{at}: file '{path}' is used by two chunks of split '{split}'")
                    files.add(path)
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

    def _is_variable(self, name: str) -> bool:
        info = self.feature_spec.get(name)
        return isinstance(info, dict) and info.get(BAG_SIZE) == VARIABLE

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

    def _categorical_info(self, feature: str | int) -> dict:
        """The feature_spec entry of a categorical feature given by name or channel index."""
        names = self.categorical_names
        if isinstance(feature, (int, np.integer)) and not isinstance(feature, bool):
            if not 0 <= feature < len(names):
                raise IndexError(f"categorical feature index {feature} out of range; the spec has {len(names)}")
            feature = names[feature]
        if feature not in names:
            raise KeyError(f"'{feature}' is not a categorical feature of this spec; they are {names}")
        return self.feature_spec[feature]

    def is_multi_hot(self, feature: str | int) -> bool:
        """Whether a categorical feature (name or channel index) holds bags: its batches come as ``Bags``."""
        return self._categorical_info(feature).get(BAG_SIZE) is not None

    def bag_size(self, feature: str | int) -> int | str | None:
        """``L`` for fixed-size bags, ``"variable"`` for variable-length ones, None for a one-hot feature."""
        return self._categorical_info(feature).get(BAG_SIZE)

    def pooling(self, feature: str | int) -> str | None:
        """How the model pools the feature's bag (``"sum"`` or ``"mean"``); None for a one-hot
        feature (a bag of one id, where both agree)."""
        info = self._categorical_info(feature)
        return info.get(POOLING) if info.get(BAG_SIZE) is not None else None

    @property
    def multi_hot_features(self) -> list[str]:
        """Names of the multi-hot categorical features, in channel (table) order."""
        return [n for n in self.categorical_names if self.is_multi_hot(n)]

    @property
    def poolings(self) -> list[str | None]:
        """``pooling(f)`` for every categorical feature, in channel (table) order."""
        return [self.pooling(n) for n in self.categorical_names]

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
        """Absolute paths of a split's files, each inside the dataset folder unless
        ``allow_files_outside`` (``dataset_file``); unknown splits fail listing the known ones."""
        if split not in self.source_spec:
            raise DatasetError(
                f"dataset {self.base_directory or '<no directory>'} has no split '{split}'; "
                f"known splits: {self.splits}"
            )
        if self.base_directory is None:
            raise DatasetError("feature spec has no base_directory; load it with FeatureSpec.from_yaml or set base_directory")
        spec_path = self.source_path or os.path.join(self.base_directory, SPEC_FILE_NAME)
        by_feature, offsets_of, outside = {}, {}, set()
        for chunk in self.source_spec[split]:
            feature = chunk["features"][0] if len(chunk["features"]) == 1 else f"{NUMERICAL} ({len(chunk['features'])})"
            files = []
            for name in chunk["files"]:
                path, out = dataset_file(self.base_directory, name, spec_path, feature, self.allow_files_outside)
                files.append(path)
                if out:
                    outside.add(path)
            by_feature[chunk["features"][0]] = files[0]
            if len(files) == 2:  # a variable-length bag feature: values, then offsets
                offsets_of[chunk["features"][0]] = files[1]
        numerical = by_feature[self.numerical_names[0]] if self.numerical_names else None
        names = self.categorical_names
        return SplitPaths(
            label=by_feature[self.label_name],
            numerical=numerical,
            categorical=[by_feature[n] for n in names],
            offsets={i: offsets_of[n] for i, n in enumerate(names) if n in offsets_of},
            outside=outside,
        )
