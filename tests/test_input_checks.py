"""Bad inputs fail in one line, exit 2, before any work: never a traceback, never unbounded
memory or time. Each test reproduces one way a user's file or flag broke a reader (N7, N8,
N11, N12, N13, D1) and runs the entry point as a user does (``python -m``, a real subprocess)
or the reader itself; the expected lines are written out here, not taken from the library."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import yaml
from conftest import REPO

from dlrm.data.csv_source import CsvSource
from dlrm.data.feature_spec import FeatureSpec
from dlrm.engine.errors import DatasetError, FeatureSpecError
from dlrm.recommender.csr_dataset import CsrDataset
from dlrm.recommender.dsstne_text import NameIndex, parse_lines
from dlrm.recommender.network import NetworkConfigError, parse_network
from dlrm.recommender.topk import check_score_format
import warm_python

NETWORK = {
    "Kind": "AutoEncoder",
    "Layers": [
        {"Kind": "Input", "N": "auto", "DataSet": "input", "Sparse": True},
        {"Kind": "Hidden", "N": 4, "Activation": "Sigmoid"},
        {"Kind": "Output", "N": "auto", "DataSet": "output", "Activation": "Sigmoid"},
    ],
    "ErrorFunction": "ScaledMarginalCrossEntropy",
    "Optimizer": {"Kind": "SGD", "Alpha": 0.05},
}


def start(*args: str, cwd: str = REPO) -> subprocess.Popen:
    """``python args`` as a user runs it, started (commands run side by side: each mostly imports torch)."""
    return warm_python.Popen([sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def finish(proc: subprocess.Popen, timeout: float = 120) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"{' '.join(proc.args)} still ran after {timeout} s") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return finish(start(*args), timeout)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The one line of stderr of a refused command (exit 2, no traceback), without 'error: '."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), \
        f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return lines[0][len("error: "):]


# ---------------------------------------------------------------------------- N7: CSR contents


def write_raw_csr(path, offsets, indices, n_features, nnz=None) -> str:
    """A CSR dataset written byte by byte as the format says (not through the library's writer,
    which refuses bad rows): what a broken or foreign writer leaves."""
    os.makedirs(path)
    np.asarray(offsets, "<i8").tofile(os.path.join(path, "offsets.bin"))
    np.asarray(indices, "<i4").tofile(os.path.join(path, "indices.bin"))
    header = {"format": "dlrm-csr", "version": 1, "n_samples": len(offsets) - 1, "n_features": n_features,
              "nnz": len(indices) if nnz is None else nnz, "has_values": False,
              "dtypes": {"offsets": "<i8", "indices": "<i4"}}
    with open(os.path.join(path, "header.json"), "w") as f:
        json.dump(header, f)
    return str(path)


# name -> (offsets, indices, n_features, the file and message expected)
BAD_CSR = {
    "decreasing": ([0, 3, 1, 4], [0, 1, 2, 3], 5,
                   ("offsets.bin", "offsets decrease at position 2 (3 then 1); they must be non-decreasing")),
    "past_n_features": ([0, 2, 4], [0, 1, 2, 9], 5,
                        ("indices.bin", "feature index 9 at position 3 is outside [0, n_features = 5)")),
    "negative": ([0, 2, 4], [0, 1, -2, 3], 5,
                 ("indices.bin", "feature index -2 at position 2 is outside [0, n_features = 5)")),
    "huge_n_features": ([0, 2, 4], [0, 1, 2, 3], 10**12,
                        ("header.json", "`n_features` = 1,000,000,000,000 is above 2,147,483,648, the most a CSR "
                                        "dataset can index (its indices are int32)")),
    "short_offsets": ([0, 2, 3], [0, 1, 2, 3], 5,
                      ("offsets.bin", "offsets end at 3 (position 2), but the header says nnz = 4")),
}


def expected_csr_line(path: str, name: str, cli: bool = False) -> str:
    """The message of the library, or as a command line shows it (``cli``: a setting the script
    has no flag for, `n_features`, without its quotes)."""
    file, message = BAD_CSR[name][3]
    line = f"{os.path.join(path, file)}: {message}; re-create the dataset"
    return line.replace("`", "") if cli else line


@pytest.mark.parametrize("name", sorted(BAD_CSR))
def test_opening_a_csr_dataset_checks_its_contents(tmp_path, name):
    offsets, indices, n_features, _ = BAD_CSR[name]
    path = write_raw_csr(tmp_path / name, offsets, indices, n_features)
    with pytest.raises(DatasetError) as info:
        CsrDataset(path)
    assert str(info.value) == expected_csr_line(path, name)


def test_a_good_csr_dataset_opens_and_the_scan_can_be_skipped(tmp_path):
    path = write_raw_csr(tmp_path / "ok", [0, 2, 2, 4], [4, 0, 1, 3], 5)
    assert CsrDataset(path).rows().indices.tolist() == [4, 0, 1, 3]
    bad = write_raw_csr(tmp_path / "bad", [0, 2, 4], [0, 1, 2, 9], 5)
    assert CsrDataset(bad, check=False).n_features == 5  # the header alone (e.g. to size a job)


@pytest.fixture(scope="module")
def recommender(tmp_path_factory):
    """A network file, bad CSR datasets of 5 items, and a model trained on a good one."""
    root = tmp_path_factory.mktemp("input_checks")
    network = root / "network.json"
    network.write_text(json.dumps(NETWORK))
    data = {name: write_raw_csr(root / name, *BAD_CSR[name][:3]) for name in BAD_CSR}
    data["ok"] = write_raw_csr(root / "ok", [0, 2, 4], [0, 1, 2, 3], 5)
    ckpt = str(root / "ckpt")
    proc = run("-m", "dlrm.scripts.recommender_train", "--network", str(network), "--input", data["ok"],
               "--save_checkpoint_path", ckpt, "--epochs", "1", "--validation_users", "0", "--device", "cpu")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"root": root, "network": str(network), "ckpt": ckpt, **data}


def test_train_predict_and_evaluate_refuse_a_bad_csr_dataset_in_the_same_line(recommender):
    """N7: recommender_train and recommender_predict fed torch a bad dataset (tracebacks, exit 1);
    all three entry points now refuse it on open, with recommender_evaluate's line."""
    r = recommender

    def train(name):
        return start("-m", "dlrm.scripts.recommender_train", "--network", r["network"], "--input", r[name],
                     "--save_checkpoint_path", str(r["root"] / f"ckpt_{name}"), "--epochs", "1",
                     "--validation_users", "0", "--device", "cpu")

    def predict(name):
        return start("-m", "dlrm.scripts.recommender_predict", "--load_checkpoint_path", r["ckpt"], "--input", r[name],
                     "--output", str(r["root"] / f"recs_{name}.txt"), "--device", "cpu")

    runs = [("decreasing", train("decreasing")), ("huge_n_features", train("huge_n_features"))]
    runs.append(("past_n_features", predict("past_n_features")))
    runs.append(("negative", start("-m", "dlrm.scripts.recommender_evaluate", "--input", r["negative"], "--heldout",
                                   r["negative"], "--baselines", "popularity")))
    for name, proc in runs:
        assert one_line_error(finish(proc)) == expected_csr_line(r[name], name, cli=True), name
    assert not any(os.path.exists(r["root"] / f"recs_{name}.txt") for name in BAD_CSR)


