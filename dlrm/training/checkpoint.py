"""DLRM's checkpoint format: what a DLRM run saves, and the checks that a checkpoint fits the
model it is loaded into. Files, checksums, staging, the lock and row blocks are the checkpoint
store's (``dlrm.engine.checkpoint_store``). NVIDIA's layout is read and written by
``dlrm.training.nvidia_checkpoint``; ``load_checkpoint`` and ``model_config_of`` take either.

Layout (independent of the embedding storage and of how tables are placed on devices):

    <path>/meta.json          format, model config, tensor shapes, train state, run flags, file sizes
                              and CRC-32 checksums
    <path>/table_<i>.pt       embedding table i (global table index), [rows, dim]
    <path>/table_<i>_optimizer.pt  its optimizer state (Adagrad: [rows, dim], row-wise: [rows]);
                              absent with SGD, which keeps none
    <path>/table_<i>_rows_<a>_<b>.pt (and _optimizer.pt)  instead of the two above when table i was
                              split row-wise: rows [a, b), one file per block, the blocks
                              covering the table
    <path>/dense.pt           every non-embedding parameter and buffer
    <path>/optimizer.pt       optimizer and gradient-scaler state
    <path>/rng.pt             torch RNG states (CPU and CUDA)

In hybrid-parallel runs every process writes the tables (or blocks of rows) it holds and the
first process the rest; any process count and any placement loads it: a process reads the rows
it holds from whichever files cover them.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from dlrm.engine import checkpoint_store as store
from dlrm.engine.checkpoint_store import (  # noqa: F401 (imported from here by the DLRM code)
    CheckpointError, CheckpointLock, file_crc32, host_copy, latest_checkpoint, state_bytes,
)
from dlrm.engine.collectives import Collectives
from dlrm.engine.tensor_checks import checked_tensor, label
from dlrm.model.dlrm import DLRMConfig
from dlrm.training import nvidia_checkpoint

FORMAT_VERSION = 1
FORMAT = store.Format("checkpoint", ("format_version", FORMAT_VERSION),
                      {"model_config": dict, "tables": list, "dense": dict, "train_state": dict, "run_config": dict})
read_meta = FORMAT.read_meta
OPTIMIZER = "_optimizer"  # what a table file's name ends in for the file of its optimizer state


@dataclass
class TrainState:
    """Where training stands: enough to continue exactly where it stopped."""

    step: int = 0  # optimizer updates done
    epoch: int = 0  # epoch of the next batch
    sample_in_epoch: int = 0  # samples of that epoch already trained on, in the epoch's batch order
    batch_size: int = 0  # global batch size those samples were read in (0: none read yet)
    best_auc: float = float("nan")

    def advance(self, samples: int, batch_size: int, num_samples: int) -> bool:
        """Counts a step over ``samples`` samples of an epoch of ``num_samples`` (0 samples: the
        epoch has nothing left); returns whether the epoch is over."""
        if samples:
            self.step += 1
            self.sample_in_epoch += samples
            self.batch_size = batch_size
        if self.sample_in_epoch < num_samples:
            return False
        self.epoch, self.sample_in_epoch = self.epoch + 1, 0
        return True

    @classmethod
    def from_meta(cls, saved: dict[str, Any], run_config: dict[str, Any]) -> "TrainState":
        """Also reads checkpoints written before positions were counted in samples."""
        saved = dict(saved)
        if "batch_in_epoch" in saved:
            batch_size = int(run_config.get("batch_size") or 0)
            if not isinstance(saved["batch_in_epoch"], int):  # a string times a count is a huge string
                raise ValueError("batch_in_epoch is not an integer")
            saved["sample_in_epoch"] = saved.pop("batch_in_epoch") * batch_size
            saved["batch_size"] = batch_size
        state = cls(**saved)
        if state.best_auc is None:
            state.best_auc = math.nan
        return state


def _table_optimizer_state(optimizer: Any, embeddings: torch.nn.Module, i: int) -> dict[str, torch.Tensor]:
    """The embedding optimizer's state of local table ``i``: per-row tensors sliced to the
    table's rows, scalars (e.g. Adagrad's step count) as they are. Empty for SGD."""
    state_of = getattr(optimizer, "embedding_state", None)
    if state_of is None:
        return {}
    param, start = embeddings.table_parameter(i)
    rows = embeddings.table_sizes[i]
    return {key: value[start: start + rows] if value.dim() > 0 else value
            for key, value in state_of(param).items() if isinstance(value, torch.Tensor)}


def _dense_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.startswith(("embeddings.", "host_embeddings."))}


LocalTable = tuple[torch.nn.Module, int]  # (embedding module, local table index in it)


def _local_tables(model: torch.nn.Module) -> list[LocalTable]:
    """Every table this process holds, in each of the model's embedding modules (the device's
    and, when some tables stay in host memory, the host's)."""
    return [(module, i) for module in model.embedding_modules() for i in range(module.num_tables)]


