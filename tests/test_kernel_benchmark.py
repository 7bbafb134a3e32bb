"""Smoke test of benchmarks/kernels.py: it runs on the CPU with tiny shapes and prints its table.

The numbers themselves mean nothing here (interpreted kernels, two busy cores); this checks
that the script runs end to end, times every phase of every kernel, and reports its peaks.
"""

import os
import subprocess
import sys
import warm_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = ["4x3x8", "2x5x16"]
DTYPES = ["fp32", "bf16"]


def run_benchmark(*args: str, script: str = "kernels.py", **env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": REPO, "PYTHONUNBUFFERED": "1", **env}
    return warm_python.run([sys.executable, os.path.join("benchmarks", script), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_benchmark_prints_a_row_per_kernel_shape_dtype_and_phase():
    proc = run_benchmark("--device", "cpu", "--shapes", ",".join(SHAPES), "--dtypes", ",".join(DTYPES),
                         "--batch_size", "2", "--table_rows", "64", "--mlp_batch_size", "4", "--warmup", "0",
                         "--reps", "1")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("device cpu: copy ") and "GB/s" in lines[0] and "bf16" in lines[0]
    assert lines[1].split() == ["kernel", "shape", "dtype", "phase", "path", "kernel", "ms", "torch", "ms",
                                "speedup", "GB/s", "TFLOP/s", "roofline"]
    rows = [line.split() for line in lines[2:] if line.startswith("dot_interaction")]
    expected = {(shape, dtype, phase) for shape in SHAPES for dtype in DTYPES for phase in ("fwd", "bwd", "fwd+bwd")}
    assert {(r[1], r[2], r[3]) for r in rows} == expected and len(rows) == len(expected)
    for row in rows:
        assert len(row) == 11 and row[4] in ("interpreted", "reference")
        assert float(row[5]) > 0 and float(row[6]) > 0 and row[7].endswith("x") and row[10].endswith("%")
    mlp = [line.split() for line in lines if line.startswith("mlp_")]
    assert {(r[0], r[1], r[2], r[3]) for r in mlp} == {
        (name, shape, dtype, phase) for name, shape in (("mlp_bottom", "4x13-512-256-128"),
                                                        ("mlp_top", "4x480-1024-1024-512-256-1"))
        for dtype in DTYPES for phase in ("fwd", "bwd", "fwd+bwd")}
    assert all(len(r) == 11 and r[4] in ("interpreted", "reference") and float(r[5]) > 0 for r in mlp)
    embedding = [line.split() for line in lines if line.startswith("embedding_")]
    assert {(r[0], r[2]) for r in embedding} == {(k, d) for k in ("embedding_gather", "embedding_sgd_update")
                                                 for d in DTYPES}


def test_benchmark_rejects_a_malformed_shape():
    proc = run_benchmark("--device", "cpu", "--shapes", "4x3")
    assert proc.returncode == 2 and "BATCHxNUM_FEATURESxDIM" in proc.stderr


def test_train_step_benchmark_times_both_paths():
    """benchmarks/train_step.py: the plain torch step and the kernel step, on the same data."""
    proc = run_benchmark("--device", "cpu", "--tables", "50,300", "--batch_size", "64", "--precisions", "fp32,bf16",
                         "--steps", "2", "--warmup", "1", script="train_step.py", TRITON_INTERPRET="0")
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("fp32", "torch"), ("fp32", "kernels"), ("bf16", "torch"), ("bf16", "kernels")]
    for row in rows:
        assert float(row[2].replace(",", "")) > 0 and row[3].endswith("x")
