"""A recommender training run as typed settings that check themselves: what
``dlrm.scripts.recommender_train`` does, without flags.

    cfg = RecommenderConfig(data=DataConfig(input="/data/ml100k/input"),
                            checkpoint=CheckpointConfig(save_checkpoint_path="ckpt/"))
    dlrm.recommender.api.train(cfg)

The parts: ``data`` (the CSR datasets), ``model`` (the linear item-item model's settings, or a
DSSTNE JSON network file and overrides of its optimizer), ``validation`` (the split that
chooses the linear model's settings and the autoencoder's best checkpoint), ``train`` (the
autoencoder's loop: epochs, steps, the schedule of logs, validations and checkpoints) and
``checkpoint`` (where it saves, whether it resumes). The settings every run has (``seed``,
``batch_size``, the device, the logs) are the config's own, as in ``dlrm.training.RunConfig``.

Every setting is named as the flag of ``recommender_train`` that sets it, and the loop's
settings as DLRM's (``log_every_steps``, ``eval_every_steps``, ``checkpoint_every_steps``,
``save_checkpoint_path``); the flags ``--print_freq`` and ``--validate_every_steps`` set
``log_every_steps`` and ``eval_every_steps``, and ``lambda_`` is ``--lambda`` (a Python keyword).

``PredictConfig`` and ``EvaluateConfig`` are the same for ``recommender_predict`` and
``recommender_evaluate`` (``api.predict``, ``api.evaluate``): flat, one field per flag of the
script, of the same name.

    dlrm.recommender.api.predict(PredictConfig("ckpt/", "/data/ml100k/input", "recs.txt", k=10))

Constructing one validates it (``__post_init__``) and raises ``ConfigError`` (a ``ValueError``)
naming each setting in backquotes, so a script shows the message in its flags' names
(``dlrm.scripts.cli.flag_terms``). What needs the files, torch or the process group (a dataset
that is not there, a network file that does not parse, a device) is checked by the ``api`` call
before any work, with the same error.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Sequence

from dlrm.engine.config_check import check_float32, check_seed, check_types

MODELS = ("auto", "linear", "autoencoder")
OPTIMIZERS = ("sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam")
AMP_DTYPES = ("auto", "bf16")
# Scoring only (predict, evaluate): no loss to scale, so fp16 too (on cuda: checked with the device).
SCORING_AMP_DTYPES = ("auto", "bf16", "fp16")
BASELINES = ("popularity", "itemknn", "mf", "ease")  # evaluate's, in the order they are reported
DATASET_HINT = " (e.g. DIR/input of recommender_generate)"
# The share of users that lend items to validation when ``validation_users`` is None.
DEFAULT_VALIDATION_USERS = {"autoencoder": 0.1, "linear": 1.0}


class ConfigError(ValueError):
    """A recommender run refused before any work: the message names the setting in backquotes
    and the fix. Scripts report it as one line (exit 2)."""


def _check_at_least(least: float, **settings: float | None) -> None:
    """Each setting given (not None) must be a number >= ``least`` (NaN is refused too)."""
    for name, value in settings.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"`{name}` {value!r}: must be a number")
        if value is not None and not (value >= least and math.isfinite(value)):
            raise ConfigError(f"`{name}` {value}: must be >= {least:g}")


def _check_share(**settings: float | None) -> None:
    for name, value in settings.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"`{name}` {value!r}: must be a number")
        if value is not None and not 0 <= value <= 1:
            raise ConfigError(f"`{name}` {value:g}: must be in [0, 1]")


def _check_choice(name: str, value: Any, choices: tuple[str, ...], optional: bool = False) -> None:
    if not (value in choices or (optional and value is None)):
        raise ConfigError(f"`{name}` {value!r}: must be one of {', '.join(choices)}")


@dataclass
class DataConfig:
    """``input``: the CSR dataset of the user histories (e.g. DIR/input of recommender_generate);
    ``output``: that of the targets, the same users in the same order (None: ``input``, an
    autoencoder)."""

    input: str | None = None
    output: str | None = None

    def __post_init__(self) -> None:
        check_types(self, ConfigError, paths=("input", "output"))


@dataclass
class OptimizerOverrides:
    """Overrides of the network file's Optimizer block (None: the file's)."""

    optimizer: str | None = None  # Optimizer.Kind
    alpha: float | None = None  # Optimizer.Alpha, the learning rate (> 0)
    mu: float | None = None  # Optimizer.Mu, momentum (RMSProp's decay), in [0, 1)
    lambda_: float | None = None  # Optimizer.Lambda, L2 weight decay of the weights (>= 0); --lambda

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        check_float32(ConfigError, alpha=self.alpha, **{"lambda": self.lambda_})  # the step's arithmetic
        _check_choice("optimizer", self.optimizer, OPTIMIZERS, optional=True)
        if self.alpha is not None and not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ConfigError(f"`alpha` {self.alpha:g}: the learning rate must be > 0")
        if self.mu is not None and not 0 <= self.mu < 1:
            raise ConfigError(f"`mu` {self.mu:g}: must be in [0, 1)")
        if self.lambda_ is not None and not (self.lambda_ >= 0 and math.isfinite(self.lambda_)):
            raise ConfigError(f"`lambda` {self.lambda_:g}: the weight decay must be >= 0")


@dataclass
class LinearConfig:
    """The linear item-item model (EASE, EDLAE; ``dlrm.recommender.linear``): its settings are
    chosen on validation, so it has only a memory bound. ``linear_max_memory_gb`` None: 80% of
    the device's (the GPU's, or the machine's RAM)."""

    linear_max_memory_gb: float | None = None

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        _check_at_least(0, linear_max_memory_gb=self.linear_max_memory_gb)


