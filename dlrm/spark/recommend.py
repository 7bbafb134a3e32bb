"""Top-K recommendations of a trained sparse autoencoder in Spark: ``recommender_predict`` on a
DataFrame of user histories.

The histories, one row per user (the column names are parameters):

    user      any type                the user (passed through to the output)
    items     array<string>           the user's items by name, as the features index names them
                                      (``features_index.txt`` of ``recommender_generate``), or
              array<int> / <long>     by column number, 0 .. items - 1 (the CSR dataset's ids)
    weights   array<float|double>     optional: one value per item (a rating); a null array, or
                                      no such column, counts each item 1.0

``read_csr_histories`` (a CSR dataset, what ``recommender_predict --input`` reads) and
``read_text_histories`` (DSSTNE text, what ``recommender_generate --text`` reads) give this.

``recommend`` returns one row per user, in the histories' order, as Spark ML's ALS
``recommendForAllUsers`` does:

    user              as given
    recommendations   array<struct<item: string, score: float>>, best first, at most K

(``F.posexplode`` makes one row per item, the position being the rank from 0). ``recommend_text``
returns DSSTNE's predict lines instead, in a column ``value``, and ``write_text`` writes them to
one file, byte for byte what ``recommender_predict`` writes for the same users.

The executors run predict's own code on batches of users: the checkpoint loaded as predict loads
it (``recommender.checkpoint``: tensors only, checksums verified), its output activations
(``scorer.model_scorer``), the user's own items removed and the best K kept, ties to the lower
item id (``predict.rank``), the lines formatted by ``topk.format_recommendations``. Items are
named as predict names them (``NameIndex.labels``). So a user's list here is the list predict
gives for the same history. The checkpoint (and the features index) must be on storage every
executor reaches; each Python worker loads the model once and keeps it for its next tasks.

Users with an empty (or null) history get the items the model scores highest with no input, as
in predict. An item the model does not know (a name not in the features index, a number outside
its items) fails the task with a ``DatasetError`` naming the user and the item, as predict refuses
a dataset wider than its network; ``on_error='skip'`` leaves such items out of the history
instead (as DSSTNE's generateNetCDF dropped features missing from a closed features index).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import reduce
from typing import Any

import numpy as np

from dlrm.engine.errors import DatasetError
from dlrm.recommender.topk import DEFAULT_SCORE_FORMAT, check_score_format
from dlrm.spark.job_io import FILE_COLUMN, SPLIT_START_COLUMN, line_of, read_raw_lines

USER, ITEMS, WEIGHTS = "user", "items", "weights"
RECOMMENDATIONS = "recommendations"
LINE = "value"  # the column of text lines, as spark.read.text names it


@dataclass(frozen=True)
class Recommender:
    """A checkpoint resolved and checked on the driver, with the names of its items: what the
    executors load (``open_recommender``)."""

    path: str  # the checkpoint directory itself (PATH.best, PATH or PATH.old)
    n_input: int  # items the network reads
    n_output: int  # items it scores
    item_names: tuple[str, ...]  # output item i is written item_names[i] (predict's names)
    index_names: tuple[str, ...] | None  # the features index's names of input items, and their ids
    index_ids: tuple[int, ...] | None

    def describe(self) -> str:
        from dlrm.recommender import checkpoint

        return checkpoint.describe(self.path)


def open_recommender(checkpoint: str, best: bool = True, features_index: str | None = None) -> Recommender:
    """The checkpoint predict would use for ``checkpoint`` (its best validation's, ``PATH.best``,
    unless ``best`` is False: ``recommender.checkpoint.model_path``), checked, and the item names
    of ``features_index`` (without one, items are their column numbers, as in predict)."""
    from dlrm.recommender import checkpoint as ckpt
    from dlrm.recommender.dsstne_text import NameIndex

    path = ckpt.model_path(checkpoint, best)
    n_input, n_output = ckpt.sizes_of(path)  # a missing or damaged checkpoint: CheckpointError, here on the driver
    if features_index is None:
        return Recommender(path, n_input, n_output, tuple(str(i) for i in range(n_output)), None, None)
    if not os.path.isfile(features_index):
        raise ValueError(f"`features_index` {features_index}: no such file")
    index = NameIndex.load(features_index)
    if index.size < n_output:
        raise ValueError(f"`features_index` {features_index} names {index.size:,} entries for the {n_output:,} items "
                         f"of the checkpoint's network; give the index written with the dataset it was trained on")
    known = [(name, i) for name, i in index.items() if i < n_input]
    return Recommender(path, n_input, n_output, tuple(index.labels(n_output)),
                       tuple(name for name, _ in known), tuple(i for _, i in known))


# ---------------------------------------------------------------------------- histories


def read_csr_histories(spark: Any, path: str, samples_index: str | None = None,
                       users_per_partition: int = 1 << 16) -> Any:
    """The CSR dataset at ``path`` (``recommender_generate``'s ``DIR/input``) as histories, read by
    the executors, ``users_per_partition`` users a task, in row order: ``user`` (the name in
    ``samples_index``, or the row number as predict writes it), ``items`` (array<int>, column
    numbers) and, when the dataset has values, ``weights`` (array<float>)."""
    import pyarrow as pa

    from dlrm.recommender.csr_dataset import CsrDataset
    from dlrm.recommender.dsstne_text import NameIndex

    if users_per_partition < 1:
        raise ValueError(f"`users_per_partition` must be >= 1, got {users_per_partition}")
    dataset = CsrDataset(path)  # checks the header on the driver
    n_users, has_values = len(dataset), dataset.values is not None
    names = None
    if samples_index is not None:
        if not os.path.isfile(samples_index):
            raise ValueError(f"`samples_index` {samples_index}: no such file")
        index = NameIndex.load(samples_index)
        if index.size != n_users:
            raise ValueError(f"`samples_index` {samples_index} names {index.size:,} entries for the {n_users:,} users "
                             f"of {path}; give the index written with that dataset")
        names = index.labels(n_users)
    partitions = -(-n_users // users_per_partition)
    schema = pa.schema([(USER, pa.string()), (ITEMS, pa.list_(pa.int32()))]
                       + ([(WEIGHTS, pa.list_(pa.float32()))] if has_values else []))

    def read(batches: Iterator[Any]) -> Iterator[Any]:
        part = CsrDataset(path)
        for batch in batches:
            for number in batch.column(0).to_pylist():
                lo, hi = number * users_per_partition, min(n_users, (number + 1) * users_per_partition)
                rows = part.rows(lo, hi)
                offsets = pa.array(rows.offsets.astype(np.int32))
                columns = [pa.array(names[lo:hi] if names is not None else [str(r) for r in range(lo, hi)],
                                    pa.string()),
                           pa.ListArray.from_arrays(offsets, pa.array(rows.indices.astype(np.int32)))]
                if has_values:
                    columns.append(pa.ListArray.from_arrays(offsets, pa.array(rows.values, pa.float32())))
                yield pa.RecordBatch.from_arrays(columns, schema=schema)

    spark_schema = f"{USER} string, {ITEMS} array<int>" + (f", {WEIGHTS} array<float>" if has_values else "")
    return spark.range(0, partitions, numPartitions=max(1, partitions)).mapInArrow(read, spark_schema)


def read_text_histories(spark: Any, paths: str | Sequence[str], on_error: str = "fail") -> Any:
    """DSSTNE text files (``<user>\\t<item>[,<value>]:<item>[,<value>]...``, what
    ``recommender_generate --text`` reads) as histories, the files in the order given and each in
    line order: ``user`` (string), ``items`` (array<string>, names) and ``weights`` (array<float>,
    null for a line whose items carry no value). A malformed line fails its task with a
    ``DatasetError`` naming its file and line, as ``recommender_generate`` would; with
    ``on_error='skip'`` it is left out. A user given twice gets two rows (not checked here)."""
    from dlrm.recommender.dsstne_text import split_line

    _check_on_error(on_error)
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise ValueError("`paths` is empty: give DSSTNE text files")
    # One read per file: a read of several files orders them by size, not as given.
    lines = reduce(lambda a, b: a.union(b), [read_raw_lines(spark, os.fspath(p)) for p in paths])

    def parse(batches: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        seen: Counter = Counter()  # (file, split start) -> its lines in earlier batches
        for frame in batches:
            users, items, weights = [], [], []
            for i, line in enumerate(frame[LINE]):
                try:
                    parsed = split_line(line)
                except DatasetError as e:
                    if on_error == "skip":
                        continue
                    where, number = line_of(frame, i, seen)
                    raise DatasetError(f"{where}:{number}: {e}") from None
                if parsed is not None:
                    name, names, values, any_value = parsed
                    users.append(name)
                    items.append(names)
                    weights.append(values if any_value else None)
            seen.update(zip(frame[FILE_COLUMN], frame[SPLIT_START_COLUMN]))
            yield pd.DataFrame({USER: pd.Series(users, dtype=object), ITEMS: pd.Series(items, dtype=object),
                                WEIGHTS: pd.Series(weights, dtype=object)})

    return lines.mapInPandas(parse, f"{USER} string, {ITEMS} array<string>, {WEIGHTS} array<float>")


# ---------------------------------------------------------------------------- recommendations


def recommend(histories: Any, checkpoint: str, k: int = 10, *, best: bool = True, features_index: str | None = None,
              exclude_inputs: bool = True, exclude_column: str | None = None, user_column: str = USER,
              items_column: str = ITEMS, weights_column: str | None = WEIGHTS, on_error: str = "fail",
              batch_size: int = 1024, threads: int | None = None) -> Any:
    """Each user's best ``k`` items, as ``recommender_predict`` ranks them: a DataFrame of
    ``user_column`` and ``recommendations`` (array<struct<item: string, score: float>>, best
    first), one row per row of ``histories``, in order.

    ``checkpoint``: the training run's ``checkpoint_path`` (its best validation's checkpoint is used
    unless ``best`` is False) or a checkpoint directory. ``features_index``: the item names (needed
    when ``items_column`` holds names). ``exclude_inputs``: never recommend the user's own items;
    ``exclude_column``: an array column of further items not to recommend (as predict's filter
    datasets). ``weights_column``: the items' values (the default ``weights`` is used when there is
    such a column). ``on_error='skip'``: leave out the items the model does not know instead of
    failing. ``batch_size`` users are scored at once, with ``threads`` torch threads a task
    (default: ``spark.task.cpus``)."""
    from pyspark.sql.types import ArrayType, FloatType, StringType, StructField, StructType

    rec, selected, columns = _prepare(histories, checkpoint, k, best, features_index, exclude_column, user_column,
                                      items_column, weights_column, on_error, batch_size, as_text=False)

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        names = pa.array(rec.item_names, pa.string())
        for batch, values, items in _ranked(batches, rec, k, columns, exclude_inputs, on_error, batch_size, threads):
            valid = items >= 0
            offsets = np.zeros(items.shape[0] + 1, np.int32)
            np.cumsum(valid.sum(1).numpy(), out=offsets[1:])
            entries = pa.StructArray.from_arrays(
                [names.take(pa.array(items[valid].numpy())), pa.array(values[valid].numpy(), pa.float32())],
                names=["item", "score"])
            yield pa.RecordBatch.from_arrays([batch.column(0), pa.ListArray.from_arrays(pa.array(offsets), entries)],
                                             names=[user_column, RECOMMENDATIONS])

    entry = StructType([StructField("item", StringType()), StructField("score", FloatType())])
    schema = StructType([selected.schema[user_column], StructField(RECOMMENDATIONS, ArrayType(entry))])
    return selected.mapInArrow(run, schema)


def recommend_text(histories: Any, checkpoint: str, k: int = 10, *, score_format: str = DEFAULT_SCORE_FORMAT,
                   best: bool = True, features_index: str | None = None, exclude_inputs: bool = True,
                   exclude_column: str | None = None, user_column: str = USER, items_column: str = ITEMS,
                   weights_column: str | None = WEIGHTS, on_error: str = "fail", batch_size: int = 1024,
                   threads: int | None = None) -> Any:
    """``recommend``'s lists as DSSTNE's predict lines, ``user\\titem,score:item,score:...`` (the
    user as a string, the scores in ``score_format``), in a string column ``value``: the lines of
    ``recommender_predict``'s output (``write_text`` writes them to one file)."""
    score_format = check_score_format(score_format)
    rec, selected, columns = _prepare(histories, checkpoint, k, best, features_index, exclude_column, user_column,
                                      items_column, weights_column, on_error, batch_size, as_text=True)

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa

        from dlrm.recommender.topk import format_recommendations

        for batch, values, items in _ranked(batches, rec, k, columns, exclude_inputs, on_error, batch_size, threads):
            lines = format_recommendations(batch.column(0).to_pylist(), values, items, rec.item_names, score_format)
            yield pa.RecordBatch.from_arrays([pa.array([line[:-1] for line in lines], pa.string())], names=[LINE])

    return selected.mapInArrow(run, f"{LINE} string")


