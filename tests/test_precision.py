"""What --amp picks: fp16 on CUDA, bf16 on a CPU with bf16 instructions, float32 (said in the
run header) on a CPU without them, where bf16 autocast is slower than no autocast at all."""

import os
import sys

import pytest
import torch

from conftest import REPO
from dlrm.engine.devices import cpu_has_native_bf16
from dlrm.model.precision import Precision
import warm_python

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("native, want", [(True, torch.bfloat16), (False, None)])
def test_auto_on_a_cpu_follows_its_bf16_instructions(native, want):
    precision = Precision.parse(True, "auto", CPU, native_bf16=native)
    assert precision.dtype is want
    assert ("AMP off" in precision.note) == (not native)


def test_an_explicit_dtype_is_obeyed_and_a_slow_one_is_named():
    forced = Precision.parse(True, "bfloat16", CPU, native_bf16=False)
    assert forced.dtype is torch.bfloat16 and "slow here" in forced.note
    assert Precision.parse(True, "bfloat16", CPU, native_bf16=True).note == ""
    assert Precision.parse(True, "auto", CUDA, native_bf16=False).dtype is torch.float16
    assert Precision.parse(False, "auto", CPU, native_bf16=True).dtype is None
    with pytest.raises(ValueError, match="amp_dtype"):
        Precision.parse(True, "float8", CPU)


def _header(*args: str, isa: str | None) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if isa:
        env["ONEDNN_MAX_CPU_ISA"] = isa
    proc = warm_python.run([sys.executable, "-m", "dlrm.scripts.main", "--amp", "--batch_size", "256", "--max_steps", "1",
                           "--synthetic_dataset_table_sizes", "50,60", "--synthetic_dataset_num_entries", "1024",
                           "--synthetic_dataset_num_test_entries", "512", "--log_path", os.devnull, *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return next(line for line in proc.stdout.splitlines() if line.startswith("DLRM:"))


def test_run_header_on_a_cpu_capped_below_bf16_says_float32_and_why():
    # oneDNN capped at a Cascade Lake's instructions (AVX-512 VNNI, no BF16): the matrix library
    # then emulates bf16, 2x slower than float32 on the quick-start model (docs/benchmarks.md).
    header = _header(isa="AVX512_CORE_VNNI")
    assert "precision float32 (AMP off: bf16 autocast is slower than float32" in header
    assert "--amp_dtype bfloat16 forces bf16" in header
    assert "precision bfloat16 (slow here" in _header("--amp_dtype", "bfloat16", isa="AVX512_CORE_VNNI")


@pytest.mark.skipif(not cpu_has_native_bf16(), reason="this CPU has no bf16 instructions")
def test_run_header_on_a_cpu_with_bf16_instructions_says_bfloat16():
    assert "precision bfloat16, data" in _header(isa=None)


def test_recommender_amp_on_a_cpu_capped_below_bf16_trains_in_float32(tmp_path):
    data = tmp_path / "data"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}
    run = lambda *a: warm_python.run([sys.executable, "-m", *a], cwd=REPO, env=env, capture_output=True, text=True,  # noqa: E731
                                    timeout=300)
    gen = run("dlrm.scripts.recommender_generate", "--synthetic", "--users", "60", "--items", "40", "--interactions",
              "900", "--output", str(data))
    assert gen.returncode == 0, gen.stderr
    proc = run("dlrm.scripts.recommender_train", "--network", "configs/recommender/movielens_tuned.json", "--input",
               str(data / "all"), "--epochs", "1", "--amp", "--checkpoint_path", str(tmp_path / "ck"), "--log_path",
               os.devnull)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "amp: training in float32" in proc.stdout  # the library's note, printed as it is