@dataclass
class ModelConfig:
    """``model``: auto (the linear model without ``network``, the autoencoder with it), linear
    or autoencoder; ``network``: a DSSTNE JSON network definition (the autoencoder's), its
    optimizer overridden by ``optimizer``'s settings."""

    model: str = "auto"
    network: str | None = None
    linear: LinearConfig = field(default_factory=LinearConfig)
    optimizer: OptimizerOverrides = field(default_factory=OptimizerOverrides)

    def __post_init__(self) -> None:
        check_types(self, ConfigError, paths=("network",))
        _check_choice("model", self.model, MODELS)
        if self.model == "autoencoder" and not self.network:
            raise ConfigError("`model` autoencoder needs `network` (a DSSTNE JSON network, e.g. "
                              "configs/recommender/mult_dae.json); or drop `model` for the linear model")

    @property
    def kind(self) -> str:
        """The model this run trains: "linear" or "autoencoder"."""
        if self.model != "auto":
            return self.model
        return "autoencoder" if self.network else "linear"


@dataclass
class ValidationSettings:
    """The validation split (``dlrm.recommender.validation``): ``validation_items`` of the items
    of ``validation_users`` of the users (at most ``validation_max_users``) are held out and
    ranked; NDCG@``validation_k`` chooses the linear model's settings and the autoencoder's best
    checkpoint. ``validation_users`` None: 0.1 for the autoencoder, every user (1) for the linear
    model; 0: no validation (then the autoencoder needs ``epochs``). Without ``epochs`` the
    autoencoder stops once ``patience`` validations and ``patience_steps`` steps have passed
    without a better NDCG@K."""

    validation_users: float | None = None
    validation_max_users: int = 10_000
    validation_items: float = 0.2
    validation_k: int = 10
    patience: int = 5
    patience_steps: int = 200

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        _check_share(validation_users=self.validation_users, validation_items=self.validation_items)
        _check_at_least(1, validation_max_users=self.validation_max_users, validation_k=self.validation_k,
                        patience=self.patience)
        _check_at_least(0, patience_steps=self.patience_steps)


@dataclass
class TrainSettings:
    """The autoencoder's training loop. ``epochs`` None: until validation stops it (at most
    ``max_epochs``); ``max_steps``: stop after that many steps of this run (the checkpoint
    resumes). A line every ``log_every_steps`` (0: never), a validation every
    ``eval_every_steps`` and a checkpoint every ``checkpoint_every_steps`` (0: at the end of
    every epoch). ``negatives``: sampled negative items per step (None: every item is scored).
    ``amp``: autocast in ``amp_dtype`` (auto: bf16, or float32 on a CPU without bf16
    instructions)."""

    epochs: int | None = None
    max_epochs: int = 200
    max_steps: int | None = None
    log_every_steps: int = 100
    eval_every_steps: int = 0
    checkpoint_every_steps: int = 0
    negatives: int | None = None
    amp: bool = False
    amp_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        _check_at_least(1, epochs=self.epochs, max_epochs=self.max_epochs, max_steps=self.max_steps,
                        negatives=self.negatives)
        _check_at_least(0, log_every_steps=self.log_every_steps, eval_every_steps=self.eval_every_steps,
                        checkpoint_every_steps=self.checkpoint_every_steps)
        _check_choice("amp_dtype", self.amp_dtype, AMP_DTYPES)


