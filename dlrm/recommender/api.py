r"""The recommender from Python: one import, one call per job.

    from dlrm.recommender import api

    summary = api.train(api.RecommenderConfig(data=api.DataConfig(input="data/input"),
                                              checkpoint=api.CheckpointConfig(save_checkpoint_path="ckpt")))
    api.predict(api.PredictConfig(load_checkpoint_path="ckpt", input="data/input", output="recs.txt", k=10))
    report = api.evaluate(api.EvaluateConfig(input="data/input", heldout="data/heldout", load_checkpoint_path="ckpt",
                                             k=(5, 10)))

``train`` runs what ``recommender_train`` runs, ``predict`` what ``recommender_predict`` runs and
``evaluate`` what ``recommender_evaluate`` runs, each the run of one config
(``dlrm.recommender.run_config``) that checks itself when constructed: those scripts turn their
flags into these configs (a field per flag, of its name), so the guarantees are the same.
``predict`` and ``evaluate`` also take the config's fields as their arguments, the same call:

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
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import signal
import threading
import time
import uuid
from typing import Any, Iterator, TypeVar

from dlrm.engine.config_check import rechecked
from dlrm.recommender.run_config import (  # noqa: F401  (re-exported: the configs are this module's)
    BASELINES, DATASET_HINT, CheckpointConfig, ConfigError, DataConfig, EvaluateConfig, LinearConfig, ModelConfig,
    OptimizerOverrides, PredictConfig, RecommenderConfig, TrainSettings, ValidationSettings)

__all__ = ["train", "predict", "evaluate", "RecommenderConfig", "DataConfig", "ModelConfig", "LinearConfig",
           "OptimizerOverrides", "ValidationSettings", "TrainSettings", "CheckpointConfig", "PredictConfig",
           "EvaluateConfig", "ConfigError"]

REPORT_KEYS = ("input", "heldout", "checkpoint", "k", "users", "results")  # what evaluate's ``output`` holds
# Settings a resumed run must share with the checkpoint's run to draw what it would have drawn.
MUST_MATCH_ON_RESUME = ("seed", "batch_size", "validation_users", "validation_max_users", "validation_items")


# ---- shared steps ---------------------------------------------------------------------------

def check_dataset_dir(setting: str, path: str | None, hint: str = "") -> None:
    """``ConfigError`` unless ``path`` (the value of ``setting``; None: not given) is a directory."""
    if path is not None and not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "does not exist"
        raise ConfigError(f"`{setting}` {path} {what}; give a CSR dataset directory{hint}")


def open_dataset(setting: str, path: str | None, hint: str = ""):
    """The CsrDataset at ``path``, the value of ``setting`` (checked as ``check_dataset_dir``)."""
    if path is None:
        raise ConfigError(f"`{setting}` is required here; give a CSR dataset directory{hint}")
    check_dataset_dir(setting, path, hint)
    from dlrm.recommender.csr_dataset import CsrDataset

    return CsrDataset(path)


def _device(name: str | None, env):
    from dlrm.engine.devices import resolve_device

    try:
        return resolve_device(name, env)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _amp_dtype(amp: bool, dtype_name: str, device):
    """The autocast dtype of ``amp`` and ``amp_dtype`` (auto, bf16 or fp16) on ``device``, or None.
    auto: bf16, except on a CPU without bf16 instructions, where bf16 autocast is slower than
    float32: float32 there, said in one line."""
    import torch

    from dlrm.engine.devices import cpu_has_native_bf16

    if not amp:
        return None
    if dtype_name == "fp16" and device.type != "cuda":
        raise ConfigError("`amp_dtype` fp16 runs on cuda only; use `amp_dtype` bf16 on the CPU")
    if dtype_name == "auto" and device.type == "cpu" and not cpu_has_native_bf16():
        print("`amp`: training in float32: bf16 autocast is slower than float32 on a CPU without bf16 instructions "
              "(AVX512-BF16, AMX), as here; `amp_dtype` bf16 forces it".replace("`", ""), flush=True)
        return None
    return torch.float16 if dtype_name == "fp16" else torch.bfloat16


def _dist_env():
    if "WORLD_SIZE" not in os.environ:
        return None
    from dlrm.engine.process_group import dist_env

    return dist_env()


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[Any]:
    """``StopOnSignals`` for the run (None outside the main thread, where no handler can be set),
    the previous handlers restored afterwards."""
    from dlrm.engine.signals import StopOnSignals

    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    stop = StopOnSignals()
    try:
        yield stop
    finally:
        stop.over()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _plain(message: object) -> str:
    """A network file's message with its JSON paths in quotes: `Alpha` there is a key of the
    file, not a setting."""
    return str(message).replace("`", "'")


_Config = TypeVar("_Config", PredictConfig, EvaluateConfig)


def _config(job: str, cls: type[_Config], cfg: Any, args: tuple, settings: dict[str, Any]) -> _Config:
    """The config of a call of ``job``: ``cfg`` itself when it is a ``cls``, else ``cls`` of the
    arguments (the short form: the config's fields as arguments, checked as the config checks
    them). A config and settings together are a ``TypeError``: the config is the whole run."""
    if isinstance(cfg, cls):
        if args or settings:
            given = ", ".join([*(repr(a) for a in args), *settings])
            raise TypeError(f"{job}() takes a {cls.__name__} or its settings, not both (got {given} beside the "
                            f"config); use dataclasses.replace(cfg, ...) to change a setting")
        return rechecked(cfg)  # a setting changed since the config was built is checked too
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        raise TypeError(f"{job}() takes a {cls.__name__}, got {type(cfg).__name__}")
    return cls(*((cfg, *args) if cfg is not None or args else ()), **settings)


def _device_memory(device) -> int:
    """Bytes of memory of ``device``: the GPU's, or the machine's RAM."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ---- train ----------------------------------------------------------------------------------

