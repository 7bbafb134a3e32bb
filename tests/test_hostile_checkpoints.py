"""Checkpoints of this program's layout that are sealed (sizes and checksums in meta.json match
their bytes) but hold what no writer of this program writes: NaN or inf weights, and tensors
whose shape promises more than the file holds (zero strides). Each is refused before it is used,
in one line naming the file and the tensor (exit 2 at the command line), for DLRM (test,
inference benchmark, training from a checkpoint, resume, export, quantized serving), the wide
model and the recommender; export's own check fails on NaN outputs; quantizing refuses NaN tables.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from conftest import REPO, run_entry_points
from dlrm.engine import checkpoint_store as store
from dlrm.engine.checkpoint_store import CheckpointError, file_crc32
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.training.checkpoint import TrainState, load_checkpoint, save_checkpoint

# What ``main`` builds from these flags, and the checkpoint written for it in-process.
TINY = ["--synthetic_dataset_table_sizes", "30,40", "--synthetic_dataset_num_entries", "2048",
        "--synthetic_dataset_num_test_entries", "1024", "--batch_size", "256", "--test_batch_size", "512",
        "--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "16,1", "--base_device", "cpu",
        "--warmup_steps", "0", "--decay_steps", "0"]
CONFIG = dict(num_numerical_features=13, table_sizes=[30, 40], embedding_dim=8, bottom_mlp_sizes=[16, 8],
              top_mlp_sizes=[16, 1])


def reseal(path: str, *names: str) -> None:
    """Writes the size and CRC-32 of each named file into ``meta.json``, as if saved so: the
    checks past the checksum are what is tested."""
    meta_path = os.path.join(path, store.META)
    with open(meta_path) as f:
        meta = json.load(f)
    for name in names:
        file = os.path.join(path, name)
        meta["files"][name] = {"bytes": os.path.getsize(file), "crc32": file_crc32(file)}
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def replace_tensor(path: str, name: str, change) -> None:
    """``change(obj)`` of what tensor file ``name`` holds (returns the new content), resealed."""
    file = os.path.join(path, name)
    torch.save(change(torch.load(file, weights_only=True)), file)
    reseal(path, name)


def _nan_table(obj):
    obj[3, 1] = float("nan")
    return obj


def _inf_mlp(obj):
    obj["bottom_mlp.layers.0.weight"][0, 0] = float("inf")
    return obj


def _zero_stride(obj):
    return torch.zeros(1).expand(10 ** 8, 13)  # 2.4 KB on disk, 5.2 GB once copied


HOSTILE = {"nan_table": ("table_0.pt", _nan_table, ["table_0.pt", "non-finite"]),
           "inf_mlp": ("dense.pt", _inf_mlp, ["dense.pt", "non-finite"]),
           "zero_stride": ("table_1.pt", _zero_stride, ["table_1.pt", "not a dense tensor"])}


@pytest.fixture(scope="module")
def dlrm_checkpoints(tmp_path_factory):
    """name -> a sealed DLRM checkpoint for TINY's model: "clean", and one per HOSTILE entry."""
    root = tmp_path_factory.mktemp("hostile_ckpt")
    torch.manual_seed(0)
    clean = str(root / "clean")
    save_checkpoint(clean, DLRM(DLRMConfig(**CONFIG)), None, None, TrainState())
    made = {"clean": clean}
    for name, (file, change, _) in HOSTILE.items():
        made[name] = str(root / name)
        shutil.copytree(clean, made[name])
        replace_tensor(made[name], file, change)
    return made


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_load_refuses_in_one_line_naming_file_and_tensor(dlrm_checkpoints, name):
    start = time.monotonic()
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(dlrm_checkpoints[name], DLRM(DLRMConfig(**CONFIG)))
    message = str(refused.value)
    assert all(needle in message for needle in HOSTILE[name][2]) and "\n" not in message and len(message) < 500
    assert time.monotonic() - start < 5  # refused before anything of the promised 5 GB is allocated


def run_cases(tmp_path, module: str, cases: list[list[str]]) -> list[dict]:
    """Each case as ``python -m module args`` (tests/entry_point_runner.py: one start, a fork each)."""
    return run_entry_points(module, cases, tmp_path, preload=("dlrm.inference.export", "dlrm.training.train"))


def _one_line_exit_2(result: dict, *needles: str) -> None:
    lines = result["stderr"].strip().splitlines()
    assert result["returncode"] == 2 and len(lines) == 1, (result["returncode"], result["stderr"][-2000:])
    assert len(lines[0]) < 500 and all(n in lines[0] for n in needles), lines[0]


def test_every_command_that_reads_weights_refuses_them(dlrm_checkpoints, tmp_path):
    """R5/R7 at the command line: before, `--mode test` printed `auc 0.49 loss nan`, exit 0.
    Each command meets one kind (every kind is met by the load itself above)."""
    resumed = str(tmp_path / "resumed")
    shutil.copytree(dlrm_checkpoints["inf_mlp"], resumed)
    cases = {
        "nan_table": [[*TINY, "--mode", "test", "--load_checkpoint_path", dlrm_checkpoints["nan_table"]],
                      [*TINY, "--mode", "inference_benchmark", "--load_checkpoint_path", dlrm_checkpoints["nan_table"],
                       "--inference_benchmark_steps", "2"]],
        "inf_mlp": [[*TINY, "--mode", "test", "--load_checkpoint_path", dlrm_checkpoints["inf_mlp"],
                     "--quantize_tables", "int8"],
                    [*TINY, "--save_checkpoint_path", resumed, "--resume", "--epochs", "1", "--log_path", os.devnull]],
        "zero_stride": [[*TINY, "--load_checkpoint_path", dlrm_checkpoints["zero_stride"], "--epochs", "1",
                         "--log_path", os.devnull]],
    }
    main_cases = [args for name in sorted(cases) for args in cases[name]]
    expected = [HOSTILE[name][2] for name in sorted(cases) for _ in cases[name]]
    main_cases.append([*TINY, "--mode", "test", "--load_checkpoint_path", dlrm_checkpoints["clean"]])
    results = run_cases(tmp_path, "dlrm.scripts.main", main_cases)
    assert results[-1]["returncode"] == 0 and "auc" in results[-1]["stdout"], results[-1]["stderr"][-2000:]
    for result, needles in zip(results, expected):
        _one_line_exit_2(result, *needles)
    out = tmp_path / "export"
    (exported,) = run_cases(tmp_path, "dlrm.scripts.export",
                            [["--checkpoint", dlrm_checkpoints["nan_table"], "--output", str(out)]])
    _one_line_exit_2(exported, *HOSTILE["nan_table"][2])
    assert not os.path.exists(out)


