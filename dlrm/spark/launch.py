"""Training launched on a Spark cluster: the same entry point as ``torchrun``, as a barrier stage.

``pyspark.ml.torch.distributor.TorchDistributor`` starts one Spark task per process (per GPU
with ``use_gpu``), all at once (a barrier stage), and each task runs ``torchrun`` on
``dlrm/spark/dlrm_task.py`` with the run's ``RunConfig`` (``to_dict`` as JSON, rebuilt there
with ``from_dict``) and the rendezvous set up by Spark. The training is then the one a
``torchrun`` command runs: same planner, same exchange, same numbers.

Work is never lost to a lost task: a barrier stage fails as a whole when one task dies, so
every attempt here runs with ``resume`` and its ``save_checkpoint_path``: the next attempt
(``attempts``) resumes from the last checkpoint, exactly where it was saved.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

FAILED = ("error", "aborted", "interrupted", "non_finite_loss")  # stop reasons of a run that did not finish
# Errors of a run's input (main exits 2 on them, its summary names the class): another attempt fails the same way.
USER_ERRORS = ("UsageError", "DatasetError", "FeatureSpecError", "CheckpointError", "PlanError",
               "NonFiniteLoss", "OutputError")  # not retried: the next attempt would meet them again


def read_summaries(log_path: str) -> list[dict[str, Any]]:
    """The ``summary`` records of a run's JSON log (one per attempt that got to write it)."""
    if not os.path.isfile(log_path):
        return []
    with open(log_path, encoding="utf-8") as f:
        return [record for record in map(json.loads, f) if record.get("type") == "summary"]


def run_attempts(entry_point: str, argument: str, num_processes: int, log_path: str, checkpoint_path: str,
                 use_gpu: bool = False, attempts: int = 2) -> dict[str, Any]:
    """Runs ``entry_point`` (a module run as a file) under torchrun in ``num_processes`` Spark
    tasks with ``argument``, up to ``attempts`` times, and returns the ``summary`` record that
    the run writes to ``log_path``. Each attempt must resume from ``checkpoint_path``, so a
    failed attempt costs only the steps since its last checkpoint; a run stopped by its input (a
    setting, the dataset) is not retried: that error's message is raised as a ``ValueError``.
    Runs on the active Spark session; the product checks its config before calling this."""
    from pyspark.ml.torch.distributor import TorchDistributor

    if num_processes < 1 or attempts < 1:
        raise ValueError(f"`num_processes` ({num_processes}) and `attempts` ({attempts}) must be at least 1")
    for attempt in range(1, attempts + 1):
        started, summaries = time.time(), len(read_summaries(log_path))
        failure: BaseException | None = None
        try:
            TorchDistributor(num_processes=num_processes, local_mode=False, use_gpu=use_gpu).run(
                importlib.util.find_spec(entry_point).origin, argument)
        except Exception as error:  # the barrier stage failed
            failure = error
        # pyspark's torchrun wrapper exits 0 whatever torchrun returns, so the run's own log says
        # whether it finished: a summary of this attempt that is not a failure.
        new = read_summaries(log_path)[summaries:]
        if new and new[-1]["stop_reason"] not in FAILED and failure is None:
            return new[-1]
        error_class, _, message = new[-1].get("error", "").partition(": ") if new else ("", "", "")
        if error_class in USER_ERRORS:
            raise ValueError(message)
        reason = (f"{new[-1]['stop_reason']}: {new[-1].get('error', '')}" if new
                  else f"{type(failure).__name__}" if failure else "no summary written")
        if attempt == attempts:
            raise RuntimeError(f"training failed on attempt {attempt} of {attempts} ({reason}); its checkpoint "
                               f"is at {checkpoint_path} and its log at {log_path}") from failure
        print(f"attempt {attempt} of {attempts} failed after {time.time() - started:.0f} s ({reason}); "
              "resuming from the last checkpoint", flush=True)
    raise AssertionError("unreachable")


def use_this_python(conf: Mapping[str, str] | None = None) -> None:
    """Makes Spark's Python workers run this interpreter, the one with this project's packages,
    unless ``spark.pyspark.python`` in ``conf`` or PYSPARK_PYTHON (which spark-submit sets from
    its settings) names another: otherwise they run the first ``python3`` on PATH, which may lack
    them (a venv's python started by its path). PySpark reads PYSPARK_PYTHON as a session starts."""
    os.environ["PYSPARK_PYTHON"] = ((conf or {}).get("spark.pyspark.python") or os.environ.get("PYSPARK_PYTHON")
                                    or sys.executable)


def _local_cores(master: str) -> int:
    """The task slots of a local master: ``local`` 1, ``local[N]`` N, ``local[*]`` (and
    ``local[N,F]``, ``local[*,F]``) as many as this machine's cores for ``*``."""
    inside = master.partition("[")[2].partition("]")[0].split(",")[0].strip()
    if inside == "*":
        return os.cpu_count() or 1
    return max(1, int(inside)) if inside.isdigit() else 1


def local_session(master: str = "local[2]", conf: Mapping[str, str] | None = None) -> Any:
    """A Spark session in local mode (``local[N]``: N task slots, one per training process)
    that serves its tasks on 127.0.0.1 and runs them in this Python: for tests, demos and
    one-machine runs.

    Defaults for one machine (``conf`` overrides each): no web UI; a few shuffle partitions per
    core (Spark's 200 are sized for clusters: on one machine each is a task to schedule for a
    few rows); and Python workers forked from ``dlrm.spark.worker_daemon``, which imports torch
    and numpy once, so that each worker does not import them again (seconds of CPU per worker,
    paid by every command on a small machine)."""
    from pyspark.sql import SparkSession

    use_this_python(conf)
    builder = SparkSession.builder.master(master).appName("dlrm")
    settings = {"spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1",
                "spark.ui.enabled": "false", "spark.ui.showConsoleProgress": "false",
                "spark.sql.shuffle.partitions": str(max(4, 2 * _local_cores(master))),
                "spark.python.daemon.module": "dlrm.spark.worker_daemon", **(conf or {})}
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def script_session(master: str | None, default_master: str, conf: Mapping[str, str] | None = None) -> Any:
    """The session of a command: on ``master``; without one, spark-submit's (which sets the
    master), else on ``default_master``. Local masters get ``local_session``; every session's
    workers run this Python unless another is configured (``use_this_python``)."""
    from pyspark.sql import SparkSession

    logging.getLogger("py4j").setLevel(logging.WARNING)  # its INFO lines at exit would follow a command's error
    # spark-submit starts the JVM and hands it to this process (SparkConf() is empty until then)
    if master is None and "PYSPARK_GATEWAY_PORT" not in os.environ:
        master = default_master
    if master is not None and master.startswith("local"):
        return local_session(master, conf)
    use_this_python(conf)
    builder = SparkSession.builder.appName("dlrm")
    for key, value in (({"spark.master": master} if master else {}) | dict(conf or {})).items():
        builder = builder.config(key, value)
    return builder.getOrCreate()