def train(cfg: RecommenderConfig) -> dict[str, Any]:
    """Trains the run ``cfg`` describes and returns its summary (the run log's "summary" record:
    ``stop_reason`` completed, early_stopped, max_steps or interrupted, steps, epochs, seconds,
    the best validation's NDCG@K; the linear model's chosen ``regularization`` and ``dropout``).
    The checkpoint is at ``cfg.checkpoint.save_checkpoint_path`` (and PATH.best)."""
    if not isinstance(cfg, RecommenderConfig):
        raise ConfigError(f"train takes a RecommenderConfig, got {type(cfg).__name__}")
    cfg = rechecked(cfg)  # a setting changed since the config was built is checked too
    env = _dist_env()
    if cfg.model.kind == "linear":
        return _fit_linear(cfg, env)
    return _train_autoencoder(cfg, env)


def _network(cfg: RecommenderConfig):
    """The network file, its optimizer overridden by ``cfg.model.optimizer``."""
    from dlrm.recommender.network import NetworkConfigError, parse_network

    try:
        network = parse_network(cfg.model.network)
    except NetworkConfigError as e:
        raise ConfigError(f"`network` {_plain(e)}") from None
    o = cfg.model.optimizer
    overrides = {name: value for name, value in (("kind", o.optimizer), ("alpha", o.alpha), ("mu", o.mu),
                                                 ("lambda_", o.lambda_)) if value is not None}
    if overrides:
        network = dataclasses.replace(network, optimizer=dataclasses.replace(network.optimizer, **overrides))
    return network


