"""Tables kept in host memory (``DLRM(..., host_tables=[...])``): looked up on the host and merged
with the device's tables in global order. Against the same model with every table on the device:
the same initial weights and lookups (bit for bit), the same training steps with every layout and
optimizer (float64, to the order of additions: sparse gradients of repeated rows are summed in
whatever order coalescing gives), and checkpoints that move between the two placements. On a CPU
machine host and device are the same memory; the ``gpu`` test runs the real transfer."""

import pytest
import torch

from dlrm.data.batch import Batch
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.table_spec import TableShard
from dlrm.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from dlrm.training.optimizers import OptimizerConfig, make_optimizer
from dlrm.training.train import make_train_step
from test_fused_rowwise_adagrad import POOLINGS, TABLES, batches  # skewed one-hot ids, or bags

HOST = [1, 3]


def config(embedding_type, dtype="fp32"):
    return DLRMConfig(4, TABLES, 8, [16, 8], [32, 16, 1], embedding_type=embedding_type, poolings=POOLINGS,
                      embedding_dtype=dtype)


def build(embedding_type, host_tables=(), device=None, dtype="fp32"):
    torch.manual_seed(0)
    return DLRM(config(embedding_type, dtype), device=device, host_tables=host_tables)


def tables_of(model):
    """Every table's weight by global index, wherever it is kept."""
    return {module.table_indices[i]: module.table_weight(i) for module in model.embedding_modules()
            for i in range(module.num_tables)}


def steps(model, optimizer, data):
    precision = Precision("cpu")
    step = make_train_step(model, optimizer, precision.grad_scaler(), precision)
    return [float(step(batch)) for batch in data]


@pytest.mark.parametrize("embedding_type", ["joint", "multi_table", "joint_fused"])
@pytest.mark.parametrize("host", [HOST, list(range(len(TABLES)))], ids=["some", "all"])
def test_host_tables_hold_the_same_weights_and_give_the_same_lookups(embedding_type, host):
    on_device, split = build(embedding_type), build(embedding_type, host)
    assert split.host_embeddings.table_indices == host
    assert split.embeddings.table_indices == [t for t in range(len(TABLES)) if t not in host]
    assert split.host_embeddings.table_weight(0).device.type == "cpu"
    dense = {k: v for k, v in on_device.state_dict().items() if not k.startswith("embeddings.")}
    for name, value in dense.items():  # the layers built after the tables drew the same weights
        assert torch.equal(split.state_dict()[name], value), name
    for table, weight in tables_of(on_device).items():
        assert torch.equal(tables_of(split)[table], weight), table
    for batch in batches("one_hot", 1) + batches("bags", 1):
        assert torch.equal(split.embed(batch.categorical), on_device.embed(batch.categorical))
        assert torch.equal(split(batch.numerical, batch.categorical), on_device(batch.numerical, batch.categorical))


