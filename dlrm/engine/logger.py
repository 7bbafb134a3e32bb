"""Run output: human lines on stdout, machine-readable JSON lines in a log file and, when asked,
the same metrics as TensorBoard scalars (``torch.utils.tensorboard``) to watch a run live.

The log file takes one of two forms (``log_format``): this program's own JSON lines (``json``,
one object per record, with ``type`` and ``time``), or the lines NVIDIA's DLRM example writes
through DLLogger (``dllogger``, ``DLLoggerLines``), for tools that parse those.

A write the file system refuses mid-run (the disk of the log or of the TensorBoard folder
filled up, it went read-only) raises a ``StorageError`` naming that output, its flag and the fix
(the entry points print it as one line, exit code 2), once: the output that failed is written no
more, so the records that follow (the checkpoint the run saves after the error, the summary) go
to the other outputs without raising again. The log keeps whole lines: a line the disk had no
room for is cut off again.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import math
import os
import sys
import threading
import time
from typing import Any, TextIO

from dlrm.engine.storage import StorageError, describe
from dlrm.engine.outputs import LOG, PROGRAM, OutputError, OutputKind, header_record, is_json_lines_log
from dlrm.version import __version__

# Record fields that place a value on the curve rather than being one.
_NOT_SCALARS = frozenset({"step", "epoch", "time"})


def record_scalars(kind: str, values: dict[str, Any]) -> dict[str, float]:
    """A record's curves, ``kind/name`` -> value at its ``step``: its finite numbers besides the
    step, epoch and time (none without an integer ``step``). TensorBoard gets these, and
    ``dlrm.engine.log_plot`` draws these from a log file."""
    if not isinstance(values.get("step"), int) or isinstance(values.get("step"), bool):
        return {}
    return {f"{kind}/{name}": value for name, value in values.items()
            if name not in _NOT_SCALARS and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class LogOpenError(OSError):
    """A run output that cannot be opened; ``what`` names the argument it came from (``log_path``
    or ``tensorboard_dir``), so the entry point's message names the flag."""

    def __init__(self, what: str, error: OSError, path: str):
        super().__init__(error.errno, error.strerror or str(error), path)
        self.what = what

    def __str__(self) -> str:
        return f"`{self.what}` {self.filename}: cannot be written ({self.strerror})"


# What each output is called in the message of a write that failed.
_OUTPUTS = {"log_path": "the log file (`log_path`)", "tensorboard_dir": "the TensorBoard folder (`tensorboard_dir`)"}


def _write_error(what: str, error: OSError, path: str) -> StorageError:
    """The ``StorageError`` of a refused write to output ``what`` (``log_path``, ``tensorboard_dir``)."""
    return describe(error.errno or errno.EIO, path, _OUTPUTS[what])


class _QuietTensorBoardThreads:
    """``threading.excepthook`` while a TensorBoard writer is open: leaves out the traceback of
    its writer thread's failed write (the writer raises that error again at its next call, where
    ``RunLogger`` turns it into its one-line message); anything else goes to the hook before."""

    def __init__(self) -> None:
        self.previous = threading.excepthook

    def __call__(self, args: threading.ExceptHookArgs) -> None:
        thread = type(args.thread)
        if (thread.__name__ == "_AsyncWriterThread" and thread.__module__.startswith("tensorboard.")
                and issubclass(args.exc_type, OSError)):
            return
        self.previous(args)

    def remove(self) -> None:
        if threading.excepthook is self:
            threading.excepthook = self.previous


LOG_FORMATS = ("json", "dllogger")

# The METADATA records NVIDIA's DLRM example writes when it opens its log, in its order.
_DLLOGGER_METADATA = (
    ("best_auc", {"unit": None}),
    *((f"mean_inference_latency_batch_{size}", {"unit": "s"}) for size in (1, 64, 4096)),
    ("average_train_throughput", {"unit": "samples/s"}),
    *((f"mean_inference_throughput_batch_{size}", {"unit": "samples/s"}) for size in (1, 64, 4096)),
)
_DLLOGGER_PREFIX = "DLLL "


