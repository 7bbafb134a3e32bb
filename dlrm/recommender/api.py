r"""The recommender from Python: one import, one call per job, and the trained model in memory.

    from dlrm.recommender import api

    result = api.train(api.RecommenderConfig(data=api.DataConfig(input="data/input"),
                                             checkpoint=api.CheckpointConfig(save_checkpoint_path="ckpt")))
    rec = result.load()                                   # or api.load("ckpt")
    ids, scores = rec.recommend([[3, 17, 42], [5]], k=10)  # in memory: [2, 10] each
    api.predict(api.PredictConfig(load_checkpoint_path="ckpt", input="data/input", output="recs.txt", k=10))
    report = api.evaluate(api.EvaluateConfig(input="data/input", heldout="data/heldout", load_checkpoint_path="ckpt",
                                             k=(5, 10)))

``train`` runs what ``recommender_train`` runs, ``predict`` what ``recommender_predict`` runs and
``evaluate`` what ``recommender_evaluate`` runs, each the run of one config
(``dlrm.recommender.run_config``) that checks itself when constructed: those scripts turn their
flags into these configs (a flag declared per field, ``dlrm.scripts.recommender_flags``), so the
guarantees are the same.
``train`` returns a ``TrainResult`` (its ``summary``, which it also reads as, its
``checkpoint_path`` and ``load()``); ``load(checkpoint)`` gives a ``Recommender`` whose
``recommend`` scores as the predict job does, without files. ``predict`` and ``evaluate`` also
take the config's fields as their arguments, the same call:

    api.predict("ckpt", "data/input", "recs.txt", k=10)
    report = api.evaluate("data/input", "data/heldout", load_checkpoint_path="ckpt", k=(5, 10))

Before any work every output is claimed (``dlrm.engine.outputs``: nothing of the user's is
replaced), a training run holds the checkpoint's lock, and SIGINT/SIGTERM stop it after the
step in flight with a checkpoint (the summary's ``stop_reason`` is then "interrupted" and
``signal`` the signal; the handlers are restored when the call returns). A refused setting or
input raises ``ConfigError`` (a ``ValueError``) naming the setting in backquotes (the config is
checked again when the call starts: a setting changed after it was built is refused too), or the
engine's errors (``DatasetError``, ``OutputError``, ``CheckpointError``, ``StorageError``,
``NonFiniteLoss`` when the loss turns nan or inf); nothing here exits the interpreter. Under
torchrun every process makes the same call (the autoencoder's item layers are split across them).

Each job is a module of its own (``train_job``, ``linear_job``, ``predict_job``, ``evaluate_job``,
``handle``; their shared steps ``job_steps``); this one gathers them, and none of them imports it.
"""

from __future__ import annotations

from dlrm.recommender.evaluate_job import REPORT_KEYS, evaluate  # noqa: F401
from dlrm.recommender.handle import Recommender, histories_of, load
from dlrm.recommender.job_steps import check_dataset_dir, open_dataset  # noqa: F401  (the scripts' checks)
from dlrm.recommender.predict_job import index_beside, is_scores, predict  # noqa: F401
from dlrm.recommender.run_config import (  # noqa: F401  (re-exported: the configs are this module's)
    BASELINES, DATASET_HINT, CheckpointConfig, ConfigError, DataConfig, EvaluateConfig, LinearConfig, ModelConfig,
    OptimizerOverrides, PredictConfig, RecommenderConfig, TrainSettings, ValidationSettings)
from dlrm.recommender.train_job import MUST_MATCH_ON_RESUME, TrainResult, train  # noqa: F401

__all__ = ["train", "predict", "evaluate", "load", "histories_of", "TrainResult", "Recommender", "RecommenderConfig",
           "DataConfig", "ModelConfig", "LinearConfig", "OptimizerOverrides", "ValidationSettings", "TrainSettings",
           "CheckpointConfig", "PredictConfig", "EvaluateConfig", "ConfigError"]
