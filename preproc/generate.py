"""Synthetic click logs in the raw Criteo format, for testing preprocessing without the real data.

Each line is ``label \\t I1..I13 \\t C1..C26``: a 0/1 label, 13 integer counts and 26 categorical
values written as 8 lowercase hex digits; any feature may be empty (missing). The data imitates
the properties that matter to a preprocessing pipeline: heavy-tailed counts (and a few negative
ones, as in the real I2), per-column missing rates, vocabularies from 4 to 200k values drawn
with Zipf-like skew (so frequency thresholds matter), and a label that a model can learn.

Everything is drawn from one seeded numpy generator in fixed-size chunks, so the output depends
only on (rows, seed, days), and 1M rows take seconds.

    python -m preproc.generate --output /tmp/criteo.tsv --rows 1000000
    python -m preproc.generate --output /tmp/criteo_days --rows 2400000 --days 24 --gzip

--output must be new (or, with --days, an empty folder); what an earlier run wrote there is
replaced with --overwrite, and a file or folder of anything else never (exit 2, one line).
"""

from __future__ import annotations

import argparse
import gzip as gzip_module
import os
import re
import sys
from dataclasses import dataclass
from typing import IO

import numpy as np

from dlrm.engine.storage import StorageError, check_can_create
from dlrm.engine.outputs import OutputError, OutputKind, claim_output

NUM_NUMERICAL = 13
NUM_CATEGORICAL = 26

# Vocabulary size of each categorical column, shaped like the real data's cardinalities (scaled
# down): a few huge columns, many medium ones, some with a handful of values.
VOCAB_SIZES = (
    200_000, 30_000, 15_000, 7_000, 20_000, 4, 7_000, 1_400, 63, 150_000, 100_000, 60_000, 11,
    2_200, 10_000, 104, 4, 968, 15, 180_000, 120_000, 160_000, 50_000, 12_000, 97, 35,
)
# Probability that a field is empty, per column.
NUMERICAL_MISSING_RATES = (0.45, 0.05, 0.20, 0.22, 0.05, 0.23, 0.05, 0.05, 0.05, 0.45, 0.05, 0.40, 0.22)
CATEGORICAL_MISSING_RATES = (
    0.05, 0.05, 0.10, 0.10, 0.05, 0.12, 0.05, 0.05, 0.05, 0.05, 0.05, 0.10, 0.05,
    0.05, 0.05, 0.10, 0.05, 0.05, 0.45, 0.45, 0.10, 0.05, 0.40, 0.05, 0.45, 0.45,
)
ZIPF_EXPONENT = 1.1  # P(rank r) ~ 1 / (r + 1)^a
TARGET_POSITIVE_RATE = 0.25
NEGATIVE_COLUMN = 1  # I2: real Criteo has values -1..-3 here
NEGATIVE_RATE = 0.05
_CHUNK_ROWS = 200_000
_CALIBRATION_ROWS = 100_000
# Columns that drive the label: a few counts (log-scaled) and per-value effects of a few categoricals.
_LABEL_NUMERICAL = (0, 2, 5, 10)
_LABEL_CATEGORICAL = (1, 5, 8, 13, 18)
_HEX = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)


@dataclass
class _Columns:
    """Per-column parameters, drawn once so that all days share vocabularies and label model."""

    log_mu: np.ndarray  # [13] lognormal parameters of the counts
    log_sigma: np.ndarray
    cdfs: list[np.ndarray]  # [26] cumulative Zipf probabilities over ranks
    vocab_hex: list[np.ndarray]  # [26] the values as 8-char strings, index = rank
    effects: list[np.ndarray]  # [26] label effect of each value (zero outside _LABEL_CATEGORICAL)
    weights: np.ndarray  # [13] label weight of log1p(count)
    bias: float = 0.0


def _hex8(values: np.ndarray) -> np.ndarray:
    """uint32 -> array of 8-digit lowercase hex strings, without a Python loop per value."""
    shifts = np.arange(28, -1, -4, dtype=np.uint32)
    digits = _HEX[(values[:, None] >> shifts) & 0xF]
    return np.ascontiguousarray(digits).view("S8").reshape(-1).astype("U8")