def _train_autoencoder(cfg: RecommenderConfig, env) -> dict[str, Any]:
    network = _network(cfg)  # before any dataset: a bad file fails at once, naming the key
    data, t, v = cfg.data, cfg.train, cfg.validation
    for setting in ("input", "output"):
        check_dataset_dir(setting, getattr(data, setting), DATASET_HINT)

    from dlrm.engine.checkpoint_store import claim_checkpoint_path, latest_checkpoint
    from dlrm.engine.logger import RunLogger
    from dlrm.engine.outputs import LOG, TENSORBOARD, claim_output
    from dlrm.recommender import checkpoint
    from dlrm.recommender.item_parallel import ItemParallel
    from dlrm.recommender.model import SparseAutoencoder
    from dlrm.recommender.network import NetworkConfigError
    from dlrm.recommender.train import TrainConfig, check_datasets, make_optimizer
    from dlrm.recommender.train import train as train_loop
    from dlrm.recommender.validation import ValidationConfig, make_split
    from dlrm.recommender.validation import validate as validate_split

    device = _device(cfg.base_device, env)
    amp_dtype = _amp_dtype(t.amp, t.amp_dtype, device)
    if t.negatives is not None and network.output.activation == "softmax":
        raise ConfigError("`negatives` needs an element-wise output activation; the network's Output layer is "
                          "SoftMax, which needs every item's score: drop `negatives`")
    path, resume, overwrite = (cfg.checkpoint.save_checkpoint_path, cfg.checkpoint.resume,
                               cfg.checkpoint.overwrite)
    validating = cfg.validating
    # Before any work, every path the run writes obeys the output rule (dlrm.engine.outputs).
    inputs_named = {"input": data.input, "output": data.output, "network": cfg.model.network}
    claim_checkpoint_path(path, checkpoint.META_FORMAT, inputs=inputs_named, replace=overwrite, keep=resume,
                          suffixes=("", ".best") if cfg.validation_users > 0 else ("",))
    inputs_named["save_checkpoint_path"] = path
    if cfg.log_path:
        claim_output(cfg.log_path, LOG, "log_path", inputs=inputs_named, keep=True)
    if cfg.tensorboard_dir:
        claim_output(cfg.tensorboard_dir, TENSORBOARD, "tensorboard_dir", inputs=inputs_named, keep=True)
    found = None if overwrite else latest_checkpoint(path)
    run_id = uuid.uuid4().hex  # names this run in its checkpoints, so a .best of another run is never taken for it
    settings = cfg.settings()
    if found is not None:
        saved = checkpoint.read_meta(found).get("run_config", {})
        run_id = saved.get(checkpoint.RUN_ID, run_id)
        for name in MUST_MATCH_ON_RESUME:
            if name in saved and saved[name] != settings[name]:
                raise ConfigError(f"`resume`: the checkpoint at {found} was trained with `{name}` {saved[name]}, "
                                  f"this run has {settings[name]}; use the same `{name}` to continue it exactly")
    inputs = open_dataset("input", data.input, DATASET_HINT)
    targets = open_dataset("output", data.output, DATASET_HINT) if data.output else inputs
    try:
        network = network.resolve(inputs.n_features, targets.n_features)
    except NetworkConfigError as e:
        raise ConfigError(f"`network` {_plain(e)}") from None

    from dlrm.engine.process_group import join_processes  # torch: imported when a run starts

    join_processes(env, device, cfg.dist_timeout)
    parallel = ItemParallel.from_process_group()
    try:
        model = SparseAutoencoder(network, parallel, seed=cfg.seed, device=device)
        check_datasets(inputs, targets, model)
    except ValueError as e:
        raise ConfigError(f"`network` {cfg.model.network}: {e}") from None
    optimizer = make_optimizer(model, network.optimizer)
    state = checkpoint.load(found, model, optimizer) if found is not None else None
    best_path = checkpoint.best_path(path)
    loop = TrainConfig(batch_size=cfg.batch_size, epochs=t.epochs or t.max_epochs, seed=cfg.seed,
                       shuffle=network.shuffle_indices, negatives=t.negatives, amp_dtype=amp_dtype,
                       log_every_steps=t.log_every_steps, save_checkpoint_path=path,
                       checkpoint_every_steps=t.checkpoint_every_steps, max_steps=t.max_steps,
                       best_checkpoint_path=best_path if validating else None,
                       patience=v.patience if t.epochs is None else None, patience_steps=v.patience_steps,
                       eval_every_steps=t.eval_every_steps)
    validate, split = None, None
    if validating:
        try:
            v_cfg = ValidationConfig(user_fraction=cfg.validation_users, max_users=v.validation_max_users,
                                     item_fraction=v.validation_items, k=v.validation_k, patience=v.patience)
            split = make_split(inputs, v_cfg, cfg.seed)
        except ValueError as e:
            raise ConfigError(f"`validation_users`: {e}") from None
        validate = functools.partial(validate_split, model, inputs, split, v_cfg, amp_dtype)
    logger = RunLogger(cfg.log_path, enabled=parallel.rank == 0, tensorboard_dir=cfg.tensorboard_dir)
    run_config = {**settings, checkpoint.RUN_ID: run_id}
    with logger:
        logger.record("flags", **run_config)
        hidden = " x ".join(str(layer.n) for layer in network.hidden)
        logger.print(f"{network.name}: {model.n_input:,} inputs, hidden {hidden}, {model.n_output:,} outputs; "
                     f"{len(inputs):,} users; optimizer {network.optimizer.kind} (alpha {network.optimizer.alpha:g}); "
                     f"device {device}, {parallel.world_size} process{'es' if parallel.world_size > 1 else ''}"
                     + (f"; resuming at step {state.step} (epoch {state.epoch})" if state is not None else ""))
        if split is not None:
            logger.print(f"validation: {split.n_held:,} items of {len(split.users):,} users held out of training "
                         f"(NDCG@{v.validation_k} picks the best checkpoint, {best_path})")
        with _stop_on_signals() as stop:
            summary = train_loop(model, optimizer, inputs, targets, loop, logger, device, state, run_config,
                                 should_stop=stop.event.is_set if stop is not None else lambda: False,
                                 validate=validate, train_mask=None if split is None else split.train_mask)
        best = (f"; best validation NDCG@{v.validation_k} {summary['best_validation_ndcg']:.4f} at epoch "
                f"{summary['best_epoch']} ({best_path})" if "best_validation_ndcg" in summary else "")
        logger.print(f"Finished ({summary['stop_reason']}) after {summary['steps']} steps, {summary['epochs']} "
                     f"epochs: {summary['users_per_s']:,.0f} users/s over {summary['seconds']:.1f} s; checkpoint "
                     f"{path}{best}")
    from dlrm.engine.process_group import leave_processes  # torch: imported when a run starts

    leave_processes(env)
    if summary["stop_reason"] == "interrupted" and stop is not None and stop.signum is not None:
        summary["signal"] = stop.signum
    return summary


