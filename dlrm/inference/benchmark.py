"""Inference latency and throughput per batch size, timed the way a server would see them.

What runs is the eager model, or any ``forward(numerical, categorical)`` standing in for it:
CUDA graphs (``dlrm.training.cuda_graphs``), or an exported file loaded the way a server loads it
(``exported_forward``: ONNX Runtime or TorchScript), so the three can be compared on the same
batches with the same clock.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dlrm.data.batch import Batch
from dlrm.model.precision import Precision
from dlrm.training.train import synchronize

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
EXPORTED_BACKENDS = {"onnxruntime": "model.onnx", "torchscript": "model.pt"}


@dataclass
class LatencyResult:
    batch_size: int
    host_to_device_copy: str  # "timed", "not timed", or "none (cpu)": whether inputs start on the host
    backend: str  # "eager", "cuda_graphs", "onnxruntime" or "torchscript"
    mean_ms: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    throughput: float  # samples/s at the mean latency

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _time_passes(run: Callable[[int], None], steps: int, warmup: int, device: torch.device) -> np.ndarray:
    for i in range(warmup):
        run(i)
    latencies = np.empty(steps)
    for i in range(steps):
        synchronize(device)
        start = time.perf_counter()
        run(i)
        synchronize(device)
        latencies[i] = time.perf_counter() - start
    return latencies


def _summarise(batch_size: int, copy: str, backend: str, latencies: np.ndarray) -> LatencyResult:
    ms = latencies * 1e3
    return LatencyResult(
        batch_size=batch_size,
        host_to_device_copy=copy,
        backend=backend,
        mean_ms=float(ms.mean()),
        p50_ms=float(np.percentile(ms, 50)),
        p90_ms=float(np.percentile(ms, 90)),
        p99_ms=float(np.percentile(ms, 99)),
        throughput=batch_size / float(latencies.mean()),
    )


@torch.no_grad()
def benchmark_inference(
    model: torch.nn.Module,
    batches_for: Callable[[int], Sequence[Batch]],
    batch_sizes: Sequence[int],
    steps: int,
    warmup: int,
    device: torch.device,
    precision: Precision,
    forward: Forward | None = None,
    backend: str = "eager",
) -> list[LatencyResult]:
    """Times ``steps`` forward passes per batch size after ``warmup`` untimed ones.

    ``batches_for(bs)`` returns a few real batches of that size (cycled, so timing never waits
    on disk). On a GPU every size is timed twice: with inputs already on the device, and with
    the copy from pinned host memory inside the timed region; on the CPU there is no copy.
    ``forward`` replaces ``model`` (``backend`` names it in the results); it gets the batch as
    stored (float16 numerical, narrow integer ids) and casts what it needs, as the model does.
    """
    model.eval()
    run = model if forward is None else forward
    results = []
    for batch_size in batch_sizes:
        host = [b.to("cpu") for b in batches_for(batch_size)]
        if not host:
            raise ValueError(f"no batch of size {batch_size} could be read for the inference benchmark")
        if device.type == "cuda":
            host = [b.pin_memory() for b in host]
        on_device = [b.to(device) for b in host]

        def compute(i: int) -> None:
            b = on_device[i % len(on_device)]
            with precision.autocast():
                run(b.numerical, b.categorical)

        if device.type != "cuda":
            results.append(_summarise(batch_size, "none (cpu)", backend, _time_passes(compute, steps, warmup, device)))
            continue

        def copy_and_compute(i: int) -> None:
            b = host[i % len(host)].to(device, non_blocking=True)
            with precision.autocast():
                run(b.numerical, b.categorical)

        results.append(_summarise(batch_size, "not timed", backend, _time_passes(compute, steps, warmup, device)))
        results.append(_summarise(batch_size, "timed", backend, _time_passes(copy_and_compute, steps, warmup, device)))
    return results


def exported_forward(
    model: torch.nn.Module, backend: str, directory: str, device: torch.device, threads: int = 0
) -> Forward:
    """Exports ``model`` (on the CPU) to ``directory`` for ``backend`` ("onnxruntime" or
    "torchscript") and returns the loaded file as a forward: what a server would run.
    ``threads`` sets ONNX Runtime's intra-op threads (0: one per core)."""
    from dlrm.inference.export import export_onnx, export_torchscript, load_exported  # onnx tooling, on demand

    if backend not in EXPORTED_BACKENDS:
        raise ValueError(f"backend must be one of {sorted(EXPORTED_BACKENDS)}, got {backend!r}")
    if device.type != "cpu" and backend == "onnxruntime":
        raise ValueError(f"the onnxruntime backend runs on the CPU (its CPU provider), not on {device}")
    if any(p.device.type != "cpu" for p in model.parameters()):  # export traces on the CPU
        cpu_model = type(model)(model.config, device="cpu")
        cpu_model.load_state_dict(model.state_dict())
        model = cpu_model.eval()
    path = os.path.join(directory, EXPORTED_BACKENDS[backend])
    try:
        (export_onnx if backend == "onnxruntime" else export_torchscript)(model, path)
        return load_exported(path, device, threads)
    except ImportError as e:
        raise ValueError(f"the {backend} backend needs {e.name}: pip install -e '.[export]'") from e


def format_table(results: Sequence[LatencyResult]) -> str:
    header = (f"{'backend':>11} {'batch':>7} {'h2d copy':>11} {'mean ms':>9} {'p50 ms':>9} {'p90 ms':>9} {'p99 ms':>9} "
              f"{'samples/s':>12}")
    rows = [
        f"{r.backend:>11} {r.batch_size:>7} {r.host_to_device_copy:>11} {r.mean_ms:>9.3f} {r.p50_ms:>9.3f} "
        f"{r.p90_ms:>9.3f} "
        f"{r.p99_ms:>9.3f} {r.throughput:>12,.0f}"
        for r in results
    ]
    return "\n".join([header, *rows])
