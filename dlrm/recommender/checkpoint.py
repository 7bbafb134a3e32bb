"""Autoencoder checkpoints: what a recommender run saves, and the checks that a checkpoint fits
the network it is loaded into. Files, checksums, staging, the lock and row blocks are the
checkpoint store's (``dlrm.engine.checkpoint_store``), as for DLRM's checkpoints.

    <path>/meta.json                   network definition, sizes, train state, files with sizes and CRC-32
    <path>/input_rows_<a>_<b>.pt       input table rows [a, b) and their optimizer state
    <path>/output_rows_<a>_<b>.pt      output layer rows [a, b) (weights, biases) and their optimizer state
    <path>/replicated.pt               the hidden layers and the input bias, with optimizer state

Each process writes the item rows it owns; the first one the rest and, last, ``meta.json``. A
process of a run with another process count reads the rows of its own ranges from whichever
files cover them.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import torch

from dlrm.engine import checkpoint_store as store
from dlrm.engine.checkpoint_store import CheckpointError, host_copy, latest_checkpoint, state_bytes
from dlrm.engine.collectives import Collectives
from dlrm.engine.tensor_checks import checked_tensor, label
from dlrm.recommender.linear import LinearModel, LinearSettings
from dlrm.recommender.model import SparseAutoencoder
from dlrm.recommender.network import parse_network
from dlrm.recommender.scorer import model_scorer

FORMAT = "dlrm-autoencoder-checkpoint"
VERSION = 1
# Both model kinds of the recommender: the autoencoder (its network, hidden sizes and weights) and
# the linear item-item model (``"model": "linear"``, its settings and ``linear.pt``).
META_FORMAT = store.Format("recommender checkpoint", ("version", VERSION),
                           {"n_input": int, "n_output": int, "train_state": dict},
                           marks={"format": FORMAT}, foreign="a DLRM checkpoint loads with dlrm.scripts.main, not here")
LINEAR, AUTOENCODER = "linear", "autoencoder"
LINEAR_FILE = "linear.pt"


def read_meta(path: str) -> dict[str, Any]:
    """``meta.json`` of a recommender checkpoint of either kind, checked (``store.Format``)."""
    meta = META_FORMAT.read_meta(path)
    kind = meta.get("model", AUTOENCODER)
    needs = {LINEAR: {"settings": dict}, AUTOENCODER: {"network": dict, "hidden": list}}.get(kind)
    if needs is None:
        raise CheckpointError(f"{os.path.join(path, store.META)}: model {kind!r} is not one this version knows "
                              f"({LINEAR}, {AUTOENCODER})")
    for key, type_ in needs.items():
        if not isinstance(meta.get(key), type_):
            raise CheckpointError(f"{os.path.join(path, store.META)}: entry {key!r} is missing or not a "
                                  f"{type_.__name__}: the checkpoint is damaged")
    return meta


def model_kind(path: str) -> str:
    """Which model the checkpoint at ``path`` holds: ``LINEAR`` or ``AUTOENCODER``."""
    return read_meta(path).get("model", AUTOENCODER)


def sizes_of(path: str) -> tuple[int, int]:
    """(inputs, outputs): the items a checkpoint's model reads and scores."""
    meta = read_meta(path)
    return meta["n_input"], meta["n_output"]


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


def _item_blocks(model: SparseAutoencoder) -> dict[str, tuple[int, tuple[int, int]]]:
    """Per item layer (the names its files start with): its rows, and the range this process holds."""
    return {"input": (model.n_input, model.input_range), "output": (model.n_output, model.output_range)}


def save(path: str, model: SparseAutoencoder, optimizer: torch.optim.Optimizer | None, state: AutoencoderState,
         run_config: dict[str, Any] | None = None) -> None:
    """Every process of the model's run calls this at the same step."""

    def write_items(files: store.StagedFiles) -> None:
        for kind, params in _item_params(model).items():
            _, (start, stop) = _item_blocks(model)[kind]
            if stop > start:
                piece = {name: host_copy(p) for name, p in params.items()}
                piece["state"] = {name: _state_of(optimizer, p) for name, p in params.items()}
                files.save(store.piece_name(kind, (start, stop)), piece)

    collectives = model.parallel.collectives(model.output_weight.device)
    store.save_directory(path, collectives, state_bytes(model), write_items,
                         lambda files: _write_rest(files, model, optimizer, state, run_config))