def write_text(lines: Any, path: str) -> int:
    """The ``value`` lines of ``recommend_text`` as one text file at ``path`` (a path of the driver's
    file system), in order, written under a temporary name and renamed when complete, as
    ``recommender_predict`` writes its output: a failure leaves ``path`` as it was. The lines pass
    through the driver one partition at a time. Returns the number of lines."""
    from dlrm.engine.atomic import write_atomically

    count = 0

    def write(tmp: str) -> None:
        nonlocal count
        with open(tmp, "w", encoding="utf-8") as f:
            for row in lines.select(LINE).toLocalIterator(prefetchPartitions=True):
                f.write(row[0] + "\n")
                count += 1

    write_atomically(path, write, "the recommendations")
    return count


def _check_on_error(on_error: str) -> None:
    if on_error not in ("fail", "skip"):
        raise ValueError(f"`on_error` must be 'fail' or 'skip', got {on_error!r}")


def _item_kind(frame: Any, column: str, what: str) -> str:
    """'names' or 'numbers': the kind of ids the array column ``column`` holds."""
    from pyspark.sql.types import ArrayType, IntegralType, StringType

    if column not in frame.columns:
        raise ValueError(f"the histories have columns {frame.columns}, no {what} {column!r}")
    kind = frame.schema[column].dataType
    if isinstance(kind, ArrayType) and isinstance(kind.elementType, StringType):
        return "names"
    if isinstance(kind, ArrayType) and isinstance(kind.elementType, IntegralType):
        return "numbers"
    raise ValueError(f"{what} {column!r} is {kind.simpleString()}: give an array of item names (strings) or of "
                     f"column numbers (integers)")


