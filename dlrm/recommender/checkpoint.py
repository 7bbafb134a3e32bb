"""Autoencoder checkpoints: a directory that any process count loads, written atomically and
read without executing code (the DLRM checkpoint's machinery: ``dlrm.training.checkpoint``).

    <path>/meta.json                   network definition, sizes, train state, files with sizes and CRC-32
    <path>/input_rows_<a>_<b>.pt       input table rows [a, b) and their optimizer state
    <path>/output_rows_<a>_<b>.pt      output layer rows [a, b) (weights, biases) and their optimizer state
    <path>/replicated.pt               the hidden layers and the input bias, with optimizer state

Each process writes the item rows it owns; the first one the rest and, last, ``meta.json``. A
process of a run with another process count reads the rows of its own ranges from whichever
files cover them (memory-mapped). A save the file system refuses leaves the previous checkpoint
as it was and raises a ``StorageError`` (``staged_directory``).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dlrm.recommender.model import SparseAutoencoder
from dlrm.recommender.network import parse_network
from dlrm.training.checkpoint import (META, CheckpointError, checkpoint_bytes, host_copy, load_tensor_file,
                                      save_tensor_file, staged_directory, verify_checksums, write_meta)

FORMAT = "dlrm-autoencoder-checkpoint"
VERSION = 1
_PIECE = re.compile(r"^(input|output)_rows_(\d+)_(\d+)\.pt$")


@dataclass
class AutoencoderState:
    """Where training stands: the next batch is batch ``batch`` of epoch ``epoch``."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    samples: int = 0
    best_metric: float | None = None  # the best validation NDCG@K so far (None: not validated)
    best_step: int = 0
    best_epoch: int = 0
    stale: int = 0  # validations since the best one


def _item_params(model: SparseAutoencoder) -> dict[str, dict[str, torch.nn.Parameter]]:
    return {"input": {"weight": model.input_weight},
            "output": {"weight": model.output_weight, "bias": model.output_bias}}