def _expected_tables(model: torch.nn.Module) -> list[list[int]]:
    """Shapes of every table of the model (all ranks' together), in global order."""
    cfg = model.config
    return [[rows, cfg.embedding_dim] for rows in cfg.table_sizes]


def _stem(index: int) -> str:
    """What the files of table ``index`` (global index) are named after (``store.piece_name``)."""
    return f"table_{index}"


def check_can_save(path: str, model: torch.nn.Module) -> None:
    """Before training: a checkpoint of ``model`` can be saved at ``path`` (``store.check_can_save``)."""
    store.check_can_save(path, state_bytes(model))


def save_checkpoint(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    state: TrainState,
    run_config: dict[str, Any] | None = None,
    collectives: Collectives = Collectives(),
) -> None:
    """Every process of ``collectives`` calls this; each writes its own tables (or blocks of rows)."""

    def write_tables(files: store.StagedFiles) -> None:
        for embeddings, i in _local_tables(model):
            rows = embeddings.row_range(i) if embeddings.is_block(i) else None
            stem = _stem(embeddings.table_indices[i])
            files.save(store.piece_name(stem, rows), host_copy(embeddings.table_weight(i)))
            table_state = _table_optimizer_state(optimizer, embeddings, i)
            if table_state:
                files.save(store.piece_name(stem, rows, OPTIMIZER), {k: host_copy(v) for k, v in table_state.items()})

    store.save_directory(path, collectives, state_bytes(model), write_tables,
                         lambda files: _write_rest(files, model, optimizer, scaler, state, run_config,
                                                   collectives.world_size))


def _write_rest(
    files: store.StagedFiles,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    state: TrainState,
    run_config: dict[str, Any] | None,
    world_size: int,
) -> dict[str, Any]:
    """Dense weights, optimizer and RNG state; returns meta.json's entries."""
    tables = _expected_tables(model)
    missing = [i for i, (rows, _) in enumerate(tables)
               if not store.covers(store.find_pieces(files.crc32, _stem(i), rows), rows)]
    if missing:
        raise CheckpointError(f"{files.directory}: tables {missing} were not written (whole, or all their rows) "
                              "by the processes")
    dense = {k: host_copy(v) for k, v in _dense_state(model).items()}
    files.save("dense.pt", dense)
    files.save("optimizer.pt", {
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
    })
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    files.save("rng.pt", rng)
    return {
        "format_version": FORMAT_VERSION,
        "model_config": dataclasses.asdict(model.config),
        "tables": tables,
        "dense": {k: list(v.shape) for k, v in dense.items()},
        "train_state": dataclasses.asdict(state),
        "run_config": run_config or {},
        "world_size": world_size,
        "optimizer": _optimizer_names(optimizer),
    }


