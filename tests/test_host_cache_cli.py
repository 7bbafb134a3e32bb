"""The command line's device cache of host-table rows (``--host_table_cache_rows``) and the
synthetic ids' skew (``--synthetic_zipf_exponent``): a cached run trains as the same run without
the cache, the log states the hit rate, and the settings it cannot work with are refused."""

from __future__ import annotations


import re

import pytest
import torch

from dlrm.data.sources import make_source
from dlrm.data.synthetic import SyntheticDataset
from dlrm.training.checkpoint import load_checkpoint
from dlrm.training.build import build_run
from dlrm.scripts import dlrm_flags
from test_optimizers import rowwise_adagrad_cli_args
from conftest import log_records


def fused_args(log: str) -> list[str]:
    return [*rowwise_adagrad_cli_args(log), "--embedding_type", "joint_fused", "--max_steps", "16"]


def checkpoint_weights(path: str, args: list[str]) -> dict[str, torch.Tensor]:
    """The checkpoint at ``path`` loaded into the model ``args`` describe (all tables on the device)."""
    values = dlrm_flags.check_args(args)
    cfg = dlrm_flags.run_config(values)
    run = build_run(cfg, torch.device("cpu"))
    load_checkpoint(path, run.model, verify=True)
    return {name: tensor.detach().clone() for name, tensor in run.model.state_dict().items()}


