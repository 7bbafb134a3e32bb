"""DLRM training on Spark from a ``RunConfig``: what ``dlrm.api.train`` runs, in Spark tasks.

    from dlrm.spark.dlrm_training import train
    from dlrm import api

    cfg = api.RunConfig(data=api.DataConfig(dataset="/shared/criteo_fl15"), amp=True,
                        train=api.TrainConfig(api.LRSchedule(lr=24.0), save_checkpoint_path="/shared/ckpt",
                                              checkpoint_every_steps=2000),
                        output=api.OutputConfig(log_path="/shared/log.json"))
    summary = train(cfg, num_processes=8, use_gpu=True)

The config itself goes to the tasks (``RunConfig.to_dict`` as JSON; each rebuilds it with
``from_dict`` and runs it, ``dlrm.spark.dlrm_task``), no command line between: any config runs,
and ``dlrm.scripts.spark_train`` reads its flags into a config and calls this. So a config runs
on Spark as it runs under torchrun, with the same failure handling: every attempt resumes from
``save_checkpoint_path``, and an input error is raised, not retried.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from dlrm.engine.config_check import rechecked
from dlrm.spark import launch
from dlrm.training import build
from dlrm.training.run_config import RunConfig

ENTRY_POINT = "dlrm.spark.dlrm_task"  # run by torchrun as a file in every task
# The run's paths every task writes (setting -> where it is in the config): on storage all share.
SHARED_PATHS = {"save_checkpoint_path": ("train", "save_checkpoint_path"), "log_path": ("output", "log_path")}
# Outputs a run may also write: absolute when given, or each task writes them in its own working
# directory (on a cluster, the executor's, which the cluster manager may remove), not beside the driver.
OPTIONAL_OUTPUTS = {"tensorboard_dir": ("output", "tensorboard_dir")}


def train(cfg: RunConfig, num_processes: int, spark: Any = None, use_gpu: bool = False,
          attempts: int = 2) -> dict[str, Any]:
    """Trains as ``cfg`` says on ``num_processes`` Spark tasks and returns the run's summary
    (``dlrm.spark.launch.run_attempts``: ``use_gpu`` and ``attempts`` as there; ``spark``: the active session).

    ``cfg`` needs ``train.save_checkpoint_path`` and ``output.log_path``, absolute paths on
    storage every executor shares, and no ``load_checkpoint_path`` or ``overwrite`` (each attempt
    resumes from its own checkpoint: ``resume`` is set for it). ``ValueError`` names the setting
    before Spark starts when one is missing."""
    cfg = prepare(cfg)
    return run_prepared(cfg, num_processes, spark=spark, use_gpu=use_gpu, attempts=attempts)


def run_prepared(cfg: RunConfig, num_processes: int, spark: Any = None, use_gpu: bool = False,
                 attempts: int = 2) -> dict[str, Any]:
    """``train`` after ``prepare``: the config itself goes to the tasks (``to_dict`` as JSON)."""
    from pyspark.sql import SparkSession

    if spark is not None and SparkSession.getActiveSession() is not spark:
        raise ValueError("`spark` must be the active session (TorchDistributor runs on that one)")
    return launch.run_attempts(ENTRY_POINT, json.dumps(cfg.to_dict()), num_processes, cfg.output.log_path,
                               cfg.train.save_checkpoint_path, use_gpu=use_gpu, attempts=attempts)


def prepare(cfg: RunConfig) -> RunConfig:
    """``cfg`` as every attempt runs it (``resume`` set), checked and its outputs claimed: what
    ``train`` does before Spark starts, for a caller that starts its session only after it."""
    check_config(cfg)  # the shared paths first: what resuming needs
    cfg = rechecked(cfg, mode="train", checkpoint=dataclasses.replace(cfg.checkpoint, resume=True))
    claim_outputs(cfg)
    return cfg


def claim_outputs(cfg: RunConfig) -> None:
    """The paths every attempt writes (checkpoint, log, TensorBoard folder), claimed on the
    driver before Spark starts, as each task claims them again (``dlrm.engine.outputs``):
    ``OutputError`` for a folder or file of anything else, at once and with nothing changed,
    rather than from every task after Spark and torchrun have started (and the driver, which
    reads the run's summary from the log, never reads a file that is not a run log)."""
    build.claim_outputs(cfg)


def check_config(cfg: RunConfig) -> None:
    """What a Spark run needs: its checkpoint and log on storage every task shares, and no
    checkpoint to start from but its own (every attempt resumes from that)."""
    if cfg.checkpoint.load_checkpoint_path:
        raise ValueError("a Spark run resumes from its own `save_checkpoint_path` (`resume` is set for it): "
                         "to start from another checkpoint, copy it there first")
    if cfg.checkpoint.overwrite:
        raise ValueError("a Spark run continues the checkpoint at its own `save_checkpoint_path` (every attempt "
                         "resumes from it), so `overwrite` cannot start over there: give a new "
                         "`save_checkpoint_path`, or remove the old checkpoint yourself")
    paths = {name: getattr(getattr(cfg, part), field) for name, (part, field) in {**SHARED_PATHS,
                                                                                 **OPTIONAL_OUTPUTS}.items()}
    for name in SHARED_PATHS:
        if not paths[name]:
            raise ValueError(f"`{name}` is needed: every Spark task writes there (a path all executors share, "
                             "e.g. a mounted network filesystem), and the driver reads the run's result from it")
    for name, path in paths.items():
        if path and "://" not in str(path) and not os.path.isabs(path):
            raise ValueError(f"`{name}` is {path!r}: give an absolute path, since the tasks do not run in "
                             "the driver's working directory")
