"""fp16/bf16 embedding tables (``embedding_dtype``) on the torch paths: lookups in the compute
dtype, updates in fp32 arithmetic rounded once (checked against float64), stochastic rounding
unbiased and placement-independent, layouts and processes agreeing, checkpoints, the planner's
bytes and the command line. The fused kernels' half-precision updates are in
test_half_weight_kernels.py."""

import json
import os

import pytest
import torch
import torch.distributed as dist

from dlrm.data.rank_source import RankSource
from dlrm.data.synthetic import SyntheticDataset
from dlrm.distributed.exchange import EmbeddingExchange
from dlrm.distributed.planner import plan_tables, table_bytes
from dlrm.engine.collectives import ProcessGroupCollectives
from dlrm.kernels.rounding import round_to, stochastic_round_bf16
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.embeddings import JointEmbedding, MultiTableEmbedding
from dlrm.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from dlrm.training.optimizers import EmbeddingSGD, OptimizerConfig, RowWiseAdagrad, make_optimizer
from dlrm.training.train import make_train_step, train_step
from test_distributed import free_port
from test_optimizers import rowwise_adagrad_cli_args
from conftest import spawn

CPU = torch.device("cpu")
HALF = [torch.float16, torch.bfloat16]
TABLES = [3, 200, 17, 50]
LR, STEPS, BATCH = 0.05, 5, 64


def model_config(embedding_type="joint", embedding_dtype="bf16"):
    return DLRMConfig(4, TABLES, 8, [16, 8], [32, 16, 1], embedding_type=embedding_type,
                      embedding_dtype=embedding_dtype)


def data(split="train", rows=STEPS * BATCH):
    return SyntheticDataset(4, TABLES, rows, BATCH, seed=3, split=split)


def train(model, optimizer, start, steps):
    precision = Precision("cpu")
    source = data()
    return [float(train_step(model, source.read_batch(i), optimizer, precision.grad_scaler(), precision))
            for i in range(start, start + steps)]


def spacing(x: torch.Tensor) -> torch.Tensor:
    """The distance from each half value to its neighbour away from zero, in float64."""
    up = torch.nextafter(x, torch.full_like(x, float("inf")) * x.sign().where(x != 0, 1))
    return (up.double() - x.double()).abs()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("layout", [JointEmbedding, MultiTableEmbedding])
def test_lookups_give_the_compute_dtype_and_start_from_the_fp32_weights_rounded(layout, dtype):
    half = layout([30, 7], 8, init_seed=5, weight_dtype=dtype)
    full = layout([30, 7], 8, init_seed=5)
    for i in range(2):
        assert half.table_weight(i).dtype == dtype
        assert torch.equal(half.table_weight(i), full.table_weight(i).to(dtype))
    ids = torch.tensor([[1, 2], [29, 6]])
    assert half(ids).dtype == torch.float32  # half storage never reaches an fp32 model
    assert torch.equal(half(ids), full(ids).to(dtype).float())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert half(ids).dtype == torch.bfloat16


