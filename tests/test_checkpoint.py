import os
import pickle

import pytest
import torch

from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.training.checkpoint import CheckpointError, TrainState, load_checkpoint, read_meta, save_checkpoint
from dlrm.training.precision import Precision
from dlrm.training.train import make_optimizer


def small_config(**overrides) -> DLRMConfig:
    cfg = dict(num_numerical_features=3, table_sizes=[5, 17, 2], embedding_dim=8,
               bottom_mlp_sizes=[16, 8], top_mlp_sizes=[16, 1])
    cfg.update(overrides)
    return DLRMConfig(**cfg)


def params_equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


@pytest.mark.parametrize("src_type,dst_type", [("joint", "joint"), ("joint", "multi_table"), ("multi_table", "joint")])
def test_round_trip_across_embedding_types(tmp_path, src_type, dst_type):
    torch.manual_seed(0)
    src = DLRM(small_config(embedding_type=src_type))
    state = TrainState(step=7, epoch=1, batch_in_epoch=3, best_auc=0.71)
    save_checkpoint(str(tmp_path / "ckpt"), src, make_optimizer(src, 0.1), None, state, {"lr": 0.1})
    torch.manual_seed(1)
    dst = DLRM(small_config(embedding_type=dst_type))
    loaded = load_checkpoint(str(tmp_path / "ckpt"), dst)
    assert loaded == state
    x, ids = torch.randn(4, 3), torch.tensor([[0, 16, 1], [4, 0, 0], [2, 3, 1], [1, 9, 0]])
    torch.testing.assert_close(dst(x, ids), src(x, ids), rtol=0, atol=0)
    for i in range(3):
        assert torch.equal(dst.embeddings.table_weight(i), src.embeddings.table_weight(i))


def test_table_files_hold_only_their_table(tmp_path):
    model = DLRM(small_config(table_sizes=[1000, 3]))
    save_checkpoint(str(tmp_path / "c"), model, None, None, TrainState())
    small = os.path.getsize(tmp_path / "c" / "table_1.pt")
    big = os.path.getsize(tmp_path / "c" / "table_0.pt")
    assert small < 3000 < 1000 * 8 * 4 <= big  # a view would have serialised the whole joint storage


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (dict(embedding_dim=4, bottom_mlp_sizes=[16, 4]), "embedding table 0"),
        (dict(table_sizes=[5, 18, 2]), "embedding table 1"),
        (dict(table_sizes=[5, 17]), "3 embedding tables, the model has 2"),
        (dict(top_mlp_sizes=[32, 1]), "top_mlp.layers.0.weight"),
        (dict(bottom_mlp_sizes=[12, 8]), "bottom_mlp.layers.0.weight"),
        (dict(top_mlp_sizes=[16, 16, 1]), "missing"),
    ],
)
def test_other_model_shape_is_refused_naming_the_tensor(tmp_path, overrides, needle):
    save_checkpoint(str(tmp_path / "c"), DLRM(small_config()), None, None, TrainState())
    other = DLRM(small_config(**overrides))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(str(tmp_path / "c"), other)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())  # untouched


def test_overwrite_keeps_a_complete_checkpoint_and_no_temp(tmp_path):
    path = str(tmp_path / "c")
    m = DLRM(small_config())
    save_checkpoint(path, m, None, None, TrainState(step=1))
    save_checkpoint(path, m, None, None, TrainState(step=2))
    assert read_meta(path)["train_state"]["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_failed_save_leaves_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    m = DLRM(small_config())
    save_checkpoint(path, m, None, None, TrainState(step=1))
    import dlrm.training.checkpoint as ck

    calls = {"n": 0}
    real = ck._save_tensor_file

    def failing(obj, file):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        real(obj, file)

    monkeypatch.setattr(ck, "_save_tensor_file", failing)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, m, None, None, TrainState(step=2))
    assert read_meta(path)["train_state"]["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_interrupted_swap_points_to_old(tmp_path):
    path = str(tmp_path / "c")
    save_checkpoint(path, DLRM(small_config()), None, None, TrainState(step=1))
    os.rename(path, path + ".old")  # as if the process died between the two renames
    with pytest.raises(CheckpointError, match=r"c\.old"):
        load_checkpoint(path, DLRM(small_config()))


def test_truncated_file_is_detected(tmp_path):
    path = str(tmp_path / "c")
    save_checkpoint(path, DLRM(small_config()), None, None, TrainState())
    with open(os.path.join(path, "table_1.pt"), "r+b") as f:
        f.truncate(10)
    with pytest.raises(CheckpointError, match="table_1.pt.*damaged"):
        load_checkpoint(path, DLRM(small_config()))


class _Exploit:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_loading_never_executes_code(tmp_path):
    path = str(tmp_path / "c")
    save_checkpoint(path, DLRM(small_config()), None, None, TrainState())
    # Replace dense.pt by a pickle that would run a command if unpickled without weights_only.
    with open(os.path.join(path, "dense.pt"), "wb") as f:
        torch.save({"x": _Exploit()}, f, pickle_module=pickle)
    meta_path = os.path.join(path, "meta.json")
    import json

    meta = json.load(open(meta_path))
    meta["files"]["dense.pt"] = os.path.getsize(os.path.join(path, "dense.pt"))
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path, DLRM(small_config()))


def test_scaler_and_optimizer_state_round_trip(tmp_path):
    m = DLRM(small_config())
    opt = make_optimizer(m, 0.5)
    scaler = Precision("cpu", torch.float16).grad_scaler(init_scale=1024.0)
    save_checkpoint(str(tmp_path / "c"), m, opt, scaler, TrainState())
    m2 = DLRM(small_config())
    opt2 = make_optimizer(m2, 0.1)
    scaler2 = Precision("cpu", torch.float16).grad_scaler(init_scale=1.0)
    load_checkpoint(str(tmp_path / "c"), m2, opt2, scaler2)
    assert scaler2.get_scale() == 1024.0
    assert [g["lr"] for g in opt2.param_groups] == [0.5, 0.5]


def test_optimizer_of_another_layout_restores_hyperparameters(tmp_path):
    """joint -> multi_table changes the embedding group's parameter count; SGD has no state to lose."""
    src = DLRM(small_config(embedding_type="joint"))
    opt = make_optimizer(src, 0.25)
    save_checkpoint(str(tmp_path / "c"), src, opt, None, TrainState())
    dst = DLRM(small_config(embedding_type="multi_table"))
    opt2 = make_optimizer(dst, 9.0)
    load_checkpoint(str(tmp_path / "c"), dst, opt2)
    assert [g["lr"] for g in opt2.param_groups] == [0.25, 0.25]
    assert [len(g["params"]) for g in opt2.param_groups] == [len(dst.dense_parameters()), 3]
