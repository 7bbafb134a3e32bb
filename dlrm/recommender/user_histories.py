"""User histories for the sparse autoencoder recommender: MovieLens ratings converted to
DSSTNE text, and realistic synthetic histories for tests and benchmarks when no real data
may be used.

The synthetic generator models what makes recommendation learnable and hard, calibrated to
MovieLens-20M: item popularity follows its curve (a few blockbusters in half the histories, a
long tail of movies rated a handful of times), history lengths are log-normal above a minimum
(MovieLens keeps users with >= 20 ratings; a few users rate thousands), and users have tastes:
each draws most items from a few latent clusters, weighted by popularity, so held-out items are
predictable from the rest of a history, as they are in real data.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator, TextIO

import numpy as np

from dlrm.engine.atomic import write_atomically
from dlrm.engine.errors import DatasetError, finite_number
from dlrm.engine.text_lines import MAX_LINE_BYTES, binary_content, bounded_lines
from dlrm.recommender.csr_dataset import CsrRows, write_csr
from dlrm.recommender.dsstne_text import NameIndex, check_utf8, write_text

MOVIELENS_HEADER = ("userId", "movieId", "rating", "timestamp")
_INT64_MIN, _INT64_MAX = int(np.iinfo(np.int64).min), int(np.iinfo(np.int64).max)
_FLOAT32_MAX = float(np.finfo(np.float32).max)  # a rating rounds to inf past it (plus half a step)

# ---------------------------------------------------------------------------- MovieLens


@dataclass
class _Chunk:
    user: np.ndarray  # int64
    item: np.ndarray  # int64
    rating: np.ndarray  # float32
    time: np.ndarray  # int64


def _check_header(path: str) -> None:
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        first = f.readline(1 << 16).rstrip("\r\n")
    if "\0" in first:
        raise binary_content(path, 1)
    fields = tuple(x.strip() for x in first.split(","))
    if fields != MOVIELENS_HEADER:
        raise DatasetError(f"{path}:1: header is {first[:80]!r}, expected {','.join(MOVIELENS_HEADER)!r} "
                           f"(MovieLens ratings.csv)")


def _parse_line(line: str, path: str, number: int) -> tuple[int, int, float, int]:
    fields = line.split(",")
    if len(fields) != 4:
        raise DatasetError(f"{path}:{number}: malformed line {line[:80]!r}: {len(fields)} fields, expected 4 "
                           f"({','.join(MOVIELENS_HEADER)})")
    try:
        user, item = int(fields[0]), int(fields[1])
    except ValueError:
        raise DatasetError(f"{path}:{number}: malformed line {line[:80]!r}: userId and movieId must be "
                           f"integers") from None
    rating = finite_number(fields[2])
    if rating is None or not _FLOAT32_MAX >= rating >= -_FLOAT32_MAX:
        raise DatasetError(f"{path}:{number}: bad rating {fields[2].strip()[:40]!r}: not a finite number "
                           f"(of float32, as ratings are kept)")
    try:
        time = int(fields[3])
    except ValueError:
        raise DatasetError(f"{path}:{number}: malformed line {line[:80]!r}: timestamp must be an integer") from None
    for name, value in (("userId", user), ("movieId", item), ("timestamp", time)):
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise DatasetError(f"{path}:{number}: {name} {value} is outside the 64-bit integers it is kept in")
    return user, item, rating, time


def _python_chunks(path: str, chunk_rows: int) -> Iterator[_Chunk]:
    """The stdlib reader: slower, but needs nothing and names the line of any problem."""
    rows: list[tuple[int, int, float, int]] = []
    with open(path, encoding="utf-8-sig", errors="surrogateescape", newline="") as f:  # bad bytes: by line, below
        f.readline(MAX_LINE_BYTES)
        for number, line in enumerate(bounded_lines(f, path, MAX_LINE_BYTES, first=2), 2):
            line = line.rstrip("\r\n")
            try:
                check_utf8(line)
            except DatasetError as e:
                raise DatasetError(f"{path}:{number}: {e}") from None
            if not line.strip():
                continue
            rows.append(_parse_line(line, path, number))
            if len(rows) >= chunk_rows:
                yield _to_chunk(rows)
                rows = []
    if rows:
        yield _to_chunk(rows)


def _to_chunk(rows: list[tuple[int, int, float, int]]) -> _Chunk:
    user, item, rating, time = zip(*rows)
    return _Chunk(np.array(user, np.int64), np.array(item, np.int64), np.array(rating, np.float32),
                  np.array(time, np.int64))


class _ArrowRefused(Exception):
    """pyarrow's reader stopped on the file; the stdlib reader reads it again and names the line
    of any problem (or reads it whole where pyarrow's rules are stricter than its own)."""


def _arrow_chunks(path: str, chunk_bytes: int) -> Iterator[_Chunk]:
    """pyarrow's streaming CSV reader (tens of millions of lines a minute). Any problem raises
    _ArrowRefused, and the conversion starts again with the stdlib reader."""
    import pyarrow as pa  # optional: the stdlib reader serves without it
    import pyarrow.csv as pacsv

    types = {"userId": pa.int64(), "movieId": pa.int64(), "rating": pa.float32(), "timestamp": pa.int64()}
    try:
        reader = pacsv.open_csv(  # the header was checked (_check_header): the columns by position
            path, read_options=pacsv.ReadOptions(block_size=chunk_bytes, encoding="utf8", skip_rows=1,
                                                 column_names=list(MOVIELENS_HEADER)),
            convert_options=pacsv.ConvertOptions(column_types=types),
        )
        for batch in reader:
            columns = [batch.column(i) for i in range(4)]
            if any(c.null_count for c in columns):
                raise ValueError("empty field")
            chunk = _Chunk(*(np.asarray(c.to_numpy(zero_copy_only=False)) for c in columns))
            if not np.isfinite(chunk.rating).all():
                raise ValueError("non-finite rating")
            yield chunk
    except (pa.ArrowException, ValueError) as e:
        raise _ArrowRefused() from e


def movielens_to_text(ratings_csv: str | os.PathLike, output: str | os.PathLike, *, with_ratings: bool = False,
                      min_rating: float | None = None, engine: str = "auto", chunk_rows: int = 1 << 20) -> tuple[int, int]:
    """MovieLens ``ratings.csv`` -> DSSTNE text: one line per user, ``userId\\tmovieId[,rating]:...``,
    items ordered by timestamp (ties in file order), rating as the value if ``with_ratings``.

    ``min_rating`` keeps only ratings >= it (the usual "liked" signal); a user left with none
    is dropped. The CSV streams in chunks and users are written as soon as complete, so each
    user's ratings must be contiguous, as in MovieLens (grouped by userId). ``engine``:
    "pyarrow", "python" (stdlib, slower) or "auto" (pyarrow when installed). Written atomically.
    Returns (users written, ratings written).
    """
    path = os.fspath(ratings_csv)
    _check_header(path)
    if engine == "auto":
        try:
            import pyarrow.csv  # noqa: F401
            engine = "pyarrow"
        except ImportError:
            engine = "python"
    if engine == "pyarrow":
        chunks = _arrow_chunks(path, max(1 << 16, chunk_rows * 32))  # ~32 bytes per MovieLens line
    elif engine == "python":
        chunks = _python_chunks(path, chunk_rows)
    else:
        raise ValueError(f"engine must be 'auto', 'pyarrow' or 'python', got {engine!r}")
    counts = [0, 0]

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            try:
                _group_users(chunks, f, path, with_ratings, min_rating, counts)
            except _ArrowRefused:  # again from the start, with the reader that names the line of a problem
                f.seek(0)
                f.truncate()
                counts[:] = [0, 0]
                _group_users(_python_chunks(path, chunk_rows), f, path, with_ratings, min_rating, counts)

    write_atomically(output, write)
    return counts[0], counts[1]


def _group_users(chunks: Iterator[_Chunk], out: TextIO, path: str, with_ratings: bool, min_rating: float | None,
                 counts: list[int]) -> None:
    done: set[int] = set()
    carry: _Chunk | None = None
    for chunk in chunks:
        if carry is not None:
            chunk = _Chunk(*(np.concatenate([a, b]) for a, b in zip(
                (carry.user, carry.item, carry.rating, carry.time), (chunk.user, chunk.item, chunk.rating, chunk.time))))
        if not chunk.user.size:
            continue
        last = chunk.user[-1]
        tail = chunk.user.shape[0] - int(np.argmax(chunk.user[::-1] != last)) if (chunk.user != last).any() else 0
        complete = _Chunk(chunk.user[:tail], chunk.item[:tail], chunk.rating[:tail], chunk.time[:tail])
        carry = _Chunk(chunk.user[tail:], chunk.item[tail:], chunk.rating[tail:], chunk.time[tail:])
        _write_users(complete, out, path, with_ratings, min_rating, done, counts)
    if carry is not None:
        _write_users(carry, out, path, with_ratings, min_rating, done, counts)


def _write_users(chunk: _Chunk, out: TextIO, path: str, with_ratings: bool, min_rating: float | None,
                 done: set[int], counts: list[int]) -> None:
    n = chunk.user.shape[0]
    if not n:
        return
    starts = np.flatnonzero(np.concatenate([[True], chunk.user[1:] != chunk.user[:-1]]))
    users = chunk.user[starts]
    again = [int(u) for u in users if int(u) in done]
    if again or np.unique(users).shape[0] != users.shape[0]:
        user = again[0] if again else int(users[np.argmax(np.unique(users, return_counts=True)[1] > 1)])
        raise DatasetError(f"{path}: the ratings of user {user} are not contiguous (they appear again after other "
                           f"users' ratings); the converter streams users one after another, so group the file "
                           f"by userId first (e.g. sort by userId, then timestamp)")
    done.update(int(u) for u in users)
    group = np.repeat(np.arange(starts.shape[0]), np.diff(np.append(starts, n)))
    keep = np.ones(n, bool) if min_rating is None else chunk.rating >= np.float32(min_rating)
    order = np.lexsort((chunk.time, group))  # stable: equal timestamps keep file order
    order = order[keep[order]]
    items = chunk.item[order].astype(str)
    if with_ratings:
        items = np.char.add(np.char.add(items, ","), chunk.rating[order].astype(str))
    items = items.tolist()
    ends = np.cumsum(np.bincount(group[order], minlength=starts.shape[0]))
    lines, lo = [], 0
    for u, hi in zip(users.tolist(), ends.tolist()):
        if hi > lo:
            lines.append(f"{u}\t{':'.join(items[lo:hi])}\n")
            counts[0] += 1
        lo = hi
    counts[1] += len(items)
    out.write("".join(lines))


# ---------------------------------------------------------------------------- synthetic


@dataclass
class HistoryConfig:
    """Shape of a synthetic set. The defaults reproduce MovieLens-20M with every rating as an
    interaction: its size, its history lengths and how concentrated its item popularity is
    (sources, tolerances and measured figures: docs/recommender.md, "Synthetic histories")."""

    n_users: int = 138_493
    n_items: int = 26_744  # the movies rated at least once (movies.csv lists 27,278)
    n_interactions: int = 20_000_263  # target total; the result is within a few percent
    min_length: int = 20
    max_length: int | None = None  # default: n_items // 3 (8,914 here; MovieLens's longest history is 9,254)
    length_sigma: float = 1.37  # log-normal sigma of (length - min_length): MovieLens-20M's median with its mean
    # The item of popularity rank r (0: the most popular) gets a share of the interactions
    # proportional to (q + offset) ** -exponent * exp(-q / cutoff), q = (r + 0.5) / max(n_items,
    # popularity_items): a power law over the blockbusters that falls faster in the long tail,
    # fitted to MovieLens-20M's item statistics. A smaller catalogue is its most popular part (as
    # if MovieLens were cut to its top movies); a larger one stretches the curve over its items.
    popularity_exponent: float = 0.896
    popularity_offset: float = 0.0026
    popularity_cutoff: float = 0.150
    popularity_items: int = 26_744
    n_clusters: int = 40  # latent tastes (genres)
    max_tastes: int = 3  # each user likes 1..max_tastes distinct clusters
    noise: float = 0.2  # share of a user's draws from global popularity instead of their tastes (not fitted
    # to data: the lower, the further personal methods get ahead of popularity)


@dataclass
class UserHistories:
    """Synthetic histories and the ground truth behind them (for tests and analysis)."""

    rows: CsrRows  # one row per user, items in "time" order, no values
    user_names: list[str]
    item_names: list[str]
    item_popularity: np.ndarray  # float64 [n_items]: the item's expected share of the interactions (sums to 1)
    item_cluster: np.ndarray  # int64 [n_items]
    user_tastes: np.ndarray  # int64 [n_users, min(max_tastes, n_clusters)], -1 where unused
    user_taste_weights: np.ndarray  # float64, same shape


def _popularity_curve(config: HistoryConfig) -> np.ndarray:
    """Each popularity rank's expected share of the interactions, most popular first."""
    q = (np.arange(config.n_items) + 0.5) / max(config.n_items, config.popularity_items)
    share = (q + config.popularity_offset) ** -config.popularity_exponent * np.exp(-q / config.popularity_cutoff)
    return share / share.sum()


def _lengths(config: HistoryConfig, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Log-normal excess over the minimum, rescaled so the total meets the target."""
    n, lo = config.n_users, config.min_length
    mean_excess = config.n_interactions / max(n, 1) - lo
    if mean_excess <= 0:
        return np.full(n, lo, np.int64)
    s = config.length_sigma
    excess = rng.lognormal(math.log(mean_excess) - s * s / 2, s, n)
    for _ in range(4):  # capping loses mass: rescale the rest, a few times
        capped = np.minimum(excess, cap - lo)
        excess = excess * (mean_excess * n / max(capped.sum(), 1e-9))
    return lo + np.floor(np.minimum(excess, cap - lo)).astype(np.int64)


def _tastes(n_users: int, n_clusters: int, max_tastes: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """1..max_tastes distinct clusters per user (-1 in the unused slots) and their weights (Dirichlet(1))."""
    n_tastes = min(max_tastes, n_clusters)
    used = rng.integers(1, n_tastes + 1, n_users)
    tastes = np.empty((n_users, n_tastes), np.int64)
    for j in range(n_tastes):  # each slot redrawn where it repeats an earlier one
        tastes[:, j] = rng.integers(0, n_clusters, n_users)
        clash = np.flatnonzero((tastes[:, :j] == tastes[:, j:j + 1]).any(axis=1))
        while clash.size:
            tastes[clash, j] = rng.integers(0, n_clusters, clash.size)
            clash = clash[(tastes[clash, :j] == tastes[clash, j:j + 1]).any(axis=1)]
    weights = rng.gamma(1.0, 1.0, (n_users, n_tastes)) * (np.arange(n_tastes) < used[:, None])
    weights /= weights.sum(axis=1, keepdims=True)
    return np.where(weights > 0, tastes, -1), weights


# ----------------------------------------------------------- calibration of the draw weights

_GRID = 256  # points of the log grids the calibration interpolates on


def _lookup(log_table: np.ndarray, rows: np.ndarray, log_x: np.ndarray, log_x0: float, step: float) -> np.ndarray:
    """log_table[rows] at log_x on the uniform grid log_x0 + step * j: linear between points, slope 1
    below the grid (where the tabled counts are proportional to x), flat above it."""
    pos = (log_x - log_x0) / step
    below = np.minimum(pos, 0.0) * step
    pos = np.clip(pos, 0.0, log_table.shape[1] - 1.000001)
    i = pos.astype(np.int64)
    f = pos - i
    return log_table[rows, i] * (1.0 - f) + log_table[rows, i + 1] * f + below


def _occupancy(weights: np.ndarray, item_cluster: np.ndarray, n_clusters: int, x: np.ndarray) -> np.ndarray:
    """log of the distinct items of each cluster (last row: of all) expected among x draws by
    ``weights`` alone, the sum over its items of 1 - exp(-x w), for each x: [n_clusters + 1, len(x)].
    Items are pooled in bins 1 % wide in weight (no matrix product: BLAS threads crawl on a busy CPU)."""
    log_w = np.log(weights)
    bins = np.round((log_w - log_w.min()) / 0.01).astype(np.int64)
    n_bins = int(bins.max()) + 1
    counts = np.bincount(item_cluster * n_bins + bins, minlength=n_clusters * n_bins).reshape(n_clusters, n_bins)
    present = np.flatnonzero(counts.any(axis=0))
    seen = -np.expm1(-np.outer(np.exp(log_w.min() + 0.01 * present), x))
    table = np.einsum("kb,bg->kg", counts[:, present].astype(np.float64), seen)
    return np.log(np.maximum(np.vstack([table, table.sum(axis=0)]), 1e-300))


def _draws_needed(lengths: np.ndarray, tastes: np.ndarray, boost: np.ndarray, noise: float, log_f: np.ndarray,
                  log_x0: float, step: float) -> np.ndarray:
    """The draws D after which a user expects `length` distinct items: the root of
    sum_i 1 - exp(-D w_i b_i) = length, b_i the user's boost of item i's cluster (noise outside
    their tastes), by bisection on log D."""
    n_clusters = log_f.shape[0] - 1
    used = tastes >= 0
    rows = np.where(used, tastes, n_clusters)
    everyone = np.full(lengths.shape, n_clusters)
    lo = np.log(np.maximum(lengths, 1.0))  # a distinct item takes a draw at least
    hi = np.full(lengths.shape, log_x0 + step * log_f.shape[1] - math.log(noise))  # all items saturated
    for _ in range(40):
        mid = (lo + hi) / 2
        base = mid + math.log(noise)
        found = np.exp(_lookup(log_f, everyone, base, log_x0, step))
        found += ((np.exp(_lookup(log_f, rows, mid[:, None] + np.log(boost), log_x0, step))
                   - np.exp(_lookup(log_f, rows, np.repeat(base[:, None], rows.shape[1], 1), log_x0, step)))
                  * used).sum(axis=1)
        more = found < lengths
        lo, hi = np.where(more, mid, lo), np.where(more, hi, mid)
    return np.exp(hi)


def _feasible(target: np.ndarray, n_users: int) -> np.ndarray:
    """Targets capped at 90 % of the users (an item is in a history once), the rest scaled up to keep the total."""
    total, cap = target.sum(), 0.9 * n_users
    for _ in range(8):
        over = target >= cap
        if not over.any() or over.all():
            break
        target = np.where(over, cap, target * (total - cap * over.sum()) / target[~over].sum())
    return target


def _calibrate(target: np.ndarray, item_cluster: np.ndarray, n_clusters: int, lengths: np.ndarray,
               tastes: np.ndarray, taste_w: np.ndarray, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """Draw weights that give each item its `target` count in expectation, and the draws each user needs.

    A history draws with replacement until it has its length in distinct items, so a popular item
    drawn twice counts once: drawing by the target shares would flatten the head. With D draws
    item i is in a history with probability 1 - exp(-D p_i) (the occupancy approximation, close
    for thousands of items); the weights are the fixed point of "solve each user's D, then invert
    each item's expected count in its weight", on a length-stratified sample of the users.
    """
    n_users, noise = lengths.shape[0], max(noise, 1e-12)
    n_sample = min(n_users, 4096)
    sample = np.argsort(lengths, kind="stable")[((np.arange(n_sample) + 0.5) * n_users / n_sample).astype(np.int64)]
    s_len, s_tastes, s_w = lengths[sample].astype(np.float64), tastes[sample], taste_w[sample]
    used = s_tastes >= 0
    pairs = np.flatnonzero(used.ravel())  # (user, taste) slots in use, by cluster
    pairs = pairs[np.argsort(s_tastes.ravel()[pairs], kind="stable")]
    pair_user = pairs // s_tastes.shape[1]
    pair_bounds = np.searchsorted(s_tastes.ravel()[pairs], np.arange(n_clusters + 1))
    by_cluster = np.argsort(item_cluster, kind="stable")
    bounds = np.searchsorted(item_cluster[by_cluster], np.arange(n_clusters + 1))
    target = _feasible(target, n_users)
    weights = target / target.sum()
    for _ in range(50):
        mass = np.bincount(item_cluster, weights, n_clusters)
        boost = np.where(used, noise + (1 - noise) * s_w / mass[np.maximum(s_tastes, 0)], 1.0)
        log_x = np.linspace(math.log(1e-3 / weights.max()), math.log(30 / weights.min()), _GRID)
        step = log_x[1] - log_x[0]
        draws = _draws_needed(s_len, s_tastes, boost, noise, _occupancy(weights, item_cluster, n_clusters,
                                                                        np.exp(log_x)), log_x[0], step)
        # Expected count of an item of weight w, per cluster, on a grid of w.
        w = np.exp(np.linspace(math.log(weights.min() / 30), math.log(min(weights.max() * 30, 1.0)), _GRID))
        anyone = -np.expm1(-np.outer(draws * noise, w)).sum(axis=0)
        fans = np.cumsum(np.exp(-np.outer(draws[pair_user] * noise, w))
                         - np.exp(-np.outer(draws[pair_user] * boost.ravel()[pairs], w)), axis=0)
        fans = np.vstack([np.zeros(_GRID), fans])  # fans[j]: the first j pairs' extra counts
        expected = n_users / n_sample * (anyone + fans[pair_bounds[1:]] - fans[pair_bounds[:-1]])
        expected = np.maximum.accumulate(expected, axis=1) * (1 + 1e-9 * np.arange(_GRID))  # strictly increasing
        new = np.empty_like(weights)
        for k in range(n_clusters):
            items = by_cluster[bounds[k]:bounds[k + 1]]
            new[items] = np.exp(np.interp(np.log(target[items]), np.log(expected[k]), np.log(w)))
        new /= new.sum()
        change = float(np.abs(np.log(new / weights)).max())
        weights = new
        if change < 1e-3:
            break
    return weights, np.interp(lengths, s_len, draws / s_len)


# ---------------------------------------------------------------------------- sampling


def _draw(rng: np.random.Generator, user: np.ndarray, noise: float, taste_cdf: np.ndarray, tastes: np.ndarray,
          cdf: np.ndarray, by_cluster: np.ndarray, mass_begin: np.ndarray, mass: np.ndarray,
          cluster_begin: np.ndarray, cluster_end: np.ndarray) -> np.ndarray:
    """One item per entry of ``user``: from one of the user's clusters by weight within it, or
    (probability ``noise``) from all items by weight."""
    n = user.shape[0]
    u = rng.random(n)
    from_taste = rng.random(n) >= noise
    pick = rng.random(n)
    slot = np.zeros(n, np.int64)
    for j in range(taste_cdf.shape[1] - 1):
        slot += pick > taste_cdf[user, j]
    cluster = np.maximum(tastes[user, slot], 0)
    lo = np.where(from_taste, mass_begin[cluster], 0.0)
    width = np.where(from_taste, mass[cluster], 1.0)
    pos = np.searchsorted(cdf, lo + u * width, side="right")
    pos = np.where(from_taste, np.clip(pos, cluster_begin[cluster], cluster_end[cluster] - 1),
                   np.minimum(pos, cdf.shape[0] - 1))
    return by_cluster[pos]


def _merge_distinct(old_user: np.ndarray, old_item: np.ndarray, user: np.ndarray, item: np.ndarray,
                    have: np.ndarray, lengths: np.ndarray, n_items: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Append new draws (user-sorted) to each user's distinct items (user-sorted, ``have[u]`` of
    them), dropping repeats (the first occurrence wins) and draws beyond the user's length.
    One sort of (user, item, position) packed in int64 finds the repeats."""
    n_old = old_user.shape[0]
    all_user = np.concatenate([old_user, user])
    position = np.arange(all_user.shape[0], dtype=np.int64)
    pair = all_user * n_items + np.concatenate([old_item, item])
    n = all_user.shape[0]
    if pair.size and int(pair.max()) < (2 ** 63 - 1) // max(n, 1):  # packed: one plain sort
        key = pair * n + position
        key.sort()
        pair, position = key // n, key % n
    else:
        order = np.lexsort((position, pair))
        pair, position = pair[order], position[order]
    first = np.zeros(n, bool)
    first[position[np.concatenate([[True], pair[1:] != pair[:-1]])]] = True
    new = first[n_old:]  # old items are distinct and earlier, so all of them are first
    user, item = user[new], item[new]
    start = np.concatenate([[True], user[1:] != user[:-1]]) if user.size else np.zeros(0, bool)
    run_start = np.maximum.accumulate(np.where(start, np.arange(user.shape[0]), 0)) if user.size else start
    rank = have[user] + np.arange(user.shape[0]) - run_start
    fits = rank < lengths[user]
    user, item = user[fits], item[fits]
    have = have + np.bincount(user, minlength=have.shape[0])
    # Interleave: each user's old items, then its new ones (both blocks user-sorted).
    merged_user = np.concatenate([old_user, user])
    order = np.argsort(merged_user, kind="stable")
    return merged_user[order], np.concatenate([old_item, item])[order], have


def _fill(draw: Callable[[np.ndarray, bool], np.ndarray], lengths: np.ndarray, need: np.ndarray,
          n_items: int) -> np.ndarray:
    """The items of users with these ``lengths``, concatenated in user order: each draws until it has
    its length in distinct items (first ``need`` draws, then as many as the rate of new items in its
    last round suggests), keeping them in draw order. Past round 16, draws are uniform, so even
    histories that their clusters cannot fill end."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = np.empty(int(offsets[-1]), np.int32)
    work_user, work_item = np.zeros(0, np.int64), np.zeros(0, np.int64)
    have = np.zeros(lengths.shape[0], np.int64)
    short = np.arange(lengths.shape[0])
    for round_ in range(64):
        if not short.size:
            return out
        before = have[short]
        user = np.repeat(short, need[short])
        work_user, work_item, have = _merge_distinct(work_user, work_item, user, draw(user, round_ >= 16), have,
                                                     lengths, n_items)
        done = have[work_user] >= lengths[work_user]
        users, items = work_user[done], work_item[done]
        if users.size:  # complete users, user-sorted: scatter into place
            first = np.concatenate([[True], users[1:] != users[:-1]])
            run_start = np.maximum.accumulate(np.where(first, np.arange(users.shape[0]), 0))
            out[offsets[users] + np.arange(users.shape[0]) - run_start] = items
        work_user, work_item = work_user[~done], work_item[~done]
        rate = np.maximum((have[short] - before) / need[short], 0.1)
        need[short] = np.ceil(1.5 * (lengths[short] - have[short]) / rate).astype(np.int64) + 2
        short = np.flatnonzero(have < lengths)
    raise RuntimeError("synthetic histories did not fill up; lower max_length or min_length")


def _race(rng: np.random.Generator, lengths: np.ndarray, tastes: np.ndarray, taste_w: np.ndarray, noise: float,
          weights: np.ndarray, item_cluster: np.ndarray) -> list[np.ndarray]:
    """Each user's ``length`` items without replacement, with the probabilities of ``_draw``: the
    smallest of Exponential(1) / probability, in order (Efraimidis and Spirakis). The same law as
    drawing until the history is full, for one key per item instead of the many repeats of a long
    history."""
    n_clusters = int(item_cluster.max()) + 1
    mass = np.bincount(item_cluster, weights, n_clusters)
    boost = np.full((lengths.shape[0], n_clusters), max(noise, 1e-12))  # the user's factor on each cluster
    used = tastes >= 0
    np.add.at(boost, (np.nonzero(used)[0], tastes[used]), (1 - noise) * taste_w[used] / mass[tastes[used]])
    keys = rng.standard_exponential((lengths.shape[0], weights.shape[0])) / (boost[:, item_cluster] * weights)
    out = []
    for key, length in zip(keys, lengths.tolist()):
        top = np.argpartition(key, length - 1)[:length] if length else np.zeros(0, np.int64)
        out.append(top[np.argsort(key[top])])
    return out


def generate_user_histories(config: HistoryConfig = HistoryConfig(), seed: int = 0) -> UserHistories:
    """Synthetic histories, the same for the same (config, seed); vectorised numpy throughout,
    in chunks of users so that memory stays bounded.

    Items get a rank on the popularity curve (in a random id order) and one of ``n_clusters``
    clusters (balanced). A user gets 1..max_tastes distinct clusters with random weights and a
    log-normal length; each draw comes, with probability 1 - noise, from one of their clusters by
    weight within it, otherwise from all items by weight, until the history has its length in
    distinct items. The weights are calibrated (``_calibrate``) so that each item's expected count
    follows the curve despite the repeats a history drops. Histories that would need many draws
    per item (the longest) are drawn without replacement directly (``_race``), in the same law.
    """
    c = config
    if c.n_users < 0 or c.n_items < 1:
        raise ValueError(f"need n_users >= 0 and n_items >= 1, got {c.n_users} and {c.n_items}")
    if not 1 <= c.n_clusters <= c.n_items:
        raise ValueError(f"n_clusters must be in [1, n_items = {c.n_items}], got {c.n_clusters}")
    if c.max_tastes < 1 or not 0.0 <= c.noise <= 1.0 or c.min_length < 0:
        raise ValueError("need max_tastes >= 1, noise in [0, 1] and min_length >= 0")
    if c.popularity_offset <= 0 or c.popularity_cutoff <= 0 or c.popularity_items < 1:
        raise ValueError("need popularity_offset > 0, popularity_cutoff > 0 and popularity_items >= 1")
    cap = c.n_items // 3 if c.max_length is None else c.max_length
    cap = max(cap, c.min_length)
    if cap > c.n_items:
        raise ValueError(f"histories of {cap} distinct items need at least that many items, have {c.n_items}")
    rng = np.random.default_rng(seed)
    n_users, n_items, n_clusters = c.n_users, c.n_items, c.n_clusters

    popularity = _popularity_curve(c)[rng.permutation(n_items)]
    item_cluster = rng.permutation(np.arange(n_items) % n_clusters)
    tastes, taste_w = _tastes(n_users, n_clusters, c.max_tastes, rng)
    lengths = _lengths(c, cap, rng)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    indices = np.empty(int(offsets[-1]), np.int32)
    if n_users:
        weights, draw_ratio = _calibrate(popularity * offsets[-1], item_cluster, n_clusters, lengths, tastes,
                                         taste_w, c.noise)
        need = np.ceil(1.1 * draw_ratio * lengths).astype(np.int64) + 2  # first-round draws
        racing = np.flatnonzero(need > n_items / 8)  # cheaper as one key per item
        block = max(1, (1 << 22) // n_items)  # users per ~4M keys
        race_rng = np.random.default_rng([seed, 0])
        for a in range(0, racing.shape[0], block):
            users = racing[a:a + block]
            for u, items in zip(users.tolist(), _race(race_rng, lengths[users], tastes[users], taste_w[users],
                                                      c.noise, weights, item_cluster)):
                indices[offsets[u]:offsets[u + 1]] = items

        by_cluster = np.argsort(item_cluster, kind="stable")  # items grouped by cluster
        cdf = np.cumsum(weights[by_cluster])
        cdf[-1] = 1.0
        cluster_end = np.cumsum(np.bincount(item_cluster, minlength=n_clusters))
        cluster_begin = cluster_end - np.bincount(item_cluster, minlength=n_clusters)
        mass_begin = np.where(cluster_begin > 0, cdf[np.maximum(cluster_begin - 1, 0)], 0.0)
        mass = cdf[cluster_end - 1] - mass_begin
        taste_cdf = np.cumsum(taste_w, axis=1)
        taste_cdf[:, -1] = 1.0
        drawing = np.flatnonzero(need <= n_items / 8)
        # Chunks of about 4M first-round draws, each with its own random stream.
        ends = np.searchsorted(np.cumsum(need[drawing]), np.arange(1 << 22, int(need[drawing].sum()), 1 << 22),
                               side="right")
        for chunk, (a, b) in enumerate(zip([0, *ends], [*ends, drawing.shape[0]])):
            users = drawing[a:b]
            chunk_rng = np.random.default_rng([seed, 1, chunk])

            def draw(local: np.ndarray, uniform: bool, users: np.ndarray = users,
                     chunk_rng: np.random.Generator = chunk_rng) -> np.ndarray:
                if uniform:
                    return chunk_rng.integers(0, n_items, local.shape[0])
                return _draw(chunk_rng, users[local], c.noise, taste_cdf, tastes, cdf, by_cluster, mass_begin, mass,
                             cluster_begin, cluster_end)

            items = _fill(draw, lengths[users], need[users], n_items)
            start = np.concatenate([[0], np.cumsum(lengths[users])[:-1]])  # of each user in ``items``
            indices[np.repeat(offsets[users] - start, lengths[users]) + np.arange(items.shape[0])] = items
    rows = CsrRows(offsets, indices, None, n_items)
    return UserHistories(rows, [f"user{u}" for u in range(n_users)], [f"item{i}" for i in range(n_items)],
                         popularity, item_cluster.astype(np.int64), tastes, taste_w)


def write_user_histories(histories: UserHistories, csr_path: str | os.PathLike, *,
                         text_path: str | os.PathLike | None = None,
                         features_index: str | os.PathLike | None = None,
                         samples_index: str | os.PathLike | None = None, overwrite: bool = False) -> None:
    """Write histories as a CSR dataset and, optionally, as DSSTNE text and the two index files
    (item names = features index, user names = samples index)."""
    write_csr(csr_path, histories.rows, overwrite=overwrite)
    if text_path is not None:
        write_text(text_path, histories.rows, histories.item_names, histories.user_names)
    if features_index is not None:
        NameIndex(histories.item_names).save(features_index)
    if samples_index is not None:
        NameIndex(histories.user_names).save(samples_index)

