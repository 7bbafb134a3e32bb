"""Exported files run in ONNX Runtime / torch.jit.load and match the eager model's probabilities."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from dlrm.inference.export import (  # noqa: E402
    ExportableDLRM,
    build_inference_model,
    check_export,
    export_onnx,
    export_torchscript,
)
from dlrm.model.dlrm import DLRM, DLRMConfig  # noqa: E402
from dlrm.training.checkpoint import CheckpointError, TrainState, save_checkpoint  # noqa: E402
import warm_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TABLES = [5, 300, 17, 2]
BATCH_SIZES = (1, 64, 4096)
# torch.jit is deprecated in recent torch, and still what TorchScript servers load.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
VARIANTS = [(e, i) for e in ("joint", "multi_table") for i in ("dot", "cat")]


def make_config(embedding_type: str, interaction_op: str, hash_indices: bool = False) -> DLRMConfig:
    return DLRMConfig(
        num_numerical_features=3, table_sizes=list(TABLES), embedding_dim=8, bottom_mlp_sizes=[16, 8],
        top_mlp_sizes=[32, 16, 1], interaction_op=interaction_op, embedding_type=embedding_type,
        hash_indices=hash_indices,
    )


def trained_model(config: DLRMConfig) -> DLRM:
    """A model whose weights no fresh initialisation reproduces, so a test sees whether the
    exported weights really came from the checkpoint."""
    torch.manual_seed(0)
    model = DLRM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def random_inputs(batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    numerical = torch.randn(batch_size, 3, generator=g)
    categorical = torch.stack([torch.randint(0, rows, (batch_size,), generator=g) for rows in TABLES], dim=1)
    return numerical, categorical


def expected_probability(model: DLRM, numerical: torch.Tensor, categorical: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return torch.sigmoid(model(numerical, categorical)).numpy()


def run_onnx(path: str, numerical: torch.Tensor, categorical: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feeds = {"numerical": numerical.numpy(), "categorical": categorical.numpy()}
    return session.run(["click_probability"], feeds)[0]


def run_torchscript(path: str, numerical: torch.Tensor, categorical: torch.Tensor) -> np.ndarray:
    with torch.no_grad():
        return torch.jit.load(path)(numerical, categorical).numpy()


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Per variant: the reference model, and both formats exported from its checkpoint."""
    out = {}
    for embedding_type, interaction_op in VARIANTS:
        root = tmp_path_factory.mktemp(f"{embedding_type}_{interaction_op}")
        model = trained_model(make_config(embedding_type, interaction_op))
        save_checkpoint(str(root / "ckpt"), model, None, None, TrainState(step=3))
        loaded = build_inference_model(str(root / "ckpt"))
        export_onnx(loaded, str(root / "export" / "model.onnx"))
        export_torchscript(loaded, str(root / "export" / "model.pt"))
        out[embedding_type, interaction_op] = (model, root / "export")
    return out


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_exported_file_matches_eager_sigmoid(exported, variant, fmt):
    model, directory = exported[variant]
    path = str(directory / ("model.onnx" if fmt == "onnx" else "model.pt"))
    run = run_onnx if fmt == "onnx" else run_torchscript
    for batch_size in BATCH_SIZES:
        numerical, categorical = random_inputs(batch_size, seed=batch_size + 1)
        got = run(path, numerical, categorical)
        want = expected_probability(model, numerical, categorical)
        assert got.shape == (batch_size, 1) and got.dtype == np.float32
        np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-6)
    assert 0.05 < want.std()  # probabilities that actually vary: a constant output would not pass above


