"""Checkpoints as directories, written atomically and loaded without executing code.

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

Everything is written into ``<path>.tmp`` first, ``meta.json`` last; the finished directory
then replaces ``<path>`` by two renames. A crash leaves either the previous checkpoint at
``<path>``, or (between the renames) the previous one at ``<path>.old``, never a half-written one.
A save the file system refuses (read-only, full, no permission) removes ``<path>.tmp`` and raises
a ``StorageError`` naming the path and the cause; ``check_can_save`` meets those causes before
training starts where it can.
A run that saves holds ``<path>.lock`` (``CheckpointLock``), so two runs never write one path.

Loading checks the size and checksum of every file it reads before unpickling anything, and turns
every way a damaged file can fail into a ``CheckpointError`` that names the file.

In hybrid-parallel runs every process writes the tables (or blocks of rows) it holds and the
first process the rest, into one directory on a file system all processes share; any process
count and any placement loads it: a process reads the rows it holds from whichever files cover
them (memory-mapped, so it never reads a whole table to keep a block).
The processes meet through the run's ``Collectives``, never through torch.distributed itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import pickle
import re
import shutil
import socket
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any, BinaryIO, Iterator

import torch

from dlrm.data.atomic import check_can_create, check_free_space, fsync_dir, writing
from dlrm.distributed.collectives import Collectives

FORMAT_VERSION = 1
META = "meta.json"
CHECKPOINT = "the checkpoint"  # what a StorageError says could not be written


class CheckpointError(ValueError):
    """A checkpoint that is missing, incomplete, or of another model."""


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
            saved["sample_in_epoch"] = saved.pop("batch_in_epoch") * batch_size
            saved["batch_size"] = batch_size
        state = cls(**saved)
        if state.best_auc is None:
            state.best_auc = math.nan
        return state


def _table_file(index: int, rows: tuple[int, int] | None = None) -> str:
    """Table ``index``'s file, or with ``rows`` (a row-wise block ``[a, b)``) the block's."""
    return f"table_{index}.pt" if rows is None else f"table_{index}_rows_{rows[0]}_{rows[1]}.pt"


def _state_file(table_file: str) -> str:
    """The optimizer-state file that goes with a table file (or block file)."""
    return table_file[:-len(".pt")] + "_optimizer.pt"


_PIECE = re.compile(r"table_(\d+)(?:_rows_(\d+)_(\d+))?\.pt")


def _table_pieces(names: Iterable[str], index: int, rows: int) -> list[tuple[int, int, str]]:
    """The files that hold table ``index`` among ``names``: ``(first row, end row, name)`` in row
    order, the whole-table file or the blocks of a row-wise table (empty if there are none)."""
    pieces = []
    for name in names:
        match = _PIECE.fullmatch(name)
        if match and int(match[1]) == index:
            pieces.append((0, rows, name) if match[2] is None else (int(match[2]), int(match[3]), name))
    return sorted(pieces)


def _covers(pieces: list[tuple[int, int, str]], rows: int) -> bool:
    """Whether ``pieces`` tile ``[0, rows)`` exactly, without gaps or overlaps."""
    end = 0
    for start, stop, _ in pieces:
        if start != end or stop <= start:
            return False
        end = stop
    return end == rows


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


class _Checksummed:
    """A write-only file that keeps the CRC-32 of what passes through it (no second read)."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.crc = 0

    def write(self, data: bytes) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def save_tensor_file(obj: Any, path: str) -> str:
    """Writes ``obj`` with ``torch.save``, durably; returns the file's CRC-32 as 8 hex digits."""
    with open(path, "wb") as f:
        out = _Checksummed(f)
        torch.save(obj, out)
        f.flush()
        os.fsync(f.fileno())
    return f"{out.crc:08x}"


def file_crc32(path: str, chunk_bytes: int = 1 << 26) -> str:
    """CRC-32 of a file as 8 hex digits, read in chunks (zlib releases the GIL: threads scale)."""
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(chunk_bytes)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return f"{crc:08x}"


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """An owning CPU copy: saving a view would serialise the whole joint table's storage."""
    tensor = tensor.detach()
    return tensor.cpu() if tensor.device.type != "cpu" else tensor.clone()


