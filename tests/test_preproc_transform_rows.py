"""The dataset keeps its vocabulary, and raw rows transformed with it are the dataset's rows.

``preproc.transform`` is what batch scoring of raw Criteo rows uses: on the raw lines of a
generated dataset (malformed lines included) it must reproduce every row the local engine
wrote, bit for bit; the saved vocabulary must be the one the reference ranks; the pandas entry
must equal the bytes entry. (That both engines and the reference save the same vocabulary bytes
is checked by tests/test_preproc_engines.py, which compares whole outputs.)
"""

from __future__ import annotations

import gzip
import os

import numpy as np
import pandas as pd
import pytest
from test_preproc_engines import GOOD, MALFORMED, days, job  # noqa: F401 (a fixture)

from dlrm.data.feature_spec import FeatureSpec
from dlrm.engine.errors import DatasetError
from preproc import local_engine
from preproc.layout import split_ranges, terabyte_inputs
from preproc.local_engine import preprocess_local
from preproc.reference import build_vocabularies
from preproc.transform import COLUMNS, transform_columns, transform_lines
from preproc.vocab import (
    VOCABULARY_FILES,
    Vocabulary,
    load_dataset_vocabulary,
    save_dataset_vocabulary,
)

DAYS = [0, 1, 2, 3, 7]  # days 1, 2 and 7 hold two malformed lines each; day 0 and 7 are gzipped


def _lines(path: str) -> list[bytes]:
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        return f.read().split(b"\n")[:-1]


def _split_lines(inputs) -> dict[str, list[bytes]]:
    """The raw lines of each split, in the order the dataset holds their rows."""
    out: dict[str, list[bytes]] = {}
    for f in inputs:
        lines = _lines(f.path)
        for split, a, b in split_ranges(f.rule, len(lines)):
            out.setdefault(split, []).extend(lines[a - 1 : b])
    return out


@pytest.fixture(scope="module")
def dataset(days, tmp_path_factory):  # noqa: F811
    inputs = terabyte_inputs(str(days), DAYS)
    out = tmp_path_factory.mktemp("transform") / "local"
    preprocess_local(job(inputs, out, on_error="skip"), workers=1, chunk_bytes=16_384)
    return inputs, out


def test_transform_lines_reproduces_every_row_of_the_dataset(dataset):
    inputs, out = dataset
    spec = FeatureSpec.from_yaml(str(out))
    vocab = load_dataset_vocabulary(str(out))
    assert vocab.cardinalities == list(spec.cardinalities)
    for split, lines in _split_lines(inputs).items():
        data = b"".join(x + b"\n" for x in lines)
        rows = transform_lines(data, vocab, on_error="skip")
        chunked = transform_lines(data, vocab, on_error="skip", chunk_bytes=5000)  # lines numbered across chunks
        assert all((a == b).all() for a, b in zip(rows[:4], chunked[:4])) and rows.malformed == chunked.malformed
        n = spec.metadata["preprocessing"]["rows"][split]
        assert len(rows.label) == n == len(lines) - len(rows.malformed)
        assert rows.label.dtype == np.uint8 and rows.numerical.dtype == np.float16 and rows.categorical.dtype == np.int64
        assert (rows.label == np.fromfile(out / split / "label.bin", dtype=np.uint8)).all()
        stored = np.fromfile(out / split / "numerical.bin", dtype=np.uint16).reshape(n, 13)
        assert (rows.numerical.view(np.uint16) == stored).all()  # bit for bit
        for j in range(26):
            ids = np.fromfile(out / split / f"cat_{j}.bin", dtype=spec.categorical_dtypes[j])
            assert (rows.categorical[:, j] == ids).all(), (split, j)
        # The left-out lines are exactly the malformed ones, with the engines' reasons.
        left_out = sorted(set(range(len(lines))) - set(rows.row.tolist()))
        assert left_out == [r for r, _, _ in rows.malformed]
        if split == "train":  # the engine counted the same reasons
            reasons = [reason for _, reason, _ in rows.malformed]
            assert {r: reasons.count(r) for r in reasons} == {
                r: v["count"] for r, v in spec.metadata["skipped_lines"].items()} == {"field_count": 5, "numerical": 1}


def test_the_saved_vocabulary_is_the_reference_ranking(dataset):
    inputs, out = dataset
    vocab = load_dataset_vocabulary(str(out))
    thresholds = job(inputs, out).thresholds
    expected = build_vocabularies([f.path for f in inputs if f.rule == "train"], thresholds, on_error="skip")
    assert vocab.sizes == [len(v) for v in expected]
    assert sorted(os.listdir(out / "vocabulary")) == sorted(VOCABULARY_FILES)
    for j, column in enumerate(expected):
        values = np.array([int(h, 16) for h in column], dtype=np.uint32)
        hashes = np.zeros((len(values), 26), dtype=np.uint32)
        hashes[:, j] = values
        present = np.zeros(hashes.shape, dtype=bool)
        present[:, j] = True
        assert vocab.lookup(hashes, present)[:, j].tolist() == list(column.values())


