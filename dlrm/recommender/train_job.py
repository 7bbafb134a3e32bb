"""The training job: what ``recommender_train`` runs, from one ``RecommenderConfig``. The linear
model's fit is ``linear_job``'s; this module trains the autoencoder and hands either back as a
``TrainResult`` (the run's summary, where its checkpoint is, and the model to recommend with).

Before any work every output is claimed (``dlrm.engine.outputs``), the run holds the
checkpoint's lock, and SIGINT/SIGTERM stop it after the step in flight with a checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from dlrm.engine.config_check import rechecked
from dlrm.recommender.job_steps import (amp_dtype_of, check_dataset_dir, dist_env, open_dataset, plain,
                                        resolve_device, stop_on_signals)
from dlrm.recommender.linear_job import fit_linear
from dlrm.recommender.run_config import DATASET_HINT, ConfigError, RecommenderConfig

# Settings a resumed run must share with the checkpoint's run to draw what it would have drawn.
MUST_MATCH_ON_RESUME = ("seed", "batch_size", "validation_users", "validation_max_users", "validation_items")


@dataclasses.dataclass(frozen=True, eq=False)
class TrainResult(Mapping):
    """What a training run hands back: its ``summary`` (the run log's "summary" record), the
    ``checkpoint_path`` it saved to, and ``load()``, the trained model as a ``Recommender``.

    It reads as the summary too (``result["stop_reason"]``, ``"signal" in result``,
    ``dict(result)``), so code written when ``train`` returned the summary dict keeps working."""

    summary: dict[str, Any]
    checkpoint_path: str

    def __getitem__(self, key: str) -> Any:
        return self.summary[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.summary)

    def __len__(self) -> int:
        return len(self.summary)

    def load(self, device: str = "cpu", best: bool = True):
        """The trained model in memory (``dlrm.recommender.handle.load`` of ``checkpoint_path``):
        with ``best``, the best validation's checkpoint (PATH.best) when the run kept one, as
        ``predict`` takes it."""
        from dlrm.recommender.handle import load

        return load(self.checkpoint_path, device=device, best=best)


def train(cfg: RecommenderConfig) -> TrainResult:
    """Trains the run ``cfg`` describes. The result's summary holds ``stop_reason`` (completed,
    early_stopped, max_steps or interrupted, with ``signal`` the signal then), steps, epochs,
    seconds, the best validation's NDCG@K; the linear model's chosen ``regularization`` and
    ``dropout``. The checkpoint is at ``cfg.checkpoint.save_checkpoint_path`` (and PATH.best)."""
    if not isinstance(cfg, RecommenderConfig):
        raise ConfigError(f"train takes a RecommenderConfig, got {type(cfg).__name__}")
    cfg = rechecked(cfg)  # a setting changed since the config was built is checked too
    env = dist_env()
    summary = fit_linear(cfg, env) if cfg.model.kind == "linear" else _train_autoencoder(cfg, env)
    return TrainResult(summary, cfg.checkpoint.save_checkpoint_path)


def _network(cfg: RecommenderConfig):
    """The network file, its optimizer overridden by ``cfg.model.optimizer``."""
    from dlrm.recommender.network import NetworkConfigError, parse_network

    try:
        network = parse_network(cfg.model.network)
    except NetworkConfigError as e:
        raise ConfigError(f"`network` {plain(e)}") from None
    o = cfg.model.optimizer
    overrides = {name: value for name, value in (("kind", o.optimizer), ("alpha", o.alpha), ("mu", o.mu),
                                                 ("lambda_", o.lambda_)) if value is not None}
    if overrides:
        network = dataclasses.replace(network, optimizer=dataclasses.replace(network.optimizer, **overrides))
    return network


def _claim_outputs(cfg: RecommenderConfig) -> str | None:
    """Claims every path the run writes (``dlrm.engine.outputs``) before any work; returns the
    checkpoint to resume from (None: a fresh run)."""
    from dlrm.engine.checkpoint_store import claim_checkpoint_path, latest_checkpoint
    from dlrm.engine.outputs import LOG, TENSORBOARD, claim_output
    from dlrm.recommender import checkpoint

    data, path = cfg.data, cfg.checkpoint.save_checkpoint_path
    inputs_named = {"input": data.input, "output": data.output, "network": cfg.model.network}
    claim_checkpoint_path(path, checkpoint.META_FORMAT, inputs=inputs_named, replace=cfg.checkpoint.overwrite,
                          keep=cfg.checkpoint.resume, suffixes=("", ".best") if cfg.validation_users > 0 else ("",))
    inputs_named["save_checkpoint_path"] = path
    if cfg.log_path:
        claim_output(cfg.log_path, LOG, "log_path", inputs=inputs_named, keep=True)
    if cfg.tensorboard_dir:
        claim_output(cfg.tensorboard_dir, TENSORBOARD, "tensorboard_dir", inputs=inputs_named, keep=True)
    return None if cfg.checkpoint.overwrite else latest_checkpoint(path)


def _run_id(found: str | None, settings: dict[str, Any]) -> str:
    """The id that names this run in its checkpoints (so a .best of another run is never taken
    for it): a new one, or the resumed checkpoint's, whose settings that steer the draws must match."""
    from dlrm.recommender import checkpoint

    if found is None:
        return uuid.uuid4().hex
    saved = checkpoint.read_meta(found).get("run_config", {})
    for name in MUST_MATCH_ON_RESUME:
        if name in saved and saved[name] != settings[name]:
            raise ConfigError(f"`resume`: the checkpoint at {found} was trained with `{name}` {saved[name]}, "
                              f"this run has {settings[name]}; use the same `{name}` to continue it exactly")
    return saved.get(checkpoint.RUN_ID, uuid.uuid4().hex)