def _expected_tables(model: torch.nn.Module) -> list[list[int]]:
    """Shapes of every table of the model (all ranks' together), in global order."""
    cfg = model.config
    return [[rows, cfg.embedding_dim] for rows in cfg.table_sizes]


def check_checkpoint_path(path: str) -> None:
    """A checkpoint is a directory: never move a file of the user's aside to make room for one."""
    if os.path.lexists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{path} exists and is not a directory: choose another path for the checkpoint")
    parent = os.path.dirname(path)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise CheckpointError(f"{parent} is a file: a checkpoint cannot be saved under it")


def state_bytes(model: torch.nn.Module) -> int:
    """Bytes of this process's weights: the least a checkpoint of it takes on disk."""
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def checkpoint_bytes(path: str, model: torch.nn.Module) -> int:
    """What a save of ``model`` to ``path`` needs on disk: the size of the checkpoint already there
    (the same model's), or at least the weights when there is none."""
    try:
        previous = sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
    except OSError:
        previous = 0
    return max(previous, state_bytes(model))


def check_can_save(path: str, model: torch.nn.Module) -> None:
    """Before training: a checkpoint can be created at ``path`` and its file system has room for
    one, so a run does not train for hours to fail at its first save (``StorageError``)."""
    check_checkpoint_path(path)
    check_can_create(path, CHECKPOINT)
    check_free_space(path, checkpoint_bytes(path, model), CHECKPOINT)


class CheckpointLock:
    """Held by the one process that writes checkpoints to ``path`` for as long as its run lasts,
    so a second run saving to the same path fails at its start instead of deleting the first
    run's work. An ``flock`` on ``<path>.lock``: the kernel drops it when the holder dies, even by
    ``kill -9``, so a stale lock never blocks the next run."""

    def __init__(self, path: str):
        self.path = f"{os.path.abspath(path).rstrip(os.sep)}.lock"
        self._fd: int | None = None

    def acquire(self) -> "CheckpointLock":
        check_checkpoint_path(self.path[: -len(".lock")])
        with writing(self.path[: -len(".lock")], CHECKPOINT):  # a read-only or missing file system fails here
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise CheckpointError(
                f"{self.path}: another run ({holder}) is saving checkpoints to {self.path[:-5]}; "
                "give this run its own `save_checkpoint_path`, or stop the other run first"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            os.unlink(self.path)  # before unlocking: a run that opens it after this makes a new file
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "CheckpointLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def save_checkpoint(
    path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    state: TrainState,
    run_config: dict[str, Any] | None = None,
    collectives: Collectives = Collectives(),
) -> None:
    """Every process of ``collectives`` calls this; each writes its own tables."""
    first = collectives.rank == 0
    with staged_directory(path, collectives, checkpoint_bytes(path, model)) as tmp:
        checksums = {}
        for embeddings, i in _local_tables(model):
            name = _table_file(embeddings.table_indices[i], embeddings.row_range(i) if embeddings.is_block(i) else None)
            checksums[name] = save_tensor_file(host_copy(embeddings.table_weight(i)), os.path.join(tmp, name))
            table_state = _table_optimizer_state(optimizer, embeddings, i)
            if table_state:
                name = _state_file(name)
                state_copy = {k: host_copy(v) for k, v in table_state.items()}
                checksums[name] = save_tensor_file(state_copy, os.path.join(tmp, name))
        # Every process's table checksums, on every process (also the barrier after the tables).
        checksums = {name: crc for part in collectives.gather_objects(checksums) for name, crc in part.items()}
        if first:
            _write_rest(tmp, model, optimizer, scaler, state, run_config, checksums, collectives.world_size)


