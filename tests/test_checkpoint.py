import os
import pickle

import pytest
import torch

from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.checkpoint import (
    CheckpointError, CheckpointLock, TrainState, file_crc32, load_checkpoint, read_meta, save_checkpoint,
)
from dlrm.training.optimizers import make_optimizer
import warm_python


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
    state = TrainState(step=7, epoch=1, sample_in_epoch=3 * 64, batch_size=64, best_auc=0.71)
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
    import dlrm.engine.checkpoint_store as store

    calls = {"n": 0}
    real = store.save_tensor_file

    def failing(obj, file):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        return real(obj, file)

    monkeypatch.setattr(store, "save_tensor_file", failing)
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
    meta["files"]["dense.pt"] = {"bytes": os.path.getsize(os.path.join(path, "dense.pt")),
                                 "crc32": file_crc32(os.path.join(path, "dense.pt"))}
    json.dump(meta, open(meta_path, "w"))
    with pytest.raises(CheckpointError, match="dense.pt: holds objects other than tensors") as info:
        load_checkpoint(path, DLRM(small_config()))
    assert "weights_only=False" not in str(info.value)


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
    assert [len(g["params"]) for g in opt2.param_groups] == [len(dst.replicated_parameters()), 3]


def _flip_byte(file: str, offset: int) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_flipped_bytes_of_the_right_size_are_refused_unless_verification_is_skipped(tmp_path):
    path = str(tmp_path / "c")
    src = DLRM(small_config())
    save_checkpoint(path, src, None, None, TrainState())
    table = os.path.join(path, "table_1.pt")
    offset = open(table, "rb").read().index(src.embeddings.table_weight(1).detach().numpy().tobytes())
    _flip_byte(table, offset + 5)  # inside the tensor data: torch.load alone would not notice
    dst = DLRM(small_config())
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"table_1.pt: checksum [0-9a-f]{8} differs"):
        load_checkpoint(path, dst)
    assert all(torch.equal(before[k], v) for k, v in dst.state_dict().items())  # untouched
    load_checkpoint(path, dst, verify=False)  # the escape hatch loads the damaged weights as they are
    assert not torch.equal(dst.embeddings.table_weight(1), src.embeddings.table_weight(1))


def test_checksum_matches_an_independent_crc(tmp_path):
    import zlib

    path = str(tmp_path / "c")
    save_checkpoint(path, DLRM(small_config()), None, None, TrainState())
    meta = read_meta(path)
    for name, entry in meta["files"].items():
        if name != "meta.json":
            data = open(os.path.join(path, name), "rb").read()
            assert entry == {"bytes": len(data), "crc32": f"{zlib.crc32(data):08x}"}, name


def _edit_meta(path: str, edit) -> None:
    import json

    meta_path = os.path.join(path, "meta.json")
    meta = json.load(open(meta_path))
    edit(meta)
    json.dump(meta, open(meta_path, "w"))


def _truncate_meta(path):
    data = open(os.path.join(path, "meta.json"), "rb").read()
    open(os.path.join(path, "meta.json"), "wb").write(data[: len(data) // 2])


def _drop_key(path):
    _edit_meta(path, lambda m: m.pop("files"))


def _not_utf8_meta(path):
    open(os.path.join(path, "meta.json"), "wb").write(b"\xff\xfe{}")


def _truncated_table_with_patched_size(path):
    table = os.path.join(path, "table_0.pt")
    with open(table, "r+b") as f:
        f.truncate(os.path.getsize(table) // 2)
    _edit_meta(path, lambda m: m["files"].update({"table_0.pt": {"bytes": os.path.getsize(table)}}))


def _garbage_dense(path):
    dense = os.path.join(path, "dense.pt")
    with open(dense, "wb") as f:
        f.write(b"not a torch file at all")
    _edit_meta(path, lambda m: m["files"].update({"dense.pt": os.path.getsize(dense)}))


def _wrong_train_state(path):
    _edit_meta(path, lambda m: m["train_state"].update({"bogus": 1}))


@pytest.mark.parametrize("damage,needle", [
    (_truncate_meta, r"meta.json: not readable as JSON"),
    (_not_utf8_meta, r"meta.json: not readable as JSON"),
    (_drop_key, r"meta.json: entry 'files' is missing"),
    (_truncated_table_with_patched_size, r"table_0.pt: cannot be read"),
    (_garbage_dense, r"dense.pt: cannot be read"),
    (_wrong_train_state, r"train_state is damaged"),
])
def test_damaged_checkpoints_raise_checkpoint_errors_naming_the_file(tmp_path, damage, needle):
    path = str(tmp_path / "c")
    save_checkpoint(path, DLRM(small_config()), None, None, TrainState())
    damage(path)
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(path, DLRM(small_config()))


def test_checkpoint_of_the_batch_position_format_still_loads(tmp_path):
    """Checkpoints written before positions were kept in samples stored ``batch_in_epoch``."""
    path = str(tmp_path / "c")
    save_checkpoint(path, DLRM(small_config()), None, None, TrainState(step=5, epoch=1), {"batch_size": 256})

    def old_format(meta):
        meta["train_state"] = {"step": 5, "epoch": 1, "batch_in_epoch": 3, "best_auc": None}

    _edit_meta(path, old_format)
    state = load_checkpoint(path, DLRM(small_config()))
    assert (state.step, state.epoch, state.sample_in_epoch, state.batch_size) == (5, 1, 768, 256)


def test_lock_refuses_a_second_holder_and_dies_with_its_process(tmp_path):
    import subprocess
    import sys

    path = str(tmp_path / "c")
    holder = warm_python.Popen(
        [sys.executable, "-c", "import sys, time; from dlrm.training.checkpoint import CheckpointLock; "
         f"CheckpointLock({path!r}).acquire(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(CheckpointError, match=rf"another run \(pid {holder.pid} on .*\) is saving checkpoints"):
            CheckpointLock(path).acquire()
        with pytest.raises(CheckpointError, match=r"give this run its own `checkpoint_path`"):
            CheckpointLock(path, setting="checkpoint_path").acquire()  # a product whose setting has another name
    finally:
        holder.kill()  # like kill -9: no cleanup runs in the holder
        holder.wait()
    with CheckpointLock(path):  # the kernel dropped the dead holder's lock
        assert os.path.exists(path + ".lock")
    assert not os.path.exists(path + ".lock")
