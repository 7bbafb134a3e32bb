"""Randomized checkpoints in NVIDIA's layout: a small valid directory, laid out here from the
layout's definition, with one drawn corruption (a metadata value of another type, huge,
negative, NaN, a long or deep list; a tensor expanded, strided, of another dtype, non-finite or
of another shape; a table's bytes; a file missing, extra, truncated or with bytes changed). Each
either loads, through ``nvidia_checkpoint.read`` and ``read_rows`` and into a model by ``load``,
and then equals what an independent reader finds in the files, or is refused with a
``CheckpointError`` of one line under 500 characters; within 5 s either way. Anything else is a
bug. Derandomized as tests/test_reader_fuzz.py; FUZZ_EXAMPLES searches longer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dlrm.engine.checkpoint_store import CheckpointError
from dlrm.model.dlrm import DLRM
from dlrm.training import nvidia_checkpoint

FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 100)), deadline=None,
                derandomize=not os.environ.get("FUZZ_RANDOM"), database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])
TABLES, DIM, NUMERICAL, BOTTOM, TOP = [5, 3, 7], 4, 2, [6, 4], [8, 1]
WIDTH = 16  # the dot interaction of 4 features of dim 4: 4 + 6, padded to a multiple of 8
SECONDS = 5.0


def write_layout(path: str, seed: int = 0) -> None:
    """A directory as NVIDIA's writer lays it out: raw float32 tables with their shapes, the
    MLPs as lists of weights and biases, the output layer's state dict, and metadata.pt."""
    g = torch.Generator().manual_seed(seed)
    os.makedirs(path)
    for i, rows in enumerate(TABLES):
        (torch.rand(rows, DIM, generator=g) - 0.5).numpy().astype("<f4").tofile(
            os.path.join(path, f"bottom_model.embeddings.{i}.bin"))
        torch.save({"shape": torch.Size([rows, DIM])}, os.path.join(path, f"embeddings.{i}.meta.pt"))

    def mlp(fan_in, sizes):
        layers = []
        for size in sizes:
            layers.append((torch.randn(size, fan_in, generator=g), torch.randn(size, generator=g)))
            fan_in = size
        return {"weights": [w for w, _ in layers], "biases": [b for _, b in layers]}

    torch.save(mlp(NUMERICAL, BOTTOM), os.path.join(path, "bottom_model.mlp.pt"))
    torch.save(mlp(WIDTH, TOP[:-1]), os.path.join(path, "top_model.mlp.pt"))
    torch.save({"weight": torch.randn(1, TOP[-2], generator=g), "bias": torch.randn(1, generator=g)},
               os.path.join(path, "top_model.out.pt"))
    mapping = {"bottom_mlp": 0, "embedding": [[2, 0], [1]], "vectors_per_gpu": [3, 1]}
    torch.save({"data": {"device_mapping": mapping, "epoch": 1, "step": 9},
                "config": {"embedding_dim": DIM, "hash_indices": False, "bottom_features_ordered": False,
                           "interaction_op": "cuda_dot"}}, os.path.join(path, "metadata.pt"))


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("nv_fuzz") / "base")
    write_layout(path)
    check_equal(path)  # and the first model's one-time set-up is not timed below
    return path


# ----------------------------------------------------------------------------- corruptions

HOSTILE = st.one_of(
    st.none(), st.booleans(), st.integers(-2, 40), st.sampled_from([1.0, 9.0, [[2.0, 0], [1]], [[2, 0, 1]]]), st.sampled_from([2**31, 2**63, 10**30, -10**20]),
    st.floats(), st.text(max_size=8), st.binary(max_size=8),
    st.integers(0, 3).flatmap(lambda i: st.lists(st.just(i), max_size=5)),
    st.tuples(st.sampled_from([0, 1, 2, "x", 0.5, 1.0, [0]]), st.integers(1, 3000), st.integers(1, 3000)).map(
        lambda t: [[t[0]] * t[1]] * t[2]),  # long lists, referenced many times
    st.integers(1, 200).map(lambda depth: _deep(depth)),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=3),
)


def _deep(depth: int) -> list:
    value: list = [0]
    for _ in range(depth):
        value = [value]
    return value