@contextlib.contextmanager
def staged_directory(path: str, collectives: Collectives = Collectives(), needed: int | None = None) -> Iterator[str]:
    """The directory every process of ``collectives`` writes a checkpoint into: ``<path>.tmp``,
    made fresh by the first process; when the block ends, the first process puts it at
    ``path`` (``commit_directory``), or removes it if the block failed. Processes meet before
    and after. A write the file system refuses becomes a ``StorageError`` (a full disk's message
    says how much is free, and ``needed``, the bytes a checkpoint takes, if that is more)."""
    path = os.path.abspath(path)
    tmp = f"{path}.tmp"
    first = collectives.rank == 0
    if first:
        check_checkpoint_path(path)
        with writing(path, CHECKPOINT, needed):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
    collectives.barrier()
    remove_tmp = (lambda: shutil.rmtree(tmp, ignore_errors=True)) if first else None
    with writing(path, CHECKPOINT, needed, cleanup=remove_tmp):  # the disk's free space is measured after cleanup
        yield tmp
        if first:
            commit_directory(tmp, path)
    collectives.barrier()


def commit_directory(tmp: str, path: str) -> None:
    """Puts the finished directory ``tmp`` at ``path`` by two renames (the previous one goes to
    ``path.old`` in between), so a crash leaves a complete checkpoint at one of the two."""
    old = f"{path}.old"
    if os.path.exists(path):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(path, old)
    os.rename(tmp, path)
    fsync_dir(os.path.dirname(path))
    shutil.rmtree(old, ignore_errors=True)


def _write_rest(
    tmp: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scaler: torch.amp.GradScaler | None,
    state: TrainState,
    run_config: dict[str, Any] | None,
    checksums: dict[str, str],
    world_size: int,
) -> None:
    """Dense weights, optimizer, RNG and, last, meta.json (which makes the directory complete)."""
    tables = _expected_tables(model)
    missing = [i for i, (rows, _) in enumerate(tables) if not _covers(_table_pieces(checksums, i, rows), rows)]
    if missing:
        raise CheckpointError(f"{tmp}: tables {missing} were not written (whole, or all their rows) by the processes")
    dense = {k: host_copy(v) for k, v in _dense_state(model).items()}
    checksums["dense.pt"] = save_tensor_file(dense, os.path.join(tmp, "dense.pt"))
    checksums["optimizer.pt"] = save_tensor_file(
        {
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
        },
        os.path.join(tmp, "optimizer.pt"),
    )
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    checksums["rng.pt"] = save_tensor_file(rng, os.path.join(tmp, "rng.pt"))
    meta = {
        "format_version": FORMAT_VERSION,
        "model_config": dataclasses.asdict(model.config),
        "tables": tables,
        "dense": {k: list(v.shape) for k, v in dense.items()},
        "train_state": dataclasses.asdict(state),
        "run_config": run_config or {},
        "world_size": world_size,
        "optimizer": _optimizer_names(optimizer),
        "files": {
            name: {"bytes": os.path.getsize(os.path.join(tmp, name)), "crc32": checksums[name]}
            for name in sorted(os.listdir(tmp))
        },
    }
    write_meta(tmp, meta)


def write_meta(tmp: str, meta: dict[str, Any]) -> None:
    """``meta.json``, durably: written last, it is what makes a checkpoint directory complete."""
    with open(os.path.join(tmp, META), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)


_META_KEYS = {"model_config": dict, "tables": list, "dense": dict, "train_state": dict, "run_config": dict,
              "files": dict}


def latest_checkpoint(path: str) -> str | None:
    """The complete checkpoint a restarted run resumes from: ``path``, or ``path.old`` when a
    save was cut off between its two renames; None when neither holds one (a first start)."""
    for candidate in (path, f"{path.rstrip(os.sep)}.old"):
        if os.path.isfile(os.path.join(candidate, META)):
            return candidate
    return None


def read_meta(path: str) -> dict[str, Any]:
    """Reads and checks ``meta.json``: the checkpoint is complete, of a known format, and every
    file it lists has the size it was written with."""
    meta_path = os.path.join(path, META)
    if not os.path.isfile(meta_path):
        hint = ""
        if os.path.isfile(os.path.join(f"{path.rstrip(os.sep)}.old", META)):
            hint = f" A complete earlier checkpoint is at {path.rstrip(os.sep)}.old (a save was interrupted): load that."
        elif os.path.isdir(path):
            hint = " The directory has no meta.json: it is not a checkpoint, or its save did not finish."
        raise CheckpointError(f"No checkpoint at {path}.{hint}")
    try:
        with open(meta_path, encoding="utf-8") as f:
            meta = json.load(f)
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise CheckpointError(f"{meta_path}: not readable as JSON ({e}): the checkpoint is damaged") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise CheckpointError(f"{meta_path}: checkpoint format {version!r}, this version reads {FORMAT_VERSION}")
    for key, kind in _META_KEYS.items():
        if not isinstance(meta.get(key), kind):
            raise CheckpointError(f"{meta_path}: entry {key!r} is missing or not a {kind.__name__}: "
                                  "the checkpoint is damaged")
    for name, entry in meta["files"].items():
        size = entry["bytes"] if isinstance(entry, dict) else entry  # older checkpoints: the size alone
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual != size:
            raise CheckpointError(f"{file}: expected {size} bytes, found {actual}: the checkpoint is damaged")
    return meta


