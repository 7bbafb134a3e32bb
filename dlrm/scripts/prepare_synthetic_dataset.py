r"""Write a synthetic split-binary dataset (labels from a hidden model, so it can be learned).

    python -m dlrm.scripts.prepare_synthetic_dataset --synthetic_dataset_dir /data/synthetic
    python -m dlrm.scripts.prepare_synthetic_dataset --synthetic_dataset_dir /data/fl15 \
        --preset criteo_fl15 --synthetic_dataset_num_entries 100000000
    python -m dlrm.scripts.prepare_synthetic_dataset --synthetic_dataset_dir /data/dlrmv2 \
        --preset mlperf_dlrmv2 --max_table_size 100000      # multi-hot, MLPerf DLRMv2's shape
    python -m dlrm.scripts.prepare_synthetic_dataset --feature_spec tests/feature_specs/default.yaml \
        --synthetic_dataset_dir /tmp/generated       # NVIDIA's: a dataset shaped by a feature spec

The result trains like any other dataset: python -m dlrm.scripts.main --dataset /data/synthetic
Without --num_validation_entries it has train and test splits only, as NVIDIA's reader requires.
"""

from __future__ import annotations

import os
import sys
import time

from absl import app, flags

from dlrm.data.split_binary_writer import SPLIT_BINARY_DATASET
from dlrm.engine.storage import StorageError
from dlrm.engine.errors import DatasetError
from dlrm.engine.outputs import claim_output
from dlrm.scripts import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("synthetic_dataset_dir", None, "Dataset directory to write: absent or empty, or (with "
                    "--overwrite) a dataset this program wrote; a folder holding anything else is refused.")
flags.DEFINE_string("feature_spec", None,
                    "A feature spec (feature_spec.yaml, or a dataset directory holding one) to shape the dataset "
                    "by: its features, names, cardinalities, dtypes, bag sizes, splits and file paths (NVIDIA's "
                    "flag). It replaces --num_numerical_features, --synthetic_dataset_table_sizes, --preset and "
                    "the multi-hot flags; rows per split: train --synthetic_dataset_num_entries, validation "
                    "--num_validation_entries if given, every other split --num_test_entries.")
flags.DEFINE_integer("num_numerical_features", 13, "Numerical features per sample.", lower_bound=0)
flags.DEFINE_list("synthetic_dataset_table_sizes", [str(100_000)] * 26,
                  "Comma-separated rows per categorical feature (ignored with --preset criteo_fl15).")
flags.DEFINE_enum("preset", "none", ["none", "criteo_fl15", "mlperf_dlrmv2"],
                  "criteo_fl15: the 26 cardinalities of NVIDIA's Criteo 1TB with frequency threshold 15; "
                  "mlperf_dlrmv2: MLPerf DLRMv2's 40M-capped cardinalities and multi-hot sizes (flags given on the "
                  "command line win).")
flags.DEFINE_list("synthetic_multi_hot_sizes", [],
                  "Ids per sample of each table (comma-separated, one per table), or 'mlperf'. Empty: one-hot.")
flags.DEFINE_enum("synthetic_pooling", "sum", ["sum", "mean"], "Pooling written into the feature spec for every bag.")
flags.DEFINE_float("synthetic_zipf_exponent", 1.2,
                   "Skew of the ids: id i of every table is drawn with probability ~ (i + 1) ** -exponent (1.2: a "
                   "few rows take most lookups, as in Criteo's tables; 1.1 and 1.01: the flatter laws of HugeCTR's "
                   "embedding-cache benchmarks). Must be > 0. The same flag of dlrm.scripts.main generates the "
                   "same ids, so a dataset written here trains as the generated one does.")
flags.DEFINE_enum("bag_layout", "fixed", ["fixed", "variable"],
                  "fixed: [rows, L] ids per bag file with -1 padding (MLPerf's synthetic layout); variable: "
                  "values + int64 offsets files (docs/data_format.md).")
flags.DEFINE_integer("max_table_size", None, "Cap every table at this many rows (reduced MLPerf shapes on a CPU).",
                     lower_bound=1)