def checked_model_config(path: str, meta: dict[str, Any]) -> DLRMConfig:
    """``meta.json``'s model config as a checked ``DLRMConfig``, agreeing with the tables the
    checkpoint saved (``meta["tables"]``, which loading holds against the files): a damaged or
    hand-edited ``meta.json`` is refused here, before a model of its sizes is allocated."""
    where = os.path.join(path, "meta.json")
    values = meta["model_config"]
    known = {f.name for f in dataclasses.fields(DLRMConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise CheckpointError(f"{where}: model_config holds settings this version does not know ({unknown[:4]}): "
                              "the checkpoint was written by a newer version, or is damaged")
    try:
        config = DLRMConfig(**values)
        config.validate()
    except (TypeError, ValueError) as e:
        reason = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise CheckpointError(f"{where}: model_config describes no valid model ({reason}): the checkpoint is "
                              "damaged") from None
    if [[rows, config.embedding_dim] for rows in config.table_sizes] != meta["tables"]:
        raise CheckpointError(f"{where}: model_config's {len(config.table_sizes)} tables of dimension "
                              f"{config.embedding_dim} disagree with the {len(meta['tables'])} tables the checkpoint "
                              "saved: the checkpoint is damaged")
    return config


def model_config_of(path: str) -> dict[str, Any]:
    """The model config a checkpoint at ``path`` describes (this program's or NVIDIA's layout),
    as ``DLRMConfig``'s fields, checked (``checked_model_config``)."""
    path = os.path.abspath(path)
    if nvidia_checkpoint.is_nvidia_checkpoint(path):
        return dataclasses.asdict(nvidia_checkpoint.read(path).model_config())
    return dataclasses.asdict(checked_model_config(path, read_meta(path)))


def _check_shapes(path: str, meta: dict[str, Any], model: torch.nn.Module) -> None:
    saved_hashing = bool(meta["model_config"].get("hash_indices", False))
    if saved_hashing != model.config.hash_indices:
        raise CheckpointError(
            f"{path} was trained {'with' if saved_hashing else 'without'} `hash_indices` and this run is "
            f"{'with' if model.config.hash_indices else 'without'} it: ids would reach other rows; "
            f"{'add' if saved_hashing else 'drop'} `hash_indices`"
        )
    expected_tables = _expected_tables(model)
    if len(meta["tables"]) != len(expected_tables):
        raise CheckpointError(
            f"{path} holds {len(meta['tables'])} embedding tables, the model has {len(expected_tables)}: "
            "it was written for another dataset or feature spec"
        )
    for i, (saved, wanted) in enumerate(zip(meta["tables"], expected_tables)):
        if saved != wanted:
            raise CheckpointError(
                f"{path}: embedding table {i} has shape {saved} in the checkpoint but {wanted} in the model "
                "(check `embedding_dim`, `max_table_size` and the dataset's cardinalities)"
            )
    dense = {k: list(v.shape) for k, v in _dense_state(model).items()}
    missing = sorted(set(dense) - set(meta["dense"]))
    unexpected = sorted(set(meta["dense"]) - set(dense))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: dense tensors differ from the model's: missing {missing}, unexpected {unexpected} "
            "(check `bottom_mlp_sizes`, `top_mlp_sizes`, `interaction_op`, `dcn_num_layers` and `dcn_low_rank_dim`)"
        )
    for name, wanted in dense.items():
        if meta["dense"][name] != wanted:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {meta['dense'][name]} in the checkpoint but {wanted} in the model "
                "(check `bottom_mlp_sizes`, `top_mlp_sizes`, `embedding_dim` and `interaction_op`)"
            )


def _optimizer_names(optimizer: Any) -> dict[str, str]:
    config = getattr(optimizer, "config", None)
    if config is None:  # e.g. a plain torch SGD
        return {"embedding": "sgd", "dense": "sgd"}
    return {"embedding": config.embedding, "dense": config.dense_optimizer}