def test_pandas_entry_equals_the_bytes_entry(dataset):
    inputs, out = dataset
    vocab = load_dataset_vocabulary(str(out))
    data = b"".join(x + b"\n" for x in _split_lines(inputs)["validation"])
    expected = transform_lines(data, vocab)
    fields = [line.split("\t") for line in data.decode().splitlines()]
    text = pd.DataFrame(fields, columns=COLUMNS)  # '' for missing
    with_none = text.replace("", None)  # None for missing
    with_nan = text.replace("", np.nan)
    with_ints = text.assign(label=text["label"].astype(np.int64))
    for frame in (text, with_none, with_nan, with_ints):
        rows = transform_columns(frame, vocab)
        for a, b in zip(rows[:4], expected[:4]):
            assert a.dtype == b.dtype and (a.view(np.uint8) == b.view(np.uint8)).all()
    bad = text.copy()
    bad.loc[3, "C3"] = "zzzzzzzz"
    with pytest.raises(DatasetError, match=r"^DataFrame, row 3: C3 must be empty or 8 hex digits.*on_error='skip'"):
        transform_columns(bad, vocab)
    skipped = transform_columns(bad, vocab, on_error="skip")
    assert 3 not in skipped.row and [r for r, _, _ in skipped.malformed] == [3]
    assert (skipped.categorical == np.delete(expected.categorical, 3, axis=0)).all()
    bad.loc[5, "I2"] = "1\n2"
    with pytest.raises(DatasetError, match=r"DataFrame, row 5: I2 holds a newline"):
        transform_columns(bad, vocab, on_error="skip")
    with pytest.raises(DatasetError, match=r"column 'I1' has dtype float64"):
        transform_columns(text.assign(I1=1.5), vocab)
    with pytest.raises(DatasetError, match=r"lacks the column\(s\) \['C26'\]"):
        transform_columns(text.drop(columns="C26"), vocab)


def test_a_malformed_line_is_named_like_the_engines_do():
    vocab = Vocabulary.build([np.array([0xAAAAAAAA], dtype=np.uint32)] + [np.zeros(0, np.uint32)] * 25)
    for case, (bad, reason, words) in MALFORMED.items():
        data = (GOOD + "\n" + bad + "\n" + GOOD).encode()  # the last line without a newline
        with pytest.raises(DatasetError) as e:
            transform_lines(data, vocab, source="day_23", first_line=10)
        assert str(e.value).startswith("day_23, line 11: ") and words in str(e.value), case
        assert "pass on_error='skip'" in str(e.value) and "--on_error" not in str(e.value)
        rows = transform_lines(data, vocab, on_error="skip")
        assert rows.row.tolist() == [0, 2] and rows.malformed[0][:2] == (1, reason), case
        assert rows.categorical[:, 0].tolist() == [1, 1] and rows.label.tolist() == [1, 1]
    empty = transform_lines(b"", vocab)
    assert empty.numerical.shape == (0, 13) and empty.categorical.shape == (0, 26)
    with pytest.raises(ValueError, match="on_error must be 'fail' or 'skip'"):
        transform_lines(b"", vocab, on_error="ignore")


def test_a_dataset_without_vocabulary_names_the_fix_and_a_kept_work_dir_makes_it_cheap(days, tmp_path, monkeypatch):  # noqa: F811
    inputs = terabyte_inputs(str(days), [3])
    out = tmp_path / "out"
    run = lambda: preprocess_local(job(inputs, out, on_error="skip", keep_work_dir=True), workers=1)
    run()
    good = {n: (out / "vocabulary" / n).read_bytes() for n in VOCABULARY_FILES}
    for name in VOCABULARY_FILES:
        os.unlink(out / "vocabulary" / name)  # as a dataset made before the vocabulary was kept
    with pytest.raises(DatasetError, match=rf"{out / 'vocabulary'}: no vocabulary .*Re-run preprocessing.*--keep_work_dir"):
        load_dataset_vocabulary(str(out))
    calls = []
    real = local_engine.transform_task
    monkeypatch.setattr(local_engine, "transform_task", lambda *args: calls.append(args[2]) or real(*args))
    assert run().resumed and calls == []  # only the final write again
    assert {n: (out / "vocabulary" / n).read_bytes() for n in VOCABULARY_FILES} == good
    load_dataset_vocabulary(str(out))

    # A failed replacement leaves the good vocabulary in place and no temporary directory.
    with pytest.raises(FileNotFoundError):
        save_dataset_vocabulary(str(out), str(tmp_path / "nowhere"))
    assert {n: (out / "vocabulary" / n).read_bytes() for n in VOCABULARY_FILES} == good
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    # A vocabulary that is not the dataset's is refused.
    save_dataset_vocabulary(str(out), Vocabulary.build([np.zeros(0, np.uint32)] * 26))
    with pytest.raises(DatasetError, match="does not belong to the dataset"):
        load_dataset_vocabulary(str(out))
