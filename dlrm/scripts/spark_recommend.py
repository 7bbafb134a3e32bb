r"""Top-K recommendations of a trained sparse autoencoder in Spark (recommender_predict on a cluster).

    # the CSR dataset recommender_predict reads: the same text file it writes
    python -m dlrm.scripts.spark_recommend --load_checkpoint_path /shared/ae --input /shared/ml20m/input \
        --features_index /shared/ml20m/features_index.txt --samples_index /shared/ml20m/samples_index.txt \
        --k 10 --output recs.txt
    # DSSTNE text files (user<TAB>item:item:...), recommendations as Parquet
    python -m dlrm.scripts.spark_recommend --load_checkpoint_path /shared/ae --text /shared/histories.txt \
        --features_index /shared/ml20m/features_index.txt --output /shared/recs.parquet --output_format parquet
    # a Parquet table of histories: user, items (array of item names or column numbers), weights (optional)
    python -m dlrm.scripts.spark_recommend --load_checkpoint_path /shared/ae --parquet /shared/histories.parquet \
        --features_index /shared/ml20m/features_index.txt --output /shared/recs.parquet --output_format parquet

--output_format text writes DSSTNE's predict output, one line per user, byte for byte what
recommender_predict writes for the same users and flags (the lines pass through the driver into one
file). --output_format parquet writes a Parquet directory of user and recommendations
(array<struct<item: string, score: float>>, best first), as Spark ML's ALS does. Either appears only
once complete: a failed run leaves --output as it was. The checkpoint, the datasets and the index
files must be on storage every executor reaches. --checkpoint is kept as an alias of
--load_checkpoint_path. See docs/spark.md.
"""

from __future__ import annotations

import os
import time

from absl import app, flags

from dlrm.scripts import cli
from dlrm.scripts import recommender_common as common
from dlrm.scripts.recommender_common import define_checkpoint_to_load

FLAGS = flags.FLAGS
define_checkpoint_to_load("Checkpoint directory of recommender_train (its --save_checkpoint_path).")
flags.DEFINE_string("input", None, "CSR dataset of the users' histories, as recommender_predict reads (e.g. DIR/input). "
                    "One source of --input, --text, --parquet.")
flags.DEFINE_list("text", None, "DSSTNE text files of the histories (user<TAB>item[,value]:...), comma-separated, "
                  "read in the order given; item names are those of --features_index.")
flags.DEFINE_string("parquet", None, "Parquet table (a file, directory or glob) of the histories: --user_column, "
                    "--items_column (array of item names, or of column numbers), --weights_column (optional).")
flags.DEFINE_string("user_column", "user", "--parquet: the column of the users (any type).")
flags.DEFINE_string("items_column", "items", "--parquet: the array column of each user's items: names (strings, with "
                    "--features_index) or column numbers (integers).")
flags.DEFINE_string("weights_column", "weights", "--parquet: the array column of the items' values (ratings), used "
                    "when the table has it; a null array counts each item 1.0.")
flags.DEFINE_string("features_index", None, "Features (items) index for item names (recommender_generate's "
                    "features_index.txt); default: column numbers. Needed for --text and for item names.")
flags.DEFINE_string("samples_index", None, "--input: samples (users) index for user names; default: row numbers.")
flags.DEFINE_integer("k", 10, "Recommendations per user.", lower_bound=1)
flags.DEFINE_boolean("exclude_inputs", True, "Never recommend the items of a user's own history "
                     "(--noexclude_inputs: allow them).")
flags.DEFINE_string("score_format", "%.6g", "--output_format text: printf format of the scores (one float "
                    "conversion; the % may be left out), as recommender_predict's: %.6g, or %4.3f (DSSTNE's).")
flags.DEFINE_integer("batch_size", 1024, "Users scored at once by a task.", lower_bound=1)
flags.DEFINE_enum("on_error", "fail", ["fail", "skip"], "A malformed --text line or an item the model does not "
                  "know stops the run naming it (fail), or is left out (skip; the user is still scored).")