def _write_rest(files: store.StagedFiles, model: SparseAutoencoder, optimizer: torch.optim.Optimizer | None,
                state: AutoencoderState, run_config: dict[str, Any] | None) -> dict[str, Any]:
    """The replicated weights; returns meta.json's entries."""
    replicated = _replicated(model)
    files.save("replicated.pt", {"params": {n: host_copy(p) for n, p in replicated.items()},
                                 "state": {n: _state_of(optimizer, p) for n, p in replicated.items()}})
    return {
        "format": FORMAT, "version": VERSION,
        "network": model.config.to_json(),
        "n_input": model.n_input, "n_output": model.n_output,
        "hidden": [layer.n for layer in model.config.hidden],
        "seed": model.seed,
        "optimizer": type(optimizer).__name__ if optimizer is not None else None,
        "train_state": asdict(state),
        "run_config": run_config or {},
        "world_size": model.parallel.world_size,
    }


def best_path(path: str) -> str:
    """Where a run that validates keeps its best checkpoint: beside the latest one (``PATH.best``),
    which resuming needs and which a later save replaces."""
    return path.rstrip(os.sep) + ".best"


def model_path(path: str, best: bool = True) -> str:
    """The checkpoint to predict or evaluate with, given a run's ``path``: its best validation's
    (``best_path``) when ``best`` and the run validated, else its latest (``PATH.old`` when a save
    was cut off between its renames); a path of a ``.best`` directory is taken as it is."""
    latest = latest_checkpoint(path)
    if best and not path.rstrip(os.sep).endswith(".best"):
        found = latest_checkpoint(best_path(path))
        if found is not None and (latest is None or _same_run(found, latest)):
            return found
    return latest or path


RUN_ID = "run_id"  # in a checkpoint's run_config: the run that wrote it, kept across resumes


def _same_run(best: str, latest: str) -> bool:
    """Whether ``best`` is the best validation of the run whose latest checkpoint is ``latest``,
    and not a leftover of an earlier run the latest one replaced (``--overwrite``). A linear
    model's run keeps no best; checkpoints written before runs were named are taken as one run."""
    try:
        latest_meta, best_meta = read_meta(latest), read_meta(best)
    except (CheckpointError, OSError):
        return True  # the reader that opens them says what is wrong
    if latest_meta.get("model") == LINEAR:
        return False
    ours = latest_meta.get("run_config", {}).get(RUN_ID)
    return ours is None or best_meta.get("run_config", {}).get(RUN_ID) == ours


def describe(path: str) -> str:
    """``path``, and which of its run's checkpoints it is, for the line a script prints."""
    meta = read_meta(path)
    if meta.get("model") == LINEAR:
        chosen = meta.get("validation", {}).get("ndcg")
        return (f"{path} (linear item-item model, {LinearSettings(**meta['settings']).describe()}"
                + (f", validation NDCG {chosen:.4f}" if isinstance(chosen, float) else "") + ")")
    state = meta.get("train_state", {})
    if path.rstrip(os.sep).endswith(".best") and state.get("best_metric") is not None:
        return (f"{path} (the best validation of its run: NDCG {state['best_metric']:.4f} after epoch "
                f"{state['best_epoch']}, step {state['best_step']})")
    return f"{path} (step {state.get('step', 0)}, epoch {state.get('epoch', 0)})"


def network_of(path: str):
    """The network definition a checkpoint was trained with, sizes resolved."""
    meta = read_meta(path)
    return parse_network(meta["network"]).resolve(meta["n_input"], meta["n_output"])


def load_model(path: str, parallel, device: torch.device | str = "cpu") -> SparseAutoencoder:
    """This process's part of the network a checkpoint holds, built from its own definition and
    seed and loaded (for predict and evaluate), all from one save (``store.read_consistently``)."""
    def build_and_load() -> SparseAutoencoder:
        meta = read_meta(path)
        network = _saved_network(path, meta)
        model = SparseAutoencoder(network, parallel, seed=_seed(path, meta), device=device)
        _load(path, model, None, True)
        return model

    return store.read_consistently(path, build_and_load)


