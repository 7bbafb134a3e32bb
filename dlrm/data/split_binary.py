"""Reader of the split-binary layout: one headerless file per column group.

Files carry no batch structure, so batch ``i`` of size ``B`` is rows ``[i*B, (i+1)*B)`` of every
file and the reader fetches it with one positional read per file, straight into a numpy buffer
that torch then wraps without a copy. All size checks happen at construction so that a bad
dataset fails before training starts, not hours into it.

Multi-hot features come as ``Bags``: a fixed-size feature is one ``[rows, L]`` read whose
padding (-1) is dropped with a mask; a variable-length one is a read of ``count + 1`` offsets
and then one read of the values they span (offsets are cumulative for exactly that reason).

The column formats are in ``dlrm.data.split_binary_columns`` and the writer in
``dlrm.data.split_binary_writer`` (``SplitBinaryWriter`` is importable from here too).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from dlrm.data.batch import Bags, Batch
from dlrm.data.feature_spec import PADDING_ID, VARIABLE, FeatureSpec
from dlrm.data.split_binary_columns import LABEL_DTYPE, NUMERICAL_DTYPE, Column, FixedBags, VariableBags, shown
from dlrm.data.split_binary_writer import SplitBinaryWriter
from dlrm.engine.errors import DatasetError

__all__ = ["SplitBinaryReader", "SplitBinaryWriter"]

_EMPTY_CATEGORICAL_DTYPE = np.dtype(np.int64)


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
        self._label: Column | None = None
        self._numerical: Column | None = None
        self._categorical: list[Column | FixedBags | VariableBags] = []
        self._cardinalities = [cards[i] for i in self.categorical_features]
        # Bags when any selected feature is multi-hot; the one-hot [B, F] path is untouched otherwise.
        self._bags = any(spec.is_multi_hot(i) for i in self.categorical_features)
        inside = {p: p not in paths.outside for p in [paths.label, paths.numerical, *paths.categorical,
                                                       *paths.offsets.values()]}  # may messages quote it
        try:
            if read_label:
                self._label = Column(paths.label, spec.label_name, LABEL_DTYPE, 1, yaml_path, quote=inside[paths.label])
            if read_numerical and paths.numerical is not None:
                self._numerical = Column(  # [B, num_numerical] always, one feature too
                    paths.numerical, f"numerical ({spec.num_numerical} features)", NUMERICAL_DTYPE, spec.num_numerical,
                    yaml_path, matrix=True, quote=inside[paths.numerical])
            for i in self.categorical_features:
                size, path = spec.bag_size(i), paths.categorical[i]
                if size is None:
                    self._categorical.append(Column(path, names[i], dtypes[i], 1, yaml_path, quote=inside[path]))
                elif size == VARIABLE:
                    self._categorical.append(VariableBags(path, paths.offsets[i], names[i], dtypes[i], yaml_path,
                                                          inside[path], inside[paths.offsets[i]]))
                else:
                    self._categorical.append(FixedBags(path, names[i], dtypes[i], int(size), yaml_path, inside[path]))
            self.num_samples = self._common_rows(paths.label, yaml_path)
        except BaseException:
            self.close()
            raise
        self._num_numerical = spec.num_numerical if read_numerical else 0
        sel = [dtypes[i] for i in self.categorical_features]
        self._categorical_dtype = max(sel, key=lambda d: d.itemsize) if sel else _EMPTY_CATEGORICAL_DTYPE

    def _columns(self) -> list[Column]:
        return [c for c in (self._label, self._numerical) if c is not None] + self._categorical

    def _common_rows(self, label_path: str, yaml_path: str) -> int:
        cols = self._columns()
        if not cols:  # nothing selected: the label file still defines the sample count
            probe = Column(label_path, self.spec.label_name, LABEL_DTYPE, 1, yaml_path)
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
            if isinstance(col, VariableBags):  # structure: checked even when ids are hashed
                bounds.append(col.read_offsets(start, count, not self.validated))
                slots.append(slots[-1] + int(bounds[-1][-1] - bounds[-1][0]))
            else:
                bounds.append(None)
                slots.append(slots[-1] + count * (col.bag_size if isinstance(col, FixedBags) else 1))
        buffer = np.empty(slots[-1], dtype=self._categorical_dtype)
        offsets = np.empty(features * count + 1, dtype=np.int64)
        offsets[0] = 0
        used, nnz = [], 0  # per feature: the ids kept in its slot; nnz: ids of earlier features
        for j, col in enumerate(self._categorical):
            out = buffer[slots[j]:slots[j + 1]]
            if isinstance(col, VariableBags):
                column, first, rows = col.values, int(bounds[j][0]), out.shape[0]
            else:
                column, first, rows = (col.ids if isinstance(col, FixedBags) else col), start, count
            if column.dtype == buffer.dtype:  # straight into the slot
                column.read(first, rows, out=out.reshape((rows, column.width) if column.width != 1 else (rows,)))
            else:
                out[:] = column.read(first, rows).reshape(-1)
            segment = offsets[j * count:(j + 1) * count + 1]
            if isinstance(col, Column):
                segment[:] = np.arange(nnz, nnz + count + 1)
                if check and count:
                    self._check_ids(out, col, self._cardinalities[j], start)
                kept = out
            elif isinstance(col, FixedBags):
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
                        raise DatasetError(f"{col.path}: label byte {shown(values.view(np.uint8)[row - start], col.quote)} at row {row} "
                                           "is not 0 or 1; re-create the split")
                elif col is self._numerical:
                    finite = np.isfinite(values)
                    if not finite.all():
                        row, k = (int(v[0]) for v in np.nonzero(~finite))
                        raise DatasetError(
                            f"{col.path}: numerical feature '{self.spec.numerical_names[k]}' is "
                            f"{shown(values[row, k], col.quote)} at row {start + row}; re-create the split (values must be finite)"
                        )
                elif self.check_ids and values.size:
                    self._check_ids(values, col, self._cardinalities[self._categorical.index(col)], start)

        def scan_bags(col: FixedBags | VariableBags) -> None:
            cardinality = self._cardinalities[self._categorical.index(col)]
            if isinstance(col, FixedBags):
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
            if isinstance(col, (FixedBags, VariableBags)):
                scan_bags(col)
            else:
                scan(j)

        columns = range(len(self._columns()))
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(columns)))) as pool:
            for _ in pool.map(scan_any, columns):  # re-raises the first column's error
                pass
        self.validated = True  # reading batches skips the per-batch checks from now on

    @staticmethod
    def _raise_bad_id(col: Column | FixedBags | VariableBags, bad: int, row: int, cardinality: int,
                      padded: bool = False) -> None:
        where = col.ids.path if isinstance(col, FixedBags) else col.values.path if isinstance(col, VariableBags) else col.path
        padding = f" (besides the padding id {PADDING_ID})" if padded else ""
        raise DatasetError(
            f"{where}: categorical feature '{col.feature}' has id {shown(bad, col.quote)} at row {row}, outside "
            f"[0, cardinality={cardinality}){padding}; fix the cardinality in the feature spec, or pass "
            f"`hash_indices=True` to map ids with id % cardinality"
        )

    @classmethod
    def _check_bag_ids(cls, ids: np.ndarray, bounds: np.ndarray, col: FixedBags | VariableBags, cardinality: int,
                       start: int, padded: bool = False) -> None:
        """Ids of the bags of rows start.. (``bounds``: count + 1 offsets into ``ids``) in range."""
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= cardinality:
            bad = lo if lo < 0 else hi
            row = start + int(np.searchsorted(bounds, int(np.argmax(ids == bad)), side="right")) - 1
            cls._raise_bad_id(col, bad, row, cardinality, padded)

    @staticmethod
    def _check_ids(ids: np.ndarray, col: Column, cardinality: int, start: int) -> None:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= cardinality:
            bad = lo if lo < 0 else hi
            row = start + int(np.argmax(ids == bad))
            raise DatasetError(
                f"{col.path}: categorical feature '{col.feature}' has id {shown(bad, col.quote)} at row {row}, outside "
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
