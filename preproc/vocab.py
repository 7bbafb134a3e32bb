"""Vocabularies: categorical value (a 32-bit hash) -> id, built from counts, looked up fast.

Ids follow the reference: per column, the values counted at least ``threshold`` times get ids
1..K by descending count, ties by ascending value (for 8-digit hex strings the numeric order
is the string order). Everything else maps to 0. Cardinality is K + 1.

Lookups use one open-addressing hash table for all columns (linear probing, Fibonacci hashing,
load factor <= 1/4) probed with whole-array numpy operations on blocks of rows, so a chunk
costs a few cache-resident passes instead of a dict lookup per value. The table is saved as a
.npy file so it can be memory-mapped.

A finished dataset keeps the vocabulary its ids came from in ``<dataset>/vocabulary/``
(``save_dataset_vocabulary``, ``load_dataset_vocabulary``), so raw rows can be scored later
with the same ids (``preproc.transform``).

This module is imported by Spark's Python workers, which get the ``preproc`` package only:
it depends on numpy at import time (``dlrm`` is imported inside the driver-side functions).
"""

from __future__ import annotations

import os
import shutil
from typing import Callable

import numpy as np

_FIB = np.uint64(0x9E3779B97F4A7C15)


def _slots(values: np.ndarray, bits: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return ((values.astype(np.uint64) * _FIB) >> np.uint64(64 - bits)).astype(np.int64)


def rank_values(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Values ordered by descending count, then ascending value: index i gets id i + 1."""
    order = np.lexsort((values, -counts.astype(np.int64)))
    return values[order].astype(np.uint32)


_LOAD_BITS = 2  # table size >= 4 x values: most lookups end at the first slot
_BLOCK_ROWS = 4096  # rows looked up at once: keeps the temporaries in cache
_LOW32 = np.uint64(0xFFFFFFFF)


def _table_bits(n: int) -> int:
    return max(4, int(np.ceil(np.log2(max(n, 1)))) + _LOAD_BITS)


def _build_table(values_by_id: np.ndarray, bits: int) -> np.ndarray:
    """Linear-probing table of ``(id << 32) | value`` entries, 0 for an empty slot (ids start at 1)."""
    n = len(values_by_id)
    size = 1 << bits
    table = np.zeros(size, dtype=np.uint64)
    entries = (np.arange(1, n + 1, dtype=np.uint64) << np.uint64(32)) | values_by_id.astype(np.uint64)
    slot = _slots(values_by_id, bits)
    pending = np.arange(n)
    while len(pending):
        s = slot[pending]
        free = table[s] == 0
        candidates, cs = pending[free], s[free]
        taken, first = np.unique(cs, return_index=True)  # one winner per free slot
        winners = candidates[first]
        table[taken] = entries[winners]
        placed = np.zeros(n, dtype=bool)
        placed[winners] = True
        pending = pending[~placed[pending]]
        slot[pending] = (slot[pending] + 1) & (size - 1)
    return table


class Vocabulary:
    """The kept values of the 26 columns, as one hash table holding all of them.

    Column j's table is ``table[offsets[j] : offsets[j] + 2**bits[j]]``; a value's first slot is
    the top ``bits[j]`` bits of ``value * 0x9E3779B97F4A7C15`` (Fibonacci hashing).
    """

    def __init__(self, sizes: list[int], table: np.ndarray):
        self.sizes = [int(k) for k in sizes]
        self.bits = np.array([_table_bits(k) for k in self.sizes], dtype=np.int64)
        widths = np.left_shift(1, self.bits)
        self.offsets = np.concatenate([[0], np.cumsum(widths)[:-1]]).astype(np.int64)
        if len(table) != int(widths.sum()):
            raise ValueError(f"vocabulary table has {len(table)} slots, expected {int(widths.sum())}")
        self.table = table
        self._shift = (64 - self.bits).astype(np.uint64)
        self._mask = widths - 1

    @classmethod
    def build(cls, values_by_id: list[np.ndarray]) -> "Vocabulary":
        """From each column's kept values in id order (value ``values_by_id[j][i]`` gets id i + 1)."""
        values = [np.asarray(v, dtype=np.uint32) for v in values_by_id]
        table = np.concatenate([_build_table(v, _table_bits(len(v))) for v in values])
        return cls([len(v) for v in values], table)

    @property
    def cardinalities(self) -> list[int]:
        return [k + 1 for k in self.sizes]

    def lookup(self, hashes: np.ndarray, present: np.ndarray) -> np.ndarray:
        """int64 ids [n, 26] of uint32 ``hashes`` [n, 26]; 0 where not present or not kept."""
        out = np.empty(hashes.shape, dtype=np.int64)
        for a in range(0, len(hashes), _BLOCK_ROWS):
            b = min(len(hashes), a + _BLOCK_ROWS)
            out[a:b] = self._lookup_block(hashes[a:b], present[a:b])
        return out

    def _lookup_block(self, hashes: np.ndarray, present: np.ndarray) -> np.ndarray:
        q = hashes.astype(np.uint64)
        with np.errstate(over="ignore"):
            local = ((q * _FIB) >> self._shift).astype(np.int64)
        entry = self.table[local + self.offsets]
        found = ((entry ^ q) & _LOW32) == 0
        ids = np.where(found & present, (entry >> np.uint64(32)).astype(np.int64), 0)
        probe = present & ~found & (entry != 0)
        if probe.any():  # continue linear probing for the values whose first slot was taken
            rows, cols = np.nonzero(probe)
            qq, ll = q[rows, cols], local[rows, cols]
            while len(rows):
                ll = (ll + 1) & self._mask[cols]
                e = self.table[ll + self.offsets[cols]]
                hit = ((e ^ qq) & _LOW32) == 0
                ids[rows[hit], cols[hit]] = (e[hit] >> np.uint64(32)).astype(np.int64)
                more = ~hit & (e != 0)
                rows, cols, qq, ll = rows[more], cols[more], qq[more], ll[more]
        return ids

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        np.save(os.path.join(directory, "sizes.npy"), np.array(self.sizes, dtype=np.int64))
        np.save(os.path.join(directory, "table.npy"), self.table)

    @classmethod
    def load(cls, directory: str, mmap: bool = True) -> "Vocabulary":
        """Load a saved vocabulary; the table is memory-mapped (shared by processes via the page cache)."""
        sizes = np.load(os.path.join(directory, "sizes.npy")).tolist()
        table = np.load(os.path.join(directory, "table.npy"), mmap_mode="r" if mmap else None)
        return cls(sizes, table)


VOCABULARY_FILES = ("sizes.npy", "table.npy")
DATASET_VOCABULARY_DIR = "vocabulary"  # <dataset>/vocabulary: the vocabulary the dataset's ids came from


def _link_or_copy(source_dir: str) -> Callable[[str], None]:
    """Fills a directory with the files of the vocabulary saved in ``source_dir``: hard links
    when on the same filesystem (no copy of a multi-GB table; saved files are never modified in
    place, a rebuild writes new ones), copies otherwise."""

    def fill(directory: str) -> None:
        for name in VOCABULARY_FILES:
            src, dst = os.path.join(source_dir, name), os.path.join(directory, name)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copyfile(src, dst)

    return fill


def save_dataset_vocabulary(dataset_dir: str, source: Vocabulary | str) -> None:
    """Put ``source`` (a ``Vocabulary``, or the directory of a saved one) into
    ``<dataset_dir>/vocabulary``, atomically: it is written into a temporary sibling directory,
    flushed, and renamed into place; an old vocabulary is moved aside just before and deleted
    after. A failure leaves the old vocabulary in place (or, killed between the two renames,
    none: never a half-written one); temporaries a killed writer left are removed first."""
    from dlrm.engine.atomic import fsync_dir, remove_stale_temporaries, temporary_name

    target = os.path.join(os.path.abspath(dataset_dir), DATASET_VOCABULARY_DIR)
    os.makedirs(os.path.dirname(target), exist_ok=True)
    remove_stale_temporaries(target)
    staged = temporary_name(target)
    os.makedirs(staged)
    try:
        if isinstance(source, Vocabulary):
            source.save(staged)
        else:
            _link_or_copy(source)(staged)
        for name in VOCABULARY_FILES:
            with open(os.path.join(staged, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(staged)
        old = None
        if os.path.lexists(target):
            old = temporary_name(target)
            os.rename(target, old)
        try:
            os.rename(staged, target)
        except BaseException:
            if old is not None:
                os.rename(old, target)
            raise
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    fsync_dir(os.path.dirname(target))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def load_dataset_vocabulary(dataset_dir: str, mmap: bool = True) -> Vocabulary:
    """The vocabulary a preprocessed dataset's categorical ids came from (``<dataset_dir>/vocabulary``),
    checked against the dataset's ``feature_spec.yaml`` when there is one. The table is
    memory-mapped unless ``mmap`` is false. Raises ``DatasetError`` naming the path and the fix
    when the dataset has none (made before datasets kept it, or by another tool)."""
    from dlrm.engine.errors import DatasetError

    directory = os.path.join(dataset_dir, DATASET_VOCABULARY_DIR)
    missing = [name for name in VOCABULARY_FILES if not os.path.isfile(os.path.join(directory, name))]
    if missing:
        raise DatasetError(
            f"{directory}: no vocabulary ({', '.join(missing)} not found); the dataset was made before "
            f"preprocessing kept its vocabulary, or by another tool. Re-run preprocessing with the same "
            f"settings into {dataset_dir} (python -m preproc ... --output {dataset_dir}): a run that kept its "
            f"work directory (--keep_work_dir, keep_work_dir=True) resumes and redoes only the final write; "
            f"otherwise the whole run is redone"
        )
    vocab = Vocabulary.load(directory, mmap=mmap)
    if os.path.isfile(os.path.join(dataset_dir, "feature_spec.yaml")):
        from dlrm.data.feature_spec import FeatureSpec

        spec = FeatureSpec.from_yaml(dataset_dir)
        if list(spec.cardinalities) != vocab.cardinalities:
            raise DatasetError(
                f"{directory} does not belong to the dataset: its cardinalities {vocab.cardinalities} differ "
                f"from those of {os.path.join(dataset_dir, 'feature_spec.yaml')} {list(spec.cardinalities)}; "
                f"re-run preprocessing into {dataset_dir}"
            )
    return vocab
