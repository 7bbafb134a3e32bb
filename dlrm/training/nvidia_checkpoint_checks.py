"""What a directory in NVIDIA's DLRM layout may hold before this program uses it, and the
checksum listing this program writes beside the files of that layout.

``metadata.pt`` and the MLP files are pickles a user hands in: any number, list or flag in them
may be of another type, huge, negative, NaN, or one list referenced a hundred thousand times (a
570 KB file whose nested loops run for minutes). So every value is typed and bounded here
before anything loops over it or computes with it, and messages give types and lengths, never
the values read.

NVIDIA's layout has no checksums. What this program writes in it carries ``CHECKSUMS`` (each
file's size and CRC-32), a file NVIDIA's loader never opens; a reader checks it when present, so
a file damaged on disk is refused instead of loaded.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

from dlrm.engine.checkpoint_store import CheckpointError, files_crc32

CHECKSUMS = "dlrm_checksums.json"  # beside NVIDIA's files: each file's size and CRC-32
MAX_GPUS = 1024  # processes a device mapping may list (NVIDIA's runs use one node: 16 at most)
MAX_LAYERS = 64  # layers of one MLP
MAX_INT = 1 << 62  # any count or position read from a file (a shape, a step)
_CHECKSUM_BYTES = 1 << 20  # a listing larger than this is not one this program wrote
_REWRITTEN = (f"if NVIDIA's code rewrote this directory, delete {CHECKSUMS}; else the file is damaged: load an "
              "earlier checkpoint")


def kind(value: Any) -> str:
    """A value read from a file, for a message: its type, and its length if it has one."""
    if isinstance(value, (list, tuple, dict, str, bytes)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def plain_int(value: Any, file: str, name: str, default: int | None = None, low: int = 0) -> int:
    """``value`` as an int in ``[low, MAX_INT)`` (never a float or a bool, which NVIDIA's writer
    does not write there); ``default`` when None and a default is given."""
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < MAX_INT:
        what = kind(value) if not isinstance(value, int) or isinstance(value, bool) else "out of range"
        raise CheckpointError(f"{file}: {name} is {what}, not a whole number from {low} (NVIDIA's writer writes "
                              "one): the checkpoint is damaged")
    return value


def flag(config: dict[str, Any], file: str, name: str, expected: type, default: Any) -> Any:
    """NVIDIA's flag ``name`` of the run's ``config``: ``default`` when absent, else a value of
    type ``expected`` (a bool only when a real bool: ``'no'`` is not false)."""
    value = config.get(name, default)
    if value is None or value is default:
        return default
    if expected is str and isinstance(value, str) and len(value) <= 64:
        return value
    if expected is bool and isinstance(value, bool):
        return value
    raise CheckpointError(f"{file}: config[{name!r}] is {kind(value)}, NVIDIA's flag {name} is a "
                          f"{expected.__name__}: the checkpoint is damaged")


def sequence(value: Any, file: str, name: str, most: int) -> list[Any]:
    """``value`` as a list of at most ``most`` items, checked before anything loops over it."""
    if not isinstance(value, (list, tuple)):
        raise CheckpointError(f"{file}: {name} is {kind(value)}, NVIDIA's layout has a list there: "
                              "the checkpoint is damaged")
    if len(value) > most:
        raise CheckpointError(f"{file}: {name} has {len(value)} entries, at most {most} fit this checkpoint: "
                              "the checkpoint is damaged")
    return list(value)


def buckets(value: Any, file: str, present: int) -> list[list[int]]:
    """``device_mapping['embedding']``: per process, the tables it held. Bounded by the
    ``present`` table files before any loop: no more processes than ``MAX_GPUS``, no more
    table indices in all than files, each a whole number below ``MAX_INT``."""
    name = "device_mapping['embedding']"
    outer = sequence(value, file, name, MAX_GPUS)
    lists = [sequence(bucket, file, f"{name}[{i}]", present) for i, bucket in enumerate(outer)]
    total = sum(map(len, lists))
    if total > present:
        raise CheckpointError(f"{file}: {name} lists {total} tables, the directory holds {present} table files: "
                              "the checkpoint is incomplete or damaged")
    return [[plain_int(i, file, f"a table index of {name}") for i in bucket] for bucket in lists]


# ----------------------------------------------------------------------------- checksums


def write_checksums(directory: str, names: list[str], threads: int = 4) -> None:
    """``CHECKSUMS`` in ``directory``: each of ``names`` with its size and CRC-32, hashed once
    every process has written (several write into one table's file)."""
    crc32 = files_crc32(directory, names, threads)
    listing = {name: {"bytes": os.path.getsize(os.path.join(directory, name)), "crc32": crc}
               for name, crc in sorted(crc32.items())}
    with open(os.path.join(directory, CHECKSUMS), "w", encoding="utf-8") as f:
        json.dump({"files": listing}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def read_checksums(path: str, names: list[str]) -> dict[str, str] | None:
    """The CRC-32 of each file ``CHECKSUMS`` lists (None: no listing, as in what NVIDIA's code
    wrote), after checking it lists exactly the layout's files ``names`` with their sizes."""
    file = os.path.join(path, CHECKSUMS)
    if not os.path.isfile(file):
        return None
    try:
        if os.path.getsize(file) > _CHECKSUM_BYTES:
            raise ValueError("too large")
        with open(file, encoding="utf-8") as f:
            listing = json.load(f)["files"]
        crc = {name: entry["crc32"] for name, entry in listing.items()}
        sizes = {name: entry["bytes"] for name, entry in listing.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise CheckpointError(f"{file}: not a checksum listing this program writes: the checkpoint is damaged; "
                              f"delete {CHECKSUMS} to load NVIDIA's files without it") from None
    if sorted(listing) != sorted(names):
        raise CheckpointError(f"{file}: lists {len(listing)} files, the directory holds {len(names)} files of "
                              f"NVIDIA's layout: {_REWRITTEN}")
    for name in names:
        size = os.path.getsize(os.path.join(path, name))
        if size != sizes[name]:
            raise CheckpointError(f"{os.path.join(path, name)}: {size} bytes, {CHECKSUMS} says it was written with "
                                  f"another size: {_REWRITTEN}")
    return crc


def verify(path: str, crc32: dict[str, str] | None, names: Iterable[str], threads: int = 4) -> None:
    """Each of ``names`` has the CRC-32 it was written with (nothing to check without a listing)."""
    if crc32 is None:
        return
    for name, crc in files_crc32(path, names, threads).items():
        if crc != crc32[name]:
            raise CheckpointError(f"{os.path.join(path, name)}: its checksum differs from the one in {CHECKSUMS}: "
                                  f"{_REWRITTEN}")