def _loop_settings(cfg: RecommenderConfig, network, amp_dtype, best_path: str):
    """The training loop's ``TrainConfig`` of the run's settings."""
    from dlrm.recommender.train import TrainConfig

    t, v = cfg.train, cfg.validation
    return TrainConfig(batch_size=cfg.batch_size, epochs=t.epochs or t.max_epochs, seed=cfg.seed,
                       shuffle=network.shuffle_indices, negatives=t.negatives, amp_dtype=amp_dtype,
                       log_every_steps=t.log_every_steps, save_checkpoint_path=cfg.checkpoint.save_checkpoint_path,
                       checkpoint_every_steps=t.checkpoint_every_steps, max_steps=t.max_steps,
                       best_checkpoint_path=best_path if cfg.validating else None,
                       patience=v.patience if t.epochs is None else None, patience_steps=v.patience_steps,
                       eval_every_steps=t.eval_every_steps)


def _validation(cfg: RecommenderConfig, model, inputs, amp_dtype):
    """(validate(), the split) of a run that validates, else (None, None)."""
    if not cfg.validating:
        return None, None
    from dlrm.recommender.validation import ValidationConfig, make_split
    from dlrm.recommender.validation import validate as validate_split

    v = cfg.validation
    try:
        v_cfg = ValidationConfig(user_fraction=cfg.validation_users, max_users=v.validation_max_users,
                                 item_fraction=v.validation_items, k=v.validation_k, patience=v.patience)
        split = make_split(inputs, v_cfg, cfg.seed)
    except ValueError as e:
        raise ConfigError(f"`validation_users`: {e}") from None
    return functools.partial(validate_split, model, inputs, split, v_cfg, amp_dtype), split


def _build_model(cfg: RecommenderConfig, env, network, inputs, targets, device):
    """(the network with its sizes, this process's model, its item parallelism) once the
    process group is joined: a network that does not fit the datasets is a ``ConfigError``."""
    from dlrm.engine.process_group import join_processes  # torch: imported when a run starts
    from dlrm.recommender.item_parallel import ItemParallel
    from dlrm.recommender.model import SparseAutoencoder
    from dlrm.recommender.network import NetworkConfigError
    from dlrm.recommender.train import check_datasets

    try:
        network = network.resolve(inputs.n_features, targets.n_features)
    except NetworkConfigError as e:
        raise ConfigError(f"`network` {plain(e)}") from None
    join_processes(env, device, cfg.dist_timeout)
    parallel = ItemParallel.from_process_group()
    try:
        model = SparseAutoencoder(network, parallel, seed=cfg.seed, device=device)
        check_datasets(inputs, targets, model)
    except ValueError as e:
        raise ConfigError(f"`network` {cfg.model.network}: {e}") from None
    return network, model, parallel