def test_build_inference_model_restores_config_and_weights(exported):
    model, directory = exported["multi_table", "dot"]
    loaded = build_inference_model(str(directory.parent / "ckpt"))
    assert not loaded.training
    assert loaded.config == model.config
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_build_inference_model_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="No checkpoint"):
        build_inference_model(str(tmp_path / "nothing"))


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(v))
def test_onnx_graph_has_dynamic_batch_and_plain_gathers(exported, variant):
    graph = onnx.load(str(exported[variant][1] / "model.onnx")).graph
    onnx.checker.check_model(onnx.load(str(exported[variant][1] / "model.onnx")))
    assert [i.name for i in graph.input] == ["numerical", "categorical"]
    assert [o.name for o in graph.output] == ["click_probability"]
    for value in [*graph.input, *graph.output]:
        first = value.type.tensor_type.shape.dim[0]
        assert first.dim_param and not first.HasField("dim_value"), value.name
    assert [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim[1:]] == [3]
    assert [d.dim_value for d in graph.input[1].type.tensor_type.shape.dim[1:]] == [len(TABLES)]
    ops = {node.op_type for node in graph.node}
    assert "Gather" in ops
    assert not ops & {"Loop", "Scan", "If", "SequenceInsert", "SequenceAt"}, ops


def test_hash_indices_modulo_is_kept(tmp_path):
    model = trained_model(make_config("joint", "dot", hash_indices=True))
    export_onnx(model, str(tmp_path / "model.onnx"))
    export_torchscript(model, str(tmp_path / "model.pt"))
    g = torch.Generator().manual_seed(5)
    numerical = torch.randn(32, 3, generator=g)
    categorical = torch.randint(-1000, 1000, (32, len(TABLES)), generator=g)
    # Floor modulo written out independently of the model: Python's % on each id.
    wrapped = torch.tensor([[v % TABLES[j] for j, v in enumerate(row)] for row in categorical.tolist()])
    plain = DLRM(make_config("joint", "dot"))
    plain.load_state_dict(model.state_dict())
    want = expected_probability(plain.eval(), numerical, wrapped)
    for run, name in ((run_onnx, "model.onnx"), (run_torchscript, "model.pt")):
        np.testing.assert_allclose(run(str(tmp_path / name), numerical, categorical)[:, 0], want, rtol=1e-5, atol=1e-6)


def test_files_are_single_and_leave_no_temporaries(exported):
    directory = exported["joint", "dot"][1]
    assert sorted(os.listdir(directory)) == ["model.onnx", "model.pt"]
    proto = onnx.load(str(directory / "model.onnx"), load_external_data=False)
    assert proto.graph.initializer
    assert all(t.data_location != onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)


@pytest.mark.parametrize("fmt", ["onnx", "torchscript"])
def test_failed_export_keeps_previous_file(tmp_path, monkeypatch, fmt):
    model = trained_model(make_config("joint", "dot"))
    path = tmp_path / ("model.onnx" if fmt == "onnx" else "model.pt")
    export = export_onnx if fmt == "onnx" else export_torchscript
    export(model, str(path))
    before = path.read_bytes()

    def broken_writer(*args, **kwargs):
        target = args[2] if fmt == "onnx" else args[1]  # export(model, inputs, f) / save(module, f)
        with open(target, "wb") as out:
            out.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(*((torch.onnx, "export") if fmt == "onnx" else (torch.jit, "save")), broken_writer)
    with pytest.raises(OSError, match="disk full"):
        export(model, str(path))
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == [path.name]


