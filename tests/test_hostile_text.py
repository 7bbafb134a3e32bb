"""Every reader of user text bounds the length of a line while it streams: a file with no newline
(all NUL bytes, as ``truncate`` makes) or one huge line is refused in one line naming the file,
the line and the bound, exit 2, after reading one block, with peak memory that does not grow
with the line. The reference for the line checks is plain ``bytes.split``."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlrm.engine.errors import DatasetError
from dlrm.engine.text_lines import MAX_LINE_BYTES, LineBound, bounded_lines, check_stream
from preproc.generate import generate_criteo_tsv
from preproc.textio import count_lines, read_line_chunks

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEAK_RSS_BOUND = 400 << 20  # the refusal peaks near 100 MB; a 64 MB file without newlines cost 1.2 GB before
_MEASURE = ("import resource, subprocess, sys\n"
            "p = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
            "sys.stdout.write(p.stderr)\n"
            "print(p.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n")


def _first_bad(data: bytes, max_bytes: int) -> tuple[set[str], int] | None:
    """Independent reference: the first bad line of ``data``, split whole, and what is wrong."""
    for number, line in enumerate(data.split(b"\n"), 1):
        kinds = {"NUL byte"} if b"\0" in line else set()
        kinds |= {"longer than"} if len(line) > max_bytes else set()
        if kinds:
            return kinds, number
    return None


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from([b"a", b"bb", b"\n", b"cccc", b"\0", b"\n\n"]), max_size=40),
       st.integers(1, 6), st.lists(st.integers(1, 9), min_size=1, max_size=8))
def test_line_bound_matches_splitting_the_whole_file(pieces, max_bytes, cuts):
    data = b"".join(pieces)
    bound, start, k = LineBound("f.txt", max_bytes), 0, 0
    try:
        while start < len(data):
            step = cuts[k % len(cuts)]
            bound.feed(data[start:start + step])
            start, k = start + step, k + 1
    except DatasetError as e:
        kinds, line = _first_bad(data, max_bytes)
        assert f"f.txt, line {line}:" in str(e) and any(kind in str(e) for kind in kinds), (str(e), kinds)
        return
    assert _first_bad(data, max_bytes) is None
    assert bound.finish() == len(data.split(b"\n")) - (data.endswith(b"\n") or not data)


@pytest.mark.parametrize("text", [False, True])
def test_bounded_lines_reads_no_more_than_the_bound(tmp_path, text):
    path = tmp_path / "x.txt"
    path.write_bytes(b"ok\nabcd\n" + b"y" * 5000 + b"\nnever")
    opened = open(path, "r" if text else "rb")
    with opened as f:
        lines = bounded_lines(f, "x.txt", 4)
        assert [next(lines), next(lines)] == (["ok\n", "abcd\n"] if text else [b"ok\n", b"abcd\n"])
        with pytest.raises(DatasetError, match=r"^x\.txt, line 3: longer than 4 bytes"):
            next(lines)
        assert f.tell() <= len("ok\nabcd\n") + 6  # the bound and its newline, not the 5,000 bytes


def test_preproc_chunks_refuse_a_long_line_and_nul_bytes(tmp_path):
    good = tmp_path / "good.tsv"
    generate_criteo_tsv(str(good), 50)
    assert count_lines(str(good), 64, max_line=400) == 50
    assert b"".join(d for d, _ in read_line_chunks(str(good), 64, max_line=400)) == good.read_bytes()
    long = tmp_path / "long.tsv.gz"
    with gzip.open(long, "wb") as f:
        f.write(good.read_bytes()[:300] + b"\n" * 2 + b"z" * 2000 + b"\n")
    lines = good.read_bytes()[:300].count(b"\n") + 3
    for read in (lambda: count_lines(str(long), 64, max_line=400), lambda: list(read_line_chunks(str(long), 64, 400))):
        with pytest.raises(DatasetError, match=rf"long\.tsv\.gz, line {lines}: longer than 400 bytes"):
            read()
    nul = tmp_path / "nul.tsv"
    nul.write_bytes(b"a\nb\n\0\0")
    with pytest.raises(DatasetError, match=r"nul\.tsv, line 3: holds a NUL byte"):
        check_stream(open(nul, "rb"), "nul.tsv")


@pytest.mark.parametrize("content", ["nul", "letters"])
def test_preproc_refuses_a_64_mb_line_in_one_line_with_bounded_memory(tmp_path, content):
    """R9: a 64 MB file without a newline, and a 64 MB line of letters."""
    train = tmp_path / "x.tsv"
    with open(train, "wb") as f:
        if content == "nul":
            f.truncate(64 << 20)
        else:
            f.write(b"a" * (64 << 20))
    test = tmp_path / "t.tsv"
    generate_criteo_tsv(str(test), 20)
    out = tmp_path / "pp"
    cmd = [sys.executable, "-c", _MEASURE, sys.executable, "-m", "preproc", "--train", str(train), "--test", str(test),
           "--output", str(out)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
    *err, last = proc.stdout.rstrip("\n").split("\n")
    code, peak_kib = map(int, last.split())
    assert code == 2 and len(err) == 1, proc.stdout
    word = "holds a NUL byte" if content == "nul" else f"longer than {MAX_LINE_BYTES >> 20} MiB"
    assert err[0].startswith(f"error: {train}, line 1: {word}"), err
    assert peak_kib * 1024 < PEAK_RSS_BOUND, f"peak RSS {peak_kib / 1024:.0f} MiB"
    assert not out.exists()


def test_transcode_refuses_a_long_line(tmp_path):
    from dlrm.data.transcode import transcode

    train = tmp_path / "train.tsv"
    train.write_text("1\t2\t3\n" * 3 + "1\t" * (MAX_LINE_BYTES // 2 + 1) + "3\n")
    with pytest.raises(DatasetError, match=r"train\.tsv.* line 4: longer than 1 MiB"):
        transcode({"train": str(train)}, str(tmp_path / "out"), num_numerical=1, num_categorical=1)


def test_transcode_command_refuses_nul_bytes_in_one_line(tmp_path, cli):
    train = tmp_path / "train.tsv"
    with open(train, "wb") as f:
        f.truncate(8 << 20)
    proc = cli("dlrm.scripts.transcode", "--train", str(train), "--output", str(tmp_path / "out"), check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{train}, line 1: holds a NUL byte" in proc.stderr


def test_dsstne_text_and_index_refuse_long_lines_and_nul(tmp_path):
    from dlrm.recommender.dsstne_text import MAX_SAMPLE_LINE, NameIndex, parse_text

    samples = tmp_path / "samples.txt"
    samples.write_text("u1\ta:b\n" + "u2\t" + ":".join(["item"] * (MAX_SAMPLE_LINE // 5 + 1)) + "\n")
    with pytest.raises(DatasetError, match=r"samples\.txt, line 2: longer than 16 MiB"):
        parse_text(samples)
    index = tmp_path / "index.txt"
    index.write_bytes(b"a\t0\n" + b"b" * (MAX_LINE_BYTES + 1))
    with pytest.raises(DatasetError, match=r"index\.txt, line 2: longer than 1 MiB"):
        NameIndex.load(index)
    index.write_bytes(b"a\t0\n\0\t1\n")
    with pytest.raises(DatasetError, match=r"index\.txt, line 2: holds a NUL byte"):
        NameIndex.load(index)


def test_ratings_readers_refuse_long_lines_and_nul(tmp_path):
    from dlrm.recommender.ratings_file import read_ratings
    from dlrm.recommender.user_histories import movielens_to_text

    ratings = tmp_path / "ratings.csv"
    ratings.write_text("userId,movieId,rating,timestamp\n1,2,3.0,4\n1,3,4.0,5\n" + "7" * (MAX_LINE_BYTES + 1) + "\n")
    with pytest.raises(DatasetError, match=r"ratings\.csv, line 4: longer than 1 MiB"):
        read_ratings(ratings, block_bytes=1 << 16)
    for engine in ("python", "auto"):
        with pytest.raises(DatasetError, match=r"ratings\.csv, line 4: longer than 1 MiB"):
            movielens_to_text(ratings, tmp_path / "out.txt", engine=engine)
    ratings.write_bytes(b"userId,movieId,rating,timestamp\n1,2,3.0,4\n" + b"\0" * 5000)
    with pytest.raises(DatasetError, match=r"ratings\.csv, line 3: holds a NUL byte"):
        read_ratings(ratings)
    with pytest.raises(DatasetError, match=r"ratings\.csv, line 3: holds a NUL byte"):
        movielens_to_text(ratings, tmp_path / "out.txt", engine="python")
    assert not (tmp_path / "out.txt").exists()


def test_network_json_is_bounded_before_parsing(tmp_path):
    from dlrm.recommender.network import parse_network
    from dlrm.recommender.network_values import MAX_NETWORK_BYTES

    network = tmp_path / "network.json"
    with open(network, "wb") as f:
        f.truncate(MAX_NETWORK_BYTES + 1)
    with pytest.raises(ValueError, match=r"network\.json: larger than"):
        parse_network(network)