def _train_autoencoder(cfg: RecommenderConfig, env) -> dict[str, Any]:
    """The autoencoder's run: outputs claimed, the model built (or resumed), the loop run."""
    network = _network(cfg)  # before any dataset: a bad file fails at once, naming the key
    data = cfg.data
    for setting in ("input", "output"):
        check_dataset_dir(setting, getattr(data, setting), DATASET_HINT)
    from dlrm.recommender import checkpoint
    from dlrm.recommender.train import make_optimizer

    device = resolve_device(cfg.base_device, env)
    amp_dtype = amp_dtype_of(cfg.train.amp, cfg.train.amp_dtype, device)
    if cfg.train.negatives is not None and network.output.activation == "softmax":
        raise ConfigError("`negatives` needs an element-wise output activation; the network's Output layer is "
                          "SoftMax, which needs every item's score: drop `negatives`")
    found = _claim_outputs(cfg)
    settings = cfg.settings()
    run_config = {**settings, checkpoint.RUN_ID: _run_id(found, settings)}
    inputs = open_dataset("input", data.input, DATASET_HINT)
    targets = open_dataset("output", data.output, DATASET_HINT) if data.output else inputs
    network, model, parallel = _build_model(cfg, env, network, inputs, targets, device)
    optimizer = make_optimizer(model, network.optimizer)
    state = checkpoint.load(found, model, optimizer) if found is not None else None
    validate, split = _validation(cfg, model, inputs, amp_dtype)
    best_path = checkpoint.best_path(cfg.checkpoint.save_checkpoint_path)
    loop = _loop_settings(cfg, network, amp_dtype, best_path)
    summary = _run_loop(cfg, network, model, optimizer, (inputs, targets), loop, state, run_config,
                        (validate, split, best_path), device, parallel)
    from dlrm.engine.process_group import leave_processes  # torch: imported when a run starts

    leave_processes(env)
    return summary


def _run_loop(cfg: RecommenderConfig, network, model, optimizer, datasets, loop, state, run_config,
              validation, device, parallel) -> dict[str, Any]:
    """The loop under the run log, stopped by SIGINT/SIGTERM after its step; its summary (with
    ``signal`` when a signal stopped it)."""
    from dlrm.engine.logger import RunLogger
    from dlrm.recommender.train import train as train_loop

    (inputs, targets), (validate, split, best_path) = datasets, validation
    k, path = cfg.validation.validation_k, cfg.checkpoint.save_checkpoint_path
    logger = RunLogger(cfg.log_path, enabled=parallel.rank == 0, tensorboard_dir=cfg.tensorboard_dir)
    with logger:
        logger.record("flags", **run_config)
        hidden = " x ".join(str(layer.n) for layer in network.hidden)
        logger.print(f"{network.name}: {model.n_input:,} inputs, hidden {hidden}, {model.n_output:,} outputs; "
                     f"{len(inputs):,} users; optimizer {network.optimizer.kind} (alpha {network.optimizer.alpha:g}); "
                     f"device {device}, {parallel.world_size} process{'es' if parallel.world_size > 1 else ''}"
                     + (f"; resuming at step {state.step} (epoch {state.epoch})" if state is not None else ""))
        if split is not None:
            logger.print(f"validation: {split.n_held:,} items of {len(split.users):,} users held out of training "
                         f"(NDCG@{k} picks the best checkpoint, {best_path})")
        with stop_on_signals() as stop:
            summary = train_loop(model, optimizer, inputs, targets, loop, logger, device, state, run_config,
                                 should_stop=stop.event.is_set if stop is not None else lambda: False,
                                 validate=validate, train_mask=None if split is None else split.train_mask)
        best = (f"; best validation NDCG@{k} {summary['best_validation_ndcg']:.4f} at epoch "
                f"{summary['best_epoch']} ({best_path})" if "best_validation_ndcg" in summary else "")
        logger.print(f"Finished ({summary['stop_reason']}) after {summary['steps']} steps, {summary['epochs']} "
                     f"epochs: {summary['users_per_s']:,.0f} users/s over {summary['seconds']:.1f} s; checkpoint "
                     f"{path}{best}")
    if summary["stop_reason"] == "interrupted" and stop is not None and stop.signum is not None:
        summary["signal"] = stop.signum
    return summary
