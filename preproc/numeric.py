"""float16(ln(x + 3)) of integer counts, identical on every machine and in every engine.

The reference computes ``math.log(x + 3)`` in float64 and rounds it to float16 in one of two
ways (``ROUNDINGS``):

- ``nvidia`` (the default): to float32 first, then to float16, as NVIDIA's pipeline does (its
  Spark job writes the float64 log, ``parquet_to_binary.py`` casts it to float32 and
  ``split_dataset.py`` to float16). The two roundings give the same float16 for all but a few
  counts (605 of the integers from -2 to 10**7): where the float64 log lies just below the
  midpoint of two float16 values and float32 rounds it onto the midpoint, which float16 then
  rounds to even (10361: ln 10364 = 9.246093541..., 9.2421875 directly, 9.25 through float32).
- ``direct``: once, float64 to the nearest float16 (what this project wrote before the option
  existed; at most one float16 step closer to the exact log for those few counts).

Calling a log per value in each engine would tie the output to the log implementation that
happens to run (numpy's SIMD loops, glibc, the JVM's StrictMath can differ in the last bit,
which moves a float16 rounding now and then). Instead the reference's own function is
evaluated once per float16 boundary, in the driver, to build a table (one per rounding);
engines then only compare integers:

- ``n = x + 3`` below 2**16: a direct table of the 65,536 results;
- larger ``n``: ``values[i]`` where ``thresholds[i] <= n < thresholds[i + 1]``, the thresholds
  being the smallest integers whose result reaches each float16 value (found by bisection
  around ``exp`` of the float16 midpoints). Above 2**16 consecutive integers differ in log by
  less than the float16 spacing, so every value in the range has a threshold.

Counts written with more than ``MAX_TABLE_DIGITS`` characters (beyond int64 once 3 is added)
are rare; they go through ``log_count`` on Python integers, like the reference.

The two roundings are ``dlrm.data.numerical_rounding``'s, shared with the CSV transcoder. This
module is imported by Spark's Python workers, so it depends on numpy, math and that module only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dlrm.data.numerical_rounding import DEFAULT_ROUNDING, ROUNDINGS, check_rounding, to_float16  # noqa: F401

MAX_TABLE_DIGITS = 18  # a count text of at most 18 characters is within +-(10**18 - 1): int64-safe with +3
_DIRECT = 1 << 16
_MAX_N = 10**18 + 2  # the largest x + 3 reachable with MAX_TABLE_DIGITS characters


def log_count(x: int | None) -> float:
    """The reference rule on a Python integer: ln(x + 3), or 0 for a missing count or x <= -3."""
    if x is None or x + 3 <= 0:
        return 0.0
    return math.log(x + 3)


def _f16(n: int, rounding: str) -> np.float16:
    return to_float16(log_count(n - 3), rounding)[()]


@dataclass(frozen=True)
class LogTable:
    """Everything needed to map int64 counts to float16; small enough to ship to Spark workers."""

    direct: np.ndarray  # float16[2**16]: result for n = x + 3 in [0, 2**16) (n = 0 -> 0)
    thresholds: np.ndarray  # int64, ascending: first n >= 2**16 of each result
    values: np.ndarray  # float16: the result from thresholds[i] on
    rounding: str = DEFAULT_ROUNDING  # how the float64 log became float16 (ROUNDINGS)


def build_log_table(rounding: str = DEFAULT_ROUNDING) -> LogTable:
    """Tabulate the reference rule (about 0.1 s); the result is a pure function of libm's log."""
    check_rounding(rounding)
    direct = to_float16([0.0] + [math.log(n) for n in range(1, _DIRECT)], rounding)
    thresholds = [_DIRECT]
    values = [_f16(_DIRECT, rounding)]
    # Through float32 a boundary can move by a float32 step of the log (a relative 2**-24 * ln n
    # in n); the direct rounding's boundaries lie within rounding error of exp(midpoint).
    relative = 1e-5 if rounding == "nvidia" else 1e-12
    while True:
        v = values[-1]
        nxt = np.nextafter(v, np.float16(np.inf))
        mid = (float(v) + float(nxt)) / 2  # exact in float64
        guess = math.exp(mid)
        if guess > _MAX_N + 1:
            break
        # Bracket the first n with _f16(n) >= nxt: lo below it, hi at or above it.
        slack = int(guess * relative) + 2
        lo, hi = max(thresholds[-1], int(guess) - slack), int(guess) + slack
        while _f16(lo, rounding) >= nxt:
            lo = max(thresholds[-1], lo - 2 * slack)
        while _f16(hi, rounding) < nxt:
            hi += 2 * slack
        while hi - lo > 1:
            m = (lo + hi) // 2
            if _f16(m, rounding) >= nxt:
                hi = m
            else:
                lo = m
        if hi > _MAX_N:
            break
        thresholds.append(hi)
        values.append(_f16(hi, rounding))
    return LogTable(direct, np.array(thresholds, dtype=np.int64), np.array(values, dtype=np.float16), rounding)


def log_counts_float16(counts: np.ndarray, present: np.ndarray, table: LogTable) -> np.ndarray:
    """float16(ln(x + 3)) elementwise for int64 counts with ``|x| < 10**18``; 0 where not present or x <= -3."""
    counts = np.asarray(counts, dtype=np.int64)
    n = counts + 3
    out = np.zeros(counts.shape, dtype=np.float16)
    small = present & (n > 0) & (n < _DIRECT)
    out[small] = table.direct[n[small]]
    big = present & (n >= _DIRECT)
    if big.any():
        out[big] = table.values[np.searchsorted(table.thresholds, n[big], side="right") - 1]
    return out


def long_count_float16(text: str, rounding: str = DEFAULT_ROUNDING) -> np.float16:
    """The value of a count written with more than MAX_TABLE_DIGITS characters (already validated)."""
    return to_float16(log_count(int(text)), rounding)[()]