class DLLoggerLines:
    """This program's records as the lines of DLLogger's JSON stream backend, as NVIDIA's DLRM
    example writes them: ``DLLL `` and a JSON object of ``timestamp`` (seconds since the epoch),
    ``datetime`` (local time), ``elapsedtime`` (seconds since the log was opened; all three as
    strings), ``type`` and, for a ``LOG`` record, ``step`` and ``data``; for a ``METADATA``
    record, ``metric`` and ``metadata``.

    The run's first record brings NVIDIA's METADATA records (units) and the flags its
    ``PARAMETER`` record. The final record, step ``[]``, has NVIDIA's names: after training
    ``best_auc``, ``best_validation_loss``, ``training_loss`` (the loss of the last progress line),
    ``best_epoch`` (the epochs done at the best AUC) and ``average_train_throughput``; after
    ``--mode test`` ``best_auc`` and ``best_validation_loss`` (that test's AUC and loss); after
    the inference benchmark ``mean_inference_latency_batch_<size>`` (seconds) and
    ``mean_inference_throughput_batch_<size>`` (samples/s). A run that ended in an error writes
    no final record (NVIDIA's would have none). Between them, step ``[epoch, step]`` records
    carry each progress line's ``loss``, ``lr`` and ``step_time`` and each test's ``auc`` and
    ``validation_loss``: ``step`` is this program's (the steps done), ``epoch`` the epoch that step
    was in, counted from 0. Values are those of this program's records; a figure with nothing
    behind it (no test ran) is NaN, as in them (NVIDIA's: 0, or 1e6 for the loss). Best values
    and ``best_epoch`` cover the tests of this process (``best_auc`` of a resumed run: the whole
    run, as its checkpoint keeps it)."""

    def __init__(self) -> None:
        self.start = datetime.datetime.now()
        self.started = False
        self.last_loss = math.nan
        self.best_loss = math.nan
        self.best_auc = math.nan
        self.best_epoch = math.nan

    def _line(self, **fields: Any) -> str:
        now = datetime.datetime.now()
        stamp = {"timestamp": str(now.timestamp()), "datetime": str(now),
                 "elapsedtime": str((now - self.start).total_seconds())}
        return _DLLOGGER_PREFIX + json.dumps({**stamp, **fields}, default=str) + "\n"

    def _log(self, step: Any, data: dict[str, Any]) -> str:
        return self._line(type="LOG", step=step, data=data)

    def lines(self, kind: str, values: dict[str, Any]) -> list[str]:
        """The DLLogger lines of one record (none for a kind NVIDIA's example does not log)."""
        out = []
        if not self.started:
            self.started = True
            # The first line carries this program's mark and the version that wrote the log.
            marks = [{"program": PROGRAM, "version": __version__}] + [{}] * (len(_DLLOGGER_METADATA) - 1)
            out += [self._line(type="METADATA", metric=name, metadata=meta, **mark)
                    for (name, meta), mark in zip(_DLLOGGER_METADATA, marks)]
        if kind == "flags":
            out.append(self._log("PARAMETER", values))
        elif kind == "train":
            self.last_loss = values["loss"]
            out.append(self._log([values["epoch"], values["step"]],
                                 {"loss": values["loss"], "lr": values["lr"], "step_time": values["step_time"]}))
        elif kind == "eval":
            auc, loss = values["auc"], values["loss"]
            if math.isnan(self.best_auc) or auc > self.best_auc:  # as the training loop keeps its best_auc
                self.best_auc, self.best_epoch = auc, values["epoch"]
            if math.isnan(self.best_loss) or loss < self.best_loss:
                self.best_loss = loss
            # the epoch its last step was in (the record's epoch counts the epochs done: 1.0 at the end of the first)
            epoch = max(math.ceil(values["epoch"]) - 1, 0)
            out.append(self._log([epoch, values["step"]], {"auc": auc, "validation_loss": loss}))
        elif kind == "summary" and "error" not in values:
            out += self._final(values)
        return out

    def _final(self, summary: dict[str, Any]) -> list[str]:
        if "stop_reason" in summary:  # training
            best_auc = summary["best_auc"]
            return [self._log([], {
                "best_auc": best_auc, "best_validation_loss": self.best_loss, "training_loss": self.last_loss,
                "best_epoch": self.best_epoch if best_auc == self.best_auc else math.nan,
                "average_train_throughput": summary["average_train_throughput"]})]
        if "inference" in summary:
            data = {}
            for row in summary["inference"]:
                size = row["batch_size"]
                data[f"mean_inference_latency_batch_{size}"] = row["mean_ms"] / 1000
                data[f"mean_inference_throughput_batch_{size}"] = row["throughput"]
            return [self._log([], data)]
        if "auc" in summary:  # --mode test
            return [self._log([], {"best_auc": summary["auc"], "best_validation_loss": summary["loss"]})]
        return []


DLLOGGER_LOG = OutputKind("run log in DLLogger's form", directory=False,
                          recognise=lambda path: is_json_lines_log(path, _DLLOGGER_PREFIX))


def log_kind(log_format: str) -> OutputKind:
    """The output kind (``dlrm.engine.outputs``) of a log file of ``log_format``: a log is appended
    to only by a run that writes the same form (``check_log_form``)."""
    return DLLOGGER_LOG if log_format == "dllogger" else LOG


def check_log_form(path: str, log_format: str) -> None:
    """Raises ``OutputError`` when ``path`` holds this program's log in the other form: one file
    never mixes the two; the message says which `log_format` adds to it."""
    if not os.path.isfile(path) or os.path.islink(path) or os.path.getsize(path) == 0:
        return
    for other in LOG_FORMATS:
        if other != log_format and log_kind(other).recognise(path):
            raise OutputError(f"`log_path` {path} holds this program's log in the form `log_format`={other}, not "
                              f"{log_format}: one log never mixes the two forms; pass `log_format`={other} to add to "
                              "it, or choose another path; nothing was changed")


