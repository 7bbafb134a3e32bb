r"""Score rows in Spark with an exported ONNX model; write them with a click_probability column.

    python -m dlrm.scripts.spark_score --model /shared/model.onnx --dataset /shared/criteo_fl15 \
        --split test --output /shared/scores.parquet                      # a split of the dataset
    python -m dlrm.scripts.spark_score --model /shared/model.onnx --dataset /shared/criteo_fl15 \
        --raw '/shared/criteo/day_23' --output /shared/scores.parquet     # raw Criteo TSV lines

Raw lines are transformed as preprocessing transformed the dataset (its vocabulary/ and
numerical transform), so --dataset is needed with --raw too. Rows with a label also get their
AUC printed. See docs/spark.md.
"""

from __future__ import annotations

from absl import app, flags

from dlrm.scripts import cli
from dlrm.spark.launch import script_session
from dlrm.spark.score import LABEL, OUTPUT, prepare_raw_rows, read_dataset, score

FLAGS = flags.FLAGS
flags.DEFINE_string("model", None, "The ONNX model (python -m dlrm.scripts.export --format onnx).")
flags.DEFINE_string("dataset", None, "The split-binary dataset (its feature spec, and vocabulary/ for --raw).")
flags.DEFINE_string("split", None, "Score this split of --dataset (train, test, validation).")
flags.DEFINE_string("raw", None, "Score these raw Criteo TSV files instead (a path or glob Spark reads as text).")
flags.DEFINE_string("output", None, "Parquet directory to write (Spark's overwrite mode).")
flags.DEFINE_string("spark_master", None, "Spark master URL; default: spark-submit's, else local[*].")
flags.mark_flags_as_required(["model", "dataset", "output"])


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if (FLAGS.split is None) == (FLAGS.raw is None):
        raise app.UsageError("give --split (rows of --dataset) or --raw (raw TSV files), not both")
    spark = script_session(FLAGS.spark_master, "local[*]")
    if FLAGS.raw:
        rows = prepare_raw_rows(spark.read.option("lineSep", "\n").text(FLAGS.raw), FLAGS.dataset)
    else:
        rows = read_dataset(spark, FLAGS.dataset, FLAGS.split)
    try:
        scored = score(rows, FLAGS.model)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    scored.write.mode("overwrite").parquet(FLAGS.output)
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
