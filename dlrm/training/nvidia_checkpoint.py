"""NVIDIA's DLRM checkpoint layout (DeepLearningExamples, PyTorch/Recommendation/DLRM), read into
this program's DLRM and written from it.

The layout, as NVIDIA's checkpoint writer lays a directory out (every process of its run writes
the tables it holds, the process of the bottom MLP that MLP, the first process the rest):

    metadata.pt                      {"data": {"device_mapping": M, "epoch": e, "step": s},
                                      "config": {NVIDIA's flag: value}}
    bottom_model.mlp.pt              {"weights": [W_0, ..], "biases": [b_0, ..]}, float32, W_i [out, in]
    top_model.mlp.pt                 the same for the top MLP but its last layer
    top_model.out.pt                 the last top layer's state dict: {"weight": [1, in], "bias": [1]}
    bottom_model.embeddings.<i>.bin  table i: its rows x dim float32 values, row-major raw bytes
    embeddings.<i>.meta.pt           {"shape": torch.Size([rows, dim])}

``i`` is the table's position among the feature spec's categorical features (this program's
table order too). ``M`` says which process held which tables: ``{"bottom_mlp": 0, "embedding":
[[tables of process 0], [tables of process 1], ..], "vectors_per_gpu": [..]}``. Every NVIDIA
embedding type (multi_table, joint, joint_sparse, joint_fused / custom_cuda) writes its tables
this way, one file each. NVIDIA's MLPs apply ReLU after every layer of ``weights``, and its
interaction is this program's (dot: ``[bottom, strictly-lower triangle of the Gram matrix of
[bottom, tables..] row by row, zero padding to a multiple of 8]``; cat: ``[bottom, tables..]``).

One thing depends on the run that wrote it: NVIDIA's model feeds its interaction the tables in
the order of ``M`` (process 0's, then process 1's, ..), not in table order, unless it ran on
several GPUs with ``--bottom_features_ordered``. On one GPU that order is NVIDIA's device
mapping's, the tables by decreasing size (``nvidia_device_mapping``). Reading permutes the top
MLP's first layer's inputs accordingly, so the model computes what NVIDIA's did.

Reading takes the tables each process holds (by this program's planner, whole tables or blocks
of rows, whatever NVIDIA's ``M`` was) from their files, and the MLPs; ``torch.load`` runs with
``weights_only=True``. It gives weights only: the layout holds no optimizer state. Writing lays
out the same files, staged in ``<path>.tmp`` and put at ``<path>`` by renames, as this program's
checkpoints are, for NVIDIA's code to load on a given number of GPUs (``nvidia_gpus``, one by
default) without ``--bottom_features_ordered`` (its default): ``M`` is the device mapping NVIDIA's
code computes for that count, and the top MLP's first layer takes its inputs in that order.

Such a directory is a user's input: every number, list and flag of its metadata is typed and
bounded by the files present before use, every tensor is dense and finite
(``dlrm.engine.tensor_checks``; ``nvidia_checkpoint_checks``), and a read comes from one save even
while another run re-saves it (``checkpoint_store.read_consistently``). What this program writes
carries ``dlrm_checksums.json`` beside NVIDIA's files (sizes and CRC-32s, which NVIDIA's loader
never opens); a read checks it when present.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dlrm.engine.atomic import fsync_dir
from dlrm.engine.storage import writing
from dlrm.engine.checkpoint_store import (LOCK, CheckpointError, check_checkpoint_path, commit_directory,
                                            read_consistently, save_tensor_file)
from dlrm.engine.collectives import Collectives
from dlrm.engine.outputs import OutputError, OutputKind, claim_output, first_foreign, holds_only
from dlrm.kernels.dot_interaction import padded_width
from dlrm.engine.tensor_checks import check_finite, checked_tensor
from dlrm.model.dlrm import DLRMConfig
from dlrm.training import nvidia_checkpoint_checks as checks
from dlrm.training.nvidia_checkpoint_checks import CHECKSUMS

METADATA = "metadata.pt"
BOTTOM_MLP = "bottom_model.mlp.pt"
TOP_MLP = "top_model.mlp.pt"
TOP_OUT = "top_model.out.pt"
_TABLE = re.compile(r"bottom_model\.embeddings\.(\d+)\.bin")
_TABLE_META = re.compile(r"embeddings\.(\d+)\.meta\.pt")
PATTERNS = (METADATA, BOTTOM_MLP, TOP_MLP, TOP_OUT, _TABLE, _TABLE_META,
            CHECKSUMS)  # all the writer puts there: no folders
NAME = "DLRM checkpoint in NVIDIA's layout"
CHECKPOINT = "the checkpoint"  # what a StorageError says could not be written
_CHUNK_BYTES = 64 << 20  # a table is written this many bytes at a time


def table_file(index: int) -> str:
    return f"bottom_model.embeddings.{index}.bin"


def table_meta_file(index: int) -> str:
    return f"embeddings.{index}.meta.pt"


def is_nvidia_checkpoint(path: str) -> bool:
    """Whether directory ``path`` is laid out as NVIDIA's (its ``metadata.pt``, no ``meta.json``
    of this program's own format). While a save swaps it (for a moment there is no ``path``, the
    previous one is ``path.old``, the new one ``path.tmp``), those say which layout it is, so a
    reader goes on to wait for the new one rather than take it for a missing checkpoint."""

    def nvidia(directory: str) -> bool:
        return os.path.isfile(os.path.join(directory, METADATA)) and not os.path.exists(
            os.path.join(directory, "meta.json"))

    if os.path.lexists(path):
        return nvidia(path)
    base = path.rstrip(os.sep)
    return nvidia(f"{base}.old") or nvidia(f"{base}.tmp")


def recognise(path: str) -> bool:
    """An NVIDIA-layout checkpoint and nothing else: what ``overwrite`` may replace."""
    return holds_only(path, PATTERNS, required=[METADATA])


KIND = OutputKind(NAME, directory=True, recognise=recognise)
STAGING = OutputKind(f"staged {NAME}", directory=True, recognise=lambda p: holds_only(p, PATTERNS))


# ----------------------------------------------------------------------------- reading


@dataclass
class NvidiaCheckpoint:
    """What a directory in NVIDIA's layout holds, but the tables' values (read per process)."""

    path: str
    config: dict[str, Any]  # NVIDIA's flags of the run that wrote it (those this program uses: typed)
    device_mapping: dict[str, Any]
    epoch: int
    step: int
    tables: list[list[int]]  # [rows, dim] of every table, in table order
    bottom: list[tuple[torch.Tensor, torch.Tensor]]  # (weight [out, in], bias) per layer
    top: list[tuple[torch.Tensor, torch.Tensor]]  # the top MLP's layers, the output layer last
    table_order: list[int]  # the tables in the order its interaction took them
    crc32: dict[str, str] | None = None  # each file's CRC-32 as this program wrote it (None: NVIDIA's)
    # The flags of ``config`` its metadata held (the others are their defaults): what a run
    # starting from it must still be told (``dlrm.training.saved_model``).
    recorded: tuple[str, ...] = ()

    @property
    def embedding_dim(self) -> int:
        return self.tables[0][1]

    def interaction_op(self) -> str:
        """``dot`` or ``cat``, by the width of the top MLP's input."""
        width = self.top[0][0].shape[1]
        n, dim = len(self.tables) + 1, self.embedding_dim
        dot, cat = padded_width(dim + n * (n - 1) // 2), n * dim
        if width == dot and width == cat:  # both give this width: the flag the run was given decides
            return "cat" if self.config.get("interaction_op") == "cat" else "dot"
        if width in (dot, cat):
            return "dot" if width == dot else "cat"
        raise CheckpointError(
            f"{self._file(TOP_MLP)}: the top MLP takes {width} inputs, which neither NVIDIA's dot interaction "
            f"({dot}) nor its cat interaction ({cat}) of {len(self.tables)} tables of dim {dim} gives: not a layout "
            "NVIDIA's DLRM writes")

    def model_config(self) -> DLRMConfig:
        """The DLRM these weights are (for export: the checkpoint alone says what to build)."""
        return DLRMConfig(
            num_numerical_features=int(self.bottom[0][0].shape[1]),
            table_sizes=[rows for rows, _ in self.tables],
            embedding_dim=self.embedding_dim,
            bottom_mlp_sizes=[int(w.shape[0]) for w, _ in self.bottom],
            top_mlp_sizes=[int(w.shape[0]) for w, _ in self.top],
            interaction_op=self.interaction_op(),
            hash_indices=bool(self.config.get("hash_indices", False)),
        )

    def _file(self, name: str) -> str:
        return os.path.join(self.path, name)


def _load(path: str, name: str) -> Any:
    """``torch.load(weights_only=True)`` of one file; every failure is a ``CheckpointError``."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: {name} is missing: NVIDIA's checkpoint writer always writes it; "
                              "the checkpoint is incomplete")
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" not in str(e).lower():
            raise CheckpointError(f"{file}: cannot be read (not a torch file): the checkpoint is damaged") from None
        found = re.search(r"GLOBAL ([\w.]{1,100})", str(e))
        raise CheckpointError(f"{file}: holds objects other than tensors and plain containers "
                              f"({found[1] if found else 'a class'}), which are never loaded (loading them could run "
                              "code): NVIDIA's checkpoint writer does not write them") from None
    except (RuntimeError, OSError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RecursionError, OverflowError, MemoryError) as e:  # what torch's unpickler raises on garbage
        reason = type(e).__name__ if isinstance(e, (RecursionError, MemoryError)) else (
            str(e).splitlines()[0][:200] if str(e).strip() else type(e).__name__)
        raise CheckpointError(f"{file}: cannot be read ({reason}): the checkpoint is damaged") from None


def _strip(state: Any, file: str) -> dict[str, Any]:
    """A state dict of NVIDIA's with DistributedDataParallel's ``module.`` prefix dropped."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: holds {checks.kind(state)}, NVIDIA's layout has a dict there")
    return {k[len("module."):] if isinstance(k, str) and k.startswith("module.") else k: v for k, v in state.items()}


