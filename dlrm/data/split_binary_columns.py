"""The columns of the split-binary layout as the reader opens them: a headerless file of rows
(``Column``) and the two multi-hot formats built on it, fixed-size bags padded with -1
(``FixedBags``) and variable-length bags as values plus cumulative offsets (``VariableBags``).

Every size check happens when a column opens, so a bad dataset fails before training starts.
"""

from __future__ import annotations

import os

import numpy as np

from dlrm.data.feature_spec import OFFSETS_DTYPE
from dlrm.engine.errors import DatasetError

LABEL_DTYPE = np.dtype(np.bool_)
NUMERICAL_DTYPE = np.dtype(np.float16)
HIDDEN = "<not shown: the file lies outside the dataset folder>"


def shown(value: object, quote: bool) -> str:
    """``value`` for a message about a file, or HIDDEN when the file lies outside the dataset
    folder (read by the user's choice): no message quotes what such a file holds."""
    return str(value) if quote else HIDDEN


class Column:
    """One open file and how to read rows of it. ``matrix``: rows come as ``[count, width]``
    even when ``width`` is 1 (the numerical file of one feature is still ``[B, 1]``).
    ``quote``: messages may show values read from it (the file lies inside the dataset folder)."""

    def __init__(self, path: str, feature: str, dtype: np.dtype, width: int, yaml_path: str,
                 setting: str | None = "dtype", matrix: bool = False, quote: bool = True):
        self.path = path
        self.feature = feature
        self.dtype = dtype
        self.width = width  # values per row
        self.matrix = matrix
        self.quote = quote
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
            out = np.empty((count, self.width) if self.width != 1 or self.matrix else (count,), dtype=self.dtype)
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


class FixedBags:
    """A fixed-size bag feature: ``bag_size`` ids per row in one ``[rows, bag_size]`` file, unused
    slots holding the padding id (-1)."""

    def __init__(self, path: str, feature: str, dtype: np.dtype, bag_size: int, yaml_path: str, quote: bool = True):
        self.ids = Column(path, feature, dtype, bag_size, yaml_path, setting=f"dtype or `bag_size` ({bag_size})",
                          quote=quote)
        self.quote = quote
        self.path, self.feature, self.dtype, self.bag_size = path, feature, dtype, bag_size
        self.rows = self.ids.rows

    def close(self) -> None:
        self.ids.close()


class VariableBags:
    """A variable-length bag feature: a values file of ids and an offsets file of ``rows + 1``
    int64 values from 0, so row ``r``'s bag is ``values[offsets[r]:offsets[r + 1]]`` and any row
    range costs one read of offsets and one of values."""

    def __init__(self, path: str, offsets_path: str, feature: str, dtype: np.dtype, yaml_path: str,
                 quote: bool = True, quote_offsets: bool = True):
        self.feature, self.dtype = feature, dtype
        self.quote, self.quote_offsets = quote, quote_offsets
        self.values = Column(path, feature, dtype, 1, yaml_path, quote=quote)
        try:
            self.offsets = Column(offsets_path, f"{feature} (offsets)", OFFSETS_DTYPE, 1, yaml_path, setting=None,
                                  quote=quote_offsets)
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
                    f"{offsets_path}: offsets of feature '{feature}' start at {shown(first, quote_offsets)}, not 0; "
                    f"re-create the file"
                )
            if last != self.values.rows:
                raise DatasetError(
                    f"{offsets_path}: offsets of feature '{feature}' end at {shown(last, quote_offsets)}, but its values "
                    f"file {path} holds "
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
            f"({shown(int(offsets[row - start]), self.quote_offsets)} then "
            f"{shown(int(offsets[row - start + 1]), self.quote_offsets)}); offsets must be non-decreasing; "
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
                f"from {shown(lo, self.quote_offsets)} to {shown(hi, self.quote_offsets)}, outside the "
                f"{self.values.rows} ids of its values file; re-create the files"
            )
        if check and count and (offsets[1:] < offsets[:-1]).any():
            raise self.bad_offsets(offsets, start)
        return offsets

    def close(self) -> None:
        self.values.close()
        if hasattr(self, "offsets"):
            self.offsets.close()