def _fit_linear(cfg: RecommenderConfig, env) -> dict[str, Any]:
    """The item x item model, its settings chosen on validation, refitted on all of ``input``
    and saved at ``save_checkpoint_path``."""
    if env is not None:
        raise ConfigError("the linear model fits on one process: run it without torchrun (under torchrun, "
                          "`network` trains the item-parallel autoencoder)")
    check_dataset_dir("input", cfg.data.input, DATASET_HINT)

    import torch

    from dlrm.engine.checkpoint_store import CheckpointLock, claim_checkpoint_path
    from dlrm.engine.logger import RunLogger
    from dlrm.engine.outputs import LOG, claim_output
    from dlrm.recommender import checkpoint, linear
    from dlrm.recommender.validation import ValidationConfig, make_split, validate_scores

    v = cfg.validation
    path = cfg.checkpoint.save_checkpoint_path
    inputs_named = {"input": cfg.data.input}
    claim_checkpoint_path(path, checkpoint.META_FORMAT, inputs=inputs_named, replace=cfg.checkpoint.overwrite)
    if cfg.log_path:
        claim_output(cfg.log_path, LOG, "log_path", inputs={**inputs_named, "save_checkpoint_path": path}, keep=True)
    inputs = open_dataset("input", cfg.data.input, DATASET_HINT)
    n = inputs.n_features
    device = _device(cfg.base_device, env)
    need = linear.memory_bytes(n, len(inputs))
    max_gb = cfg.model.linear.linear_max_memory_gb
    budget = max_gb * 2**30 if max_gb is not None else 0.8 * _device_memory(device)
    # float64 redoes a fit whose float32 inverse is off (linear.solve), if its memory is there.
    allow_float64 = linear.memory_bytes(n, len(inputs), torch.float64) <= budget
    if need > budget:
        raise ConfigError(f"the linear model of {n:,} items needs {need / 2**30:.1f} GiB (items^2 x "
                          f"{need // max(n * n, 1)} bytes), over the {budget / 2**30:.1f} GiB of "
                          f"`linear_max_memory_gb`: raise it if {device} has the memory, or train the item-parallel "
                          f"autoencoder (`network`)")
    try:
        v_cfg = ValidationConfig(user_fraction=cfg.validation_users, max_users=v.validation_max_users,
                                 item_fraction=v.validation_items, k=v.validation_k)
        split = make_split(inputs, v_cfg, cfg.seed)
    except ValueError as e:
        raise ConfigError(f"`validation_users`: {e}") from None
    k = v.validation_k
    run_config = cfg.settings()
    with CheckpointLock(path), RunLogger(cfg.log_path) as logger:
        logger.record("flags", **run_config)
        logger.print(f"linear item-item model (EASE, EDLAE): {len(inputs):,} users, {n:,} items, "
                     f"{inputs.nnz:,} interactions; device {device}; settings chosen by validation NDCG@{k} over "
                     f"{split.n_held:,} items of {len(split.users):,} users held out of the fit")
        started = time.perf_counter()
        g = linear.gram(inputs, split.train_mask, device)

        def validate(model: linear.LinearModel):
            return validate_scores(model.scores, inputs, split, v_cfg)

        def report(trial: linear.Trial) -> None:
            m = trial.metrics
            logger.record("validation", regularization=trial.settings.regularization, dropout=trial.settings.dropout,
                          ndcg=m.ndcg, precision=m.precision, recall=m.recall, seconds=trial.seconds)
            logger.print(f"  {trial.settings.describe():<32} validation NDCG@{k} {m.ndcg:.4f}  P@{k} "
                         f"{m.precision:.4f}  R@{k} {m.recall:.4f}  ({trial.seconds:.1f} s)")

        try:
            choice = linear.choose(g, validate, report=report, allow_float64=allow_float64)
            del g
            best = choice.best
            ease = max((t for t in choice.trials if t.settings.dropout == 0), key=lambda t: t.metrics.ndcg)
            fitted = linear.LinearModel(linear.solve(linear.gram(inputs, None, device), best.settings, allow_float64),
                                         best.settings)
        except linear.LinearFitError as e:
            raise ConfigError(str(e).replace("`regularization`", "the regularisation")) from None
        validation = {"k": k, "ndcg": best.metrics.ndcg, "precision": best.metrics.precision,
                      "recall": best.metrics.recall, "users": len(split.users), "held_out": split.n_held,
                      "ease_ndcg": ease.metrics.ndcg, "ease_regularization": ease.settings.regularization,
                      "trials": len(choice.trials)}
        checkpoint.save_linear(path, fitted, validation, run_config)
        seconds = time.perf_counter() - started
        summary = {"stop_reason": "completed", "model": "linear", **dataclasses.asdict(best.settings),
                   "best_validation_ndcg": best.metrics.ndcg, "seconds": seconds}
        logger.record("summary", **summary)
        why = ("EASE's best" if best.settings.dropout == 0 else
               f"EASE's best {ease.metrics.ndcg:.4f} at lambda {ease.settings.regularization:g}")
        logger.print(f"chose {best.settings.describe()}: validation NDCG@{k} {best.metrics.ndcg:.4f} ({why}, the "
                     f"best of {len(choice.trials)} settings); refitted on all {len(inputs):,} users; "
                     f"{seconds:.1f} s; checkpoint {path}")
    return summary


