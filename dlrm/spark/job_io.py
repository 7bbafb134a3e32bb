"""What every Spark job of either product reads and writes: raw text lines with the file and line
each came from (so a bad line is named by both), a Parquet directory written all or nothing, and
the library error that failed a task, recovered from the driver's exception."""

from __future__ import annotations

import re
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any
from urllib.parse import unquote, urlparse

from dlrm.engine.errors import DatasetError
from dlrm.engine.outputs import OutputKind, holds_only

# Where a raw line comes from (read_raw_lines): its file, and the first byte of the file split read with it.
FILE_COLUMN = "_file"
SPLIT_START_COLUMN = "_split_start"


def read_raw_lines(spark: Any, path: str) -> Any:
    """The lines of text files (a path or glob: raw Criteo TSV for ``score.prepare_raw_rows``, DSSTNE
    text for ``recommend``), with where each comes from (``line_of``), so that a malformed line is named by its file
    and line number."""
    lines = spark.read.option("lineSep", "\n").text(path)
    return lines.select("value", lines["_metadata.file_path"].alias(FILE_COLUMN),
                        lines["_metadata.file_block_start"].alias(SPLIT_START_COLUMN))


def line_of(frame: Any, index: int, seen: Counter) -> tuple[str, int]:
    """The file and line number (from 1) of row ``index`` of a batch of ``read_raw_lines``, given
    ``seen``: the lines of each (file, split start) in the task's earlier batches.

    Spark reads a file split from the first line that starts after the split's first byte
    (a line that starts there belongs to the split before), so the lines before a split
    starting at byte s > 0 are the newlines in bytes [0, s), plus one; they are counted only
    for a local file (elsewhere the line is named within its split)."""
    file, start = frame[FILE_COLUMN].iat[index], int(frame[SPLIT_START_COLUMN].iat[index])
    earlier = frame.iloc[:index]
    same_split = (earlier[FILE_COLUMN] == file) & (earlier[SPLIT_START_COLUMN] == start)
    line = seen[(file, start)] + int(same_split.sum()) + 1  # within the split
    url = urlparse(file)
    if url.scheme not in ("", "file"):
        return (f"{file} (its split from byte {start})", line) if start else (file, line)
    path = unquote(url.path)
    if start:
        line += 1
        with open(path, "rb") as f:
            while f.tell() < start and (chunk := f.read(min(1 << 24, start - f.tell()))):
                line += chunk.count(b"\n")
    return path, line


def is_parquet_output(path: str) -> bool:
    """Whether folder ``path`` holds nothing but what a Spark job writes as a Parquet directory:
    ``part-*`` files, ``_SUCCESS``, the commit protocol's markers and Hadoop's ``.crc`` files of those."""
    return holds_only(path, ["part-*", "_SUCCESS", "_committed_*", "_started_*", ".part-*.crc", "._SUCCESS.crc"],
                      required=["_SUCCESS"])


PARQUET_OUTPUT = OutputKind("Parquet output of a Spark job", directory=True, recognise=is_parquet_output)


def write_parquet(frame: Any, path: str) -> None:
    """Writes ``frame`` as the Parquet directory ``path``, replacing one there, all or nothing:
    Spark writes a hidden sibling directory, which is renamed into place once complete, so a
    failed write leaves ``path`` as it was. Any Hadoop filesystem (the JVM's API does the renames)."""
    spark = frame.sparkSession
    hadoop = spark.sparkContext._jvm.org.apache.hadoop.fs
    target = hadoop.Path(path)
    fs = target.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    target = fs.makeQualified(target)
    tag = uuid.uuid4().hex[:12]
    staged = hadoop.Path(target.getParent(), f".{target.getName()}.{tag}.tmp")  # a leading "." hides it
    old = hadoop.Path(target.getParent(), f".{target.getName()}.{tag}.old")
    try:
        frame.write.parquet(staged.toString())
        replaced = fs.exists(target) and fs.rename(target, old)
        if not fs.rename(staged, target):
            if replaced:
                fs.rename(old, target)
            raise OSError(f"{path}: could not move the written scores there from {staged.toString()}")
        if replaced:
            fs.delete(old, True)
    finally:
        if fs.exists(staged):
            fs.delete(staged, True)


def task_error(error: BaseException, classes: Sequence[type[Exception]] = (DatasetError,)) -> Exception | None:
    """The error of one of ``classes`` (by default ``DatasetError``: a malformed row, an id out of
    range) that failed a Spark task, from the exception the driver got, or None. Spark sends a
    task's Python traceback as text; the error's message, on its last line, names the file, the
    row and the fix."""
    for cls in classes:
        name = re.escape(f"{cls.__module__}.{cls.__qualname__}")
        match = re.search(rf"^{name}: (.+)$", str(error), re.MULTILINE)
        if match:
            return cls(match.group(1))
    return None
