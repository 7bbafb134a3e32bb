"""Vectorised parsing of a chunk of Criteo lines (numpy), with the reference's exact rules.

A chunk is bytes holding whole lines. A pre-scan finds every newline and tab and sets aside
each line that has other than 39 tabs, a byte outside ``[0-9a-fA-F-]`` between them, or a ``-``
anywhere but at the start of a count field (I1..I13). The remaining lines have a fixed shape:
the tab positions give every field's start and length, and

- the label is valid when it is one byte, ``0`` or ``1``;
- a count is valid when it is empty, or an optional ``-`` and then only decimal digits; up to
  18 digits it is decoded 8 digits at a time from little-endian 64-bit words (SWAR), longer
  ones are kept as text and valued by the reference rule on a Python integer;
- a categorical value is valid when it is empty or 8 bytes (the alphabet makes them hex
  digits); it is decoded to its 32-bit value, so case does not matter.

Rows failing a check join the set-aside lines, which are returned raw: the caller gets each
one's reason and message from ``report.classify`` (the reference parser). (This module stays
free of the reference's imports so worker processes start light.) A line is thus either parsed whole into its 40 columns or
reported; it can never shift into other columns.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import numpy as np

from preproc.numeric import MAX_TABLE_DIGITS, LogTable, log_counts_float16, long_count_float16

NUM_NUMERICAL = 13
NUM_CATEGORICAL = 26
NUM_FIELDS = 1 + NUM_NUMERICAL + NUM_CATEGORICAL
_TABS = NUM_FIELDS - 1
_ALLOWED = b"0123456789abcdefABCDEF-\t\n"
_OUTSIDE = np.ones(256, dtype=bool)
_OUTSIDE[np.frombuffer(_ALLOWED, dtype=np.uint8)] = False
_DASH = ord("-")
_COUNT = re.compile(r"-?[0-9]+")
_PAD = 16
_BLOCK_LINES = 4096  # lines decoded at once: keeps numpy's temporaries in cache

_U = np.uint64
_LOW_NIBBLES = _U(0x0F0F0F0F0F0F0F0F)
_BIT6 = _U(0x4040404040404040)
_ONES = _U(0x0101010101010101)


@dataclass
class Rows:
    """The well-formed lines of a chunk, column-wise."""

    line: np.ndarray  # int64 [n]: 1-based line numbers in the file
    label: np.ndarray  # uint8 [n]
    counts: np.ndarray  # int64 [n, 13]: 0 where missing or longer than MAX_TABLE_DIGITS characters
    count_present: np.ndarray  # bool [n, 13]
    long_counts: list[tuple[int, int, str]]  # (row, column, text) of counts too long for the table
    hashes: np.ndarray  # uint32 [n, 26]: 0 where missing
    hash_present: np.ndarray  # bool [n, 26]

    def __len__(self) -> int:
        return len(self.line)

    def numerical(self, table: LogTable) -> np.ndarray:
        """float16 [n, 13]: ln(x + 3), 0 for missing and x <= -3."""
        out = log_counts_float16(self.counts, self.count_present, table)
        for row, col, text in self.long_counts:
            out[row, col] = long_count_float16(text, table.rounding)
        return out

    def select(self, mask: np.ndarray) -> "Rows":
        """The rows where ``mask`` is true."""
        index = np.flatnonzero(mask)
        remap = {int(r): i for i, r in enumerate(index)} if self.long_counts else {}
        return Rows(
            self.line[index], self.label[index], self.counts[index], self.count_present[index],
            [(remap[r], c, t) for r, c, t in self.long_counts if r in remap],
            self.hashes[index], self.hash_present[index],
        )


@dataclass
class Chunk:
    rows: Rows
    bad: list[tuple[int, bytes]]  # (line, raw bytes without the newline) of the set-aside lines, by line
    lines: int  # lines in the chunk, well formed or not


def empty_rows() -> Rows:
    return Rows(
        np.zeros(0, np.int64), np.zeros(0, np.uint8), np.zeros((0, NUM_NUMERICAL), np.int64),
        np.zeros((0, NUM_NUMERICAL), bool), [], np.zeros((0, NUM_CATEGORICAL), np.uint32),
        np.zeros((0, NUM_CATEGORICAL), bool),
    )


# ---------------------------------------------------------------------------- word decoding


def _words(words: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The 8 bytes at each byte position as a little-endian uint64.

    ``words`` is the chunk viewed as aligned uint64 (with a spare word at the end); an unaligned
    word is put together from the two aligned words it straddles.
    """
    q = positions >> 3
    shift = ((positions & 7) << 3).astype(np.uint64)
    lo = words[q]
    hi = words[q + 1]
    with np.errstate(all="ignore"):
        joined = (lo >> shift) | (hi << (_U(64) - shift))
    return np.where(shift == 0, lo, joined)


