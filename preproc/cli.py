"""``python -m preproc``: Criteo TSV in, split-binary dataset and feature_spec.yaml out.

    python -m preproc --input_dir /data/criteo --output /data/criteo_fl15 --frequency_threshold 15
    python -m preproc --input_dir /data/kaggle --layout kaggle --output /data/kaggle_bin
    python -m preproc --train a.tsv b.tsv --test c.tsv --validation d.tsv --output out/
    python -m preproc --input_dir /data/criteo --output out/ --engine spark --spark_master spark://host:7077
    python -m preproc --input_dir /data/criteo --output out/ --frequency_threshold 15 --vocabulary_days all  # NVIDIA's dataset

Both engines write the same bytes. An interrupted run resumes when rerun with the same
arguments (finished input files are not redone). Exit status: 0 on success; 2 on bad input or
settings, or when the file system refuses a write (read-only, full, no permission: checked at the
start where it can be), with one line ``error: <message>`` on stderr naming the file, line or flag
and the fix; 1 when a worker process dies; 130 when interrupted. A run that fails before finishing any unit of work
leaves nothing behind; one that fails later keeps its finished units (in the work directory) for
the rerun.

--output is a folder of its own (``dlrm.engine.outputs``): new, empty, an unfinished run's (which
the rerun resumes), or a dataset this program wrote, replaced only with --overwrite; a folder
holding anything else, a link, the working directory and a folder holding the input files are
refused before any work. An explicit --work_dir is new, empty or a work directory of this
program, and apart from --output.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import resource
import shutil
import sys
import time
from concurrent.futures.process import BrokenProcessPool

from dlrm.data.split_binary_writer import PREPROC_WORK_FILES, is_split_binary_dataset
from dlrm.engine.storage import StorageError, check_can_create, describe, fault_of, free_bytes
from dlrm.engine.errors import DatasetError
from dlrm.engine.outputs import OutputError, OutputKind, claim_output, holds_only, under
from dlrm.extras import missing_extra
from preproc.job import DEFAULT_MEMORY_LIMIT, WORK_DIR_NAME, Job
from preproc.layout import detect_layout, file_inputs, kaggle_inputs, parse_days, terabyte_inputs
from preproc.numeric import DEFAULT_ROUNDING, ROUNDINGS
from preproc.progress import Progress
from preproc.reference import VOCABULARY_DAYS, column_thresholds, parse_threshold
from preproc.workdir import MANIFEST


USAGE_ERROR_EXIT = 2

# What a run leaves in --output before the spec is written (split files, the vocabulary, the work
# directory, temporaries): an unfinished run, which the same command resumes.
# (The spec's name is there for its temporary: a written spec makes the run finished.)
_UNFINISHED = (re.compile(r"(train|test|validation)/([^/]+\.bin)?"), "vocabulary/sizes.npy", "vocabulary/table.npy",
               "feature_spec.yaml", *under(WORK_DIR_NAME, PREPROC_WORK_FILES))


def unfinished_run(path: str) -> bool:
    """Whether directory ``path`` holds an unfinished run's output and nothing else (no spec yet)."""
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return not any(n.endswith((".yaml", ".yml")) for n in names) and holds_only(path, _UNFINISHED)


def _is_work_dir(path: str) -> bool:
    """Whether directory ``path`` is a work directory of this program (``preproc.workdir``: its
    manifest) and holds nothing but what that module writes."""
    if not holds_only(path, PREPROC_WORK_FILES, required=[MANIFEST]):
        return False
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and isinstance(manifest.get("identity"), dict) and "settings" in manifest


DATASET = OutputKind("dataset", directory=True, recognise=lambda p: is_split_binary_dataset(p) or unfinished_run(p))
WORK_DIR = OutputKind("preprocessing work directory", directory=True, recognise=_is_work_dir)


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as one line (``error: ...``) instead of usage + error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        print(f"error: {message} (see --help)", file=sys.stderr)
        sys.exit(USAGE_ERROR_EXIT)


