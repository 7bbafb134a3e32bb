r"""Convert CSV/TSV files of integer-coded features into a split-binary dataset.

    python -m dlrm.scripts.transcode --train train.tsv --test test.tsv --output /data/mine \
        --num_numerical 13 --num_categorical 26 [--validation val.tsv] [--delimiter comma] \
        [--cardinalities 10,20,...]
"""

from __future__ import annotations

import os

from absl import app, flags

from dlrm.data.errors import DatasetError
from dlrm.data.transcode import transcode
from dlrm.scripts import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("train", None, "Text file of the train split.")
flags.DEFINE_string("test", None, "Text file of the test split.")
flags.DEFINE_string("validation", None, "Text file of the validation split.")
flags.DEFINE_string("output", None, "Dataset directory to write (created if missing).")
flags.DEFINE_integer("num_numerical", 13, "Numerical fields per line, after the label.", lower_bound=0)
flags.DEFINE_integer("num_categorical", 26, "Categorical id fields per line, after the numerical ones.", lower_bound=0)
flags.DEFINE_enum("delimiter", "tab", ["tab", "comma"], "Field separator.")
flags.DEFINE_list("cardinalities", None, "Comma-separated cardinality per categorical feature; default: max id + 1 over all splits.")
flags.DEFINE_integer("chunk_rows", 1_000_000, "Lines parsed per chunk (bounds memory).", lower_bound=1)
flags.mark_flags_as_required(["train", "output"])

_DELIMITERS = {"tab": "\t", "comma": ","}


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    inputs = {name: getattr(FLAGS, name) for name in ("train", "test", "validation") if getattr(FLAGS, name)}
    cardinalities = None
    if FLAGS.cardinalities:
        try:
            cardinalities = [int(c) for c in FLAGS.cardinalities]
        except ValueError:
            raise app.UsageError(f"--cardinalities must be integers, got {FLAGS.cardinalities}") from None
    if os.path.exists(FLAGS.output) and not os.path.isdir(FLAGS.output):
        raise app.UsageError(f"--output {FLAGS.output} is a file; give a directory (created if missing)")
    try:
        spec = transcode(
            inputs,
            FLAGS.output,
            num_numerical=FLAGS.num_numerical,
            num_categorical=FLAGS.num_categorical,
            delimiter=_DELIMITERS[FLAGS.delimiter],
            cardinalities=cardinalities,
            chunk_rows=FLAGS.chunk_rows,
        )
    except DatasetError:
        raise  # bad input file: cli.run prints the message (file, line, fix) and exits 2
    except ValueError as e:  # settings the flags' own checks let through
        raise app.UsageError(str(e)) from None
    print(f"wrote {FLAGS.output}: splits {spec.splits}, cardinalities {spec.cardinalities}")
    return 0


if __name__ == "__main__":
    cli.run(main)