flags.DEFINE_integer("synthetic_dataset_num_entries", 1 << 22, "Rows of the train split.", lower_bound=0)
flags.DEFINE_integer("num_test_entries", 1 << 19, "Rows of the test split.", lower_bound=0)
flags.DEFINE_integer("num_validation_entries", 0,
                     "Rows of the validation split (0: none, as NVIDIA's reader, which takes train and test "
                     "only, requires).", lower_bound=0)
flags.DEFINE_integer("seed", 12345, "Seed of the hidden model and the samples.")
flags.DEFINE_integer("batch_size", 65536, "Rows generated and written at a time.", lower_bound=1)
flags.DEFINE_boolean("overwrite", False, "Replace the dataset an earlier run wrote in --synthetic_dataset_dir "
                     "(never a folder holding anything else).")
flags.mark_flag_as_required("synthetic_dataset_dir")


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _split_bytes(path: str) -> dict[str, int]:
    """Bytes of each split's files (a spec's files may lie anywhere in the dataset directory)."""
    from dlrm.data.feature_spec import FeatureSpec

    spec = FeatureSpec.from_yaml(path)
    return {split: sum(os.path.getsize(os.path.join(path, f)) for chunk in chunks for f in chunk["files"])
            for split, chunks in spec.source_spec.items()}


def _multi_hot_sizes() -> list[int] | None:
    from dlrm.data.synthetic import MLPERF_MULTI_HOT_SIZES

    values = FLAGS.synthetic_multi_hot_sizes
    if not values and FLAGS.preset == "mlperf_dlrmv2":
        values = ["mlperf"]
    if not values:
        return None
    if values == ["mlperf"]:
        return list(MLPERF_MULTI_HOT_SIZES)
    try:
        sizes = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--synthetic_multi_hot_sizes must be integers or 'mlperf', got {','.join(values)}") from None
    if any(size < 1 for size in sizes):
        raise app.UsageError(f"--synthetic_multi_hot_sizes must be positive, got {','.join(values)}")
    return sizes


_SPEC_REPLACES = ("num_numerical_features", "synthetic_dataset_table_sizes", "preset", "synthetic_multi_hot_sizes",
                  "synthetic_pooling", "bag_layout", "max_table_size")


def _spec_samples(splits: list[str]) -> dict[str, int]:
    """Rows of each split of a --feature_spec."""
    rows = {}
    for split in splits:
        if split == "train":
            rows[split] = FLAGS.synthetic_dataset_num_entries
        elif split == "validation" and FLAGS["num_validation_entries"].present:
            rows[split] = FLAGS.num_validation_entries
        else:
            rows[split] = FLAGS.num_test_entries
    return {split: n for split, n in rows.items() if n > 0}


def _write_for_spec() -> dict[str, int]:
    from dlrm.data.feature_spec import FeatureSpec
    from dlrm.data.synthetic import write_synthetic_dataset_for_spec

    given = [f"--{name}" for name in _SPEC_REPLACES if FLAGS[name].present]
    if given:
        raise app.UsageError(f"--feature_spec sets the features; leave out {', '.join(given)}")
    spec = FeatureSpec.from_yaml(FLAGS.feature_spec)  # a bad spec: DatasetError naming the file and the fix
    samples = _spec_samples(spec.splits)
    if not samples:
        raise app.UsageError("every split has 0 rows; nothing to write")
    write_synthetic_dataset_for_spec(FLAGS.synthetic_dataset_dir, spec, samples, batch_size=FLAGS.batch_size,
                                     seed=FLAGS.seed, overwrite=FLAGS.overwrite, progress=_progress,
                                     zipf_exponent=FLAGS.synthetic_zipf_exponent)
    return samples


def _progress(split: str, done: int, total: int) -> None:
    if sys.stdout.isatty():
        print(f"\r{split}: {done}/{total} rows", end="" if done < total else "\n", flush=True)


