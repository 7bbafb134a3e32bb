"""On-disk CSR datasets of sparse rows (user histories for the sparse autoencoder), read in
batches straight from memory-mapped files.

DSSTNE loaded a whole NetCDF dataset onto the GPU and large catalogues ran out of memory; here
the rows stay on disk and a batch costs two slices of memory-mapped arrays. A dataset is a
directory:

    header.json   format, version, n_samples, n_features, nnz, has_values, dtypes (written last)
    offsets.bin   int64 [n_samples + 1], offsets[0] == 0, non-decreasing, offsets[-1] == nnz
    indices.bin   int32 [nnz], feature (item) indices in [0, n_features)
    values.bin    float32 [nnz], only when has_values (ratings, weights)

Row ``r`` holds ``indices[offsets[r]:offsets[r + 1]]``. The directory is built under a
temporary name beside the target and renamed into place when complete, so a failed or killed
write never replaces a good dataset with a partial one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import numpy as np
import torch

from dlrm.engine.atomic import StagedWriter, check_writable_dir, fsync_dir, remove_stale_temporaries, replace_dir, temporary_name
from dlrm.engine.storage import writing
from dlrm.engine.errors import DatasetError
from dlrm.engine.outputs import OutputKind, holds_only

FORMAT = "dlrm-csr"
VERSION = 1
HEADER = "header.json"
OFFSETS, INDICES, VALUES = "offsets.bin", "indices.bin", "values.bin"
OFFSETS_DTYPE, INDICES_DTYPE, VALUES_DTYPE = np.dtype("<i8"), np.dtype("<i4"), np.dtype("<f4")
_MAX_FEATURES = int(np.iinfo(np.int32).max) + 1  # indices are int32
_CHECK_CHUNK = 1 << 22  # elements per validation step: bounded memory on any dataset size


@dataclass
class CsrRows:
    """Sparse rows in memory: row ``r`` is ``indices[offsets[r]:offsets[r + 1]]`` (with
    ``values`` alongside, or None for indicator features). The unit that parsers and
    generators hand to ``write_csr`` and that ``CsrDataset.rows`` returns."""

    offsets: np.ndarray  # int64 [n_samples + 1]
    indices: np.ndarray  # integer [nnz]
    values: np.ndarray | None  # float32 [nnz] or None
    n_features: int

    @property
    def n_samples(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def nnz(self) -> int:
        return int(self.indices.shape[0])

    def row(self, r: int) -> np.ndarray:
        return self.indices[self.offsets[r]:self.offsets[r + 1]]


# ---------------------------------------------------------------------------- writer


def is_csr_dataset(path: str) -> bool:
    """Whether directory ``path`` holds a CSR dataset of ``CsrWriter`` and nothing else: its
    arrays and a header of this format."""
    if not holds_only(path, [HEADER, OFFSETS, INDICES, VALUES], required=[HEADER]):
        return False
    try:
        with open(os.path.join(path, HEADER), encoding="utf-8") as f:
            header = json.loads(f.read(1 << 16))
    except (OSError, ValueError):
        return False
    return isinstance(header, dict) and header.get("format") == FORMAT


CSR_DATASET = OutputKind("CSR dataset", directory=True, recognise=is_csr_dataset)


class CsrWriter(StagedWriter):
    """Appends rows to a new CSR dataset at ``path``; the dataset appears only on a clean close.

    Use as a context manager. Files are written in a staging directory beside ``path`` (named
    as ``atomic.temporary_name`` names it, so a killed writer's staging is removed by the next
    write); ``close`` writes the header last, syncs, and renames the directory into place. An
    existing CSR dataset at ``path`` is replaced only when ``overwrite`` and only after the new
    one is complete; an exception leaves it untouched (and a write the file system refuses is a
    ``StorageError`` naming the dataset). Anything else at ``path`` (a folder holding other
    files, a link) is an ``OutputError`` (``dlrm.engine.outputs``), whatever ``overwrite`` says;
    ``setting`` is how its message names ``path``.
    """

    def __init__(self, path: str | os.PathLike, n_features: int, has_values: bool, overwrite: bool = False,
                 setting: str = "path"):
        self.path = os.path.abspath(os.fspath(path))
        if not 0 <= int(n_features) <= _MAX_FEATURES:
            raise ValueError(f"n_features must be in [0, {_MAX_FEATURES}] (indices are int32), got {n_features}")
        self.n_features, self.has_values, self.overwrite = int(n_features), bool(has_values), overwrite
        self.setting = setting
        check_writable_dir(self.path, CSR_DATASET, setting, overwrite, "the dataset")
        self.n_samples = 0
        self.nnz = 0
        self._staging: str | None = None
        self._files: list[BinaryIO] = []
        with self._writing():
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            remove_stale_temporaries(self.path)
            self._staging = temporary_name(self.path)
            os.mkdir(self._staging)  # not mkdtemp: datasets are shared, so the usual permissions
            self._offsets = self._open(OFFSETS)
            self._indices = self._open(INDICES)
            self._values = self._open(VALUES) if has_values else None
            self._offsets.write(np.zeros(1, OFFSETS_DTYPE).tobytes())

    def _writing(self) -> contextlib.AbstractContextManager[None]:
        """Any error aborts (the staging goes); the file system's refusals become a StorageError."""
        return writing(self.path, "the dataset", cleanup=self.abort)

    def _open(self, name: str) -> BinaryIO:
        f = open(os.path.join(self._staging, name), "wb")
        self._files.append(f)
        return f

    def write(self, offsets: np.ndarray, indices: np.ndarray, values: np.ndarray | None = None) -> None:
        """Append rows given as batch-relative CSR (``offsets`` has rows + 1 entries from 0);
        checked first, so a bad batch raises before anything of it is written."""
        if self._staging is None:
            raise RuntimeError(f"CSR writer for {self.path} is already closed")
        offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        indices = np.asarray(indices).reshape(-1)
        where = f"rows {self.n_samples}.. written to {self.path}"
        if offsets.shape[0] < 1 or offsets[0] != 0 or offsets[-1] != indices.shape[0] \
                or (np.diff(offsets) < 0).any():
            raise DatasetError(f"{where}: offsets must run non-decreasing from 0 to the number of indices "
                               f"({indices.shape[0]})")
        if indices.size:
            if not np.issubdtype(indices.dtype, np.integer):
                raise TypeError(f"feature indices must be integers, got dtype {indices.dtype}")
            lo, hi = int(indices.min()), int(indices.max())
            if lo < 0 or hi >= self.n_features:
                raise DatasetError(f"{where}: feature index {lo if lo < 0 else hi} is outside [0, {self.n_features})")
        if self.has_values != (values is not None):
            raise ValueError(f"{where}: the dataset {'has' if self.has_values else 'has no'} values; "
                             f"pass values {'with' if self.has_values else 'never with'} every batch")
        if values is not None:
            values = np.asarray(values, dtype=VALUES_DTYPE).reshape(-1)
            if values.shape != indices.shape:
                raise DatasetError(f"{where}: {values.shape[0]} values for {indices.shape[0]} indices")
            if not np.isfinite(values).all():
                bad = int(np.argmax(~np.isfinite(values)))
                raise DatasetError(f"{where}: value {values[bad]!r} at position {self.nnz + bad} is not finite")
        with self._writing():
            self._offsets.write((offsets[1:] + self.nnz).astype(OFFSETS_DTYPE).tobytes())
            self._indices.write(indices.astype(INDICES_DTYPE).tobytes())
            if self._values is not None:
                self._values.write(values.tobytes())
        self.n_samples += offsets.shape[0] - 1
        self.nnz += int(indices.shape[0])

    def write_rows(self, rows: CsrRows) -> None:
        self.write(rows.offsets - rows.offsets[0], rows.indices, rows.values)

    def close(self) -> None:
        """Sync the arrays, write the header last, and rename the directory into place."""
        if self._staging is None:
            return
        with self._writing():
            for f in self._files:
                f.flush()
                os.fsync(f.fileno())
                f.close()
            self._files = []
            header = {
                "format": FORMAT, "version": VERSION, "n_samples": self.n_samples, "n_features": self.n_features,
                "nnz": self.nnz, "has_values": self.has_values,
                "dtypes": {"offsets": OFFSETS_DTYPE.str, "indices": INDICES_DTYPE.str,
                           **({"values": VALUES_DTYPE.str} if self.has_values else {})},
            }
            with open(os.path.join(self._staging, HEADER), "w", encoding="utf-8") as f:
                json.dump(header, f, indent=1)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(self._staging)
            replace_dir(self._staging, self.path, CSR_DATASET, self.setting, self.overwrite)
        self._staging = None

    def abort(self) -> None:
        """Drop everything written; a previous dataset at the target stays as it was."""
        staging, self._staging = self._staging, None
        for f in self._files:
            with contextlib.suppress(OSError):  # a full disk fails the flush of a file being dropped anyway
                f.close()
        self._files = []
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)

    def __del__(self) -> None:
        if getattr(self, "_staging", None) is not None:
            self.abort()


