"""The checkpoint store under both products: a checkpoint is a directory of tensor files and a
``meta.json`` that lists them, written so that a crash or a full disk never leaves half a
checkpoint, and read so that a damaged file or a foreign pickle is refused before anything loads.

A product's format (``dlrm.training.checkpoint``, ``dlrm.recommender.checkpoint``) says only
what it saves and what it checks; this module owns the rest:

- staging and commit: every process writes into ``<path>.tmp``; the first one writes
  ``meta.json`` last and puts the directory at ``<path>`` by two renames (the previous one is
  ``<path>.old`` in between), so a crash leaves a complete checkpoint at one of the two
  (``latest_checkpoint``). A write the file system refuses removes ``<path>.tmp`` and raises a
  ``StorageError``; ``check_can_save`` meets those causes before a run trains for hours;
- the lock (``CheckpointLock``): one run saves to a path at a time;
- each file's size and CRC-32 in ``meta.json``, checked before anything is unpickled;
- safe load: ``torch.load(weights_only=True)``; every way a damaged file fails is a
  ``CheckpointError`` naming it;
- row blocks: a tensor, or a dict of tensors with the same rows, saved in pieces by row range
  (``<stem>_rows_<a>_<b><suffix>.pt``, or ``<stem><suffix>.pt`` whole) by however many processes
  hold it, and read back as any rows ``[start, stop)``, so N processes' checkpoint loads on M.

The processes meet through the run's ``Collectives``, never through torch.distributed itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pickle
import re
import shutil
import socket
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import torch

from dlrm.engine.atomic import fsync_dir
from dlrm.engine.storage import check_can_create, check_free_space, writing
from dlrm.engine.collectives import Collectives
from dlrm.engine.errors import CheckpointError
from dlrm.engine.model_contract import ParallelModel
from dlrm.engine.outputs import PROGRAM, OutputError, OutputKind, claim_output, holds_only
from dlrm.engine.tensor_checks import check_all, check_finite, is_compact, label
from dlrm.version import __version__

META = "meta.json"
CHECKPOINT = "the checkpoint"  # what a StorageError says could not be written




# ----------------------------------------------------------------------------- writing files


class _Checksummed:
    """A write-only file that keeps the CRC-32 of what passes through it (no second read)."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.crc = 0

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_tensor_file(obj: Any, path: str) -> str:
    """Writes ``obj`` with ``torch.save``, durably; returns the file's CRC-32 as 8 hex digits."""
    with open(path, "wb") as f:
        out = _Checksummed(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    return f"{out.crc:08x}"


def file_crc32(path: str, chunk_bytes: int = 1 << 26) -> str:
    """CRC-32 of a file as 8 hex digits, read in chunks (zlib releases the GIL: threads scale)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(max(1, min(chunk_bytes, os.fstat(f.fileno()).st_size)))  # small files: no 64 MiB buffer
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """An owning CPU copy: saving a view would serialise the whole storage it is a view of."""
    tensor = tensor.detach()
    return tensor.cpu() if tensor.device.type != "cpu" else tensor.clone()


# ----------------------------------------------------------------------------- where and how much


def check_checkpoint_path(path: str) -> None:
    """A checkpoint is a directory: never move a file of the user's aside to make room for one."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a directory: choose another path for the checkpoint")
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise CheckpointError(f"{parent} is a file: a checkpoint cannot be saved under it")


CHECKPOINT_FILES = ("meta.json", "*.pt")  # all a checkpoint directory ever holds


def is_checkpoint_dir(path: str) -> bool:
    """Whether ``path`` holds a checkpoint of this program's store (of either product) and nothing
    else: ``meta.json`` and tensor files. What the store may move aside or replace."""
    return holds_only(path, CHECKPOINT_FILES, required=[META])


def _lists_every_file(path: str, meta: dict[str, Any]) -> bool:
    """Whether every file of the checkpoint at ``path`` is ``meta.json`` or one it lists: the
    exact names its save wrote. A ``.pt`` of the user's dropped beside them (``my_table.pt``) makes
    the folder not ours, so ``--resume`` or ``--overwrite`` never deletes it."""
    files = meta.get("files")
    if not isinstance(files, dict) or not all(isinstance(name, str) for name in files):
        return False
    return holds_only(path, [re.compile(re.escape(name)) for name in (META, *files)])


def _is_staging_dir(path: str) -> bool:
    """A staged save left behind: tensor files and perhaps ``meta.json``, nothing else."""
    return holds_only(path, CHECKPOINT_FILES)


def _is_lock_file(path: str) -> bool:
    """A lock file of ``CheckpointLock``: empty, or the one line it writes."""
    try:
        with open(path, "rb") as f:
            content = f.read(4097)
    except OSError:
        return False
    return re.fullmatch(rb"(pid \d+ on [^\n]{1,255}\n)?", content) is not None


STAGING = OutputKind("staged checkpoint", directory=True, recognise=_is_staging_dir)
LOCK = OutputKind("checkpoint lock file", directory=False, recognise=_is_lock_file)


def claim_checkpoint_path(path: str, fmt: "Format", setting: str = "save_checkpoint_path", *,
                          inputs: Mapping[str, Any] | None = None, replace: bool = False, keep: bool = False,
                          keep_setting: str | None = "resume", suffixes: Iterable[str] = ("",)) -> str:
    """Before a run trains: ``path`` may receive its checkpoints (``dlrm.engine.outputs``): absent,
    empty, or a checkpoint of ``fmt`` which the run continues (``keep``) or replaces
    (``replace``); the names the store puts beside it (``.tmp``, ``.old``, ``.lock``) hold nothing
    of the user's; it is none of ``inputs``. ``suffixes``: the checkpoint directories the run
    writes, as suffixes of ``path`` (a recommender that validates also writes ``PATH.best``)."""
    kind = fmt.kind
    for suffix in suffixes:
        target = path.rstrip(os.sep) + suffix if suffix else path
        claim_output(target, kind, setting, inputs=inputs, replace=replace, keep=keep, keep_setting=keep_setting,
                     siblings={".tmp": STAGING, ".old": kind, ".lock": LOCK})
    return os.path.abspath(path)


def state_bytes(module: ParallelModel) -> int:
    """Bytes of this process's weights: the least a checkpoint of them takes on disk."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def bytes_needed(path: str, least: int) -> int:
    """What a save to ``path`` needs on disk: the size of the checkpoint already there (the
    same model's), or at least ``least`` bytes when there is none."""
    try:
        previous = sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
    except OSError:
        previous = 0
    return max(previous, least)


def check_can_save(path: str, least: int) -> None:
    """Before training: a checkpoint can be created at ``path`` and its file system has room for
    one of at least ``least`` bytes, so a run does not fail at its first save (``StorageError``)."""
    check_checkpoint_path(path)
    check_can_create(path, CHECKPOINT)
    check_free_space(path, bytes_needed(path, least), CHECKPOINT)


class CheckpointLock:
    """Held by the one process that writes checkpoints to ``path`` for as long as its run lasts,
    so a second run saving to the same path fails at its start instead of deleting the first
    run's work. An ``flock`` on ``<path>.lock``: the kernel drops it when the holder dies, even by
    ``kill -9``, so a stale lock never blocks the next run. ``setting`` names the path's setting
    in the message."""

    def __init__(self, path: str, setting: str = "save_checkpoint_path"):
        self.path = f"{os.path.abspath(path).rstrip(os.sep)}.lock"
        self.setting = setting
        self._fd: int | None = None

    def acquire(self) -> "CheckpointLock":
        check_checkpoint_path(self.path[: -len(".lock")])
        if os.path.lexists(self.path) and (os.path.islink(self.path) or not _is_lock_file(self.path)):
            raise OutputError(f"`{self.setting}`: {self.path} exists and is not a lock file of this program: it is "
                              "never overwritten; move it away or choose another path; nothing was changed")
        with writing(self.path[: -len(".lock")], CHECKPOINT):  # a read-only or missing file system fails here
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0)
                         | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CheckpointError(
                f"{self.path}: another run ({holder}) is saving checkpoints to {self.path[:-5]}; "
                f"give this run its own `{self.setting}`, or stop the other run first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.unlink(self.path)  # before unlocking: a run that opens it after this makes a new file
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "CheckpointLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


# ----------------------------------------------------------------------------- one save


@contextlib.contextmanager
def staged_directory(path: str, collectives: Collectives = Collectives(), needed: int | None = None) -> Iterator[str]:
    """The directory every process of ``collectives`` writes a checkpoint into: ``<path>.tmp``,
    made fresh by the first process; when the block ends, the first process puts it at
    ``path`` (``commit_directory``), or removes it if the block failed. Processes meet before
    and after. A write the file system refuses becomes a ``StorageError`` (a full disk's message
    says how much is free, and ``needed``, the bytes a checkpoint takes, if that is more)."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp"
    first = collectives.rank == 0
    if first:
        check_checkpoint_path(path)
        with writing(path, CHECKPOINT, needed):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.lexists(tmp):
                if os.path.islink(tmp) or not _is_staging_dir(tmp):
                    raise OutputError(f"{tmp} is in the way of the checkpoint's staging and is not one of this "
                                      "program's: move it away; nothing was changed")
                shutil.rmtree(tmp)
            os.makedirs(tmp)
    collectives.barrier()
    remove_tmp = (lambda: shutil.rmtree(tmp, ignore_errors=True)) if first else None
    with writing(path, CHECKPOINT, needed, cleanup=remove_tmp):  # the disk's free space is measured after cleanup
        yield tmp
        if first:
            commit_directory(tmp, path)
    collectives.barrier()


def commit_directory(tmp: str, path: str, recognise: Callable[[str], bool] | None = None,
                     what: str = "a checkpoint of this program") -> None:
    """Puts the finished directory ``tmp`` at ``path`` by two renames (the previous one goes to
    ``path.old`` in between), so a crash leaves a complete checkpoint at one of the two. Only
    directories ``recognise`` (default: this store's checkpoints) or empty ones are replaced."""
    recognise = recognise or is_checkpoint_dir
    old = f"{path}.old"
    for existing in (path, old):  # the store moves aside or removes only checkpoints of its own
        if os.path.lexists(existing) and (os.path.islink(existing) or not (
                recognise(existing) or (os.path.isdir(existing) and not os.listdir(existing)))):
            raise OutputError(f"{existing} is not {what}: it is never replaced; move it away "
                              "or save elsewhere; nothing was changed")
    if os.path.exists(path):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path))
    shutil.rmtree(old, ignore_errors=True)


def write_meta(directory: str, meta: dict[str, Any]) -> None:
    """``meta.json``, durably: written last, it is what makes a checkpoint directory complete."""
    with open(os.path.join(directory, META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(directory)


class StagedFiles:
    """The files of one save in its staged directory, each with the CRC-32 it was written with."""

    def __init__(self, directory: str):
        self.directory = directory
        self.crc32: dict[str, str] = {}

    def save(self, name: str, obj: Any) -> None:
        """Writes ``obj`` (tensors in plain containers) as the checkpoint's file ``name``."""
        self.crc32[name] = save_tensor_file(obj, os.path.join(self.directory, name))

    def listing(self) -> dict[str, dict[str, Any]]:
        """``meta.json``'s ``files``: every file's size and CRC-32."""
        return {name: {"bytes": os.path.getsize(os.path.join(self.directory, name)), "crc32": crc}
                for name, crc in sorted(self.crc32.items())}


def save_directory(path: str, collectives: Collectives, least_bytes: int,
                   write_local: Callable[[StagedFiles], None],
                   write_rest: Callable[[StagedFiles], dict[str, Any]]) -> None:
    """One checkpoint at ``path``, which every process of ``collectives`` calls this for: each
    writes its own files (``write_local``, e.g. the row blocks it holds); then the first, which
    then knows every process's files, writes the rest and returns ``meta.json``'s entries
    (``write_rest``); ``meta.json``, listing every file and the program and version that wrote
    it (``written_by``), is written last and the directory committed. ``least_bytes``: the least
    the checkpoint takes, for a full disk's message."""
    with staged_directory(path, collectives, bytes_needed(path, least_bytes)) as tmp:
        files = StagedFiles(tmp)
        write_local(files)
        # Every process's files, on every process (also the barrier after them).
        files.crc32 = {name: crc for part in collectives.gather_objects(files.crc32) for name, crc in part.items()}
        if collectives.rank == 0:
            meta = write_rest(files)
            meta["files"] = files.listing()
            meta["written_by"] = {"program": PROGRAM, "version": __version__}
            write_meta(tmp, meta)


# ----------------------------------------------------------------------------- reading


def latest_checkpoint(path: str) -> str | None:
    """The complete checkpoint a restarted run resumes from: ``path``, or ``path.old`` when a
    save was cut off between its two renames; None when neither holds one (a first start)."""
    for candidate in (path, f"{path.rstrip(os.sep)}.old"):
        if os.path.isfile(os.path.join(candidate, META)):
            return candidate
    return None


def _identity(path: str, marker: str = META) -> tuple[int, ...] | None:
    """What changes when a save replaces the checkpoint at ``path``: the directory's and its
    ``marker`` file's (``meta.json``, or the last file another layout writes) inode and
    modification time (a commit renames a new directory into place)."""
    try:
        d, m = os.stat(path), os.stat(os.path.join(path, marker))
    except OSError:
        return None
    return d.st_dev, d.st_ino, m.st_ino, m.st_mtime_ns, m.st_size


def _lock_held(lock: str) -> bool | None:
    """Whether a live process holds the ``CheckpointLock`` file ``lock`` (None: there is none).
    Tried with a shared ``flock``, which needs read access only; the kernel dropped the lock of a
    run that died, so its leftover file reads as not held."""
    try:
        fd = os.open(lock, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)
    return False


def _save_under_way(path: str) -> bool:
    """Whether a save to ``path`` may be under way: its staging directory exists and no run that
    died left it (a run that saves holds the lock; a writer without one is given the benefit of
    the doubt). A moved-aside previous (``.old``) without staging is what a save cut off between
    its two renames leaves, never a save in progress: a commit renames the staging into place
    before the previous goes away."""
    base = path.rstrip(os.sep)
    return os.path.isdir(f"{base}.tmp") and _lock_held(f"{base}.lock") is not False


def read_consistently(path: str, read: Callable[[], Any], timeout: float = 60.0, marker: str = META) -> Any:
    """``read()`` of the checkpoint at ``path`` such that everything it read came from one save.
    Another run may save to ``path`` while we read (a trainer's periodic save, predict or a
    Triton reload beside it): a commit swaps the whole directory, so a read that saw the
    directory change under it, or failed while a save was under way, is repeated, for up to
    ``timeout`` seconds. A damaged checkpoint that nobody is saving fails at once, as before.
    Why not lock: a reader must never block a trainer, nor need write access to the folder.
    ``marker``: the file a save writes last (``meta.json``; NVIDIA's layout: its ``metadata.pt``)."""
    deadline = time.monotonic() + timeout
    while True:
        before = _identity(path, marker)
        try:
            result = read()
        except (CheckpointError, OSError):  # OSError: a file of the save we read was removed under us
            after = _identity(path, marker)
            changed = after != before if before is not None else (after is not None or _save_under_way(path))
            if not changed or time.monotonic() > deadline:
                raise
        else:
            if before is not None and _identity(path, marker) == before:
                return result
            if time.monotonic() > deadline:
                raise CheckpointError(f"{path}: the checkpoint kept changing while it was read (another run is saving "
                                      "to it every moment): load a copy, or stop that run first")
        time.sleep(0.02)


@dataclass(frozen=True)
class Format:
    """What a product's ``meta.json`` must hold: ``marks``, the entries that say which product
    wrote it, with their values; ``version``, the entry that holds the format's version and the
    version this code reads; ``entries``, what else it must have, with their types."""

    name: str  # what messages call such a checkpoint, e.g. "autoencoder checkpoint"
    version: tuple[str, int]
    entries: Mapping[str, type]
    marks: Mapping[str, str] = field(default_factory=dict)
    foreign: str = ""  # what to tell of a meta.json without the marks

    def recognise(self, path: str) -> bool:
        """Whether directory ``path`` holds a checkpoint of this format (or one whose save was cut
        short), and nothing but a checkpoint's files."""
        if not is_checkpoint_dir(path):
            return False
        try:
            with open(os.path.join(path, META), encoding="utf-8") as f:
                meta = json.load(f)
        except (ValueError, OSError):
            return False
        return (isinstance(meta, dict) and all(meta.get(k) == v for k, v in self.marks.items())
                and all(k in meta for k in self.entries) and _lists_every_file(path, meta))

    @property
    def kind(self) -> OutputKind:
        """This format as an output of the output rule (``dlrm.engine.outputs``)."""
        return OutputKind(self.name, directory=True, recognise=self.recognise)

    def read_meta(self, path: str) -> dict[str, Any]:
        """Reads and checks ``meta.json``: the checkpoint is complete, of this format and version,
        and every file it lists has the size it was written with."""
        meta_path = os.path.join(path, META)
        if not os.path.isfile(meta_path):
            hint = ""
            if os.path.isfile(os.path.join(f"{path.rstrip(os.sep)}.old", META)):
                hint = f" A complete earlier checkpoint is at {path.rstrip(os.sep)}.old (a save was interrupted): load that."
            elif os.path.isdir(path):
                hint = " The directory has no meta.json: it is not a checkpoint, or its save did not finish."
            raise CheckpointError(f"No {self.name} at {path}.{hint}")
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise CheckpointError(f"{meta_path}: not readable as JSON ({e}): the checkpoint is damaged") from None
        if not isinstance(meta, dict) or any(meta.get(key) != value for key, value in self.marks.items()):
            article = "an" if self.name[0] in "aeiou" else "a"
            raise CheckpointError(f"{meta_path}: not {article} {self.name}{f' ({self.foreign})' if self.foreign else ''}")
        key, version = self.version
        if meta.get(key) != version:
            raise CheckpointError(f"{meta_path}: checkpoint format {meta.get(key)!r}, this version reads {version}")
        for key, kind in {**self.entries, "files": dict}.items():
            if not isinstance(meta.get(key), kind):
                raise CheckpointError(f"{meta_path}: entry {key!r} is missing or not a {kind.__name__}: "
                                      "the checkpoint is damaged")
        for name, entry in meta["files"].items():
            size = entry.get("bytes") if isinstance(entry, dict) else entry  # older checkpoints: the size alone
            file = os.path.join(path, name)
            actual = os.path.getsize(file) if os.path.isfile(file) else None
            if actual != size:
                raise CheckpointError(f"{file}: expected {size} bytes, found {actual}: the checkpoint is damaged")
        return meta


def files_crc32(path: str, names: Iterable[str], threads: int = 4) -> dict[str, str]:
    """The CRC-32 of each of ``names`` under ``path``, the files hashed in parallel (see
    docs/training.md for the speed): for checking a save, of this program's layout or NVIDIA's."""
    names = list(names)
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
        return dict(zip(names, pool.map(lambda n: file_crc32(os.path.join(path, n)), names)))


def verify_checksums(path: str, meta: dict[str, Any], names: list[str], threads: int = 4) -> None:
    """Compares each named file's CRC-32 with the one written at save time. Checkpoints that
    predate checksums pass."""
    expected = {n: e["crc32"] for n in names if isinstance(e := meta["files"].get(n), dict) and "crc32" in e}
    actual = files_crc32(path, expected, threads)
    for name, crc in expected.items():
        if actual[name] != crc:
            saved = crc if isinstance(crc, str) and re.fullmatch(r"[0-9a-f]{8}", crc) else "one"  # read from meta.json
            raise CheckpointError(
                f"{os.path.join(path, name)}: checksum {actual[name]} differs from the {saved} it was saved with: "
                "the file is damaged; load an earlier checkpoint (or load it anyway with `verify=False`)"
            )


def check_files(path: str, meta: dict[str, Any], names: list[str], verify: bool = True) -> None:
    """Before reading ``names``: ``meta.json`` lists each, and with ``verify`` each has its checksum."""
    missing = [name for name in names if name not in meta["files"]]
    if missing:
        raise CheckpointError(f"{os.path.join(path, META)}: lists no {missing[0]}: the checkpoint is damaged")
    if verify:
        verify_checksums(path, meta, names)


def check_shape(file: str, what: str, value: Any, shape: Iterable[int]) -> None:
    """``value``, read from ``file``, is a contiguous tensor of ``shape``; else the file is
    damaged (a zero-stride tensor of any shape takes a few bytes on disk and gigabytes once
    copied). ``load_tensor_file`` found every tensor of the file dense; ``value`` may be rows cut
    from one (``read_rows``), so a view of a storage that holds it passes here."""
    if not isinstance(value, torch.Tensor) or list(value.shape) != list(shape):
        raise CheckpointError(f"{file}: {what} has shape {list(getattr(value, 'shape', []))[:8]}, "
                              f"expected {list(shape)}: the checkpoint is damaged")
    if not is_compact(value):
        raise CheckpointError(f"{file}: {what} is not a dense tensor (its strides do not match its shape): "
                              "the checkpoint is damaged or was crafted")


def load_tensor_file(path: str, name: str, mmap: bool = False) -> Any:
    """``torch.load`` with ``weights_only=True``; every way a damaged file fails becomes a
    ``CheckpointError`` naming it. Every tensor in what comes back is dense (its shape needs
    exactly the bytes the file holds for it: ``tensor_checks``) and, unless ``mmap``, finite;
    a memory-mapped file is read for the rows a process needs only, so ``read_rows`` checks
    those rows' values."""
    file = os.path.join(path, name)
    return check_all(_load(file, mmap), file, "tensor", finite=not mmap)


def _load(file: str, mmap: bool) -> Any:
    """``torch.load`` of ``file`` (``load_tensor_file``), its failures as ``CheckpointError``."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "global" not in str(e).lower():  # no refused class or function: garbage bytes
            raise CheckpointError(f"{file}: cannot be read (not a tensor file): the checkpoint is damaged") from None
        raise CheckpointError(
            f"{file}: holds objects other than tensors and plain containers, which are never loaded "
            "(loading them could run code): it was not written by this program"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{file}: cannot be read ({reason}): the checkpoint is damaged") from None


# ----------------------------------------------------------------------------- row blocks

Piece = tuple[int, int, str]  # (first row, end row, file name) of a file holding some rows


def piece_name(stem: str, rows: tuple[int, int] | None = None, suffix: str = "") -> str:
    """The file of rows ``[a, b)`` of ``stem`` (``<stem>_rows_<a>_<b><suffix>.pt``), or with no
    ``rows`` of all of them (``<stem><suffix>.pt``)."""
    return f"{stem}{suffix}.pt" if rows is None else f"{stem}_rows_{rows[0]}_{rows[1]}{suffix}.pt"


def find_pieces(names: Iterable[str], stem: str, total: int, suffix: str = "") -> list[Piece]:
    """The files among ``names`` that hold rows of ``stem`` (of ``total`` rows), in row order."""
    pattern = re.compile(re.escape(stem) + r"(?:_rows_(\d+)_(\d+))?" + re.escape(suffix) + r"\.pt")
    pieces = []
    for name in names:
        if match := pattern.fullmatch(name):
            pieces.append((0, total, name) if match[1] is None else (int(match[1]), int(match[2]), name))
    return sorted(pieces)


def covers(pieces: list[Piece], total: int) -> bool:
    """Whether ``pieces`` tile ``[0, total)`` exactly, without gaps or overlaps."""
    end = 0
    for start, stop, _ in pieces:
        if start != end or stop <= start:
            return False
        end = stop
    return end == total


def pieces_for(path: str, meta: dict[str, Any], stem: str, total: int, rows: tuple[int, int], what: str,
               suffix: str = "") -> list[Piece]:
    """The files of the checkpoint at ``path`` that hold rows ``[start, stop)`` of ``stem``
    (``what`` in messages), after checking that its files hold each of its ``total`` rows once
    (they may come from any process count and placement)."""
    pieces = find_pieces(meta["files"], stem, total, suffix)
    if not covers(pieces, total):
        raise CheckpointError(f"{os.path.join(path, META)}: the files of {what} "
                              f"({[name for _, _, name in pieces] or 'none'}) do not cover its {total} rows: "
                              "the checkpoint is damaged")
    start, stop = rows
    return [piece for piece in pieces if piece[0] < stop and piece[1] > start]


def read_rows(path: str, pieces: list[Piece], rows: tuple[int, int]) -> Any:
    """Rows ``[start, stop)`` of what ``pieces`` (``pieces_for``) hold, joined from the files.
    A file holds a tensor or a dict (nested) of tensors: those with a first dimension hold the
    piece's rows and are cut and joined; scalars (an optimizer's step count) come from the first
    file. Files are memory-mapped, so a process reads only its rows; what comes back may be a
    view of one: copy what you keep."""
    if not pieces:
        raise CheckpointError(f"{path}: no file holds rows [{rows[0]}, {rows[1]})")
    loaded = [(piece, load_tensor_file(path, piece[2], mmap=True)) for piece in pieces]
    return _join(path, loaded, rows, "the tensor")


def _join(path: str, parts: list[tuple[Piece, Any]], rows: tuple[int, int], what: str) -> Any:
    """``read_rows`` of one level of the files' contents (``what`` in messages)."""
    first_piece, first = parts[0]
    start, stop = rows
    for (a, b, name), value in parts:
        file = os.path.join(path, name)
        if isinstance(first, dict):
            if not isinstance(value, dict) or value.keys() != first.keys():
                held = _keys(value, label) if isinstance(value, dict) else type(value).__name__
                raise CheckpointError(f"{file}: holds {held}, {first_piece[2]} holds {_keys(first, label)}: "
                                      "the checkpoint is damaged")
        elif not isinstance(value, torch.Tensor) or not isinstance(first, torch.Tensor) or value.dim() != first.dim() \
                or (value.dim() and value.shape[0] != b - a):
            raise CheckpointError(f"{file}: {what} has shape {list(getattr(value, 'shape', []))[:8]}, "
                                  f"expected {b - a} rows: the checkpoint is damaged")
        elif value.dtype != first.dtype:  # torch.cat would promote both to one type silently
            raise CheckpointError(f"{file}: {what} holds {str(value.dtype).removeprefix('torch.')} values, "
                                  f"{first_piece[2]} holds {str(first.dtype).removeprefix('torch.')}: "
                                  "the checkpoint is damaged")
    if isinstance(first, dict):
        return {key: _join(path, [(piece, value[key]) for piece, value in parts], rows, label(key)) for key in first}
    if first.dim() == 0:
        check_finite(first, os.path.join(path, first_piece[2]), what)
        return first
    cut = [value[max(start, a) - a:min(stop, b) - a] for (a, b, _), value in parts]
    for ((_, _, name), _), value in zip(parts, cut):  # the rows this process reads (the files are memory-mapped)
        check_finite(value, os.path.join(path, name), what)
    return cut[0] if len(cut) == 1 else torch.cat(cut)


def _keys(value: dict, label: Callable[[Any], str]) -> str:
    """A dict's keys read from a file, for a message: the first few, each bounded by ``label``."""
    keys = [label(key) for key in list(value)[:6]]
    return f"[{', '.join(keys)}{', ...' if len(value) > 6 else ''}]"