def _saved_optimizers(meta: dict[str, Any]) -> tuple[str, str]:
    """(embedding, dense) optimizer of a checkpoint; checkpoints from before the choice: SGD."""
    names = meta.get("optimizer")
    if not isinstance(names, dict):
        return "sgd", "sgd"
    return str(names.get("embedding", "sgd")), str(names.get("dense", "sgd"))


def _check_optimizer_kind(path: str, meta: dict[str, Any], optimizer: Any) -> None:
    config = getattr(optimizer, "config", None)
    if config is None:
        return
    saved = _saved_optimizers(meta)
    wanted = (config.embedding, config.dense_optimizer)
    if saved != wanted:
        raise CheckpointError(
            f"{path} was trained with `optimizer={saved[0]}` and `dense_optimizer={saved[1]}`, this run uses "
            f"`optimizer={wanted[0]}` and `dense_optimizer={wanted[1]}`: resume with the checkpoint's optimizers "
            "(their state does not carry over to others)"
        )


def _load_optimizer(path: str, optimizer: Any, saved: dict[str, Any]) -> None:
    """Loads the dense optimizer's state and every group's hyperparameters. The embeddings' state
    is per table (``_load_table_state``), so any number of processes can resume a checkpoint.
    Checkpoints from before the optimizer choice hold a plain SGD state dict: SGD keeps no state,
    so their groups' hyperparameters are all there is to restore."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups", []), list):
        raise CheckpointError(f"{path}: optimizer.pt does not hold an optimizer state: the checkpoint is damaged")
    if saved.get("format") == "combined":  # its dense state was checked (``_check_dense_state``)
        try:
            optimizer.load_state_dict(saved)
        except (KeyError, ValueError, RuntimeError, TypeError, AttributeError, IndexError) as e:
            reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise CheckpointError(f"{path}: the optimizer state does not fit this model ({reason}): "
                                  "it was written for another model") from None
        return
    if saved.get("state"):
        raise CheckpointError(f"{path}: the optimizer state has per-parameter entries this program does not write: "
                              "the checkpoint is damaged or not one of this program's")
    for group, saved_group in zip(optimizer.param_groups, saved.get("param_groups", [])):
        if not isinstance(saved_group, dict):
            raise CheckpointError(f"{path}: optimizer.pt holds a parameter group that is not a dict: "
                                  "the checkpoint is damaged")
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def _check_dense_state(path: str, optimizer: Any, saved: dict[str, Any]) -> None:
    """Each per-parameter tensor of the dense optimizer's saved state (e.g. Adam's moments) has
    its parameter's shape, before anything is loaded: torch's ``load_state_dict`` takes any shape,
    and the first step after a resume would fail, or broadcast one value over a whole layer."""
    file = os.path.join(path, "optimizer.pt")
    dense, live = saved.get("dense"), getattr(optimizer, "dense", None)
    if live is None:
        return
    try:
        ids = [i for group in dense["param_groups"] for i in group["params"]]
        params = dict(zip(ids, (p for group in live.param_groups for p in group["params"])))
        state = dict(dense.get("state", {}))
    except (KeyError, TypeError, AttributeError, ValueError):
        raise CheckpointError(f"{file}: the dense optimizer's state is not what this program writes: "
                              "the checkpoint is damaged") from None
    for index, entries in state.items():
        if index not in params or not isinstance(entries, dict):
            raise CheckpointError(f"{file}: the dense optimizer's state names a parameter the model does not have: "
                                  "the checkpoint is damaged or of another model")
        for key, value in entries.items():
            what = f"the dense optimizer's {label(key)}"
            checked_tensor(value, file, what, finite=False)  # finite: load_tensor_file; a step count too
            if value.dim():
                store.check_shape(file, what, value, params[index].shape)


def _pieces(path: str, meta: dict[str, Any], table: LocalTable, suffix: str = "") -> list[store.Piece]:
    """The files that hold the rows of a local table (``suffix``: of its optimizer state), whole
    tables or row-wise blocks, whichever the checkpoint has: it may come from another placement."""
    embeddings, i = table
    index = embeddings.table_indices[i]
    what = f"embedding table {index}" if not suffix else f"the optimizer state of embedding table {index}"
    return store.pieces_for(path, meta, _stem(index), embeddings.full_table_sizes[i], embeddings.row_range(i), what,
                            suffix)


def _check_table(file: str, what: str, value: Any, shape: Any) -> None:
    """Rows of a table (or of its optimizer state; ``shape`` None: a scalar such as a step count)
    read by ``store.read_rows``: of ``shape`` and floating point (dense and finite: the store
    checked them), as this program writes them; other types would be converted silently."""
    if shape is None:
        if not isinstance(value, torch.Tensor) or value.dim():
            raise CheckpointError(f"{file}: {what} is not a scalar tensor: the checkpoint is damaged")
    else:
        store.check_shape(file, what, value, shape)
    if not value.is_floating_point():
        raise CheckpointError(f"{file}: {what} holds {str(value.dtype).removeprefix('torch.')} values, not floating "
                              "point: the checkpoint is damaged")


def _load_table_state(path: str, pieces: list[store.Piece], rows: tuple[int, int],
                      state: dict[str, torch.Tensor]) -> None:
    """Copies the saved optimizer state of one table's rows ``[start, stop)`` into ``state``
    (views of the live state): per-row tensors from every piece, scalars from the first."""
    saved = store.read_rows(path, pieces, rows)
    file = os.path.join(path, pieces[0][2])
    if not isinstance(saved, dict) or set(saved) != set(state):
        held = sorted(map(label, saved)) if isinstance(saved, dict) else type(saved).__name__
        raise CheckpointError(f"{file}: holds {held[:8]}, the optimizer keeps {sorted(state)}: the checkpoint is "
                              "damaged")
    for key, target in state.items():
        _check_table(file, label(key), saved[key], target.shape if target.dim() else None)
        with torch.no_grad():
            target.copy_(saved[key])


def _checked_dense(file: str, dense: dict[str, Any], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's dense tensors from ``dense.pt``: each there, of the model's shape and (for
    weights) floating point; entries the model lacks are left out, so none reaches its tables."""
    wanted = _dense_state(model)
    for name, live in wanted.items():
        store.check_shape(file, label(name), dense.get(name), live.shape)
        if live.is_floating_point():
            checked_tensor(dense[name], file, label(name), finite=False)  # finite: load_tensor_file
    return {name: dense[name] for name in wanted}