def test_cli_cache_of_a_host_table_trains_as_without_it_and_logs_its_hit_rate(cli, tmp_path):
    """Table 3 (1,000 rows) on the host behind 800 device rows (a test batch of 4,096 uses about
    570): losses and the final checkpoint equal the run that keeps it on the host uncached; the
    plan and the log state the cache."""
    logs = {name: str(tmp_path / f"{name}.json") for name in ("plain", "cached")}
    ckpts = {name: str(tmp_path / name) for name in logs}
    cli("dlrm.scripts.main", *fused_args(logs["plain"]), "--host_tables", "3", "--save_checkpoint_path",
        ckpts["plain"])
    out = cli("dlrm.scripts.main", *fused_args(logs["cached"]), "--host_tables", "3", "--host_table_cache_rows",
              "800", "--save_checkpoint_path", ckpts["cached"]).stdout
    assert "through 800 rows cached on the device" in out
    assert log_records(logs["cached"], "plan")[0]["host_cache_rows"] == 800
    plain, cached = ([r["loss"] for r in log_records(logs[n], "train")] for n in ("plain", "cached"))
    assert len(plain) == 1 and cached == pytest.approx(plain, rel=1e-5)
    hit_rate = log_records(logs["cached"], "host_cache")[0]["host_cache_hit_rate"]
    assert 0 < hit_rate <= 1 and not log_records(logs["plain"], "host_cache")
    args = fused_args(str(tmp_path / "load.json"))
    weights = [checkpoint_weights(ckpts[n], args) for n in ("plain", "cached")]
    assert weights[0].keys() == weights[1].keys()
    for name, tensor in weights[0].items():
        torch.testing.assert_close(weights[1][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("extra, says", [
    (["--host_tables", "3"], "--host_table_cache_rows needs --embedding_type=joint_fused"),
    (["--embedding_type", "joint_fused", "--host_tables", "none"], "--host_tables=none keeps none there"),
    (["--embedding_type", "joint_fused"], "every table fits on the device"),  # auto: none on the CPU
    # CUDA graphs are a CUDA feature: on a CPU the run drops --cuda_graphs with a note, so this refusal is CUDA's.
    pytest.param(["--embedding_type", "joint_fused", "--host_tables", "3", "--cuda_graphs", "--base_device", "cuda"],
                 "drop --cuda_graphs", marks=pytest.mark.gpu),
    # 32 KB: the device tables (14.5 KB) fit, not with 1,000 cached rows of 36 bytes and the slot map
    (["--embedding_type", "joint_fused", "--host_tables", "3", "--device_memory_gb", "0.00003"],
     "lower --host_table_cache_rows"),
])
def test_cli_refuses_a_host_cache_it_cannot_use_in_one_line(cli, tmp_path, extra, says):
    proc = cli("dlrm.scripts.main", *rowwise_adagrad_cli_args(str(tmp_path / "log.json")), "--max_steps", "1",
               "--host_table_cache_rows", "2000", *extra, check=False)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_cli_stops_in_one_line_when_a_batch_outgrows_the_cache(cli, tmp_path):
    """300 cache rows hold a training step's rows (batches of 512, power-law ids) but not those of
    the test batch of 4,096 (about 570 distinct rows of table 3): one line naming the flag, exit 2,
    and the trained steps saved before it."""
    ckpt = tmp_path / "ckpt"
    proc = cli("dlrm.scripts.main", *fused_args(str(tmp_path / "log.json")), "--host_tables", "3",
               "--host_table_cache_rows", "300", "--save_checkpoint_path", str(ckpt), check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --host_table_cache_rows=300 is too small"), proc.stderr
    assert log_records(str(tmp_path / "log.json"), "summary")[0]["stop_reason"] == "error"
    assert log_records(str(tmp_path / "log.json"), "checkpoint")[-1]["step"] == 16 and (ckpt / "meta.json").exists()


def _frequency_slope(ids: torch.Tensor, head: int) -> float:
    """Least-squares slope of log count against log (id + 1) over the ``head`` most frequent ids."""
    counts = torch.bincount(ids, minlength=head)[:head].double()
    x, y = torch.arange(1, head + 1, dtype=torch.float64).log(), counts.clamp(min=1).log()
    x, y = x - x.mean(), y - y.mean()
    return float((x * y).sum() / (x * x).sum())


@pytest.mark.parametrize("exponent", [0.8, 1.2])
def test_cli_zipf_exponent_draws_the_ids_of_synthetic_dataset_with_that_exponent(exponent):
    """``--synthetic_zipf_exponent x``: the run's data are ``SyntheticDataset(zipf_exponent=x)``'s,
    and their id frequencies fall with slope about -x."""
    args = ["--base_device", "cpu", "--synthetic_dataset_table_sizes", "100000,50",
            "--synthetic_dataset_num_entries", "65536", "--batch_size", "65536",
            "--synthetic_zipf_exponent", str(exponent)]
    cfg = dlrm_flags.run_config(dlrm_flags.check_args(args))
    assert cfg.data.synthetic_zipf_exponent == exponent
    spec_source = make_source(cfg.data, None, "train", 65536, torch.device("cpu"))
    ids = spec_source.read_batch(0).categorical
    reference = SyntheticDataset(13, [100000, 50], 65536, 65536, seed=cfg.seed, split="train",
                                 zipf_exponent=exponent).read_batch(0).categorical
    assert torch.equal(ids, reference)
    assert _frequency_slope(ids[:, 0].long(), 200) == pytest.approx(-exponent, abs=0.15)


@pytest.mark.parametrize("bad", ["0", "-1", "nan"])
def test_cli_refuses_a_zipf_exponent_that_is_not_positive(cli, bad):
    proc = cli("dlrm.scripts.main", "--base_device", "cpu", f"--synthetic_zipf_exponent={bad}", check=False)
    assert proc.returncode == 2 and re.search(r"--synthetic_zipf_exponent must be (positive|a finite number)", proc.stderr), \
        proc.stderr


# ---------------------------------------------------------------------------------------------
# host_table_cache_rows=auto

# The command-line run below: tables 30,300,4,1000,70 of dim 8 with row-wise Adagrad (36 bytes a
# device row), table 3 on the host; batches of 512 (the test's of 256).
AUTO_ARGS = ["--embedding_type", "joint_fused", "--host_tables", "3", "--host_table_cache_rows", "auto",
             "--test_batch_size", "256", "--synthetic_dataset_num_entries", "4096",
             "--synthetic_dataset_num_test_entries", "512"]
CACHED_ROW = 8 * 4 + 4 + 19  # values, the cached accumulator, the slot's bookkeeping


def test_planner_auto_caches_what_the_device_has_left_and_says_so():
    """``auto``: (capacity - device tables - reserve - 4 bytes per host row) // bytes a cached row,
    at most the host rows, at least one batch's rows (else a PlanError naming the setting)."""
    from dlrm.distributed.planner import PlanError, plan_tables, size_host_cache

    rows, dim, state = [1000, 5000, 200], 8, 4
    device = (1000 + 200) * (dim * 4 + state)

    def plan(capacity, batch_rows=(0, 300, 0)):
        return plan_tables(rows, dim, 1, capacity, host_tables=[1], host_cache_rows="auto", host_cache_reserve=7000,
                           host_cache_batch_rows=batch_rows, state_bytes_per_row=state)

    capacity = device + 7000 + 4 * 5000 + 1234 * CACHED_ROW + CACHED_ROW - 1
    chosen = plan(capacity)
    assert (chosen.host, chosen.host_cache_rows) == ([1], 1234)
    assert chosen.host_cache_bytes == 1234 * CACHED_ROW + 4 * 5000 and chosen.device_bytes(0) <= capacity
    said = size_host_cache(chosen, dim, 4, 7000, (0, 300, 0)).describe()
    assert (f"1,234 rows cached on the device = ({capacity:,} bytes of device - {device:,} bytes of device tables - "
            "7,000 bytes for the dense part and a batch's activations - 20,000 bytes of slot map") in said, said
    assert f"/ {CACHED_ROW} bytes a row (32 of values, 4 of row-wise Adagrad accumulator, 19 of slot bookkeeping)" \
        in said, said
    assert plan(10**9).host_cache_rows == 5000  # capped at the host rows
    with pytest.raises(PlanError, match=r"`host_table_cache_rows=auto` finds room for 299 cached rows .* fewer than "
                                        r"the 300 rows one batch may look up"):
        plan(device + 7000 + 4 * 5000 + 300 * CACHED_ROW - 1)
    assert plan_tables(rows, dim, 1, 10**9, host_cache_rows="auto").host_cache_rows == 0  # no host table


def test_run_config_takes_auto_and_the_flags_say_it():
    from dlrm.training.run_config import ParallelConfig, RunConfig

    for rows in ("auto", 7):
        cfg = RunConfig(model=dlrm_flags.run_config(dlrm_flags.check_args(["--embedding_type=joint_fused"])).model,
                        parallel=ParallelConfig(host_tables=[0], host_table_cache_rows=rows))
        assert dlrm_flags.run_config(dlrm_flags.check_args(dlrm_flags.config_args(cfg))) == cfg
    for bad in ("many", "8", -1, True, 2.0):
        with pytest.raises(ValueError, match=r'^`host_table_cache_rows` must be an integer >= 0 or "auto", got '):
            ParallelConfig(host_table_cache_rows=bad)


def test_cli_auto_sizes_the_cache_from_the_device_memory_and_trains(cli, tmp_path):
    """``--device_memory_gb 0.00075`` (805,306 bytes): less the device tables, the MLPs with their
    Adagrad state and a batch of 512's activations, and the slot map: the rows the log states,
    fewer than the host table's 1,000; the run trains through them."""
    from dlrm.model.dlrm import DLRM, DLRMConfig

    log = str(tmp_path / "log.json")
    out = cli("dlrm.scripts.main", *fused_args(log), *AUTO_ARGS, "--max_steps", "4", "--device_memory_gb",
              "0.00075").stdout
    config = DLRMConfig(13, [30, 300, 4, 1000, 70], 8, [16, 8], [32, 16, 1])
    model = DLRM(config)
    dense = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.embeddings.parameters())
    widths = 16 + 8 + model.interaction.num_outputs + 32 + 16 + 1  # bottom MLP, the interaction, top MLP
    reserve = dense * (4 + 4 + 4) + 512 * 4 * (4 * 5 * 8 + 2 * widths)
    device = (30 + 300 + 4 + 70) * (8 * 4 + 4)
    expected = (int(0.00075 * 2**30) - device - reserve - 4 * 1000) // CACHED_ROW
    assert 512 <= expected < 1000
    plan = log_records(log, "plan")[0]
    assert plan["host_cache_rows"] == plan["host_cache_auto"]["rows"] == expected
    assert f"host_table_cache_rows=auto: {expected:,} rows cached on the device" in out, out
    assert 0 < log_records(log, "host_cache")[0]["host_cache_hit_rate"] < 1


@pytest.mark.parametrize("extra, says", [
    (["--host_tables", "3"], "--host_table_cache_rows needs --embedding_type=joint_fused"),
    (["--embedding_type", "joint_fused", "--host_tables", "none"], "--host_tables=none keeps none there"),
    (["--embedding_type", "joint_fused"], "every table fits on the device"),  # host_tables auto: none on the CPU
    (AUTO_ARGS + ["--device_memory_gb", "0.0007"], "--host_table_cache_rows=auto finds room for 0 cached rows"),
])
def test_cli_refuses_an_auto_cache_it_cannot_use_in_one_line(cli, tmp_path, extra, says):
    proc = cli("dlrm.scripts.main", *rowwise_adagrad_cli_args(str(tmp_path / "log.json")), "--max_steps", "1",
               "--host_table_cache_rows", "auto", *extra, check=False)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
