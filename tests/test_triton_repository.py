"""Triton model repositories: every generated config.pbtxt parses as Triton's ModelConfig
protobuf (tritonclient's copy of model_config.proto) and says what the deployer was asked for;
the files next to it run and match the eager model."""

import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
from google.protobuf import text_format  # noqa: E402

from dlrm.inference import triton_python_model  # noqa: E402
from dlrm.inference.triton_repository import TritonModelConfig, deploy_model, render_config  # noqa: E402
from dlrm.model.dlrm import DLRM, DLRMConfig  # noqa: E402
from dlrm.training.checkpoint import TrainState, save_checkpoint  # noqa: E402
import warm_python

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLES = [7, 50, 3, 20, 11, 4, 9, 30, 2, 5, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36]  # 26
CONFIG = DLRMConfig(num_numerical_features=13, table_sizes=TABLES, embedding_dim=8, bottom_mlp_sizes=[16, 8],
                    top_mlp_sizes=[16, 1])
FLAVOURS = [(fmt, python) for fmt in ("onnx", "torchscript") for python in (False, True)]


def parse(text: str):
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def dtype_name(value: int) -> str:
    return model_config_pb2.DataType.Name(value)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(3)
    m = DLRM(CONFIG)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return m.eval()


@pytest.mark.parametrize("fmt,python_backend", FLAVOURS, ids=lambda v: str(v))
@pytest.mark.parametrize("numerical_type", ["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["gpu", "cpu"])
def test_config_parses_as_model_config(fmt, python_backend, numerical_type, kind):
    cfg = TritonModelConfig(model_name="ctr", format=fmt, python_backend=python_backend, numerical_type=numerical_type,
                            max_batch_size=32768, preferred_batch_sizes=[256, 4096], max_queue_delay_us=250,
                            instance_kind=kind, instance_count=2, gpus=[0, 1] if kind == "gpu" else None)
    config = parse(render_config(cfg, 13, 26))
    assert config.name == "ctr" and config.max_batch_size == 32768
    if python_backend:
        assert config.backend == "python" and not config.platform
        assert config.parameters["model_file"].string_value == ("model.onnx" if fmt == "onnx" else "model.pt")
    else:
        assert config.platform == {"onnx": "onnxruntime_onnx", "torchscript": "pytorch_libtorch"}[fmt]
        assert config.default_model_filename == ("model.onnx" if fmt == "onnx" else "model.pt")
    names = [t.name for t in config.input] + [t.name for t in config.output]
    libtorch = fmt == "torchscript" and not python_backend
    assert names == (["numerical__0", "categorical__1", "click_probability__0"] if libtorch
                     else ["numerical", "categorical", "click_probability"])
    numerical, categorical = config.input
    assert dtype_name(numerical.data_type) == {"fp32": "TYPE_FP32", "fp16": "TYPE_FP16"}[numerical_type]
    assert list(numerical.dims) == [13]
    assert dtype_name(categorical.data_type) == "TYPE_INT64" and list(categorical.dims) == [26]
    assert dtype_name(config.output[0].data_type) == "TYPE_FP32" and list(config.output[0].dims) == [1]
    assert list(config.dynamic_batching.preferred_batch_size) == [256, 4096]
    assert config.dynamic_batching.max_queue_delay_microseconds == 250
    (group,) = config.instance_group
    assert model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind) == f"KIND_{kind.upper()}"
    assert group.count == 2 and list(group.gpus) == ([0, 1] if kind == "gpu" else [])


def test_config_without_preferred_sizes_and_with_threads():
    cfg = TritonModelConfig(python_backend=True, preferred_batch_sizes=[], intra_op_threads=2, instance_kind="cpu")
    config = parse(render_config(cfg, 4, 5))
    assert config.HasField("dynamic_batching") and not config.dynamic_batching.preferred_batch_size
    assert config.parameters["intra_op_threads"].string_value == "2"
    assert [list(t.dims) for t in config.input] == [[4], [5]]


@pytest.mark.parametrize(
    "changes,needle",
    [
        ({"format": "tflite"}, "format must be one of"),
        ({"numerical_type": "int8"}, "numerical_type must be one of"),
        ({"instance_kind": "tpu"}, "instance_kind must be one of"),
        ({"model_name": "a/b"}, "is not a model name"),
        ({"max_batch_size": 0}, "max_batch_size must be at least 1"),
        ({"preferred_batch_sizes": [64, 100_000]}, "outside [1, max_batch_size=65536]"),
        ({"max_queue_delay_us": -1}, "must not be negative"),
        ({"instance_kind": "cpu", "gpus": [0]}, "gpus applies to instance_kind 'gpu' only"),
    ],
)
def test_invalid_configs_are_refused(changes, needle):
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        render_config(TritonModelConfig(**changes), 13, 26)


@pytest.mark.parametrize("fmt,python_backend,numerical_type",
                         [("onnx", False, "fp16"), ("onnx", True, "fp32"), ("torchscript", False, "fp32"),
                          ("torchscript", True, "fp16")])
def test_deploy_writes_a_repository_that_matches_eager(model, tmp_path, fmt, python_backend, numerical_type):
    cfg = TritonModelConfig(format=fmt, python_backend=python_backend, numerical_type=numerical_type)
    deployed = deploy_model(model, str(tmp_path), cfg, check_batch_sizes=(1, 64, 4096))
    model_file = "model.onnx" if fmt == "onnx" else "model.pt"
    expected = {"config.pbtxt", f"1/{model_file}"} | ({"1/model.py"} if python_backend else set())
    written = {os.path.relpath(f, deployed.model_dir) for f in deployed.files}
    assert written == expected
    found = {os.path.relpath(os.path.join(d, f), deployed.model_dir) for d, _, fs in os.walk(deployed.model_dir)
             for f in fs}
    assert found == expected  # no temporaries left behind
    assert set(deployed.max_abs_errors) == {1, 64, 4096} and max(deployed.max_abs_errors.values()) < 1e-5
    config = parse(open(os.path.join(deployed.model_dir, "config.pbtxt")).read())
    assert [list(t.dims) for t in config.input] == [[13], [26]]
    if python_backend:
        script = open(os.path.join(deployed.model_dir, "1", "model.py")).read()
        assert script == open(triton_python_model.__file__).read()

    # The file on its own, with inputs as a client sends them: numerical in the configured type.
    g = torch.Generator().manual_seed(11)
    numerical = torch.randn(300, 13, generator=g).to(torch.float16 if numerical_type == "fp16" else torch.float32)
    categorical = torch.stack([torch.randint(0, n, (300,), generator=g) for n in TABLES], dim=1)
    path = os.path.join(deployed.model_dir, "1", model_file)
    if fmt == "onnx":
        import onnxruntime as ort

        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        want_type = "tensor(float16)" if numerical_type == "fp16" else "tensor(float)"
        assert session.get_inputs()[0].type == want_type
        got = session.run(None, {"numerical": numerical.numpy(), "categorical": categorical.numpy()})[0]
    else:
        with torch.no_grad():
            got = torch.jit.load(path)(numerical, categorical).numpy()
    with torch.no_grad():
        want = torch.sigmoid(model(numerical.float(), categorical)).numpy()
    np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-6)


