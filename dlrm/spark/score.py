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
``dlrm.spark.job_io`` reads raw lines with where each came from, writes the scores all or
nothing (``write_parquet``) and recovers the ``DatasetError`` that failed a task (``task_error``).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from dlrm.spark.job_io import FILE_COLUMN, SPLIT_START_COLUMN, line_of

LABEL = "label"
NUMERICAL_PREFIX = "num_"
CATEGORICAL_PREFIX = "cat_"
OUTPUT = "click_probability"


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