def test_export_check_fails_on_nan_outputs(tmp_path):
    """``check_export`` compared with ``error > tol``, which is False for NaN: a NaN model passed
    with "max abs error nan". The eager reference and the file are both NaN here."""
    from dlrm.inference.export import check_export, export_torchscript

    torch.manual_seed(0)
    model = DLRM(DLRMConfig(**CONFIG)).eval()
    with torch.no_grad():
        model.top_mlp.layers[0].weight[0, 0] = float("nan")
    path = str(tmp_path / "model.pt")
    export_torchscript(model, path)
    with pytest.raises(AssertionError, match="max abs error nan"):
        check_export(model, path, batch_sizes=(4,))


def test_quantizing_refuses_a_non_finite_table():
    from dlrm.inference.quantize import NonFiniteTableError, quantize_model

    model = DLRM(DLRMConfig(**CONFIG))
    with torch.no_grad():
        model.embeddings.load_table_(1, torch.full((40, 8), float("inf")))
    with pytest.raises(NonFiniteTableError, match="table 1 holds non-finite"):
        quantize_model(model, "int8")
    quantize_model(DLRM(DLRMConfig(**CONFIG)), "int8")  # a finite one still quantizes


def test_row_blocks_of_zero_strides_are_refused(tmp_path):
    """The row-block path (``read_rows``) of both products: a piece that is an expanded scalar."""
    path = str(tmp_path / "c")
    os.makedirs(path)
    torch.save(torch.zeros(1).expand(10 ** 7, 13), os.path.join(path, "w_rows_0_10000000.pt"))
    pieces = [(0, 10 ** 7, "w_rows_0_10000000.pt")]
    with pytest.raises(CheckpointError, match="not a dense tensor"):
        store.read_rows(path, pieces, (0, 10 ** 7))
    torch.save({"weight": torch.ones(1, 4).expand(10 ** 7, 4)}, os.path.join(path, "w_rows_0_10000000.pt"))
    with pytest.raises(CheckpointError, match=r"\['weight'\] is not a dense tensor"):
        store.read_rows(path, pieces, (5, 9))


def test_wide_model_refuses_nan_rows_and_a_non_tensor_bias(tmp_path):
    from dlrm.wide import checkpoint as wide
    from dlrm.wide.model import WideModel

    model = WideModel(50, seed=1)  # one process: rows [0, 50) in one file
    path = str(tmp_path / "wide")
    wide.save(path, model, wide.WideState())
    replace_tensor(path, "weight_rows_0_50.pt", lambda w: w.index_fill_(0, torch.tensor([7]), float("nan")))
    with pytest.raises(CheckpointError, match="weight_rows_0_50.pt: the tensor holds non-finite"):
        wide.load(path, WideModel(50, seed=2))
    replace_tensor(path, "weight_rows_0_50.pt", lambda w: torch.nan_to_num(w))
    replace_tensor(path, "replicated.pt", lambda r: {"bias": [1.0]})
    with pytest.raises(CheckpointError, match="replicated.pt: bias has shape"):
        wide.load(path, WideModel(50, seed=2))


def test_recommender_refuses_nan_weights_for_predict_and_evaluate(tmp_path):
    """``load_model`` (predict, evaluate, Spark) of an autoencoder checkpoint with one NaN weight."""
    from dlrm.recommender import checkpoint as autoencoder
    from dlrm.recommender.item_parallel import ItemParallel

    path = str(tmp_path / "ae")
    shutil.copytree(os.path.join(REPO, "tests", "fixtures", "checkpoints", "autoencoder_2_processes"), path)
    autoencoder.load_model(path, ItemParallel(0, 1))  # the fixture as it is loads

    def poison(piece):
        piece["weight"][19, 0] = float("nan")
        return piece

    replace_tensor(path, "output_rows_21_41.pt", poison)
    autoencoder.load_model(path, ItemParallel(0, 2))  # rows 0-20 of the output layer: not the poisoned ones
    with pytest.raises(CheckpointError, match=r"output_rows_21_41.pt: 'weight' holds non-finite"):
        autoencoder.load_model(path, ItemParallel(1, 2))


def test_a_checksum_in_meta_json_that_is_no_crc_is_not_quoted(tmp_path):
    """meta.json is read from the user's folder: a mismatch names the file, not a megabyte of its text."""
    from dlrm.engine.checkpoint_store import verify_checksums

    (tmp_path / "a.pt").write_bytes(b"data")
    meta = {"files": {"a.pt": {"bytes": 4, "crc32": "\x1b[2J" + "x" * 100_000}}}
    with pytest.raises(CheckpointError) as info:
        verify_checksums(str(tmp_path), meta, ["a.pt"])
    message = str(info.value)
    assert "a.pt: checksum" in message and "differs from the one it was saved with" in message
    assert len(message) < 300 and "\x1b" not in message and "\n" not in message