flags.DEFINE_string("output", None, "Where to write: a text file (--output_format text) or a Parquet directory "
                    "(parquet), replaced if it exists.")
flags.DEFINE_enum("output_format", "text", ["text", "parquet"], "text: DSSTNE's predict output, one file written "
                  "through the driver; parquet: user and recommendations, written by the executors.")
flags.DEFINE_integer("users_per_partition", 65536, "--input: users a Spark task reads and scores.", lower_bound=1)
flags.DEFINE_string("spark_master", None, "Spark master URL; default: spark-submit's, else local[*].")
flags.DEFINE_boolean("overwrite", False, "Replace the recommendations an earlier run wrote at --output; a file or "
                     "folder holding anything else is never replaced.")
flags.mark_flags_as_required(["load_checkpoint_path", "output"])

_SOURCE_FLAGS = {"input": ("samples_index", "users_per_partition"),
                 "text": (),
                 "parquet": ("user_column", "items_column", "weights_column")}


def _local(path: str) -> bool:
    return "://" not in path or path.startswith("file:")


def _check_flags() -> None:
    sources = [name for name in _SOURCE_FLAGS if FLAGS[name].value]
    if len(sources) != 1:
        given = ", ".join(f"--{s}" for s in sources) if sources else "none"
        raise app.UsageError(f"give exactly one source of histories: --input, --text or --parquet (given: {given})")
    source = sources[0]
    for other, names in _SOURCE_FLAGS.items():
        for name in names:
            if other != source and FLAGS[name].present:
                raise app.UsageError(f"--{name} applies to --{other} only; drop it")
    if FLAGS["score_format"].present and FLAGS.output_format != "text":
        raise app.UsageError("--score_format applies to --output_format text only; drop it")
    if source == "input" and not os.path.isdir(FLAGS.input):
        what = "is not a directory" if os.path.exists(FLAGS.input) else "does not exist"
        raise app.UsageError(f"--input {FLAGS.input} {what}; give a CSR dataset directory (e.g. DIR/input of "
                             f"recommender_generate)")
    for path in FLAGS.text or []:
        if _local(path) and not os.path.isfile(path.removeprefix("file:")):
            what = "is a directory; give a file" if os.path.isdir(path) else "no such file"
            raise app.UsageError(f"--text {path}: {what}")
    if source == "parquet" and _local(FLAGS.parquet) and not any(c in FLAGS.parquet for c in "*?[{"):
        if not os.path.exists(FLAGS.parquet.removeprefix("file:")):
            raise app.UsageError(f"--parquet {FLAGS.parquet}: no such file or directory")
    if source == "text" and not FLAGS.features_index:
        raise app.UsageError("--text names items: give --features_index, the features index of the training data")
    for flag in ("features_index", "samples_index"):
        path = FLAGS[flag].value
        if path and not os.path.isfile(path):
            raise app.UsageError(f"--{flag} {path}: no such file")
    common.score_format(FLAGS.score_format)  # imports torch: after the checks of paths, which fail fast


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    _check_flags()
    if FLAGS.input:  # as recommender_predict: the indexes recommender_generate wrote beside --input name things
        for flag in ("features_index", "samples_index"):
            if not FLAGS[flag].present:
                path, _ = common.index_beside(None, FLAGS.input, f"{flag}.txt")
                if path:
                    FLAGS[flag].value = path
                    print(f"--{flag} {path} (beside --input)", flush=True)
    from dlrm.engine.outputs import claim_output
    from dlrm.recommender.prediction_file import PREDICTIONS
    from dlrm.spark.job_io import PARQUET_OUTPUT

    output = FLAGS.output
    if _local(output):  # the output rule (dlrm.engine.outputs), before Spark starts; it also checks the file system
        local = [p.removeprefix("file:") if _local(p) else None for p in (FLAGS.text or [])]
        inputs = {"load_checkpoint_path": FLAGS.load_checkpoint_path, "input": FLAGS.input, "text": local,
                  "parquet": FLAGS.parquet.removeprefix("file:") if FLAGS.parquet and _local(FLAGS.parquet) else None,
                  "features_index": FLAGS.features_index, "samples_index": FLAGS.samples_index}
        kind = PREDICTIONS if FLAGS.output_format == "text" else PARQUET_OUTPUT
        claim_output(output.removeprefix("file:"), kind, "output", inputs=inputs, replace=FLAGS.overwrite)
    from dlrm.spark.recommend import open_recommender

    try:  # before Spark starts: a missing checkpoint or index is one line at once
        recommender = open_recommender(FLAGS.load_checkpoint_path, FLAGS.best, FLAGS.features_index)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    if FLAGS.input:
        from dlrm.recommender.csr_dataset import CsrDataset

        n_items = CsrDataset(FLAGS.input).n_features
        if n_items != recommender.n_input:  # as recommender_predict refuses it
            raise app.UsageError(f"--input {FLAGS.input} has {n_items:,} items, the checkpoint's network "
                                 f"{recommender.n_input:,} inputs; give the dataset (and features index) it was "
                                 f"trained on")
    print(f"model: {recommender.describe()}", flush=True)
    return _run(recommender.path)


