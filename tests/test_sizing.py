"""Sizing a run (--mode plan): memory per process and the fewest processes that hold the model."""

import torch

from dlrm.distributed.sizing import USABLE_FRACTION, activation_bytes_per_sample, dense_parameters, size_processes
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.training.optimizers import OptimizerConfig

TABLES = [400_000, 250_000, 90_000, 5_000, 60, 3]
CONFIG = DLRMConfig(num_numerical_features=13, table_sizes=TABLES, embedding_dim=16,
                    bottom_mlp_sizes=[64, 16], top_mlp_sizes=[64, 32, 1])


def test_dense_parameters_are_the_model_s_parameters_outside_its_tables():
    model = DLRM(CONFIG, device="cpu")
    tables = sum(rows * CONFIG.embedding_dim for rows in TABLES)
    assert dense_parameters(CONFIG) == sum(p.numel() for p in model.parameters()) - tables


def test_the_fewest_processes_fit_and_one_fewer_does_not():
    row_bytes = CONFIG.embedding_dim * 4 + 4  # fp32 weights and a row-wise Adagrad state
    device = 12 * 2**20
    sizings = size_processes(CONFIG, 4096, device, list(range(1, 9)), state_bytes_per_row=4, dense_state_bytes=4)
    fits = [s.processes for s in sizings if s.plan is not None]
    assert fits and fits == list(range(fits[0], 9))  # more processes never stop fitting
    smallest = sizings[fits[0] - 1]
    assert fits[0] > 1 and sizings[fits[0] - 2].plan is None
    dense = dense_parameters(CONFIG) * (4 + 4 + 4)
    assert smallest.dense_bytes == dense
    assert smallest.activation_bytes == -(-4096 // fits[0]) * activation_bytes_per_sample(CONFIG, 4)
    # Every rank's tables fit what the device has left; all rows are placed once.
    left = int(USABLE_FRACTION * device) - smallest.dense_bytes - smallest.activation_bytes
    assert max(smallest.plan.rank_bytes(r) for r in range(fits[0])) <= left
    assert smallest.table_bytes == max(smallest.plan.rank_bytes(r) for r in range(fits[0]))
    assert sum(smallest.plan.rank_bytes(r) for r in range(fits[0])) == sum(TABLES) * row_bytes


def test_cli_plan_prints_the_fewest_processes_and_spark_settings(cli):
    sizes = ",".join(map(str, TABLES))
    args = ["dlrm.scripts.main", "--mode", "plan", "--synthetic_dataset_table_sizes", sizes, "--embedding_dim", "16",
            "--bottom_mlp_sizes", "64,16", "--top_mlp_sizes", "64,32,1", "--batch_size", "4096",
            "--optimizer", "rowwise_adagrad", "--device_memory_gb", str(12 / 1024)]
    out = cli(*args).stdout
    optimizer = OptimizerConfig(embedding="rowwise_adagrad")
    sizings = size_processes(CONFIG, 4096, int(12 / 1024 * 2**30), list(range(1, 65)),
                             state_bytes_per_row=optimizer.state_bytes_per_row(16),
                             dense_state_bytes=4 if optimizer.dense_optimizer == "adagrad" else 0)
    fewest = next(s.processes for s in sizings if s.plan is not None)
    assert f"Fewest processes: {fewest}." in out
    assert f"spark_train --num_processes {fewest} --use_gpu --spark_conf spark.task.resource.gpu.amount=1" in out
    proc = cli(*args[:-2], check=False)
    if not torch.cuda.is_available():
        assert proc.returncode == 2 and "pass --device_memory_gb" in proc.stderr
