"""Randomized damage to real checkpoints of both products: whatever a checkpoint directory holds
(a tensor swapped for one of another shape, dtype or stride pattern, NaN or inf, a file cut
short, removed or added, ``meta.json`` entries of the wrong type, huge, negative or NaN), loading
it either gives exactly the weights and optimizer state of the checkpoint as saved, or raises
``CheckpointError`` with a one-line message (what the command lines print, exit 2), quickly.
Damaged files are resealed (their sizes and CRC-32 written into ``meta.json``) in most examples,
so the checks past the checksum are what is driven. Any other exception is a bug.

Derandomized as tests/test_reader_fuzz.py (a fixed seed, no example database);
FUZZ_EXAMPLES=N searches longer, FUZZ_RANDOM=1 with other seeds each run.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from conftest import REPO
from dlrm.engine import checkpoint_store as store
from dlrm.engine.checkpoint_store import CheckpointError
from dlrm.engine.tensor_checks import tensors_in
from test_hostile_checkpoints import reseal

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 250)), deadline=None,
                derandomize=not os.environ.get("FUZZ_RANDOM"), database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
SECONDS = 5.0  # the most one load of a damaged checkpoint of a few KB may take
AE_FIXTURE = os.path.join(REPO, "tests", "fixtures", "checkpoints", "autoencoder_2_processes")
HOSTILE_VALUES = [None, True, "x", "", [], {}, [1, 2], {"a": 1}, 0, -1, -10 ** 12, 2 ** 63, 10 ** 30, 0.5,
                  float("nan"), float("inf"), -float("inf"), 1e308]


# ----------------------------------------------------------------------------- damage


def _replacement(t: torch.Tensor, kind: str):
    """What a tensor of a file becomes: another shape, dtype or stride pattern, non-finite
    values, or no tensor at all."""
    shape, numel = tuple(t.shape), t.numel()
    if kind == "bigger":
        return torch.zeros((shape[0] + 1, *shape[1:]) if shape else (2,), dtype=t.dtype)
    if kind == "flat":
        return t.reshape(-1).clone() if t.dim() != 1 else t[None].clone()
    if kind == "float64":  # the same values, exactly: may load
        return t.double() if t.is_floating_point() else t.clone()
    if kind == "int64":
        return torch.arange(numel, dtype=torch.int64).reshape(shape) + 3
    if kind == "zero_stride":
        return torch.ones(1, dtype=t.dtype).expand(*shape) if numel > 1 else torch.ones(1).expand(10 ** 6, 13)
    if kind == "transposed":  # the same values, other strides
        return t.t().contiguous().t() if t.dim() == 2 else t.clone()
    if kind == "window":  # the same values, a window onto a larger storage
        return torch.cat([torch.zeros(3, dtype=t.dtype), t.reshape(-1)])[3:].view(shape)
    if kind in ("nan", "inf"):
        bad = t.clone()
        if bad.is_floating_point() and numel:
            bad.view(-1)[numel // 2] = float(kind)
        return bad
    return {"int": 7, "str": "x", "list": [t], "none": None}[kind]


KINDS = ["bigger", "flat", "float64", "int64", "zero_stride", "transposed", "window", "nan", "inf", "int", "str",
         "list", "none"]


def _swap(obj, path: list, new):
    """``obj`` with the entry at ``path`` (keys and indices from the top) replaced by ``new``."""
    if not path:
        return new
    obj[path[0]] = _swap(obj[path[0]], path[1:], new)
    return obj


def _entries(obj, path=()):
    """(path, tensor) of every tensor in ``obj``, with the path as keys and indices."""
    if isinstance(obj, torch.Tensor):
        yield list(path), obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _entries(value, (*path, key))
    elif isinstance(obj, (list, tuple)) and not isinstance(obj, tuple):
        for i, value in enumerate(obj):
            yield from _entries(value, (*path, i))


def _pt_files(path: str) -> list[str]:
    return sorted(name for name in os.listdir(path) if name.endswith(".pt"))


def damage(path: str, data) -> None:
    """One drawn corruption of the checkpoint at ``path``."""
    what = data.draw(st.sampled_from(["tensor", "tensor", "tensor", "truncate", "delete", "add", "meta", "meta"]))
    event(what)
    note(what)
    files = _pt_files(path)
    name = data.draw(st.sampled_from(files))
    file = os.path.join(path, name)
    if what == "tensor":
        obj = torch.load(file, weights_only=True)
        entries = list(_entries(obj))
        if not entries:
            return
        where, tensor = data.draw(st.sampled_from(entries))
        kind = data.draw(st.sampled_from(KINDS))
        event(f"tensor {kind}")
        note(f"{name}: {where} -> {kind}")
        torch.save(_swap(obj, where, _replacement(tensor, kind)), file)
    elif what == "truncate":
        with open(file, "r+b") as f:
            f.truncate(data.draw(st.integers(0, max(0, os.path.getsize(file) - 1))))
    elif what == "delete":
        os.remove(file)
        if data.draw(st.booleans()):
            _edit_meta(path, lambda meta: meta["files"].pop(name))
        return
    elif what == "add":
        name = data.draw(st.sampled_from([name.replace(".pt", "_rows_0_2.pt"), "extra.pt", name[:-3] + "_x.pt"]))
        torch.save({"weight": torch.ones(2, 4)} if data.draw(st.booleans()) else torch.ones(2, 8),
                   os.path.join(path, name))
        if not data.draw(st.booleans()):
            return  # an unlisted file: ignored
    else:
        _damage_meta(path, data)
        return
    if data.draw(st.integers(0, 4)):  # mostly resealed: the checks past the checksum are reached
        reseal(path, name)


def _edit_meta(path: str, edit) -> None:
    meta_path = os.path.join(path, store.META)
    with open(meta_path) as f:
        meta = json.load(f)
    edit(meta)
    with open(meta_path, "w") as f:
        json.dump(meta, f)  # NaN and inf as Python's json writes them


def _leaves(obj, path=()):
    """Paths of every entry of a JSON document (containers too)."""
    if path:
        yield list(path)
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _leaves(value, (*path, key))
    elif isinstance(obj, list):
        for i, value in enumerate(obj):
            yield from _leaves(value, (*path, i))


def _damage_meta(path: str, data) -> None:
    with open(os.path.join(path, store.META)) as f:
        meta = json.load(f)
    where = data.draw(st.sampled_from(list(_leaves(meta))))
    value = data.draw(st.sampled_from(HOSTILE_VALUES))
    event(f"meta {where[0]}")
    note(f"meta.json: {where} -> {value!r}")
    _edit_meta(path, lambda m: _swap(m, where, value))


# ----------------------------------------------------------------------------- the property


def _values(obj) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``obj`` as float64 values, by place (what "equal" compares)."""
    return [(where, t.detach().double()) for where, t in tensors_in(obj, "")]