def _seed(path: str, meta: dict[str, Any]) -> int:
    """The run's seed from ``meta.json``: an integer a torch generator takes."""
    seed = meta.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 63:
        raise CheckpointError(f"{os.path.join(path, store.META)}: entry 'seed' is not a non-negative 64-bit "
                              "integer: the checkpoint is damaged")
    return seed


def _saved_network(path: str, meta: dict[str, Any]):
    """The network ``meta.json`` describes, resolved, once the values it holds are no more than
    the checkpoint's files can hold (2 bytes each at least): sizes in a damaged or crafted
    ``meta.json`` must not make a model of terabytes before any file is read."""
    where = os.path.join(path, store.META)
    sizes = (meta["n_input"], meta["n_output"])
    if any(isinstance(n, bool) or n < 1 for n in sizes):
        raise CheckpointError(f"{where}: n_input and n_output must be positive item counts: the checkpoint is damaged")
    try:
        network = parse_network(meta["network"]).resolve(*sizes)
        widths = [layer.n for layer in network.hidden]
        latent = [layer.name for layer in network.hidden].index(network.variational.layer) \
            if network.variational is not None else None
    except (ValueError, TypeError, KeyError, AttributeError):
        raise CheckpointError(f"{where}: its network definition is damaged (it no longer parses)") from None
    outs = [2 * n if i == latent else n for i, n in enumerate(widths)]
    values = (sizes[0] + 1) * outs[0] + sum((a + 1) * b for a, b in zip(widths[:-1], outs[1:])) \
        + sizes[1] * (widths[-1] + 1) if widths else 0
    held = sum(e.get("bytes", 0) if isinstance(e, dict) else e for e in meta["files"].values()
               if isinstance(e, (dict, int)))
    if not isinstance(held, int) or values * 2 > held:
        raise CheckpointError(f"{where}: its network has more weights than its files hold: the checkpoint is damaged")
    return network


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


def _restore(where: str, params: dict[str, torch.nn.Parameter], weights: dict[str, Any],
             states: dict[str, dict[str, torch.Tensor]], optimizer: torch.optim.Optimizer | None) -> None:
    """Copies the saved ``weights`` into ``params`` and, with ``optimizer``, their saved
    ``states`` into it (copies: what was read may be memory-mapped; scalars such as Adam's step
    count stay on the CPU, as torch's optimizers keep them)."""
    if not isinstance(states, dict):
        raise CheckpointError(f"{where}: its optimizer state is not a dict: the checkpoint is damaged")
    for name, p in params.items():
        if name not in weights:
            raise CheckpointError(f"{where}: no weights for {name}: it was saved by another network")
        store.check_shape(where, name, weights[name], p.shape)
        if not weights[name].is_floating_point():  # dense and finite: the store checked what it read
            raise CheckpointError(f"{where}: {name} does not hold floating-point weights: the checkpoint is damaged")
        if optimizer is not None and states.get(name):
            _check_state(where, name, states[name], p.shape)
    for name, p in params.items():
        p.copy_(weights[name])
        if optimizer is not None and states.get(name):
            optimizer.state[p] = {k: v.to(p.device, copy=True) if v.dim() else v.clone()
                                  for k, v in states[name].items()}


