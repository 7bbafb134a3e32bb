"""Which input files feed which split, and which lines of them.

Three layouts:

- **terabyte**: a directory of ``day_0`` .. ``day_23`` (each plain or ``.gz``). The chosen
  training days (default 0-22) are the train split; day 23 is cut by line count into halves,
  test first (``n // 2`` lines) then validation (the other ``n - n // 2``): NVIDIA's split.
- **kaggle**: a directory with ``train.txt`` (or ``train.txt.gz``) of the Kaggle Display
  Advertising Challenge. Its ``n`` lines are seen as 7 consecutive days of
  ``n // 7 (+1 for the first n % 7 days)`` lines: days 0-5 are train, and day 6 (``m = n // 7``
  lines) is cut into test (``m // 2`` lines) then validation (the rest). The challenge's
  ``test.txt`` has no labels and is not used.
- **files**: explicit lists of train, test and (optional) validation files, each file whole.

Files are numbered in the job's order: train files, then the file(s) that hold test, then
validation; that order and the line numbers define row positions (see ``order.py``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

SPLITS = ("train", "test", "validation")
DAY23 = "day23_halves"
KAGGLE = "kaggle_days"
_DAY = re.compile(r"day_([0-9]+)(\.gz)?")


@dataclass(frozen=True)
class InputFile:
    """One input file and the rule that assigns its lines to splits.

    ``rule`` is a split name (the whole file belongs to it), ``DAY23`` or ``KAGGLE``.
    """

    path: str
    rule: str

    @property
    def needs_line_count(self) -> bool:
        """True when the split boundaries depend on the file's number of lines."""
        return self.rule not in SPLITS

    def splits(self) -> list[str]:
        if self.rule == DAY23:
            return ["test", "validation"]
        if self.rule == KAGGLE:
            return list(SPLITS)
        return [self.rule]


def split_ranges(rule: str, lines: int) -> list[tuple[str, int, int]]:
    """``(split, first_line, last_line)`` (1-based, inclusive; empty when last < first) of a file."""
    if rule in SPLITS:
        return [(rule, 1, lines)]
    if rule == DAY23:
        half = lines // 2
        return [("test", 1, half), ("validation", half + 1, lines)]
    if rule == KAGGLE:
        held_out = lines // 7
        train = lines - held_out
        test = held_out // 2
        return [("train", 1, train), ("test", train + 1, train + test), ("validation", train + test + 1, lines)]
    raise ValueError(f"unknown split rule {rule!r}")


def parse_days(text: str) -> list[int]:
    """``0-22``, ``0-3,7`` or ``5`` -> sorted day numbers (no duplicates)."""
    days: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"([0-9]+)(?:-([0-9]+))?", part)
        if not m:
            raise ValueError(f"days {text!r}: cannot parse {part!r}; use e.g. '0-22' or '0-3,7'")
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        if last < first:
            raise ValueError(f"days {text!r}: range {part!r} runs backwards")
        days.update(range(first, last + 1))
    return sorted(days)


def _day_files(input_dir: str) -> dict[int, str]:
    found: dict[int, str] = {}
    for name in sorted(os.listdir(input_dir)):
        m = _DAY.fullmatch(name)
        if not m:
            continue
        day = int(m.group(1))
        path = os.path.join(input_dir, name)
        if day in found:
            raise ValueError(
                f"{input_dir}: day {day} exists twice ({os.path.basename(found[day])} and {name}); keep one of them"
            )
        found[day] = path
    return found


def terabyte_inputs(input_dir: str, train_days: list[int] | None = None) -> list[InputFile]:
    """Train days (default 0-22) as train, day 23 as the test/validation halves."""
    train_days = list(range(23)) if train_days is None else list(train_days)
    if not train_days:
        raise ValueError("no training days chosen")
    if 23 in train_days or any(d < 0 or d > 23 for d in train_days):
        raise ValueError(f"training days must lie in 0..22 (day 23 is test and validation), got {train_days}")
    days = _day_files(input_dir)
    missing = [d for d in train_days + [23] if d not in days]
    if missing:
        raise ValueError(
            f"{input_dir}: missing Criteo day file(s) {', '.join(f'day_{d}' for d in missing)} "
            f"(plain or .gz); download them or choose other days with --train_days"
        )
    return [InputFile(days[d], "train") for d in train_days] + [InputFile(days[23], DAY23)]


def kaggle_inputs(input_dir: str) -> list[InputFile]:
    """The Kaggle ``train.txt`` (or ``train.txt.gz``), split into 7 days by line count."""
    candidates = [os.path.join(input_dir, n) for n in ("train.txt", "train.txt.gz")]
    present = [p for p in candidates if os.path.exists(p)]
    if not present:
        raise ValueError(f"{input_dir}: no train.txt (or train.txt.gz) of the Kaggle Criteo dataset")
    if len(present) > 1:
        raise ValueError(f"{input_dir}: both train.txt and train.txt.gz exist; keep one of them")
    return [InputFile(present[0], KAGGLE)]


def detect_layout(input_dir: str) -> str:
    """``terabyte`` if day files are present, ``kaggle`` if train.txt is, else an error."""
    if not os.path.isdir(input_dir):
        raise ValueError(f"{input_dir}: not a directory")
    if _day_files(input_dir):
        return "terabyte"
    if any(os.path.exists(os.path.join(input_dir, n)) for n in ("train.txt", "train.txt.gz")):
        return "kaggle"
    raise ValueError(
        f"{input_dir}: found neither Criteo Terabyte day files (day_0 .. day_23) nor a Kaggle train.txt; "
        f"pass --layout, or the files with --train/--test/--validation"
    )


def file_inputs(train: list[str], test: list[str], validation: list[str] | None = None) -> list[InputFile]:
    """Explicit files, each wholly in one split; train and test are required."""
    if not train:
        raise ValueError("no train files given")
    if not test:
        raise ValueError("no test files given")
    inputs = [InputFile(p, "train") for p in train] + [InputFile(p, "test") for p in test]
    inputs += [InputFile(p, "validation") for p in validation or []]
    seen: set[str] = set()
    for f in inputs:
        key = os.path.realpath(f.path)
        if key in seen:
            raise ValueError(f"{f.path} is given twice; each input file belongs to one split")
        seen.add(key)
    return inputs


def job_splits(inputs: list[InputFile]) -> list[str]:
    """The splits the inputs produce, in the order train, test, validation."""
    present = {s for f in inputs for s in f.splits()}
    return [s for s in SPLITS if s in present]
