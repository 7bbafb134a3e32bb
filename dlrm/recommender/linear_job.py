"""The linear model's training job (``recommender_train`` without a network): the item x item
model's settings chosen on a validation split of ``input``, the model refitted on all of it and
saved as a checkpoint. The fit itself is ``dlrm.recommender.linear``'s; this module is the run
around it (claims, memory budget, the run log).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from dlrm.recommender.job_steps import check_dataset_dir, device_memory, open_dataset, resolve_device
from dlrm.recommender.run_config import DATASET_HINT, ConfigError, RecommenderConfig


def fit_linear(cfg: RecommenderConfig, env) -> dict[str, Any]:
    """The item x item model, its settings chosen on validation, refitted on all of ``input``
    and saved at ``save_checkpoint_path``; returns the run's summary."""
    if env is not None:
        raise ConfigError("the linear model fits on one process: run it without torchrun (under torchrun, "
                          "`network` trains the item-parallel autoencoder)")
    check_dataset_dir("input", cfg.data.input, DATASET_HINT)
    from dlrm.engine.checkpoint_store import CheckpointLock, claim_checkpoint_path
    from dlrm.engine.logger import RunLogger
    from dlrm.engine.outputs import LOG, claim_output
    from dlrm.recommender import checkpoint
    from dlrm.recommender.validation import ValidationConfig, make_split

    v = cfg.validation
    path = cfg.checkpoint.save_checkpoint_path
    inputs_named = {"input": cfg.data.input}
    claim_checkpoint_path(path, checkpoint.META_FORMAT, inputs=inputs_named, replace=cfg.checkpoint.overwrite)
    if cfg.log_path:
        claim_output(cfg.log_path, LOG, "log_path", inputs={**inputs_named, "save_checkpoint_path": path}, keep=True)
    inputs = open_dataset("input", cfg.data.input, DATASET_HINT)
    device = resolve_device(cfg.base_device, env)
    allow_float64 = _check_memory(cfg, inputs, device)
    try:
        v_cfg = ValidationConfig(user_fraction=cfg.validation_users, max_users=v.validation_max_users,
                                 item_fraction=v.validation_items, k=v.validation_k)
        split = make_split(inputs, v_cfg, cfg.seed)
    except ValueError as e:
        raise ConfigError(f"`validation_users`: {e}") from None
    run_config = cfg.settings()
    with CheckpointLock(path), RunLogger(cfg.log_path) as logger:
        logger.record("flags", **run_config)
        logger.print(f"linear item-item model (EASE, EDLAE): {len(inputs):,} users, {inputs.n_features:,} items, "
                     f"{inputs.nnz:,} interactions; device {device}; settings chosen by validation NDCG@{v_cfg.k} "
                     f"over {split.n_held:,} items of {len(split.users):,} users held out of the fit")
        started = time.perf_counter()
        best, ease, fitted, trials = _choose_and_refit(inputs, split, v_cfg, device, allow_float64, logger)
        validation = {"k": v_cfg.k, "ndcg": best.metrics.ndcg, "precision": best.metrics.precision,
                      "recall": best.metrics.recall, "users": len(split.users), "held_out": split.n_held,
                      "ease_ndcg": ease.metrics.ndcg, "ease_regularization": ease.settings.regularization,
                      "trials": trials}
        checkpoint.save_linear(path, fitted, validation, run_config)
        seconds = time.perf_counter() - started
        summary = {"stop_reason": "completed", "model": "linear", **dataclasses.asdict(best.settings),
                   "best_validation_ndcg": best.metrics.ndcg, "seconds": seconds}
        logger.record("summary", **summary)
        why = ("EASE's best" if best.settings.dropout == 0 else
               f"EASE's best {ease.metrics.ndcg:.4f} at lambda {ease.settings.regularization:g}")
        logger.print(f"chose {best.settings.describe()}: validation NDCG@{v_cfg.k} {best.metrics.ndcg:.4f} ({why}, "
                     f"the best of {trials} settings); refitted on all {len(inputs):,} users; {seconds:.1f} s; "
                     f"checkpoint {path}")
    return summary


