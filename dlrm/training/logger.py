"""Run output: human lines on stdout, machine-readable JSON lines in a log file and, when asked,
the same metrics as TensorBoard scalars (``torch.utils.tensorboard``) to watch a run live."""

from __future__ import annotations

import datetime
import json
import os
import sys
import math
import time
from typing import Any, TextIO

# Record fields that place a value on the curve rather than being one.
_NOT_SCALARS = frozenset({"step", "epoch", "time"})


class LogOpenError(OSError):
    """A run output that cannot be opened; ``what`` names the argument it came from (``log_path``
    or ``tensorboard_dir``), so the entry point's message names the flag."""

    def __init__(self, what: str, error: OSError, path: str):
        super().__init__(error.errno, error.strerror or str(error), path)
        self.what = what

    def __str__(self) -> str:
        return f"`{self.what}` {self.filename}: cannot be written ({self.strerror})"


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=max(0, int(seconds))))


class RunLogger:
    """Writes one JSON object per line to ``log_path`` (appending, so a resumed run keeps the
    history of the run it continues) and plain lines to ``stream`` (default: ``sys.stdout``).

    Every record has ``type`` and ``time`` (seconds since the epoch). ``enabled=False`` silences
    every output, for ranks other than the first in multi-process runs. Used as a context manager,
    a run that ends in an exception before it wrote its ``summary`` gets one with the error.

    With ``tensorboard_dir``, every record that has a ``step`` also becomes TensorBoard scalars,
    one per finite number, tagged ``<type>/<field>`` (``train/loss``, ``eval/auc``,
    ``validation/ndcg``): both products write their curves through this one place.
    """

    def __init__(self, log_path: str | None = None, stream: TextIO | None = None, enabled: bool = True,
                 tensorboard_dir: str | None = None):
        self.stream = stream if stream is not None else sys.stdout  # None: stdout as it is now
        self.enabled = enabled
        self._file: TextIO | None = None
        self._tensorboard: Any = None
        self._kinds: set[str] = set()
        if enabled and tensorboard_dir:
            # torch's writer: needs the tensorboard package (extra "tensorboard"); imported only
            # here so that runs without --tensorboard_dir never need it. tensorboard first, so a
            # missing one raises an ImportError naming it (the entry points turn that into the
            # pip line), not torch's rewording.
            import tensorboard  # noqa: F401
            from torch.utils.tensorboard import SummaryWriter
            try:
                self._tensorboard = SummaryWriter(tensorboard_dir)
            except OSError as e:
                raise LogOpenError("tensorboard_dir", e, tensorboard_dir) from None
        if enabled and log_path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
                self._file = open(log_path, "a", buffering=1)
            except OSError as e:
                self.close()
                raise LogOpenError("log_path", e, log_path) from None

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream, flush=True)

    def record(self, kind: str, **values: Any) -> None:
        self._kinds.add(kind)
        if self._file is not None:
            self._file.write(json.dumps({"type": kind, "time": time.time(), **values}, default=str) + "\n")
        if self._tensorboard is not None and isinstance(values.get("step"), int):
            for name, value in values.items():
                if (name not in _NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool)
                        and math.isfinite(value)):
                    self._tensorboard.add_scalar(f"{kind}/{name}", value, values["step"])
            self._tensorboard.flush()  # a watcher sees each point as it is logged

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None and "summary" not in self._kinds:
            self.record("summary", stop_reason="error" if isinstance(exc, Exception) else "aborted",
                        error=f"{type(exc).__name__}: {exc}")
        self.close()