def _run(checkpoint: str) -> int:
    from dlrm.engine.checkpoint_store import CheckpointError
    from dlrm.engine.errors import DatasetError
    from dlrm.spark.job_io import task_error, write_parquet
    from dlrm.spark.launch import script_session
    from dlrm.spark.recommend import (read_csr_histories, read_text_histories, recommend, recommend_text,
                                      write_text)

    spark = script_session(FLAGS.spark_master, "local[*]")
    spark.sparkContext.setLogLevel("FATAL")  # a failed task is reported below, once and in one line
    options = dict(k=FLAGS.k, best=False, features_index=FLAGS.features_index, exclude_inputs=FLAGS.exclude_inputs,
                   on_error=FLAGS.on_error, batch_size=FLAGS.batch_size)
    try:
        if FLAGS.input:
            histories = read_csr_histories(spark, FLAGS.input, FLAGS.samples_index, FLAGS.users_per_partition)
        elif FLAGS.text:
            histories = read_text_histories(spark, FLAGS.text, FLAGS.on_error)
        else:
            histories = spark.read.parquet(FLAGS.parquet)
            options.update(user_column=FLAGS.user_column, items_column=FLAGS.items_column,
                           weights_column=FLAGS.weights_column)
        if FLAGS.output_format == "text":
            lines = recommend_text(histories, checkpoint, score_format=FLAGS.score_format, **options)
        else:
            recommended = recommend(histories, checkpoint, **options)
    except ValueError as e:  # the histories do not fit (columns, types, sizes), with the library's names
        raise app.UsageError(str(e)) from None
    except Exception as e:  # Spark's: a path of --parquet it cannot read
        if type(e).__name__ != "AnalysisException":
            raise
        raise app.UsageError(f"--{'parquet' if FLAGS.parquet else 'text'}: {str(e).splitlines()[0]}") from None
    started = time.perf_counter()
    try:
        if FLAGS.output_format == "text":
            users = write_text(lines, FLAGS.output)
        else:
            write_parquet(recommended, FLAGS.output)
            users = spark.read.parquet(FLAGS.output).count()
    except Exception as e:
        error = task_error(e, (DatasetError, CheckpointError))
        if error is None:
            raise
        raise error from None  # one line (cli.run), naming the file and line, or the user and item
    seconds = time.perf_counter() - started
    print(f"wrote {FLAGS.output}: {users:,} users, top {FLAGS.k} items each (inputs "
          f"{'excluded' if FLAGS.exclude_inputs else 'allowed'}), {FLAGS.output_format}")
    # Reading, scoring, exclusion, top K and writing, with the executors' start (their Python workers import
    # torch and load the model); starting the session and checking the model on the driver are not counted.
    print(f"predicted {users:,} users in {seconds:.2f} s ({users / max(seconds, 1e-9):,.0f} users/s)")
    return 0


if __name__ == "__main__":
    cli.run(main)