def _state_of(optimizer: torch.optim.Optimizer | None, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
    if optimizer is None:
        return {}
    return {k: host_copy(v) for k, v in optimizer.state.get(param, {}).items() if torch.is_tensor(v)}


def _replicated(model: SparseAutoencoder) -> dict[str, torch.nn.Parameter]:
    item = {id(p) for group in _item_params(model).values() for p in group.values()}
    return {name: p for name, p in model.named_parameters() if id(p) not in item}


def save(path: str, model: SparseAutoencoder, optimizer: torch.optim.Optimizer | None, state: AutoencoderState,
         run_config: dict[str, Any] | None = None) -> None:
    """Every process of the model's run calls this at the same step."""
    parallel = model.parallel
    collectives = parallel.collectives(model.output_weight.device)
    with staged_directory(path, collectives, checkpoint_bytes(path, model)) as tmp:
        checksums = {}
        for kind, params in _item_params(model).items():
            start, stop = model.input_range if kind == "input" else model.output_range
            if stop == start:
                continue
            piece = {name: host_copy(p) for name, p in params.items()}
            piece["state"] = {name: _state_of(optimizer, p) for name, p in params.items()}
            name = f"{kind}_rows_{start}_{stop}.pt"
            checksums[name] = save_tensor_file(piece, os.path.join(tmp, name))
        checksums = {name: crc for part in collectives.gather_objects(checksums) for name, crc in part.items()}
        if parallel.rank == 0:
            _write_rest(tmp, model, optimizer, state, run_config, checksums)


def _write_rest(tmp: str, model: SparseAutoencoder, optimizer: torch.optim.Optimizer | None,
                state: AutoencoderState, run_config: dict[str, Any] | None, checksums: dict[str, str]) -> None:
    """The replicated weights and, last, ``meta.json`` (which makes the directory complete)."""
    replicated = _replicated(model)
    checksums["replicated.pt"] = save_tensor_file(
        {"params": {n: host_copy(p) for n, p in replicated.items()},
         "state": {n: _state_of(optimizer, p) for n, p in replicated.items()}},
        os.path.join(tmp, "replicated.pt"))
    meta = {
        "format": FORMAT, "version": VERSION,
        "network": model.config.to_json(),
        "n_input": model.n_input, "n_output": model.n_output,
        "hidden": [layer.n for layer in model.config.hidden],
        "seed": model.seed,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "train_state": asdict(state),
        "run_config": run_config or {},
        "world_size": model.parallel.world_size,
        "files": {n: {"bytes": os.path.getsize(os.path.join(tmp, n)), "crc32": c} for n, c in sorted(checksums.items())},
    }
    write_meta(tmp, meta)


def best_path(path: str) -> str:
    """Where a run that validates keeps its best checkpoint: beside the latest one (``PATH.best``),
    which resuming needs and which a later save replaces."""
    return path.rstrip(os.sep) + ".best"


def model_path(path: str, best: bool = True) -> str:
    """The checkpoint to predict or evaluate with, given a run's ``path``: its best validation's
    (``best_path``) when ``best`` and the run validated, else its latest (``PATH.old`` when a save
    was cut off between its renames); a path of a ``.best`` directory is taken as it is."""
    from dlrm.training.checkpoint import latest_checkpoint

    if best and not path.rstrip(os.sep).endswith(".best"):
        found = latest_checkpoint(best_path(path))
        if found is not None:
            return found
    return latest_checkpoint(path) or path


def describe(path: str) -> str:
    """``path``, and which of its run's checkpoints it is, for the line a script prints."""
    state = read_meta(path).get("train_state", {})
    if path.rstrip(os.sep).endswith(".best") and state.get("best_metric") is not None:
        return (f"{path} (the best validation of its run: NDCG {state['best_metric']:.4f} after epoch "
                f"{state['best_epoch']}, step {state['best_step']})")
    return f"{path} (step {state.get('step', 0)}, epoch {state.get('epoch', 0)})"


def read_meta(path: str) -> dict[str, Any]:
    """``meta.json`` checked: complete, of this format, every listed file of its saved size."""
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"No autoencoder checkpoint at {path} (no {META}: not a checkpoint, or its save did "
                              f"not finish; a complete earlier one may be at {path.rstrip(os.sep)}.old)")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"{meta_path}: not readable as JSON ({e}): the checkpoint is damaged") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{meta_path}: not an autoencoder checkpoint (a DLRM checkpoint loads with "
                              "dlrm.scripts.main, not here)")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{meta_path}: checkpoint version {meta.get('version')!r}, this version reads {VERSION}")
    for name, entry in meta["files"].items():
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual != entry["bytes"]:
            raise CheckpointError(f"{file}: expected {entry['bytes']} bytes, found {actual}: the checkpoint is damaged")
    return meta


def network_of(path: str):
    """The network definition a checkpoint was trained with, sizes resolved."""
    meta = read_meta(path)
    return parse_network(meta["network"]).resolve(meta["n_input"], meta["n_output"])


def load_model(path: str, parallel, device: torch.device | str = "cpu") -> SparseAutoencoder:
    """This process's part of the network a checkpoint holds, built from its own definition and
    seed and loaded (for predict and evaluate)."""
    meta = read_meta(path)
    network = parse_network(meta["network"]).resolve(meta["n_input"], meta["n_output"])
    model = SparseAutoencoder(network, parallel, seed=int(meta.get("seed", 0)), device=device)
    load(path, model)
    return model


def _latent(network) -> str:
    """The latent layer named for messages (its weights are twice as wide)."""
    return f"the latent {network.variational.layer!r}" if network.variational is not None else "no latent"


