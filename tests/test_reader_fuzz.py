"""Randomized inputs for every text reader: whatever a file holds (random bytes, a valid file
mutated, huge numbers, odd Unicode, deep nesting), the reader either parses it or raises its
user-error class with a one-line message, which the command lines print as one line, exit 2
(``dlrm.scripts.cli.DEFAULT_ERRORS``; recommender_train words NetworkConfigError the same way).
Any other exception is a bug. The Criteo parser never raises: every line is parsed or set aside,
exactly as the reference parser decides.

Derandomized (a fixed seed per test, no example database), so a run in CI is the same as here;
FUZZ_EXAMPLES=5000 searches longer, FUZZ_RANDOM=1 with other seeds each run.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from dlrm.data.csv_source import CsvSource
from dlrm.data.feature_spec import FeatureSpec
from dlrm.engine.errors import DatasetError
from dlrm.recommender.dsstne_text import NameIndex, parse_text
from dlrm.recommender.network import NetworkConfigError, parse_network
from dlrm.recommender.user_histories import movielens_to_text
from preproc.numeric import build_log_table
from preproc.parse import parse_chunk
from preproc.reference import _Malformed, log_transform, parse_line

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 200)), deadline=None,
                derandomize=not os.environ.get("FUZZ_RANDOM"), database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz")


def write(directory, name: str, data: bytes) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def parsed_or_refused(call, errors: type[BaseException] | tuple[type[BaseException], ...]):
    """Runs ``call()``; a refusal must be of ``errors`` with a one-line message (anything else
    propagates: hypothesis reports the input)."""
    try:
        result = call()
    except errors as e:
        message = str(e)
        assert message and "\n" not in message and "\r" not in message, repr(message[:500])
        event("refused")
        return None
    event("parsed")
    return result


# ---------------------------------------------------------------------------- inputs


# Pieces that break parsers: separators, numbers too large for any type, not numbers, odd
# Unicode (a combining mark, a right-to-left mark, a line separator, a surrogate-free emoji,
# NUL, BOM), YAML and JSON syntax, and nesting.
ODD = ["\t", "\n", "\r", "\r\n", ":", ",", " ", "", "-", "+", ".", "e", "0", "1", "-1", "nan", "inf", "-inf",
       "1e999", "9" * 30, "9" * 5000, "0x1f", "\x00", "\ufeff", "\u0301", "\u200f", "\u2028", "\u00e9", "\U0001f600",
       "\x85", "\x1b", "{", "}", "[", "]", '"', "'", "&a", "*a", "!!python/object", "<<", "? ", "- ", "#", "%",
       "\\", "null", "true", "[" * 200, "{" * 200, "]" * 200]


def mutated(base: bytes, tokens: list[str] = ODD) -> st.SearchStrategy[bytes]:
    """``base`` with a few edits: bytes replaced, deleted or inserted, slices repeated, tokens of
    ``tokens`` put in."""
    edit = st.one_of(
        st.tuples(st.just("set"), st.integers(0, max(len(base), 1)), st.binary(min_size=1, max_size=4)),
        st.tuples(st.just("del"), st.integers(0, max(len(base), 1)), st.integers(1, 16)),
        st.tuples(st.just("dup"), st.integers(0, max(len(base), 1)), st.integers(1, 64)),
        st.tuples(st.just("put"), st.integers(0, max(len(base), 1)), st.sampled_from(tokens)),
    )

    def apply(edits) -> bytes:
        data = bytearray(base)
        for op, at, arg in edits:
            at = min(at, len(data))
            if op == "set":
                data[at:at + len(arg)] = arg
            elif op == "del":
                del data[at:at + arg]
            elif op == "dup":
                data[at:at] = data[at:at + arg]
            else:
                data[at:at] = arg.encode("utf-8")
        return bytes(data)

    return st.lists(edit, min_size=1, max_size=6).map(apply)


def token_soup(tokens: list[str], max_size: int = 60) -> st.SearchStrategy[bytes]:
    return st.lists(st.sampled_from(tokens), max_size=max_size).map(lambda t: "".join(t).encode("utf-8"))


def inputs(base: bytes, tokens: list[str], *structured: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
    """Random bytes, odd text, a mutated valid file, a soup of the format's tokens, and the
    format's own ``structured`` inputs (well-formed syntax, odd contents)."""
    return st.one_of(
        st.binary(max_size=300),
        st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
        mutated(base, tokens),
        token_soup(tokens),
        *structured,
    )


