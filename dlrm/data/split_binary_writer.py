"""Writer of the split-binary layout: batches appended to one split's files, which appear
together, and only when the writer closes cleanly (the reader is ``dlrm.data.split_binary``).

Importing this module does not import torch (a batch of tensors has done so already), so that a
command can check its output folder (``SPLIT_BINARY_DATASET``) at once, before torch loads."""

from __future__ import annotations

import contextlib
import glob
import os
import re
import sys
from typing import TYPE_CHECKING, BinaryIO

import numpy as np
import yaml

from dlrm.data.feature_spec import OFFSETS_DTYPE, PADDING_ID, SPLIT_BINARY, VARIABLE, FeatureSpec
from dlrm.data.split_binary_columns import LABEL_DTYPE, NUMERICAL_DTYPE
from dlrm.engine.atomic import StagedWriter, remove_stale_temporaries, temporary_name
from dlrm.engine.errors import DatasetError
from dlrm.engine.outputs import OutputKind, holds_only, under

if TYPE_CHECKING:
    from dlrm.data.batch import Bags, Batch

# What ``python -m preproc`` writes in its work directory (``preproc.workdir``; named here because
# dlrm never imports preproc): the manifest, each unit's marker ``<unit>.json`` and folder
# ``<unit>`` (``<unit>.tmp`` while written) of the local engine's counts, vocabulary and row
# fragments, and the Spark engine's units (``spark/``), which hold Spark's own Parquet layout.
PREPROC_WORK_FILES = (
    "manifest.json", "vocab.json", re.compile(r"(lines|scan|rows)/(f[0-9]+\.json)?"),
    re.compile(r"scan/f[0-9]+(\.tmp)?/(run[0-9]+\.p[0-9]+\.npy)?"), re.compile(r"vocab(\.tmp)?/((sizes|table)\.npy)?"),
    re.compile(r"rows/f[0-9]+(\.tmp)?/([a-z]+\.b[0-9]+(\.p[0-9]{6})?\.rec)?"), "spark/**")
# Besides its spec and the files the spec names: split directories of .bin files, the vocabulary
# that preprocessing keeps with its datasets (docs/data_format.md) and preprocessing's resume state
# (``preproc.job.WORK_DIR_NAME``). Writers' temporaries are recognised by ``holds_only`` itself.
_DATASET_FILES = (re.compile(r"(train|test|validation)/([^/]+\.bin)?"), "vocabulary/sizes.npy", "vocabulary/table.npy",
                  *under(".preproc_work", PREPROC_WORK_FILES))
_PREPROC_MANIFEST = ".preproc_work/manifest.json"


def _spec_files(path: str) -> list[str] | None:
    """The relative files the split-binary feature spec ``path`` names, or None when ``path``
    is no such spec (not YAML, not a mapping of a spec's keys, or a chunk of another type)."""
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f.read(1 << 20))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("channel_spec"), dict) \
            or not isinstance(raw.get("source_spec"), dict) or not raw["source_spec"]:
        return None
    files = []
    for chunks in raw["source_spec"].values():
        if not isinstance(chunks, list):
            return None
        for chunk in chunks:
            if not isinstance(chunk, dict) or chunk.get("type") != SPLIT_BINARY:
                return None
            files += [os.path.normpath(f).replace(os.sep, "/") for f in chunk.get("files") or []
                      if isinstance(f, str) and not os.path.isabs(f)]
    return files


