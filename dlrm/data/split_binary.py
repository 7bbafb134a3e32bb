"""Reader and writer for the split-binary layout: one headerless file per column group.

Files carry no batch structure, so batch ``i`` of size ``B`` is rows ``[i*B, (i+1)*B)`` of every
file and the reader fetches it with one positional read per file, straight into a numpy buffer
that torch then wraps without a copy. All size checks happen at construction so that a bad
dataset fails before training starts, not hours into it.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Sequence

import numpy as np
import torch

from dlrm.data.atomic import remove_stale_temporaries, temporary_name
from dlrm.data.batch import Batch
from dlrm.data.errors import DatasetError
from dlrm.data.feature_spec import FeatureSpec

_LABEL_DTYPE = np.dtype(np.bool_)
_NUMERICAL_DTYPE = np.dtype(np.float16)
_EMPTY_CATEGORICAL_DTYPE = np.dtype(np.int64)


def _to_numpy(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


# ---------------------------------------------------------------------------- writer


class SplitBinaryWriter:
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
        targets = [paths.label] + ([paths.numerical] if paths.numerical else []) + list(paths.categorical)
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
        self._categorical = [f for _, _, f in self._files[1 + (paths.numerical is not None):]]
        self._categorical_paths = list(paths.categorical)

    def __enter__(self) -> "SplitBinaryWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def write(self, batch: Batch) -> None:
        """Append a batch; checks shapes, label values, float16 range and id ranges first."""
        if not self._files:
            raise RuntimeError(f"writer for split '{self.split}' is already closed")
        label = _to_numpy(batch.label).reshape(-1)
        n = label.shape[0]
        numerical = _to_numpy(batch.numerical)
        categorical = _to_numpy(batch.categorical)
        spec = self.spec
        if numerical.shape != (n, spec.num_numerical) and not (spec.num_numerical == 0 and numerical.size == 0):
            raise DatasetError(f"batch numerical has shape {numerical.shape}, expected ({n}, {spec.num_numerical})")
        if categorical.shape != (n, spec.num_categorical) and not (spec.num_categorical == 0 and categorical.size == 0):
            raise DatasetError(f"batch categorical has shape {categorical.shape}, expected ({n}, {spec.num_categorical})")
        if n and not np.isin(label, (0, 1)).all():
            bad = label[~np.isin(label, (0, 1))][0].item()
            raise DatasetError(f"label '{spec.label_name}' ({self._files[0][0]}): value {bad!r} is not 0 or 1")
        num16 = None
        if spec.num_numerical:
            with np.errstate(over="ignore", invalid="ignore"):  # overflow is reported below, by feature
                num16 = numerical.astype(_NUMERICAL_DTYPE)
        if num16 is not None and n and not np.isfinite(num16).all():
            rows, cols = np.nonzero(~np.isfinite(num16))
            name = spec.numerical_names[cols[0]]
            raise DatasetError(
                f"numerical feature '{name}': value {numerical[rows[0], cols[0]].item()!r} is not finite in float16 "
                f"(max 65504); transform it (e.g. log) before writing"
            )
        if spec.num_categorical and n:
            if not np.issubdtype(categorical.dtype, np.integer):
                raise TypeError(f"categorical ids must be integers, got dtype {categorical.dtype}")
            self._check_ids(categorical)
        self._label.write(label.astype(_LABEL_DTYPE).tobytes())
        if self._numerical is not None:
            self._numerical.write(np.ascontiguousarray(num16).tobytes())
        for j, f in enumerate(self._categorical):
            f.write(np.ascontiguousarray(categorical[:, j].astype(self._dtypes[j])).tobytes())
        self.num_rows += n

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
            try:
                f.close()
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)

    def __del__(self) -> None:
        if getattr(self, "_files", None):
            self.abort()


# ---------------------------------------------------------------------------- reader


class _Column:
    """One open file and how to read rows of it."""

    def __init__(self, path: str, feature: str, dtype: np.dtype, width: int, yaml_path: str):
        self.path = path
        self.feature = feature
        self.dtype = dtype
        self.width = width  # values per row
        self.row_bytes = dtype.itemsize * width
        try:
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise DatasetError(
                f"{path}: file of feature '{feature}' is missing; re-run the transcode/preprocessing "
                f"step or fix its path in {yaml_path}"
            ) from None
        size = os.fstat(self.fd).st_size
        if size % self.row_bytes:
            os.close(self.fd)
            raise DatasetError(
                f"{path}: size {size} bytes is not a multiple of the row size {self.row_bytes} bytes "
                f"(feature '{feature}', dtype {dtype}, {width} value(s) per row); the file is truncated or "
                f"its dtype in {yaml_path} is wrong; re-create it"
            )
        self.rows = size // self.row_bytes

    def read(self, start: int, count: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows [start, start+count) with one positional read into ``out`` (contiguous, of this
        column's dtype and shape) or into a fresh, writable buffer."""
        if out is None:
            out = np.empty((count, self.width) if self.width != 1 else (count,), dtype=self.dtype)
        nbytes = count * self.row_bytes
        got = os.preadv(self.fd, [memoryview(out).cast("B")], start * self.row_bytes) if nbytes else 0
        if got != nbytes:
            raise DatasetError(
                f"{self.path}: short read of feature '{self.feature}' ({got} of {nbytes} bytes at row {start}); "
                f"the file changed while training"
            )
        return out

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class SplitBinaryReader:
    """Random access to batches of one split; reads only the columns asked for.

    ``categorical_features`` selects categorical channel indices (a rank in multi-device
    training reads only its own tables). Parts not read come back as empty tensors ``[B, 0]``.
    """

    def __init__(
        self,
        spec: FeatureSpec,
        split: str,
        batch_size: int,
        categorical_features: Sequence[int] | None = None,
        read_numerical: bool = True,
        read_label: bool = True,
        check_ids: bool = True,
        drop_last_batch: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        paths = spec.paths(split)
        n_cat = spec.num_categorical
        if categorical_features is None:
            categorical_features = range(n_cat)
        self.categorical_features = [int(i) for i in categorical_features]
        for i in self.categorical_features:
            if not 0 <= i < n_cat:
                raise ValueError(f"categorical feature index {i} out of range; the spec has {n_cat} categorical features")
        self.spec = spec
        self.split = split
        self.batch_size = int(batch_size)
        self.check_ids = check_ids
        self.validated = False  # set by validate(): every value was checked, batches need not be
        self.drop_last_batch = drop_last_batch
        yaml_path = os.path.join(spec.base_directory or ".", "feature_spec.yaml")
        names, dtypes, cards = spec.categorical_names, spec.categorical_dtypes, spec.cardinalities
        self._label: _Column | None = None
        self._numerical: _Column | None = None
        self._categorical: list[_Column] = []
        self._cardinalities = [cards[i] for i in self.categorical_features]
        try:
            if read_label:
                self._label = _Column(paths.label, spec.label_name, _LABEL_DTYPE, 1, yaml_path)
            if read_numerical and paths.numerical is not None:
                self._numerical = _Column(
                    paths.numerical, f"numerical ({spec.num_numerical} features)", _NUMERICAL_DTYPE, spec.num_numerical, yaml_path
                )
            for i in self.categorical_features:
                self._categorical.append(_Column(paths.categorical[i], names[i], dtypes[i], 1, yaml_path))
            self.num_samples = self._common_rows(paths.label, yaml_path)
        except BaseException:
            self.close()
            raise
        self._num_numerical = spec.num_numerical if read_numerical else 0
        sel = [dtypes[i] for i in self.categorical_features]
        self._categorical_dtype = max(sel, key=lambda d: d.itemsize) if sel else _EMPTY_CATEGORICAL_DTYPE

    def _columns(self) -> list[_Column]:
        return [c for c in (self._label, self._numerical) if c is not None] + self._categorical

    def _common_rows(self, label_path: str, yaml_path: str) -> int:
        cols = self._columns()
        if not cols:  # nothing selected: the label file still defines the sample count
            probe = _Column(label_path, self.spec.label_name, _LABEL_DTYPE, 1, yaml_path)
            probe.close()
            return probe.rows
        counts = {c.path: c.rows for c in cols}
        if len(set(counts.values())) > 1:
            listing = "; ".join(f"{p}: {r} rows" for p, r in counts.items())
            raise DatasetError(
                f"files of split '{self.split}' disagree on the number of rows ({listing}); "
                f"they must all come from the same write; re-create the split"
            )
        return cols[0].rows

    def __len__(self) -> int:
        if self.drop_last_batch:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def read_batch(self, index: int) -> Batch:
        """Batch ``index``: rows [index*B, (index+1)*B), the last one possibly shorter."""
        if not 0 <= index < len(self):
            raise IndexError(f"batch {index} out of range for {len(self)} batches of split '{self.split}'")
        start = index * self.batch_size
        return self.read_rows(start, min(self.batch_size, self.num_samples - start))

    def read_rows(self, start: int, count: int) -> Batch:
        """Rows [start, start+count) of every column this reader reads (one read per file)."""
        if start < 0 or count < 0 or start + count > self.num_samples:
            raise IndexError(f"rows {start}..{start + count} out of range for {self.num_samples} rows of split '{self.split}'")

        if self._label is not None:
            label = self._label.read(start, count)
            if self.check_ids and not self.validated and count and label.view(np.uint8).max() > 1:
                raise DatasetError(f"{self._label.path}: label bytes must be 0 or 1 (rows {start}..{start + count - 1})")
            label_t = torch.from_numpy(label)
        else:
            label_t = torch.empty((count, 0), dtype=torch.bool)

        if self._numerical is not None:
            numerical_t = torch.from_numpy(self._numerical.read(start, count))
        else:
            numerical_t = torch.empty((count, 0), dtype=torch.float16)

        # Feature-major, so every column lands contiguously (read straight into place when its
        # dtype is the common one); the batch gets the [B, F] transposed view.
        categorical = np.empty((len(self._categorical), count), dtype=self._categorical_dtype)
        for j, col in enumerate(self._categorical):
            if col.dtype == categorical.dtype:
                ids = col.read(start, count, out=categorical[j])
            else:
                ids = col.read(start, count)
                categorical[j] = ids
            if self.check_ids and not self.validated and count:
                self._check_ids(ids, col, self._cardinalities[j], start)
        return Batch(numerical=numerical_t, categorical=torch.from_numpy(categorical).t(), label=label_t)

    def validate(self, chunk_rows: int = 1 << 22, threads: int = 4) -> None:
        """Reads every value of every column this reader reads, before any training, and raises
        the error that reading it mid-run would raise: label bytes other than 0/1, non-finite
        numerical values, and (unless ids are hashed) ids outside [0, cardinality). Once it has
        passed, ``read_batch`` skips its per-batch checks (they would find nothing). Columns are
        scanned in parallel in chunks of ``chunk_rows`` rows (vectorised min/max; preadv and numpy
        release the GIL); docs/training.md states the measured speed."""

        def scan(j: int) -> None:
            col = self._columns()[j]
            for start in range(0, self.num_samples, chunk_rows):
                values = col.read(start, min(chunk_rows, self.num_samples - start))
                if col is self._label:
                    if values.size and values.view(np.uint8).max() > 1:
                        row = start + int(np.argmax(values.view(np.uint8) > 1))
                        raise DatasetError(f"{col.path}: label byte {values.view(np.uint8)[row - start]} at row {row} "
                                           "is not 0 or 1; re-create the split")
                elif col is self._numerical:
                    finite = np.isfinite(values)
                    if not finite.all():
                        row, k = (int(v[0]) for v in np.nonzero(~finite))
                        raise DatasetError(
                            f"{col.path}: numerical feature '{self.spec.numerical_names[k]}' is "
                            f"{values[row, k]} at row {start + row}; re-create the split (values must be finite)"
                        )
                elif self.check_ids and values.size:
                    self._check_ids(values, col, self._cardinalities[self._categorical.index(col)], start)

        columns = range(len(self._columns()))
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(columns)))) as pool:
            for _ in pool.map(scan, columns):  # re-raises the first column's error
                pass
        self.validated = True  # reading batches skips the per-batch checks from now on

    @staticmethod
    def _check_ids(ids: np.ndarray, col: _Column, cardinality: int, start: int) -> None:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= cardinality:
            bad = lo if lo < 0 else hi
            row = start + int(np.argmax(ids == bad))
            raise DatasetError(
                f"{col.path}: categorical feature '{col.feature}' has id {bad} at row {row}, outside "
                f"[0, cardinality={cardinality}); fix the cardinality in the feature spec, or pass "
                f"`hash_indices=True` to map ids with id % cardinality"
            )

    def close(self) -> None:
        for col in self._columns():
            col.close()

    def __enter__(self) -> "SplitBinaryReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if hasattr(self, "_categorical"):
            self.close()