def _prepare(histories: Any, checkpoint: str, k: int, best: bool, features_index: str | None,
             exclude_column: str | None, user_column: str, items_column: str, weights_column: str | None,
             on_error: str, batch_size: int, as_text: bool) -> tuple[Recommender, Any, dict[str, Any]]:
    """Checks on the driver, the recommender, and the histories reduced to the columns the tasks
    read: user, items (names, or numbers as long), weights (float), exclude (as items)."""
    from pyspark.sql.types import ArrayType, FloatType, LongType, NumericType

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"`k` must be an integer >= 1, got {k!r}")
    if batch_size < 1:
        raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
    _check_on_error(on_error)
    if user_column not in histories.columns:
        raise ValueError(f"the histories have columns {histories.columns}, no `user_column` {user_column!r}")
    kinds = {"items": _item_kind(histories, items_column, "`items_column`")}
    if exclude_column is not None:
        kinds["exclude"] = _item_kind(histories, exclude_column, "`exclude_column`")
    rec = open_recommender(checkpoint, best, features_index)
    if "names" in kinds.values() and rec.index_names is None:
        raise ValueError("the histories name their items (strings): give the features index that names them "
                         "(`features_index`), or give column numbers (integers)")
    user = histories[user_column]
    selected = [user.cast("string").alias(user_column) if as_text else user]

    def items(column: str, kind: str) -> Any:
        return histories[column] if kind == "names" else histories[column].cast(ArrayType(LongType()))

    selected.append(items(items_column, kinds["items"]).alias(ITEMS))
    columns = {"items": kinds["items"], "weights": False, "exclude": kinds.get("exclude")}
    if weights_column is not None and weights_column in histories.columns:
        kind = histories.schema[weights_column].dataType
        if not (isinstance(kind, ArrayType) and isinstance(kind.elementType, NumericType)):
            raise ValueError(f"`weights_column` {weights_column!r} is {kind.simpleString()}: give an array of numbers, "
                             f"one per item")
        selected.append(histories[weights_column].cast(ArrayType(FloatType())).alias(WEIGHTS))
        columns["weights"] = True
    elif weights_column not in (None, WEIGHTS):
        raise ValueError(f"the histories have columns {histories.columns}, no `weights_column` {weights_column!r}")
    if exclude_column is not None:
        selected.append(items(exclude_column, kinds["exclude"]).alias("exclude"))
    return rec, histories.select(*selected), columns


