"""Progress of long runs on stderr: rows, rows/s, share of the input bytes done, ETA.

On a terminal one line is redrawn in place a few times a second; otherwise (a log file, CI) a
line is printed every ``interval`` seconds. Each stage ends with a summary line, whatever the
mode, so logs always carry the throughput of every stage.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _human(n: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _clock(seconds: float) -> str:
    s = int(max(0, seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """``mode``: 'auto' (a live line on a terminal, periodic lines otherwise), 'bar', 'log' or 'off'."""

    def __init__(self, mode: str = "auto", stream: TextIO | None = None, interval: float = 30.0):
        if mode not in ("auto", "bar", "log", "off"):
            raise ValueError(f"progress mode must be auto, bar, log or off, got {mode!r}")
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "log"
        self.mode = mode
        self.interval = interval if mode == "log" else 0.25
        self.stage = ""
        self.summaries: dict[str, dict] = {}
        self._start = self._last = 0.0
        self.rows = 0
        self.total_bytes = 0
        self.done_bytes = 0
        self.files = self.total_files = 0
        self.detail = ""  # extra text for the live line (e.g. Spark's task progress)
        self.unit = "files"

    def begin(self, stage: str, total_bytes: int = 0, total_files: int = 0, unit: str = "files") -> None:
        self.stage = stage
        self.unit = unit
        self._start = self._last = time.monotonic()
        self.rows = 0
        self.total_bytes, self.done_bytes = total_bytes, 0
        self.files, self.total_files = 0, total_files

    def update(self, rows: int = 0, done_bytes: int | None = None, files: int | None = None) -> None:
        """Add ``rows``; set the bytes done so far and the files finished, when given."""
        self.rows += rows
        if done_bytes is not None:
            self.done_bytes = done_bytes
        if files is not None:
            self.files = files
        now = time.monotonic()
        if self.mode != "off" and now - self._last >= self.interval:
            self._last = now
            self._emit(self._line(now), final=False)

    def _line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        parts = [f"[{self.stage}]"]
        if self.total_files:
            parts.append(f"{self.files}/{self.total_files} {self.unit}")
        parts.append(f"{_human(self.rows)} rows  {_human(self.rows / elapsed)} rows/s")
        if self.total_bytes:
            frac = min(self.done_bytes / self.total_bytes, 1.0)
            parts.append(f"{100 * frac:.0f}% of {_human(self.total_bytes)}B")
            if frac > 0:
                parts.append(f"eta {_clock(elapsed * (1 - frac) / frac)}")
        parts.append(_clock(elapsed))
        if self.detail:
            parts.append(self.detail)
        return "  ".join(parts)

    def _emit(self, text: str, final: bool) -> None:
        if self.mode == "bar":
            self.stream.write("\r\x1b[2K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def end(self, note: str = "") -> dict:
        """Finish the stage: print and return its summary (rows, seconds, rows/s)."""
        seconds = time.monotonic() - self._start
        summary = {"rows": self.rows, "seconds": round(seconds, 3), "rows_per_s": round(self.rows / max(seconds, 1e-9))}
        self.summaries[self.stage] = summary
        if self.mode != "off":
            text = f"[{self.stage}] {_human(self.rows)} rows in {seconds:.1f} s ({_human(summary['rows_per_s'])} rows/s)"
            self._emit(text + (f"  {note}" if note else ""), final=True)
        return summary

    def message(self, text: str) -> None:
        if self.mode != "off":
            if self.mode == "bar":
                self.stream.write("\r\x1b[2K")
            self.stream.write(text + "\n")
            self.stream.flush()
