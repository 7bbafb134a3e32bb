"""The file system's refusals of a write, in words: a ``StorageError`` whose message names the
path, the cause and the fix. ``writing`` turns the ``OSError`` (or the opaque ``RuntimeError``
of torch's zip writer on a full disk) met inside a block into one, and ``check_can_create`` /
``check_free_space`` let a program fail that way at its start instead of after hours of work.

A module of its own, below both ``dlrm.engine.atomic`` (the writers) and
``dlrm.engine.outputs`` (the output rule, whose claim probes the file system): both use it, and
neither needs the other to tell a full disk from a read-only mount.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import tempfile
from typing import Callable, Iterator

# The file system's refusals a writer meets: the cause in words, and what to do about it.
_FAULTS: dict[int, tuple[str, str]] = {
    errno.EROFS: ("read-only file system", "write to a writable file system, or remount this one read-write"),
    errno.ENOSPC: ("no space left on device", "free space on that file system, or write to another one"),
    errno.EDQUOT: ("disk quota exceeded", "free space within your quota, or write elsewhere"),
    errno.EACCES: ("permission denied", "write to a directory you may write to, or change its permissions"),
    errno.EPERM: ("operation not permitted", "write to a directory you may write to, or change its permissions"),
    errno.ENOTDIR: ("a part of the path is a file, not a directory", "choose a path whose parents are directories"),
    errno.EISDIR: ("a directory is in the way", "choose another path, or remove that directory"),
    errno.ENOENT: ("nothing can be created there (not an ordinary file system, e.g. /proc)",
                   "write to an ordinary writable file system"),
    errno.EFBIG: ("file too large for the file system", "write to another file system"),
    errno.ENAMETOOLONG: ("file name too long", "choose a shorter path"),
    errno.EIO: ("input/output error (a failing disk or an unreachable network file system)",
                "check the device, or write elsewhere"),
}
_NEARLY_FULL = 1 << 20  # bytes free below which a write failing without an errno is taken for a full disk
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")  # numpy's tofile, which drops the errno


class StorageError(OSError):
    """The file system refused a write. ``errno`` is the system's code; the message names the
    path, the cause and the fix, so scripts print it as their one line of error (exit code 2)."""

    what = ""  # what could not be written, e.g. "the checkpoint"
    needed: int | None = None  # bytes a full disk lacked room for, if known

    def __str__(self) -> str:
        return str(self.strerror)


def _existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def free_bytes(path: str) -> int | None:
    """Bytes free to us on the file system that holds (or would hold) ``path``; None if unknown."""
    try:
        return shutil.disk_usage(_existing(path)).free
    except OSError:
        return None


def describe(code: int, path: str | os.PathLike, what: str = "", needed: int | None = None) -> StorageError:
    """The ``StorageError`` of errno ``code`` met while writing ``path`` (``what``, e.g. "the
    checkpoint", says what it is); a full disk's message says how much is free, and ``needed``
    when that is more."""
    path = os.path.abspath(os.fspath(path))
    cause, fix = _FAULTS.get(code, (os.strerror(code).lower(), "check the file system, or write elsewhere"))
    if code in (errno.ENOSPC, errno.EDQUOT) and (free := free_bytes(path)) is not None:
        cause += f" ({needed:,} bytes needed, {free:,} free)" if needed and needed > free else f" ({free:,} bytes free)"
    error = StorageError(code, f"cannot write {what + ' ' if what else ''}{path}: {cause}; {fix}", path)
    error.what, error.needed = what, needed
    return error


def _about(filename: object, path: str, temporary_only: bool = False) -> bool:
    """Whether an error's file is ``path``, inside it, one of its temporaries beside it (or inside
    one), or a parent directory made for it: not, say, an input read while writing. With
    ``temporary_only``: inside one of its temporaries only."""
    if not isinstance(filename, (str, bytes, os.PathLike)):
        return False
    f = os.path.abspath(os.fsdecode(filename))
    name = os.path.basename(path)
    first = os.path.relpath(f, os.path.dirname(path)).split(os.sep)[0]
    if first.startswith(f".{name}.") or first == f"{name}.tmp":
        return True
    return not temporary_only and (first == name or first.startswith(f"{name}.")
                                   or path.startswith(f.rstrip(os.sep) + os.sep))


def fault_of(error: BaseException, path: str | os.PathLike) -> int | None:
    """The errno of a write to ``path`` that the file system refused, found in ``error`` or the
    errors it was raised from (torch's zip writer wraps the ``OSError`` of its writes in a
    ``RuntimeError``); a ``RuntimeError`` with nothing underneath, or numpy's short write, counts
    as a full disk when the disk is nearly full. None: not the file system's doing."""
    path = os.path.abspath(os.fspath(path))
    seen, e = set(), error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _FAULTS and (e.filename is None or _about(e.filename, path)):
            return e.errno
        e = e.__cause__ or e.__context__
    no_errno = isinstance(error, RuntimeError) or (isinstance(error, OSError) and error.errno is None
                                                   and _SHORT_WRITE.search(str(error)))
    if no_errno and (free := free_bytes(path)) is not None and free < _NEARLY_FULL:
        return errno.ENOSPC
    return None


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str = "", needed: int | None = None,
            cleanup: Callable[[], None] | None = None) -> Iterator[None]:
    """Turns the file system's refusal of a write to ``path`` inside the block into a
    ``StorageError`` (``describe``); one about a file inside a temporary of ``path`` is told
    again about ``path``. ``cleanup`` runs on any error, after the refusal was recognised (a full
    disk is seen before the partial files go) and before the free space is measured for the
    message (a full disk's error from inside is measured again)."""
    path = os.path.abspath(os.fspath(path))
    try:
        yield
    except BaseException as e:
        again = None  # describe's arguments of the error to raise instead
        if isinstance(e, StorageError):
            if _about(e.filename, path, temporary_only=True):
                again = (e.errno, path, what, needed)
            elif cleanup is not None and e.errno in (errno.ENOSPC, errno.EDQUOT):
                again = (e.errno, e.filename, e.what, e.needed)
        elif isinstance(e, Exception) and (code := fault_of(e, path)) is not None:
            again = (code, path, what, needed)
        if cleanup is not None:
            cleanup()
        if again is None:
            raise
        raise describe(*again) from e


def check_can_create(path: str | os.PathLike, what: str = "", inside: bool = False) -> None:
    """Fails now, with a ``StorageError``, when ``path`` (a file or directory to be written later,
    or with ``inside`` a directory to write files into) could not be created: the nearest existing
    directory above it (or, with ``inside``, at it) must take a new file (a probe, removed at
    once). Run before the work whose result would otherwise be lost."""
    path = os.path.abspath(os.fspath(path))
    parent = _existing(path if inside else os.path.dirname(path))
    if not os.path.isdir(parent):
        raise describe(errno.ENOTDIR, path, what)
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.{owner_tag()}.", suffix=".tmp")
    except OSError as e:
        if e.errno not in _FAULTS:
            raise
        raise describe(e.errno, path, what) from e
    os.close(fd)
    os.remove(probe)


def check_free_space(path: str | os.PathLike, needed: int, what: str = "") -> None:
    """Fails now, with a ``StorageError``, when the file system of ``path`` has less than
    ``needed`` bytes free."""
    free = free_bytes(os.path.abspath(os.fspath(path)))
    if free is not None and free < needed:
        raise describe(errno.ENOSPC, path, what, needed)


def owner_tag() -> str:
    """``<pid>@<host>``: what a temporary name carries so that a later run can tell it is stale."""
    return f"{os.getpid()}@{socket.gethostname()}"