def test_python_model_runs_the_file_with_its_runners(model, tmp_path):
    """model.py's runners (what the python backend calls per batch) against eager, without a
    server: the server round trip itself is tested in test_triton_server.py."""
    onnx_dir = deploy_model(model, str(tmp_path), TritonModelConfig(model_name="a", python_backend=True,
                                                                    numerical_type="fp16"), (8,)).model_dir
    ts_dir = deploy_model(model, str(tmp_path), TritonModelConfig(model_name="b", format="torchscript",
                                                                  python_backend=True), (8,)).model_dir
    numerical = np.random.default_rng(0).standard_normal((40, 13)).astype(np.float32)
    categorical = np.stack([np.random.default_rng(i).integers(0, n, 40) for i, n in enumerate(TABLES)], axis=1)
    with torch.no_grad():
        want = torch.sigmoid(model(torch.from_numpy(numerical.astype(np.float16).astype(np.float32)),
                                   torch.from_numpy(categorical))).numpy()
    for runner, path in ((triton_python_model._onnx_runner, os.path.join(onnx_dir, "1", "model.onnx")),
                         (triton_python_model._torchscript_runner, os.path.join(ts_dir, "1", "model.pt"))):
        run = runner(path, gpu=False, device_id=0, threads=1)
        got = run(numerical.astype(np.float16), categorical.astype(np.int32))  # the runners cast what they get
        assert got.shape == (40, 1) and got.dtype == np.float32
        np.testing.assert_allclose(got[:, 0], want, rtol=1e-5, atol=1e-6)


def test_deployer_script(model, tmp_path):
    """``python triton/deployer.py`` as a user runs it: a python-backend repository from a checkpoint."""
    save_checkpoint(str(tmp_path / "ckpt"), model, None, None, TrainState())
    repo = tmp_path / "models"
    proc = warm_python.run(
        [sys.executable, os.path.join(REPO, "triton", "deployer.py"), f"--checkpoint={tmp_path / 'ckpt'}",
         f"--model_repository={repo}", "--model_name=ctr", "--python_backend", "--instance_kind=cpu",
         "--numerical_type=fp16", "--preferred_batch_sizes=64,1024", "--check_batch_sizes=1,64"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.returncode == 0, proc.stderr
    assert "deployed 'ctr' (python backend, onnx, numerical fp16)" in proc.stdout
    assert "batch 64: max abs error against eager" in proc.stdout
    assert sorted(os.listdir(repo / "ctr")) == ["1", "config.pbtxt"]
    assert sorted(os.listdir(repo / "ctr" / "1")) == ["model.onnx", "model.py"]
    config = parse((repo / "ctr" / "config.pbtxt").read_text())
    assert config.backend == "python" and list(config.dynamic_batching.preferred_batch_size) == [64, 1024]


def test_deploy_script_errors(cli, tmp_path):
    proc = cli("dlrm.scripts.deploy", f"--checkpoint={tmp_path / 'none'}", f"--model_repository={tmp_path / 'models'}",
               check=False)
    assert proc.returncode != 0 and "No checkpoint" in proc.stderr and "Traceback" not in proc.stderr
    proc = cli("dlrm.scripts.deploy", f"--checkpoint={tmp_path}", f"--model_repository={tmp_path}",
               "--instance_kind=cpu", "--gpus=0", check=False)
    assert proc.returncode != 0 and "gpus applies to instance_kind 'gpu' only" in proc.stderr
    assert os.listdir(tmp_path) == []
