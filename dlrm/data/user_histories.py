"""User histories for the sparse autoencoder recommender: MovieLens ratings converted to
DSSTNE text, and realistic synthetic histories for tests and benchmarks when no real data
may be used.

The synthetic generator models what makes recommendation learnable and hard: item popularity
is power-law (a few blockbusters, a long tail), history lengths are log-normal above a minimum
(MovieLens keeps users with >= 20 ratings; a few users rate thousands), and users have tastes:
each draws most items from a few latent clusters, weighted by popularity, so held-out items are
predictable from the rest of a history, as they are in real data.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Iterator, TextIO

import numpy as np

from dlrm.data.atomic import write_atomically
from dlrm.data.csr_dataset import CsrRows, write_csr
from dlrm.data.dsstne_text import NameIndex, write_text
from dlrm.data.errors import DatasetError

MOVIELENS_HEADER = ("userId", "movieId", "rating", "timestamp")

# ---------------------------------------------------------------------------- MovieLens


@dataclass
class _Chunk:
    user: np.ndarray  # int64
    item: np.ndarray  # int64
    rating: np.ndarray  # float32
    time: np.ndarray  # int64


def _check_header(path: str) -> None:
    with open(path, encoding="utf-8-sig", newline="") as f:
        first = f.readline().rstrip("\r\n")
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
    try:
        rating = float(fields[2])
    except ValueError:
        rating = math.nan
    if not math.isfinite(rating):
        raise DatasetError(f"{path}:{number}: bad rating {fields[2].strip()!r}: not a finite number")
    try:
        time = int(fields[3])
    except ValueError:
        raise DatasetError(f"{path}:{number}: malformed line {line[:80]!r}: timestamp must be an integer") from None
    return user, item, rating, time


def _python_chunks(path: str, chunk_rows: int) -> Iterator[_Chunk]:
    """The stdlib reader: slower, but needs nothing and names the line of any problem."""
    rows: list[tuple[int, int, float, int]] = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        f.readline()
        for number, line in enumerate(f, 2):
            line = line.rstrip("\r\n")
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


def _arrow_chunks(path: str, chunk_bytes: int) -> Iterator[_Chunk]:
    """pyarrow's streaming CSV reader (tens of millions of lines a minute). Any parse problem
    is re-located by the stdlib reader, which names the line."""
    import pyarrow as pa  # optional: the stdlib reader serves without it
    import pyarrow.csv as pacsv

    types = {"userId": pa.int64(), "movieId": pa.int64(), "rating": pa.float32(), "timestamp": pa.int64()}
    try:
        reader = pacsv.open_csv(
            path, read_options=pacsv.ReadOptions(block_size=chunk_bytes, encoding="utf8"),
            convert_options=pacsv.ConvertOptions(column_types=types, include_columns=list(MOVIELENS_HEADER)),
        )
        for batch in reader:
            columns = [batch.column(i) for i in range(4)]
            if any(c.null_count for c in columns):
                raise ValueError("empty field")
            chunk = _Chunk(*(np.asarray(c.to_numpy(zero_copy_only=False)) for c in columns))
            if not np.isfinite(chunk.rating).all():
                raise ValueError("non-finite rating")
            yield chunk
    except (pa.ArrowInvalid, ValueError):
        for _ in _python_chunks(path, 1 << 16):  # raises DatasetError naming the line
            pass
        raise


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
            _group_users(chunks, f, path, with_ratings, min_rating, counts)

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
    """Shape of a synthetic set; defaults match MovieLens-20M (138,493 users, 27,278 items,
    20,000,263 ratings, >= 20 per user, median ~68, mean ~144)."""

    n_users: int = 138_493
    n_items: int = 27_278
    n_interactions: int = 20_000_263  # target total; the result is within a few percent
    min_length: int = 20
    max_length: int | None = None  # default: n_items // 3 (MovieLens's longest history is ~9,300)
    length_sigma: float = 1.4  # log-normal sigma of (length - min_length); 1.4 gives MovieLens's median/mean
    popularity_exponent: float = 1.0  # Zipf: item of popularity rank r has weight (r + 1) ** -exponent
    n_clusters: int = 40  # latent tastes (genres)
    max_tastes: int = 3  # each user likes 1..max_tastes clusters
    noise: float = 0.1  # share of a user's draws from global popularity instead of their tastes


@dataclass
class UserHistories:
    """Synthetic histories and the ground truth behind them (for tests and analysis)."""

    rows: CsrRows  # one row per user, items in "time" order, no values
    user_names: list[str]
    item_names: list[str]
    item_popularity: np.ndarray  # float64 [n_items], sums to 1
    item_cluster: np.ndarray  # int64 [n_items]
    user_tastes: np.ndarray  # int64 [n_users, max_tastes], -1 where unused
    user_taste_weights: np.ndarray  # float64 [n_users, max_tastes]


def _lengths(config: HistoryConfig, cap: int, rng: np.random.Generator) -> np.ndarray:
    """Log-normal excess over the minimum, rescaled so the total meets the target."""
    n, lo = config.n_users, config.min_length
    mean_excess = config.n_interactions / n - lo
    if mean_excess <= 0:
        return np.full(n, lo, np.int64)
    s = config.length_sigma
    excess = rng.lognormal(math.log(mean_excess) - s * s / 2, s, n)
    for _ in range(4):  # capping loses mass: rescale the rest, a few times
        capped = np.minimum(excess, cap - lo)
        excess = excess * (mean_excess * n / max(capped.sum(), 1e-9))
    return lo + np.floor(np.minimum(excess, cap - lo)).astype(np.int64)


def _draw(rng: np.random.Generator, user: np.ndarray, round_: int, noise: float, taste_cdf: np.ndarray,
          tastes: np.ndarray, cdf: np.ndarray, by_cluster: np.ndarray, mass_begin: np.ndarray, mass: np.ndarray,
          cluster_begin: np.ndarray, cluster_end: np.ndarray) -> np.ndarray:
    """One item per entry of ``user``: from one of the user's clusters by popularity within it,
    or (probability ``noise``) from all items by popularity. Later rounds only fill up long
    histories that their clusters and the popular items cannot: more noise, and from round 3
    items uniformly, so every round fills most of what is missing."""
    n = user.shape[0]
    if round_ >= 3:
        return rng.integers(0, cdf.shape[0], n)
    if round_:
        noise = min(1.0, max(noise, 0.05) * 4 ** round_)
    u = rng.random(n)
    from_taste = rng.random(n) >= noise
    pick = rng.random(n)
    slot = np.zeros(n, np.int64)
    for j in range(taste_cdf.shape[1] - 1):
        slot += pick > taste_cdf[user, j]
    cluster = tastes[user, slot]
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


def generate_user_histories(config: HistoryConfig = HistoryConfig(), seed: int = 0) -> UserHistories:
    """Synthetic histories, the same for the same (config, seed); vectorised numpy throughout.

    Items get Zipf popularity (in a random id order) and one of ``n_clusters`` clusters
    (balanced). A user gets 1..max_tastes clusters with random weights and a log-normal length;
    each draw comes, with probability 1 - noise, from one of their clusters by popularity
    within it, otherwise from all items by popularity. Repeats are dropped and users short of
    their length draw again (later rounds with more noise, so even long histories fill), so
    every history has distinct items and at least ``min_length`` of them.
    """
    c = config
    if c.n_users < 0 or c.n_items < 1:
        raise ValueError(f"need n_users >= 0 and n_items >= 1, got {c.n_users} and {c.n_items}")
    if not 1 <= c.n_clusters <= c.n_items:
        raise ValueError(f"n_clusters must be in [1, n_items = {c.n_items}], got {c.n_clusters}")
    if c.max_tastes < 1 or not 0.0 <= c.noise <= 1.0 or c.min_length < 0:
        raise ValueError("need max_tastes >= 1, noise in [0, 1] and min_length >= 0")
    cap = c.n_items // 3 if c.max_length is None else c.max_length
    cap = max(cap, c.min_length)
    if cap > c.n_items:
        raise ValueError(f"histories of {cap} distinct items need at least that many items, have {c.n_items}")
    rng = np.random.default_rng(seed)
    n_users, n_items, n_clusters, n_tastes = c.n_users, c.n_items, c.n_clusters, c.max_tastes

    rank = rng.permutation(n_items)
    weight = (rank + 1.0) ** -c.popularity_exponent
    popularity = weight / weight.sum()
    item_cluster = rng.permutation(np.arange(n_items) % n_clusters)
    by_cluster = np.argsort(item_cluster, kind="stable")  # items grouped by cluster
    cdf = np.cumsum(popularity[by_cluster])
    cdf[-1] = 1.0
    cluster_end = np.cumsum(np.bincount(item_cluster, minlength=n_clusters))
    cluster_begin = cluster_end - np.bincount(item_cluster, minlength=n_clusters)
    mass_begin = np.where(cluster_begin > 0, cdf[np.maximum(cluster_begin - 1, 0)], 0.0)
    mass = cdf[cluster_end - 1] - mass_begin

    used = rng.integers(1, n_tastes + 1, n_users)
    tastes = rng.integers(0, n_clusters, (n_users, n_tastes))
    taste_w = rng.gamma(1.0, 1.0, (n_users, n_tastes)) * (np.arange(n_tastes) < used[:, None])
    taste_w /= taste_w.sum(axis=1, keepdims=True)
    tastes = np.where(taste_w > 0, tastes, -1)
    taste_cdf = np.cumsum(taste_w, axis=1)
    taste_cdf[:, -1] = 1.0

    lengths = _lengths(c, cap, rng)
    # Working set: the users still short of their length, user-sorted, items in draw order.
    work_user, work_item = np.zeros(0, np.int64), np.zeros(0, np.int64)
    have = np.zeros(n_users, np.int64)
    done: list[tuple[np.ndarray, np.ndarray]] = []
    short = np.arange(n_users)
    for round_ in range(64):
        if not short.size:
            break
        deficit = lengths[short] - have[short]
        user = np.repeat(short, np.ceil(deficit * (1.15 if round_ == 0 else 2.0)).astype(np.int64) + 2)
        item = _draw(rng, user, round_, c.noise, taste_cdf, tastes, cdf, by_cluster, mass_begin, mass,
                     cluster_begin, cluster_end)
        work_user, work_item, have = _merge_distinct(work_user, work_item, user, item, have, lengths, n_items)
        finished = have[work_user] >= lengths[work_user]
        done.append((work_user[finished], work_item[finished]))
        work_user, work_item = work_user[~finished], work_item[~finished]
        short = np.flatnonzero(have < lengths)
    else:
        raise RuntimeError("synthetic histories did not fill up; lower max_length or min_length")
    offsets = np.concatenate([[0], np.cumsum(have)]).astype(np.int64)
    indices = np.empty(int(offsets[-1]), np.int32)
    for users, items in done:  # each block user-sorted, its users complete: scatter into place
        if users.size:
            first = np.concatenate([[True], users[1:] != users[:-1]])
            run_start = np.maximum.accumulate(np.where(first, np.arange(users.shape[0]), 0))
            indices[offsets[users] + np.arange(users.shape[0]) - run_start] = items
    rows = CsrRows(offsets, indices, None, n_items)
    return UserHistories(rows, [f"user{u}" for u in range(n_users)], [f"item{i}" for i in range(n_items)],
                         popularity, item_cluster.astype(np.int64), tastes.astype(np.int64), taste_w)


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