# ---------------------------------------------------------------------------- N8: feature spec YAML


def spec_text() -> str:
    """A valid split-binary feature spec of one feature per channel."""
    splits = {s: [{"features": ["num_0"], "files": [f"{s}/numerical.bin"], "type": "split_binary"},
                  {"features": ["label"], "files": [f"{s}/label.bin"], "type": "split_binary"},
                  {"features": ["cat_0.bin"], "files": [f"{s}/cat_0.bin"], "type": "split_binary"}]
              for s in ("train", "test")}
    return yaml.safe_dump({
        "channel_spec": {"categorical": ["cat_0.bin"], "label": ["label"], "numerical": ["num_0"]},
        "feature_spec": {"cat_0.bin": {"cardinality": 5, "dtype": "int8"}, "label": {"dtype": "bool"},
                         "num_0": {"dtype": "float16"}},
        "source_spec": splits,
    })


def billion_laughs() -> tuple[str, int]:
    """A 'billion laughs' under ``metadata:``: nine levels of nine aliases, 9**9 = 387 million
    strings once expanded, in 700 bytes. Returns (YAML, the line of the alias that first
    expands past 8 MiB)."""
    lines = ["metadata:", '  a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    previous = "a"
    for name in "bcdefghi":
        lines.append(f"  {name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]")
        previous = name
    text = spec_text()
    # a "lol" written out takes 4 bytes, so level f (9**5 of them) is 2 MiB and level g the first past 8 MiB
    return text + "\n".join(lines) + "\n", text.count("\n") + 1 + lines.index("  g: &g [" + ", ".join(["*f"] * 9) + "]")


def test_a_yaml_alias_bomb_is_refused_when_read(tmp_path):
    """N8: safe_load keeps aliases shared, so the bomb loaded at once and blew up where the spec
    was written out (prepare_synthetic_dataset: minutes, GBs, MemoryError). Now both readers
    refuse it, naming the file and line, in well under a second."""
    text, line = billion_laughs()
    path = tmp_path / "feature_spec.yaml"
    path.write_text(text)
    for read in (FeatureSpec.from_yaml, CsvSource.from_yaml):
        started = time.perf_counter()
        with pytest.raises(FeatureSpecError, match=rf"^{path}:{line}: its YAML aliases \(such as \*f\) expand the "
                                                   rf"spec to more than 8 MiB"):
            read(str(path))
        assert time.perf_counter() - started < 5


def test_prepare_synthetic_dataset_refuses_a_yaml_alias_bomb(tmp_path):
    text, line = billion_laughs()
    spec = tmp_path / "bomb.yaml"
    spec.write_text(text)
    out = tmp_path / "out"
    proc = run("-m", "dlrm.scripts.prepare_synthetic_dataset", "--feature_spec", str(spec), "--synthetic_dataset_dir",
               str(out), "--synthetic_dataset_num_entries", "8", "--num_test_entries", "8", timeout=60)
    assert one_line_error(proc).startswith(f"{spec}:{line}: its YAML aliases (such as *f) expand the spec")
    assert not out.exists()


def test_yaml_aliases_that_stay_small_still_load(tmp_path):
    """NVIDIA's files share lists through anchors (yaml.dump writes &id001): they load as before."""
    d = yaml.safe_load(spec_text())
    d["metadata"] = {"first": {"x": 1}}
    d["metadata"]["again"] = d["metadata"]["first"]
    path = tmp_path / "feature_spec.yaml"
    path.write_text(yaml.dump(d))
    assert "&id001" in path.read_text()
    assert FeatureSpec.from_yaml(str(path)).metadata["again"] == {"x": 1}


@pytest.mark.parametrize("case", ["recursive", "deep", "large", "long_number", "bad_date"])
def test_feature_spec_files_past_the_bounds_are_refused(tmp_path, case):
    path = tmp_path / "feature_spec.yaml"
    text = spec_text()
    extra = {
        "recursive": "metadata:\n  a: &a [1, *a]\n",  # a list inside itself: no full form to write
        "deep": "metadata:\n  a: " + "[" * 100_000 + "]" * 100_000 + "\n",  # PyYAML's recursion overflowed
        "large": "metadata:\n  a: 1\n# " + "x" * (8 << 20) + "\n",
        "long_number": "metadata:\n  a: " + "9" * 5000 + "\n",  # past Python's int digits limit: a ValueError
        "bad_date": "metadata:\n  a: 2021-02-31\n",  # a timestamp's constructor: a ValueError
    }[case]
    path.write_text(text + extra)
    line = text.count("\n") + 2
    expected = {
        "recursive": f"{path}:{line}: the alias *a stands inside its own anchor &a",
        "deep": f"{path}:{line}: nested more than 64 levels deep",
        "large": f"{path}: larger than 8 MiB",
        "long_number": f"{path}: a value cannot be read: Exceeds the limit (4300 digits)",
        "bad_date": f"{path}: a value cannot be read: day is out of range for month",
    }[case]
    for read in (FeatureSpec.from_yaml, CsvSource.from_yaml):
        with pytest.raises(FeatureSpecError) as info:
            read(str(path))
        assert str(info.value).startswith(expected), str(info.value)[:300]


# ---------------------------------------------------------------------------- N11: network JSON depth


def test_a_network_file_nested_100000_deep_is_one_line(tmp_path, recommender):
    """N11: json.loads overflowed Python's recursion (RecursionError traceback)."""
    deep = tmp_path / "deep.json"
    deep.write_text('{"Kind": "AutoEncoder",\n "Name": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    proc = run("-m", "dlrm.scripts.recommender_train", "--network", str(deep), "--input", recommender["ok"],
               "--save_checkpoint_path", str(tmp_path / "ckpt"), "--epochs", "1", "--validation_users", "0")
    assert one_line_error(proc) == (f"--network {deep}:2: JSON nested more than 64 levels deep; a network definition "
                                    f"is a few levels of objects and arrays: fix the file")
    long_number = tmp_path / "long.json"
    long_number.write_text('{"Version": ' + "9" * 5000 + "}")
    with pytest.raises(NetworkConfigError, match=rf"^{long_number}: a number cannot be read"):
        parse_network(str(long_number))
    brackets_in_strings = {**NETWORK, "Name": "[" * 1000}  # inside a string: no nesting
    path = tmp_path / "brackets.json"
    path.write_text(json.dumps(brackets_in_strings))
    assert parse_network(str(path)).name == "[" * 1000


# ---------------------------------------------------------------------------- N12: Triton URL


@pytest.fixture(scope="module")
def split_binary(tmp_path_factory):
    from dlrm.data.synthetic import write_synthetic_dataset

    path = str(tmp_path_factory.mktemp("triton_client") / "data")
    write_synthetic_dataset(path, 2, [5, 5], {"train": 8, "test": 8}, batch_size=8)
    return path


def test_triton_client_refuses_a_bad_url_in_one_line(split_binary):
    """N12: a ValueError traceback from the HTTP library, then an AttributeError from its
    __del__; now the URL is checked first, before the dataset is read."""
    cases = {
        "localhost:abc": "the port 'abc' is not a number in 1..65535; give host:port, e.g. localhost:8000",
        "http://[::1": "the [ of an IPv6 address is not closed; give host:port, e.g. localhost:8000",
    }
    procs = {url: start("triton/client.py", "--url", url, "--dataset", split_binary) for url in cases}
    for url, proc in procs.items():
        proc = finish(proc)
        assert proc.stderr.count("\n") == 1, proc.stderr  # exactly one line: no __del__ noise after it
        assert one_line_error(proc) == f"--url {url!r}: {cases[url]}"


@pytest.mark.parametrize("url, protocol, expected", [
    ("localhost:8000", "http", "localhost:8000"),
    ("http://127.0.0.1:8000/", "http", "127.0.0.1:8000"),
    ("grpc://triton.example.com:8001", "grpc", "triton.example.com:8001"),
    ("[::1]:8001", "grpc", "[::1]:8001"),
])
def test_check_url_gives_host_and_port(url, protocol, expected):
    from dlrm.inference.triton_client import check_url

    assert check_url(url, protocol) == expected


@pytest.mark.parametrize("url, protocol, expected", [
    ("localhost:0", "http", "the port '0' is not a number in 1..65535"),
    ("localhost:65536", "http", "the port '65536' is not a number in 1..65535"),
    ("localhost", "http", "no port"),
    (":8000", "http", "no host"),
    ("[::g]:8000", "http", "[::g] is not an IPv6 address"),
    ("300.1.1.1:8000", "http", "300.1.1.1 is not an IPv4 address"),
    ("a b:8000", "http", "'a b' is not a host name or an IP address"),
    ("https://host:8000", "http", "the scheme https:// is not http://: this client speaks plain HTTP and gRPC"),
    ("grpc://host:8001", "http", "the scheme grpc:// is not http://: it does not match `protocol=http`"),
    ("host:8000/v2/models", "http", "not a server address"),
])
def test_check_url_refuses(url, protocol, expected):
    from dlrm.inference.triton_client import check_url

    with pytest.raises(ValueError) as info:
        check_url(url, protocol)
    assert str(info.value).startswith(f"`url` {url!r}: {expected}"), str(info.value)


# ---------------------------------------------------------------------------- N13: --score_format


@pytest.mark.parametrize("module, extra", [("dlrm.scripts.recommender_predict", ["--device", "cpu"]),
                                           ("dlrm.scripts.spark_recommend", [])])
def test_predict_refuses_a_score_format_of_unbounded_precision(recommender, tmp_path, module, extra):
    """N13: --score_format %.99999999f was accepted and wrote 100 MB per score (21 GB in all)."""
    out = tmp_path / "recs.txt"
    proc = run("-m", module, "--load_checkpoint_path", recommender["ckpt"], "--input",
               recommender["ok"], "--output", str(out), "--k", "1", *extra, "--score_format", "%.99999999f")
    assert one_line_error(proc) == ("--score_format '%.99999999f': give a printf format of one float, e.g. %.6g (the "
                                    "default) or %4.3f (DSSTNE's), with at most 17 digits of precision and a width of "
                                    "at most 32")
    assert not out.exists()


@pytest.mark.parametrize("spec, ok", [("%.17g", True), ("%32.17f", True), ("4.3f", True), ("%-+ #032.3e", True),
                                      ("%.18g", False), ("%33f", False), ("%.99999999f", False),
                                      ("%99999999.1f", False), ("%" + "0" * 100 + "1f", False)])
def test_score_format_bounds(spec, ok):
    if ok:
        assert check_score_format(spec) % 0.5 == ("%" + spec.lstrip("%")) % 0.5
    else:
        with pytest.raises(ValueError, match="`score_format`"):
            check_score_format(spec)


# ---------------------------------------------------------------------------- D1: names


def test_generate_refuses_a_tab_inside_an_item_name(tmp_path):
    """D1: 'i<TAB>2' was taken as an item name; the features index written with it failed its
    own reader (malformed index line 'i\\t2\\t1'). Now the text is refused where it is read."""
    text = tmp_path / "histories.txt"
    text.write_text("u\tx:i\t2\nv\tx\n")
    out = tmp_path / "out"
    proc = run("-m", "dlrm.scripts.recommender_generate", "--text", str(text), "--output", str(out))
    assert one_line_error(proc) == (f"{text}:1: feature name 'i\\t2' holds a tab (U+0009) at character 2; names may "
                                    f"not hold tabs, newlines or other control characters (they separate the fields "
                                    f"of DSSTNE text and of the index files): rename it")
    assert not out.exists()


@pytest.mark.parametrize("line, expected", [
    ("u\x00\tx", "sample name 'u\\x00' holds the control character (U+0000) at character 2"),
    ("u\tx\ny", "feature name 'x\\ny' holds a newline (U+000A) at character 2"),
    ("u\ta\rb,1", "feature name 'a\\rb' holds a carriage return (U+000D) at character 2"),
    ("u\tx\u2028y", "feature name 'x\\u2028y' holds the control character (U+2028) at character 2"),
    ("u\tx\x85y", "feature name 'x\\x85y' holds the control character (U+0085) at character 2"),
])
def test_names_with_control_characters_are_refused(line, expected):
    with pytest.raises(DatasetError) as info:
        parse_lines([line], source="in.txt")
    assert str(info.value).startswith(f"in.txt:1: {expected}; names may not hold tabs"), str(info.value)


def test_names_keep_what_is_stripped_and_other_text():
    parsed = parse_lines(["u 1\t x,1.5 \t:y:\u00e9t\u00e9 ,2\r\n"])  # surrounding whitespace, a trailing tab: stripped
    assert parsed.samples.names() == ["u 1"] and parsed.features.names() == ["x", "y", "\u00e9t\u00e9"]


def test_an_index_file_with_a_control_character_in_a_name_is_refused(tmp_path):
    index = tmp_path / "features_index.txt"
    index.write_bytes(b"a\t0\nb\x1bc\t1\n")
    with pytest.raises(DatasetError, match=rf"^{index}:2: index entry name 'b\\x1bc' holds the control character "
                                           rf"\(U\+001B\) at character 2"):
        NameIndex.load(index)