# Values a JSON or YAML document may hold where a reader expects something else: every type,
# numbers past every bound, odd strings, nesting.
ODD_NUMBERS = st.sampled_from([0, 1, -1, 2**31, 2**63, 10**30, int("9" * 400), 0.5, -0.0, 1e308, 1e-320])
VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), ODD_NUMBERS, st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=12), st.sampled_from(ODD)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def _paths(tree, prefix=()):
    yield prefix
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _paths(value, (*prefix, key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _paths(value, (*prefix, i))


def edited_trees(base) -> st.SearchStrategy:
    """``base`` (a JSON-like tree) with a few values replaced by ``VALUES``, keys removed or added."""
    paths = [p for p in _paths(base) if p]

    def edit(tree, path, how, value):
        *parent_path, last = path
        parent = tree
        for key in parent_path:
            parent = parent[key]
        if how == "drop" and isinstance(parent, dict):
            del parent[last]
        elif how == "add" and isinstance(parent, dict) and isinstance(value, (str, int, float)):
            parent[str(value)] = value
        else:
            parent[last] = value

    def apply(edits):
        tree = json.loads(json.dumps(base))
        for path, how, value in edits:
            try:
                edit(tree, path, how, value)
            except (KeyError, IndexError, TypeError):  # an earlier edit took the path away
                pass
        return tree

    edit_ = st.tuples(st.sampled_from(paths), st.sampled_from(["set", "set", "drop", "add"]), VALUES)
    return st.lists(edit_, min_size=1, max_size=3).map(apply)


# ---------------------------------------------------------------------------- DSSTNE text


DSSTNE = b"u1\ti1,1.5:i2:i3,2\nu2\ti2\nu3\t\n\nu4\ti1,-0.25:i4,1e3\r\n"
DSSTNE_TOKENS = ODD + ["u1", "u2", "i1", "i2", "i1,2", "\tx", "x:y", "a,b,c", "1.5"]
NAMES = st.one_of(st.sampled_from(["u1", "u2", "i1", "i2", "a b", "\u00e9"]), st.text(min_size=1, max_size=6))
VALUE_TEXT = st.one_of(st.just(""), st.floats().map(lambda v: f",{v!r}"), st.sampled_from([",1", ",", ",x", ",1e999"]))
DSSTNE_LINES = st.lists(
    st.tuples(NAMES, st.lists(st.tuples(NAMES, VALUE_TEXT), max_size=4)).map(
        lambda row: row[0] + "\t" + ":".join(name + value for name, value in row[1])),
    max_size=6,
).map(lambda lines: "".join(line + "\n" for line in lines).encode("utf-8", "surrogatepass"))


# Found by this search, kept: a byte that is not UTF-8 (a UnicodeDecodeError traceback).
@example(data=b"u1\ti1\n\x80\ti2\n")
@FUZZ
@given(data=inputs(DSSTNE, DSSTNE_TOKENS, DSSTNE_LINES))
def test_dsstne_text(scratch, data):
    path = write(scratch, "samples.txt", data)
    parsed = parsed_or_refused(lambda: parse_text(path), DatasetError)
    if parsed is not None:  # what was read can be written to an index and read back
        names = [n for n in parsed.features.names() if n is not None]
        index = write(scratch, "index.txt", "".join(f"{n}\t{i}\n" for i, n in enumerate(names)).encode("utf-8"))
        assert NameIndex.load(index).names() == names
        assert parsed.rows.n_samples == parsed.samples.size and parsed.rows.n_features == parsed.features.size


INDEX = b"item1\t0\nitem2\t1\n\nitem 3\t5\n"


@example(data=b"a\t" + b"9" * 5000 + b"\n")  # int() past 4300 digits: a ValueError traceback
@example(data=b"a\t0\n\xff\t1\n")
@FUZZ
@given(data=inputs(INDEX, ODD + ["item1", "\t0", "\t1", "\t99999999999999999999"]))
def test_dsstne_index(scratch, data):
    path = write(scratch, "index.txt", data)
    parsed_or_refused(lambda: NameIndex.load(path), DatasetError)


# ---------------------------------------------------------------------------- MovieLens ratings


RATINGS = b"userId,movieId,rating,timestamp\n1,10,4.5,100\n1,20,3.0,99\n2,10,5,101\n3,30,0.5,50\n"
RATINGS_TOKENS = ODD + ["userId,movieId,rating,timestamp\n", "1,10,4.5,100\n", ",", "\n2,", "3.5", "-7"]
NUMBER_TEXT = st.one_of(st.integers(-3, 5).map(str), st.integers().map(str), ODD_NUMBERS.map(str), st.floats().map(str),
                        st.sampled_from(["", " 1", "1 ", "+2", "1_0", "\u0663", "0x10", "1.0"]))
RATING_ROWS = st.lists(st.tuples(NUMBER_TEXT, NUMBER_TEXT, NUMBER_TEXT, NUMBER_TEXT), max_size=8).map(
    lambda rows: ("userId,movieId,rating,timestamp\n" + "".join(",".join(r) + "\n" for r in sorted(rows))).encode(
        "utf-8", "surrogatepass"))


# Found by this search, kept: a header pyarrow does not read as the stdlib reader does, bytes that
# are not UTF-8, a rating that float32 rounds to inf, an id past int64.
@example(data=b"\tuserId,movieId,rating,timestamp\n1,10,4.5,100\n")
@example(data=b"userId,movieId,rating,timestamp\n1,10,4.5,100\n\x80,1,1,1\n")
@example(data=b"userId,movieId,rating,timestamp\n0,0,3.4028235677973366e+38,0\n")
@example(data=b"userId,movieId,rating,timestamp\n9223372036854775808,0,1,0\n")
@pytest.mark.parametrize("engine", ["python", "pyarrow"])
@FUZZ
@given(data=inputs(RATINGS, RATINGS_TOKENS, RATING_ROWS))
def test_movielens_ratings(scratch, engine, data):
    path = write(scratch, "ratings.csv", data)
    out = os.path.join(scratch, f"histories_{engine}.txt")
    done = parsed_or_refused(lambda: movielens_to_text(path, out, with_ratings=True, engine=engine), DatasetError)
    if done is not None:  # what was written parses as DSSTNE text
        assert parse_text(out).rows.nnz == done[1]


# ---------------------------------------------------------------------------- feature specs (YAML)


def spec_dict(chunk_type: str) -> dict:
    splits = {s: [{"features": ["num_0"], "files": [f"{s}/numerical.bin"], "type": chunk_type},
                  {"features": ["label"], "files": [f"{s}/label.bin"], "type": chunk_type},
                  {"features": ["cat_0.bin"], "files": [f"{s}/cat_0.bin"], "type": chunk_type}]
              for s in ("train", "test")}
    features = {"cat_0.bin": {"cardinality": 5, "dtype": "int8"}, "label": {"dtype": "bool"},
                "num_0": {"dtype": "float16"}}
    if chunk_type == "csv":
        features["cat_0.bin"] = {"cardinality": "auto"}
    return {"channel_spec": {"categorical": ["cat_0.bin"], "label": ["label"], "numerical": ["num_0"]},
            "feature_spec": features, "metadata": {"a": [1, 2]}, "source_spec": splits}


def spec_yaml(chunk_type: str) -> bytes:
    return yaml.dump(spec_dict(chunk_type)).encode()


def edited_specs(chunk_type: str) -> st.SearchStrategy[bytes]:
    return edited_trees(spec_dict(chunk_type)).map(lambda tree: yaml.dump(tree).encode("utf-8", "surrogatepass"))


YAML_TOKENS = ODD + ["\n  ", "\n- ", ": ", "&x ", "*x", "!!binary ", "!!int ", "!!timestamp ", "2021-02-31",
                     "cardinality: ", "dtype: ", "bag_size: ", "pooling: ", "int8", "float16", "bool", "variable",
                     "split_binary", "csv", "files: ", "features: ", "~", "-1", "0o17", "1_000", "12:30:00",
                     "[" * 70, "&a [*a]", "\t"]


# Found by this search, kept: PyYAML's constructors on an empty tagged value (IndexError,
# AttributeError), numpy building a dtype from a mapping (ValueError), a syntax error over lines.
@example(data=b"!!int ")
@example(data=b"!!timestamp ")
@example(data=spec_yaml("split_binary").replace(b"dtype: int8", b"dtype: {'': ''}"))
@example(data=b"[0")
@FUZZ
@given(data=inputs(spec_yaml("split_binary"), YAML_TOKENS, edited_specs("split_binary")))
def test_feature_spec_yaml(scratch, data):
    path = write(scratch, "feature_spec.yaml", data)
    spec = parsed_or_refused(lambda: FeatureSpec.from_yaml(path), DatasetError)
    if spec is not None:  # a spec that loads can be written back and loads again the same
        spec.to_yaml(os.path.join(scratch, "written.yaml"))
        assert FeatureSpec.from_yaml(os.path.join(scratch, "written.yaml")).to_dict() == spec.to_dict()


@example(data=b"!!int ")
@example(data=b"!!timestamp ")
@FUZZ
@given(data=inputs(spec_yaml("csv"), YAML_TOKENS, edited_specs("csv")))
def test_csv_source_spec(scratch, data):
    path = write(scratch, "csv_spec.yaml", data)
    source = parsed_or_refused(lambda: CsvSource.from_yaml(path), DatasetError)
    if source is not None:
        for split in source.splits:
            assert all(chunk.features for chunk in source.chunks(split))
        for name in source.categorical_names:
            source.cardinality(name)


# ---------------------------------------------------------------------------- network JSON


NETWORK_DICT = {
    "Kind": "AutoEncoder", "Denoising": {"p": 0.1},
    "Layers": [{"Kind": "Input", "N": "auto", "DataSet": "input", "Sparse": True},
               {"Kind": "Hidden", "N": 16, "Activation": "Sigmoid", "pDropout": 0.1,
                "WeightInit": {"Scheme": "Gaussian", "Scale": 0.01}},
               {"Kind": "Output", "N": "auto", "DataSet": "output", "Activation": "Sigmoid"}],
    "ErrorFunction": "ScaledMarginalCrossEntropy", "Optimizer": {"Kind": "Adam", "Alpha": 0.01},
}
NETWORK = json.dumps(NETWORK_DICT, indent=1).encode()
EDITED_NETWORKS = edited_trees(NETWORK_DICT).map(lambda tree: json.dumps(tree).encode("utf-8", "surrogatepass"))
JSON_TOKENS = ODD + ['"Kind"', '"N"', ": ", '"auto"', "1e308", "-0.0", "true", "[]", "{}", '"Layers": ',
                     '"Variational": {"Beta": 1}', '"Source": ["Input"]', '"Kind": "Hidden"', '"\\ud800"',
                     '"\\u0000"', "[" * 70, "[" * 5000]


@example(data=b"[" * 100_000)  # json's recursion overflowed: a RecursionError traceback
@example(data=b'{"Version": ' + b"9" * 5000 + b"}")
@FUZZ
@given(data=inputs(NETWORK, JSON_TOKENS, EDITED_NETWORKS))
def test_network_json(scratch, data):
    path = write(scratch, "network.json", data)
    parsed_or_refused(lambda: parse_network(path), NetworkConfigError)


def test_the_shipped_networks_parse():
    for name in sorted(os.listdir(os.path.join(REPO, "configs", "recommender"))):
        parse_network(os.path.join(REPO, "configs", "recommender", name))


# ---------------------------------------------------------------------------- Criteo TSV (preproc)


def criteo_line(rng: np.random.Generator) -> str:
    counts = ["" if rng.random() < 0.2 else str(int(rng.integers(-5, 10**6))) for _ in range(13)]
    hashes = ["" if rng.random() < 0.2 else f"{int(rng.integers(0, 2**32)):08x}" for _ in range(26)]
    return "\t".join([str(int(rng.integers(0, 2)))] + counts + hashes)


CRITEO = "".join(criteo_line(np.random.default_rng(s)) + "\n" for s in range(4)).encode()
CRITEO_TOKENS = ["\t", "\n", "-", "0", "1", "9" * 19, "9" * 5000, "-" + "0" * 30 + "7", "deadbeef", "DEADBEEF",
                 "0000000g", "1234567", "123456789", "\x00", "\xff", " ", "\r"]


@pytest.fixture(scope="module")
def log_table():
    return build_log_table()


# A count of 5000 digits: Python's int() refuses it, so the reference cannot value it; it was kept
# as a long count and valuing it raised a ValueError.
@example(data=CRITEO.replace(b"\t", b"\t" + b"9" * 5000, 1))
@FUZZ
@given(data=inputs(CRITEO, CRITEO_TOKENS))
def test_criteo_lines_are_parsed_or_set_aside_as_the_reference_decides(log_table, data):
    """parse_chunk never raises; each line is parsed, with the reference's values, or set aside
    as a line the reference refuses (its reason then comes from the reference)."""
    if not data.endswith(b"\n"):
        data += b"\n"  # a chunk holds whole lines (textio adds the last newline)
    chunk = parse_chunk(data, 1)
    lines = data.split(b"\n")[:-1]
    assert chunk.lines == len(lines)
    bad = dict(chunk.bad)
    numerical = chunk.rows.numerical(log_table)
    kept = {int(n): i for i, n in enumerate(chunk.rows.line)}
    assert sorted([*bad, *kept]) == list(range(1, len(lines) + 1))
    for n, raw in enumerate(lines, 1):
        try:
            label, counts, hashes = parse_line(raw.decode("ascii", errors="replace"))
        except _Malformed:
            assert n in bad and bad[n] == raw, n
            continue
        except ValueError:  # a count past Python's 4300-digit limit: the reference cannot value it
            assert n in bad and any(len(field) > 4300 for field in raw.split(b"\t")), n
            continue
        i = kept[n]
        assert chunk.rows.label[i] == label
        expected = np.array([log_transform(c) for c in counts]).astype(np.float32).astype(np.float16)
        assert numerical[i].tobytes() == expected.tobytes(), n
        assert chunk.rows.hashes[i].tolist() == [0 if h is None else int(h, 16) for h in hashes]
