"""One convention for splitting N rows over P processes, used by every split in the engine.

Process ``r`` owns the contiguous rows ``[b[r], b[r + 1])``; the sizes differ by one at most and
the first ``N % P`` processes hold the extra rows (as ``numpy.array_split`` and
``torch.tensor_split`` do). Batches over processes, items of the recommender's wide layers and
row-wise blocks of embedding tables all split this way, so a reader of one split knows them all.
"""

from __future__ import annotations


def split_sizes(n: int, parts: int) -> list[int]:
    """Rows per part: ``n // parts`` each, one more for the first ``n % parts`` parts."""
    if parts < 1:
        raise ValueError(f"rows are split over at least 1 part, got {parts}")
    if n < 0:
        raise ValueError(f"a split needs a row count >= 0, got {n}")
    base, extra = divmod(n, parts)
    return [base + (r < extra) for r in range(parts)]


def split_bounds(n: int, parts: int) -> list[int]:
    """``parts + 1`` bounds: part ``r`` owns rows ``[b[r], b[r + 1])``."""
    bounds = [0]
    for size in split_sizes(n, parts):
        bounds.append(bounds[-1] + size)
    return bounds