def _write_from_flags() -> tuple[dict[str, int], str, int]:
    """The dataset of the layout flags; returns (rows per split, kind of bags, tables)."""
    from dlrm.data.synthetic import FL15_CARDINALITIES, MLPERF_DLRMV2_CARDINALITIES, write_synthetic_dataset

    if FLAGS.preset == "criteo_fl15":
        table_sizes = list(FL15_CARDINALITIES)
    elif FLAGS.preset == "mlperf_dlrmv2" and not FLAGS["synthetic_dataset_table_sizes"].present:
        table_sizes = list(MLPERF_DLRMV2_CARDINALITIES)
    else:
        try:
            table_sizes = [int(s) for s in FLAGS.synthetic_dataset_table_sizes]
        except ValueError:
            raise app.UsageError(f"--synthetic_dataset_table_sizes must be integers, got {FLAGS.synthetic_dataset_table_sizes}") from None
        if any(s < 1 for s in table_sizes):
            raise app.UsageError(f"--synthetic_dataset_table_sizes must be at least 1 (rows per table), "
                                 f"got {FLAGS.synthetic_dataset_table_sizes}")
    if FLAGS.max_table_size is not None:
        table_sizes = [min(size, FLAGS.max_table_size) for size in table_sizes]
    bag_sizes = _multi_hot_sizes()
    rows = {"train": FLAGS.synthetic_dataset_num_entries, "test": FLAGS.num_test_entries,
            "validation": FLAGS.num_validation_entries}
    samples = {split: n for split, n in rows.items() if n > 0}  # a split of 0 rows is left out
    if not samples:
        raise app.UsageError("every split has 0 rows; nothing to write")
    write_synthetic_dataset(FLAGS.synthetic_dataset_dir, FLAGS.num_numerical_features, table_sizes, samples,
                            batch_size=FLAGS.batch_size, seed=FLAGS.seed, overwrite=FLAGS.overwrite,
                            progress=_progress, bag_sizes=bag_sizes, pooling=FLAGS.synthetic_pooling,
                            bag_layout=FLAGS.bag_layout, zipf_exponent=FLAGS.synthetic_zipf_exponent)
    kind = "one-hot" if bag_sizes is None else f"multi-hot ({FLAGS.bag_layout} bags, {FLAGS.synthetic_pooling} pooling)"
    return samples, kind, len(table_sizes)


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.synthetic_zipf_exponent > 0:  # before the output folder is claimed
        raise app.UsageError(f"--synthetic_zipf_exponent must be > 0, got {FLAGS.synthetic_zipf_exponent}")
    # Before any work: a foreign folder, a link, the working directory or the spec itself is refused.
    claim_output(FLAGS.synthetic_dataset_dir, SPLIT_BINARY_DATASET, "synthetic_dataset_dir",
                 inputs={"feature_spec": FLAGS.feature_spec}, replace=FLAGS.overwrite)
    start = time.perf_counter()
    try:
        if FLAGS.feature_spec is not None:
            samples = _write_for_spec()
        else:
            samples, kind, tables = _write_from_flags()
    except DatasetError:
        raise  # a bad --feature_spec: its message names the file, the feature and the fix (cli.run)
    except ValueError as e:  # settings the flags' own checks let through
        raise app.UsageError(str(e)) from None
    except StorageError:
        raise  # a read-only or full disk, no permission: its message names the path and the fix (cli.run)
    except OSError as e:
        if e.errno is None:  # no code to word: the message as it is
            raise app.UsageError(str(e)) from None
        raise app.UsageError(f"cannot write --synthetic_dataset_dir {FLAGS.synthetic_dataset_dir}: "
                             f"{e.strerror}" + (f" ({e.filename})" if e.filename else "")) from None
    seconds = time.perf_counter() - start
    out = FLAGS.synthetic_dataset_dir
    if FLAGS.feature_spec is not None:
        print(f"wrote {out} in {seconds:.1f} s, shaped by {FLAGS.feature_spec}, seed {FLAGS.seed}")
    else:
        print(f"wrote {out} in {seconds:.1f} s: {FLAGS.num_numerical_features} numerical, {tables} {kind} "
              f"categorical features, seed {FLAGS.seed}")
    split_bytes = _split_bytes(out)
    for split, rows in samples.items():
        print(f"  {split:<10} {rows:>12} rows {split_bytes[split]:>16} bytes")
    total_rows = sum(samples.values())
    print(f"  {'total':<10} {total_rows:>12} rows {_dir_bytes(out):>16} bytes "
          f"({total_rows / max(seconds, 1e-9):.0f} rows/s)")
    return 0


if __name__ == "__main__":
    cli.run(main)
