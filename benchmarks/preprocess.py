"""Throughput and peak memory of the two preprocessing engines on generated Criteo data.

    python benchmarks/preprocess.py --rows 1000000 --dir DIR [--engines local spark] [--workers 1]

Generates ``--rows`` lines as 24 Terabyte-style days under DIR/input_<rows> (kept and reused
across runs; a generation cut short is redone there with --overwrite), then runs
``python -m preproc`` once per engine as a user would (frequency threshold 15, --fresh,
--overwrite: each run replaces the previous run's DIR/<engine>_<rows>; progress lines on
stderr) and prints one line per engine: wall time, rows/s end to end (all rows read, every
pass included) and peak memory. Memory is the resident set size summed over the whole process
tree (the CLI, its worker processes, and for Spark the JVM and its Python workers), sampled
every 0.2 s; shared pages count once per process, so this errs on the high side. The
per-stage lines of the engines are kept in DIR/<engine>_<rows>.log. Finally the two outputs are compared byte for byte.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import subprocess
import sys
import time

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc] + proc.children(recursive=True):
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def run(cmd: list[str], log_path: str) -> tuple[float, int, int]:
    """(seconds, peak summed RSS in bytes, exit status) of ``cmd``, its output to ``log_path``."""
    with open(log_path, "w") as log:
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        ps = psutil.Process(proc.pid)
        peak = 0
        while proc.poll() is None:
            try:
                peak = max(peak, tree_rss(ps))
            except psutil.NoSuchProcess:
                break
            time.sleep(0.2)
        return time.monotonic() - start, peak, proc.returncode


def same_dataset(a: str, b: str) -> bool:
    for root, _, files in os.walk(a):
        for f in files:
            x = os.path.join(root, f)
            if not filecmp.cmp(x, os.path.join(b, os.path.relpath(x, a)), shallow=False):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--dir", required=True, help="scratch directory (inputs are kept for reuse)")
    parser.add_argument("--engines", nargs="+", default=["local", "spark"], choices=["local", "spark"])
    parser.add_argument("--workers", default="auto", help="local engine worker processes")
    parser.add_argument("--threshold", default="15")
    parser.add_argument("--memory_limit_gb", default="4", help="both engines (the JVM heap in Spark local mode)")
    parser.add_argument("--spark_master", default="local[*]")
    args = parser.parse_args()

    src = os.path.join(args.dir, f"input_{args.rows}")
    if not os.path.exists(os.path.join(src, "day_23")):
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "preproc.generate", "--output", src, "--rows", str(args.rows),
                        "--days", "24", "--seed", "0", "--overwrite"], cwd=REPO, check=True)
        print(f"generated {args.rows:,} rows in {time.monotonic() - start:.0f} s", flush=True)
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    print(f"input: {args.rows:,} rows, {size / 1e9:.2f} GB in 24 day files; threshold {args.threshold}; "
          f"{os.cpu_count()} CPUs", flush=True)
    outputs = {}
    for engine in args.engines:
        out = os.path.join(args.dir, f"{engine}_{args.rows}")
        cmd = [sys.executable, "-m", "preproc", "--input_dir", src, "--output", out, "--frequency_threshold",
               args.threshold, "--engine", engine, "--fresh", "--overwrite", "--progress", "log",
               "--memory_limit_gb", args.memory_limit_gb]
        if engine == "local":
            cmd += ["--workers", args.workers]
        else:
            cmd += ["--spark_master", args.spark_master]
        seconds, peak, rc = run(cmd, os.path.join(args.dir, f"{engine}_{args.rows}.log"))
        status = "" if rc == 0 else f"  FAILED (exit {rc}, see the log)"
        print(f"{engine:6s} {seconds:8.1f} s  {args.rows / seconds:10,.0f} rows/s  peak RSS {peak / 2**30:5.2f} GiB"
              f"{status}", flush=True)
        outputs[engine] = out
    if len(outputs) == 2:
        print("outputs byte-identical:", same_dataset(outputs["local"], outputs["spark"]))


if __name__ == "__main__":
    main()
