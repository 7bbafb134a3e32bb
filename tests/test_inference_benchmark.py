"""--mode inference_benchmark: the timing library, and the entry point for the eager model and
for the exported files (ONNX Runtime, TorchScript), with its table on stdout and JSON log rows.
The eager path on a trained checkpoint is also covered by test_cli.py; the GPU paths (AMP,
CUDA graphs, host-to-device copy) by the gpu-marked test at the end."""

import json
import os

import numpy as np
import pytest
import torch

from dlrm.data.batch import Batch
from dlrm.inference.benchmark import LatencyResult, benchmark_inference, exported_forward, format_table
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
TABLES = [30, 300, 4, 1000, 70]
CONFIG = DLRMConfig(4, TABLES, 8, [16, 8], [32, 16, 1])
SMALL_MODEL = ["--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "32,16,1"]
CPU = torch.device("cpu")


def batches(batch_size: int, count: int = 3) -> list[Batch]:
    """Batches as a reader returns them: float16 numerical, narrow integer ids."""
    g = torch.Generator().manual_seed(batch_size)
    return [Batch(numerical=torch.randn(batch_size, 4, generator=g).half(),
                  categorical=torch.stack([torch.randint(0, n, (batch_size,), generator=g) for n in TABLES],
                                          dim=1).to(torch.int16),
                  label=torch.zeros(batch_size, dtype=torch.uint8)) for _ in range(count)]


def check_rows(rows: list[dict], batch_sizes: list[int], backend: str) -> None:
    assert [r["batch_size"] for r in rows] == batch_sizes
    for r in rows:
        assert r["backend"] == backend and r["host_to_device_copy"] == "none (cpu)"
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert r["throughput"] == pytest.approx(r["batch_size"] / (r["mean_ms"] / 1e3))


def test_benchmark_times_the_forward_it_is_given(tmp_path):
    torch.manual_seed(0)
    model = DLRM(CONFIG).eval()
    eager = benchmark_inference(model, batches, [1, 64], steps=20, warmup=3, device=CPU,
                                precision=Precision("cpu"))
    check_rows([r.as_dict() for r in eager], [1, 64], "eager")
    # An exported file, loaded as a server loads it, through the same clock and batches; that it
    # computes the model's probabilities is what test_export.py checks, here that it is what ran.
    for backend in ("onnxruntime", "torchscript"):
        pytest.importorskip("onnxruntime")
        forward = exported_forward(model, backend, str(tmp_path / backend), CPU)
        b = batches(64)[0]
        with torch.no_grad():
            want = torch.sigmoid(model(b.numerical.float(), b.categorical.long()))
        np.testing.assert_allclose(forward(b.numerical, b.categorical)[:, 0].numpy(), want.numpy(), rtol=1e-5,
                                   atol=1e-6)
        results = benchmark_inference(model, batches, [1, 64], steps=20, warmup=3, device=CPU,
                                      precision=Precision("cpu"), forward=forward, backend=backend)
        check_rows([r.as_dict() for r in results], [1, 64], backend)
    table = format_table(eager)
    assert table.splitlines()[0].split() == ["backend", "batch", "h2d", "copy", "mean", "ms", "p50", "ms", "p90", "ms",
                                             "p99", "ms", "samples/s"]
    assert len(table.splitlines()) == 3


def test_percentiles_and_throughput_from_known_latencies():
    from dlrm.inference.benchmark import _summarise

    latencies = np.arange(1, 101) / 1e3  # 1..100 ms
    r = _summarise(32, "none (cpu)", "eager", latencies)
    assert isinstance(r, LatencyResult)
    assert r.mean_ms == pytest.approx(50.5) and r.p50_ms == pytest.approx(50.5)
    assert r.p90_ms == pytest.approx(90.1) and r.p99_ms == pytest.approx(99.01)
    assert r.throughput == pytest.approx(32 / 0.0505)


def test_exported_forward_refuses_onnx_off_the_cpu(tmp_path):
    with pytest.raises(ValueError, match="CPU"):
        exported_forward(DLRM(CONFIG), "onnxruntime", str(tmp_path), torch.device("cuda"))
    with pytest.raises(ValueError, match="backend must be one of"):
        exported_forward(DLRM(CONFIG), "tensorrt", str(tmp_path), CPU)


@pytest.fixture(scope="module")
def dataset(synthetic_dataset):
    return synthetic_dataset(4, TABLES, {"train": 5000, "test": 5000}, batch_size=4096, seed=3)


@pytest.mark.parametrize("backend", ["onnxruntime", "torchscript"])
def test_cli_benchmarks_an_exported_backend(cli, dataset, tmp_path, backend):
    pytest.importorskip("onnxruntime")
    log = str(tmp_path / "bench.json")
    out = cli("dlrm.scripts.main", "--mode", "inference_benchmark", "--dataset", dataset, "--base_device", "cpu",
              "--inference_benchmark_backend", backend, "--inference_benchmark_batch_sizes", "1,64,4096",
              "--inference_benchmark_steps", "10", "--inference_benchmark_threads", "1", "--log_path", log,
              *SMALL_MODEL).stdout
    assert "Inference benchmark (float32, device cpu, CPU threads 1)" in out and f"{backend:>11}" in out
    records = [json.loads(line) for line in open(log)]
    rows = [r for r in records if r["type"] == "inference_benchmark"]
    check_rows(rows, [1, 64, 4096], backend)
    assert all(r["precision"] == "float32" and r["device"] == "cpu" and r["threads"] == 1 for r in rows)
    (summary,) = [r for r in records if r["type"] == "summary"]
    assert [s["batch_size"] for s in summary["inference"]] == [1, 64, 4096]
    assert not [f for f in os.listdir(tmp_path) if f != "bench.json"]  # the export lived in a temporary directory


def test_cli_refuses_amp_with_an_exported_backend(cli, dataset):
    proc = cli("dlrm.scripts.main", "--mode", "inference_benchmark", "--dataset", dataset, "--base_device", "cpu",
               "--inference_benchmark_backend", "onnxruntime", "--amp", "--log_path", os.devnull, *SMALL_MODEL,
               check=False)
    assert proc.returncode != 0 and "drop --amp" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("extra", [[], ["--amp"], ["--amp", "--cuda_graphs"]], ids=["fp32", "amp", "amp-graphs"])
def test_cli_on_gpu(cli, dataset, tmp_path, extra):
    log = str(tmp_path / "bench.json")
    out = cli("dlrm.scripts.main", "--mode", "inference_benchmark", "--dataset", dataset, "--base_device", "cuda",
              "--inference_benchmark_batch_sizes", "1,64,4096", "--inference_benchmark_steps", "20",
              "--log_path", log, *SMALL_MODEL, *extra).stdout
    assert ("float16" if "--amp" in extra else "float32") in out
    rows = [r for r in map(json.loads, open(log)) if r["type"] == "inference_benchmark"]
    # Every batch size twice: inputs already on the GPU, and the copy from pinned memory timed.
    assert [(r["batch_size"], r["host_to_device_copy"]) for r in rows] == [
        (b, c) for b in (1, 64, 4096) for c in ("not timed", "timed")]
    assert {r["backend"] for r in rows} == {"cuda_graphs" if "--cuda_graphs" in extra else "eager"}
    for r in rows:
        assert 0 < r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