def _check_model(path: str, meta: dict[str, Any], model: SparseAutoencoder) -> None:
    saved = (meta["n_input"], meta["n_output"], meta["hidden"])
    this = (model.n_input, model.n_output, [layer.n for layer in model.config.hidden])
    saved_latent, this_latent = _latent(parse_network(meta["network"])), _latent(model.config)
    if saved == this and saved_latent != this_latent:
        raise CheckpointError(f"{path} holds a network with {saved_latent}, this model has {this_latent}: load it "
                              f"with the network it was trained on")
    if saved != this:
        raise CheckpointError(
            f"{path} holds a network of {saved[0]} inputs, hidden layers {saved[2]} and {saved[1]} outputs; this "
            f"model has {this[0]}, {this[2]} and {this[1]}: load it with the network and datasets it was trained on")


def _rows(path: str, pieces: list[tuple[int, int, str]], start: int, stop: int, cache: dict[str, Any]) -> dict:
    """Rows [start, stop) of every tensor of a kind's pieces, assembled from the files covering them."""
    out: dict[str, Any] = {}
    covered = start
    for a, b, name in sorted(pieces):
        if b <= start or a >= stop:
            continue
        if a > covered:
            break
        piece = cache.setdefault(name, load_tensor_file(path, name, mmap=True))
        lo, hi = max(a, start) - a, min(b, stop) - a
        for key, value in piece.items():
            if key == "state":
                for param, state in value.items():
                    for k, v in state.items():
                        slot = out.setdefault("state", {}).setdefault(param, {})
                        slot.setdefault(k, []).append(v[lo:hi] if v.dim() else v)
            else:
                out.setdefault(key, []).append(value[lo:hi])
        covered = min(b, stop)
    if covered < stop:
        raise CheckpointError(f"{path}: no file holds rows [{covered}, {stop}): the checkpoint is incomplete")
    joined = {k: torch.cat(v) for k, v in out.items() if k != "state"}
    joined["state"] = {p: {k: (torch.cat(v) if v[0].dim() else v[0]) for k, v in s.items()}
                       for p, s in out.get("state", {}).items()}
    return joined


def load(path: str, model: SparseAutoencoder, optimizer: torch.optim.Optimizer | None = None,
         verify: bool = True) -> AutoencoderState:
    """Loads this process's part of a checkpoint saved by any process count; with
    ``optimizer``, its state too (for resuming). Returns the train state."""
    meta = read_meta(path)
    _check_model(path, meta, model)
    pieces: dict[str, list[tuple[int, int, str]]] = {"input": [], "output": []}
    for name in meta["files"]:
        if match := _PIECE.match(name):
            pieces[match.group(1)].append((int(match.group(2)), int(match.group(3)), name))
    needed = ["replicated.pt"]
    for kind, (start, stop) in (("input", model.input_range), ("output", model.output_range)):
        needed += [n for a, b, n in pieces[kind] if a < stop and b > start]
    if verify:
        verify_checksums(path, meta, needed)
    cache: dict[str, Any] = {}
    with torch.no_grad():
        for kind, params in _item_params(model).items():
            start, stop = model.input_range if kind == "input" else model.output_range
            if stop == start:
                continue
            rows = _rows(path, pieces[kind], start, stop, cache)
            for name, p in params.items():
                p.copy_(rows[name])
                if optimizer is not None and rows["state"].get(name):
                    optimizer.state[p] = {k: v.to(p.device) if v.dim() else v.clone()
                                          for k, v in rows["state"][name].items()}
        replicated = load_tensor_file(path, "replicated.pt")
        for name, p in _replicated(model).items():
            if name not in replicated["params"]:
                raise CheckpointError(f"{path}/replicated.pt: no weights for {name}: it was saved by another network")
            p.copy_(replicated["params"][name])
            if optimizer is not None and replicated["state"].get(name):
                optimizer.state[p] = {k: v.to(p.device) if v.dim() else v.clone()
                                      for k, v in replicated["state"][name].items()}
    return AutoencoderState(**meta["train_state"])
