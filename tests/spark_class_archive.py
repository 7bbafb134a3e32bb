"""A class-data-sharing archive of the classes a Spark driver loads, for the suite's Spark JVMs.

The suite starts about forty Spark drivers (the tests' sessions, and the Spark commands it runs
as the user would). Each loads some twenty thousand classes from Spark's jars, which on two cores
is most of its start-up. The JVM can map classes it loaded once from an archive instead
(``-XX:SharedArchiveFile``, Java 13 and newer): measured on two cores, a session starts and runs
its first shuffle in half the time. The archive is built once per machine by ``test.sh``
(``python tests/spark_class_archive.py``), from one run of the kinds of jobs the product runs
(Python and Arrow tasks, a shuffle, Parquet and text), into the user's cache, named by the java
binary and pyspark it was built with. ``tests/conftest.py`` passes it to every Spark JVM when it
is there; a JVM that cannot use it (another classpath) runs as without it, silently
(``-Xlog:cds*=off``: the one-line errors the tests check stay one line).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

# What every Spark JVM of the suite gets: Spark's short jobs run best with the C1 compiler alone
# and the serial collector (they start and warm up in half the time on two cores).
BASE_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    found = os.path.join(home, "bin", "java") if home else shutil.which("java")
    return os.path.realpath(found) if found and os.path.isfile(found) else None


def archive_path() -> str | None:
    """Where this machine's archive is (or would be): None without Java or pyspark."""
    java = _java()
    try:
        import pyspark
    except ImportError:
        return None
    if java is None:
        return None
    stat = os.stat(java)
    key = hashlib.sha256(f"{java} {stat.st_size} {stat.st_mtime_ns} {pyspark.__version__} "
                         f"{os.path.dirname(pyspark.__file__)}".encode()).hexdigest()[:12]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "dlrm", f"spark-classes-{key}.jsa")


def java_options() -> str:
    """The driver options for the suite's Spark JVMs: the archive's when it is built."""
    path = archive_path()
    if path and os.path.isfile(path) and " " not in path and "'" not in path:
        return f"{BASE_OPTIONS} -XX:SharedArchiveFile={path} -Xlog:cds*=off"
    return BASE_OPTIONS


def _submit_args(options: str) -> str:
    return f"--driver-java-options '{options}' pyspark-shell"


# The jobs whose classes are archived: one of each kind the product runs.
_JOBS = r"""
import os, sys
import pandas as pd
from dlrm.spark.launch import local_session
out = sys.argv[1]
spark = local_session("local[2]")
frame = spark.range(2000).selectExpr("id", "id % 7 AS k", "CAST(id AS STRING) AS s")
frame.groupBy("k").count().orderBy("k").collect()
frame.join(frame.select("k").distinct(), "k").count()
frame.write.parquet(os.path.join(out, "p"))
spark.read.parquet(os.path.join(out, "p")).mapInPandas(lambda it: (b[["id"]] for b in it), "id long").count()
spark.read.parquet(os.path.join(out, "p")).mapInArrow(lambda it: it, frame.schema).count()
frame.select("s").write.text(os.path.join(out, "t"))
spark.read.text(os.path.join(out, "t")).rdd.map(lambda row: len(row.value)).sum()
spark.createDataFrame(pd.DataFrame({"a": [1, 2]})).collect()
spark.sparkContext.parallelize(range(4), 2).barrier().mapPartitions(lambda it: it).collect()
spark.stop()
"""


def build(path: str) -> None:
    """Runs the jobs in a fresh JVM that writes the classes it loaded to ``path`` as it exits."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(path)) as work:
        staged = os.path.join(work, "classes.jsa")
        env = {**os.environ, "PYSPARK_SUBMIT_ARGS": _submit_args(f"{BASE_OPTIONS} -XX:ArchiveClassesAtExit={staged}"),
               "SPARK_LAUNCHER_OPTS": BASE_OPTIONS}
        proc = subprocess.run([sys.executable, "-c", _JOBS, work], env=env, capture_output=True, text=True,
                              timeout=600)
        if proc.returncode != 0 or not os.path.isfile(staged):
            raise RuntimeError(f"the Spark class archive was not written (exit {proc.returncode}):\n"
                               + proc.stderr[-3000:])
        os.replace(staged, path)


def main() -> int:
    path = archive_path()
    if path is None:
        print("no Java or no pyspark: Spark's JVMs start without a class archive")
        return 0
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two clones testing at once build it once
        if not os.path.isfile(path):
            build(path)
    print(f"Spark class archive: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