def _make_columns(rng: np.random.Generator) -> _Columns:
    log_mu = rng.uniform(0.5, 3.5, NUM_NUMERICAL)
    log_sigma = rng.uniform(0.8, 2.0, NUM_NUMERICAL)
    cdfs, vocab_hex, effects = [], [], []
    for j, size in enumerate(VOCAB_SIZES):
        p = 1.0 / np.arange(1, size + 1, dtype=np.float64) ** ZIPF_EXPONENT
        cdf = np.cumsum(p)
        cdfs.append(cdf / cdf[-1])
        hashes = rng.choice(np.uint64(2**32), size=size, replace=False).astype(np.uint32)
        vocab_hex.append(_hex8(hashes))
        effect = rng.normal(0.0, 1.0, size) if j in _LABEL_CATEGORICAL else np.zeros(size)
        effects.append(effect)
    weights = np.zeros(NUM_NUMERICAL)
    weights[list(_LABEL_NUMERICAL)] = rng.normal(0.0, 0.4, len(_LABEL_NUMERICAL))
    return _Columns(log_mu, log_sigma, cdfs, vocab_hex, effects, weights)


def _draw(rng: np.random.Generator, cols: _Columns, n: int):
    """Features of n rows: counts, their missing mask, category ranks, their missing mask, logits."""
    counts = np.floor(rng.lognormal(cols.log_mu, cols.log_sigma, (n, NUM_NUMERICAL)) - 0.5).astype(np.int64)
    counts = np.maximum(counts, 0)
    negative = rng.random(n) < NEGATIVE_RATE
    counts[negative, NEGATIVE_COLUMN] = rng.integers(-3, 0, int(negative.sum()))
    num_missing = rng.random((n, NUM_NUMERICAL)) < np.asarray(NUMERICAL_MISSING_RATES)
    ranks = np.empty((n, NUM_CATEGORICAL), dtype=np.int64)
    for j, cdf in enumerate(cols.cdfs):
        ranks[:, j] = np.minimum(np.searchsorted(cdf, rng.random(n), side="right"), len(cdf) - 1)
    cat_missing = rng.random((n, NUM_CATEGORICAL)) < np.asarray(CATEGORICAL_MISSING_RATES)
    present = np.where(num_missing, 0, np.maximum(counts, 0))
    logits = np.log1p(present) @ cols.weights
    for j in _LABEL_CATEGORICAL:
        logits += np.where(cat_missing[:, j], 0.0, cols.effects[j][ranks[:, j]])
    return counts, num_missing, ranks, cat_missing, logits


def _calibrate_bias(rng: np.random.Generator, cols: _Columns) -> float:
    """The bias that gives TARGET_POSITIVE_RATE on a pilot sample (bisection; the rate is monotone)."""
    logits = _draw(rng, cols, _CALIBRATION_ROWS)[-1]
    lo, hi = -30.0, 30.0
    for _ in range(60):
        mid = (lo + hi) / 2
        rate = np.mean(1.0 / (1.0 + np.exp(-(logits + mid))))
        lo, hi = (mid, hi) if rate < TARGET_POSITIVE_RATE else (lo, mid)
    return (lo + hi) / 2


def _format_chunk(rng: np.random.Generator, cols: _Columns, n: int) -> str:
    counts, num_missing, ranks, cat_missing, logits = _draw(rng, cols, n)
    labels = rng.random(n) < 1.0 / (1.0 + np.exp(-(logits + cols.bias)))
    fields: list[list[str]] = [np.where(labels, "1", "0").tolist()]
    for j in range(NUM_NUMERICAL):
        text = counts[:, j].astype("U20")
        text[num_missing[:, j]] = ""
        fields.append(text.tolist())
    for j in range(NUM_CATEGORICAL):
        text = cols.vocab_hex[j][ranks[:, j]]
        text[cat_missing[:, j]] = ""
        fields.append(text.tolist())
    return "".join("\t".join(row) + "\n" for row in zip(*fields))


def _open(path: str, gzip: bool) -> IO[bytes]:
    if gzip:
        # mtime=0 and no file name in the header: the same seed gives byte-identical files.
        return gzip_module.GzipFile(filename="", mode="wb", fileobj=open(path, "wb"), mtime=0, compresslevel=6)
    return open(path, "wb")


def _write_rows(f: IO[bytes], rng: np.random.Generator, cols: _Columns, rows: int) -> None:
    for start in range(0, rows, _CHUNK_ROWS):
        f.write(_format_chunk(rng, cols, min(_CHUNK_ROWS, rows - start)).encode("ascii"))


def day_file_name(day: int, gzip: bool = False) -> str:
    """Name of one day's file, as in the real dataset: ``day_<n>`` (``.gz`` when compressed)."""
    return f"day_{day}" + (".gz" if gzip else "")


