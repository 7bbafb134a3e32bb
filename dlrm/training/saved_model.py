"""The model of a run that starts from a checkpoint: the checkpoint's own, checked against the data.

A checkpoint carries its whole model (``meta.json``'s ``model_config``; in NVIDIA's layout, the
shapes of its files and the flags its metadata holds), so ``mode`` test and inference_benchmark
with ``load_checkpoint_path`` need no model setting: they serve the model that was trained, and
a user who trained with other sizes than the defaults never meets a shape error. A model setting
of ``RunConfig.model`` left at its default follows the checkpoint; one given with another value
than the checkpoint's is refused, naming both (the run would otherwise load weights into a model
they do not fit, or silently serve another model than asked for).

What stays the run's own choice, because it changes how the model runs and not what it computes:
``embedding_type`` (the checkpoint layout does not depend on the storage; left at its default the
checkpoint's is used), ``interaction_op`` dot or cuda_dot for a dot model (``auto``: the device's
pick), and, where NVIDIA's layout does not record it, ``embedding_dtype``.

The data is checked against the checkpoint before anything is built: its numerical features,
its number of tables, and its cardinalities capped as the checkpoint was trained
(``max_table_size``, recorded in the checkpoint's settings; ids mapped by ``hash_indices`` as the
checkpoint says). Synthetic data whose shape settings were left at their defaults takes the
checkpoint's shape. Training from a checkpoint (``mode=train``) keeps the run's settings and the
shape checks of ``load_checkpoint``.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from dlrm.data.feature_spec import FeatureSpec
from dlrm.data.sources import DataConfig, load_feature_spec
from dlrm.engine.errors import CheckpointError
from dlrm.model.dlrm import DLRMConfig
from dlrm.training import nvidia_checkpoint
from dlrm.training.checkpoint import checked_model_config, read_meta
from dlrm.training.run_config import VERSION_KEY, ModelSettings, RunConfig

SERVING_MODES = ("test", "inference_benchmark")  # the modes whose model is the checkpoint's
# ``ModelSettings`` that say what the model is; a checkpoint of this program's records them all.
SHAPE_SETTINGS = ("embedding_dim", "bottom_mlp_sizes", "top_mlp_sizes", "interaction_op", "dcn_num_layers",
                  "dcn_low_rank_dim", "embedding_dtype")
NVIDIA_RECORDS = ("embedding_dim", "bottom_mlp_sizes", "top_mlp_sizes", "interaction_op")  # by its files' shapes
DOT = ("dot", "cuda_dot")  # one model, two ways to compute it


@dataclass
class SavedModel:
    """What a checkpoint says of its model: the config it was built with and which settings it
    records (a setting it does not record is the run's to give, its value here a default)."""

    path: str
    config: DLRMConfig
    recorded: frozenset[str]  # of SHAPE_SETTINGS, "hash_indices" and "max_table_size"
    max_table_size: int | None = None  # the cap its tables were trained with, when recorded
    nvidia: bool = False


def starts_from_checkpoint(cfg: RunConfig) -> bool:
    """Whether the run serves a checkpoint's model (test, or an inference benchmark of one)."""
    return cfg.mode in SERVING_MODES and bool(cfg.checkpoint.load_checkpoint_path)


def read_saved_model(path: str) -> SavedModel:
    """The model a checkpoint at ``path`` describes (either layout); ``CheckpointError`` when
    it is missing, damaged or describes no valid model."""
    path = os.path.abspath(path)
    if nvidia_checkpoint.is_nvidia_checkpoint(path):
        ckpt = nvidia_checkpoint.read(path)
        recorded = set(NVIDIA_RECORDS) | ({"hash_indices"} & set(ckpt.recorded))
        return SavedModel(path, ckpt.model_config(), frozenset(recorded), nvidia=True)
    meta = read_meta(path)
    config = checked_model_config(path, meta)
    recorded = {*SHAPE_SETTINGS, "hash_indices"}
    found, cap = _recorded_max_table_size(path, meta["run_config"])
    if found:
        recorded.add("max_table_size")
    return SavedModel(path, config, frozenset(recorded), cap)


def _recorded_max_table_size(path: str, run_config: dict[str, Any]) -> tuple[bool, int | None]:
    """Whether the checkpoint's settings record ``max_table_size`` (a ``RunConfig.to_dict()``, or
    the flags of an earlier version), and its value."""
    settings = run_config.get("model") if VERSION_KEY in run_config else run_config
    if not isinstance(settings, dict) or "max_table_size" not in settings:
        return False, None
    cap = settings["max_table_size"]
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise CheckpointError(f"{os.path.join(path, 'meta.json')}: run_config's max_table_size is {cap!r}, not a "
                              "positive integer or null: the checkpoint is damaged")
    return True, cap


def _shown(value: Any) -> str:
    """A setting's value as a flag takes it (lists comma-separated)."""
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _contradiction(name: str, mine: Any, theirs: Any, path: str) -> ValueError:
    return ValueError(f"`{name}` {_shown(mine)} contradicts the checkpoint {path}, saved with {_shown(theirs)}: "
                      "leave it out (the checkpoint says the model)")


def _shape(cfg: RunConfig, saved: SavedModel, device: torch.device) -> dict[str, Any]:
    """The model's settings: the checkpoint's, but for the run's own choices (module docstring);
    ``ValueError`` for a given setting that contradicts the checkpoint."""
    defaults, theirs_all = ModelSettings(), saved.config
    chosen: dict[str, Any] = {}
    for name in SHAPE_SETTINGS:
        mine, theirs = getattr(cfg.model, name), getattr(theirs_all, name)
        given = mine != getattr(defaults, name)
        if name not in saved.recorded:
            chosen[name] = mine if name == "embedding_dtype" else theirs
        elif name == "interaction_op" and theirs in DOT and mine in ("auto", *DOT):
            chosen[name] = mine if mine != "auto" else ("cuda_dot" if device.type == "cuda" else "dot")
        elif name.startswith("dcn_") and theirs_all.interaction_op != "dcn":
            chosen[name] = theirs  # unused by the model: nothing to contradict
        elif given and mine != theirs:
            raise _contradiction(name, mine, theirs, saved.path)
        else:
            chosen[name] = theirs
    mine = cfg.model.embedding_type
    chosen["embedding_type"] = mine if mine != defaults.embedding_type else theirs_all.embedding_type
    return chosen


def _hashing(cfg: RunConfig, saved: SavedModel) -> bool:
    """Whether ids are mapped into the tables by ``id % rows``: as the checkpoint was trained."""
    mine = cfg.data.hash_indices
    if "hash_indices" not in saved.recorded:
        return mine
    theirs = saved.config.hash_indices
    if mine and not theirs:
        raise ValueError(f"`hash_indices` contradicts the checkpoint {saved.path}, trained without it: leave it out "
                         "(the checkpoint says how ids reach its rows)")
    return theirs


def _cap(cfg: RunConfig, saved: SavedModel) -> tuple[bool, int | None]:
    """Whether the cap on the tables' rows is known (recorded, or given) and its value."""
    mine = cfg.model.max_table_size
    if "max_table_size" not in saved.recorded:
        return mine is not None, mine
    if mine is not None and mine != saved.max_table_size:
        raise _contradiction("max_table_size", mine, saved.max_table_size, saved.path)
    return True, saved.max_table_size


def served_data(data: DataConfig, model_cfg: DLRMConfig) -> DataConfig:
    """``data`` as the checkpoint's model reads it: ids hashed as it says; synthetic data of its
    shape where its shape settings were left at their defaults."""
    defaults = DataConfig()
    changes: dict[str, Any] = {"hash_indices": model_cfg.hash_indices}
    if data.synthetic and data.synthetic_table_sizes == defaults.synthetic_table_sizes:
        changes["synthetic_table_sizes"] = list(model_cfg.table_sizes)
    if data.synthetic and data.synthetic_num_numerical == defaults.synthetic_num_numerical:
        changes["synthetic_num_numerical"] = model_cfg.num_numerical_features
    return dataclasses.replace(data, **changes)


def _data_name(data: DataConfig) -> tuple[str, str, str]:
    """How messages name the data, and the settings that fix its numerical features and tables."""
    if data.synthetic:
        return ("the synthetic data", "leave out `synthetic_num_numerical` (synthetic data follows the checkpoint)",
                "leave out `synthetic_table_sizes` (synthetic data follows the checkpoint)")
    fix = "it was trained on another dataset (check `dataset` and `feature_spec`)"
    return f"the dataset {data.dataset}", fix, fix


def check_data(saved: SavedModel, spec: FeatureSpec, data: DataConfig, cap: tuple[bool, int | None]) -> None:
    """The data fits the checkpoint: its numerical features, its tables, its cardinalities capped
    as the checkpoint was trained; ``CheckpointError`` naming the file and the setting otherwise."""
    config, path = saved.config, saved.path
    name, numerical_fix, tables_fix = _data_name(data)
    if spec.num_numerical != config.num_numerical_features:
        raise CheckpointError(f"{path} was trained on {config.num_numerical_features} numerical features, {name} has "
                              f"{spec.num_numerical}: {numerical_fix}")
    cardinalities = list(spec.cardinalities)
    if len(cardinalities) != len(config.table_sizes):
        raise CheckpointError(f"{path} holds {len(config.table_sizes)} embedding tables, {name} has "
                              f"{len(cardinalities)} categorical features: {tables_fix}")
    known, limit = cap
    for i, (rows, ids) in enumerate(zip(config.table_sizes, cardinalities)):
        expected = min(ids, limit) if known and limit else ids
        if rows == expected or (not known and rows < ids and data.hash_indices):
            continue
        if not known and rows < ids and "hash_indices" not in saved.recorded:
            raise CheckpointError(f"{path}: table {i} has {rows} rows and feature {i} of {name} {ids} ids; the "
                                  "checkpoint's metadata does not say whether its run mapped ids into the rows: pass "
                                  "`hash_indices` if it did")
        capped = f" (capped at `max_table_size`={limit})" if known and limit else ""
        raise CheckpointError(f"{path}: table {i} has {rows} rows in the checkpoint and {expected} for feature {i} of "
                              f"{name}{capped}: {tables_fix}")


def model_config(cfg: RunConfig, device: torch.device) -> tuple[FeatureSpec, DLRMConfig]:
    """The data's feature spec and the checkpoint's model (``starts_from_checkpoint``), checked
    against each other and against the run's settings; nothing built."""
    saved = read_saved_model(cfg.checkpoint.load_checkpoint_path)
    # A dataset's spec first (it does not depend on the settings below): its own refusals, such
    # as files outside the dataset folder, come before any comparison with the checkpoint.
    spec = None if cfg.data.synthetic else load_feature_spec(cfg.data)
    hashing, cap = _hashing(cfg, saved), _cap(cfg, saved)
    shape = _shape(cfg, saved, device)
    data = served_data(cfg.data, dataclasses.replace(saved.config, hash_indices=hashing))
    spec = spec or load_feature_spec(data)
    check_data(saved, spec, data, cap)
    model_cfg = dataclasses.replace(saved.config, **shape, hash_indices=hashing,
                                    poolings=[pooling or "sum" for pooling in spec.poolings])
    model_cfg.validate()
    return spec, model_cfg
