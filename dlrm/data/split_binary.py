"""Reader and writer for the split-binary layout: one headerless file per column group.

Files carry no batch structure, so batch ``i`` of size ``B`` is rows ``[i*B, (i+1)*B)`` of every
file and the reader fetches it with one positional read per file, straight into a numpy buffer
that torch then wraps without a copy. All size checks happen at construction so that a bad
dataset fails before training starts, not hours into it.

Multi-hot features come as ``Bags``: a fixed-size feature is one ``[rows, L]`` read whose
padding (-1) is dropped with a mask; a variable-length one is a read of ``count + 1`` offsets
and then one read of the values they span (offsets are cumulative for exactly that reason).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO, Sequence

import numpy as np
import torch

from dlrm.data.atomic import remove_stale_temporaries, temporary_name
from dlrm.data.batch import Bags, Batch
from dlrm.data.errors import DatasetError
from dlrm.data.feature_spec import OFFSETS_DTYPE, PADDING_ID, VARIABLE, FeatureSpec

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
                num16 = numerical.astype(_NUMERICAL_DTYPE)
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
        self._label.write(label.astype(_LABEL_DTYPE).tobytes())
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


# ---------------------------------------------------------------------------- reader


class _Column:
    """One open file and how to read rows of it."""

    def __init__(self, path: str, feature: str, dtype: np.dtype, width: int, yaml_path: str,
                 setting: str | None = "dtype"):
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
                f"(feature '{feature}', dtype {dtype}, {width} value(s) per row); the file is truncated"
                + (f" or its {setting} in {yaml_path} is wrong" if setting else "") + "; re-create it"
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


class _FixedBags:
    """A fixed-size bag feature: ``bag_size`` ids per row in one ``[rows, bag_size]`` file, unused
    slots holding the padding id (-1)."""

    def __init__(self, path: str, feature: str, dtype: np.dtype, bag_size: int, yaml_path: str):
        self.ids = _Column(path, feature, dtype, bag_size, yaml_path, setting=f"dtype or `bag_size` ({bag_size})")
        self.path, self.feature, self.dtype, self.bag_size = path, feature, dtype, bag_size
        self.rows = self.ids.rows

    def close(self) -> None:
        self.ids.close()


class _VariableBags:
    """A variable-length bag feature: a values file of ids and an offsets file of ``rows + 1``
    int64 values from 0, so row ``r``'s bag is ``values[offsets[r]:offsets[r + 1]]`` and any row
    range costs one read of offsets and one of values."""

    def __init__(self, path: str, offsets_path: str, feature: str, dtype: np.dtype, yaml_path: str):
        self.feature, self.dtype = feature, dtype
        self.values = _Column(path, feature, dtype, 1, yaml_path)
        try:
            self.offsets = _Column(offsets_path, f"{feature} (offsets)", OFFSETS_DTYPE, 1, yaml_path, setting=None)
        except BaseException:
            self.values.close()
            raise
        self.path = offsets_path  # the file that says how many rows the feature has
        try:
            if self.offsets.rows == 0:
                raise DatasetError(
                    f"{offsets_path}: offsets file of feature '{feature}' is empty; it holds rows + 1 int64 "
                    f"values starting with 0; re-create it"
                )
            self.rows = self.offsets.rows - 1
            first = int(self.offsets.read(0, 1)[0])
            last = int(self.offsets.read(self.rows, 1)[0])
            if first != 0:
                raise DatasetError(
                    f"{offsets_path}: offsets of feature '{feature}' start at {first}, not 0; re-create the file"
                )
            if last != self.values.rows:
                raise DatasetError(
                    f"{offsets_path}: offsets of feature '{feature}' end at {last}, but its values file {path} holds "
                    f"{self.values.rows} ids; the two files do not belong together (or one is truncated); "
                    f"re-create them"
                )
        except BaseException:
            self.close()
            raise

    def bad_offsets(self, offsets: np.ndarray, start: int) -> DatasetError:
        row = start + int(np.argmax(offsets[1:] < offsets[:-1]))
        return DatasetError(
            f"{self.offsets.path}: offsets of feature '{self.feature}' decrease after row {row} "
            f"({int(offsets[row - start])} then {int(offsets[row - start + 1])}); offsets must be non-decreasing; "
            f"re-create the file"
        )

    def row_of(self, index: int) -> int:
        """The row whose bag holds id ``index`` of the values file, bisecting the (checked,
        non-decreasing) offsets on disk: a few 8-byte reads, however large the file."""
        lo, hi = 0, self.rows - 1  # the last row r with offsets[r] <= index
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if int(self.offsets.read(mid, 1)[0]) <= index:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def read_offsets(self, start: int, count: int, check: bool) -> np.ndarray:
        """Offsets ``[start, start+count]`` (count + 1 values); within the values file always,
        checked to be non-decreasing when ``check``."""
        offsets = self.offsets.read(start, count + 1)
        lo, hi = int(offsets[0]), int(offsets[-1])
        if lo < 0 or hi > self.values.rows or lo > hi:
            raise DatasetError(
                f"{self.offsets.path}: offsets of feature '{self.feature}' for rows {start}..{start + count} run "
                f"from {lo} to {hi}, outside the {self.values.rows} ids of its values file; re-create the files"
            )
        if check and count and (offsets[1:] < offsets[:-1]).any():
            raise self.bad_offsets(offsets, start)
        return offsets

    def close(self) -> None:
        self.values.close()
        if hasattr(self, "offsets"):
            self.offsets.close()


class SplitBinaryReader:
    """Random access to batches of one split; reads only the columns asked for.

    ``categorical_features`` selects categorical channel indices (a rank in multi-device
    training reads only its own tables). Parts not read come back as empty tensors ``[B, 0]``.
    When any selected feature is multi-hot, the ids come as ``Bags`` of every selected feature
    (one-hot ones as bags of one), in selection order; otherwise as ``[B, F]``.
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
        self._categorical: list[_Column | _FixedBags | _VariableBags] = []
        self._cardinalities = [cards[i] for i in self.categorical_features]
        # Bags when any selected feature is multi-hot; the one-hot [B, F] path is untouched otherwise.
        self._bags = any(spec.is_multi_hot(i) for i in self.categorical_features)
        try:
            if read_label:
                self._label = _Column(paths.label, spec.label_name, _LABEL_DTYPE, 1, yaml_path)
            if read_numerical and paths.numerical is not None:
                self._numerical = _Column(
                    paths.numerical, f"numerical ({spec.num_numerical} features)", _NUMERICAL_DTYPE, spec.num_numerical, yaml_path
                )
            for i in self.categorical_features:
                size = spec.bag_size(i)
                if size is None:
                    self._categorical.append(_Column(paths.categorical[i], names[i], dtypes[i], 1, yaml_path))
                elif size == VARIABLE:
                    self._categorical.append(_VariableBags(paths.categorical[i], paths.offsets[i], names[i], dtypes[i], yaml_path))
                else:
                    self._categorical.append(_FixedBags(paths.categorical[i], names[i], dtypes[i], int(size), yaml_path))
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
        if self._bags:
            return self._read_bag_rows(start, count)
        numerical_t, label_t = self._dense_rows(start, count)
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

    def _dense_rows(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(numerical, label) of rows [start, start+count), as ``read_rows`` returns them."""
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
        return numerical_t, label_t

    def _read_bag_rows(self, start: int, count: int) -> Batch:
        """``read_rows`` when a selected feature is multi-hot: the ids as feature-major ``Bags``.

        Each feature gets a slot in one values buffer (``count`` ids one-hot, ``count * L``
        fixed-size, what its offsets span variable-length) and is read straight into it (one
        positional read, as for one-hot columns); fixed-size blocks with padding are compacted
        afterwards. Vectorised per feature; no loop over rows."""
        numerical_t, label_t = self._dense_rows(start, count)
        check = self.check_ids and not self.validated
        features = len(self._categorical)
        bounds, slots = [], [0]
        for col in self._categorical:
            if isinstance(col, _VariableBags):  # structure: checked even when ids are hashed
                bounds.append(col.read_offsets(start, count, not self.validated))
                slots.append(slots[-1] + int(bounds[-1][-1] - bounds[-1][0]))
            else:
                bounds.append(None)
                slots.append(slots[-1] + count * (col.bag_size if isinstance(col, _FixedBags) else 1))
        buffer = np.empty(slots[-1], dtype=self._categorical_dtype)
        offsets = np.empty(features * count + 1, dtype=np.int64)
        offsets[0] = 0
        used, nnz = [], 0  # per feature: the ids kept in its slot; nnz: ids of earlier features
        for j, col in enumerate(self._categorical):
            out = buffer[slots[j]:slots[j + 1]]
            if isinstance(col, _VariableBags):
                column, first, rows = col.values, int(bounds[j][0]), out.shape[0]
            else:
                column, first, rows = (col.ids if isinstance(col, _FixedBags) else col), start, count
            if column.dtype == buffer.dtype:  # straight into the slot
                column.read(first, rows, out=out.reshape((rows, column.width) if column.width != 1 else (rows,)))
            else:
                out[:] = column.read(first, rows).reshape(-1)
            segment = offsets[j * count:(j + 1) * count + 1]
            if isinstance(col, _Column):
                segment[:] = np.arange(nnz, nnz + count + 1)
                if check and count:
                    self._check_ids(out, col, self._cardinalities[j], start)
                kept = out
            elif isinstance(col, _FixedBags):
                kept = out
                if out.size and int(out.min()) < 0:  # padding (or negative ids): drop the padding
                    block = out.reshape(count, col.bag_size)
                    keep = block != PADDING_ID
                    kept = block[keep]
                    segment[0] = nnz
                    np.cumsum(np.count_nonzero(keep, axis=1), out=segment[1:])
                    segment[1:] += nnz
                else:
                    segment[:] = np.arange(nnz, nnz + out.shape[0] + 1, col.bag_size)
                if check and kept.size:
                    self._check_bag_ids(kept, segment - nnz, col, self._cardinalities[j], start, padded=True)
            else:
                segment[:] = bounds[j] - (int(bounds[j][0]) - nnz)
                kept = out
                if check and kept.size:
                    self._check_bag_ids(kept, segment - nnz, col, self._cardinalities[j], start)
            used.append(kept)
            nnz += kept.shape[0]
        values = buffer if nnz == buffer.shape[0] else np.concatenate(used)
        bags = Bags(torch.from_numpy(values), torch.from_numpy(offsets), features)
        return Batch(numerical=numerical_t, categorical=bags, label=label_t)

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

        def scan_bags(col: _FixedBags | _VariableBags) -> None:
            cardinality = self._cardinalities[self._categorical.index(col)]
            if isinstance(col, _FixedBags):
                for start in range(0, col.rows, chunk_rows):
                    block = col.ids.read(start, min(chunk_rows, col.rows - start)).reshape(-1, col.bag_size)
                    if self.check_ids and block.size and (block.min() < PADDING_ID or block.max() >= cardinality):
                        bad = (block < PADDING_ID) | (block >= cardinality)
                        row = int(np.argmax(bad.any(axis=1)))
                        self._raise_bad_id(col, int(block[row][bad[row]][0]), start + row, cardinality, padded=True)
                return
            # Offsets: from 0 (checked when opened), non-decreasing across chunk boundaries too
            # (consecutive chunks share one offset), ending at the number of ids (also checked).
            for start in range(0, col.rows, chunk_rows):
                bounds = col.offsets.read(start, min(chunk_rows, col.rows - start) + 1)
                if (bounds[1:] < bounds[:-1]).any():
                    raise col.bad_offsets(bounds, start)
            if not self.check_ids:
                return
            for first in range(0, col.values.rows, chunk_rows):
                ids = col.values.read(first, min(chunk_rows, col.values.rows - first))
                if ids.size and (ids.min() < 0 or ids.max() >= cardinality):
                    index = first + int(np.argmax((ids < 0) | (ids >= cardinality)))
                    self._raise_bad_id(col, int(col.values.read(index, 1)[0]), col.row_of(index), cardinality)

        def scan_any(j: int) -> None:
            col = self._columns()[j]
            if isinstance(col, (_FixedBags, _VariableBags)):
                scan_bags(col)
            else:
                scan(j)

        columns = range(len(self._columns()))
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(columns)))) as pool:
            for _ in pool.map(scan_any, columns):  # re-raises the first column's error
                pass
        self.validated = True  # reading batches skips the per-batch checks from now on

    @staticmethod
    def _raise_bad_id(col: _Column | _FixedBags | _VariableBags, bad: int, row: int, cardinality: int,
                      padded: bool = False) -> None:
        where = col.ids.path if isinstance(col, _FixedBags) else col.values.path if isinstance(col, _VariableBags) else col.path
        padding = f" (besides the padding id {PADDING_ID})" if padded else ""
        raise DatasetError(
            f"{where}: categorical feature '{col.feature}' has id {bad} at row {row}, outside "
            f"[0, cardinality={cardinality}){padding}; fix the cardinality in the feature spec, or pass "
            f"`hash_indices=True` to map ids with id % cardinality"
        )

    @classmethod
    def _check_bag_ids(cls, ids: np.ndarray, bounds: np.ndarray, col: _FixedBags | _VariableBags, cardinality: int,
                       start: int, padded: bool = False) -> None:
        """Ids of the bags of rows start.. (``bounds``: count + 1 offsets into ``ids``) in range."""
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= cardinality:
            bad = lo if lo < 0 else hi
            row = start + int(np.searchsorted(bounds, int(np.argmax(ids == bad)), side="right")) - 1
            cls._raise_bad_id(col, bad, row, cardinality, padded)

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
