"""A bound on the length of a line of user text, checked while the bytes stream by.

A text reader that splits lines itself keeps the unfinished line in memory until its newline
comes; a file with no newline (what ``truncate`` makes: all NUL bytes) or one huge line would
then be read whole, and an engine handed it (polars, Spark, numpy) asks for several times its
size. Every reader of user text therefore checks each line against a bound before it holds
more than the bound plus one read block, and refuses a file with NUL bytes (binary, not text):
one line naming the file, the line number and the bound, never echoing what was read.

``LineBound`` checks a stream block by block (for readers that read blocks);
``bounded_lines`` yields the lines of an open file (for readers that go line by line).
"""

from __future__ import annotations

from typing import IO, AnyStr, Iterator

from dlrm.engine.errors import DatasetError

MAX_LINE_BYTES = 1 << 20  # a Criteo or CSV line of numbers is under 1 KB
_NEWLINE = {bytes: b"\n", str: "\n"}
_NUL = {bytes: b"\0", str: "\0"}


def _human(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 and size % (1 << 20) == 0 else f"{size:,} bytes"


def line_too_long(path: str, line: int, max_bytes: int) -> DatasetError:
    """The error for line ``line`` of ``path`` longer than ``max_bytes``."""
    return DatasetError(f"{path}, line {line}: longer than {_human(max_bytes)}, the longest line this reader "
                        f"accepts; is this the right file? (a file without newlines is one long line)")


def binary_content(path: str, line: int) -> DatasetError:
    """The error for a NUL byte on line ``line`` of ``path``."""
    return DatasetError(f"{path}, line {line}: holds a NUL byte: binary data, not text; give the text file")


class LineBound:
    """Checks the successive blocks of one file: no NUL byte, no line over ``max_bytes`` (the
    bytes before its ``\\n``). Only counters are kept, so a file of any size costs one block."""

    def __init__(self, path: str, max_bytes: int = MAX_LINE_BYTES, first: int = 1):
        self.path = path
        self.max_bytes = max_bytes
        self.first = first
        self.line = first  # the line that the next block continues
        self.open = 0  # bytes of that line already seen

    def feed(self, block: bytes) -> None:
        """Check ``block``, the bytes that follow everything fed before; raises DatasetError."""
        nul = block.find(b"\0")
        if nul < 0:
            self._feed_text(block)
            return
        self._feed_text(block[:nul])  # an earlier line may be too long: the first problem is reported
        raise binary_content(self.path, self.line)

    def _feed_text(self, block: bytes) -> None:
        first = block.find(b"\n")
        if first < 0:
            self.open += len(block)
            if self.open > self.max_bytes:
                raise line_too_long(self.path, self.line, self.max_bytes)
            return
        if self.open + first > self.max_bytes:
            raise line_too_long(self.path, self.line, self.max_bytes)
        self._check_rest(block, first + 1)
        last = block.rfind(b"\n")
        self.open = len(block) - last - 1
        self.line += block.count(b"\n")

    def _check_rest(self, block: bytes, start: int) -> None:
        """Lines starting at ``start`` (a line start): every window of ``max_bytes + 1`` bytes
        from a line start must hold a newline; hopping to the window's last one takes about
        ``len(block) / max_bytes`` C-speed searches, not one step per line."""
        window = self.max_bytes + 1
        end = len(block)
        while end - start > self.max_bytes:
            cut = block.rfind(b"\n", start, start + window)
            if cut < 0:
                raise line_too_long(self.path, self.line + block.count(b"\n", 0, start), self.max_bytes)
            start = cut + 1

    def finish(self) -> int:
        """Number of lines fed (a last line without ``\\n`` counts)."""
        return self.line - self.first + (self.open > 0)


def check_stream(stream: IO[bytes], path: str, max_bytes: int = MAX_LINE_BYTES, block_bytes: int = 8 << 20) -> int:
    """Read ``stream`` to its end in blocks, checking every line; returns the number of lines."""
    bound = LineBound(path, max_bytes)
    while True:
        block = stream.read(block_bytes)
        if not block:
            return bound.finish()
        bound.feed(block)


def bounded_lines(f: IO[AnyStr], path: str, max_bytes: int = MAX_LINE_BYTES, first: int = 1) -> Iterator[AnyStr]:
    """The lines of ``f`` (each with its ``\\n``, the last maybe without), refusing one over
    ``max_bytes`` (characters for a text file) or holding a NUL, having read at most that
    much of it. Errors number the first line this call reads ``first``."""
    number = first - 1
    newline = nul = None
    while True:
        line = f.readline(max_bytes + 2)
        if not line:
            return
        number += 1
        if newline is None:
            newline, nul = _NEWLINE[type(line)], _NUL[type(line)]
        if nul in line:
            raise binary_content(path, number)
        if len(line) - line.endswith(newline) > max_bytes:
            raise line_too_long(path, number, max_bytes)
        yield line
