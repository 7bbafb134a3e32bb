"""Run output: human lines on stdout and machine-readable JSON lines in a log file."""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from typing import Any, TextIO


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=max(0, int(seconds))))


class RunLogger:
    """Writes one JSON object per line to ``log_path`` (appending, so a resumed run keeps the
    history of the run it continues) and plain lines to ``stream`` (default: ``sys.stdout``).

    Every record has ``type`` and ``time`` (seconds since the epoch). ``enabled=False`` silences
    both outputs, for ranks other than the first in multi-process runs. Used as a context manager,
    a run that ends in an exception before it wrote its ``summary`` gets one with the error.
    """

    def __init__(self, log_path: str | None = None, stream: TextIO | None = None, enabled: bool = True):
        self.stream = stream if stream is not None else sys.stdout  # None: stdout as it is now
        self.enabled = enabled
        self._file: TextIO | None = None
        self._kinds: set[str] = set()
        if enabled and log_path:
            os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
            self._file = open(log_path, "a", buffering=1)

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream, flush=True)

    def record(self, kind: str, **values: Any) -> None:
        self._kinds.add(kind)
        if self._file is not None:
            self._file.write(json.dumps({"type": kind, "time": time.time(), **values}, default=str) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None and "summary" not in self._kinds:
            self.record("summary", stop_reason="error" if isinstance(exc, Exception) else "aborted",
                        error=f"{type(exc).__name__}: {exc}")
        self.close()