# ---- predict --------------------------------------------------------------------------------

def index_beside(given: str | None, input_path: str, name: str) -> tuple[str | None, bool]:
    """(the index file to name items or users by, whether it was found rather than given): the
    file given, else recommender_generate's ``name`` beside the ``input`` dataset (DIR/``name``
    for DIR/input), else None (numbers)."""
    if given:
        return given, False
    candidate = os.path.join(os.path.dirname(os.path.abspath(input_path)), name)
    return (candidate, True) if os.path.isfile(candidate) else (None, False)


def _names(setting: str, given: str | None, input_path: str, count: int, exact: bool) -> list[str]:
    """``count`` names from the index file of ``setting``: the one given, else recommender_generate's
    beside ``input``; row/column numbers without one (or with ""), said in a line."""
    from dlrm.recommender.dsstne_text import NameIndex

    name = f"{setting}.txt"
    if given == "":  # numbers, as asked
        return [str(i) for i in range(count)]
    path, found = index_beside(given, input_path, name)
    what = "users of input" if setting == "samples_index" else "items of the checkpoint's network"
    numbers = "row numbers for users" if setting == "samples_index" else "column numbers for items"
    if not path:
        print(f"note: writing {numbers}: no {setting}, and no {name} beside the input", flush=True)
        return [str(i) for i in range(count)]
    if not os.path.isfile(path):
        raise ConfigError(f"`{setting}` {path}: no such file")
    index = NameIndex.load(path)
    if index.size < count or (exact and index.size != count):
        if found:
            print(f"note: writing {numbers}: {path} beside the input names {index.size:,} entries, not the "
                  f"{count:,} {what}; give {setting}", flush=True)
            return [str(i) for i in range(count)]
        raise ConfigError(f"`{setting}` {path} names {index.size:,} entries for the {count:,} {what}; give the "
                          f"index written with that dataset")
    if found:
        print(f"names of the {what.split(' of ')[0]} from {path} (beside the input)", flush=True)
    return index.labels(count)


