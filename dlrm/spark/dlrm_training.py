"""DLRM training on Spark from a ``RunConfig``: what ``dlrm.training.api.train`` runs, in Spark tasks.

    from dlrm.spark.dlrm_training import train
    from dlrm.training import api

    cfg = api.RunConfig(data=api.DataConfig(dataset="/shared/criteo_fl15"), amp=True,
                        train=api.TrainConfig(api.LRSchedule(lr=24.0), save_checkpoint_path="/shared/ckpt",
                                              checkpoint_every_steps=2000),
                        output=api.OutputConfig(log_path="/shared/log.json"))
    summary = train(cfg, num_processes=8, use_gpu=True)

The config becomes the command line of ``dlrm.scripts.main`` that gives it back
(``dlrm_flags.config_flags``, every setting spelled out), and ``dlrm.spark.launch.train`` runs
that in one task per process, as ``dlrm.scripts.spark_train`` runs the flags it is given. So a
config runs on Spark as it runs under torchrun, with the same failure handling: every attempt
resumes from ``save_checkpoint_path``, and an input error is raised, not retried.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlrm.engine.config_check import rechecked
from dlrm.scripts.dlrm_flags import config_flags
from dlrm.spark import launch
from dlrm.training import build
from dlrm.training.run_config import RunConfig


def train(cfg: RunConfig, num_processes: int, spark: Any = None, use_gpu: bool = False,
          attempts: int = 2) -> dict[str, Any]:
    """Trains as ``cfg`` says on ``num_processes`` Spark tasks and returns the run's summary
    (``dlrm.spark.launch.train``: ``spark``, ``use_gpu`` and ``attempts`` as there).

    ``cfg`` needs ``train.save_checkpoint_path`` and ``output.log_path``, absolute paths on
    storage every executor shares, and no ``load_checkpoint_path`` or ``overwrite`` (each attempt
    resumes from its own checkpoint: ``resume`` is set for it). ``ValueError`` names the setting
    before Spark starts when one is missing, or when no flag of the script can say it."""
    cfg = rechecked(cfg, mode="train")  # checked again: a setting may have changed since it was built
    flags = {**config_flags(cfg), "resume": None}  # None: launch.train runs every attempt with resume
    launch.check_flags(flags)  # the shared paths first: what resuming needs
    claim_outputs(rechecked(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, resume=True)))  # as each attempt runs
    return launch.train(flags, num_processes, spark=spark, use_gpu=use_gpu, attempts=attempts)


def claim_outputs(cfg: RunConfig) -> None:
    """The paths every attempt writes (checkpoint, log, TensorBoard folder), claimed on the
    driver before Spark starts, as each task claims them again (``dlrm.engine.outputs``):
    ``OutputError`` for a folder or file of anything else, at once and with nothing changed,
    rather than from every task after Spark and torchrun have started (and the driver, which
    reads the run's summary from the log, never reads a file that is not a run log)."""
    build.claim_outputs(cfg)
