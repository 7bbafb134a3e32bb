r"""Write random CSV files in the layout of a CSV feature spec (NVIDIA's gen_csv), to try transcode.

    python -m dlrm.scripts.gen_csv --feature_spec_in tests/transcoding/small_csv.yaml --output /data --size 1000
    python -m dlrm.scripts.transcode --input /data --output /data/converted

Every CSV file the spec names (each chunk of each split, relative to --output) gets --size lines:
labels 0 or 1, numericals uniform in [0, 1), ids uniform below their cardinality (which must be
an integer). The spec is copied to --output/feature_spec.yaml, where transcode --input finds it.
--output is a folder of its own: created, or empty, or (with --overwrite) what an earlier run
wrote; a folder holding anything else is refused. Every file the spec names must lie inside it
(an absolute path or one with '..' is refused). See docs/data_format.md.
"""

from __future__ import annotations

import os
import shutil

from absl import app, flags

from dlrm.data.csv_source import RANDOM_CSV, CsvSource, csv_targets, write_random_csv
from dlrm.data.feature_spec import SPEC_FILE_NAME
from dlrm.engine.atomic import write_atomically
from dlrm.engine.storage import StorageError, check_can_create
from dlrm.engine.errors import DatasetError
from dlrm.engine.outputs import OutputError, claim_output
from dlrm.scripts import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("feature_spec_in", SPEC_FILE_NAME, "The CSV feature spec whose files to write (NVIDIA's flag).")
flags.DEFINE_string("output", "/data", "Directory the spec's file paths are relative to (NVIDIA's default /data).")
flags.DEFINE_integer("size", 1000, "Lines per CSV file (rows of every split).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the random values.")
flags.DEFINE_boolean("overwrite", False, "Replace the CSV files and feature_spec.yaml an earlier run wrote in "
                     "--output (never a folder or file holding anything else).")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    # a bad spec: DatasetError, whose message names the file, the feature and the fix (cli.run)
    source = CsvSource.from_yaml(FLAGS.feature_spec_in, base_directory=FLAGS.output)
    # Before any work (dlrm.engine.outputs): --output is new, empty or an earlier run's (with --overwrite),
    # never the spec's folder nor the working directory; every file the spec names lies inside it.
    output = claim_output(FLAGS.output, RANDOM_CSV, "output", inputs={"feature_spec_in": source.path},
                          replace=FLAGS.overwrite)
    check_can_create(output, "the CSV files", inside=True)  # a read-only file system fails before any file
    spec_copy = os.path.join(output, SPEC_FILE_NAME)
    if any(os.path.realpath(chunk.path) == os.path.realpath(spec_copy)
           for _, chunk in csv_targets(source, overwrite=True)):
        raise app.UsageError(f"{source.path}: a CSV file is named {SPEC_FILE_NAME}, where the spec is copied; "
                             f"rename the file in the spec")
    try:
        written = write_random_csv(source, FLAGS.size, seed=FLAGS.seed, overwrite=FLAGS.overwrite)
        write_atomically(spec_copy, lambda tmp: shutil.copyfile(source.path, tmp), "the feature spec")
    except (DatasetError, OutputError, StorageError):
        raise  # one line naming the file and the fix (cli.run)
    except OSError as e:
        raise app.UsageError(f"cannot write --output {FLAGS.output}: {e.strerror}"
                             + (f" ({e.filename})" if e.filename else "")) from None
    print(f"wrote {len(written)} CSV files of {FLAGS.size} lines under {FLAGS.output}, and {spec_copy}; "
          f"next: python -m dlrm.scripts.transcode --input {FLAGS.output} --output <dataset>")
    return 0


if __name__ == "__main__":
    cli.run(main)
