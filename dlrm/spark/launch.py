"""Training launched on a Spark cluster: the same entry point as ``torchrun``, as a barrier stage.

``pyspark.ml.torch.distributor.TorchDistributor`` starts one Spark task per process (per GPU
with ``use_gpu``), all at once (a barrier stage), and each task runs ``torchrun`` on
``dlrm/scripts/main.py`` with the rendezvous set up by Spark. The training is then the one a
``torchrun`` command runs: same planner, same exchange, same numbers.

Work is never lost to a lost task: a barrier stage fails as a whole when one task dies, so
every attempt here runs with ``--resume`` and ``--save_checkpoint_path``: the next attempt
(``attempts``) resumes from the last checkpoint, exactly where it was saved.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

ENTRY_POINT = "dlrm.scripts.main"  # run by torchrun as a file in every task

SHARED_PATH_FLAGS = ("save_checkpoint_path", "log_path")
# Outputs a run may also write: absolute when given, or each task writes them in its own working
# directory (on a cluster, the executor's, which the cluster manager may remove), not beside the driver.
OPTIONAL_OUTPUT_FLAGS = ("tensorboard_dir",)
FAILED = ("error", "aborted", "interrupted", "non_finite_loss")  # stop reasons of a run that did not finish
# Errors of a run's input (main exits 2 on them, its summary names the class): another attempt fails the same way.
USER_ERRORS = ("UsageError", "DatasetError", "FeatureSpecError", "CheckpointError", "PlanError",
               "NonFiniteLoss", "OutputError")  # not retried: the next attempt would meet them again


def flag_args(flags: Mapping[str, Any]) -> list[str]:
    """``{"batch_size": 1024, "amp": True, "lr": 0.5}`` -> ``["--batch_size=1024", "--amp", "--lr=0.5"]``
    (False -> ``--noamp``; None leaves the flag at its default)."""
    args = []
    for name, value in flags.items():
        if value is None:
            continue
        if isinstance(value, bool):
            args.append(f"--{name}" if value else f"--no{name}")
        elif isinstance(value, (list, tuple)):
            args.append(f"--{name}={','.join(map(str, value))}")
        else:
            args.append(f"--{name}={value}")
    return args


def check_flags(flags: Mapping[str, Any]) -> None:
    """The flags a Spark run needs: its checkpoint and log on storage every task shares, and no
    checkpoint to start from but its own (every attempt resumes from that)."""
    if flags.get("resume") is False or flags.get("load_checkpoint_path"):
        raise ValueError("a Spark run resumes from its own `save_checkpoint_path` (`resume` is set for it): "
                         "to start from another checkpoint, copy it there first")
    if flags.get("overwrite"):
        raise ValueError("a Spark run continues the checkpoint at its own `save_checkpoint_path` (every attempt "
                         "resumes from it), so `overwrite` cannot start over there: give a new "
                         "`save_checkpoint_path`, or remove the old checkpoint yourself")
    for name in SHARED_PATH_FLAGS:
        if not flags.get(name):
            raise ValueError(f"`{name}` is needed: every Spark task writes there (a path all executors share, "
                             "e.g. a mounted network filesystem), and the driver reads the run's result from it")
    for name in SHARED_PATH_FLAGS + OPTIONAL_OUTPUT_FLAGS:
        if flags.get(name) and "://" not in str(flags[name]) and not os.path.isabs(flags[name]):
            raise ValueError(f"`{name}` is {flags[name]!r}: give an absolute path, since the tasks do not run in "
                             "the driver's working directory")


def read_summaries(log_path: str) -> list[dict[str, Any]]:
    """The ``summary`` records of a run's JSON log (one per attempt that got to write it)."""
    if not os.path.isfile(log_path):
        return []
    with open(log_path, encoding="utf-8") as f:
        return [record for record in map(json.loads, f) if record.get("type") == "summary"]


def train(
    flags: Mapping[str, Any],
    num_processes: int,
    spark: Any = None,
    use_gpu: bool = False,
    attempts: int = 2,
) -> dict[str, Any]:
    """Trains with ``dlrm.scripts.main``'s ``flags`` on ``num_processes`` Spark tasks and returns
    the run's ``summary`` record (``best_auc``, throughputs, ...).

    ``flags`` must include ``save_checkpoint_path`` and ``log_path`` (absolute, on storage every
    executor reaches), and should include ``checkpoint_freq``: a failed attempt costs at most
    that many steps, since each of the ``attempts`` resumes from the last checkpoint. A run
    stopped by its input (a flag, the dataset: what main exits 2 on) is not retried: that
    error's message is raised as a ``ValueError``. ``spark`` is the session (default: the
    active one). On GPUs set ``spark.task.resource.gpu.amount`` (one task per GPU is the usual
    choice) and pass ``use_gpu``.
    """
    from pyspark.ml.torch.distributor import TorchDistributor
    from pyspark.sql import SparkSession

    if num_processes < 1 or attempts < 1:
        raise ValueError(f"`num_processes` ({num_processes}) and `attempts` ({attempts}) must be at least 1")
    check_flags(flags)
    flags = {**flags, "resume": True}
    if spark is not None and SparkSession.getActiveSession() is not spark:
        raise ValueError("`spark` must be the active session (TorchDistributor runs on that one)")
    args = flag_args(flags)
    log_path = flags["log_path"]
    for attempt in range(1, attempts + 1):
        started, summaries = time.time(), len(read_summaries(log_path))
        failure: BaseException | None = None
        try:
            TorchDistributor(num_processes=num_processes, local_mode=False, use_gpu=use_gpu).run(
                importlib.util.find_spec(ENTRY_POINT).origin, *args)
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
                               f"is at {flags['save_checkpoint_path']} and its log at {log_path}") from failure
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


def parse_flag_args(flags: Sequence[str]) -> dict[str, str]:
    """``["--log_path=/x", "--amp"]`` -> ``{"log_path": "/x", "amp": True}``: command-line flags
    as ``train`` takes them (both ``--name=value`` and ``--name value``)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        item = flags[i]
        if not item.startswith("--"):
            raise ValueError(f"{item!r} is not a flag: pass training flags as --name=value or --name value")
        name, eq, value = item[2:].partition("=")
        if not eq and i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value, i = flags[i + 1], i + 1
        elif not eq:
            value = True
        out[name] = value
        i += 1
    return out
