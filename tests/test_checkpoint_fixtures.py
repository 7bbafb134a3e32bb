"""Checkpoints written by an earlier version still load (tests/fixtures/checkpoints, 45 KB).

Both were written by commit 8160d67, the last one before the checkpoint store:
- dlrm_row_wise_2_processes: two gloo processes, DLRMConfig(num_numerical_features=3,
  table_sizes=[7, 3], embedding_dim=4, bottom_mlp_sizes=[8, 4], top_mlp_sizes=[8, 1]) with
  table 0 split row-wise (rows 0-3 and 3-7) and table 1 whole, embedding Adagrad (its state
  filled with random values), TrainState(step=3, epoch=1, sample_in_epoch=64, batch_size=32);
- autoencoder_2_processes: ``torchrun --nproc_per_node 2 -m dlrm.scripts.recommender_train``,
  3 steps of Adam on 41 synthetic items (rows 0-21 and 21-41 per process), hidden layer of 4.

The reference is the files themselves, read with plain ``torch.load`` and joined with
``torch.cat``; each loads on one process and on another split than it was written with.
"""

import os

import pytest
import torch

from conftest import REPO
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.nn.table_spec import TableShard
from dlrm.recommender import checkpoint as autoencoder
from dlrm.recommender.item_parallel import ItemParallel
from dlrm.recommender.train import make_optimizer as autoencoder_optimizer
from dlrm.training.checkpoint import load_checkpoint, read_meta
from dlrm.training.optimizers import OptimizerConfig, make_optimizer

FIXTURES = os.path.join(REPO, "tests", "fixtures", "checkpoints")
DLRM_CKPT = os.path.join(FIXTURES, "dlrm_row_wise_2_processes")
AE_CKPT = os.path.join(FIXTURES, "autoencoder_2_processes")


def _file(path: str, name: str):
    return torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)


def _joined(path: str, names: list[str], key: str | None = None) -> torch.Tensor:
    return torch.cat([_file(path, name) if key is None else _file(path, name)[key] for name in names])


TABLE_FILES = {0: ["table_0_rows_0_3.pt", "table_0_rows_3_7.pt"], 1: ["table_1.pt"]}


@pytest.mark.parametrize("tables", [None, [TableShard(0, 2, 6), 1], [TableShard(0, 6, 7), TableShard(0, 0, 2)]],
                         ids=["whole", "rows_2_6", "two_blocks"])
def test_dlrm_checkpoint_of_two_row_wise_processes_loads(tables):
    meta = read_meta(DLRM_CKPT)
    config = DLRMConfig(**meta["model_config"])
    torch.manual_seed(5)
    model = DLRM(config, tables=tables)
    optimizer = make_optimizer(model, 9.0, OptimizerConfig("adagrad", "sgd"))
    state = load_checkpoint(DLRM_CKPT, model, optimizer)
    assert (state.step, state.epoch, state.sample_in_epoch, state.batch_size, state.best_auc) == (3, 1, 64, 32, 0.6)
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.1]
    dense = _file(DLRM_CKPT, "dense.pt")
    for name, value in dense.items():
        assert torch.equal(model.state_dict()[name], value), name
    for module in model.embedding_modules():
        for i in range(module.num_tables):
            table = module.table_indices[i]
            start, stop = module.row_range(i)
            weight = _joined(DLRM_CKPT, TABLE_FILES[table])
            assert torch.equal(module.table_weight(i), weight[start:stop])
            param, offset = module.table_parameter(i)
            saved = _joined(DLRM_CKPT, [n[:-3] + "_optimizer.pt" for n in TABLE_FILES[table]], "sum")
            live = optimizer.embedding_state(param)["sum"][offset:offset + stop - start]
            assert torch.equal(live, saved[start:stop]) and saved.abs().sum() > 0


ITEM_FILES = {"input": ["input_rows_0_21.pt", "input_rows_21_41.pt"],
              "output": ["output_rows_0_21.pt", "output_rows_21_41.pt"]}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_autoencoder_checkpoint_of_two_processes_loads(world):
    for rank in range(world):
        model = autoencoder.load_model(AE_CKPT, ItemParallel(rank, world))
        optimizer = autoencoder_optimizer(model, model.config.optimizer)
        state = autoencoder.load(AE_CKPT, model, optimizer)
        assert (state.epoch, state.batch, state.step, state.samples) == (1, 0, 3, 60)
        for kind, param, key, (start, stop) in [("input", model.input_weight, "weight", model.input_range),
                                                 ("output", model.output_weight, "weight", model.output_range),
                                                 ("output", model.output_bias, "bias", model.output_range)]:
            assert torch.equal(param.detach(), _joined(AE_CKPT, ITEM_FILES[kind], key)[start:stop])
            saved = [_file(AE_CKPT, name)["state"][key] for name in ITEM_FILES[kind]]
            live = optimizer.state[param]
            assert torch.equal(live["exp_avg_sq"], torch.cat([s["exp_avg_sq"] for s in saved])[start:stop])
            assert torch.equal(live["step"], saved[0]["step"]) and float(live["step"]) == 3
        replicated = _file(AE_CKPT, "replicated.pt")
        assert torch.equal(model.input_bias.detach(), replicated["params"]["input_bias"])
        assert torch.equal(optimizer.state[model.input_bias]["exp_avg"], replicated["state"]["input_bias"]["exp_avg"])