@pytest.mark.parametrize(
    "embedding_type,optimizer,kind,dtype",
    [("joint", "sgd", "one_hot", "fp32"), ("joint", "adagrad", "bags", "fp32"), ("multi_table", "sgd", "bags", "fp32"),
     ("joint_fused", "rowwise_adagrad", "one_hot", "fp32"), ("joint_fused", "sgd", "bags", "fp32"),
     ("joint_fused", "sgd", "one_hot", "bf16")],  # bf16: stochastic rounding keyed by the step counter
)
def test_training_with_host_tables_equals_training_on_the_device(embedding_type, optimizer, kind, dtype):
    data = batches(kind)
    models = [build(embedding_type, host, dtype=dtype) for host in ((), HOST)]
    if dtype == "fp32":
        models = [m.double() for m in models]
    # bf16 tables: the fp32 sum of a row's repeated gradients may round differently, then the
    # row by a bf16 step (2.4e-4 near 0.06), and the steps after add up (3 such steps seen);
    # everything else is float64
    rtol, atol = (1e-12, 1e-15) if dtype == "fp32" else (2**-7, 2e-3)
    optimizers = [make_optimizer(m, 0.3, OptimizerConfig(embedding=optimizer)) for m in models]
    losses = [steps(m, o, data) for m, o in zip(models, optimizers)]
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=rtol, atol=0)
    for table, weight in tables_of(models[0]).items():
        torch.testing.assert_close(tables_of(models[1])[table], weight, rtol=rtol, atol=atol, msg=str(table))
    dense = [{k: v for k, v in m.state_dict().items() if "embeddings." not in k} for m in models]
    for name, value in dense[0].items():
        torch.testing.assert_close(dense[1][name], value, rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("saved_host,loaded_host", [(HOST, ()), ((), HOST), (HOST, [0, 2])])
def test_checkpoints_move_between_host_and_device_placements(tmp_path, saved_host, loaded_host):
    """Row-wise Adagrad (per-row state saved with each table): 2 steps, save, 2 more steps in the
    other placement equal 4 uninterrupted steps."""
    data = batches("one_hot")
    reference = build("joint_fused").double()
    ref_opt = make_optimizer(reference, 0.3, OptimizerConfig(embedding="rowwise_adagrad"))
    ref_losses = steps(reference, ref_opt, data)

    first = build("joint_fused", saved_host).double()
    first_opt = make_optimizer(first, 0.3, OptimizerConfig(embedding="rowwise_adagrad"))
    steps(first, first_opt, data[:2])
    precision = Precision("cpu")
    save_checkpoint(str(tmp_path / "ckpt"), first, first_opt, precision.grad_scaler(), TrainState(step=2))
    resumed = build("joint_fused", loaded_host).double()
    resumed_opt = make_optimizer(resumed, 0.3, OptimizerConfig(embedding="rowwise_adagrad"))
    assert load_checkpoint(str(tmp_path / "ckpt"), resumed, resumed_opt, precision.grad_scaler()).step == 2
    torch.testing.assert_close(torch.tensor(steps(resumed, resumed_opt, data[2:])), torch.tensor(ref_losses[2:]),
                               rtol=1e-12, atol=0)
    for table, weight in tables_of(reference).items():
        torch.testing.assert_close(tables_of(resumed)[table], weight, rtol=1e-12, atol=1e-15, msg=str(table))


def test_host_tables_must_be_whole_tables_of_the_model():
    cfg = config("joint")
    with pytest.raises(ValueError, match="`host_tables` lists table 7, which is not among the tables built here"):
        DLRM(cfg, host_tables=[7])
    with pytest.raises(ValueError, match="`host_tables` lists table 1, a row-wise block"):
        DLRM(cfg, tables=[0, TableShard(1, 0, 100)], host_tables=[1])


@pytest.mark.gpu
@pytest.mark.parametrize("embedding_type", ["joint", "joint_fused"])
def test_host_tables_on_a_gpu_run_train_as_tables_on_the_gpu(embedding_type):
    """The real transfer: ids to the host, embeddings back, gradients to the host tables."""
    cuda = torch.device("cuda")
    data = [Batch(b.numerical.to(cuda), b.categorical.to(cuda), b.label.to(cuda)) for b in batches("one_hot")]
    models = [build(embedding_type, host, device=cuda) for host in ((), HOST)]
    assert models[1].host_embeddings.table_weight(0).device.type == "cpu"
    optimizers = [make_optimizer(m, 0.3) for m in models]
    losses = []
    for model, optimizer in zip(models, optimizers):
        precision = Precision("cuda")
        step = make_train_step(model, optimizer, precision.grad_scaler(), precision)
        losses.append([float(step(batch)) for batch in data])
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=1e-5, atol=1e-6)
    for table, weight in tables_of(models[0]).items():
        torch.testing.assert_close(tables_of(models[1])[table].cpu(), weight.cpu(), rtol=1e-5, atol=1e-6)


def test_cli_keeps_the_listed_tables_on_the_host_and_trains_as_without(cli, tmp_path):
    """``--host_tables 1,3`` (on a CPU run host and device memory are one, but the host path runs):
    the plan says where the tables are, the losses equal the run with every table on the device,
    and the checkpoint tests the same without host tables."""
    import json

    from test_optimizers import rowwise_adagrad_cli_args

    def records(log, kind):
        return [r for r in map(json.loads, open(log)) if r["type"] == kind]

    base = ["--max_steps", "16"]
    plain_log, host_log, test_log = (str(tmp_path / f"{n}.json") for n in ("plain", "host", "test"))
    ckpt = str(tmp_path / "ckpt")
    cli("dlrm.scripts.main", *rowwise_adagrad_cli_args(plain_log), *base)
    out = cli("dlrm.scripts.main", *rowwise_adagrad_cli_args(host_log), *base, "--host_tables", "1,3",
              "--save_checkpoint_path", ckpt).stdout
    assert "2 in host memory" in out and "host memory: tables 1, 3 (1,300 rows" in out
    assert records(host_log, "plan")[0]["host"] == [1, 3]
    plain, host = ([r["loss"] for r in records(log, "train")] for log in (plain_log, host_log))
    assert len(host) == 1 and host == pytest.approx(plain, rel=1e-5)
    cli("dlrm.scripts.main", *rowwise_adagrad_cli_args(test_log), "--mode", "test", "--load_checkpoint_path", ckpt,
        "--host_tables", "none")
    assert records(test_log, "summary")[0]["auc"] == pytest.approx(records(host_log, "summary")[0]["best_auc"],
                                                                    abs=1e-6)
    proc = cli("dlrm.scripts.main", *rowwise_adagrad_cli_args(test_log), "--host_tables", "1,x", check=False)
    assert proc.returncode == 2 and "--host_tables must be a comma-separated list" in proc.stderr
