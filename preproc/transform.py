"""Raw Criteo rows -> the arrays a preprocessed dataset holds for them: for scoring raw rows.

``transform_lines`` runs the engines' own transform (``tasks.transform_chunk``: the numpy
parser, the float16 log table, the vocabulary lookup) on lines in the input format of
docs/preprocessing.md, so a row gets exactly the label, numericals and ids a dataset made with
that vocabulary would hold for it. ``transform_columns`` does the same for a pandas DataFrame
of the 40 fields as text. The vocabulary comes from the dataset::

    from preproc.transform import transform_lines
    from preproc.vocab import load_dataset_vocabulary

    vocab = load_dataset_vocabulary("/data/criteo_fl15")
    rows = transform_lines(open("day_23", "rb").read(), vocab, source="day_23")
    rows.label, rows.numerical, rows.categorical  # uint8 [n], float16 [n, 13], int64 [n, 26]

The frequency threshold needs no setting here: the vocabulary holds only the kept values (ids
1..K), and everything else (missing, rare, or never counted) maps to 0, as in the dataset. The
numerical rounding is the dataset's (``dataset_numerical_rounding``; ``nvidia`` by default).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from dlrm.engine.errors import DatasetError
from preproc.numeric import DEFAULT_ROUNDING, LogTable, build_log_table, check_rounding
from preproc.parse import NUM_CATEGORICAL, NUM_NUMERICAL
from preproc.report import classify_bad, malformed_error
from preproc.tasks import transform_chunk
from preproc.textio import DEFAULT_CHUNK_BYTES
from preproc.vocab import Vocabulary

COLUMNS = ["label"] + [f"I{k}" for k in range(1, NUM_NUMERICAL + 1)] + [f"C{k}" for k in range(1, NUM_CATEGORICAL + 1)]


class TransformedRows(NamedTuple):
    """The transformed rows, in input order (the malformed ones left out in skip mode)."""

    label: np.ndarray  # uint8 [n]: 0 or 1, as label.bin
    numerical: np.ndarray  # float16 [n, 13], as numerical.bin
    categorical: np.ndarray  # int64 [n, 26]: the ids of cat_<i>.bin (there in the narrowest dtype)
    row: np.ndarray  # int64 [n]: each row's index among the input's rows (lines or frame rows), from 0
    malformed: list[tuple[int, str, str]]  # skip mode: (row index, reason, detail) of the rows left out


@functools.lru_cache(maxsize=2)
def log_table(rounding: str = DEFAULT_ROUNDING) -> LogTable:
    """The float16 log table of the engines (built once per process and rounding, about 0.1 s)."""
    return build_log_table(rounding)


def dataset_numerical_rounding(dataset_dir: str) -> str:
    """How a preprocessed dataset rounded its numericals (``metadata.preprocessing.numerical_rounding``
    of its spec; ``direct`` for datasets made before the setting was recorded)."""
    from dlrm.data.feature_spec import FeatureSpec

    pre = FeatureSpec.from_yaml(dataset_dir).metadata.get("preprocessing") or {}
    return check_rounding(pre.get("numerical_rounding", "direct"))


def _check_on_error(on_error: str) -> None:
    if on_error not in ("fail", "skip"):
        raise ValueError(f"on_error must be 'fail' or 'skip', got {on_error!r}")


def _transform(data: bytes, vocabulary: Vocabulary, chunk_bytes: int,
               rounding: str) -> tuple[TransformedRows, list[tuple[int, str, str]]]:
    """Every row of ``data`` (lines numbered from 1), in chunks of whole lines of about
    ``chunk_bytes`` (the engines' memory per chunk); malformed rows by (line, reason, detail)."""
    if data and not data.endswith(b"\n"):
        data += b"\n"  # a last line without a newline is still a line, as in the engines
    labels, numericals, ids, lines, bad = [], [], [], [], []
    start, first_line = 0, 1
    while start < len(data):
        end = data.rfind(b"\n", start, start + chunk_bytes) + 1
        if end <= start:  # one line longer than a chunk
            end = data.index(b"\n", start) + 1
        chunk, numerical, cat = transform_chunk(data[start:end], first_line, log_table(rounding), vocabulary)
        labels.append(chunk.rows.label)
        numericals.append(numerical)
        ids.append(cat)
        lines.append(chunk.rows.line)
        bad += classify_bad(chunk.bad)
        start, first_line = end, first_line + chunk.lines
    if not labels:
        rows = TransformedRows(np.zeros(0, np.uint8), np.zeros((0, NUM_NUMERICAL), np.float16),
                               np.zeros((0, NUM_CATEGORICAL), np.int64), np.zeros(0, np.int64), [])
        return rows, bad
    rows = TransformedRows(np.concatenate(labels), np.concatenate(numericals), np.concatenate(ids),
                           np.concatenate(lines) - 1, [])
    return rows, bad


def transform_lines(data: bytes, vocabulary: Vocabulary, on_error: str = "fail", source: str = "input",
                    first_line: int = 1, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                    numerical_rounding: str = DEFAULT_ROUNDING) -> TransformedRows:
    """Criteo TSV lines (``label \\t I1..I13 \\t C1..C26``, each ending in ``\\n``; a last line may
    lack it) -> what a dataset made with ``vocabulary`` holds for them: labels, float16
    numericals and int64 categorical ids, bit for bit as the engines write them.

    Lines follow the input rules of the engines exactly (docs/preprocessing.md): 40 fields,
    label ``0``/``1``, counts empty or an optional ``-`` and digits, categorical values empty or
    8 hex digits; a ``\\r`` before the ``\\n`` makes a line malformed. A malformed line is an
    error by default (``on_error='fail'``): ``DatasetError`` with the engines' message,
    ``<source>, line <n>: <reason>`` (lines counted from ``first_line``), for the first one.
    Scoring usually needs one result per input row, so failing is the default; with
    ``on_error='skip'`` malformed lines are left out, ``row`` says which input rows the results
    are (line ``first_line + row``), and ``malformed`` lists the others with their reasons.
    ``numerical_rounding`` must be the dataset's (``dataset_numerical_rounding``).
    """
    _check_on_error(on_error)
    rows, bad = _transform(bytes(data), vocabulary, chunk_bytes, check_rounding(numerical_rounding))
    if bad and on_error == "fail":
        line, _, detail = bad[0]
        raise malformed_error(source, first_line + line - 1, detail, skip="pass on_error='skip'")
    return rows._replace(malformed=[(line - 1, reason, detail) for line, reason, detail in bad])


def _text_column(frame, name: str):
    """Column ``name`` of ``frame`` as an Arrow large_string array (nulls for missing)."""
    import pandas as pd
    import pyarrow as pa

    column = frame[name]
    if pd.api.types.is_integer_dtype(column.dtype) and not pd.api.types.is_bool_dtype(column.dtype):
        return pa.array(column, from_pandas=True).cast(pa.large_string())
    if not (pd.api.types.is_object_dtype(column.dtype) or pd.api.types.is_string_dtype(column.dtype)):
        raise DatasetError(
            f"column {name!r} has dtype {column.dtype}; pass the Criteo fields as text (str, with '' or None "
            f"for a missing value), e.g. read the file with dtype=str and keep_default_na=False"
        )
    try:
        array = pa.array(column, from_pandas=True, type=pa.large_string())
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise DatasetError(f"column {name!r} holds values that are not text (str, '' or None): {e}") from None
    return array


def transform_columns(frame, vocabulary: Vocabulary, on_error: str = "fail",
                      numerical_rounding: str = DEFAULT_ROUNDING) -> TransformedRows:
    """``transform_lines`` for a pandas DataFrame whose columns ``label, I1..I13, C1..C26`` hold
    the Criteo fields as text (``str``; ``''``, ``None`` or NaN for a missing value; integer
    columns are accepted too). The fields are joined into TSV lines and transformed, so every
    rule and result is that of ``transform_lines``; ``row`` holds positions in the frame (use
    ``frame.iloc[rows.row]``), and an error names the row by that position: ``DataFrame, row <i>:
    <reason>``. A value holding a newline is an error in either mode (it would split the row).
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    _check_on_error(on_error)
    missing = [c for c in COLUMNS if c not in frame.columns]
    if missing:
        raise DatasetError(f"the DataFrame lacks the column(s) {missing}; it needs {COLUMNS[0]}, I1..I13 and C1..C26")
    n = len(frame)
    check_rounding(numerical_rounding)
    if n == 0:
        return transform_lines(b"", vocabulary, on_error)
    texts = [_text_column(frame, c) for c in COLUMNS]
    empty, newline, tab = (pa.scalar(x, pa.large_string()) for x in ("", "\n", "\t"))
    last = pc.binary_join_element_wise(texts[-1], empty, newline, null_handling="replace", null_replacement="")  # C26 + "\n"
    joined = pc.binary_join_element_wise(*texts[:-1], last, tab, null_handling="replace", null_replacement="")
    joined = joined.combine_chunks() if isinstance(joined, pa.ChunkedArray) else joined
    offsets = np.frombuffer(joined.buffers()[1], dtype=np.int64)[joined.offset : joined.offset + n + 1]
    data = memoryview(joined.buffers()[2])[int(offsets[0]) : int(offsets[-1])].tobytes()
    if data.count(b"\n") != n:  # a value holding a newline would split its row in two
        hits = [pc.match_substring(t, "\n").fill_null(False).to_numpy(zero_copy_only=False) for t in texts]
        pos = int(np.flatnonzero(np.any(hits, axis=0))[0])
        name = COLUMNS[next(k for k, hit in enumerate(hits) if hit[pos])]
        raise DatasetError(f"DataFrame, row {pos}: {name} holds a newline; fix or drop the row (transform_columns "
                           f"joins the fields into lines, which a newline would split)")
    rows, bad = _transform(data, vocabulary, DEFAULT_CHUNK_BYTES, numerical_rounding)
    if bad and on_error == "fail":
        line, _, detail = bad[0]
        raise malformed_error("DataFrame", line - 1, detail, skip="pass on_error='skip'", what="row")
    return rows._replace(malformed=[(line - 1, reason, detail) for line, reason, detail in bad])