def _check_memory(cfg: RecommenderConfig, inputs, device) -> bool:
    """Refuses a model over ``linear_max_memory_gb`` (default: 80% of the device's memory);
    returns whether a float32 fit that lost accuracy may be redone in float64 (``linear.solve``)."""
    import torch

    from dlrm.recommender import linear

    n = inputs.n_features
    need = linear.memory_bytes(n, len(inputs))
    max_gb = cfg.model.linear.linear_max_memory_gb
    budget = max_gb * 2**30 if max_gb is not None else 0.8 * device_memory(device)
    if need > budget:
        raise ConfigError(f"the linear model of {n:,} items needs {need / 2**30:.1f} GiB (items^2 x "
                          f"{need // max(n * n, 1)} bytes), over the {budget / 2**30:.1f} GiB of "
                          f"`linear_max_memory_gb`: raise it if {device} has the memory, or train the item-parallel "
                          f"autoencoder (`network`)")
    return linear.memory_bytes(n, len(inputs), torch.float64) <= budget


def _choose_and_refit(inputs, split, v_cfg, device, allow_float64: bool, logger):
    """(the best trial, EASE's best trial, the model of the best settings refitted on every
    user, the number of settings tried); each trial logged as it ends, and where the time went."""
    from dlrm.recommender import linear, linear_catalogue, linear_search
    from dlrm.recommender.validation import validate_scores

    k = v_cfg.k
    started = time.perf_counter()
    users = linear.user_matrix(inputs, split.train_mask)

    def validate(model):
        return validate_scores(model.scores, inputs, split, v_cfg)

    def report(trial: linear_search.Trial) -> None:
        m = trial.metrics
        logger.record("validation", regularization=trial.settings.regularization, dropout=trial.settings.dropout,
                      min_support=trial.settings.min_support, learned_items=trial.learned_items,
                      ndcg=m.ndcg, precision=m.precision, recall=m.recall, seconds=trial.seconds)
        logger.print(f"  {trial.settings.describe():<32} validation NDCG@{k} {m.ndcg:.4f}  P@{k} "
                     f"{m.precision:.4f}  R@{k} {m.recall:.4f}  ({trial.learned_items:,} items solved, "
                     f"{trial.seconds:.2f} s)")

    try:
        choice = linear_search.choose(users, validate, report=report, allow_float64=allow_float64, device=device)
        searched = time.perf_counter()
        best = choice.best
        ease = max((t for t in choice.trials if t.settings.dropout == 0), key=lambda t: t.metrics.ndcg)
        (learned, g), choice.gram = choice.gram, None
        search = linear_catalogue.SearchGram(g, learned, users, split.users)
        del g, users
        fitted = linear_catalogue.fit(linear.user_matrix(inputs), best.settings, device, allow_float64, search)
    except linear.LinearFitError as e:
        raise ConfigError(str(e).replace("`regularization`", "the regularisation")) from None
    _report_time(logger, choice, started, searched, len(inputs), reused=search.g is None)
    return best, ease, fitted, len(choice.trials)


def _report_time(logger, choice, started: float, searched: float, n_users: int, reused: bool) -> None:
    """Where the fit's time went: each trial's share, the rest of the search, and the refit (G
    updated from the search's for the validation users' rows where the memory allows, else made
    anew; the solve redone, as G changed)."""
    total = time.perf_counter() - started
    trials = sum(t.seconds for t in choice.trials)
    shares = ", ".join(f"{100 * t.seconds / total:.0f}%" for t in choice.trials)
    how = "G updated from the search's for the validation users" if reused else "G made anew"
    logger.record("fit_time", seconds=total, trials=[t.seconds for t in choice.trials],
                  search_other=searched - started - trials, refit=total - (searched - started), gram_reused=reused)
    logger.print(f"fit {total:.2f} s: {len(choice.trials)} trials {trials:.2f} s ({100 * trials / total:.0f}%; "
                 f"each {shares}), the search's G and validation split {searched - started - trials:.2f} s, the "
                 f"refit on all {n_users:,} users ({how}, the solve redone: G changed) "
                 f"{total - (searched - started):.2f} s")
