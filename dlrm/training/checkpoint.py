"""Checkpoints as directories, written atomically and loaded without executing code.

Layout (independent of the embedding storage and of how tables are placed on devices):

    <path>/meta.json          format, model config, tensor shapes, train state, run flags, file sizes
    <path>/table_<i>.pt       embedding table i (global table index), [rows, dim]
    <path>/dense.pt           every non-embedding parameter and buffer
    <path>/optimizer.pt       optimizer and gradient-scaler state
    <path>/rng.pt             torch RNG states (CPU and CUDA)

Everything is written into ``<path>.tmp`` first, ``meta.json`` last; the finished directory
then replaces ``<path>`` by two renames. A crash leaves either the previous checkpoint at
``<path>``, or (between the renames) the previous one at ``<path>.old``, never a half-written one.

In hybrid-parallel runs every process writes the tables it holds and the first process the
rest, into one directory on a file system all processes share; any process count loads it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

FORMAT_VERSION = 1
META = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, or of another model."""


@dataclass
class TrainState:
    """Where training stands: enough to continue exactly where it stopped."""

    step: int = 0  # optimizer updates done
    epoch: int = 0  # epoch of the next batch
    batch_in_epoch: int = 0  # position of the next batch in that epoch's batch order
    best_auc: float = float("nan")


def _table_file(index: int) -> str:
    return f"table_{index}.pt"


def _dense_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")}