def _restore_rng(file: str, rng: dict[str, Any]) -> None:
    """Sets torch's RNG states from ``rng.pt``; a state torch refuses is a damaged file."""
    try:
        torch.set_rng_state(checked_tensor(rng["cpu"], file, "the CPU RNG state", floating=False))
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    except (RuntimeError, TypeError, ValueError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{file}: holds an RNG state torch refuses: the checkpoint is damaged") from None


def load_checkpoint(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    restore_rng: bool = False,
    verify: bool = True,
) -> TrainState:
    """Loads weights (and optimizer, scaler, RNG state when given) into the model in place.

    Every shape, and with ``verify`` the checksum of every file this process reads, is checked
    before anything is copied, so a mismatching or damaged checkpoint leaves the model untouched.
    Files are read with ``weights_only=True``: loading never runs code. A save to ``path`` by
    another run meanwhile makes the load start again (``store.read_consistently``): what is
    loaded always comes from one save.

    A directory in NVIDIA's layout (``dlrm.training.nvidia_checkpoint``) loads too, weights only.
    """
    path = os.path.abspath(path)
    if nvidia_checkpoint.is_nvidia_checkpoint(path):
        nvidia_checkpoint.load(path, model, optimizer, restore_rng)
        return TrainState()
    return store.read_consistently(
        path, lambda: _load_checkpoint(path, model, optimizer, scaler, restore_rng, verify))


def _load_checkpoint(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                     scaler: torch.amp.GradScaler | None, restore_rng: bool, verify: bool) -> TrainState:
    meta = read_meta(path)
    _check_shapes(path, meta, model)
    local = _local_tables(model)
    with_state = False  # whether the optimizer keeps state per table row, to be read
    if optimizer is not None:
        _check_optimizer_kind(path, meta, optimizer)
        with_state = any(_table_optimizer_state(optimizer, embeddings, i) for embeddings, i in local)
    reads = [_pieces(path, meta, table) for table in local]
    state_reads = [_pieces(path, meta, table, OPTIMIZER) for table in local] if with_state else []
    names = [name for pieces in reads + state_reads for _, _, name in pieces]
    store.check_files(path, meta, names + ["dense.pt", "optimizer.pt"] + (["rng.pt"] if restore_rng else []), verify)
    weights = []
    for (embeddings, i), pieces in zip(local, reads):
        start, stop = embeddings.row_range(i)
        weights.append(store.read_rows(path, pieces, (start, stop)))
        _check_table(os.path.join(path, pieces[0][2]), "the table", weights[-1],
                     [stop - start, model.config.embedding_dim])
    dense = store.load_tensor_file(path, "dense.pt")  # every tensor dense and finite (``store``)
    extra = store.load_tensor_file(path, "optimizer.pt")
    rng = store.load_tensor_file(path, "rng.pt") if restore_rng else None
    if not isinstance(dense, dict) or not isinstance(extra, dict) or not {"optimizer", "scaler"} <= extra.keys() \
            or (rng is not None and not (isinstance(rng, dict) and isinstance(rng.get("cpu"), torch.Tensor))):
        raise CheckpointError(f"{path}: dense.pt, optimizer.pt or rng.pt does not hold what this program writes: "
                              "the checkpoint is damaged or not one of this program's")
    dense = _checked_dense(os.path.join(path, "dense.pt"), dense, model)
    saved_optimizer = extra["optimizer"]
    if optimizer is not None and isinstance(saved_optimizer, dict) and saved_optimizer.get("format") == "combined":
        _check_dense_state(path, optimizer, saved_optimizer)  # before anything is loaded
    with torch.no_grad():
        for (embeddings, i), weight in zip(local, weights):
            embeddings.load_table_(i, weight)
        model.load_state_dict(dense, strict=False)
    if optimizer is not None and extra["optimizer"] is not None:
        _load_optimizer(path, optimizer, extra["optimizer"])
        for (embeddings, i), pieces in zip(local, state_reads):
            _load_table_state(path, pieces, embeddings.row_range(i), _table_optimizer_state(optimizer, embeddings, i))
    if scaler is not None and scaler.is_enabled() and extra["scaler"] is not None:
        scaler.load_state_dict(extra["scaler"])
    if rng is not None:
        _restore_rng(os.path.join(path, "rng.pt"), rng)
    return _train_state(path, meta)


def _train_state(path: str, meta: dict[str, Any]) -> TrainState:
    """``meta.json``'s train state, its counts non-negative integers and its AUC a number: a
    resumed run computes its data position from them."""
    where = os.path.join(path, store.META)
    try:
        state = TrainState.from_meta(meta["train_state"], meta["run_config"])
    except (TypeError, ValueError, OverflowError, AttributeError) as e:
        reason = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
        raise CheckpointError(f"{where}: train_state is damaged ({reason})") from None
    counts = (state.step, state.epoch, state.sample_in_epoch, state.batch_size)
    if any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < 2 ** 63 for n in counts) \
            or isinstance(state.best_auc, bool) or not isinstance(state.best_auc, (int, float)):
        raise CheckpointError(f"{where}: train_state holds a count that is not a non-negative integer, or an AUC "
                              "that is not a number: the checkpoint is damaged")
    return state
