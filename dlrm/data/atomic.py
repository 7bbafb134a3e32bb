"""Files that are either the old version or the whole new one, never half written: the data
goes to a temporary file beside the target, is flushed to disk, and replaces the target with
one ``os.replace``. Used for specs, exported models, Triton configs and preprocessing state."""

from __future__ import annotations

import os
import tempfile
from typing import Callable


def write_atomically(path: str | os.PathLike, write: Callable[[str], None]) -> None:
    """``write(tmp)`` fills a temporary file, which then replaces ``path``; on any failure the
    temporary file is removed and ``path`` is untouched. The file gets the usual permissions
    (0666 minus the umask), not ``mkstemp``'s 0600: datasets and models are usually shared."""
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_atomically(path, write)