def difference(a, b) -> str | None:
    """Where ``a`` and ``b`` differ (None: the same places, shapes and values)."""
    va, vb = _values(a), _values(b)
    if [w for w, _ in va] != [w for w, _ in vb]:
        return f"other entries: {[w for w, _ in va]} != {[w for w, _ in vb]}"
    return next((w for (w, x), (_, y) in zip(va, vb) if x.shape != y.shape or not torch.equal(x, y)), None)


class Reference(dict):
    """What a pristine checkpoint loads as (a short repr in hypothesis's reports)."""

    def __repr__(self) -> str:
        return "<reference>"


def loaded_or_refused(load, reference, directory: str):
    """``load()`` gives exactly ``reference``, or a one-line ``CheckpointError``, within ``SECONDS``."""
    start = time.monotonic()
    try:
        got = load()
    except CheckpointError as e:
        message = str(e)
        assert message and "\n" not in message and len(message) < 500, repr(message[:600])
        event("refused")
    else:
        event("loaded")
        differs = difference(got, reference)
        assert differs is None, f"{directory}: loaded, but {differs} is not what was saved"
    assert time.monotonic() - start < SECONDS


def fresh(pristine: str, scratch: str) -> str:
    path = os.path.join(scratch, "ckpt")
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(pristine, path)
    return path


