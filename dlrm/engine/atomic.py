"""Files that are either the old version or the whole new one, never half written: the data
goes to a temporary file beside the target, is flushed to disk, and replaces the target with
one ``os.replace``. Used for specs, exported models, Triton configs and preprocessing state.

What the file system refuses (a read-only mount, a full disk, no permission, a file where a
directory should be) becomes a ``StorageError`` whose message names the path, the cause in words
and the fix: ``writing`` turns the ``OSError`` (or the opaque ``RuntimeError`` of torch's zip
writer on a full disk) into one, and ``check_can_create`` / ``check_free_space`` let a program
fail that way at its start instead of after hours of work. Those live in
``dlrm.engine.storage`` (below the output rule, which probes the file system too) and are
imported from here as well.

A writer killed outright (``kill -9``, power loss) cannot remove its temporary file, so the
name says who wrote it, ``.<target>.<pid>@<host>.<random>.tmp``, and the next write to the
same target removes those whose writer is gone: same host, pid no longer running. A live
writer's file (another process, or a thread of this one) and another host's are left alone.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import uuid
from typing import Callable, Mapping

from dlrm.engine.outputs import OutputKind, claim_output
from dlrm.engine.storage import check_can_create, owner_tag, writing

_OWNED = re.compile(r"(?P<pid>\d+)@(?P<host>.+)\.[A-Za-z0-9_]+\.tmp")  # after ".<target>."


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a pid we may not signal exists too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def written_by_dead_process(pid: int, host: str) -> bool:
    """True only when sure: the writer was on this host and its pid is gone."""
    return host == socket.gethostname() and not pid_alive(pid)


def temporary_name(path: str | os.PathLike) -> str:
    """A fresh name beside ``path`` (a file or directory on its way there), in the naming that
    ``remove_stale_temporaries`` recognises; for writers that create it themselves."""
    path = os.path.abspath(os.fspath(path))
    name = f".{os.path.basename(path)}.{owner_tag()}.{uuid.uuid4().hex[:8]}.tmp"
    return os.path.join(os.path.dirname(path), name)


def remove_stale_temporaries(path: str | os.PathLike) -> list[str]:
    """Remove the temporary files (or staging directories) of ``path`` that killed writers left;
    returns their paths."""
    path = os.path.abspath(os.fspath(path))
    directory, prefix = os.path.dirname(path), f".{os.path.basename(path)}."
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        m = _OWNED.fullmatch(name[len(prefix):]) if name.startswith(prefix) else None
        if m and written_by_dead_process(int(m["pid"]), m["host"]):
            stale = os.path.join(directory, name)
            try:
                if os.path.isdir(stale) and not os.path.islink(stale):
                    shutil.rmtree(stale)
                else:
                    os.remove(stale)
                removed.append(stale)
            except FileNotFoundError:  # another writer cleaned it first
                pass
    return removed


def fsync_dir(path: str | os.PathLike) -> None:
    """Makes the renames and new files in directory ``path`` durable (a crash keeps them)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str | os.PathLike, write: Callable[[str], None], what: str = "",
                     needed: int | None = None) -> None:
    """``write(tmp)`` fills a temporary file, which then replaces ``path``; on any failure the
    temporary file is removed and ``path`` is untouched, and a refusal of the file system is a
    ``StorageError`` (``writing``; ``needed``: the file's expected size, for a full disk's
    message). The file gets the usual permissions (0666 minus the umask), not ``mkstemp``'s
    0600: datasets and models are usually shared."""
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    with writing(path, what):
        os.makedirs(directory, exist_ok=True)
        remove_stale_temporaries(path)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.{owner_tag()}.", suffix=".tmp")
    os.close(fd)

    def remove_tmp() -> None:
        if os.path.exists(tmp):
            os.remove(tmp)

    with writing(path, what, needed, cleanup=remove_tmp):
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)


def write_text_atomically(path: str | os.PathLike, text: str, what: str = "") -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_atomically(path, write, what)


def check_writable_dir(path: str | os.PathLike, kind: OutputKind, setting: str, overwrite: bool, what: str = "",
                       inputs: Mapping[str, object] | None = None) -> str:
    """``path`` may become a directory output of ``kind``, as ``dlrm.engine.outputs.claim_output``
    rules (absent, empty, or this program's own earlier ``kind`` with ``overwrite``; never a
    foreign folder, a link, the working directory or one of ``inputs``), and the file system
    takes it: a staging directory can be created beside it, and an existing ``path`` takes new
    files (else a ``StorageError``). Returns ``path`` made absolute."""
    absolute = _check_replaceable(path, kind, setting, overwrite, inputs)
    check_can_create(absolute, what)
    if os.path.isdir(absolute):  # replaced whole, but one the user may not write into is not theirs to replace
        check_can_create(absolute, what, inside=True)
    return absolute


def _check_replaceable(path: str | os.PathLike, kind: OutputKind, setting: str, overwrite: bool,
                       inputs: Mapping[str, object] | None = None) -> str:
    return claim_output(path, kind, setting, inputs=inputs, replace=overwrite)  # type: ignore[arg-type]


def replace_dir(staging: str | os.PathLike, path: str | os.PathLike, kind: OutputKind, setting: str,
                overwrite: bool) -> None:
    """Renames the finished directory ``staging`` to ``path``. An old ``path`` is moved aside
    first (into a temporary directory that the next write removes if we die here), then
    deleted: no moment leaves a half-written directory at ``path``. What stands at ``path`` is
    checked again first (``claim_output`` for ``kind``): it may have been filled meanwhile."""
    path = os.fspath(path)
    _check_replaceable(path, kind, setting, overwrite)
    old = None
    if os.path.isdir(path):
        old = temporary_name(path)
        os.mkdir(old)
        os.replace(path, os.path.join(old, "dataset"))
    os.replace(staging, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


class StagedWriter:
    """A writer that stages its output and puts it in place only on ``close()``: used as a
    context manager it closes when the block ends normally and ``abort()``s (removing what it
    staged, leaving what was there before) when the block raises."""

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
