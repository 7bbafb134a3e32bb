"""Batch scoring in Spark: click probabilities from an exported model, as a DataFrame column.

Rows come in one of two forms, both flat columns that Arrow hands to pandas without copies:

- prepared rows: ``label`` (optional), ``num_0 .. num_{N-1}`` (the numerical features as
  preprocessing wrote them: log-transformed) and ``cat_0 .. cat_{F-1}`` (ids);
  ``read_dataset`` reads a split of a split-binary dataset in that form;
- raw Criteo rows (TSV lines, or the 40 fields as columns ``label, I1..I13, C1..C26``):
  ``prepare_raw_rows`` turns them into prepared rows with preprocessing's own transform and the vocabulary the
  dataset was made with (``<dataset>/vocabulary``), so that a row scores as it trained.

``score`` runs the ONNX export (``python -m dlrm.scripts.export``) with ONNX Runtime in
``mapInPandas`` on the executors, one session per task, and appends ``click_probability``.
The model file and the dataset directory must be on storage every executor reaches.
``write_parquet`` writes the scores all or nothing, and ``task_error`` recovers the
``DatasetError`` (a malformed line, an id out of range) that failed a task.
"""

from __future__ import annotations

import os
import re
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np

from dlrm.data.errors import DatasetError
from dlrm.data.outputs import OutputKind, holds_only

LABEL = "label"
NUMERICAL_PREFIX = "num_"
CATEGORICAL_PREFIX = "cat_"
OUTPUT = "click_probability"
# Where a raw line comes from (read_raw_lines): its file, and the first byte of the file split read with it.
FILE_COLUMN = "_file"
SPLIT_START_COLUMN = "_split_start"


def prepared_columns(num_numerical: int, num_categorical: int) -> tuple[list[str], list[str]]:
    """The numerical and categorical column names of prepared rows."""
    return ([f"{NUMERICAL_PREFIX}{i}" for i in range(num_numerical)],
            [f"{CATEGORICAL_PREFIX}{i}" for i in range(num_categorical)])


def _prepared_schema(num_numerical: int, num_categorical: int, label: bool = True) -> str:
    numerical, categorical = prepared_columns(num_numerical, num_categorical)
    fields = ([f"{LABEL} int"] if label else []) + [f"{n} float" for n in numerical] + [f"{c} long" for c in categorical]
    return ", ".join(fields)