def generate_criteo_tsv(path: str, rows: int, seed: int = 0, days: int | None = None, gzip: bool = False) -> None:
    """Write ``rows`` synthetic Criteo lines to ``path``.

    With ``days=N``, ``path`` is a directory that receives ``day_0`` .. ``day_{N-1}`` (``.gz`` with
    ``gzip``), the rows split as evenly as possible (the first ``rows % N`` days get one more);
    all days share vocabularies and label model, like consecutive days of real traffic. Without
    ``days`` the single file is written to ``path`` exactly (gzip-compressed if asked).
    """
    if rows < 0:
        raise ValueError(f"rows must be >= 0, got {rows}")
    if days is not None and days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    rng = np.random.default_rng(seed)
    cols = _make_columns(rng)
    cols.bias = _calibrate_bias(rng, cols)
    if days is None:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        with _open(path, gzip) as f:
            _write_rows(f, rng, cols, rows)
        return
    os.makedirs(path, exist_ok=True)
    for day in range(days):
        day_rows = rows // days + (1 if day < rows % days else 0)
        with _open(os.path.join(path, day_file_name(day, gzip)), gzip) as f:
            _write_rows(f, rng, cols, day_rows)


def is_criteo_tsv(path: str) -> bool:
    """Whether file ``path`` (plain or gzip) holds Criteo lines, as this generator writes them: the
    first MiB of text, whole lines of 40 tab-separated fields (an empty file too)."""
    try:
        with open(path, "rb") as raw:
            packed = raw.read(2) == b"\x1f\x8b"
        with (gzip_module.open(path, "rb") if packed else open(path, "rb")) as f:
            head = f.read(1 << 20)
            more = f.read(1) != b""
    except (OSError, EOFError):
        return False
    if more:
        head = head[:head.rfind(b"\n") + 1]
    lines = head.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return all(line.count(b"\t") == NUM_NUMERICAL + NUM_CATEGORICAL for line in lines)


def is_criteo_days(path: str) -> bool:
    """Whether directory ``path`` holds day files of this generator (``day_<n>``, ``.gz``) and nothing else."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return all(re.fullmatch(r"day_[0-9]+(\.gz)?", name) and os.path.isfile(os.path.join(path, name))
               and not os.path.islink(os.path.join(path, name)) and is_criteo_tsv(os.path.join(path, name))
               for name in names)


CRITEO_TSV = OutputKind("Criteo TSV file", directory=False, recognise=is_criteo_tsv)
CRITEO_DAYS = OutputKind("Criteo day folder", directory=True, recognise=is_criteo_days)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write synthetic click logs in the raw Criteo TSV format.")
    parser.add_argument("--output", required=True, help="output file, or directory with --days (new, or with "
                        "--overwrite an earlier run's; never a file or folder of anything else)")
    parser.add_argument("--rows", type=int, required=True, help="total number of lines")
    parser.add_argument("--days", type=int, default=None, help="write day_0..day_{N-1} into the --output directory")
    parser.add_argument("--gzip", action="store_true", help="gzip-compress the output (day files get .gz)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace what an earlier run wrote in --output")
    args = parser.parse_args(argv)
    try:  # before any work (dlrm.engine.outputs), and a file system that refuses it (read-only, no permission)
        claim_output(args.output, CRITEO_DAYS if args.days is not None else CRITEO_TSV, "output",
                     replace=args.overwrite)
        check_can_create(args.output, "the generated logs", inside=args.days is not None and os.path.isdir(args.output))
    except (OutputError, StorageError) as e:
        print("error: " + re.sub(r"`(\w+)`", r"--\1", str(e)), file=sys.stderr)
        sys.exit(2)
    generate_criteo_tsv(args.output, args.rows, seed=args.seed, days=args.days, gzip=args.gzip)
    if args.days is not None:  # an earlier run's other days (more of them, or the other compression) go
        written = {day_file_name(day, args.gzip) for day in range(args.days)}
        for name in set(os.listdir(args.output)) - written:
            os.remove(os.path.join(args.output, name))


if __name__ == "__main__":
    main()


def tsv_line(label: str, nums: dict[int, str] | None = None, cats: dict[int, str] | None = None) -> str:
    """One Criteo line (no newline) with the given fields, the rest empty: for tests and examples
    that need exact lines. ``nums`` keys 0..12 (I1..I13), ``cats`` keys 0..25 (C1..C26)."""
    fields = [label] + [""] * (NUM_NUMERICAL + NUM_CATEGORICAL)
    for k, v in (nums or {}).items():
        fields[1 + k] = v
    for k, v in (cats or {}).items():
        fields[1 + NUM_NUMERICAL + k] = v
    return "\t".join(fields)