def is_scores(path: str) -> bool:
    """Whether file ``path`` is a float32 .npy of [samples, items], as ``scores_path`` is written."""
    import numpy as np

    try:
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
    except (OSError, ValueError):
        return False
    return dtype == np.float32 and len(shape) == 2


def _scores_kind():
    from dlrm.engine.outputs import OutputKind

    return OutputKind("scores file", directory=False, recognise=is_scores)


def predict(cfg: PredictConfig | str | None = None, /, *args: Any, **settings: Any) -> dict[str, Any]:
    """Writes the top ``cfg.k`` items of every user of ``cfg.input`` to ``cfg.output`` (DSSTNE's
    format), scored by the checkpoint at ``cfg.load_checkpoint_path`` (its PATH.best with
    ``best``), as ``recommender_predict`` (whose flags are the config's fields) does.
    ``predict(load_checkpoint_path, input, output, k=10, ...)`` is the same call: the arguments
    make the ``PredictConfig``; a config with arguments beside it is a ``TypeError``. Returns
    {"users", "items", "k", "seconds", "filters", "exclude_inputs", "processes", "first"}
    ("first": this process wrote the file)."""
    cfg = _config("predict", PredictConfig, cfg, args, settings)
    from dlrm.engine.outputs import claim_output
    from dlrm.recommender.prediction_file import PREDICTIONS

    input, output, scores_path, k = cfg.input, cfg.output, cfg.scores_path, cfg.k
    filters_given = list(cfg.filter)
    env = _dist_env()
    if scores_path and env is not None and env.world_size > 1:
        raise ConfigError("`scores_path` writes one file from one process; run without torchrun to dump the "
                          "scores, or drop `scores_path`")
    for setting, path in [("input", input)] + [("filter", p) for p in filters_given]:
        check_dataset_dir(setting, path)  # before torch loads: a mistyped path fails at once
    # Before any work (dlrm.engine.outputs): each output file is new, or this program's own of its
    # kind and overwrite given; none is an input of the run or the other output.
    named = {"load_checkpoint_path": cfg.load_checkpoint_path, "input": input, "filter": filters_given,
             "features_index": cfg.features_index, "samples_index": cfg.samples_index}
    claimed = claim_output(output, PREDICTIONS, "output", inputs=named, replace=cfg.overwrite)
    if scores_path:
        scores_claim = claim_output(scores_path, _scores_kind(), "scores_path", inputs=named, replace=cfg.overwrite)
        if os.path.realpath(scores_claim) == os.path.realpath(claimed):
            raise ConfigError(f"`scores_path` {scores_path} and `output` {output} name the same file; give each its "
                              f"own")
    from dlrm.engine.atomic import check_can_create, check_free_space, write_atomically

    if env is None or env.rank == 0:  # the first process writes: a read-only or missing file system fails now
        check_can_create(output, "the predictions")
        if scores_path:
            check_can_create(scores_path, "the scores")
    import numpy as np

    from dlrm.recommender import checkpoint
    from dlrm.recommender.item_parallel import ItemParallel
    from dlrm.recommender.predict import recommend, write_predictions

    device = _device(cfg.base_device, env)
    amp_dtype = _amp_dtype(cfg.amp, cfg.amp_dtype, device)
    path = checkpoint.model_path(cfg.load_checkpoint_path, cfg.best)
    n_input, n_output = checkpoint.sizes_of(path)
    inputs = open_dataset("input", input)
    if inputs.n_features != n_input:
        raise ConfigError(f"`input` {input} has {inputs.n_features:,} items, the checkpoint's model {n_input:,} "
                          f"inputs; give the dataset (and features index) it was trained on")
    filters = [open_dataset("filter", p) for p in filters_given]
    for f in filters:
        if len(f) != len(inputs):
            raise ConfigError(f"`filter` {f.path} has {len(f):,} users, `input` {len(inputs):,}: they must hold the "
                              f"same users in the same order")
    item_names = _names("features_index", cfg.features_index, input, n_output, exact=False)
    user_names = _names("samples_index", cfg.samples_index, input, len(inputs), exact=True)

    from dlrm.engine.process_group import join_processes  # torch: imported when a run starts

    join_processes(env, device, cfg.dist_timeout)
    parallel = ItemParallel.from_process_group()
    score, item_start = checkpoint.load_scorer(path, parallel, device, amp_dtype)
    first = parallel.rank == 0
    if first:
        print(f"model: {checkpoint.describe(path)}", flush=True)

    def batches(scores=None):
        done = 0

        def scored(csr):
            nonlocal done
            values = score(csr)
            if scores is not None:  # before recommend() writes -inf over the excluded items
                scores[done:done + values.shape[0]] = values.float().cpu().numpy()
                done += values.shape[0]
            return values

        return recommend(scored, inputs, k, cfg.batch_size, item_start=item_start, exclude=filters,
                         exclude_inputs=cfg.exclude_inputs, parallel=parallel)

    started = time.perf_counter()
    lines = 0
    if not first:
        for _ in batches():  # the collectives of the merge, in step with the first process
            pass
    elif scores_path:
        check_free_space(scores_path, len(inputs) * n_output * 4, "the scores")

        def write_scores(tmp: str) -> None:
            nonlocal lines
            scores = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float32, shape=(len(inputs), n_output))
            with open(tmp, "rb+") as f:  # claim the blocks: a full disk is an error now, not a SIGBUS in the memmap
                os.posix_fallocate(f.fileno(), 0, os.path.getsize(tmp))
            lines = write_predictions(output, batches(scores), user_names, item_names, cfg.score_format)
            scores.flush()
            del scores

        write_atomically(scores_path, write_scores, "the scores")
    else:
        lines = write_predictions(output, batches(), user_names, item_names, cfg.score_format)
    # Scoring, exclusion, top K and writing; loading the model and the data is not counted.
    seconds = time.perf_counter() - started
    processes = parallel.world_size
    from dlrm.engine.process_group import leave_processes  # torch: imported when a run starts

    leave_processes(env)
    return {"users": lines, "items": n_output, "k": k, "seconds": seconds, "filters": len(filters),
            "exclude_inputs": cfg.exclude_inputs, "processes": processes, "first": first}


