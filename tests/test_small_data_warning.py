"""A run its data cannot fill (an epoch of a few steps, tables many times the training samples, a
test split smaller than one test batch) says so in one warning line, naming the flags to change,
before its first step; a run its data fills says nothing."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from dlrm.training.small_data import MIN_STEPS_PER_EPOCH, ROWS_PER_SAMPLE, small_data_warning

SMALL_MODEL = ["--embedding_dim", "4", "--bottom_mlp_sizes", "8,4", "--top_mlp_sizes", "8,1", "--base_device", "cpu"]


def _lines(stdout: str) -> tuple[list[str], int]:
    lines = stdout.splitlines()
    warnings = [line for line in lines if line.startswith("Warning:")]
    first_step = next(i for i, line in enumerate(lines) if line.startswith(("Epoch:", "Test at")))
    assert all(lines.index(w) < first_step for w in warnings), stdout
    return warnings, first_step


def test_a_small_dataset_with_large_batches_is_told_before_training(synthetic_dataset, tmp_path):
    data = synthetic_dataset(4, [50, 60], {"train": 512, "test": 256}, batch_size=256, seed=0)
    log = tmp_path / "log.json"
    proc = run_cli("dlrm.scripts.main", "--dataset", data, "--batch_size", "256", "--test_batch_size", "1024",
                   *SMALL_MODEL, "--log_path", str(log))
    (warning,), _ = _lines(proc.stdout)
    assert "an epoch is 2 steps of --batch_size 256" in warning and "lower --batch_size" in warning
    assert "256 samples are fewer than one test batch of --test_batch_size 1024" in warning
    assert "rows never train" not in warning  # tables of 50 and 60 rows for 512 samples
    (record,) = [r for r in map(json.loads, log.read_text().splitlines()) if r["type"] == "warning"]
    assert "`batch_size`" in record["message"]  # the log names settings; the line, this script's flags


def test_tables_many_times_the_samples_are_told(tmp_path):
    proc = run_cli("dlrm.scripts.main", "--synthetic_dataset_table_sizes", "100000,50",
                   "--synthetic_dataset_num_entries", "4096", "--synthetic_dataset_num_test_entries", "1024",
                   "--batch_size", "32", "--test_batch_size", "512", "--max_steps", "2", *SMALL_MODEL,
                   "--log_path", str(tmp_path / "log.json"))
    (warning,), _ = _lines(proc.stdout)
    assert "table 0 has 100,000 rows for 4,096 training samples" in warning and "--max_table_size" in warning
    assert "an epoch" not in warning and "test batch" not in warning  # 128 steps; 1024 test samples


def test_a_run_its_data_fills_says_nothing(tmp_path):
    proc = run_cli("dlrm.scripts.main", "--synthetic_dataset_table_sizes", "1000,50",
                   "--synthetic_dataset_num_entries", str(128 * 256), "--synthetic_dataset_num_test_entries", "1024",
                   "--batch_size", "256", "--test_batch_size", "1024", "--max_steps", "2", *SMALL_MODEL,
                   "--log_path", str(tmp_path / "log.json"))
    assert _lines(proc.stdout)[0] == []


@pytest.mark.parametrize("steps", [MIN_STEPS_PER_EPOCH - 1, MIN_STEPS_PER_EPOCH])
@pytest.mark.parametrize("rows", [ROWS_PER_SAMPLE * 1000, ROWS_PER_SAMPLE * 1000 + 1])
@pytest.mark.parametrize("test_samples", [None, 0, 99, 100])
def test_each_finding_at_its_bound(steps, rows, test_samples):
    warning = small_data_warning(steps, 10, 1000, [5, rows], test_samples, 100) or ""
    assert ("an epoch is" in warning) == (steps < MIN_STEPS_PER_EPOCH)
    assert ("table 1 has" in warning) == (rows > ROWS_PER_SAMPLE * 1000)
    assert ("test batch" in warning) == (test_samples == 99)
    assert (warning == "") == (steps >= MIN_STEPS_PER_EPOCH and rows <= ROWS_PER_SAMPLE * 1000 and test_samples != 99)
