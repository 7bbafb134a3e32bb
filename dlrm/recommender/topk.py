"""Top-K recommendations: seen items excluded, ties broken by item id, lists merged across
processes, and DSSTNE's predict output lines.

Why a tie rule: ``torch.topk`` returns tied entries in an unspecified order, which depends on
the device, the kernel and on how the items are split across processes. Recommendations must
not change with the number of processes, so every function here orders entries by
(score descending, item id ascending): a total order, the same on every split. Excluded items
(score -inf) are never recommended: they come out as id -1 with value -inf at the end of a row.

Why exclusion first: each process scores only its own item range. When it sets its users' seen
items to -inf *before* its local top-k, every local list is the true top-k of that slice under
the total order, so the global top-k is among the union of the local lists and the merge is
exact; no oversampling (DSSTNE took K * c candidates and filtered afterwards) is needed.
"""

from __future__ import annotations

import re

import torch

# Scores in predict's output: 6 significant digits, so that a user's top K rarely tie on paper (a
# softmax over 27,278 items gives top scores of a few thousandths, which 3 decimals write as
# 0.004, 0.004, 0.003, ...). DSSTNE's predict wrote 3 decimals (its ``-p`` option, default "4.3f").
DEFAULT_SCORE_FORMAT = "%.6g"
DSSTNE_SCORE_FORMAT = "%4.3f"
_SCORE_FORMAT = re.compile(r"%?[-+ #0]*(?P<width>[0-9]*)(?:\.(?P<precision>[0-9]+))?[eEfFgG]")
# Bounds of a score's printf format: a float32 score has 9 significant digits and a float64 17,
# so more digits print noise (and %.99999999f writes 100 MB per score); a width beyond a few
# dozen characters only pads.
MAX_SCORE_PRECISION = 17
MAX_SCORE_WIDTH = 32

# Rows of scores processed at once by ``top_k``: bounds its temporaries (two bool masks and,
# only when a tie straddles the k-th place, an int32 running count) to about this many elements.
_CHUNK_ELEMENTS = 1 << 24


def _check_csr(offsets: torch.Tensor, indices: torch.Tensor, rows: int) -> None:
    if offsets.dim() != 1 or offsets.shape[0] != rows + 1:
        raise ValueError(f"`offsets` must have shape [{rows + 1}] (batch size + 1), got {list(offsets.shape)}")
    if indices.dim() != 1:
        raise ValueError(f"`indices` must be 1-D, got shape {list(indices.shape)}")
    if rows and (int(offsets[0]) != 0 or int(offsets[-1]) != indices.shape[0]):
        raise ValueError(f"`offsets` must run from 0 to the number of indices ({indices.shape[0]}), got "
                         f"{int(offsets[0])} .. {int(offsets[-1])}; pass batch-relative offsets")