# ---- evaluate -------------------------------------------------------------------------------

def _is_metrics(path: str) -> bool:
    """Whether file ``path`` is a metrics report of ``evaluate``: a JSON object of ``REPORT_KEYS``."""
    try:
        with open(path, encoding="utf-8") as f:
            report = json.loads(f.read(1 << 24))
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and sorted(report) == sorted(REPORT_KEYS)


def _metrics_kind():
    from dlrm.engine.outputs import OutputKind

    return OutputKind("metrics file", directory=False, recognise=_is_metrics)


def _row(metrics) -> dict:
    out = {}
    for m in metrics:
        out.update({f"precision@{m.k}": m.precision, f"recall@{m.k}": m.recall, f"ndcg@{m.k}": m.ndcg,
                    f"coverage@{m.k}": m.coverage})
    out["users"] = metrics[0].users
    return out


def evaluate(cfg: EvaluateConfig | str | None = None, /, *args: Any, **settings: Any) -> dict[str, Any] | None:
    """Precision, recall, NDCG and coverage at each of ``cfg.k`` of the checkpoint at
    ``cfg.load_checkpoint_path`` (if given) and of ``cfg.baselines``, ranking every item a user of
    ``cfg.input`` has not seen against their ``cfg.heldout`` items, as ``recommender_evaluate``
    (whose flags are the config's fields) does; ``output`` also writes the report as JSON.
    ``evaluate(input, heldout, load_checkpoint_path=..., k=(5, 10), ...)`` is the same call: the
    arguments make the ``EvaluateConfig``; a config with arguments beside it is a ``TypeError``.
    Returns the report (input, heldout, checkpoint, k, users, results: a row of metrics per
    model) with "n_users" and "n_items" of ``input``; under torchrun, None on every process but
    the first."""
    cfg = _config("evaluate", EvaluateConfig, cfg, args, settings)
    input, heldout, output, load_checkpoint_path = cfg.input, cfg.heldout, cfg.output, cfg.load_checkpoint_path
    ks, baselines, batch_size = list(cfg.k), list(cfg.baselines), cfg.batch_size
    if output:  # before any work (dlrm.engine.outputs; a read-only file system too)
        from dlrm.engine.outputs import claim_output

        claim_output(output, _metrics_kind(), "output", replace=cfg.overwrite,
                     inputs={"input": input, "heldout": heldout, "load_checkpoint_path": load_checkpoint_path})
    for setting, path in (("input", input), ("heldout", heldout)):
        check_dataset_dir(setting, path)  # before torch loads: a mistyped path fails at once
    inputs, held = open_dataset("input", input), open_dataset("heldout", heldout)
    if len(inputs) != len(held) or inputs.n_features != held.n_features:
        raise ConfigError(f"`input` has {len(inputs):,} users and {inputs.n_features:,} items, `heldout` "
                          f"{len(held):,} and {held.n_features:,}: give the two halves of one held-out split "
                          f"(DIR/input and DIR/heldout of recommender_generate)")
    ease_limit = int(cfg.ease_max_memory_gb * 2**30)
    if "ease" in baselines:  # refused before anything is evaluated, not after the model
        from dlrm.recommender.baselines import ease_memory_bytes, memory_size

        need = ease_memory_bytes(inputs.n_features)
        if need > ease_limit:
            others = ",".join(b for b in baselines if b != "ease") or ",".join(b for b in BASELINES if b != "ease")
            raise ConfigError(f"`baselines` ease: a catalogue of {inputs.n_features:,} items needs "
                              f"{memory_size(need)} for EASE (items^2 x 12 bytes), over `ease_max_memory_gb` "
                              f"{cfg.ease_max_memory_gb:g}; raise `ease_max_memory_gb` if the machine has the memory, "
                              f"leave ease out (`baselines` {others}), or evaluate a smaller catalogue")
    from dlrm.recommender.predict import evaluate as evaluate_lists
    from dlrm.recommender.predict import recommend

    results: dict[str, dict] = {}
    if load_checkpoint_path:
        import torch

        from dlrm.recommender import checkpoint
        from dlrm.recommender.item_parallel import ItemParallel

        env = _dist_env()
        device = _device(cfg.base_device, env)
        dtype = _amp_dtype(cfg.amp, cfg.amp_dtype, device)
        path = checkpoint.model_path(load_checkpoint_path, cfg.best)
        n_input, n_output = checkpoint.sizes_of(path)
        if (n_input, n_output) != (inputs.n_features, held.n_features):
            raise ConfigError(f"`load_checkpoint_path` {load_checkpoint_path} has {n_input:,} inputs and "
                              f"{n_output:,} outputs, `input` and `heldout` {inputs.n_features:,} and "
                              f"{held.n_features:,} items; evaluate on the datasets it was trained for")
        from dlrm.engine.process_group import join_processes  # torch: imported when a run starts

        join_processes(env, device, cfg.dist_timeout)
        parallel = ItemParallel.from_process_group()
        score, item_start = checkpoint.load_scorer(path, parallel, device, dtype)
        if parallel.rank == 0:
            print(f"model: {checkpoint.describe(path)}", flush=True)
        started = time.perf_counter()
        lists = recommend(score, inputs, max(ks), batch_size, item_start=item_start, parallel=parallel)
        results["model"] = {**_row(evaluate_lists(lists, held, ks)), "seconds": time.perf_counter() - started}
        if env is not None:  # the baselines run on one process: the others are done
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        if parallel.rank != 0:
            return None
    if baselines:
        from dlrm.recommender.baselines import fit_baseline

        rows = inputs.rows()
        fits = {"popularity": {}, "itemknn": {"neighbours": cfg.knn_neighbours},
                "mf": {"factors": cfg.mf_factors, "iterations": cfg.mf_iterations, "seed": cfg.seed},
                "ease": {"regularization": cfg.ease_lambda, "max_memory_bytes": ease_limit}}
        for name in baselines:
            started = time.perf_counter()
            baseline = fit_baseline(name, rows, **fits[name])
            fitted = time.perf_counter()
            lists = recommend(lambda csr, b=baseline: b.scores(csr[0], csr[1]), inputs, max(ks), batch_size)
            results[name] = {**_row(evaluate_lists(lists, held, ks)), "fit_seconds": fitted - started,
                             "seconds": time.perf_counter() - fitted}
    report = {"input": os.path.abspath(input), "heldout": os.path.abspath(heldout),
              "checkpoint": os.path.abspath(load_checkpoint_path) if load_checkpoint_path else None, "k": ks,
              "users": next(iter(results.values()))["users"], "results": results}
    if output:
        from dlrm.engine.atomic import write_text_atomically

        write_text_atomically(output, json.dumps(report, indent=1) + "\n")
    return {**report, "n_users": len(inputs), "n_items": inputs.n_features}
