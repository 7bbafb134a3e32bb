r"""Write random CSV files in the layout of a CSV feature spec (NVIDIA's gen_csv), to try transcode.

    python -m dlrm.scripts.gen_csv --feature_spec_in tests/transcoding/small_csv.yaml --output /data --size 1000
    python -m dlrm.scripts.transcode --input /data --output /data/converted

Every CSV file the spec names (each chunk of each split, relative to --output) gets --size lines:
labels 0 or 1, numericals uniform in [0, 1), ids uniform below their cardinality (which must be
an integer). The spec is copied to --output/feature_spec.yaml, where transcode --input finds it.
Existing files are refused unless --overwrite. See docs/data_format.md.
"""

from __future__ import annotations

import os
import shutil

from absl import app, flags

from dlrm.data.atomic import StorageError
from dlrm.data.csv_source import CsvSource, write_random_csv
from dlrm.data.errors import DatasetError
from dlrm.data.feature_spec import SPEC_FILE_NAME
from dlrm.scripts import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("feature_spec_in", SPEC_FILE_NAME, "The CSV feature spec whose files to write (NVIDIA's flag).")
flags.DEFINE_string("output", "/data", "Directory the spec's file paths are relative to (NVIDIA's default /data).")
flags.DEFINE_integer("size", 1000, "Lines per CSV file (rows of every split).", lower_bound=1)
flags.DEFINE_integer("seed", 0, "Seed of the random values.")
flags.DEFINE_boolean("overwrite", False, "Replace CSV files (and a feature_spec.yaml) that exist already.")


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if os.path.exists(FLAGS.output) and not os.path.isdir(FLAGS.output):
        raise app.UsageError(f"--output {FLAGS.output} is a file; give a directory (created if missing)")
    try:
        source = CsvSource.from_yaml(FLAGS.feature_spec_in, base_directory=FLAGS.output)
        spec_copy = os.path.join(os.path.abspath(FLAGS.output), SPEC_FILE_NAME)
        same = os.path.exists(spec_copy) and os.path.samefile(spec_copy, source.path)
        if os.path.exists(spec_copy) and not same and not FLAGS.overwrite:
            raise app.UsageError(f"{spec_copy} exists; pass --overwrite to replace it, or another --output")
        written = write_random_csv(source, FLAGS.size, seed=FLAGS.seed, overwrite=FLAGS.overwrite)
        if not same:
            shutil.copyfile(source.path, spec_copy)
    except DatasetError:
        raise  # a bad spec: cli.run prints its message (file, feature, fix) and exits 2
    except FileExistsError as e:
        raise app.UsageError(f"{e} (--overwrite)") from None
    except StorageError:
        raise
    except OSError as e:
        raise app.UsageError(f"cannot write --output {FLAGS.output}: {e.strerror}"
                             + (f" ({e.filename})" if e.filename else "")) from None
    print(f"wrote {len(written)} CSV files of {FLAGS.size} lines under {FLAGS.output}, and {spec_copy}; "
          f"next: python -m dlrm.scripts.transcode --input {FLAGS.output} --output <dataset>")
    return 0


if __name__ == "__main__":
    cli.run(main)
