"""A real Triton Inference Server (the one nvidia-pytriton bundles) serving a trained DLRM
through the python-backend repository: the client's AUC equals the offline AUC of the same
checkpoint, a soak of 16 gRPC streams sees no errors, the client's errors are clear, and the
server stops cleanly.

The server runs in its own environment (``bash triton/setup_server_env.sh --with-torch``);
these tests look for it at $DLRM_TRITON_SERVER_ENV, else .venv-tritonserver in the repository,
and skip without it, unless DLRM_REQUIRE_TRITON_SERVER=1 (CI) turns that into a failure. One
server serves the whole module.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("tritonclient.grpc")
pytest.importorskip("tritonclient.http")
from sklearn.metrics import roc_auc_score  # noqa: E402

from dlrm.data.feature_spec import FeatureSpec  # noqa: E402
from dlrm.data.split_binary import SplitBinaryReader  # noqa: E402
from dlrm.data.synthetic import write_synthetic_dataset  # noqa: E402
from dlrm.inference.triton_client import DLRMTritonClient, TritonClientError, score_split, soak  # noqa: E402
from dlrm.inference.triton_repository import TritonModelConfig, deploy_checkpoint  # noqa: E402
from dlrm.inference.quantize import quantize_model  # noqa: E402
from dlrm.inference.triton_server import LocalTritonServer, ServerEnv, TritonServerError, free_port  # noqa: E402
from dlrm.model.dlrm import DLRM, DLRMConfig  # noqa: E402
from dlrm.training.checkpoint import TrainState, save_checkpoint  # noqa: E402
import warm_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SERVER_ENV = os.environ.get("DLRM_TRITON_SERVER_ENV", os.path.join(REPO, ".venv-tritonserver"))
TABLES = [30, 300, 4, 1000, 70, 12]
CONFIG = DLRMConfig(num_numerical_features=13, table_sizes=TABLES, embedding_dim=8, bottom_mlp_sizes=[16, 8],
                    top_mlp_sizes=[32, 16, 1])
TEST_SAMPLES = 3000
QUANTIZED_MODELS = {"dlrm_int8_onnx": "int8", "dlrm_int4_torchscript": "int4"}  # model name -> its tables
SOAK_SECONDS = 3.0


def run_script(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python triton/<name> args`` from the repository root, as the README shows."""
    return warm_python.run(
        [sys.executable, os.path.join(REPO, "triton", name), *args], cwd=REPO, capture_output=True, text=True,
        timeout=timeout, env={**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])},
    )


@pytest.fixture(scope="module")
def server_env():
    try:
        return ServerEnv.find(SERVER_ENV)
    except TritonServerError as e:
        if os.environ.get("DLRM_REQUIRE_TRITON_SERVER") == "1":
            pytest.fail(f"DLRM_REQUIRE_TRITON_SERVER=1 but: {e}")
        pytest.skip(f"no Triton server environment: {e}")