def write_csr(path: str | os.PathLike, rows: CsrRows, overwrite: bool = False) -> None:
    """Write in-memory rows as a CSR dataset (atomically, see ``CsrWriter``)."""
    with CsrWriter(path, rows.n_features, rows.values is not None, overwrite=overwrite) as writer:
        writer.write_rows(rows)


# ---------------------------------------------------------------------------- reader


def _map(path: str, dtype: np.dtype, count: int) -> np.ndarray:
    """A read-only memory map of ``count`` items (np.memmap refuses empty files)."""
    if count == 0:
        return np.zeros(0, dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


class CsrDataset:
    """Read access to a CSR dataset: header checked, file sizes checked against it (a truncated
    file fails here, not mid-epoch), arrays memory-mapped so only touched pages are read.

    ``batch(start, stop)`` returns torch tensors for ``F.embedding_bag(..., offsets,
    include_last_offset=True, per_sample_weights=values)``. Opening checks the contents too
    (``validate``: offsets non-decreasing from 0 to nnz, every index in [0, n_features), values
    finite; vectorised, in bounded chunks), so every reader (training, prediction, evaluation)
    refuses a bad dataset with one ``DatasetError`` before any work; ``check=False`` skips that
    scan for a caller that reads the header only.
    """

    def __init__(self, path: str | os.PathLike, check: bool = True):
        self.path = os.path.abspath(os.fspath(path))
        header_path = os.path.join(self.path, HEADER)
        try:
            with open(header_path, encoding="utf-8") as f:
                header = json.load(f)
        except FileNotFoundError:
            raise DatasetError(f"{header_path}: missing; {self.path} is not a complete CSR dataset "
                               f"(its header is written last); re-create it") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DatasetError(f"{header_path}: not valid JSON ({e}); re-create the dataset") from None
        self.header = header
        self._check_header(header, header_path)
        self.n_samples, self.n_features = int(header["n_samples"]), int(header["n_features"])
        self.nnz, self.has_values = int(header["nnz"]), bool(header["has_values"])
        self.offsets_path = os.path.join(self.path, OFFSETS)
        self.indices_path = os.path.join(self.path, INDICES)
        self.values_path = os.path.join(self.path, VALUES) if self.has_values else None
        expected = [(self.offsets_path, OFFSETS_DTYPE, self.n_samples + 1), (self.indices_path, INDICES_DTYPE, self.nnz)]
        if self.values_path:
            expected.append((self.values_path, VALUES_DTYPE, self.nnz))
        for file, dtype, count in expected:
            try:
                size = os.path.getsize(file)
            except FileNotFoundError:
                raise DatasetError(f"{file}: missing from the CSR dataset; re-create the dataset") from None
            if size != count * dtype.itemsize:
                what = "truncated" if size < count * dtype.itemsize else "longer than its header says"
                raise DatasetError(
                    f"{file}: {size} bytes, but {header_path} says {count} {dtype.name} values "
                    f"({count * dtype.itemsize} bytes); the file is {what}; re-create the dataset"
                )
        self.offsets = _map(self.offsets_path, OFFSETS_DTYPE, self.n_samples + 1)
        self.indices = _map(self.indices_path, INDICES_DTYPE, self.nnz)
        self.values = _map(self.values_path, VALUES_DTYPE, self.nnz) if self.values_path else None
        first, last = int(self.offsets[0]), int(self.offsets[-1])
        if first != 0:
            raise DatasetError(f"{self.offsets_path}: offsets start at {first} (position 0), not 0; re-create the dataset")
        if last != self.nnz:
            raise DatasetError(f"{self.offsets_path}: offsets end at {last} (position {self.n_samples}), but the "
                               f"header says nnz = {self.nnz}; re-create the dataset")
        if check:
            self.validate()

    @staticmethod
    def _check_header(header: object, header_path: str) -> None:
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise DatasetError(f"{header_path}: not a CSR dataset header (needs \"format\": \"{FORMAT}\")")
        if header.get("version") != VERSION:
            raise DatasetError(f"{header_path}: format version {header.get('version')!r} is not supported "
                               f"(this reader knows version {VERSION}); re-create the dataset with this version")
        for key in ("n_samples", "n_features", "nnz"):
            value = header.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise DatasetError(f"{header_path}: `{key}` must be a non-negative integer, got {value!r}")
        if header["n_features"] > _MAX_FEATURES:  # before anything is sized by it (a model's item layers)
            raise DatasetError(f"{header_path}: `n_features` = {header['n_features']:,} is above {_MAX_FEATURES:,}, "
                               f"the most a CSR dataset can index (its indices are int32); re-create the dataset")
        if not isinstance(header.get("has_values"), bool):
            raise DatasetError(f"{header_path}: `has_values` must be true or false, got {header.get('has_values')!r}")
        dtypes = header.get("dtypes")
        wanted = {"offsets": OFFSETS_DTYPE, "indices": INDICES_DTYPE}
        if header["has_values"]:
            wanted["values"] = VALUES_DTYPE
        if not isinstance(dtypes, dict):
            raise DatasetError(f"{header_path}: `dtypes` must map each array to its dtype")
        for name, dtype in wanted.items():
            try:
                ok = np.dtype(dtypes.get(name)) == dtype
            except TypeError:
                ok = False
            if not ok:
                raise DatasetError(f"{header_path}: `dtypes.{name}` is {dtypes.get(name)!r}, this reader needs "
                                   f"{dtype.str!r} ({dtype.name})")

    def __len__(self) -> int:
        return self.n_samples

    def lengths(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Features per sample for samples [start, stop)."""
        stop = self.n_samples if stop is None else stop
        return np.diff(np.asarray(self.offsets[start:stop + 1]))

    def rows(self, start: int = 0, stop: int | None = None, check: bool = True) -> CsrRows:
        """Samples [start, stop) as numpy CSR with offsets relative to ``start`` (copies)."""
        stop = self.n_samples if stop is None else stop
        if not 0 <= start <= stop <= self.n_samples:
            raise IndexError(f"sample range [{start}, {stop}) is outside [0, {self.n_samples}) of {self.path}")
        offsets = np.array(self.offsets[start:stop + 1], dtype=np.int64)
        lo, hi = int(offsets[0]), int(offsets[-1])
        if check:
            if lo > hi or lo < 0 or hi > self.nnz or (stop > start and (offsets[1:] < offsets[:-1]).any()):
                raise self._bad_offsets(offsets, start)
        indices = np.array(self.indices[lo:hi], dtype=np.int64)
        if check and indices.size:
            bad = (indices < 0) | (indices >= self.n_features)
            if bad.any():
                raise self._bad_index(lo + int(np.argmax(bad)), indices[int(np.argmax(bad))])
        values = np.array(self.values[lo:hi], dtype=np.float32) if self.values is not None else None
        return CsrRows(offsets - lo, indices, values, self.n_features)

    def batch(self, start: int, stop: int, check: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(offsets int64 [B + 1] from 0, indices int64 [nnz_B], values float32 [nnz_B] or None)
        for samples [start, stop); ``check`` verifies offsets and index range of this batch."""
        rows = self.rows(start, stop, check=check)
        values = torch.from_numpy(rows.values) if rows.values is not None else None
        return torch.from_numpy(rows.offsets), torch.from_numpy(rows.indices), values

    def batches(self, batch_size: int, start: int = 0, stop: int | None = None,
                check: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """Consecutive batches of ``batch_size`` samples (the last one may be smaller)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        stop = self.n_samples if stop is None else stop
        for s in range(start, stop, batch_size):
            yield self.batch(s, min(s + batch_size, stop), check=check)

    def _bad_offsets(self, offsets: np.ndarray, start: int) -> DatasetError:
        # the first offset out of [0, nnz] or below its predecessor
        bad = (offsets < 0) | (offsets > self.nnz)
        bad[1:] |= offsets[1:] < offsets[:-1]
        if bad.any():
            i = int(np.argmax(bad))
            value = int(offsets[i])
            if not 0 <= value <= self.nnz:
                return DatasetError(f"{self.offsets_path}: offset {value} at position {start + i} is outside "
                                    f"[0, nnz = {self.nnz}]; re-create the dataset")
            return DatasetError(f"{self.offsets_path}: offsets decrease at position {start + i} "
                                f"({int(offsets[i - 1])} then {value}); they must be non-decreasing; "
                                f"re-create the dataset")
        return DatasetError(f"{self.offsets_path}: offsets near position {start} are inconsistent; re-create the dataset")

    def _bad_index(self, position: int, value: int) -> DatasetError:
        return DatasetError(f"{self.indices_path}: feature index {int(value)} at position {position} is outside "
                            f"[0, n_features = {self.n_features}); re-create the dataset")

    def validate(self) -> None:
        """Scan every array in bounded chunks: offsets non-decreasing from 0 to nnz, indices in
        [0, n_features), values finite. Raises DatasetError naming the file and the first bad
        position. Opening runs it (unless ``check=False``); the checks of ``rows`` are the same,
        for one batch."""
        for s in range(0, self.n_samples + 1, _CHECK_CHUNK):
            base = max(s - 1, 0)  # one offset of overlap: the step across chunks is checked too
            chunk = np.asarray(self.offsets[base:s + _CHECK_CHUNK])
            if chunk.size and (int(chunk.min()) < 0 or int(chunk.max()) > self.nnz
                               or (chunk.size > 1 and int(np.diff(chunk).min()) < 0)):
                raise self._bad_offsets(chunk, base)
        for s in range(0, self.nnz, _CHECK_CHUNK):
            chunk = np.asarray(self.indices[s:s + _CHECK_CHUNK])
            if int(chunk.min()) < 0 or int(chunk.max()) >= self.n_features:
                i = int(np.argmax((chunk < 0) | (chunk >= self.n_features)))
                raise self._bad_index(s + i, chunk[i])
            if self.values is not None:
                v = np.asarray(self.values[s:s + _CHECK_CHUNK])
                if not np.isfinite(v).all():
                    i = int(np.argmax(~np.isfinite(v)))
                    raise DatasetError(f"{self.values_path}: value {float(v[i])!r} at position {s + i} is not "
                                       f"finite; re-create the dataset")


# ---------------------------------------------------------------------------- held-out split


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A stateless 64-bit hash: random keys that depend on (seed, position) only, so a split is
    the same whatever the chunking."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def holdout_mask(offsets: np.ndarray, *, fraction: float | None = None, last_k: int | None = None,
                 seed: int = 0, min_input: int = 1, position: int = 0) -> np.ndarray:
    """Boolean mask over the nnz of batch-relative ``offsets``: True = held out.

    Per sample of length n: ``last_k`` holds out its last min(k, n - min_input) features (the
    latest, when rows are in time order); ``fraction`` holds out round(fraction * n), at most
    n - min_input, chosen at random from hashes of (seed, global position ``position + j``).
    """
    if (fraction is None) == (last_k is None):
        raise ValueError("give exactly one of `fraction` and `last_k`")
    if fraction is not None and not 0.0 <= fraction <= 1.0:
        raise ValueError(f"`fraction` must be in [0, 1], got {fraction}")
    if last_k is not None and last_k < 0:
        raise ValueError(f"`last_k` must be >= 0, got {last_k}")
    if min_input < 0:
        raise ValueError(f"`min_input` must be >= 0, got {min_input}")
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    nnz = int(offsets[-1] - offsets[0])
    if last_k is not None:
        held = np.minimum(last_k, lengths)
    else:
        held = np.floor(fraction * lengths + 0.5).astype(np.int64)
    held = np.minimum(held, np.maximum(lengths - min_input, 0))
    row = np.repeat(np.arange(lengths.shape[0]), lengths)
    rank = np.arange(nnz, dtype=np.int64) - np.repeat(offsets[:-1] - offsets[0], lengths)  # position in its row
    if last_k is not None:
        return rank >= (lengths - held)[row]
    keys = _splitmix64(np.arange(position, position + nnz, dtype=np.uint64) ^ _splitmix64(np.full(1, seed, np.uint64)))
    order = np.lexsort((keys, row))  # within each row, positions by random key
    random_rank = np.empty(nnz, np.int64)
    random_rank[order] = rank  # rows are contiguous in `order` too, so rank doubles as rank-in-row
    return random_rank < held[row]


def split_holdout(source: str | os.PathLike | CsrDataset, input_path: str | os.PathLike,
                  heldout_path: str | os.PathLike, *, fraction: float | None = None, last_k: int | None = None,
                  seed: int = 0, min_input: int = 1, chunk_samples: int = 65536,
                  overwrite: bool = False) -> tuple[int, int]:
    """Split every sample's features into an input part and a held-out part, for evaluating a
    recommender on items it did not see: two CSR datasets with the same samples in the same
    order and the same n_features, each feature (with its value) in exactly one of them, in
    the original order. See ``holdout_mask`` for what is held out. Streams in chunks of
    samples; the result does not depend on ``chunk_samples``. Returns (input nnz, held-out nnz).
    """
    dataset = source if isinstance(source, CsrDataset) else CsrDataset(source)
    if os.path.abspath(os.fspath(input_path)) == os.path.abspath(os.fspath(heldout_path)):
        raise ValueError(f"input and held-out datasets must go to different directories, both are {input_path}")
    holdout_mask(np.zeros(1, np.int64), fraction=fraction, last_k=last_k, seed=seed, min_input=min_input)  # checks
    has_values = dataset.has_values
    with CsrWriter(input_path, dataset.n_features, has_values, overwrite) as kept, \
            CsrWriter(heldout_path, dataset.n_features, has_values, overwrite) as held:
        for s in range(0, dataset.n_samples, chunk_samples):
            rows = dataset.rows(s, min(s + chunk_samples, dataset.n_samples))
            mask = holdout_mask(rows.offsets, fraction=fraction, last_k=last_k, seed=seed, min_input=min_input,
                                position=int(dataset.offsets[s]))
            row = np.repeat(np.arange(rows.n_samples), np.diff(rows.offsets))
            for writer, select in ((kept, ~mask), (held, mask)):
                counts = np.bincount(row[select], minlength=rows.n_samples)
                offsets = np.concatenate([[0], np.cumsum(counts)])
                writer.write(offsets, rows.indices[select], rows.values[select] if has_values else None)
        return kept.nnz, held.nnz