def _sparse_step(optimizer_cls, dtype, stochastic=False, **kwargs):
    """One step on a table whose row 1 is looked up 300 times in the batch: the rule as run,
    and the float64 reference (old row upcast, gradients summed in float64, rounded once)."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter((torch.randn(6, 16) * 0.05).to(dtype))
    ids = torch.cat([torch.full((300,), 1), torch.tensor([0, 3, 3, 5])])
    upstream = torch.randn(ids.shape[0], 16) * 1e-2
    old = weight.detach().double().clone()
    (torch.nn.functional.embedding(ids, weight, sparse=True).float() * upstream).sum().backward()
    optimizer = optimizer_cls([weight], lr=0.7, stochastic_rounding=stochastic, **kwargs)
    optimizer.step()
    g = torch.zeros(6, 16, dtype=torch.float64).index_add_(0, ids, upstream.double().to(dtype).double())
    return weight.detach(), old, g


@pytest.mark.parametrize("dtype", HALF)
def test_sgd_on_half_tables_is_fp32_arithmetic_rounded_once(dtype):
    new, old, g = _sparse_step(EmbeddingSGD, dtype)
    expected = old - 0.7 * g  # untouched rows: g == 0
    off = (new.double() - expected.to(dtype).double()).abs()
    assert (off <= spacing(new)).all()  # at most one unit in the last place (fp32 vs float64 near a tie)
    assert (off == 0).float().mean() > 0.95
    assert torch.equal(new[[2, 4]].double(), old[[2, 4]])
    # the hot row's 300 gradients summed in bf16/fp16 would land elsewhere: the sum really is fp32
    naive = (old[1] - 0.7 * g[1].to(dtype).double()).to(dtype)
    assert not torch.equal(naive, new[1])


@pytest.mark.parametrize("dtype", HALF)
def test_rowwise_adagrad_on_half_tables_is_fp32_arithmetic_rounded_once(dtype):
    new, old, g = _sparse_step(RowWiseAdagrad, dtype, eps=1e-8)
    used = g.abs().sum(dim=1) > 0
    state = (g * g).mean(dim=1)
    expected = old.clone()
    expected[used] -= 0.7 * g[used] / (state[used].sqrt() + 1e-8).unsqueeze(1)
    off = (new.double() - expected.to(dtype).double()).abs()
    assert (off <= spacing(new)).all()
    assert (off == 0).float().mean() > 0.95


def test_stochastic_rounding_moves_a_weight_by_updates_below_its_spacing_on_average():
    """lr * g is 1/8 of bf16's spacing at 1.0: round to nearest never moves the weight, the
    stochastic rounding moves it by lr * g per step on average (unbiased)."""
    steps, step_size = 400, 2**-7 / 8
    for stochastic, lower, upper in [(False, 0.0, 0.0), (True, 0.8, 1.2)]:
        weight = torch.nn.Parameter(torch.ones(1, 256, dtype=torch.bfloat16))
        optimizer = EmbeddingSGD([weight], lr=1.0, stochastic_rounding=stochastic)
        for _ in range(steps):
            weight.grad = torch.sparse_coo_tensor([[0]], torch.full((1, 256), -step_size), (1, 256)).to(torch.bfloat16)
            optimizer.step()
        moved = (weight.detach().double() - 1).mean() / (steps * step_size)
        assert lower <= float(moved) <= upper, (stochastic, float(moved))


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    x = torch.rand(64, 128) * 2 - 1
    draws = torch.stack([stochastic_round_bf16(x, step).double() for step in range(300)])
    down = x.to(torch.bfloat16).double()
    lo = torch.minimum(down, torch.nextafter(x.to(torch.bfloat16), torch.full_like(x, -2).bfloat16()).double())
    hi = torch.maximum(down, torch.nextafter(x.to(torch.bfloat16), torch.full_like(x, 2).bfloat16()).double())
    lo = torch.where(down <= x.double(), down, lo)
    hi = torch.where(down >= x.double(), down, hi)
    assert ((draws == lo) | (draws == hi)).all()
    # mean error over 300 draws: spacing * sqrt(p(1-p)/300) <= spacing / 34 per element; averaged over 8192
    bias = (draws.mean(dim=0) - x.double()) / (hi - lo).clamp(min=1e-30)
    assert bias.mean().abs() < 0.01 and bias.abs().max() < 0.3
    assert torch.equal(round_to(x, torch.float16, 3), x.half())  # fp16 always rounds to nearest


def test_joint_and_multi_table_layouts_train_bf16_tables_identically():
    """The stochastic draws are keyed by value, column and step, not by where a row is stored."""
    results = []
    for layout in ("joint", "multi_table"):
        torch.manual_seed(0)
        model = DLRM(model_config(layout))
        optimizer = make_optimizer(model, LR, OptimizerConfig("rowwise_adagrad", "adagrad"))
        losses = train(model, optimizer, 0, STEPS)
        results.append((losses, [model.embeddings.table_weight(i).clone() for i in range(len(TABLES))]))
    assert results[0][0] == results[1][0]
    for a, b in zip(results[0][1], results[1][1]):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)


def test_adagrad_is_refused_for_half_tables_and_the_planner_counts_two_bytes_a_value():
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="`optimizer=rowwise_adagrad`"):
        make_optimizer(DLRM(model_config()), LR, OptimizerConfig("adagrad"))
    assert table_bytes([10, 1000], 16, 4, bytes_per_value=2) == [10 * (32 + 4), 1000 * (32 + 4)]
    rows = [256, 256]  # fp32: 32 KiB, more than a 24 KiB device; bf16: 16 KiB, fits
    with pytest.raises(ValueError, match="fits on no rank"):
        plan_tables(rows, 16, 1, 24 * 1024)
    assert plan_tables(rows, 16, 1, 24 * 1024, bytes_per_value=2).tables == [[0, 1]]


def test_resume_repeats_the_uninterrupted_run_bit_for_bit(tmp_path):
    """The rounding key (``rounding_step``) is checkpointed: a resumed run draws as the
    uninterrupted one does. Restarting the key instead changes the result."""
    cfg = OptimizerConfig("sgd")
    torch.manual_seed(0)
    model = DLRM(model_config())
    full = train(model, make_optimizer(model, LR, cfg), 0, STEPS)
    torch.manual_seed(0)
    first = DLRM(model_config())
    optimizer = make_optimizer(first, LR, cfg)
    part = train(first, optimizer, 0, 2)
    save_checkpoint(str(tmp_path / "ck"), first, optimizer, None, TrainState(step=2))
    outcomes = []
    for restore_key in (True, False):
        torch.manual_seed(7)
        resumed = DLRM(model_config())
        resumed_optimizer = make_optimizer(resumed, LR, cfg)
        load_checkpoint(str(tmp_path / "ck"), resumed, resumed_optimizer)
        if not restore_key:
            resumed_optimizer.embeddings.param_groups[0]["rounding_step"] = 0
        losses = part + train(resumed, resumed_optimizer, 2, STEPS - 2)
        outcomes.append(torch.equal(resumed.embeddings.weight, model.embeddings.weight) and losses == full)
    assert outcomes == [True, False]


def test_checkpoints_move_between_fp32_and_half_tables(tmp_path):
    torch.manual_seed(0)
    fp32 = DLRM(model_config(embedding_dtype="fp32"))
    save_checkpoint(str(tmp_path / "fp32"), fp32, None, None, TrainState())
    half = DLRM(model_config(embedding_dtype="bf16"))
    load_checkpoint(str(tmp_path / "fp32"), half)
    assert torch.equal(half.embeddings.weight, fp32.embeddings.weight.to(torch.bfloat16))
    save_checkpoint(str(tmp_path / "bf16"), half, None, None, TrainState())
    back = DLRM(model_config(embedding_dtype="fp32"))
    load_checkpoint(str(tmp_path / "bf16"), back)
    assert torch.equal(back.embeddings.weight, half.embeddings.weight.float())


def _rank_worker(rank, world, port, plan, out_dir):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DLRM(model_config(), tables=plan[rank])
    model.exchange = EmbeddingExchange(plan, rank)
    collectives = ProcessGroupCollectives(CPU)
    optimizer = make_optimizer(model, LR, OptimizerConfig("rowwise_adagrad", "adagrad"))
    precision = Precision("cpu")
    source = RankSource(lambda *args: data(), plan[rank], rank, world)
    losses = [float(collectives.sum(train_step(model, source.read_batch(i), optimizer, precision.grad_scaler(),
                                               precision, collectives))) for i in range(STEPS)]
    torch.save({"losses": losses, "tables": {t: model.embeddings.table_weight(i).clone()
                                             for i, t in enumerate(plan[rank])}},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_two_processes_train_bf16_tables_as_one_process_does(tmp_path):
    """Row-wise Adagrad on bf16 tables with stochastic rounding, tables split over 2 gloo
    processes, against one process: the same losses and the same bf16 tables (the dense
    gradients are summed in another order, so a rounding may flip by one unit)."""
    plan = [[1, 2], [3, 0]]
    spawn(_rank_worker, args=(2, free_port(), plan, str(tmp_path)), nprocs=2)
    torch.manual_seed(0)
    single = DLRM(model_config())
    losses = train(single, make_optimizer(single, LR, OptimizerConfig("rowwise_adagrad", "adagrad")), 0, STEPS)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)
        for t, weight in result["tables"].items():
            expected = single.embeddings.table_weight(t)
            off = (weight.double() - expected.double()).abs()
            assert (off <= spacing(expected)).all(), t
            assert (off == 0).float().mean() > 0.99, t


def test_cli_trains_bf16_tables_and_plans_half_the_bytes(cli, tmp_path):
    log = str(tmp_path / "log.json")
    common = rowwise_adagrad_cli_args(log) + ["--max_steps", "48"]
    out = cli("dlrm.scripts.main", *common, "--embedding_dtype", "bf16").stdout
    rows = 30 + 300 + 4 + 1000 + 70
    assert f"{rows * (8 * 2 + 4):,} bytes in all" in out, out  # 2 bytes a value + the row's accumulator
    summary = [json.loads(line) for line in open(log) if json.loads(line)["type"] == "summary"][-1]
    assert summary["best_auc"] > 0.6, out
    proc = cli("dlrm.scripts.main", *common, "--embedding_dtype", "fp16", "--optimizer", "adagrad", check=False)
    assert proc.returncode == 2 and "--optimizer=rowwise_adagrad" in proc.stderr, proc.stderr


def test_bf16_tables_export_as_bf16_and_run_in_onnx_runtime_and_torchscript(tmp_path):
    """The files keep the tables in bf16 (half the bytes) with a cast after the gather, and
    score as the eager model does."""
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from dlrm.inference.export import check_export, export_onnx, export_torchscript

    torch.manual_seed(0)
    model = DLRM(model_config("multi_table")).eval()
    export_onnx(model, str(tmp_path / "model.onnx"))
    export_torchscript(model, str(tmp_path / "model.pt"))
    initializers = {init.data_type for init in onnx.load(str(tmp_path / "model.onnx")).graph.initializer
                    if len(init.dims) == 2 and init.dims[1] == 8 and init.dims[0] in TABLES}
    assert initializers == {onnx.TensorProto.BFLOAT16}
    for name in ("model.onnx", "model.pt"):
        errors = check_export(model, str(tmp_path / name), batch_sizes=(1, 64))
        assert all(0 <= e <= 1e-5 for e in errors.values()), (name, errors)


@pytest.mark.parametrize("embedding", ["sgd", "rowwise_adagrad"])
def test_fused_kernels_train_bf16_tables_as_the_torch_path_does(embedding, tmp_path):
    """``joint_fused`` (the kernels, in Triton's interpreter here) against ``joint`` (torch's
    sparse gradients and the optimizers above), bf16 tables with stochastic rounding and the
    same rounding keys (``take_rounding_step``), under bf16 autocast (so both get bf16 gradients:
    outside autocast torch's autograd rounds a bf16 weight's gradient rows to bf16 while the
    kernels keep them fp32). The two compute the fp32 rows in another order, and a last-bit
    difference gives another draw, so after one step a few entries may differ, each by one unit;
    the losses of a few steps agree. The fused run's key survives its checkpoint."""
    cfg = OptimizerConfig(embedding, "sgd")
    runs = {}
    for layout in ("joint", "joint_fused"):
        torch.manual_seed(0)
        model = DLRM(model_config(layout))
        optimizer = make_optimizer(model, LR, cfg)
        precision = Precision("cpu", torch.bfloat16)
        step = make_train_step(model, optimizer, precision.grad_scaler(), precision)
        source = data()
        losses = [float(step(source.read_batch(0)))]
        first = model.embeddings.weight.detach().clone()
        losses += [float(step(source.read_batch(i))) for i in range(1, STEPS)]
        runs[layout] = (losses, first, model, optimizer)
    (joint_losses, joint_first, _, _), (fused_losses, fused_first, fused, fused_optimizer) = runs.values()
    torch.testing.assert_close(torch.tensor(fused_losses), torch.tensor(joint_losses), rtol=1e-3, atol=0)
    assert fused_first.dtype == torch.bfloat16
    off = (fused_first.double() - joint_first.double()).abs()
    assert (off <= torch.maximum(spacing(joint_first), spacing(fused_first))).all()
    assert (off == 0).float().mean() > 0.95
    assert fused_optimizer.embeddings.param_groups[0]["rounding_step"] == STEPS
    save_checkpoint(str(tmp_path / "ck"), fused, fused_optimizer, None, TrainState(step=STEPS))
    resumed = DLRM(model_config("joint_fused"))
    resumed_optimizer = make_optimizer(resumed, LR, cfg)
    load_checkpoint(str(tmp_path / "ck"), resumed, resumed_optimizer)
    assert resumed_optimizer.take_rounding_step() == STEPS
