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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

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


def read_dataset(spark: Any, dataset_dir: str, split: str, rows_per_partition: int = 1 << 18) -> Any:
    """Split ``split`` of the split-binary dataset at ``dataset_dir`` as a DataFrame of prepared
    rows, in file order, read by the executors (``rows_per_partition`` rows a task)."""
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

        with SplitBinaryReader(FeatureSpec.from_yaml(dataset_dir), split, rows_per_partition) as part:
            for frame in batches:
                for index in frame["id"]:
                    batch = part.read_batch(int(index))
                    columns = {LABEL: batch.label.numpy().reshape(-1).astype(np.int32)}
                    columns.update(zip(numerical, batch.numerical.numpy().astype(np.float32).T))
                    columns.update(zip(categorical, batch.categorical.numpy().astype(np.int64).T))
                    yield pd.DataFrame(columns)

    return spark.range(0, partitions, numPartitions=max(1, partitions)).mapInPandas(
        read, _prepared_schema(spec.num_numerical, spec.num_categorical))


def prepare_raw_rows(raw: Any, dataset_dir: str, line_column: str = "value") -> Any:
    """Raw Criteo rows as prepared rows, with the transform and vocabulary of preprocessing.

    ``raw`` holds either TSV lines, one string column ``line_column`` (what ``spark.read.text``
    gives), or the 40 fields as columns ``label, I1..I13, C1..C26`` (e.g. a Parquet table; any
    column type, taken as text, null for a missing value). A malformed row fails its task with
    the row and the reason."""
    from preproc.transform import COLUMNS, transform_columns, transform_lines
    from preproc.vocab import load_dataset_vocabulary

    load_dataset_vocabulary(dataset_dir)  # a dataset without one fails here, on the driver
    numerical, categorical = prepared_columns(13, 26)
    fields = all(c in raw.columns for c in COLUMNS)
    if not fields and line_column not in raw.columns:
        raise ValueError(f"the raw rows have columns {raw.columns}: give TSV lines in column {line_column!r} "
                         f"(`line_column`) or the fields as columns {COLUMNS[0]}, I1..I13, C1..C26")
    selected = raw.select(*[raw[c].cast("string") for c in COLUMNS]) if fields else raw.select(line_column)

    def transform(batches: Iterator[Any]) -> Iterator[Any]:
        import pandas as pd

        vocabulary = load_dataset_vocabulary(dataset_dir)
        for frame in batches:
            if fields:
                rows = transform_columns(frame, vocabulary)
            else:
                text = "".join(line + "\n" for line in frame[line_column])
                rows = transform_lines(text.encode(), vocabulary, source=f"{line_column} column")
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


def score(rows: Any, model_path: str, output_column: str = OUTPUT, threads: int | None = None) -> Any:
    """``rows`` (prepared rows; other columns pass through) with ``output_column``, the click
    probability of the ONNX model at ``model_path``. ONNX Runtime uses ``threads`` threads a
    task (default: ``spark.task.cpus``)."""
    import onnxruntime as ort

    numerical = _columns(rows.columns, NUMERICAL_PREFIX)
    categorical = _columns(rows.columns, CATEGORICAL_PREFIX)
    inputs = {i.name: i.shape for i in ort.InferenceSession(model_path, providers=["CPUExecutionProvider"]).get_inputs()}
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
