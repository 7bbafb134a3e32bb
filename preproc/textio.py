"""Reading input files as chunks of whole lines, with the reference's idea of a line.

Only ``\\n`` ends a line (a ``\\r`` stays part of it); a last line without ``\\n`` is still a
line; an empty file has none. ``.gz`` files are decompressed on the fly. Chunks are read ahead
in a background thread (file reads and zlib release the GIL), so decompression overlaps parsing.
"""

from __future__ import annotations

import gzip
import queue
import threading
from typing import IO, Iterator

DEFAULT_CHUNK_BYTES = 32 << 20


def _open(path: str) -> tuple[IO[bytes], IO[bytes]]:
    """(stream of file bytes, raw file whose position measures progress)."""
    raw = open(path, "rb")
    if path.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb"), raw
    return raw, raw


def read_line_chunks(path: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tuple[bytes, int]]:
    """Yield ``(data, raw_bytes_read)``: ``data`` holds whole lines, each ending in ``\\n``.

    A final line without ``\\n`` gets one appended, so every chunk splits the same way.
    ``raw_bytes_read`` is the position in the file on disk (compressed for ``.gz``), for progress.
    """
    stream, raw = _open(path)
    try:
        carry = b""
        while True:
            block = stream.read(chunk_bytes)
            if not block:
                break
            data = carry + block if carry else block
            cut = data.rfind(b"\n")
            if cut < 0:
                carry = data
                continue
            carry = data[cut + 1 :]
            yield data[: cut + 1], raw.tell()
        if carry:
            yield carry + b"\n", raw.tell()
    finally:
        stream.close()
        if raw is not stream:
            raw.close()


def numbered_chunks(path: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[tuple[bytes, int, int, int]]:
    """``(data, first_line, lines, raw_bytes_read)`` for each chunk of ``path``; lines count from 1."""
    first = 1
    for data, raw_pos in read_line_chunks(path, chunk_bytes):
        lines = data.count(b"\n")
        yield data, first, lines, raw_pos
        first += lines


def count_lines(path: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Number of lines as the reference counts them (a last line without ``\\n`` counts)."""
    stream, raw = _open(path)
    lines = 0
    last = b"\n"
    try:
        while True:
            block = stream.read(chunk_bytes)
            if not block:
                break
            lines += block.count(b"\n")
            last = block[-1:]
    finally:
        stream.close()
        if raw is not stream:
            raw.close()
    return lines + (0 if last == b"\n" else 1)


class _Done:
    pass


def prefetch(items: Iterator, depth: int = 2) -> Iterator:
    """Iterate ``items`` in a background thread, ``depth`` items ahead; errors re-raise here.

    Closing the returned generator early (an exception in the consumer) stops the thread.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def run() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_Done())
        except BaseException as e:  # handed to the consumer
            put(e)
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=run, name="preproc-read", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if isinstance(item, _Done):
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        thread.join()
