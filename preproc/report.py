"""Malformed lines: the reference's classification, the fail-mode error, the skip-mode summary.

Engines find bad lines their own (fast) way, but the reason and message of a bad line always
come from ``reference.parse_line`` run on its raw bytes, so every engine says the same thing.
Locations are kept as (file index, line) so summaries merge in input order; the first
``FIRST_LOCATIONS`` of each reason are kept, as the reference does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dlrm.engine.errors import DatasetError
from preproc.reference import ERROR_REASONS, _Malformed, parse_line

FIRST_LOCATIONS = 5


def classify(raw: bytes) -> tuple[str, str] | None:
    """(reason, detail) of one line (without its ``\\n``), or None if it is well formed.

    Decoded as the reference reads files: ASCII, each other byte replaced by U+FFFD.
    """
    try:
        parse_line(raw.decode("ascii", errors="replace"))
    except _Malformed as e:
        return e.reason, e.detail
    return None


def classify_bad(bad: list[tuple[int, bytes]]) -> list[tuple[int, str, str]]:
    """(line, reason, detail) of lines an engine set aside; each must be malformed."""
    out = []
    for line, raw in bad:
        found = classify(raw)
        if found is None:
            raise RuntimeError(f"internal error: line {line} was set aside, but the reference parses it: {raw[:80]!r}")
        out.append((line, found[0], found[1]))
    return out


def malformed_error(path: str, line: int, detail: str, skip: str = "rerun with --on_error skip (on_error='skip')",
                    what: str = "line") -> DatasetError:
    """The fail-mode error of a malformed line: where it is, why, and how to go on (``skip``:
    how to leave such lines out; the library functions name only their parameter)."""
    return DatasetError(f"{path}, {what} {line}: {detail}; fix or drop the {what}, or {skip} to leave out malformed {what}s")


@dataclass
class MalformedSummary:
    """Counts per reason and the first few (file index, line) locations of each."""

    counts: dict[str, int] = field(default_factory=lambda: {r: 0 for r in ERROR_REASONS})
    first: dict[str, list[tuple[int, int]]] = field(default_factory=lambda: {r: [] for r in ERROR_REASONS})

    def add(self, reason: str, file_index: int, line: int) -> None:
        self.counts[reason] += 1
        if len(self.first[reason]) < FIRST_LOCATIONS:
            self.first[reason].append((file_index, line))

    def extend(self, later: "MalformedSummary") -> None:
        """Append a summary of lines that come after all of this one's."""
        for r in ERROR_REASONS:
            self.counts[r] += later.counts[r]
            self.first[r] = (self.first[r] + later.first[r])[:FIRST_LOCATIONS]

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict:
        return {"counts": dict(self.counts), "first": {r: [list(x) for x in v] for r, v in self.first.items()}}

    @classmethod
    def from_json(cls, data: dict) -> "MalformedSummary":
        s = cls()
        for r in ERROR_REASONS:
            s.counts[r] = int(data["counts"][r])
            s.first[r] = [(int(a), int(b)) for a, b in data["first"][r]]
        return s

    def metadata(self, paths: list[str]) -> dict:
        """The reference's ``skipped_lines`` form: {reason: {count, first: ['path:line', ...]}}."""
        return {
            r: {"count": self.counts[r], "first": [f"{paths[i]}:{line}" for i, line in self.first[r]]}
            for r in ERROR_REASONS
            if self.counts[r]
        }


def empty_split_error(split: str, files: list[str], skipped: dict) -> DatasetError:
    """A split without a single well-formed row is an error, never an empty dataset."""
    return DatasetError(
        f"split '{split}' has no rows: its files {files} hold no well-formed line"
        + (f" ({skipped_text(skipped)})" if skipped else "")
    )


def skipped_text(skipped: dict) -> str:
    """The one-line stderr summary the reference prints."""
    total = sum(v["count"] for v in skipped.values())
    detail = "; ".join(f"{r}: {v['count']} (first at {', '.join(v['first'])})" for r, v in skipped.items())
    return f"skipped {total} malformed line(s): {detail}"
