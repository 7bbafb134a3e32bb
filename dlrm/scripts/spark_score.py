r"""Score rows in Spark with an exported ONNX model; write them with a click_probability column.

    python -m dlrm.scripts.spark_score --model /shared/model.onnx --dataset /shared/criteo_fl15 \
        --split test --output /shared/scores.parquet                      # a split of the dataset
    python -m dlrm.scripts.spark_score --model /shared/model.onnx --dataset /shared/criteo_fl15 \
        --raw '/shared/criteo/day_23' --output /shared/scores.parquet     # raw Criteo TSV lines

Raw lines are transformed as preprocessing transformed the dataset (its vocabulary/ and
numerical transform), so --dataset is needed with --raw too. Rows with a label also get their
AUC printed. --output appears only once every row is scored (a failed run leaves it as it
was). See docs/spark.md.
"""

from __future__ import annotations

import glob

from absl import app, flags

from dlrm.engine.outputs import claim_output

from dlrm.scripts import cli
from dlrm.spark.job_io import PARQUET_OUTPUT, read_raw_lines, task_error, write_parquet
from dlrm.spark.launch import script_session
from dlrm.spark.score import LABEL, OUTPUT, model_inputs, model_maps_any_id, prepare_raw_rows, read_dataset, score

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "The ONNX model (python -m dlrm.scripts.export --format onnx).")
flags.DEFINE_string("dataset", None, "The split-binary dataset (its feature spec, and vocabulary/ for --raw).")
flags.DEFINE_string("split", None, "Score this split of --dataset (train, test, validation).")
flags.DEFINE_string("raw", None, "Score these raw Criteo TSV files instead (a path or glob Spark reads as text).")
flags.DEFINE_enum("on_error", "fail", ["fail", "skip"],
                  "--raw: a malformed line stops the run naming its file and line (fail), or is left out (skip).")
flags.DEFINE_boolean("hash_indices", False, "--split: score ids outside a feature's cardinality too; the model "
                     "must map them (exported from a run with --hash_indices).")
flags.DEFINE_string("output", None, "Parquet directory to write: absent, empty, or an earlier output of this "
                    "command (replaced with --overwrite only); a folder holding anything else is never replaced.")
flags.DEFINE_boolean("overwrite", False, "Replace the Parquet output an earlier run wrote at --output.")
flags.DEFINE_string("spark_master", None, "Spark master URL; default: spark-submit's, else local[*].")
flags.mark_flags_as_required(["model", "dataset", "output"])


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if (FLAGS.split is None) == (FLAGS.raw is None):
        raise app.UsageError("give --split (rows of --dataset) or --raw (raw TSV files), not both")
    if "://" not in FLAGS.output or FLAGS.output.startswith("file:"):  # a local path: the output rule, now
        raw = [p for p in glob.glob(FLAGS.raw.removeprefix("file:"))] if FLAGS.raw else None
        claim_output(FLAGS.output.removeprefix("file:"), PARQUET_OUTPUT, "output", replace=FLAGS.overwrite,
                     inputs={"model": FLAGS.model, "dataset": FLAGS.dataset, "raw": raw})
    try:
        model_inputs(FLAGS.model)  # before a session starts
    except ValueError as e:
        raise app.UsageError(f"--model {e}") from None
    if FLAGS.hash_indices and not model_maps_any_id(FLAGS.model):
        raise app.UsageError(f"--hash_indices: {FLAGS.model} does not map ids outside its tables (it was trained "
                             "without --hash_indices); drop --hash_indices")
    spark = script_session(FLAGS.spark_master, "local[*]")
    spark.sparkContext.setLogLevel("FATAL")  # a failed task is reported below, once and in one line
    if FLAGS.raw:
        rows = prepare_raw_rows(read_raw_lines(spark, FLAGS.raw), FLAGS.dataset, on_error=FLAGS.on_error)
    else:
        rows = read_dataset(spark, FLAGS.dataset, FLAGS.split, hash_indices=FLAGS.hash_indices)
    try:
        scored = score(rows, FLAGS.model)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    try:
        write_parquet(scored, FLAGS.output)
    except Exception as e:
        error = task_error(e)
        if error is None:
            raise
        raise error from None  # one line (cli.run), naming the file and row
    written = spark.read.parquet(FLAGS.output)
    print(f"wrote {written.count():,} rows to {FLAGS.output}")
    if LABEL in written.columns and written.select(LABEL).distinct().count() == 2:
        from pyspark.ml.evaluation import BinaryClassificationEvaluator

        # numBins=0: the exact area, computed by the executors (no rows collected on the driver)
        evaluator = BinaryClassificationEvaluator(rawPredictionCol=OUTPUT, labelCol=LABEL, numBins=0)
        labelled = written.select(written[LABEL].cast("double"), written[OUTPUT].cast("double"))
        print(f"auc {evaluator.evaluate(labelled):.6f}")
    return 0


if __name__ == "__main__":
    cli.run(main)
