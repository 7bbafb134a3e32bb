"""Wide-model checkpoints on the engine's checkpoint store.

    <path>/meta.json                  format, ids, seed, train state, files with sizes and CRC-32
    <path>/weight_rows_<a>_<b>.pt     rows [a, b) of the weight, from the process that held them
    <path>/replicated.pt              the bias

Staging, the atomic commit, checksums, the lock and finding the rows a process needs in files
written by any other process count are the store's; this module only names the pieces.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dlrm.engine import checkpoint_store as store
from dlrm.engine.checkpoint_store import CheckpointError, host_copy
from dlrm.wide.model import WideModel

FORMAT = store.Format("wide-model checkpoint", ("version", 1), {"num_ids": int, "train_state": dict},
                      marks={"format": "dlrm-wide-checkpoint"})


@dataclass
class WideState:
    """Where training stands: the next batch is batch ``batch`` of epoch ``epoch``."""

    step: int = 0
    epoch: int = 0
    batch: int = 0


def save(path: str, model: WideModel, state: WideState) -> None:
    """Every process calls this at the same step; each writes the rows it holds."""

    def write_rows(files: store.StagedFiles) -> None:
        if model.rows[1] > model.rows[0]:
            files.save(store.piece_name("weight", model.rows), host_copy(model.weight))

    def write_rest(files: store.StagedFiles) -> dict[str, Any]:
        files.save("replicated.pt", {"bias": host_copy(model.bias)})
        return {"format": "dlrm-wide-checkpoint", "version": 1, "num_ids": model.num_ids, "seed": model.seed,
                "train_state": asdict(state), "world_size": model.collectives.world_size}

    store.save_directory(path, model.collectives, store.state_bytes(model), write_rows, write_rest)


def load(path: str, model: WideModel, verify: bool = True) -> WideState:
    """This process's rows and the bias from a checkpoint written by any process count."""

    def read() -> WideState:
        meta = FORMAT.read_meta(path)
        if meta["num_ids"] != model.num_ids:
            raise CheckpointError(f"{path} holds a model of {meta['num_ids']} ids, this one has {model.num_ids}: "
                                  "load it with the data it was trained on")
        pieces = store.pieces_for(path, meta, "weight", model.num_ids, model.rows, "the weight")
        store.check_files(path, meta, ["replicated.pt", *(name for _, _, name in pieces)], verify)
        with torch.no_grad():
            if model.rows[1] > model.rows[0]:
                rows = store.read_rows(path, pieces, model.rows)
                store.check_shape(os.path.join(path, pieces[0][2]), "weight", rows, model.weight.shape)
                model.weight.copy_(rows)
            replicated = store.load_tensor_file(path, "replicated.pt")  # dense and finite, or refused
            bias = replicated.get("bias") if isinstance(replicated, dict) else None
            store.check_shape(os.path.join(path, "replicated.pt"), "bias", bias, model.bias.shape)
            model.bias.copy_(bias)
        try:
            return WideState(**meta["train_state"])
        except TypeError:
            raise CheckpointError(f"{os.path.join(path, store.META)}: train_state is damaged") from None

    return store.read_consistently(path, read)