# ----------------------------------------------------------------------------- DLRM


def _dlrm_parts():
    from dlrm.model.dlrm import DLRM, DLRMConfig
    from dlrm.training.optimizers import OptimizerConfig, make_optimizer

    torch.manual_seed(0)
    model = DLRM(DLRMConfig(num_numerical_features=3, table_sizes=[5, 9], embedding_dim=4, bottom_mlp_sizes=[8, 4],
                            top_mlp_sizes=[8, 1]))
    return model, make_optimizer(model, 0.1, OptimizerConfig("adagrad", "adam"))


def _dlrm_state(model, optimizer) -> dict:
    tables = [optimizer.embedding_state(model.embeddings.table_parameter(i)[0])
              for i in range(model.embeddings.num_tables)]
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "tables": tables}


def _dlrm_load(path: str) -> dict:
    from dlrm.training.checkpoint import load_checkpoint

    model, optimizer = _dlrm_parts()
    state = load_checkpoint(path, model, optimizer, restore_rng=True)
    # meta.json is not checksummed: another count is a valid checkpoint, another type is not
    assert all(type(n) is int and n >= 0 for n in (state.step, state.epoch, state.sample_in_epoch, state.batch_size))
    return _dlrm_state(model, optimizer)


@pytest.fixture(scope="module")
def dlrm_checkpoint(tmp_path_factory):
    """(a DLRM checkpoint written by the library's save after two steps, its state as loaded)."""
    from dlrm.training.checkpoint import TrainState, save_checkpoint

    model, optimizer = _dlrm_parts()
    for _ in range(2):
        x, ids = torch.randn(4, 3), torch.tensor([[0, 8], [4, 1], [2, 3], [1, 0]])
        optimizer.zero_grad()
        model(x, ids).sum().backward()
        optimizer.step()
    path = str(tmp_path_factory.mktemp("fuzz_dlrm") / "pristine")
    save_checkpoint(path, model, optimizer, None, TrainState(step=2), {"lr": 0.1})
    return path, Reference(_dlrm_load(path))


@FUZZ
@given(data=st.data())
def test_damaged_dlrm_checkpoints_load_exactly_or_are_refused(dlrm_checkpoint, tmp_path_factory, data):
    pristine, reference = dlrm_checkpoint
    path = fresh(pristine, str(tmp_path_factory.getbasetemp()))
    damage(path, data)
    loaded_or_refused(lambda: _dlrm_load(path), reference, path)


# ----------------------------------------------------------------------------- recommender


def _recommender_load(path: str, rank: int, world: int) -> dict:
    from dlrm.recommender import checkpoint as autoencoder
    from dlrm.recommender.item_parallel import ItemParallel
    from dlrm.recommender.train import make_optimizer

    model = autoencoder.load_model(path, ItemParallel(rank, world))
    optimizer = make_optimizer(model, model.config.optimizer)
    autoencoder.load(path, model, optimizer)
    return {"model": model.state_dict(), "state": [optimizer.state.get(p, {}) for p in model.parameters()]}


@pytest.fixture(scope="module")
def recommender_reference():
    """The committed checkpoint of two recommender processes (tests/test_checkpoint_fixtures.py),
    as each rank of one and of two processes loads it."""
    return Reference({(rank, world): _recommender_load(AE_FIXTURE, rank, world)
                      for world in (1, 2) for rank in range(world)})


@FUZZ
@given(data=st.data())
def test_damaged_recommender_checkpoints_load_exactly_or_are_refused(recommender_reference, tmp_path_factory, data):
    path = fresh(AE_FIXTURE, str(tmp_path_factory.getbasetemp()))
    damage(path, data)
    rank, world = data.draw(st.sampled_from(sorted(recommender_reference)))
    loaded_or_refused(lambda: _recommender_load(path, rank, world), recommender_reference[(rank, world)], path)