METADATA_KEYS = [("data", "epoch"), ("data", "step"), ("data", "device_mapping"),
                 ("data", "device_mapping", "embedding"), ("config", "hash_indices"),
                 ("config", "bottom_features_ordered"), ("config", "interaction_op"), ("config",), ("data",), ()]


def set_metadata(path: str, keys: tuple, value) -> None:
    meta = torch.load(os.path.join(path, "metadata.pt"), weights_only=True)
    if not keys:
        meta = value
    else:
        node = meta
        for key in keys[:-1]:
            node = node[key]
        node[keys[-1]] = value
    torch.save(meta, os.path.join(path, "metadata.pt"))


def odd_tensor(base: torch.Tensor, kind: str) -> torch.Tensor:
    """``base`` made hostile in one way."""
    if kind == "expanded":
        return torch.zeros(1).expand(*base.shape)
    if kind == "huge_expanded":
        return torch.zeros(1).expand(10 ** 8, *base.shape[1:])
    if kind == "transposed" and base.dim() == 2:
        return base.t().contiguous().t()
    if kind == "view":
        return torch.cat([base.flatten(), torch.zeros(7)])[:base.numel()].view(base.shape)
    if kind in ("float64", "float16", "int64", "bool"):
        return base.to(getattr(torch, kind))
    if kind in ("nan", "inf"):
        out = base.clone()
        out.view(-1)[0] = float(kind)
        return out
    if kind == "wider":
        return torch.zeros(*base.shape[:-1], base.shape[-1] + 1)
    if kind == "scalar":
        return torch.tensor(1.0)
    return base


TENSOR_KINDS = ["expanded", "huge_expanded", "transposed", "view", "float64", "float16", "int64", "bool", "nan", "inf",
                "wider", "scalar"]


def set_tensor(path: str, file: str, key: str, index: int, kind: str) -> None:
    state = torch.load(os.path.join(path, file), weights_only=True)
    if file == "top_model.out.pt":
        state[key] = odd_tensor(state[key], kind)
    else:
        index %= len(state[key])
        state[key][index] = odd_tensor(state[key][index], kind)
    torch.save(state, os.path.join(path, file))


def edit_bytes(path: str, name: str, op: str, at: int, data: bytes) -> None:
    file = os.path.join(path, name)
    raw = bytearray(open(file, "rb").read())
    at %= max(len(raw), 1)
    if op == "truncate":
        raw = raw[:at]
    elif op == "set":
        raw[at:at + len(data)] = data
    else:
        raw += data
    open(file, "wb").write(bytes(raw))


FILES = ["metadata.pt", "bottom_model.mlp.pt", "top_model.mlp.pt", "top_model.out.pt", "embeddings.1.meta.pt",
         "bottom_model.embeddings.2.bin"]
CORRUPTION = st.one_of(
    st.tuples(st.just("metadata"), st.sampled_from(METADATA_KEYS), HOSTILE),
    st.tuples(st.just("tensor"), st.sampled_from([("bottom_model.mlp.pt", "weights"), ("bottom_model.mlp.pt", "biases"),
                                                  ("top_model.mlp.pt", "weights"), ("top_model.out.pt", "weight"),
                                                  ("top_model.out.pt", "bias")]),
              st.tuples(st.integers(0, 3), st.sampled_from(TENSOR_KINDS))),
    st.tuples(st.just("shape"), st.integers(0, 2), HOSTILE),
    st.tuples(st.just("table_value"), st.integers(0, 2), st.tuples(st.integers(0, 27), st.sampled_from(
        [float("nan"), float("inf"), -float("inf"), 1e30, 0.0]))),
    st.tuples(st.just("missing"), st.sampled_from(FILES + ["bottom_model.embeddings.0.bin", "embeddings.2.meta.pt"]),
              st.none()),
    st.tuples(st.just("extra"), st.sampled_from(["notes.txt", "bottom_model.embeddings.3.bin", "embeddings.7.meta.pt",
                                                 "model.pt", ".hidden", "dlrm_checksums.json"]),
              st.binary(max_size=16)),
    st.tuples(st.just("bytes"), st.sampled_from(FILES),
              st.tuples(st.sampled_from(["truncate", "set", "append"]), st.integers(0, 10 ** 6),
                        st.binary(min_size=1, max_size=8))),
)