def read_dataset(spark: Any, dataset_dir: str, split: str, rows_per_partition: int = 1 << 18,
                 hash_indices: bool = False) -> Any:
    """Split ``split`` of the split-binary dataset at ``dataset_dir`` as a DataFrame of prepared
    rows, in file order, read by the executors (``rows_per_partition`` rows a task). An id
    outside its feature's cardinality fails its task, unless ``hash_indices`` (for a model that
    maps every id, ``model_maps_any_id``)."""
    from dlrm.data.feature_spec import FeatureSpec
    from dlrm.data.split_binary import SplitBinaryReader

    spec = FeatureSpec.from_yaml(dataset_dir)
    if any(spec.is_multi_hot(i) for i in range(spec.num_categorical)):
        raise ValueError(f"{dataset_dir}: multi-hot features are not scored in Spark yet (one-hot datasets only)")
    with SplitBinaryReader(spec, split, rows_per_partition) as reader:  # checks the files on the driver
        partitions = len(reader)
    numerical, categorical = prepared_columns(spec.num_numerical, spec.num_categorical)

    def read(batches: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        with SplitBinaryReader(FeatureSpec.from_yaml(dataset_dir), split, rows_per_partition,
                               check_ids=not hash_indices) as part:
            for frame in batches:
                for index in frame["id"]:
                    batch = part.read_batch(int(index))
                    columns = {LABEL: batch.label.numpy().reshape(-1).astype(np.int32)}
                    columns.update(zip(numerical, batch.numerical.numpy().astype(np.float32).T))
                    columns.update(zip(categorical, batch.categorical.numpy().astype(np.int64).T))
                    yield pd.DataFrame(columns)

    return spark.range(0, partitions, numPartitions=max(1, partitions)).mapInPandas(
        read, _prepared_schema(spec.num_numerical, spec.num_categorical))


def read_raw_lines(spark: Any, path: str) -> Any:
    """The lines of raw Criteo TSV files (a path or glob) for ``prepare_raw_rows``, or of any text
    files, with where each comes from (``line_of``), so that a malformed line is named by its file
    and line number."""
    lines = spark.read.option("lineSep", "\n").text(path)
    return lines.select("value", lines["_metadata.file_path"].alias(FILE_COLUMN),
                        lines["_metadata.file_block_start"].alias(SPLIT_START_COLUMN))


def prepare_raw_rows(raw: Any, dataset_dir: str, line_column: str = "value", on_error: str = "fail") -> Any:
    """Raw Criteo rows as prepared rows, with the transform and vocabulary of preprocessing.

    ``raw`` holds either TSV lines, one string column ``line_column`` (what ``spark.read.text``
    gives; ``read_raw_lines`` adds where each line is from), or the 40 fields as columns
    ``label, I1..I13, C1..C26`` (e.g. a Parquet table; any column type, taken as text, null for
    a missing value). A malformed row fails its task with a ``DatasetError`` naming the row
    (its file and line with ``read_raw_lines``) and the reason; ``on_error='skip'`` leaves it
    out instead."""
    from preproc.report import malformed_error
    from preproc.transform import COLUMNS, dataset_numerical_rounding, transform_columns, transform_lines
    from preproc.vocab import load_dataset_vocabulary

    if on_error not in ("fail", "skip"):
        raise ValueError(f"`on_error` must be 'fail' or 'skip', got {on_error!r}")
    load_dataset_vocabulary(dataset_dir)  # a dataset without one fails here, on the driver
    rounding = dataset_numerical_rounding(dataset_dir)
    numerical, categorical = prepared_columns(13, 26)
    fields = all(c in raw.columns for c in COLUMNS)
    if not fields and line_column not in raw.columns:
        raise ValueError(f"the raw rows have columns {raw.columns}: give TSV lines in column {line_column!r} "
                         f"(`line_column`) or the fields as columns {COLUMNS[0]}, I1..I13, C1..C26")
    located = not fields and FILE_COLUMN in raw.columns and SPLIT_START_COLUMN in raw.columns
    selected = (raw.select(*[raw[c].cast("string") for c in COLUMNS]) if fields
                else raw.select(line_column, FILE_COLUMN, SPLIT_START_COLUMN) if located else raw.select(line_column))

    def transform(batches: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        vocabulary = load_dataset_vocabulary(dataset_dir)
        seen: Counter = Counter()  # (file, split start) -> its lines in earlier batches
        for frame in batches:
            if fields:
                rows = transform_columns(frame, vocabulary, on_error, numerical_rounding=rounding)
            else:
                text = "".join(line + "\n" for line in frame[line_column])
                rows = transform_lines(text.encode(), vocabulary, on_error="skip", numerical_rounding=rounding)
                if rows.malformed and on_error == "fail":
                    index, _, detail = rows.malformed[0]
                    where, line = line_of(frame, index, seen) if located else (f"{line_column} column", index + 1)
                    raise malformed_error(where, line, detail)
                if located:
                    seen.update(zip(frame[FILE_COLUMN], frame[SPLIT_START_COLUMN]))
            columns = {LABEL: rows.label.astype(np.int32)}
            columns.update(zip(numerical, rows.numerical.astype(np.float32).T))
            columns.update(zip(categorical, rows.categorical.T))
            yield pd.DataFrame(columns)

    return selected.mapInPandas(transform, _prepared_schema(13, 26))


def line_of(frame: Any, index: int, seen: Counter) -> tuple[str, int]:
    """The file and line number (from 1) of row ``index`` of a batch of ``read_raw_lines``, given
    ``seen``: the lines of each (file, split start) in the task's earlier batches.

    Spark reads a file split from the first line that starts after the split's first byte
    (a line that starts there belongs to the split before), so the lines before a split
    starting at byte s > 0 are the newlines in bytes [0, s), plus one; they are counted only
    for a local file (elsewhere the line is named within its split)."""
    file, start = frame[FILE_COLUMN].iat[index], int(frame[SPLIT_START_COLUMN].iat[index])
    earlier = frame.iloc[:index]
    same_split = (earlier[FILE_COLUMN] == file) & (earlier[SPLIT_START_COLUMN] == start)
    line = seen[(file, start)] + int(same_split.sum()) + 1  # within the split
    url = urlparse(file)
    if url.scheme not in ("", "file"):
        return (f"{file} (its split from byte {start})", line) if start else (file, line)
    path = unquote(url.path)
    if start:
        line += 1
        with open(path, "rb") as f:
            while f.tell() < start and (chunk := f.read(min(1 << 24, start - f.tell()))):
                line += chunk.count(b"\n")
    return path, line


def _columns(names: Sequence[str], prefix: str) -> list[str]:
    found = sorted((int(n[len(prefix):]), n) for n in names if n.startswith(prefix) and n[len(prefix):].isdigit())
    if [i for i, _ in found] != list(range(len(found))):
        raise ValueError(f"columns {[n for _, n in found]}: expected {prefix}0 .. {prefix}<n-1>, each once")
    return [n for _, n in found]


def _load_model(model_path: str) -> Any:
    import onnxruntime as ort

    if not os.path.isfile(model_path):
        raise ValueError(f"{model_path}: no such file; give an ONNX model (as dlrm.inference.export writes)")
    try:
        return ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own classes: InvalidProtobuf, InvalidGraph, ...
        raise ValueError(f"{model_path}: not an ONNX model ONNX Runtime can load ({e}); give an ONNX model "
                         "(as dlrm.inference.export writes)") from None


def model_inputs(model_path: str) -> dict[str, list]:
    """The inputs (name -> shape) of the ONNX model at ``model_path``, loaded on the driver, so
    that a missing or unloadable file is a ``ValueError`` here rather than a failure of every task."""
    return {i.name: i.shape for i in _load_model(model_path).get_inputs()}


def model_maps_any_id(model_path: str) -> bool:
    """Whether the ONNX model maps any id into its tables (exported from a run with
    ``hash_indices``), tried on one row of huge ids; other models refuse them."""
    session = _load_model(model_path)
    width = {i.name: (i.shape[1], np.float16 if i.type == "tensor(float16)" else np.float32)
             for i in session.get_inputs()}
    (n, numerical_type), (f, _) = width["numerical"], width["categorical"]
    try:
        session.run(None, {"numerical": np.zeros((1, n), numerical_type),
                           "categorical": np.full((1, f), 1 << 40, np.int64)})
    except Exception:  # onnxruntime's own classes: an index out of a table's bounds
        return False
    return True


def score(rows: Any, model_path: str, output_column: str = OUTPUT, threads: int | None = None) -> Any:
    """``rows`` (prepared rows; other columns pass through) with ``output_column``, the click
    probability of the ONNX model at ``model_path``. ONNX Runtime uses ``threads`` threads a
    task (default: ``spark.task.cpus``)."""
    import onnxruntime as ort

    numerical = _columns(rows.columns, NUMERICAL_PREFIX)
    categorical = _columns(rows.columns, CATEGORICAL_PREFIX)
    inputs = model_inputs(model_path)
    expected = {"numerical": len(numerical), "categorical": len(categorical)}
    for name, width in expected.items():
        if name not in inputs or inputs[name][1] != width:
            raise ValueError(f"{model_path} takes {inputs}, but the rows have {len(numerical)} numerical and "
                             f"{len(categorical)} categorical columns")
    if output_column in rows.columns:
        raise ValueError(f"the rows already have a column {output_column!r}: choose another `output_column`")

    def run(batches: Iterator[Any]) -> Iterator[Any]:
        from pyspark import TaskContext

        options = ort.SessionOptions()
        context = TaskContext.get()
        options.intra_op_num_threads = threads or (context.cpus() if context is not None else 1)
        session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
        for frame in batches:
            if len(frame) == 0:
                continue
            feed = {"numerical": frame[numerical].to_numpy(np.float32),
                    "categorical": frame[categorical].to_numpy(np.int64)}
            (probability,) = session.run(None, feed)
            yield frame.assign(**{output_column: probability.reshape(-1).astype(np.float32)})

    from pyspark.sql.types import FloatType, StructField, StructType

    schema = StructType([*rows.schema.fields, StructField(output_column, FloatType())])  # add() would change rows'
    return rows.mapInPandas(run, schema)


def is_parquet_output(path: str) -> bool:
    """Whether folder ``path`` holds nothing but what a Spark job writes as a Parquet directory:
    ``part-*`` files, ``_SUCCESS``, the commit protocol's markers and Hadoop's ``.crc`` files."""
    return holds_only(path, ["part-*", "_SUCCESS", "_committed_*", "_started_*", ".*.crc"], required=["_SUCCESS"])


PARQUET_OUTPUT = OutputKind("Parquet output of a Spark job", directory=True, recognise=is_parquet_output)


def write_parquet(frame: Any, path: str) -> None:
    """Writes ``frame`` as the Parquet directory ``path``, replacing one there, all or nothing:
    Spark writes a hidden sibling directory, which is renamed into place once complete, so a
    failed write leaves ``path`` as it was. Any Hadoop filesystem (the JVM's API does the renames)."""
    spark = frame.sparkSession
    hadoop = spark.sparkContext._jvm.org.apache.hadoop.fs
    target = hadoop.Path(path)
    fs = target.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    target = fs.makeQualified(target)
    tag = uuid.uuid4().hex[:12]
    staged = hadoop.Path(target.getParent(), f".{target.getName()}.{tag}.tmp")  # a leading "." hides it
    old = hadoop.Path(target.getParent(), f".{target.getName()}.{tag}.old")
    try:
        frame.write.parquet(staged.toString())
        replaced = fs.exists(target) and fs.rename(target, old)
        if not fs.rename(staged, target):
            if replaced:
                fs.rename(old, target)
            raise OSError(f"{path}: could not move the written scores there from {staged.toString()}")
        if replaced:
            fs.delete(old, True)
    finally:
        if fs.exists(staged):
            fs.delete(staged, True)


def task_error(error: BaseException, classes: Sequence[type[Exception]] = (DatasetError,)) -> Exception | None:
    """The error of one of ``classes`` (by default ``DatasetError``: a malformed row, an id out of
    range) that failed a Spark task, from the exception the driver got, or None. Spark sends a
    task's Python traceback as text; the error's message, on its last line, names the file, the
    row and the fix."""
    for cls in classes:
        name = re.escape(f"{cls.__module__}.{cls.__qualname__}")
        match = re.search(rf"^{name}: (.+)$", str(error), re.MULTILINE)
        if match:
            return cls(match.group(1))
    return None