def exclude_(scores: torch.Tensor, offsets: torch.Tensor, indices: torch.Tensor, item_start: int = 0) -> torch.Tensor:
    """In place: ``scores`` [B, n_local] holds items [item_start, item_start + n_local); sets -inf
    at (b, i - item_start) for every item i in row b of the CSR (``offsets`` [B + 1] from 0,
    ``indices`` global item ids). Ids outside the local range are ignored (they belong to
    another process's slice). Returns ``scores``."""
    if scores.dim() != 2:
        raise ValueError(f"`scores` must be [batch, items], got shape {list(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"`scores` must be floating point to hold -inf, got {scores.dtype}")
    offsets = torch.as_tensor(offsets).to(device=scores.device, dtype=torch.int64)
    indices = torch.as_tensor(indices).to(device=scores.device, dtype=torch.int64)
    batch, n_local = scores.shape
    _check_csr(offsets, indices, batch)
    if not indices.numel() or not n_local:
        return scores
    row = torch.repeat_interleave(torch.arange(batch, device=scores.device), offsets[1:] - offsets[:-1],
                                  output_size=indices.shape[0])
    local = indices - item_start
    inside = (local >= 0) & (local < n_local)
    scores[row[inside], local[inside]] = float("-inf")
    return scores


def _sorted_by_value_then_id(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of candidates ordered by (value descending, id ascending): sort by id, then a stable
    sort by value keeps ids ascending among equal values."""
    order = torch.sort(ids, dim=1, stable=True).indices
    values, ids = values.gather(1, order), ids.gather(1, order)
    order = torch.sort(values, dim=1, descending=True, stable=True).indices
    return values.gather(1, order), ids.gather(1, order)


def _top_k_rows(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact top-k of a chunk of rows (k <= n) with ids ascending among ties, local ids.

    Fast path: ``torch.topk`` of k + 1 shows where no tie straddles the k-th place (the usual
    case for float scores; ties at -inf are excluded items and do not matter); those rows only
    need their k candidates ordered. The other rows take the exact path below."""
    rows, n = scores.shape
    if k < n:
        values, ids = torch.topk(scores, k + 1, dim=1, sorted=True)
        clear = (values[:, k - 1] > values[:, k]) | (values[:, k - 1] == float("-inf"))
        if bool(clear.all()):
            return _sorted_by_value_then_id(values[:, :k], ids[:, :k])
        if bool(clear.any()):
            fast_v, fast_i = _sorted_by_value_then_id(values[clear, :k], ids[clear, :k])
            slow_v, slow_i = _exact_top_k_rows(scores[~clear], k)
            out_v, out_i = values[:, :k].clone(), ids[:, :k].clone()
            out_v[clear], out_i[clear] = fast_v, fast_i
            out_v[~clear], out_i[~clear] = slow_v, slow_i
            return out_v, out_i
    return _exact_top_k_rows(scores, k)


def _exact_top_k_rows(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-th value's ties resolved explicitly: the lowest ids equal to it fill the places."""
    rows, n = scores.shape
    kth = torch.topk(scores, k, dim=1, sorted=True).values[:, -1:]  # the k-th best value per row
    above = scores > kth  # all of these are in
    tied = scores == kth  # the lowest ids of these fill the remaining places
    need = k - above.sum(1, keepdim=True)
    if bool((tied.sum(1, keepdim=True) == need).all()):
        chosen = above | tied  # no tie straddles the k-th place: the usual case for float scores
    else:
        chosen = above | (tied & (torch.cumsum(tied, dim=1, dtype=torch.int32) <= need))
    # Row-major nonzero: exactly k per row, ids ascending within each row.
    ids = chosen.nonzero()[:, 1].view(rows, k)
    return _sorted_by_value_then_id(scores.gather(1, ids), ids)


def top_k(scores: torch.Tensor, k: int, item_start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(values [B, k'], global item ids int64 [B, k']) best first, k' = min(k, n_local).

    Ties are broken by the lower item id, so the result does not depend on how items are split
    across processes. Excluded (-inf) entries are dropped: they get id -1 and value -inf and
    come last. Exact and memory-safe for large n_local: ``torch.topk`` finds each row's k-th
    best value; the entries above it are all chosen and the places left go to the lowest ids
    equal to it; rows are processed in chunks so the temporaries stay bounded. NaN scores are
    refused (they have no place in the order).
    """
    if scores.dim() != 2:
        raise ValueError(f"`scores` must be [batch, items], got shape {list(scores.shape)}")
    if not scores.is_floating_point():
        raise ValueError(f"`scores` must be floating point, got {scores.dtype}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"`k` must be an integer >= 0, got {k!r}")
    batch, n_local = scores.shape
    kk = min(k, n_local)
    if not kk or not batch:
        return (scores.new_empty((batch, kk)), torch.empty((batch, kk), dtype=torch.int64, device=scores.device))
    if bool(torch.isnan(scores).any()):
        raise ValueError("`scores` contain NaN; top-k needs comparable scores (check the model's output)")
    chunk = max(1, _CHUNK_ELEMENTS // n_local)
    values, ids = [], []
    for lo in range(0, batch, chunk):
        v, i = _top_k_rows(scores[lo:lo + chunk], kk)
        values.append(v)
        ids.append(i)
    values_t, ids_t = torch.cat(values), torch.cat(ids) + item_start
    return values_t, ids_t.masked_fill_(values_t == float("-inf"), -1)


def merge_top_k(values: list[torch.Tensor], items: list[torch.Tensor], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-shard top lists (each [B, k_s], global ids, as ``top_k`` gives them) into the
    global top-k per row, same order and tie rule: (values [B, k'], ids [B, k']) with
    k' = min(k, sum of k_s); id -1 (value -inf) entries stay last.

    This is the distributed predict's final step. Each process applies ``exclude_`` to its item
    slice and keeps its top-k; that is exact, with no K * c oversampling: under the total order
    (value desc, id asc) a row's global top-k items are each within the top-k of their own
    slice, so the union of the local lists contains the whole answer.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"`k` must be an integer >= 0, got {k!r}")
    if len(values) != len(items) or not values:
        raise ValueError(f"`values` and `items` must be equally long non-empty lists (one entry per shard), got "
                         f"{len(values)} and {len(items)}")
    for s, (v, i) in enumerate(zip(values, items)):
        if v.dim() != 2 or v.shape != i.shape or v.shape[0] != values[0].shape[0]:
            raise ValueError(f"shard {s}: `values` and `items` must both be [B, k_s] with the same B as shard 0, got "
                             f"{list(v.shape)} and {list(i.shape)}")
    all_values = torch.cat(values, dim=1)
    all_ids = torch.cat([i.to(torch.int64) for i in items], dim=1)
    dropped = (all_ids < 0) | (all_values == float("-inf"))
    all_values = all_values.masked_fill(dropped, float("-inf"))
    # Dropped entries sort after every real id among equal (-inf) values.
    all_ids = all_ids.masked_fill(dropped, torch.iinfo(torch.int64).max)
    kk = min(k, all_values.shape[1])
    all_values, all_ids = _sorted_by_value_then_id(all_values, all_ids)
    out_values, out_ids = all_values[:, :kk].contiguous(), all_ids[:, :kk].contiguous()
    return out_values, out_ids.masked_fill_(out_values == float("-inf"), -1)


def check_score_format(spec: str) -> str:
    """``spec`` as a printf format of one float (``%.6g``, ``%4.3f``, ``%.8e``), with its ``%``
    added if left out as in DSSTNE's ``-p 4.3f``. Anything else is refused: text beside the
    number could break the ``item,score:`` fields."""
    match = _SCORE_FORMAT.fullmatch(spec) if isinstance(spec, str) and len(spec) <= 64 else None
    if match is None:
        raise ValueError(f"`score_format` must be a printf format of one float such as {DEFAULT_SCORE_FORMAT!r} or "
                         f"{DSSTNE_SCORE_FORMAT!r} (DSSTNE's), got {spec[:80] if isinstance(spec, str) else spec!r}")
    width, precision = int(match.group("width") or 0), int(match.group("precision") or 0)
    if precision > MAX_SCORE_PRECISION or width > MAX_SCORE_WIDTH:
        raise ValueError(f"`score_format` {spec!r} has a {'precision' if precision > MAX_SCORE_PRECISION else 'width'} "
                         f"of {precision if precision > MAX_SCORE_PRECISION else width}; at most "
                         f"{MAX_SCORE_PRECISION} digits of precision (a float64's; a score has fewer) and a width "
                         f"of {MAX_SCORE_WIDTH}, e.g. {DEFAULT_SCORE_FORMAT!r}")
    return spec if spec.startswith("%") else "%" + spec


def format_recommendations(sample_names: list[str], values: torch.Tensor, items: torch.Tensor,
                           item_names: list[str], score_format: str = DEFAULT_SCORE_FORMAT) -> list[str]:
    """DSSTNE's predict output: one line per sample, ``sample\\titem,score:item,score:...\\n``, best
    first, scores written with ``score_format`` (``check_score_format``); entries with id -1 are
    left out (a sample with none gives ``sample\\t\\n``)."""
    if values.dim() != 2 or values.shape != items.shape:
        raise ValueError(f"`values` and `items` must both be [B, k], got {list(values.shape)} and {list(items.shape)}")
    if len(sample_names) != values.shape[0]:
        raise ValueError(f"`sample_names` has {len(sample_names)} names for {values.shape[0]} rows; pass one per row")
    score_format = check_score_format(score_format)
    ids = items.detach().to("cpu", torch.int64).tolist()
    scores = values.detach().to("cpu", torch.float64).tolist()
    n_names = len(item_names)
    lines = []
    for name, row_ids, row_scores in zip(sample_names, ids, scores):
        fields = []
        for i, s in zip(row_ids, row_scores):
            if i < 0:
                continue
            if i >= n_names:
                raise ValueError(f"item id {i} has no name (`item_names` has {n_names}); pass the full features index")
            fields.append(f"{item_names[i]},{score_format % s}")
        lines.append(f"{name}\t{':'.join(fields)}\n")
    return lines