def _check_state(where: str, name: str, state: Any, shape: torch.Size) -> None:
    """The saved optimizer state of parameter ``name``: floating-point tensors, each a scalar (a
    step count) or of the parameter's shape (moments), as torch's optimizers keep them."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{where}: the optimizer state of {name} is not a dict: the checkpoint is damaged")
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise CheckpointError(f"{where}: the optimizer state {label(key)} of {name} is not a floating-point "
                                  "tensor: the checkpoint is damaged")
        if value.dim():
            store.check_shape(where, f"the optimizer state {label(key)} of {name}", value, shape)


def load(path: str, model: SparseAutoencoder, optimizer: torch.optim.Optimizer | None = None,
         verify: bool = True) -> AutoencoderState:
    """Loads this process's part of a checkpoint saved by any process count; with
    ``optimizer``, its state too (for resuming). Returns the train state. What is loaded always
    comes from one save, even while another run saves to ``path`` (``store.read_consistently``)."""
    return store.read_consistently(path, lambda: _load(path, model, optimizer, verify))


def _load(path: str, model: SparseAutoencoder, optimizer: torch.optim.Optimizer | None,
          verify: bool) -> AutoencoderState:
    meta = read_meta(path)
    _check_model(path, meta, model)
    reads = {kind: store.pieces_for(path, meta, kind, total, rows, f"the {kind} layer")
             for kind, (total, rows) in _item_blocks(model).items()}
    store.check_files(path, meta, ["replicated.pt", *(name for pieces in reads.values() for _, _, name in pieces)],
                      verify)
    replicated = store.load_tensor_file(path, "replicated.pt")
    if not isinstance(replicated, dict) or not isinstance(replicated.get("params"), dict):
        raise CheckpointError(f"{os.path.join(path, 'replicated.pt')}: does not hold what this program writes: "
                              "the checkpoint is damaged")
    with torch.no_grad():
        for kind, params in _item_params(model).items():
            if reads[kind]:
                rows = store.read_rows(path, reads[kind], _item_blocks(model)[kind][1])
                if not isinstance(rows, dict):
                    raise CheckpointError(f"{os.path.join(path, reads[kind][0][2])}: does not hold what this program "
                                          "writes: the checkpoint is damaged")
                _restore(os.path.join(path, reads[kind][0][2]), params, rows, rows.get("state", {}), optimizer)
        _restore(os.path.join(path, "replicated.pt"), _replicated(model), replicated["params"],
                 replicated.get("state", {}), optimizer)
    try:
        return AutoencoderState(**meta["train_state"])
    except TypeError as e:
        raise CheckpointError(f"{os.path.join(path, store.META)}: train_state is damaged ({e})") from None


# ----------------------------------------------------------------------------- the linear model


def save_linear(path: str, model, validation: dict[str, Any], run_config: dict[str, Any] | None = None) -> None:
    """The linear model (``dlrm.recommender.linear.LinearModel``, all its columns) as a
    checkpoint at ``path``, through the checkpoint store as the autoencoder's."""
    if not bool(torch.isfinite(model.weights).all()):
        raise CheckpointError(f"the linear model's weights are not all finite ({model.settings.describe()}): "
                              "nothing was saved; raise `regularization`")
    n = model.n_items

    def write_rest(files: store.StagedFiles) -> dict[str, Any]:
        files.save(LINEAR_FILE, {"weights": host_copy(model.weights)})
        return {"format": FORMAT, "version": VERSION, "model": LINEAR, "n_input": n, "n_output": n,
                "settings": asdict(model.settings), "validation": validation, "train_state": {},
                "run_config": run_config or {}, "world_size": 1}

    store.save_directory(path, Collectives(), n * n * 4, lambda files: None, write_rest)


def load_linear(path: str, parallel, device: torch.device | str = "cpu", verify: bool = True):
    """The columns of the linear model at ``path`` that this process scores (all on one)."""

    def read():
        meta = read_meta(path)
        if meta.get("model") != LINEAR:
            raise CheckpointError(f"{path} holds an autoencoder, not a linear model")
        store.check_files(path, meta, [LINEAR_FILE], verify)
        saved = store.load_tensor_file(path, LINEAR_FILE)
        where = os.path.join(path, LINEAR_FILE)
        if not isinstance(saved, dict) or not torch.is_tensor(saved.get("weights")):
            raise CheckpointError(f"{where}: does not hold what this program writes: the checkpoint is damaged")
        n = meta["n_input"]
        store.check_shape(where, "weights", saved["weights"], (n, n))
        checked_tensor(saved["weights"], where, "weights", finite=False)  # finite: the store checked it
        try:
            settings = LinearSettings(**meta["settings"])
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"{os.path.join(path, store.META)}: settings are damaged ({e})") from None
        whole = LinearModel(saved["weights"].to(torch.float32), settings)
        return whole.column_slice(*parallel.item_range(n)).to(device)

    return store.read_consistently(path, read)


def load_scorer(path: str, parallel, device: torch.device | str = "cpu", amp_dtype: torch.dtype | None = None):
    """(scores of a batch of histories for this process's items, the first of those items) of
    the checkpoint at ``path``, whichever model it holds: what predict, evaluate and Spark use."""
    if model_kind(path) == LINEAR:
        model = load_linear(path, parallel, device)
        return model.scores, model.item_start
    model = load_model(path, parallel, device)
    return model_scorer(model, amp_dtype), model.output_range[0]