def test_server_env_errors_say_how_to_create_it(tmp_path):
    with pytest.raises(TritonServerError, match=r"no Triton server environment at .* triton/setup_server_env\.sh"):
        ServerEnv.find(str(tmp_path))
    # This interpreter's own environment: no bundled server (and numpy 2, which the stub cannot use).
    with pytest.raises(TritonServerError, match="lacks nvidia-pytriton|numpy"):
        ServerEnv.find(sys.prefix)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A split-binary dataset with learnable labels, a model trained on it for a few dozen steps,
    its checkpoint, and the offline reference: eager probabilities on the test split."""
    root = tmp_path_factory.mktemp("served")
    dataset = str(root / "data")
    write_synthetic_dataset(dataset, 13, TABLES, {"train": 16384, "test": TEST_SAMPLES}, batch_size=4096, seed=5)
    spec = FeatureSpec.from_yaml(os.path.join(dataset, "feature_spec.yaml"))
    torch.manual_seed(0)
    model = DLRM(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    with SplitBinaryReader(spec, "train", 1024) as reader:
        for epoch in range(2):
            for i in range(len(reader)):
                batch = reader.read_batch(i)
                logits = model(batch.numerical.float(), batch.categorical.long())
                loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.label.float())
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
    model.eval()
    save_checkpoint(str(root / "ckpt"), model, None, None, TrainState(step=32))
    with SplitBinaryReader(spec, "test", TEST_SAMPLES) as reader:
        batch = reader.read_batch(0)
    with torch.no_grad():
        probability = torch.sigmoid(model(batch.numerical.float(), batch.categorical.long())).numpy()
    labels = batch.label.numpy().astype(np.float64)
    quantized = {}  # the offline reference of each quantized deployment: the quantized eager model
    for precision in QUANTIZED_MODELS.values():
        with torch.no_grad():
            quantized[precision] = torch.sigmoid(quantize_model(model, precision)(
                batch.numerical.float(), batch.categorical.long())).numpy()
    return {"root": root, "dataset": dataset, "spec": spec, "ckpt": str(root / "ckpt"),
            "probability": probability, "labels": labels, "auc": roc_auc_score(labels, probability),
            "quantized": quantized}


@pytest.fixture(scope="module")
def server(server_env, trained):
    """The checkpoint deployed for the python backend (ONNX with fp16 numerical input; and
    TorchScript when the server environment has torch), served on free local ports. The
    deployer script itself is tested in test_triton_repository.py."""
    repository = str(trained["root"] / "models")
    models = [TritonModelConfig(model_name="dlrm_onnx", format="onnx", numerical_type="fp16"),
              TritonModelConfig(model_name="dlrm_int8_onnx", format="onnx")]
    if server_env.has_torch:
        models.append(TritonModelConfig(model_name="dlrm_torchscript", format="torchscript"))
        models.append(TritonModelConfig(model_name="dlrm_int4_torchscript", format="torchscript"))
    for cfg in models:
        cfg.python_backend, cfg.instance_kind, cfg.intra_op_threads = True, "cpu", 1
        cfg.preferred_batch_sizes, cfg.max_queue_delay_us = [64, 1024], 500
        deploy_checkpoint(trained["ckpt"], repository, cfg, check_batch_sizes=(1, 64),
                          quantize_tables=QUANTIZED_MODELS.get(cfg.model_name, "fp32"))
    local = LocalTritonServer(server_env, repository, str(trained["root"] / "server"))
    with local:
        yield local


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_client_auc_equals_offline_auc(server, trained, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    spec = trained["spec"]
    with DLRMTritonClient(url, "dlrm_onnx", protocol) as client, SplitBinaryReader(spec, "test", 1000) as reader:
        assert client.signature.numerical_datatype == "FP16"
        report = score_split(client, reader)
    assert report.samples == TEST_SAMPLES and report.requests == 3
    np.testing.assert_array_equal(report.labels, trained["labels"])
    # Sample by sample the server's probabilities are the eager model's (fp16 numerical is what
    # the dataset stores, so nothing is lost on the way) ...
    np.testing.assert_allclose(report.scores, trained["probability"], rtol=1e-5, atol=1e-6)
    # ... so the AUCs agree: the client's own computation against sklearn on eager scores.
    assert trained["auc"] > 0.6  # a model that learned something, so equal AUCs mean something
    assert report.auc == pytest.approx(trained["auc"], abs=1e-6)
    assert 0 < report.p50_ms <= report.p90_ms <= report.p99_ms and report.throughput > 0


@pytest.mark.parametrize("model_name", list(QUANTIZED_MODELS))
def test_quantized_model_client_auc_equals_offline_quantized_auc(server, server_env, trained, model_name):
    """A model deployed with quantized tables (int8 in ONNX's split form, int4 in TorchScript's
    packed one, run by torch's quantized operators inside the server): the server's scores are
    the offline quantized model's, so the AUCs agree."""
    if model_name.endswith("torchscript") and not server_env.has_torch:
        pytest.skip("the server environment has no torch")
    offline = trained["quantized"][QUANTIZED_MODELS[model_name]]
    with DLRMTritonClient(server.grpc_url, model_name, "grpc") as client, \
            SplitBinaryReader(trained["spec"], "test", 1000) as reader:
        report = score_split(client, reader)
    np.testing.assert_allclose(report.scores, offline, rtol=1e-5, atol=1e-6)
    assert report.auc == pytest.approx(roc_auc_score(trained["labels"], offline), abs=1e-6)
    assert not np.allclose(offline, trained["probability"], rtol=0, atol=1e-7)  # quantization changed the scores
    assert abs(report.auc - trained["auc"]) < 0.01


def test_torchscript_model_and_client_script_over_grpc(server, server_env, trained, tmp_path):
    if not server_env.has_torch:
        pytest.skip("the server environment has no torch: create it with triton/setup_server_env.sh --with-torch")
    log = tmp_path / "client.json"
    proc = run_script("client.py", f"--url={server.grpc_url}", "--protocol=grpc", "--model_name=dlrm_torchscript",
                      f"--dataset={trained['dataset']}", "--batch_size=512", f"--log_path={log}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    printed_auc = float(re.search(r"auc (\d\.\d+)", proc.stdout).group(1))
    assert printed_auc == pytest.approx(trained["auc"], abs=2e-6)  # printed with 6 decimals
    assert f"{TEST_SAMPLES} samples in 6 requests of up to 512" in proc.stdout
    assert re.search(r"latency ms: mean [\d.]+  p50 [\d.]+  p90 [\d.]+  p99 [\d.]+", proc.stdout)
    import json

    header, record = [json.loads(line) for line in open(log)]
    assert header["type"] == "header" and header["program"] == "dlrm-engine"
    assert record["type"] == "score" and record["samples"] == TEST_SAMPLES
    assert record["auc"] == pytest.approx(trained["auc"], abs=1e-6)


def test_soak_16_grpc_streams(server, trained):
    with SplitBinaryReader(trained["spec"], "test", 64) as reader:
        batch = reader.read_batch(0)
    report = soak(server.grpc_url, "dlrm_onnx", batch.numerical.numpy(), batch.categorical.numpy(),
                  streams=16, seconds=SOAK_SECONDS)
    print(f"\nsoak: {report.streams} gRPC streams, {report.seconds:.1f} s, {report.requests} requests of 64, "
          f"{report.errors} errors, {report.throughput:,.0f} samples/s, latency ms mean {report.mean_ms:.2f} "
          f"p50 {report.p50_ms:.2f} p90 {report.p90_ms:.2f} p99 {report.p99_ms:.2f}")
    assert report.errors == 0, report.first_errors
    assert report.requests >= 16 and report.samples == 64 * report.requests
    assert SOAK_SECONDS <= report.seconds < SOAK_SECONDS + 30
    assert 0 < report.p50_ms <= report.p90_ms <= report.p99_ms


def test_client_script_soak(server, trained):
    proc = run_script("client.py", f"--url={server.grpc_url}", "--protocol=grpc", "--model_name=dlrm_onnx",
                      f"--dataset={trained['dataset']}", "--max_batches=1", "--soak_seconds=1", "--soak_streams=4")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"soak: 4 gRPC streams for [\d.]+ s, batch 64: \d+ requests, 0 errors", proc.stdout), proc.stdout


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_unreachable_server(protocol):
    url = f"127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(TritonClientError, match=rf"cannot reach the Triton server at {protocol}://{url}"):
        DLRMTritonClient(url, "dlrm", protocol, timeout_s=5)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_missing_model_lists_what_the_server_has(server, protocol):
    url = server.http_url if protocol == "http" else server.grpc_url
    with pytest.raises(TritonClientError) as info:
        DLRMTritonClient(url, "no_such_model", protocol)
    message = str(info.value)
    assert f"model 'no_such_model' on the Triton server at {protocol}://{url} is missing or not ready" in message
    assert "dlrm_onnx (READY)" in message


def test_mismatched_shapes(server, trained, tmp_path):
    other = str(tmp_path / "other")
    write_synthetic_dataset(other, 4, [10, 20, 30], {"test": 100}, batch_size=100, seed=1)
    spec = FeatureSpec.from_yaml(os.path.join(other, "feature_spec.yaml"))
    expected = ("shape mismatch: model 'dlrm_onnx' on the Triton server at http://{url} expects numerical "
                "[batch, 13] and categorical [batch, 6], got numerical [batch, 4] and categorical [batch, 3]")
    with DLRMTritonClient(server.http_url, "dlrm_onnx") as client, SplitBinaryReader(spec, "test", 50) as reader:
        with pytest.raises(TritonClientError, match=re.escape(expected.format(url=server.http_url))):
            score_split(client, reader)
        with pytest.raises(TritonClientError, match=re.escape("expects numerical [batch, 13]")):
            client.infer(np.zeros((2, 13), np.float32), np.zeros((2, 5), np.int64))
        with pytest.raises(TritonClientError, match=re.escape("got numerical [2, 13] and categorical [3, 6]")):
            client.infer(np.zeros((2, 13), np.float32), np.zeros((3, 6), np.int64))
    proc = run_script("client.py", f"--url={server.http_url}", "--model_name=dlrm_onnx", f"--dataset={other}")
    assert proc.returncode == 2 and "error: shape mismatch" in proc.stderr and "Traceback" not in proc.stderr


def test_client_script_errors(server, trained):
    url = f"127.0.0.1:{free_port()}"
    proc = run_script("client.py", f"--url={url}", f"--dataset={trained['dataset']}", "--timeout_s=5")
    assert proc.returncode == 2 and f"cannot reach the Triton server at http://{url}" in proc.stderr
    proc = run_script("client.py", f"--url={server.http_url}", "--model_name=nope", f"--dataset={trained['dataset']}")
    assert proc.returncode == 2 and "model 'nope'" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_script("client.py", f"--url={server.http_url}", f"--dataset={trained['dataset']}", "--soak_seconds=1")
    assert proc.returncode != 0 and "--protocol grpc" in proc.stderr


def test_server_stops_cleanly(server):
    """Last in the module: SIGTERM with no client connected ends the server with exit code 0
    and every model unloaded (the fixture's own stop is then a no-op)."""
    code = server.stop()
    log = open(server.log_path).read()
    assert code == 0, log[-3000:]
    assert "successfully unloaded 'dlrm_onnx'" in log
    assert server.process is None