def _save_tensor_file(obj: Any, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """An owning CPU copy: saving a view would serialise the whole joint table's storage."""
    tensor = tensor.detach()
    return tensor.cpu() if tensor.device.type != "cpu" else tensor.clone()


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _barrier() -> None:
    if _distributed():
        dist.barrier()


def _expected_tables(model: torch.nn.Module) -> list[list[int]]:
    """Shapes of every table of the model (all ranks' together), in global order."""
    cfg = model.config
    return [[rows, cfg.embedding_dim] for rows in cfg.table_sizes]


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    state: TrainState,
    run_config: dict[str, Any] | None = None,
) -> None:
    """Every process calls this; in a process group each writes its own tables."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    tmp = f"{path}.tmp"
    first = not _distributed() or dist.get_rank() == 0
    if first:
        os.makedirs(parent, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier()
    try:
        embeddings = model.embeddings
        for i, index in enumerate(embeddings.table_indices):
            _save_tensor_file(_host_copy(embeddings.table_weight(i)), os.path.join(tmp, _table_file(index)))
        _barrier()
        if first:
            _write_rest(tmp, model, optimizer, scaler, state, run_config)
    except BaseException:
        if first:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if first:
        old = f"{path}.old"
        if os.path.exists(path):
            if os.path.exists(old):
                shutil.rmtree(old)
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(parent)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def _write_rest(
    tmp: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    state: TrainState,
    run_config: dict[str, Any] | None,
) -> None:
    """Dense weights, optimizer, RNG and, last, meta.json (which makes the directory complete)."""
    tables = _expected_tables(model)
    missing = [i for i in range(len(tables)) if not os.path.isfile(os.path.join(tmp, _table_file(i)))]
    if missing:
        raise CheckpointError(f"{tmp}: tables {missing} were not written by any process")
    dense = {k: _host_copy(v) for k, v in _dense_state(model).items()}
    _save_tensor_file(dense, os.path.join(tmp, "dense.pt"))
    _save_tensor_file(
        {
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        },
        os.path.join(tmp, "optimizer.pt"),
    )
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    _save_tensor_file(rng, os.path.join(tmp, "rng.pt"))
    meta = {
        "format_version": FORMAT_VERSION,
        "model_config": dataclasses.asdict(model.config),
        "tables": tables,
        "dense": {k: list(v.shape) for k, v in dense.items()},
        "train_state": dataclasses.asdict(state),
        "run_config": run_config or {},
        "world_size": dist.get_world_size() if _distributed() else 1,
        "files": {name: os.path.getsize(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))},
    }
    with open(os.path.join(tmp, META), "w") as f:
        json.dump(meta, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def read_meta(path: str) -> dict[str, Any]:
    """Reads and checks ``meta.json``: the checkpoint is complete and of a known format."""
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        hint = ""
        if os.path.isfile(os.path.join(f"{path.rstrip(os.sep)}.old", META)):
            hint = f" A complete earlier checkpoint is at {path.rstrip(os.sep)}.old (a save was interrupted): load that."
        elif os.path.isdir(path):
            hint = " The directory has no meta.json: it is not a checkpoint, or its save did not finish."
        raise CheckpointError(f"No checkpoint at {path}.{hint}")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{meta_path}: checkpoint format {meta.get('format_version')!r}, this version reads {FORMAT_VERSION}"
        )
    for name, size in meta["files"].items():
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.exists(file) else None
        if actual != size:
            raise CheckpointError(f"{file}: expected {size} bytes, found {actual}: the checkpoint is damaged")
    return meta


def _check_shapes(path: str, meta: dict[str, Any], model: torch.nn.Module) -> None:
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
                "(check --embedding_dim, --max_table_size and the dataset's cardinalities)"
            )
    dense = {k: list(v.shape) for k, v in _dense_state(model).items()}
    missing = sorted(set(dense) - set(meta["dense"]))
    unexpected = sorted(set(meta["dense"]) - set(dense))
    if missing or unexpected:
        raise CheckpointError(
            f"{path}: dense tensors differ from the model's: missing {missing}, unexpected {unexpected} "
            "(check --bottom_mlp_sizes, --top_mlp_sizes and --interaction_op)"
        )
    for name, wanted in dense.items():
        if meta["dense"][name] != wanted:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {meta['dense'][name]} in the checkpoint but {wanted} in the model "
                "(check --bottom_mlp_sizes, --top_mlp_sizes, --embedding_dim and --interaction_op)"
            )


def _load_optimizer(path: str, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Loads the optimizer state. With a different number of processes the embedding group holds
    other parameters; that is exact as long as the optimizer keeps no per-parameter state (plain
    SGD), in which case only the groups' hyperparameters are restored."""
    sizes = [len(g["params"]) for g in optimizer.param_groups]
    if sizes == [len(g["params"]) for g in saved["param_groups"]]:
        optimizer.load_state_dict(saved)
        return
    if saved["state"]:
        raise CheckpointError(
            f"{path}: the optimizer state has per-parameter entries and was written for another embedding "
            "layout or number of processes; resume with the same --embedding_type and process count"
        )
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


def load_checkpoint(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: torch.amp.GradScaler | None = None,
    restore_rng: bool = False,
) -> TrainState:
    """Loads weights (and optimizer, scaler, RNG state when given) into the model in place.

    Every shape is checked before anything is copied, so a mismatching checkpoint leaves the
    model untouched. Files are read with ``weights_only=True``: loading never runs code.
    """
    path = os.path.abspath(path)
    meta = read_meta(path)
    _check_shapes(path, meta, model)
    embeddings = model.embeddings
    with torch.no_grad():
        for i, index in enumerate(embeddings.table_indices):
            file = os.path.join(path, _table_file(index))
            embeddings.load_table_(i, torch.load(file, map_location="cpu", weights_only=True, mmap=True))
        dense = torch.load(os.path.join(path, "dense.pt"), map_location="cpu", weights_only=True)
        model.load_state_dict(dense, strict=False)
    extra = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
    if optimizer is not None and extra["optimizer"] is not None:
        _load_optimizer(path, optimizer, extra["optimizer"])
    if scaler is not None and scaler.is_enabled() and extra["scaler"] is not None:
        scaler.load_state_dict(extra["scaler"])
    if restore_rng:
        rng = torch.load(os.path.join(path, "rng.pt"), weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    state = TrainState(**meta["train_state"])
    if state.best_auc is None:
        state.best_auc = math.nan
    return state