def _keys(state: dict[str, Any], file: str, keys: set[str], what: str) -> None:
    """``state`` holds exactly ``keys`` (named in the message; the file's own keys never are)."""
    if set(state) != keys:
        raise CheckpointError(f"{file}: holds {len(state)} entries, NVIDIA's layout has {what} there: "
                              "the checkpoint is damaged")


def _mlp(path: str, name: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The layers of one MLP file, each a dense, finite float weight [out, in] and bias [out]."""
    file = os.path.join(path, name)
    state = _strip(_load(path, name), file)
    _keys(state, file, {"weights", "biases"}, "equally long lists 'weights' and 'biases'")
    weights = checks.sequence(state["weights"], file, "'weights'", checks.MAX_LAYERS)
    biases = checks.sequence(state["biases"], file, "'biases'", checks.MAX_LAYERS)
    if len(weights) != len(biases):
        raise CheckpointError(f"{file}: {len(weights)} weights and {len(biases)} biases, NVIDIA's layout has one "
                              "of each per layer: the checkpoint is damaged")
    layers = []
    for i, (w, b) in enumerate(zip(weights, biases)):
        w = checked_tensor(w, file, f"layer {i}'s weight", dims=[2])
        b = checked_tensor(b, file, f"layer {i}'s bias", dims=[1])
        if b.shape[0] != w.shape[0] or not w.numel():
            raise CheckpointError(f"{file}: layer {i} has weight {list(w.shape)} and bias {list(b.shape)}, not "
                                  "[out, in] and [out]: the checkpoint is damaged")
        layers.append((w.detach().float(), b.detach().float()))
    for i in range(1, len(layers)):
        if layers[i][0].shape[1] != layers[i - 1][0].shape[0]:
            raise CheckpointError(f"{file}: layer {i} takes {layers[i][0].shape[1]} inputs, layer {i - 1} gives "
                                  f"{layers[i - 1][0].shape[0]}: the checkpoint is damaged")
    return layers


def _table_shape(path: str, index: int) -> list[int]:
    """Table ``index``'s [rows, dim] from its meta file, after checking its values file holds them."""
    meta_file = os.path.join(path, table_meta_file(index))
    meta = _strip(_load(path, table_meta_file(index)), meta_file)
    if "shape" not in meta:
        raise CheckpointError(f"{meta_file}: holds no 'shape': the checkpoint is damaged")
    shape = [checks.plain_int(s, meta_file, "a size of 'shape'", low=1)
             for s in checks.sequence(meta["shape"], meta_file, "'shape'", 2)]
    if len(shape) != 2:
        raise CheckpointError(f"{meta_file}: 'shape' has {len(shape)} sizes, not [rows, dim]: the checkpoint is "
                              "damaged")
    file = os.path.join(path, table_file(index))
    if not os.path.isfile(file):
        raise CheckpointError(f"{path}: {table_file(index)} is missing: the checkpoint is incomplete")
    size, wanted = os.path.getsize(file), shape[0] * shape[1] * 4
    if size != wanted:
        raise CheckpointError(f"{file}: {size} bytes, its {shape} float32 values take {wanted}: "
                              "the checkpoint is damaged")
    return shape


def _tables(path: str, mapping: dict[str, Any], names: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """Every table's shape and ``mapping``'s tables per process, after checking that the files
    (``names``) are those it lists; it is bounded by the table files present before any loop."""
    meta_file = os.path.join(path, METADATA)
    present = {int(m[1]) for name in names if (m := _TABLE.fullmatch(name) or _TABLE_META.fullmatch(name))}
    buckets = checks.buckets(mapping.get("embedding"), meta_file, len(present))
    indices = sorted(i for bucket in buckets for i in bucket)
    if indices != list(range(len(indices))) or not indices:
        listed = indices if len(indices) <= 16 else f"{len(indices)} indices"
        raise CheckpointError(f"{meta_file}: device_mapping['embedding'] lists tables {listed}, not each of "
                              f"0..{max(len(indices) - 1, 0)} once: not a layout NVIDIA's writer writes")
    foreign = first_foreign(path, PATTERNS)
    unlisted = sorted(i for i in present if i >= len(indices))
    if foreign is not None or unlisted:
        what = foreign if foreign is not None else table_file(unlisted[0])
        raise CheckpointError(f"{path} holds {what}, which NVIDIA's checkpoint writer does not write "
                              f"(its device_mapping lists tables 0..{len(indices) - 1}): an unsupported layout; "
                              "load a directory NVIDIA's DLRM wrote, as it wrote it")
    shapes = [_table_shape(path, index) for index in indices]
    dims = {dim for _, dim in shapes}
    if len(dims) > 1:
        raise CheckpointError(f"{path}: its tables have dims {sorted(dims)[:8]}; NVIDIA's DLRM gives every table one "
                              "embedding_dim: not its layout")
    return shapes, buckets


def _metadata(path: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], tuple[str, ...]]:
    """``metadata.pt``'s data, device mapping and config, the flags this program uses typed (those
    absent set to their defaults), and which of those flags the file held."""
    meta_file = os.path.join(path, METADATA)
    meta = _load(path, METADATA)
    data = meta.get("data") if isinstance(meta, dict) else None
    config = meta.get("config") if isinstance(meta, dict) else None
    mapping = data.get("device_mapping") if isinstance(data, dict) else None
    if not isinstance(mapping, dict) or not isinstance(config, (dict, type(None))):
        raise CheckpointError(f"{meta_file}: holds no data['device_mapping'] (and config) as NVIDIA's checkpoint "
                              "writer writes: not its layout")
    config = dict(config or {})
    typed = (("interaction_op", str, None), ("hash_indices", bool, False), ("bottom_features_ordered", bool, False))
    recorded = tuple(name for name, _, _ in typed if name in config)
    for name, kind, default in typed:
        config[name] = checks.flag(config, meta_file, name, kind, default)
    return data, mapping, config, recorded


def _layout_files(path: str) -> list[str]:
    """The files of NVIDIA's layout in ``path`` (what a checksum listing covers)."""
    return sorted(name for name in os.listdir(path)
                  if name != CHECKSUMS and _layout_name(name) and os.path.isfile(os.path.join(path, name)))


def _layout_name(name: str) -> bool:
    """Whether ``name`` is one that NVIDIA's writer puts in a checkpoint directory."""
    return name in (METADATA, BOTTOM_MLP, TOP_MLP, TOP_OUT) or bool(_TABLE.fullmatch(name) or
                                                                   _TABLE_META.fullmatch(name))


def _read(path: str) -> NvidiaCheckpoint:
    """``read`` once, without regard to a save that replaces the directory meanwhile."""
    names = _layout_files(path) if os.path.isdir(path) else []
    crc32 = checks.read_checksums(path, names)
    checks.verify(path, crc32, [name for name in names if name.endswith(".pt")])  # before anything is unpickled
    data, mapping, config, recorded = _metadata(path)
    meta_file = os.path.join(path, METADATA)
    epoch = checks.plain_int(data.get("epoch"), meta_file, "data['epoch']", default=0)
    step = checks.plain_int(data.get("step"), meta_file, "data['step']", default=0)
    tables, buckets = _tables(path, mapping, names)
    bottom = _mlp(path, BOTTOM_MLP)
    top = _mlp(path, TOP_MLP)
    out_file = os.path.join(path, TOP_OUT)
    out = _strip(_load(path, TOP_OUT), out_file)
    _keys(out, out_file, {"weight", "bias"}, "a Linear layer's 'weight' [out, in] and 'bias' [out]")
    weight = checked_tensor(out["weight"], out_file, "'weight'", dims=[2])
    bias = checked_tensor(out["bias"], out_file, "'bias'", dims=[1])
    if list(bias.shape) != [weight.shape[0]]:
        raise CheckpointError(f"{out_file}: 'weight' {list(weight.shape)} and 'bias' {list(bias.shape)} are not "
                              "[out, in] and [out]: the checkpoint is damaged")
    top.append((weight.detach().float(), bias.detach().float()))
    if not bottom or len(top) < 2 or top[-1][0].shape[1] != top[-2][0].shape[0]:
        raise CheckpointError(f"{path}: its MLPs do not chain (bottom {len(bottom)} layers, top {len(top)}): "
                              "the checkpoint is damaged")
    if bottom[-1][0].shape[0] != tables[0][1]:
        raise CheckpointError(f"{os.path.join(path, BOTTOM_MLP)}: the bottom MLP ends at {bottom[-1][0].shape[0]}, "
                              f"its tables have dim {tables[0][1]}: NVIDIA's DLRM ends it at the tables' dim; "
                              "the checkpoint is damaged")
    # NVIDIA's model reorders its tables into feature order only on several GPUs, when asked.
    feature_order = len(buckets) > 1 and config["bottom_features_ordered"]
    order = list(range(len(tables))) if feature_order else [i for bucket in buckets for i in bucket]
    return NvidiaCheckpoint(path, config, {**mapping, "embedding": buckets}, epoch, step, tables, bottom, top, order,
                            crc32, recorded)


def read(path: str) -> NvidiaCheckpoint:
    """Reads and checks everything but the tables' values (``read_rows``), all from one save
    even while another run saves to ``path`` (``checkpoint_store.read_consistently``)."""
    path = os.path.abspath(path)
    return read_consistently(path, lambda: _read(path), marker=METADATA)


def read_rows(ckpt: NvidiaCheckpoint, index: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of table ``index``, read from its file alone; finite, or a
    ``CheckpointError`` naming the file and table."""
    rows, dim = ckpt.tables[index]
    if not 0 <= start <= stop <= rows:
        raise ValueError(f"rows [{start}, {stop}) of table {index}, which has {rows}")
    file = os.path.join(ckpt.path, table_file(index))
    values = np.empty((stop - start) * dim, dtype="<f4")
    buffer, done = memoryview(values).cast("B"), 0
    with open(file, "rb") as f:
        f.seek(start * dim * 4)
        while done < len(buffer) and (n := f.readinto(buffer[done:])):
            done += n
    if done != len(buffer):
        raise CheckpointError(f"{file}: ends before row {stop} of its {rows}: the checkpoint is damaged")
    weight = torch.from_numpy(values.astype(np.float32, copy=False).reshape(stop - start, dim))
    check_finite(weight, file, f"table {index}'s rows [{start}, {stop})")
    return weight


def _sizes(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    return ",".join(str(w.shape[0]) for w, _ in layers)


def _interaction_columns(op: str, order: list[int], dim: int, width: int) -> torch.Tensor:
    """For each input of this program's top MLP, the input of the checkpoint's that carries the
    same value, when the checkpoint's interaction took the tables in ``order``."""
    position = [0] * (len(order) + 1)  # feature (0: bottom, 1 + t: table t) -> position in NVIDIA's input
    for p, table in enumerate(order):
        position[1 + table] = 1 + p
    n = len(position)
    if op == "cat":
        return torch.cat([torch.arange(position[f] * dim, (position[f] + 1) * dim) for f in range(n)])
    columns = list(range(dim))
    for a in range(1, n):
        for b in range(a):  # the strictly-lower triangle, row by row, as both interactions lay it out
            p, q = max(position[a], position[b]), min(position[a], position[b])
            columns.append(dim + p * (p - 1) // 2 + q)
    columns += range(len(columns), width)  # the zero padding
    return torch.tensor(columns)


def nvidia_device_mapping(table_sizes: list[int], gpus: int = 1) -> dict[str, Any]:
    """The device mapping NVIDIA's DLRM example computes for ``gpus`` GPUs (and so the order its
    interaction takes the tables in): tables by decreasing size (ties by index), each to the
    bucket of the least rows so far among those with room (ceil(tables / buckets) each, a bucket
    that fills is closed); from 5 GPUs on, GPU 0 holds only the bottom MLP."""
    if not 1 <= gpus <= checks.MAX_GPUS:
        raise ValueError(f"`nvidia_gpus` must be from 1 to {checks.MAX_GPUS}, got {gpus}")
    count = gpus - 1 if gpus > 4 else gpus
    room = -(-len(table_sizes) // count)
    open_buckets: list[list[int]] = [[] for _ in range(count)]
    closed: list[list[int]] = []
    for table in sorted(range(len(table_sizes)), key=lambda t: -table_sizes[t]):
        bucket = open_buckets[0]
        bucket.append(table)
        if len(bucket) == room:
            closed.append(open_buckets.pop(0))
        open_buckets.sort(key=lambda b: sum(table_sizes[t] for t in b))
    buckets = closed + open_buckets
    if gpus > 4:
        buckets.insert(0, [])
    vectors = [len(b) for b in buckets]
    vectors[0] += 1  # the bottom MLP's output
    return {"bottom_mlp": 0, "embedding": buckets, "vectors_per_gpu": vectors}


def check_fits(ckpt: NvidiaCheckpoint, model: torch.nn.Module) -> None:
    """One line naming what differs between the checkpoint and the model, and the setting to change."""
    cfg: DLRMConfig = model.config
    path = ckpt.path
    if cfg.interaction_op == "dcn":
        raise CheckpointError(f"{path}: NVIDIA's DLRM has no DCN interaction; this run has `interaction_op=dcn`: "
                              f"set `interaction_op={ckpt.interaction_op()}`")
    if len(ckpt.tables) != cfg.num_categorical_features:
        raise CheckpointError(f"{path} holds {len(ckpt.tables)} embedding tables, this run's feature spec has "
                              f"{cfg.num_categorical_features}: it was written for another dataset or feature spec")
    for i, (found, rows) in enumerate(zip(ckpt.tables, cfg.table_sizes)):
        wanted = [rows, cfg.embedding_dim]
        if found != wanted:
            hint = (f"set `embedding_dim={found[1]}`" if found[1] != wanted[1] else
                    "check `max_table_size` and the dataset's cardinalities")
            raise CheckpointError(f"{path}: embedding table {i} ({table_file(i)}) has shape {found} in the checkpoint, "
                                  f"{wanted} in this run: {hint}")
    saved_hashing = ckpt.config["hash_indices"] if "hash_indices" in ckpt.recorded else cfg.hash_indices
    if saved_hashing != cfg.hash_indices:
        raise CheckpointError(
            f"{path} was trained {'with' if saved_hashing else 'without'} `hash_indices` and this run is "
            f"{'with' if cfg.hash_indices else 'without'} it: ids would reach other rows; "
            f"{'add' if saved_hashing else 'drop'} `hash_indices`")
    for name, layers, setting, mlp in (("bottom", ckpt.bottom, "bottom_mlp_sizes", model.bottom_mlp),
                                       ("top", ckpt.top, "top_mlp_sizes", model.top_mlp)):
        found = _sizes(layers)
        wanted = ",".join(str(layer.out_features) for layer in mlp.layers)
        if found != wanted:
            raise CheckpointError(f"{path}: the {name} MLP has layers {found} in the checkpoint, {wanted} in this run: "
                                  f"set `{setting}={found}`")
    if ckpt.bottom[0][0].shape[1] != cfg.num_numerical_features:
        raise CheckpointError(f"{path}: the bottom MLP takes {ckpt.bottom[0][0].shape[1]} numerical features, this "
                              f"run's feature spec has {cfg.num_numerical_features}: it was written for another "
                              "dataset or feature spec")
    op = ckpt.interaction_op()
    mine = "cat" if cfg.interaction_op == "cat" else "dot"
    width = ckpt.top[0][0].shape[1]
    if op != mine or width != model.top_mlp.layers[0].in_features:
        raise CheckpointError(f"{path}: the top MLP takes {width} inputs ({op} interaction) in the checkpoint, "
                              f"{model.top_mlp.layers[0].in_features} in this run ({cfg.interaction_op}): "
                              f"set `interaction_op={op}`")


def local_tables(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Every table (or block of rows) this process holds: (embedding module, local index)."""
    return [(module, i) for module in model.embedding_modules() for i in range(module.num_tables)]


Weights = tuple[NvidiaCheckpoint, list[tuple[torch.nn.Module, int, torch.Tensor]],
                list[tuple[torch.Tensor, torch.Tensor]]]


def _read_weights(path: str, model: torch.nn.Module) -> Weights:
    """What ``load`` copies into ``model``: the checkpoint, this process's tables (checked
    against their checksums when this program wrote them) and the top MLP in the model's order."""
    ckpt = _read(path)
    check_fits(ckpt, model)
    local = local_tables(model)
    checks.verify(path, ckpt.crc32, sorted({table_file(module.table_indices[i]) for module, i in local}))
    tables = [(module, i, read_rows(ckpt, module.table_indices[i], *module.row_range(i))) for module, i in local]
    first = ckpt.top[0][0][:, _interaction_columns(ckpt.interaction_op(), ckpt.table_order, ckpt.embedding_dim,
                                                   ckpt.top[0][0].shape[1])]
    return ckpt, tables, [(first, ckpt.top[0][1]), *ckpt.top[1:]]


def load(path: str, model: torch.nn.Module, optimizer: Any = None, restore_rng: bool = False) -> dict[str, Any]:
    """Copies the weights of NVIDIA's checkpoint at ``path`` into ``model`` (this process's
    tables and the MLPs), after checking every shape and value: a mismatch leaves the model
    untouched. Everything comes from one save, even while another run saves to ``path``
    (``checkpoint_store.read_consistently``). Returns what the metadata says of where its run
    stood (``epoch``, ``step``)."""
    if optimizer is not None or restore_rng:
        raise CheckpointError(f"{path} is a checkpoint in NVIDIA's layout, which holds weights only (no optimizer "
                              "state): drop `resume` to start a new run from its weights")
    path = os.path.abspath(path)
    ckpt, tables, top = read_consistently(path, lambda: _read_weights(path, model), marker=METADATA)
    with torch.no_grad():
        for module, i, weight in tables:
            module.load_table_(i, weight)
        for mlp, layers in ((model.bottom_mlp, ckpt.bottom), (model.top_mlp, top)):
            for layer, (weight, bias) in zip(mlp.layers, layers):
                layer.weight.copy_(weight)
                layer.bias.copy_(bias)
    return {"epoch": ckpt.epoch, "step": ckpt.step}


# ----------------------------------------------------------------------------- writing


def check_can_write(cfg: DLRMConfig) -> None:
    """Before training: NVIDIA's DLRM has a model of this shape (``ValueError`` naming the setting)."""
    if cfg.interaction_op not in ("dot", "cuda_dot", "cat"):
        raise ValueError(f"`checkpoint_format=nvidia`: NVIDIA's DLRM has no {cfg.interaction_op} interaction; use "
                         "`interaction_op=dot` or `cat`, or save this program's format")
    if len(cfg.top_mlp_sizes) < 2:
        raise ValueError(f"`checkpoint_format=nvidia`: NVIDIA's top model is an MLP and an output layer, "
                         f"`top_mlp_sizes={','.join(map(str, cfg.top_mlp_sizes))}` has one layer: give at least two")
    if cfg.bottom_mlp_sizes[-1] != cfg.embedding_dim:
        raise ValueError(f"`checkpoint_format=nvidia`: NVIDIA's bottom MLP ends at `embedding_dim` "
                         f"({cfg.embedding_dim}), `bottom_mlp_sizes` ends at {cfg.bottom_mlp_sizes[-1]}")


def claim(path: str, inputs: dict[str, Any] | None = None, replace: bool = False,
          setting: str = "save_checkpoint_path") -> str:
    """``path`` may receive an NVIDIA-layout checkpoint (``dlrm.engine.outputs``): absent, empty,
    or (with ``replace``) one such checkpoint; what goes beside it holds nothing of the user's."""
    return claim_output(path, KIND, setting, inputs=inputs, replace=replace,
                        siblings={".tmp": STAGING, ".old": KIND, ".lock": LOCK})


def _plain(value: Any) -> bool:
    """Whether ``value`` unpickles under ``weights_only`` (plain data)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(map(_plain, value))
    return isinstance(value, dict) and all(isinstance(k, str) and _plain(v) for k, v in value.items())


def _config(cfg: DLRMConfig, run_config: dict[str, Any] | None) -> dict[str, Any]:
    """metadata.pt's config: the run's settings (a flags dict, or a ``RunConfig.to_dict()`` by
    its settings' names, which are NVIDIA's flags' for most) with the model's shape as NVIDIA's
    flags give it."""
    flat: dict[str, Any] = {}

    def leaves(values: dict[str, Any]) -> None:  # a RunConfig.to_dict() nests its settings
        for k, v in values.items():
            if isinstance(v, dict):
                leaves(v)
            else:
                flat.setdefault(k, v)

    leaves(run_config or {})
    config = {k: v for k, v in flat.items() if _plain(v)}
    config.update(embedding_dim=cfg.embedding_dim, bottom_mlp_sizes=list(cfg.bottom_mlp_sizes),
                  top_mlp_sizes=list(cfg.top_mlp_sizes), hash_indices=cfg.hash_indices,
                  interaction_op="cat" if cfg.interaction_op == "cat" else "dot",
                  bottom_features_ordered=False)
    return config


def _write_rows(file: str, weight: torch.Tensor, start: int) -> None:
    """Writes ``weight`` (rows of a table from row ``start``) into its file as float32 bytes."""
    rows, dim = weight.shape
    step = max(1, _CHUNK_BYTES // max(1, dim * 4))
    fd = os.open(file, os.O_WRONLY)
    try:
        for a in range(0, rows, step):
            chunk = weight[a:a + step].detach().to("cpu", torch.float32).contiguous().numpy()
            data, offset = chunk.astype("<f4", copy=False).tobytes(), (start + a) * dim * 4
            while data:
                n = os.pwrite(fd, data, offset)
                data, offset = data[n:], offset + n
        os.fsync(fd)
    finally:
        os.close(fd)


def _mlp_state(layers: Any) -> dict[str, list[torch.Tensor]]:
    return {"weights": [layer.weight.detach().to("cpu", torch.float32).clone() for layer in layers],
            "biases": [layer.bias.detach().to("cpu", torch.float32).clone() for layer in layers]}


def save(path: str, model: torch.nn.Module, epoch: int, step: int, run_config: dict[str, Any] | None = None,
         collectives: Collectives = Collectives(), nvidia_gpus: int = 1) -> None:
    """Every process of ``collectives`` calls this: each writes the tables (or blocks of rows) it
    holds into the table's file, the first process the MLPs and ``metadata.pt``; the directory
    is staged in ``<path>.tmp`` and put at ``<path>`` whole (the previous one is ``<path>.old``
    in between)."""
    cfg: DLRMConfig = model.config
    check_can_write(cfg)
    path = os.path.abspath(path)
    tmp = f"{path}.tmp"
    first = collectives.rank == 0
    if first:
        check_checkpoint_path(path)
        with writing(path, CHECKPOINT):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            if os.path.lexists(tmp):
                if os.path.islink(tmp) or not os.path.isdir(tmp) or not STAGING.recognise(tmp):
                    raise OutputError(f"{tmp} is in the way of the checkpoint's staging and is not one of this "
                                      "program's: move it away; nothing was changed")
                shutil.rmtree(tmp)
            os.makedirs(tmp)
            for index, rows in enumerate(cfg.table_sizes):  # each process writes its rows into these
                with open(os.path.join(tmp, table_file(index)), "wb") as f:
                    f.truncate(rows * cfg.embedding_dim * 4)
    collectives.barrier()
    cleanup = (lambda: shutil.rmtree(tmp, ignore_errors=True)) if first else None
    with writing(path, CHECKPOINT, cleanup=cleanup):
        held = []  # the tables whose first rows this process holds: its bucket of the device mapping
        for module, i in local_tables(model):
            index, (start, _) = module.table_indices[i], module.row_range(i)
            _write_rows(os.path.join(tmp, table_file(index)), module.table_weight(i), start)
            if start == 0:
                held.append(index)
                save_tensor_file({"shape": torch.Size([cfg.table_sizes[index], cfg.embedding_dim])},
                                 os.path.join(tmp, table_meta_file(index)))
        collectives.gather_objects(held)  # every process has written its rows before the first one goes on
        if first:
            save_tensor_file(_mlp_state(model.bottom_mlp.layers), os.path.join(tmp, BOTTOM_MLP))
            top = _mlp_state(model.top_mlp.layers[:-1])
            mapping = nvidia_device_mapping(list(cfg.table_sizes), nvidia_gpus)
            ours = top["weights"][0]
            columns = _interaction_columns("cat" if cfg.interaction_op == "cat" else "dot",
                                           [t for bucket in mapping["embedding"] for t in bucket], cfg.embedding_dim,
                                           ours.shape[1])
            top["weights"][0] = torch.empty_like(ours)
            top["weights"][0][:, columns] = ours  # NVIDIA's inputs in its device order (``load`` reads them back)
            save_tensor_file(top, os.path.join(tmp, TOP_MLP))
            out = model.top_mlp.layers[-1]
            save_tensor_file({"weight": out.weight.detach().to("cpu", torch.float32).clone(),
                              "bias": out.bias.detach().to("cpu", torch.float32).clone()},
                             os.path.join(tmp, TOP_OUT))
            save_tensor_file({"data": {"device_mapping": mapping, "epoch": epoch, "step": step},
                              "config": _config(cfg, run_config)}, os.path.join(tmp, METADATA))
            checks.write_checksums(tmp, _layout_files(tmp))  # what NVIDIA's loader ignores, ours checks
            fsync_dir(tmp)
            commit_directory(tmp, path, recognise, f"a {NAME} written by this program")
    collectives.barrier()