def _workers(text: str) -> int | None:
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number of processes, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {'number' if kind is float else 'whole number'}, "
                                             f"got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m preproc",
        description="Preprocess Criteo click logs (TSV, plain or .gz) into a split-binary dataset for dlrm.scripts.main.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    src = p.add_argument_group("input (either --input_dir, or --train and --test)")
    src.add_argument("--input_dir", help="directory with day_0..day_23 (Terabyte) or train.txt (Kaggle)")
    src.add_argument("--layout", choices=["auto", "terabyte", "kaggle"], default="auto",
                     help="how --input_dir is split: terabyte (days 0-22 train, day 23 halves test/validation) "
                          "or kaggle (train.txt as 7 days: 6 train, the 7th halves test/validation)")
    src.add_argument("--train_days", default="0-22", help="terabyte layout: training days, e.g. 0-22 or 0-3,7")
    src.add_argument("--train", nargs="+", metavar="FILE", help="explicit train files")
    src.add_argument("--test", nargs="+", metavar="FILE", help="explicit test files")
    src.add_argument("--validation", nargs="+", metavar="FILE", help="explicit validation files (optional)")
    src.add_argument("--validation_split", choices=["drop", "keep"], default=None,
                     help="--input_dir: the second half of day 23 (Kaggle: of the 7th day) is read and checked but "
                          "not written (drop: the dataset has train and test, as NVIDIA's reader requires), or "
                          "written as a 'validation' split (keep). Default: drop; explicit --validation files are "
                          "always written")

    out = p.add_argument_group("output and transform")
    out.add_argument("--output", required=True, help="dataset directory to write: new or empty, an unfinished run's "
                     "(resumed), or with --overwrite a dataset this program wrote; never a folder holding anything else")
    out.add_argument("--overwrite", action="store_true",
                     help="replace the dataset an earlier run wrote in --output (never a folder holding anything else)")
    out.add_argument("--frequency_threshold", default="0",
                     help="keep values seen at least this often in train: '15', or per column as NVIDIA's "
                          "--frequency_limit, e.g. '14:3,15' (field 14 = C1 -> 3, the others 15); 0 keeps all")
    out.add_argument("--vocabulary_days", choices=list(VOCABULARY_DAYS), default="train",
                     help="rows whose categorical values are counted for the vocabulary: train (only the training "
                          "days; no test row influences ids) or all (train, test and validation rows, as NVIDIA's "
                          "Spark and NVTabular pipelines count; this lets test-day values into the vocabulary)")
    out.add_argument("--numerical_rounding", choices=list(ROUNDINGS), default=DEFAULT_ROUNDING,
                     help="float64 ln(x + 3) -> float16: nvidia (through float32, as NVIDIA's scripts convert: their "
                          "bytes) or direct (once to the nearest float16; what this project wrote before the option)")
    out.add_argument("--on_error", choices=["fail", "skip"], default="fail",
                     help="malformed lines: stop at the first (fail) or leave them out and report counts (skip)")
    out.add_argument("--shuffle_seed", type=int, default=None, help="shuffle the train rows with this seed (default: input order)")

    run = p.add_argument_group("execution")
    run.add_argument("--engine", choices=["local", "spark"], default="local", help="single-machine engine or Spark")
    run.add_argument("--work_dir", default=None, help="for intermediate files and resume state (default: <output>/.preproc_work)")
    run.add_argument("--keep_work_dir", action="store_true", help="keep the work directory after success")
    run.add_argument("--fresh", action="store_true", help="discard an unfinished run in the work directory instead of resuming")
    run.add_argument("--memory_limit_gb", type=_positive(float), default=DEFAULT_MEMORY_LIMIT / 2**30,
                     help="local engine: memory to stay within, besides the vocabulary (sizes spills, buckets and workers)")
    run.add_argument("--workers", type=_workers, default="auto", help="local engine: parsing processes ('auto': CPUs, capped by the memory limit)")
    run.add_argument("--progress", choices=["auto", "bar", "log", "off"], default="auto",
                     help="progress on stderr: a live line on a terminal (bar), periodic lines (log), or none")

    spark = p.add_argument_group("spark engine")
    spark.add_argument("--spark_master", default="local[*]", help="Spark master URL: local[N], spark://host:port, yarn, k8s://...")
    spark.add_argument("--spark_conf", action="append", default=[], metavar="KEY=VALUE",
                       help="extra Spark setting, repeatable (e.g. spark.executor.memory=16g)")
    spark.add_argument("--spark_group_mb", type=_positive(int), default=1024,
                       help="input files are processed (and resumed) in groups of at least this many MB; a day of the "
                            "Terabyte dataset is always its own group")
    return p