def verify_checksums(path: str, meta: dict[str, Any], names: list[str], threads: int = 4) -> None:
    """Compares each named file's CRC-32 with the one written at save time (files are hashed in
    parallel; see docs/training.md for the speed). Checkpoints that predate checksums pass."""
    expected = {n: e["crc32"] for n in names if isinstance(e := meta["files"].get(n), dict) and "crc32" in e}
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(expected)))) as pool:
        actual = dict(zip(expected, pool.map(lambda n: file_crc32(os.path.join(path, n)), expected)))
    for name, crc in expected.items():
        if actual[name] != crc:
            raise CheckpointError(
                f"{os.path.join(path, name)}: checksum {actual[name]} differs from the {crc} it was saved with: "
                "the file is damaged; load an earlier checkpoint (or load it anyway with `verify=False`)"
            )


def load_tensor_file(path: str, name: str, mmap: bool = False) -> Any:
    """``torch.load`` with ``weights_only=True``; every way a damaged file fails becomes a
    ``CheckpointError`` naming it."""
    file = os.path.join(path, name)
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if "global" not in str(e).lower():  # no refused class or function: garbage bytes
            raise CheckpointError(f"{file}: cannot be read (not a tensor file): the checkpoint is damaged") from None
        raise CheckpointError(
            f"{file}: holds objects other than tensors and plain containers, which are never loaded "
            "(loading them could run code): it was not written by this program"
        ) from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{file}: cannot be read ({reason}): the checkpoint is damaged") from None


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
    if saved.get("format") == "combined":
        try:
            optimizer.load_state_dict(saved)
        except (KeyError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{path}: the optimizer state does not fit this model ({e}): "
                                  "it was written for another model") from None
        return
    if saved.get("state"):
        raise CheckpointError(f"{path}: the optimizer state has per-parameter entries this program does not write: "
                              "the checkpoint is damaged or not one of this program's")
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
        group.update({k: v for k, v in saved_group.items() if k != "params"})


Piece = tuple[int, int, str]  # (first row, end row, file name) of a file holding a table's rows


def _rows_of(path: str, pieces: list[Piece], loaded: list[torch.Tensor], rows: tuple[int, int],
             what: str) -> torch.Tensor:
    """Rows ``[start, stop)`` of a table from the pieces that cover them (each ``[rows, ...]``)."""
    start, stop = rows
    parts = []
    for (first, end, name), tensor in zip(pieces, loaded):
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] != end - first:
            raise CheckpointError(f"{os.path.join(path, name)}: {what} has shape {list(getattr(tensor, 'shape', []))}, "
                                  f"expected {end - first} rows: the checkpoint is damaged")
        parts.append(tensor[max(start, first) - first:min(stop, end) - first])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _load_table_state(path: str, pieces: list[Piece], rows: tuple[int, int], state: dict[str, torch.Tensor]) -> None:
    """Copies the saved optimizer state of one table's rows ``[start, stop)`` into ``state``
    (views of the live state): per-row tensors from every piece, scalars from the first."""
    names = [_state_file(name) for _, _, name in pieces]
    saved = [load_tensor_file(path, name, mmap=True) for name in names]
    for name, part in zip(names, saved):
        if not isinstance(part, dict) or set(part) != set(state):
            raise CheckpointError(f"{os.path.join(path, name)}: holds {sorted(part) if isinstance(part, dict) else part!r}, "
                                  f"the optimizer keeps {sorted(state)}: the checkpoint is damaged")
    state_pieces = [(a, b, n) for (a, b, _), n in zip(pieces, names)]
    for key, target in state.items():
        if target.dim() == 0:
            value = saved[0][key]
        else:
            value = _rows_of(path, state_pieces, [part[key] for part in saved], rows, key)
        if not isinstance(value, torch.Tensor) or value.shape != target.shape:
            raise CheckpointError(f"{os.path.join(path, names[0])}: {key} has shape "
                                  f"{list(getattr(value, 'shape', []))}, expected {list(target.shape)}: "
                                  "the checkpoint is damaged")
        with torch.no_grad():
            target.copy_(value)