def is_split_binary_dataset(path: str) -> bool:
    """Whether directory ``path`` holds a split-binary dataset of this program's writers (or
    NVIDIA's, the same format) and nothing else: feature specs at the top (any ``*.yaml``
    there must be one), the files they name, split directories of ``.bin`` files, the
    vocabulary and resume state of ``python -m preproc`` (an unfinished run has no spec yet)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    patterns = list(_DATASET_FILES)
    specs = 0
    for name in names:
        if name.endswith((".yaml", ".yml")) and os.path.isfile(os.path.join(path, name)):
            named = _spec_files(os.path.join(path, name))
            if named is None:
                return False
            specs += 1
            patterns += [glob.escape(name)] + [glob.escape(f) for f in named]
    unfinished = os.path.isfile(os.path.join(path, _PREPROC_MANIFEST))
    return (specs > 0 or unfinished) and holds_only(path, patterns)


SPLIT_BINARY_DATASET = OutputKind("dataset", directory=True, recognise=is_split_binary_dataset)


def _to_numpy(x) -> np.ndarray:
    torch = sys.modules.get("torch")  # not imported: x is no tensor
    if torch is not None and isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


class SplitBinaryWriter(StagedWriter):
    """Appends batches to one split's files (under ``spec.base_directory``); files appear only
    when the writer closes cleanly.

    Use as a context manager. Rows go to temporary files next to their final names; a clean
    exit renames them into place, an exception deletes them, so a failed run never replaces a
    good dataset with a partial one. The files must appear together, so they are renamed as a
    set here rather than one by one through ``atomic.write_atomically``; their temporary names
    follow ``atomic``'s, and temporaries of a killed writer are removed on the next write.
    """

    def __init__(self, spec: FeatureSpec, split: str):
        self.spec = spec
        self.split = split
        self.num_rows = 0
        paths = spec.paths(split)
        self._cardinalities = np.asarray(spec.cardinalities, dtype=np.int64)
        self._dtypes = spec.categorical_dtypes
        self._bag_sizes = [spec.bag_size(j) for j in range(spec.num_categorical)]
        self._multi_hot = any(b is not None for b in self._bag_sizes)
        self._offsets_paths = dict(paths.offsets)  # categorical index -> offsets file (variable bags)
        targets = [paths.label] + ([paths.numerical] if paths.numerical else []) + list(paths.categorical)
        targets += [self._offsets_paths[j] for j in sorted(self._offsets_paths)]
        self._files: list[tuple[str, str, BinaryIO]] = []  # (final path, temp path, handle)
        try:
            for path in targets:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                remove_stale_temporaries(path)
                tmp = temporary_name(path)
                self._files.append((path, tmp, open(tmp, "wb")))
        except BaseException:
            self.abort()
            raise
        self._label = self._files[0][2]
        self._numerical = self._files[1][2] if paths.numerical else None
        first = 1 + (paths.numerical is not None)
        self._categorical = [f for _, _, f in self._files[first:first + spec.num_categorical]]
        self._categorical_paths = list(paths.categorical)
        # An offsets file starts with 0 and gets each batch's running ends: row r's bag is
        # values[offsets[r]:offsets[r + 1]].
        self._offsets = {j: f for j, (_, _, f) in zip(sorted(self._offsets_paths), self._files[first + spec.num_categorical:])}
        self._offsets_end = {j: 0 for j in self._offsets}
        for f in self._offsets.values():
            f.write(np.zeros(1, dtype=OFFSETS_DTYPE).tobytes())

    def write(self, batch: Batch) -> None:
        """Append a batch; checks shapes, label values, float16 range and id ranges first."""
        import torch  # loaded already: a Batch comes from dlrm.data.batch

        from dlrm.data.batch import Bags

        if not self._files:
            raise RuntimeError(f"writer for split '{self.split}' is already closed")
        label = _to_numpy(batch.label).reshape(-1)
        n = label.shape[0]
        numerical = _to_numpy(batch.numerical)
        spec = self.spec
        bags = batch.categorical if isinstance(batch.categorical, Bags) else None
        if bags is None and self._multi_hot:  # one id per feature: bags of one
            bags = Bags.from_one_hot(torch.as_tensor(_to_numpy(batch.categorical)).reshape(n, -1))
        categorical = _to_numpy(batch.categorical) if bags is None else None
        if numerical.shape != (n, spec.num_numerical) and not (spec.num_numerical == 0 and numerical.size == 0):
            raise DatasetError(f"batch numerical has shape {numerical.shape}, expected ({n}, {spec.num_numerical})")
        if bags is not None:
            bag_columns = self._bag_columns(bags, n)
        elif categorical.shape != (n, spec.num_categorical) and not (spec.num_categorical == 0 and categorical.size == 0):
            raise DatasetError(f"batch categorical has shape {categorical.shape}, expected ({n}, {spec.num_categorical})")
        if n and not np.isin(label, (0, 1)).all():
            bad = label[~np.isin(label, (0, 1))][0].item()
            raise DatasetError(f"label '{spec.label_name}' ({self._files[0][0]}): value {bad!r} is not 0 or 1")
        num16 = None
        if spec.num_numerical:
            with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, by feature
                num16 = numerical.astype(NUMERICAL_DTYPE)
        if num16 is not None and n and not np.isfinite(num16).all():
            rows, cols = np.nonzero(~np.isfinite(num16))
            name = spec.numerical_names[cols[0]]
            raise DatasetError(
                f"numerical feature '{name}': value {numerical[rows[0], cols[0]].item()!r} is not finite in float16 "
                f"(max 65504); transform it (e.g. log) before writing"
            )
        if bags is None and spec.num_categorical and n:
            if not np.issubdtype(categorical.dtype, np.integer):
                raise TypeError(f"categorical ids must be integers, got dtype {categorical.dtype}")
            self._check_ids(categorical)
        self._label.write(label.astype(LABEL_DTYPE).tobytes())
        if self._numerical is not None:
            self._numerical.write(np.ascontiguousarray(num16).tobytes())
        if bags is not None:
            self._write_bags(bag_columns)
        else:
            for j, f in enumerate(self._categorical):
                f.write(np.ascontiguousarray(categorical[:, j].astype(self._dtypes[j])).tobytes())
        self.num_rows += n

    def _bag_columns(self, bags: Bags, n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each feature's (ids, lengths) from a batch's bags, checked against the spec before
        anything is written: bag count, offsets, id range, one id per one-hot feature, at most
        ``bag_size`` ids per fixed-size bag."""
        spec = self.spec
        if bags.num_features != spec.num_categorical or (spec.num_categorical and bags.batch_size != n):
            raise DatasetError(
                f"batch categorical holds bags of {bags.num_features} features for {bags.batch_size} samples, "
                f"expected {spec.num_categorical} features for {n} samples"
            )
        values, offsets = _to_numpy(bags.values).reshape(-1), _to_numpy(bags.offsets).astype(np.int64).reshape(-1)
        if not np.issubdtype(values.dtype, np.integer):
            raise TypeError(f"categorical ids must be integers, got dtype {values.dtype}")
        if offsets.shape[0] != spec.num_categorical * n + 1 or offsets[0] != 0 or offsets[-1] != values.shape[0] \
                or (offsets.shape[0] > 1 and (np.diff(offsets) < 0).any()):
            raise DatasetError(
                f"batch categorical bags are inconsistent: offsets need {spec.num_categorical * n + 1} "
                f"non-decreasing values from 0 to the number of ids ({values.shape[0]})"
            )
        columns = []
        for j in range(spec.num_categorical):
            start, end = int(offsets[j * n]), int(offsets[(j + 1) * n])
            ids, lengths = values[start:end], np.diff(offsets[j * n:(j + 1) * n + 1])
            name, size = spec.categorical_names[j], self._bag_sizes[j]
            where = f"categorical feature '{name}' ({self._categorical_paths[j]})"
            if size is None and n and (lengths != 1).any():
                row = int(np.argmax(lengths != 1))
                raise DatasetError(
                    f"{where} is one-hot in the spec but row {row} of the batch has a bag of {int(lengths[row])} "
                    f"ids; give it a `bag_size` in the spec or pass one id per sample"
                )
            if isinstance(size, int) and n and lengths.max() > size:
                row = int(np.argmax(lengths > size))
                raise DatasetError(
                    f"{where} has `bag_size: {size}` but row {row} of the batch has a bag of {int(lengths[row])} "
                    f"ids; raise `bag_size` or use `bag_size: {VARIABLE}`"
                )
            if ids.size:
                lo, hi = int(ids.min()), int(ids.max())
                if lo < 0 or hi >= int(self._cardinalities[j]):
                    value = lo if lo < 0 else hi
                    raise DatasetError(
                        f"{where}: id {value} is outside [0, {int(self._cardinalities[j])}); raise its cardinality "
                        f"in the spec or map ids into range (id % cardinality) before writing"
                    )
            columns.append((ids, lengths))
        return columns

    def _write_bags(self, columns: list[tuple[np.ndarray, np.ndarray]]) -> None:
        for j, (ids, lengths) in enumerate(columns):
            size, dtype = self._bag_sizes[j], self._dtypes[j]
            if size == VARIABLE:
                self._categorical[j].write(np.ascontiguousarray(ids.astype(dtype)).tobytes())
                ends = self._offsets_end[j] + np.cumsum(lengths, dtype=np.int64)
                self._offsets[j].write(ends.astype(OFFSETS_DTYPE).tobytes())
                self._offsets_end[j] += int(ids.shape[0])
            elif size is None:
                self._categorical[j].write(np.ascontiguousarray(ids.astype(dtype)).tobytes())
            else:  # [rows, size], each bag left-aligned and padded with PADDING_ID
                block = np.full((lengths.shape[0], size), PADDING_ID, dtype=dtype)
                if ids.size == block.size:
                    block = ids.astype(dtype).reshape(block.shape)
                elif ids.size:
                    starts = np.cumsum(lengths) - lengths
                    rows = np.repeat(np.arange(lengths.shape[0]), lengths)
                    block[rows, np.arange(ids.shape[0]) - np.repeat(starts, lengths)] = ids
                self._categorical[j].write(block.tobytes())

    def _check_ids(self, categorical: np.ndarray) -> None:
        # One min and max per column (vectorised); Python ints so uint64 ids compare exactly.
        lo = [int(v) for v in categorical.min(axis=0)]
        hi = [int(v) for v in categorical.max(axis=0)]
        bad = [j for j in range(len(lo)) if lo[j] < 0 or hi[j] >= int(self._cardinalities[j])]
        if bad:
            j = bad[0]
            value = lo[j] if lo[j] < 0 else hi[j]
            raise DatasetError(
                f"categorical feature '{self.spec.categorical_names[j]}' ({self._categorical_paths[j]}): "
                f"id {value} is outside [0, {int(self._cardinalities[j])}); raise its cardinality in the spec "
                f"or map ids into range (id % cardinality) before writing"
            )

    def close(self) -> None:
        """Flush and rename every temp file into place."""
        if not self._files:
            return
        try:
            for _, _, f in self._files:
                f.flush()
                os.fsync(f.fileno())
                f.close()
            for path, tmp, _ in self._files:
                os.replace(tmp, path)
        except BaseException:
            self.abort()
            raise
        self._files = []

    def abort(self) -> None:
        """Drop everything written so far; the previous files (if any) stay as they were."""
        files, self._files = self._files, []
        for _, tmp, f in files:
            with contextlib.suppress(OSError):  # a full disk fails the flush of a file being dropped anyway
                f.close()
            if os.path.exists(tmp):
                os.unlink(tmp)

    def __del__(self) -> None:
        if getattr(self, "_files", None):
            self.abort()