def _hex8(words: np.ndarray) -> np.ndarray:
    """8 ASCII hex digits (first digit in the lowest byte) -> uint32."""
    nibbles = (words & _LOW_NIBBLES) + ((words >> _U(6)) & _ONES) * _U(9)  # '0'-'9' -> 0-9, a-f/A-F -> 10-15
    pairs = ((nibbles & _U(0x00FF00FF00FF00FF)) << _U(4)) | ((nibbles >> _U(8)) & _U(0x00FF00FF00FF00FF))
    quads = ((pairs & _U(0x0000FFFF0000FFFF)) << _U(8)) | ((pairs >> _U(16)) & _U(0x0000FFFF0000FFFF))
    return (((quads & _U(0xFFFFFFFF)) << _U(16)) | (quads >> _U(32))).astype(np.uint32)


def hex8_at(raw: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """uint32 values of the 8 hex digits at each byte position of ``raw`` (uint8)."""
    pad = 16 + (-len(raw)) % 8
    padded = np.concatenate([raw, np.zeros(pad, dtype=np.uint8)])
    return _hex8(_words(padded.view("<u8"), np.asarray(positions, dtype=np.int64)))


def _dec8(words: np.ndarray, digits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value, ok) of the first ``digits`` (1..8) ASCII characters of each word, as a decimal.

    The word is shifted so the digits occupy its top bytes (the bytes after them fall off) with
    zero bytes before them; ok is false if one of them is not a decimal digit (only hex letters
    can occur here, and they are the bytes with bit 6 set).
    """
    x = words << ((_U(8) - digits.astype(np.uint64)) * _U(8))
    ok = (x & _BIT6) == 0
    x = x & _LOW_NIBBLES
    x = x * _U(10) + (x >> _U(8))
    mask = _U(0x000000FF000000FF)
    x = (((x & mask) * _U(100 + (1000000 << 32))) + (((x >> _U(16)) & mask) * _U(1 + (10000 << 32)))) >> _U(32)
    return x.astype(np.int64), ok


# ---------------------------------------------------------------------------- pre-scan


def _scan(buf: np.ndarray, data: bytes, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tab positions, index of each line's first tab, suspect line mask); see the module doc."""
    n = len(ends)
    tabs = np.flatnonzero(buf == 9)
    if len(tabs) == _TABS * n and (tabs[_TABS - 1 :: _TABS] < ends).all() and (tabs[_TABS::_TABS] > ends[:-1]).all():
        suspect = np.zeros(n, dtype=bool)  # block i of 39 tabs lies inside line i: every line has 39
        first_tab = np.arange(n, dtype=np.int64) * _TABS
    else:
        tabs_at_end = np.searchsorted(tabs, ends)
        suspect = np.diff(tabs_at_end, prepend=0) != _TABS
        first_tab = np.concatenate([[0], tabs_at_end[:-1]]).astype(np.int64)
    if data.translate(None, _ALLOWED):
        suspect[np.searchsorted(ends, np.flatnonzero(_OUTSIDE[buf]))] = True
    if b"-" in data:
        dash = np.flatnonzero(buf == _DASH)
        line = np.searchsorted(ends, dash)
        field = np.searchsorted(tabs, dash) - first_tab[line]
        at_start = buf[np.maximum(dash - 1, 0)] == 9
        suspect[line[~at_start | (field < 1) | (field > NUM_NUMERICAL)]] = True
    return tabs, first_tab, suspect


# ---------------------------------------------------------------------------- fields


def _counts(raw: np.ndarray, words: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Decode count fields [n, 13]: (values, present, long mask, ok)."""
    length = end - start
    present = length > 0
    negative = present & (raw[start] == _DASH)
    first = start + negative
    digits = length - negative
    ok = ~present | (digits > 0)
    short = present & (digits >= 1) & (digits <= 8)
    medium = present & (digits > 8) & (digits <= MAX_TABLE_DIGITS)
    long = present & (digits > MAX_TABLE_DIGITS)
    values = np.zeros(start.shape, dtype=np.int64)
    if short.any():
        v, good = _dec8(_words(words, first[short]), digits[short])
        values[short] = v
        ok[short] &= good
    if medium.any():  # 9..18 digits: a leading group of 1..8 digits, then one or two groups of 8
        d = digits[medium]
        f = first[medium]
        groups = (d - 1) // 8
        lead = d - 8 * groups
        total, good = _dec8(_words(words, f), lead)
        for g in (1, 2):
            has = groups >= g
            v, g_ok = _dec8(_words(words, (f + lead + 8 * (g - 1))[has]), np.full(int(has.sum()), 8))
            total[has] = total[has] * 100_000_000 + v
            good[has] &= g_ok
        values[medium] = total
        ok[medium] &= good
    np.negative(values, out=values, where=negative)
    return values, present, long, ok


def _decode_block(raw: np.ndarray, words: np.ndarray, t: np.ndarray, line_start: np.ndarray, line_end: np.ndarray):
    """Decode lines that passed the pre-scan, given their tab positions ``t`` [n, 39]."""
    first_byte = raw[line_start]
    ok = (t[:, 0] - line_start == 1) & ((first_byte == ord("0")) | (first_byte == ord("1")))
    label = (first_byte == ord("1")).astype(np.uint8)

    c_start = t[:, :NUM_NUMERICAL] + 1  # count k (field k + 1) lies between tabs k and k + 1
    c_end = t[:, 1 : NUM_NUMERICAL + 1]
    counts, count_present, long, count_ok = _counts(raw, words, c_start, c_end)
    ok &= count_ok.all(axis=1)

    h_start = t[:, NUM_NUMERICAL:] + 1  # C1..C26 start after tabs 13..38
    h_end = np.empty_like(h_start)
    h_end[:, :-1] = t[:, NUM_NUMERICAL + 1 :]
    h_end[:, -1] = line_end
    length = h_end - h_start
    hash_present = length == 8
    ok &= (hash_present | (length == 0)).all(axis=1)
    hashes = _hex8(_words(words, h_start))
    hashes[~hash_present] = 0
    return ok, label, counts, count_present, long, c_start, c_end, hashes, hash_present


def _fits_int(count: str) -> bool:
    """Whether Python turns the decimal ``count`` into an int: at most sys.get_int_max_str_digits()
    digits (4300 by default; 0 is no limit). A longer count is set aside, as the reference cannot
    value it either: its parse of the line reports it."""
    limit = sys.get_int_max_str_digits()
    return limit == 0 or len(count) - count.startswith("-") <= limit


def parse_chunk(data: bytes, first_line: int) -> Chunk:
    """Parse ``data`` (whole lines, each ending in ``\\n``) whose first line is ``first_line``."""
    pad = _PAD + (-len(data)) % 8
    raw = np.frombuffer(data + bytes(pad), dtype=np.uint8)
    words = raw.view("<u8")
    buf = raw[: len(data)]
    ends = np.flatnonzero(buf == 10)
    n_lines = len(ends)
    if n_lines == 0:
        return Chunk(empty_rows(), [], 0)
    starts = np.concatenate([[0], ends[:-1] + 1])
    line_numbers = first_line + np.arange(n_lines, dtype=np.int64)
    tabs, first_tab, suspect = _scan(buf, data, ends)
    kept = np.flatnonzero(~suspect)
    bad = np.flatnonzero(suspect).tolist()
    n = len(kept)
    label = np.empty(n, np.uint8)
    counts = np.empty((n, NUM_NUMERICAL), np.int64)
    count_present = np.empty((n, NUM_NUMERICAL), bool)
    hashes = np.empty((n, NUM_CATEGORICAL), np.uint32)
    hash_present = np.empty((n, NUM_CATEGORICAL), bool)
    ok = np.empty(n, bool)
    long_counts: list[tuple[int, int, str]] = []
    offsets = np.arange(_TABS)
    for a in range(0, n, _BLOCK_LINES):
        b = min(n, a + _BLOCK_LINES)
        lines = kept[a:b]
        t = tabs[first_tab[lines][:, None] + offsets]
        ok[a:b], label[a:b], counts[a:b], count_present[a:b], long, c_start, c_end, hashes[a:b], hash_present[a:b] = (
            _decode_block(raw, words, t, starts[lines], ends[lines])
        )
        for r, k in zip(*np.nonzero(long)):  # rare: counts too long for int64 are checked here
            text = data[c_start[r, k] : c_end[r, k]].decode("ascii")
            if _COUNT.fullmatch(text) and _fits_int(text):
                long_counts.append((a + int(r), int(k), text))
            else:
                ok[a + r] = False
    rows = Rows(line_numbers[kept], label, counts, count_present, long_counts, hashes, hash_present)
    if not ok.all():
        bad += kept[~ok].tolist()
        rows = rows.select(ok)
    raw_bad = [(int(line_numbers[i]), data[starts[i] : ends[i]]) for i in sorted(bad)]
    return Chunk(rows, raw_bad, n_lines)