def _pieces_to_read(path: str, meta: dict[str, Any], local: list[LocalTable]) -> list[list[Piece]]:
    """Per local table, the files that hold its rows (whole-table files or row-wise blocks,
    whichever the checkpoint has: it may come from another placement)."""
    reads = []
    for embeddings, i in local:
        index, rows = embeddings.table_indices[i], embeddings.full_table_sizes[i]
        pieces = _table_pieces(meta["files"], index, rows)
        if not _covers(pieces, rows):
            raise CheckpointError(f"{os.path.join(path, META)}: the files of embedding table {index} "
                                  f"({[name for _, _, name in pieces] or 'none'}) do not cover its {rows} rows: "
                                  "the checkpoint is damaged")
        start, stop = embeddings.row_range(i)
        reads.append([piece for piece in pieces if piece[0] < stop and piece[1] > start])
    return reads


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
    Files are read with ``weights_only=True``: loading never runs code.
    """
    path = os.path.abspath(path)
    meta = read_meta(path)
    _check_shapes(path, meta, model)
    local = _local_tables(model)
    reads = _pieces_to_read(path, meta, local)
    tables = [name for pieces in reads for _, _, name in pieces]
    table_states = []
    if optimizer is not None:
        _check_optimizer_kind(path, meta, optimizer)
        if any(_table_optimizer_state(optimizer, embeddings, i) for embeddings, i in local):
            table_states = [_state_file(name) for name in tables]
    names = tables + table_states + ["dense.pt", "optimizer.pt"] + (["rng.pt"] if restore_rng else [])
    missing = [n for n in names if n not in meta["files"]]
    if missing:
        raise CheckpointError(f"{os.path.join(path, META)}: lists no {missing[0]}: the checkpoint is damaged")
    if verify:
        verify_checksums(path, meta, names)
    weights = []
    for (embeddings, i), pieces in zip(local, reads):
        loaded = [load_tensor_file(path, name, mmap=True) for _, _, name in pieces]
        weights.append(_rows_of(path, pieces, loaded, embeddings.row_range(i), "the table"))
    dense = load_tensor_file(path, "dense.pt")
    extra = load_tensor_file(path, "optimizer.pt")
    rng = load_tensor_file(path, "rng.pt") if restore_rng else None
    if not isinstance(dense, dict) or not isinstance(extra, dict) or not {"optimizer", "scaler"} <= extra.keys() \
            or (rng is not None and not (isinstance(rng, dict) and "cpu" in rng)):
        raise CheckpointError(f"{path}: dense.pt, optimizer.pt or rng.pt does not hold what this program writes: "
                              "the checkpoint is damaged or not one of this program's")
    with torch.no_grad():
        for (embeddings, i), weight in zip(local, weights):
            embeddings.load_table_(i, weight)
        model.load_state_dict(dense, strict=False)
    if optimizer is not None and extra["optimizer"] is not None:
        _load_optimizer(path, optimizer, extra["optimizer"])
        for (embeddings, i), pieces in zip(local, reads if table_states else []):
            _load_table_state(path, pieces, embeddings.row_range(i), _table_optimizer_state(optimizer, embeddings, i))
    if scaler is not None and scaler.is_enabled() and extra["scaler"] is not None:
        scaler.load_state_dict(extra["scaler"])
    if rng is not None:
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    try:
        return TrainState.from_meta(meta["train_state"], meta["run_config"])
    except TypeError as e:
        raise CheckpointError(f"{os.path.join(path, META)}: train_state is damaged ({e})") from None
