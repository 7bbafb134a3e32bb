r"""Convert CSV/TSV files of integer-coded features into a split-binary dataset.

NVIDIA's form: CSV files described by a CSV feature spec in the input directory (chunks of
``type: csv``; see docs/data_format.md), as NVIDIA's transcode.py takes them:

    python -m dlrm.scripts.transcode --input /data --output /data/converted \
        [--feature_spec_in feature_spec.yaml] [--feature_spec_out feature_spec.yaml] [--chunk_size 65536]

One text file per split, label then numerical then categorical fields:

    python -m dlrm.scripts.transcode --train train.tsv --test test.tsv --output /data/mine \
        --num_numerical 13 --num_categorical 26 [--validation val.tsv] [--delimiter comma] \
        [--cardinalities 10,20,...]

Numericals are rounded to float16 through float32, as NVIDIA's transcode.py does (its bytes);
--numerical_rounding direct rounds them once.

--output is created, or must be empty; a dataset an earlier run wrote there is replaced with
--overwrite, and a folder holding anything else is never written into.
"""

from __future__ import annotations

import os

from absl import app, flags

from dlrm.data.feature_spec import SPEC_FILE_NAME
from dlrm.data.numerical_rounding import DEFAULT_ROUNDING, ROUNDINGS
from dlrm.data.split_binary_writer import SPLIT_BINARY_DATASET
from dlrm.engine.errors import DatasetError
from dlrm.engine.outputs import claim_output
from dlrm.scripts import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "NVIDIA's form: the directory of the CSV files and their feature spec "
                    "(--feature_spec_in).")
flags.DEFINE_string("feature_spec_in", SPEC_FILE_NAME, "NVIDIA's form: the CSV feature spec, relative to --input.")
flags.DEFINE_string("feature_spec_out", SPEC_FILE_NAME, "File name of the written feature spec, in --output.")
flags.DEFINE_string("train", None, "Text file of the train split.")
flags.DEFINE_string("test", None, "Text file of the test split.")
flags.DEFINE_string("validation", None, "Text file of the validation split.")
flags.DEFINE_string("output", None, "Dataset directory to write (created if missing; an existing one must be "
                    "empty, or with --overwrite a dataset this program wrote).")
flags.DEFINE_boolean("overwrite", False, "Replace the dataset an earlier run wrote in --output (never a folder "
                     "holding anything else).")
flags.DEFINE_integer("num_numerical", 13, "Numerical fields per line, after the label.", lower_bound=0)
flags.DEFINE_integer("num_categorical", 26, "Categorical id fields per line, after the numerical ones.", lower_bound=0)
flags.DEFINE_enum("delimiter", "tab", ["tab", "comma"], "Field separator.")
flags.DEFINE_list("cardinalities", None, "Comma-separated cardinality per categorical feature; default: max id + 1 over all splits.")
flags.DEFINE_integer("chunk_size", 1_000_000, "Lines parsed per chunk (bounds memory; NVIDIA's flag).", lower_bound=1)
flags.DEFINE_alias("chunk_rows", "chunk_size")
flags.DEFINE_enum("numerical_rounding", DEFAULT_ROUNDING, list(ROUNDINGS),
                  "float64 -> float16 of the numericals: nvidia (through float32, as NVIDIA's transcode.py: its "
                  "bytes) or direct (once, to the nearest float16; at most one float16 step apart, on values next "
                  "to a midpoint of two float16 values; what this program wrote before the option).")
flags.mark_flags_as_required(["output"])

_TEXT_FLAGS = ("train", "test", "validation", "num_numerical", "num_categorical", "delimiter", "cardinalities")

_DELIMITERS = {"tab": "\t", "comma": ","}


def _from_csv_source() -> int:
    given = [f"--{name}" for name in _TEXT_FLAGS if FLAGS[name].present]
    if given:
        raise app.UsageError(f"--input reads the feature spec's CSV files; leave out {', '.join(given)} (the "
                             f"other form), or drop --input")
    if not os.path.isdir(FLAGS.input):
        raise app.UsageError(f"--input {FLAGS.input} is not a directory; give the directory of the CSV files and "
                             f"their feature spec")
    from dlrm.data.csv_source import CsvSource, source_files

    spec_in = os.path.join(FLAGS.input, FLAGS.feature_spec_in)
    source = CsvSource.from_yaml(spec_in)  # a bad spec: DatasetError (cli.run)
    _claim_output({"input": source_files(source)}, source.splits)
    from dlrm.data.transcode import transcode_csv_source  # torch: once the output is known to be free

    try:
        spec = transcode_csv_source(spec_in, FLAGS.output, spec_out_name=FLAGS.feature_spec_out,
                                    chunk_rows=FLAGS.chunk_size, overwrite=FLAGS.overwrite,
                                    numerical_rounding=FLAGS.numerical_rounding)
    except DatasetError:
        raise
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    print(f"wrote {FLAGS.output}: splits {spec.splits}, cardinalities {spec.cardinalities}, "
          f"spec {os.path.join(FLAGS.output, FLAGS.feature_spec_out)}")
    return 0


def _claim_output(inputs: dict, splits: list[str]) -> None:
    """Before any work: --output is free, or this program's dataset and --overwrite given
    (dlrm.engine.outputs); --feature_spec_out names a file in it, beside the split folders."""
    name = FLAGS.feature_spec_out
    if name in ("", ".", "..") or "/" in name or os.sep in name:
        raise app.UsageError(f"--feature_spec_out {name!r} must be a file name: the spec is written in --output")
    if name in splits:
        raise app.UsageError(f"--feature_spec_out {name!r} is the folder of split '{name}'; choose another name, "
                             f"e.g. {SPEC_FILE_NAME}")
    claim_output(FLAGS.output, SPLIT_BINARY_DATASET, "output", inputs=inputs, replace=FLAGS.overwrite)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.input is not None:
        return _from_csv_source()
    if FLAGS.train is None:
        raise app.UsageError("give --input DIR (CSV files and their feature spec, NVIDIA's form) or --train FILE")
    if FLAGS["feature_spec_in"].present:
        raise app.UsageError("--feature_spec_in goes with --input; the --train form takes the layout from "
                             "--num_numerical and --num_categorical")
    inputs = {name: getattr(FLAGS, name) for name in ("train", "test", "validation") if getattr(FLAGS, name)}
    _claim_output(inputs, list(inputs))
    from dlrm.data.transcode import transcode  # torch: once the output is known to be free

    cardinalities = None
    if FLAGS.cardinalities:
        try:
            cardinalities = [int(c) for c in FLAGS.cardinalities]
        except ValueError:
            raise app.UsageError(f"--cardinalities must be integers, got {FLAGS.cardinalities}") from None
    try:
        spec = transcode(
            inputs,
            FLAGS.output,
            num_numerical=FLAGS.num_numerical,
            num_categorical=FLAGS.num_categorical,
            delimiter=_DELIMITERS[FLAGS.delimiter],
            cardinalities=cardinalities,
            chunk_rows=FLAGS.chunk_size,
            spec_name=FLAGS.feature_spec_out,
            overwrite=FLAGS.overwrite,
            numerical_rounding=FLAGS.numerical_rounding,
        )
    except DatasetError:
        raise  # bad input file: cli.run prints the message (file, line, fix) and exits 2
    except ValueError as e:  # settings the flags' own checks let through
        raise app.UsageError(str(e)) from None
    print(f"wrote {FLAGS.output}: splits {spec.splits}, cardinalities {spec.cardinalities}")
    return 0


if __name__ == "__main__":
    cli.run(main)