# ---------------------------------------------------------------------------- on the executors

_LOADED: dict[str, Any] = {}  # the model a Python worker loaded last: (path, meta.json's stamp) -> scorer


def _scorer(path: str) -> Any:
    """``scorer.model_scorer`` of the checkpoint at ``path`` (loaded as predict loads it, on the
    CPU, as one process), kept for this worker's next tasks while the checkpoint is unchanged."""
    from dlrm.recommender import checkpoint
    from dlrm.recommender.item_parallel import ItemParallel
    stat = os.stat(os.path.join(path, "meta.json"))
    key = f"{path}\0{stat.st_mtime_ns}\0{stat.st_size}"
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = checkpoint.load_scorer(path, ItemParallel(), "cpu")[0]
    return _LOADED[key]


def _ids(column: Any, kind: str, rec: Recommender, lookup: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(lengths per row, column numbers per entry (-1: unknown), the entries' rows) of a list column."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(column).fill_null(0).to_numpy().astype(np.int64)
    flat = pc.list_flatten(column)
    if kind == "names":
        position = pc.index_in(flat, value_set=lookup[0]).fill_null(-1).to_numpy().astype(np.int64)
        ids = np.where(position >= 0, lookup[1][np.maximum(position, 0)], -1)
    else:
        ids = flat.fill_null(-1).to_numpy().astype(np.int64)
        ids[(ids < 0) | (ids >= rec.n_input)] = -1
    return lengths, ids, np.repeat(np.arange(lengths.shape[0]), lengths)


def _csr(lengths: np.ndarray, keep: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    """Offsets [B + 1] of the entries kept."""
    counts = lengths if keep is None else np.bincount(rows[keep], minlength=lengths.shape[0])
    offsets = np.zeros(lengths.shape[0] + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    return offsets


def _ranked(batches: Iterator[Any], rec: Recommender, k: int, columns: dict[str, Any], exclude_inputs: bool,
            on_error: str, batch_size: int, threads: int | None) -> Iterator[tuple[Any, Any, Any]]:
    """(the rows of an Arrow batch, values [B, k'], item ids [B, k']) per ``batch_size`` users:
    predict's ``rank`` on their histories, with the model of ``rec``."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import torch
    from pyspark import TaskContext

    from dlrm.recommender.predict import rank

    context = TaskContext.get()
    torch.set_num_threads(threads or (context.cpus() if context is not None else 1))
    score = _scorer(rec.path)
    lookup = None
    if rec.index_names is not None:
        lookup = (pa.array(rec.index_names, pa.string()), np.asarray(rec.index_ids, np.int64))
    for whole in batches:
        for lo in range(0, whole.num_rows, batch_size):
            batch = whole.slice(lo, batch_size)
            lengths, ids, rows = _ids(batch.column(ITEMS), columns["items"], rec, lookup)
            unknown = ids < 0
            if unknown.any() and on_error == "fail":
                first = int(np.argmax(unknown))
                user = batch.column(0)[int(rows[first])].as_py()
                item = pc.list_flatten(batch.column(ITEMS))[first].as_py()
                raise DatasetError(
                    f"user {user!r}: item {item!r} is not one of the {rec.n_input:,} items of the model {rec.path} "
                    f"(not in its features index, or not a column number below {rec.n_input:,}); give the "
                    f"histories of the items it was trained on, or leave unknown items out (`on_error=skip`)")
            keep = ~unknown if unknown.any() else None
            offsets = _csr(lengths, keep, rows)
            indices = ids if keep is None else ids[keep]
            values = None
            if columns["weights"]:
                values = _weights(batch, lengths, rows, ids.shape[0])
                values = None if values is None else values if keep is None else values[keep]
            history = (torch.from_numpy(offsets), torch.from_numpy(indices),
                       None if values is None else torch.from_numpy(values))
            filters = [history] if exclude_inputs else []
            if columns["exclude"] is not None:
                ex_lengths, ex_ids, ex_rows = _ids(batch.column("exclude"), columns["exclude"], rec, lookup)
                known = ex_ids >= 0  # an item the model does not know cannot be recommended anyway
                filters.append((torch.from_numpy(_csr(ex_lengths, known, ex_rows)), torch.from_numpy(ex_ids[known]),
                                None))
            values_k, items_k = rank(score, history, k, filters)
            yield batch, values_k, items_k


def _weights(batch: Any, lengths: np.ndarray, rows: np.ndarray, entries: int) -> np.ndarray | None:
    """The items' values (float32, one per entry), 1.0 in rows whose weights are null; None when
    every row's are (the model then sums its rows unweighted, as for a dataset without values)."""
    import pyarrow.compute as pc

    column = batch.column(WEIGHTS)
    given = column.is_valid().to_numpy(zero_copy_only=False)
    if not given.any():
        return None
    counts = pc.list_value_length(column).fill_null(0).to_numpy().astype(np.int64)
    wrong = given & (counts != lengths)
    if wrong.any():
        r = int(np.argmax(wrong))
        raise DatasetError(f"user {batch.column(0)[r].as_py()!r}: {int(counts[r])} weights for {int(lengths[r])} "
                           f"items; give one weight per item, or none (null)")
    values = np.ones(entries, np.float32)
    values[given[rows]] = pc.list_flatten(column).to_numpy(zero_copy_only=False).astype(np.float32)
    bad = ~np.isfinite(values)  # NaN, inf, a null inside an array, or a double beyond float32
    if bad.any():
        first = int(np.argmax(bad))
        raise DatasetError(f"user {batch.column(0)[int(rows[first])].as_py()!r}: weight {values[first]} of the "
                           f"`weights_column` is not a finite number; give finite weights (ratings), or none (null) "
                           f"for unweighted histories")
    return values