@dataclass
class CheckpointConfig:
    """Where the run saves (``save_checkpoint_path``, and PATH.best when it validates).
    ``resume``: continue the checkpoint there exactly (same ``seed`` and ``batch_size``);
    ``overwrite``: start over in its place. Without either, a checkpoint already there is refused;
    a folder holding anything else is never replaced (``dlrm.engine.outputs``)."""

    save_checkpoint_path: str | None = None
    resume: bool = False
    overwrite: bool = False

    def __post_init__(self) -> None:
        check_types(self, ConfigError)
        if self.resume and self.overwrite:
            raise ConfigError("`resume` continues the checkpoint at `save_checkpoint_path` and `overwrite` starts "
                              "over in its place: pass one of them")


@dataclass
class RecommenderConfig:
    """One recommender training run (module docstring). ``base_device``: cuda, cuda:N or cpu
    (None: cuda if available); ``dist_timeout``: under torchrun, seconds a collective may wait;
    ``log_path``: a JSON-lines run log (appended to); ``tensorboard_dir``: the logged metrics as
    TensorBoard scalars too."""

    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    validation: ValidationSettings = field(default_factory=ValidationSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0
    batch_size: int = 256
    base_device: str | None = None
    dist_timeout: float = 300.0
    log_path: str | None = None
    tensorboard_dir: str | None = None

    def __post_init__(self) -> None:
        check_types(self, ConfigError)  # the parts are of their classes, each checked when built
        check_seed(self.seed, error=ConfigError)
        if not self.data.input:
            raise ConfigError(f"`input` is required; give a CSR dataset directory{DATASET_HINT}")
        if not self.checkpoint.save_checkpoint_path:
            raise ConfigError("`save_checkpoint_path` is required: the directory the trained model is saved to")
        _check_at_least(1, batch_size=self.batch_size, dist_timeout=self.dist_timeout)
        if self.model.kind == "linear":
            self._check_linear()
        else:
            self._check_autoencoder()

    @property
    def validation_users(self) -> float:
        """``validation.validation_users``, or its default for this run's model."""
        given = self.validation.validation_users
        return DEFAULT_VALIDATION_USERS[self.model.kind] if given is None else given

    @property
    def validating(self) -> bool:
        """Whether the run holds out a validation split (an autoencoder with other targets cannot)."""
        return self.validation_users > 0 and not (self.model.kind == "autoencoder" and self.data.output)

    def _check_linear(self) -> None:
        # The autoencoder's settings: the linear model refuses them rather than ignore them.
        given = leaves(self)
        for name in _AUTOENCODER_SETTINGS:
            if given[name] != _DEFAULTS[name]:
                raise ConfigError(f"`{name.rstrip('_')}` applies to the autoencoder (`network`), not to the linear "
                                  f"model, which has no epochs, steps or optimizer: drop it, or give `network`")
        if not 0 < self.validation.validation_items < 1:
            raise ConfigError(f"`validation_items` {self.validation.validation_items:g}: must be in (0, 1)")
        if self.validation_users <= 0:
            raise ConfigError("`validation_users` 0: the linear model's settings are chosen on validation; give a "
                              "share of the users in (0, 1]")

    def _check_autoencoder(self) -> None:
        epochs = self.train.epochs
        if self.validation_users > 0 and self.data.output and epochs is None:
            raise ConfigError("`output`: validation holds out items of an autoencoder's own input, which other "
                              "targets cannot follow; give `epochs` (and `validation_users` 0)")
        if not self.validating and epochs is None:
            raise ConfigError("`validation_users` 0: without validation, give `epochs`")
        if self.validating and not 0 < self.validation.validation_items < 1:
            raise ConfigError(f"`validation_items` {self.validation.validation_items:g}: must be in (0, 1)")

    def settings(self) -> dict[str, Any]:
        """Every setting under its name (``lambda_`` as "lambda"), ``validation_users`` resolved:
        the run log's "flags" record and a checkpoint's ``run_config``."""
        out = {name.rstrip("_"): value for name, value in leaves(self).items()}
        out["validation_users"] = self.validation_users
        return out


# Settings of the autoencoder's training alone (named as in ``leaves``).
_AUTOENCODER_SETTINGS = ("network", "output", "batch_size", "epochs", "max_epochs", "patience", "patience_steps",
                         "eval_every_steps", "resume", "checkpoint_every_steps", "max_steps", "amp", "amp_dtype",
                         "negatives", "optimizer", "alpha", "mu", "lambda_", "tensorboard_dir", "log_every_steps")


def leaves(config: Any) -> dict[str, Any]:
    """The settings of a config tree by their (unique) field names, parts flattened."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            out.update(leaves(value))
        else:
            out[f.name] = value
    return out


def _defaults() -> dict[str, Any]:
    """The default of every setting, read off the classes (a whole config would validate)."""
    out: dict[str, Any] = {}
    for cls in (DataConfig, ModelConfig, LinearConfig, OptimizerOverrides, ValidationSettings, TrainSettings,
                CheckpointConfig, RecommenderConfig):
        out.update({f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING})
    return out


_DEFAULTS = _defaults()


# ---- predict and evaluate -------------------------------------------------------------------

def check_score_format(value: str) -> str:
    """``score_format`` checked (``dlrm.recommender.topk.check_score_format``; its ``%`` added if
    left out), or ``ConfigError`` giving its bounds."""
    # topk imports torch: imported here, so that importing this module stays light.
    from dlrm.recommender.topk import MAX_SCORE_PRECISION, MAX_SCORE_WIDTH
    from dlrm.recommender.topk import check_score_format as check

    try:
        return check(value)
    except ValueError:
        raise ConfigError(f"`score_format` {value!r}: give a printf format of one float, e.g. %.6g (the default) or "
                          f"%4.3f (DSSTNE's), with at most {MAX_SCORE_PRECISION} digits of precision and a width of "
                          f"at most {MAX_SCORE_WIDTH}") from None


def _check_required(what: dict[str, str], settings: dict[str, Any]) -> None:
    """Each of ``settings`` must be given (not None or ""); ``what`` says what it is."""
    for name, value in settings.items():
        if value is None or value == "":
            raise ConfigError(f"`{name}` is required{what[name]}")


def _as_tuple(name: str, value: Any) -> tuple:
    """A sequence setting as a tuple (a lone string: one entry), so that a config holds tuples
    whatever it was given (lists from flags, tuples as defaults)."""
    if isinstance(value, str):
        return (value,)
    try:
        return tuple(value)
    except TypeError:
        raise ConfigError(f"`{name}` {value!r}: must be a sequence") from None


@dataclass
class PredictConfig:
    """One ``recommender_predict`` run: the top ``k`` items of every user of ``input``, scored by
    the checkpoint at ``load_checkpoint_path`` (its PATH.best with ``best``), written to
    ``output`` in DSSTNE's format. The fields are the script's flags (its --help says each);
    ``features_index``/``samples_index`` None: the index beside ``input``, "": numbers;
    ``filter``: datasets of further items not to recommend (a tuple); ``scores_path``: every
    score too, a float32 .npy (one process only); ``score_format`` is kept with its ``%``."""

    load_checkpoint_path: str | None = None
    input: str | None = None
    output: str | None = None
    _: KW_ONLY  # as api.predict's arguments were: the three paths by position, the rest by name
    k: int = 10
    best: bool = True
    features_index: str | None = None
    samples_index: str | None = None
    filter: Sequence[str] = ()
    exclude_inputs: bool = True
    score_format: str = "%.6g"
    batch_size: int = 1024
    scores_path: str | None = None
    overwrite: bool = False
    base_device: str | None = None
    amp: bool = False
    amp_dtype: str = "auto"
    dist_timeout: float = 300.0

    def __post_init__(self) -> None:
        check_types(self, ConfigError, paths=("input", "output", "features_index", "samples_index"))
        _check_required({"load_checkpoint_path": ": the checkpoint directory of recommender_train to load",
                         "input": f"; give a CSR dataset directory{DATASET_HINT}",
                         "output": ": the text file the recommendations are written to"},
                        {"load_checkpoint_path": self.load_checkpoint_path, "input": self.input,
                         "output": self.output})
        _check_at_least(1, k=self.k, batch_size=self.batch_size, dist_timeout=self.dist_timeout)
        self.filter = _as_tuple("filter", self.filter)
        _check_choice("amp_dtype", self.amp_dtype, SCORING_AMP_DTYPES)
        self.score_format = check_score_format(self.score_format)


@dataclass
class EvaluateConfig:
    """One ``recommender_evaluate`` run: precision, recall, NDCG and coverage at each of ``k`` of
    the checkpoint at ``load_checkpoint_path`` (if given) and of ``baselines``, every user of
    ``input`` ranked against their ``heldout`` items; ``output``: the report as JSON too. The
    fields are the script's flags (its --help says each). ``k`` is kept sorted without repeats
    and ``baselines`` without repeats (tuples), as the report has them."""

    input: str | None = None
    heldout: str | None = None
    _: KW_ONLY  # as api.evaluate's arguments were: the two datasets by position, the rest by name
    load_checkpoint_path: str | None = None
    best: bool = True
    baselines: Sequence[str] = BASELINES
    k: int | Sequence[int] = (1, 5, 10, 20)
    batch_size: int = 1024
    output: str | None = None
    overwrite: bool = False
    mf_factors: int = 64
    mf_iterations: int = 10
    knn_neighbours: int = 100
    seed: int = 0
    ease_lambda: float = 250.0
    ease_max_memory_gb: float = 12.0
    base_device: str | None = None
    amp: bool = False
    amp_dtype: str = "auto"
    dist_timeout: float = 300.0

    def __post_init__(self) -> None:
        check_types(self, ConfigError, paths=("input", "heldout", "output"))
        check_seed(self.seed, error=ConfigError)
        _check_required({"input": f"; give a CSR dataset directory{DATASET_HINT}",
                         "heldout": "; give a CSR dataset directory (e.g. DIR/heldout of recommender_generate)"},
                        {"input": self.input, "heldout": self.heldout})
        k = (self.k,) if isinstance(self.k, numbers.Integral) else _as_tuple("k", self.k)
        if not k:
            raise ConfigError("`k` is empty; give at least one cut-off, e.g. `k` 10")
        if not all(isinstance(K, numbers.Integral) and not isinstance(K, bool) for K in k):
            raise ConfigError(f"`k` {', '.join(map(repr, k))}: every K must be an integer")
        if min(k) < 1:
            raise ConfigError(f"`k` {','.join(map(str, k))}: every K must be >= 1, got {min(k)}")
        self.k = tuple(sorted({int(K) for K in k}))
        baselines = _as_tuple("baselines", self.baselines)
        unknown = [b for b in baselines if b not in BASELINES]
        if unknown:
            raise ConfigError(f"`baselines`: unknown {', '.join(map(repr, unknown))}; choose from "
                              f"{','.join(BASELINES)}")
        self.baselines = tuple(dict.fromkeys(baselines))
        if isinstance(self.ease_lambda, bool) or not isinstance(self.ease_lambda, (int, float)):
            raise ConfigError(f"`ease_lambda` {self.ease_lambda!r}: must be a number")
        if "ease" in self.baselines and not self.ease_lambda > 0:
            raise ConfigError(f"`ease_lambda` {self.ease_lambda:g}: must be > 0, so that X^T X + lambda I is "
                              f"invertible")
        if not self.baselines and not self.load_checkpoint_path:
            raise ConfigError("nothing to evaluate: give `load_checkpoint_path`, or baselines with `baselines`")
        _check_at_least(1, batch_size=self.batch_size, mf_factors=self.mf_factors,
                        knn_neighbours=self.knn_neighbours, dist_timeout=self.dist_timeout)
        _check_at_least(0, mf_iterations=self.mf_iterations, ease_max_memory_gb=self.ease_max_memory_gb)
        _check_choice("amp_dtype", self.amp_dtype, SCORING_AMP_DTYPES)