def test_export_killed_mid_write_leaves_a_temporary_the_next_export_removes(tmp_path):
    """``kill -9`` while ``python -m dlrm.scripts.export`` writes model.onnx leaves its temporary
    file (nothing can remove it then); the next export to the same path removes it."""
    model = trained_model(make_config("joint", "dot"))
    save_checkpoint(str(tmp_path / "ckpt"), model, None, None, TrainState())
    out = tmp_path / "out"
    child = warm_python.Popen(
        [sys.executable, "-m", "dlrm.scripts.export", f"--checkpoint={tmp_path / 'ckpt'}", f"--output={out}",
         "--format=onnx"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 240
        while not (out.is_dir() and any(n.endswith(".tmp") for n in os.listdir(out))):
            assert child.poll() is None and time.monotonic() < deadline, "the export never started writing"
            time.sleep(0.01)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert [n for n in os.listdir(out) if n.startswith(".model.onnx.")], os.listdir(out)
    export_onnx(model, str(out / "model.onnx"))
    assert os.listdir(out) == ["model.onnx"]


def test_check_export_reports_errors_and_catches_a_wrong_model(exported):
    model, directory = exported["joint", "cat"]
    for name in ("model.onnx", "model.pt"):
        errors = check_export(model, str(directory / name), batch_sizes=(1, 64))
        assert set(errors) == {1, 64} and all(0 <= e <= 1e-5 for e in errors.values())
    other = trained_model(make_config("joint", "cat"))
    with torch.no_grad():
        other.top_mlp.layers[-1].bias.add_(0.01)
    for name in ("model.onnx", "model.pt"):
        with pytest.raises(AssertionError, match="max abs error"):
            check_export(other, str(directory / name), batch_sizes=(8,))


ALL_LAYOUTS = [(e, i) for e in ("joint", "multi_table", "joint_fused") for i in ("dot", "cat", "cuda_dot")]


@pytest.mark.parametrize("variant", ALL_LAYOUTS, ids=lambda v: "-".join(v))
def test_every_layout_exports_the_model_forward(tmp_path, variant):
    """The files hold ``DLRM.forward`` itself for every embedding layout and interaction: they
    match the eager model (whose fused kernels run in Triton's interpreter here) at several
    batch sizes, hashed ids included, and the graph is plain gathers."""
    model = trained_model(make_config(*variant, hash_indices=True))
    export_onnx(model, str(tmp_path / "model.onnx"))
    export_torchscript(model, str(tmp_path / "model.pt"))
    ops = {node.op_type for node in onnx.load(str(tmp_path / "model.onnx")).graph.node}
    assert "Gather" in ops and not ops & {"Loop", "Scan", "If"}, ops
    g = torch.Generator().manual_seed(11)
    for batch_size in (1, 64):
        numerical = torch.randn(batch_size, 3, generator=g)
        categorical = torch.randint(-1000, 1000, (batch_size, len(TABLES)), generator=g)
        want = expected_probability(model, numerical, categorical)
        for run, name in ((run_onnx, "model.onnx"), (run_torchscript, "model.pt")):
            got = run(str(tmp_path / name), numerical, categorical)
            np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-6)


def test_wrapper_rejects_a_hybrid_parallel_shard():
    shard = DLRM(make_config("joint", "dot"), tables=[0, 2])
    with pytest.raises(ValueError, match="all of its tables"):
        ExportableDLRM(shard)


def test_script_exports_and_prints_errors(tmp_path, cli):
    model = trained_model(make_config("multi_table", "dot"))
    save_checkpoint(str(tmp_path / "ckpt"), model, None, None, TrainState())
    out = tmp_path / "served"
    proc = cli("dlrm.scripts.export", f"--checkpoint={tmp_path / 'ckpt'}", f"--output={out}")
    assert sorted(os.listdir(out)) == ["model.onnx", "model.pt"]
    for fmt in ("onnx", "torchscript"):
        for batch_size in BATCH_SIZES:
            assert f"{fmt} batch {batch_size}: max abs error" in proc.stdout, proc.stdout
    # The exporter's own chatter (an opset converted down "may not be successful", torchvision
    # operators skipped) is silenced: the file is checked against the eager model instead.
    assert proc.stderr.strip() == "", proc.stderr
    assert "may not be successful" not in proc.stdout and "torchvision" not in proc.stdout, proc.stdout
    numerical, categorical = random_inputs(16, seed=9)
    np.testing.assert_allclose(
        run_onnx(str(out / "model.onnx"), numerical, categorical)[:, 0],
        expected_probability(model, numerical, categorical), rtol=1e-5, atol=1e-6,
    )


def test_script_errors(tmp_path, cli):
    proc = cli("dlrm.scripts.export", f"--checkpoint={tmp_path / 'none'}", f"--output={tmp_path / 'out'}", check=False)
    assert proc.returncode != 0 and "No checkpoint" in proc.stderr
    proc = cli("dlrm.scripts.export", f"--checkpoint={tmp_path}", f"--output={tmp_path / 'out'}", "--format=onnx,tflite",
               check=False)
    assert proc.returncode != 0 and "tflite" in proc.stderr
    assert os.listdir(tmp_path) == []


def test_float16_numerical_input(tmp_path):
    """``numerical_dtype=float16``: the ONNX input is float16 (what datasets store), the file
    matches eager on the same (rounded) values at every checked batch size."""
    model = trained_model(make_config("joint", "dot"))
    path = str(tmp_path / "model.onnx")
    export_onnx(model, path, numerical_dtype=torch.float16)
    graph = onnx.load(path).graph
    assert graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert graph.input[1].type.tensor_type.elem_type == onnx.TensorProto.INT64
    for batch_size in BATCH_SIZES:
        numerical, categorical = random_inputs(batch_size, seed=batch_size + 7)
        numerical = numerical.half()
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        got = session.run(None, {"numerical": numerical.numpy(), "categorical": categorical.numpy()})[0]
        np.testing.assert_allclose(got[:, 0], expected_probability(model, numerical.float(), categorical),
                                   rtol=1e-5, atol=1e-6)
    errors = check_export(model, path, numerical_dtype=torch.float16)
    assert set(errors) == set(BATCH_SIZES)
    with pytest.raises(ValueError, match="numerical_dtype"):
        export_onnx(model, path, numerical_dtype=torch.bfloat16)


def test_fused_training_layouts_export_as_plain_lookups(tmp_path):
    """A model trained with the fused kernels (``joint_fused`` embeddings, ``cuda_dot``
    interaction) exports the pure-torch equivalents (one gather, the reference interaction),
    so the files hold no kernel call and match the plain model with the same weights."""
    fused = DLRM(make_config("joint_fused", "cuda_dot"))
    plain = trained_model(make_config("joint", "dot"))
    fused.load_state_dict(plain.state_dict())
    fused.eval()
    export_onnx(fused, str(tmp_path / "model.onnx"))
    export_torchscript(fused, str(tmp_path / "model.pt"))
    assert fused.interaction.use_kernel  # the caller's model is left as it was
    ops = {node.op_type for node in onnx.load(str(tmp_path / "model.onnx")).graph.node}
    assert "Gather" in ops and not ops & {"Loop", "Scan", "If"}
    numerical, categorical = random_inputs(64, seed=3)
    want = expected_probability(plain, numerical, categorical)
    for run, name in ((run_onnx, "model.onnx"), (run_torchscript, "model.pt")):
        np.testing.assert_allclose(run(str(tmp_path / name), numerical, categorical)[:, 0], want, rtol=1e-5, atol=1e-6)


def test_onnx_with_external_data_scores_as_the_eager_model(tmp_path):
    """Weights past protobuf's 2 GiB go to ``model.onnx.data`` beside the graph (ONNX's external
    data): forced here on a small model, ONNX Runtime loads the pair from the folder and scores
    as the eager model; the graph file is small, the data file holds the weights."""
    from dlrm.inference.export import export_onnx

    model = trained_model(make_config("joint", "dot"))
    path = tmp_path / "model.onnx"
    export_onnx(model, str(path), external_data=True)
    assert sorted(os.listdir(tmp_path)) == ["model.onnx", "model.onnx.data"]  # no staging folder left
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert (tmp_path / "model.onnx.data").stat().st_size >= 0.9 * weights > (tmp_path / "model.onnx").stat().st_size
    numerical, categorical = random_inputs(16, seed=3)
    np.testing.assert_allclose(run_onnx(str(path), numerical, categorical)[:, 0],
                               expected_probability(model, numerical, categorical), rtol=1e-5, atol=1e-6)


def test_a_model_past_2_gib_takes_external_data_by_itself(tmp_path, monkeypatch):
    """The choice is the weights' size against the limit (lowered here to a small model's size):
    past it, external data unless refused, and a refusal names the way out."""
    from dlrm.inference import export as export_module

    model = trained_model(make_config("joint", "dot"))
    monkeypatch.setattr(export_module, "ONNX_MAX_BYTES", 1024)
    export_module.export_onnx(model, str(tmp_path / "model.onnx"))
    assert (tmp_path / "model.onnx.data").is_file()
    with pytest.raises(ValueError, match="external_data"):
        export_module.export_onnx(model, str(tmp_path / "other.onnx"), external_data=False)
    assert not (tmp_path / "other.onnx").exists()