def corrupt(path: str, corruption) -> None:
    what, target, arg = corruption
    if what == "metadata":
        set_metadata(path, target, arg)
    elif what == "tensor":
        set_tensor(path, *target, *arg)
    elif what == "shape":
        torch.save({"shape": arg}, os.path.join(path, f"embeddings.{target}.meta.pt"))
    elif what == "table_value":
        values = np.fromfile(os.path.join(path, f"bottom_model.embeddings.{target}.bin"), dtype="<f4")
        values[arg[0] % len(values)] = arg[1]
        values.tofile(os.path.join(path, f"bottom_model.embeddings.{target}.bin"))
    elif what == "missing":
        os.remove(os.path.join(path, target))
    elif what == "extra":
        open(os.path.join(path, target), "wb").write(arg)
    else:
        edit_bytes(path, target, *arg)


# ----------------------------------------------------------------------------- the independent reference


def on_disk(path: str):
    """What the files hold, read without the code under test (for a checkpoint it accepted)."""
    meta = torch.load(os.path.join(path, "metadata.pt"), weights_only=True)
    tables = []
    for i in range(len(TABLES)):
        shape = list(torch.load(os.path.join(path, f"embeddings.{i}.meta.pt"), weights_only=True)["shape"])
        values = np.fromfile(os.path.join(path, f"bottom_model.embeddings.{i}.bin"), dtype="<f4")
        tables.append(torch.from_numpy(values.reshape(shape)))
    mlps = {name: torch.load(os.path.join(path, name), weights_only=True)
            for name in ("bottom_model.mlp.pt", "top_model.mlp.pt")}
    out = torch.load(os.path.join(path, "top_model.out.pt"), weights_only=True)
    return meta, tables, mlps, out


def check_equal(path: str) -> None:
    """``read``, ``read_rows`` and ``load`` give exactly what the files hold."""
    ckpt = nvidia_checkpoint.read(path)
    meta, tables, mlps, out = on_disk(path)
    data = meta["data"]  # a step or epoch left out (None) counts as 0
    assert ckpt.step == (data.get("step") or 0) and ckpt.epoch == (data.get("epoch") or 0)
    for index, table in enumerate(tables):
        assert torch.equal(nvidia_checkpoint.read_rows(ckpt, index, 0, table.shape[0]), table)
    for layers, name in ((ckpt.bottom, "bottom_model.mlp.pt"), (ckpt.top[:-1], "top_model.mlp.pt")):
        state = mlps[name]
        assert len(layers) == len(state["weights"])
        for (w, b), want_w, want_b in zip(layers, state["weights"], state["biases"]):
            assert torch.equal(w, want_w.float()) and torch.equal(b, want_b.float())
    assert torch.equal(ckpt.top[-1][0], out["weight"].float()) and torch.equal(ckpt.top[-1][1], out["bias"].float())
    model = DLRM(ckpt.model_config(), device="cpu")
    assert nvidia_checkpoint.load(path, model)["step"] == ckpt.step
    for layer, (w, b) in zip(model.bottom_mlp.layers, ckpt.bottom):
        assert torch.equal(layer.weight.detach(), w) and torch.equal(layer.bias.detach(), b)
    for module, i in nvidia_checkpoint.local_tables(model):
        start, stop = module.row_range(i)
        assert torch.equal(module.table_weight(i).detach().float(), tables[module.table_indices[i]][start:stop])


@FUZZ
@given(corruption=CORRUPTION)
def test_a_corrupted_checkpoint_loads_as_written_or_is_refused_in_one_line(template, corruption):
    root = tempfile.mkdtemp(dir=os.path.dirname(template))
    try:
        path = os.path.join(root, "nv")
        shutil.copytree(template, path)
        corrupt(path, corruption)
        start = time.monotonic()
        try:
            check_equal(path)
            event("loaded")
        except CheckpointError as e:
            message = str(e)
            assert message and "\n" not in message and len(message) < 500, message[:1000]
            event("refused")
        assert time.monotonic() - start < SECONDS
    finally:
        shutil.rmtree(root)


def test_the_template_itself_loads(template):
    check_equal(template)
