"""The sparse autoencoder recommender (Amazon DSSTNE's job) on this engine's parts: a user's
history goes in as a bag of item ids, a score for every item comes out, and the top K unseen
items are the recommendations. Wide item layers split across processes by item range.

Modules: ``network`` (DSSTNE's JSON network definition), ``model`` (the network as torch
modules), ``item_parallel`` (item ranges per process and the exchanges between them),
``loss`` (DSSTNE's error functions over sparse targets), ``topk`` (top-K excluding seen
items, merged across processes), ``metrics`` and ``baselines`` (evaluation on a held-out
split), ``train`` and ``predict`` (the loops), ``checkpoint``; ``run_config`` (a training run
as one typed, self-checking ``RecommenderConfig``, a prediction or evaluation run as a
``PredictConfig`` or ``EvaluateConfig``) and ``api`` (``train``, ``predict``, ``evaluate``: one
call per job, what the scripts run; ``load``: a trained model in memory, ``handle``).
Guide: docs/recommender.md.

``dlrm.recommender.load(checkpoint)`` is ``handle.load``, imported on first use so that
``import dlrm.recommender`` stays light (no torch).
"""

from typing import Any

__all__ = ["load"]


def __getattr__(name: str) -> Any:
    """``load``, from ``handle`` when first asked for."""
    if name == "load":
        from dlrm.recommender.handle import load

        return load
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
