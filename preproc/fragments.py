"""Transformed rows between the transform and the final write: packed records in fragment files.

A fragment holds the rows of one split (and one shuffle bucket) produced by one unit of work
(an input file, or a Spark task). Records are packed little-endian numpy structs: the row's
position, its shuffle key (shuffled train rows only), label, 13 float16 values and the 26 ids
in the dtypes of the final files. ``assemble`` concatenates or sorts fragments into the dataset.

Imported by Spark's Python workers: numpy only.
"""

from __future__ import annotations

import os

import numpy as np

NUM_NUMERICAL = 13


def record_dtype(categorical_dtypes: list, keyed: bool) -> np.dtype:
    fields: list = [("pos", "<i8")]
    if keyed:
        fields.append(("key", "<i8"))
    fields += [("label", "u1"), ("num", "<f2", (NUM_NUMERICAL,))]
    fields += [(f"c{j}", np.dtype(d).newbyteorder("<")) for j, d in enumerate(categorical_dtypes)]
    return np.dtype(fields)


def make_records(dtype: np.dtype, pos: np.ndarray, key: np.ndarray | None, label: np.ndarray, numerical: np.ndarray,
                 ids: np.ndarray) -> np.ndarray:
    rec = np.empty(len(pos), dtype=dtype)
    rec["pos"] = pos
    if key is not None:
        rec["key"] = key
    rec["label"] = label
    rec["num"] = numerical
    for j in range(ids.shape[1]):
        rec[f"c{j}"] = ids[:, j]
    return rec


def fragment_name(split: str, bucket: int, part: int | None = None) -> str:
    return f"{split}.b{bucket}" + ("" if part is None else f".p{part:06d}") + ".rec"


class FragmentFiles:
    """Open fragment files of one unit of work, appended to as rows arrive."""

    def __init__(self, directory: str, suffix: str = ""):
        self.directory = directory
        self.suffix = suffix  # appended to names while writing (a Spark task's attempt)
        self.rows: dict[tuple[str, int], int] = {}
        self._files: dict[tuple[str, int], object] = {}
        self._names: dict[tuple[str, int], str] = {}

    def append(self, split: str, bucket: int, records: np.ndarray, part: int | None = None) -> None:
        if len(records) == 0:
            return
        k = (split, bucket)
        if k not in self._files:
            name = fragment_name(split, bucket, part)
            self._names[k] = name
            self._files[k] = open(os.path.join(self.directory, name + self.suffix), "wb")
            self.rows[k] = 0
        records.tofile(self._files[k])
        self.rows[k] += len(records)

    def close(self) -> dict[tuple[str, int], str]:
        """Flush, fsync and (with a suffix) rename to the final names; returns the names."""
        for k, f in self._files.items():
            f.flush()
            os.fsync(f.fileno())
            f.close()
            if self.suffix:
                path = os.path.join(self.directory, self._names[k])
                os.replace(path + self.suffix, path)
        self._files = {}
        return dict(self._names)

    def abort(self) -> None:
        for k, f in self._files.items():
            f.close()
            path = os.path.join(self.directory, self._names[k] + self.suffix)
            if os.path.exists(path):
                os.unlink(path)
        self._files = {}