def _inputs(args: argparse.Namespace, parser: argparse.ArgumentParser):
    if args.input_dir and (args.train or args.test or args.validation):
        parser.error("give either --input_dir or --train/--test/--validation, not both")
    if args.validation and args.validation_split == "drop":
        parser.error("--validation_split drop contradicts the --validation files given; leave one of them out")
    if args.input_dir:
        layout = detect_layout(args.input_dir) if args.layout == "auto" else args.layout
        if layout == "terabyte":
            return terabyte_inputs(args.input_dir, parse_days(args.train_days))
        return kaggle_inputs(args.input_dir)
    if not args.train or not args.test:
        parser.error("give --input_dir, or both --train and --test")
    return file_inputs(args.train, args.test, args.validation)


def _spark_conf(items: list[str], parser: argparse.ArgumentParser) -> dict[str, str]:
    conf = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            parser.error(f"--spark_conf {item!r}: expected KEY=VALUE")
        conf[key.strip()] = value.strip()
    return conf


def _peak_rss_mb() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return max(own, children) / 1024


def _missing_dirs(path: str) -> list[str]:
    """``path`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def _finished_units(work_dir: str) -> bool:
    """Whether the work directory records a finished unit (a marker besides the manifest)."""
    for _, _, files in os.walk(work_dir):
        if any(name.endswith(".json") and name != "manifest.json" for name in files):
            return True
    return False


def _clean_up(created: list[str], work_dir: str) -> None:
    """After a failure: remove what this run created, unless it holds finished work to resume."""
    if os.path.abspath(work_dir) in created and os.path.isdir(work_dir) and not _finished_units(work_dir):
        shutil.rmtree(work_dir, ignore_errors=True)
    for path in created:  # deepest first; only those left empty
        try:
            os.rmdir(path)
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    work_dir = args.work_dir or os.path.join(args.output, WORK_DIR_NAME)
    created = sorted(set(_missing_dirs(work_dir) + _missing_dirs(args.output)), key=len, reverse=True)
    try:
        return _run(args, parser)
    except KeyboardInterrupt:
        print(f"\ninterrupted; rerun the same command to resume (finished input files are kept in {work_dir})",
              file=sys.stderr)
        return 130
    except (DatasetError, ValueError, OSError) as e:
        refused = _refused_write(e, args.output, work_dir)  # before the clean-up: a full disk is seen full
        _clean_up(created, work_dir)
        message = _one_line(e) if refused is None else str(describe(*refused))  # the space freed counts
        if isinstance(e, OutputError):
            message = _flags(message)
        print(f"error: {message}", file=sys.stderr)
        return USAGE_ERROR_EXIT
    except ImportError as e:
        _clean_up(created, work_dir)
        message = missing_extra(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return USAGE_ERROR_EXIT
    except BrokenProcessPool:
        print("error: a worker process died (out of memory? try a lower --memory_limit_gb or fewer --workers); "
              "rerun the same command to resume", file=sys.stderr)
        return 1
    except BaseException:
        _clean_up(created, work_dir)
        raise


def _refused_write(e: BaseException, output: str, work_dir: str) -> tuple[int, str, str] | None:
    """(errno, path, what) when ``e`` is the file system refusing a write to the output or the
    work directory (a full disk's error names no file: then the fuller of the two)."""
    if isinstance(e, StorageError) or not isinstance(e, OSError):
        return None
    places = [(work_dir, "the work directory"), (output, "the dataset")]
    if getattr(e, "filename", None) is None:
        places.sort(key=lambda place: free_bytes(place[0]) or 0)
    for path, what in places:
        if (code := fault_of(e, path)) is not None:
            return code, path, what
    return None


def _one_line(e: BaseException) -> str:
    """The message on one line; the system's errors (no such file, no permission) with the file they name."""
    if isinstance(e, OSError) and not isinstance(e, StorageError) and e.errno is not None and e.strerror:
        message = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    else:
        message = str(e)
    return "; ".join(part.strip() for part in message.splitlines() if part.strip())


def _check_directory(flag: str, path: str) -> None:
    """``path`` must be a directory or creatable as one: no file in its place or on its way."""
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        where = "is a file" if existing == os.path.abspath(path) else f"is under {existing}, which is a file"
        raise ValueError(f"{flag} {path} {where}; give a directory (created if missing)")
    check_can_create(path, flag, inside=True)  # a read-only file system, no permission


def _check_splits_have_data(job: Job) -> None:
    """Fail before any work when every file of a split is empty (0 bytes)."""
    for split in job.splits:
        files = job.split_files(split)
        if files and all(os.path.getsize(f) == 0 for f in files):
            raise DatasetError(f"split '{split}' has no rows: its files {files} are empty")


def _claim(args: argparse.Namespace, files: list[str]) -> None:
    """Before any work: --output and --work_dir may be written (``dlrm.engine.outputs``)."""
    inputs = {"input_dir": files} if args.input_dir else {"train": args.train, "test": args.test,
                                                            "validation": args.validation}
    claim_output(args.output, DATASET, "output", inputs=inputs, replace=args.overwrite,
                 keep=os.path.isdir(args.output) and unfinished_run(args.output))
    if args.work_dir:
        claim_output(args.work_dir, WORK_DIR, "work_dir", inputs=inputs, keep=True)
        work, output = (os.path.realpath(os.path.abspath(p)) for p in (args.work_dir, args.output))
        if work == output or output.startswith(work.rstrip(os.sep) + os.sep):
            raise OutputError(f"`work_dir` {args.work_dir} holds `output` {args.output}: the work directory is "
                              "removed when the run ends; choose a folder apart from the output; nothing was changed")


def _flags(message: str) -> str:
    """A library message's `setting` names as this command's flags."""
    return re.sub(r"`(\w+)`", lambda m: f"--{m.group(1)}", message)


def _run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    inputs = _inputs(args, parser)
    _claim(args, [f.path for f in inputs])
    _check_directory("--output", args.output)
    if args.work_dir:
        _check_directory("--work_dir", args.work_dir)
    thresholds = column_thresholds(parse_threshold(args.frequency_threshold))
    # Validation derived from --input_dir (half of the last day) is dropped unless kept.
    drop = args.input_dir is not None and (args.validation_split or "drop") == "drop"
    job = Job(
        inputs, args.output, thresholds, on_error=args.on_error, shuffle_seed=args.shuffle_seed,
        work_dir=args.work_dir, memory_limit=int(args.memory_limit_gb * 2**30), keep_work_dir=args.keep_work_dir,
        fresh=args.fresh, vocabulary_days=args.vocabulary_days, numerical_rounding=args.numerical_rounding,
        unwritten_splits=("validation",) if drop else (),
    )
    job.check_inputs()
    _check_splits_have_data(job)
    progress = Progress(args.progress)
    start = time.monotonic()
    if args.engine == "local":
        from preproc.local_engine import preprocess_local

        result = preprocess_local(job, progress, workers=args.workers)
    else:
        from preproc.spark_engine import preprocess_spark

        result = preprocess_spark(job, progress, master=args.spark_master, conf=_spark_conf(args.spark_conf, parser),
                                  group_bytes=args.spark_group_mb << 20)
    seconds = time.monotonic() - start
    total = sum(result.rows.values())
    print(f"wrote {args.output}: " + ", ".join(f"{s} {n:,} rows" for s, n in result.rows.items()))
    if "validation" in job.unwritten_splits and "validation" in job.splits:
        print("validation rows (the second half of the last day) read and checked but not written; "
              "--validation_split keep writes them")
    print(f"cardinalities: {result.spec.cardinalities}")
    print(f"{total:,} rows in {seconds:.1f} s ({total / max(seconds, 1e-9):,.0f} rows/s end to end, engine {args.engine}"
          f"{', resumed' if result.resumed else ''}); peak RSS of this process {_peak_rss_mb():,.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