def format_eta(seconds: float) -> str:
    return str(datetime.timedelta(seconds=max(0, int(seconds))))


class RunLogger:
    """Writes one JSON object per line to ``log_path`` (appending, so a resumed run keeps the
    history of the run it continues) and plain lines to ``stream`` (default: ``sys.stdout``).
    ``log_format="dllogger"``: the log's lines are DLLogger's instead (``DLLoggerLines``).

    Every record has ``type`` and ``time`` (seconds since the epoch). ``enabled=False`` silences
    every output, for ranks other than the first in multi-process runs. Used as a context manager,
    a run that ends in an exception before it wrote its ``summary`` gets one with the error.

    With ``tensorboard_dir``, every record that has a ``step`` also becomes TensorBoard scalars,
    one per finite number, tagged ``<type>/<field>`` (``train/loss``, ``eval/auc``,
    ``validation/ndcg``): both products write their curves through this one place.

    A write the file system refuses raises a ``StorageError`` (module docstring) and ends that
    output: later records skip it.
    """

    def __init__(self, log_path: str | None = None, stream: TextIO | None = None, enabled: bool = True,
                 tensorboard_dir: str | None = None, log_format: str = "json"):
        if log_format not in LOG_FORMATS:
            raise ValueError(f"`log_format` {log_format!r} is none of {', '.join(LOG_FORMATS)}")
        self._dllogger = DLLoggerLines() if log_format == "dllogger" else None
        self.stream = stream if stream is not None else sys.stdout  # None: stdout as it is now
        self.enabled = enabled
        self._fd: int | None = None  # the log file, appended to with whole lines
        self._log_path = log_path
        self._tensorboard: Any = None
        self._tensorboard_dir = tensorboard_dir
        self._hook: _QuietTensorBoardThreads | None = None
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
            self._hook = _QuietTensorBoardThreads()
            threading.excepthook = self._hook
        if enabled and log_path:
            try:
                os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
                self._fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
                if self._dllogger is None and os.fstat(self._fd).st_size == 0:
                    self._append(self._header())
            except OSError as e:
                self.close()
                raise LogOpenError("log_path", e, log_path) from None

    @staticmethod
    def _header() -> bytes:
        """A new log's first record: the mark (``outputs.PROGRAM``) by which a later run tells
        this program's log from anyone's JSON lines."""
        return (json.dumps(header_record()) + "\n").encode()

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream, flush=True)

    def record(self, kind: str, **values: Any) -> None:
        """Writes one record to the log file and, if it has a ``step``, its numbers to TensorBoard.
        Raises ``StorageError`` when the file system refuses the write (that output then ends)."""
        self._kinds.add(kind)
        if self._fd is not None:
            if self._dllogger is not None:
                line = "".join(self._dllogger.lines(kind, values))
            else:
                line = json.dumps({"type": kind, "time": time.time(), **values}, default=str) + "\n"
            try:
                if line:
                    self._append(line.encode())
            except OSError as e:
                self._end_log()
                raise _write_error("log_path", e, self._log_path) from e
        if self._tensorboard is not None and isinstance(values.get("step"), int):
            try:
                for tag, value in record_scalars(kind, values).items():
                    self._tensorboard.add_scalar(tag, value, values["step"])
                self._tensorboard.flush()  # a watcher sees each point as it is logged
            except OSError as e:  # the writer thread's failed write, raised again here
                with contextlib.suppress(StorageError):
                    self._end_tensorboard()
                raise _write_error("tensorboard_dir", e, self._tensorboard_dir) from e

    def _append(self, data: bytes) -> None:
        """Appends ``data`` whole or not at all: a write cut short (a full disk) is truncated
        away, so the log stays whole JSON lines that a resumed run appends to."""
        start = os.lseek(self._fd, 0, os.SEEK_END)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, start)
            raise

    def _end_log(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None

    def _end_tensorboard(self) -> None:
        """Closes the TensorBoard writer; raises ``StorageError`` if what it still held cannot be written."""
        writer, self._tensorboard = self._tensorboard, None
        if writer is None:
            return
        try:
            writer.close()  # writes what is queued; after a failed write it raises that error again
        except OSError as e:
            raise _write_error("tensorboard_dir", e, self._tensorboard_dir) from e
        finally:
            if self._hook is not None:
                self._hook.remove()
                self._hook = None

    def close(self) -> None:
        self._end_log()
        self._end_tensorboard()

    def __enter__(self) -> "RunLogger":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            self.close()
            return
        # The error in flight is what the user needs: a log that cannot take its summary, or
        # close, does not replace it.
        with contextlib.suppress(StorageError):
            if "summary" not in self._kinds:
                self.record("summary", stop_reason="error" if isinstance(exc, Exception) else "aborted",
                            error=f"{type(exc).__name__}: {exc}")
        with contextlib.suppress(StorageError):
            self.close()
