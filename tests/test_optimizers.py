"""Embedding and dense optimizers against plainly written float64 references; fp16 skips;
checkpoints of their state (exact resume, another number of processes); the planner's bytes."""

import copy
import os

import pytest
import torch
import torch.distributed as dist

from dlrm.data.rank_source import RankSource
from dlrm.data.synthetic import SyntheticDataset
from dlrm.distributed.exchange import EmbeddingExchange
from dlrm.distributed.planner import plan_tables, table_bytes
from dlrm.engine.collectives import ProcessGroupCollectives
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.training.checkpoint import CheckpointError, TrainState, load_checkpoint, save_checkpoint
from dlrm.training.optimizers import EmbeddingAdam, OptimizerConfig, RowWiseAdagrad, make_optimizer
from dlrm.training.train import fused_train_step, train_step
from test_distributed import free_port
from conftest import spawn

CPU = torch.device("cpu")
TABLES = [3, 200, 17, 50]
LR, EPS, STEPS, BATCH = 0.05, 1e-8, 5, 64
COMBINATIONS = [("sgd", "sgd"), ("adagrad", "adagrad"), ("rowwise_adagrad", "adagrad"), ("rowwise_adagrad", "adam"),
                ("adagrad", "sgd"), ("sgd", "adam"), ("adam", "adam"), ("adam", "sgd")]


def model_config(embedding_type="joint"):
    return DLRMConfig(4, TABLES, 8, [16, 8], [32, 16, 1], embedding_type=embedding_type)


def data(split="train", rows=STEPS * BATCH):
    return SyntheticDataset(4, TABLES, rows, BATCH, seed=3, split=split)


class PlainReference:
    """The optimizers written out on dense float64 gradients, independent of torch.optim and of
    sparse tensors: a row the batch did not use has a zero gradient, which these updates leave alone."""

    def __init__(self, embedding: str, dense: str, initial: float = 0.0):
        self.embedding, self.dense, self.state, self.t = embedding, dense, {}, 0
        self.initial = initial  # Adagrad's and row-wise Adagrad's accumulators start here

    def step(self, params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor]) -> None:
        self.t += 1
        for name, p in params.items():
            g = grads[name]
            kind = self.embedding if name.startswith("embeddings.") else self.dense
            s = self.state.setdefault(name, {})
            if kind == "sgd":
                p -= LR * g
            elif kind == "adagrad":
                s["sum"] = s.get("sum", torch.full_like(p, self.initial)) + g * g
                p -= LR * g / (s["sum"].sqrt() + EPS)
            elif kind == "rowwise_adagrad":
                s["sum"] = s.get("sum", torch.full((p.shape[0],), self.initial, dtype=p.dtype)) + (g * g).mean(dim=1)
                p -= LR * g / (s["sum"].sqrt() + EPS).unsqueeze(1)
            elif name.startswith("embeddings."):  # adam tables: SparseAdam's lazy rule, only the rows used
                b1, b2 = 0.9, 0.999
                used = (g != 0).any(dim=1)
                m, v = s.setdefault("m", torch.zeros_like(p)), s.setdefault("v", torch.zeros_like(p))
                m[used] = b1 * m[used] + (1 - b1) * g[used]
                v[used] = b2 * v[used] + (1 - b2) * g[used] ** 2
                step_size = LR * (1 - b2**self.t) ** 0.5 / (1 - b1**self.t)
                p[used] -= step_size * m[used] / (v[used].sqrt() + EPS)
            else:  # adam, torch's defaults betas (0.9, 0.999)
                b1, b2 = 0.9, 0.999
                s["m"] = b1 * s.get("m", torch.zeros_like(p)) + (1 - b1) * g
                s["v"] = b2 * s.get("v", torch.zeros_like(p)) + (1 - b2) * g * g
                m_hat, v_hat = s["m"] / (1 - b1**self.t), s["v"] / (1 - b2**self.t)
                p -= LR * m_hat / (v_hat.sqrt() + EPS)


def reference_run(embedding: str, dense: str, initial: float = 0.0) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = DLRM(model_config()).double()
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    reference = PlainReference(embedding, dense, initial)
    source, losses = data(), []
    for i in range(STEPS):
        batch = source.read_batch(i)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(params[name])
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(batch.numerical, batch.categorical), batch.label.double())
        loss.backward()
        grads = {n: (p.grad.to_dense() if p.grad.is_sparse else p.grad) for n, p in model.named_parameters()}
        reference.step(params, grads)
        losses.append(float(loss.detach()))
    return losses, params


@pytest.mark.parametrize("embedding,dense", COMBINATIONS)
@pytest.mark.parametrize("embedding_type", ["joint", "multi_table"])
def test_each_optimizer_matches_its_plain_float64_reference(embedding, dense, embedding_type):
    torch.manual_seed(0)
    model = DLRM(model_config(embedding_type)).double()
    optimizer = make_optimizer(model, LR, OptimizerConfig(embedding, dense, eps=EPS))
    precision = Precision("cpu")
    source = data()
    losses = [float(train_step(model, source.read_batch(i), optimizer, precision.grad_scaler(), precision))
              for i in range(STEPS)]
    ref_losses, ref_params = reference_run(embedding, dense)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-10, atol=0)
    for name, value in model.named_parameters():
        if name.startswith("embeddings."):
            continue
        torch.testing.assert_close(value.detach(), ref_params[name], rtol=1e-9, atol=1e-12, msg=name)
    joint = torch.cat([model.embeddings.table_weight(i) for i in range(len(TABLES))])
    torch.testing.assert_close(joint, ref_params.get("embeddings.weight", joint), rtol=1e-9, atol=1e-12)
    for i in range(len(TABLES)):
        key = f"embeddings.tables.{i}.weight"
        if key in ref_params:
            torch.testing.assert_close(model.embeddings.table_weight(i), ref_params[key], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("embedding,dense,embedding_type", [
    ("adagrad", "adagrad", "joint"), ("rowwise_adagrad", "adagrad", "multi_table"),
    ("rowwise_adagrad", "adagrad", "joint_fused")])
def test_adagrad_accumulators_start_at_the_initial_accumulator_value(embedding, dense, embedding_type):
    """--initial_accumulator_value 0.25: every accumulator, the tables' (plain and fused) and the
    MLPs', starts there (the first updates are damped), as the float64 rule says."""
    torch.manual_seed(0)
    model = DLRM(model_config(embedding_type)).double()
    config = OptimizerConfig(embedding, dense, eps=EPS, initial_accumulator_value=0.25)
    optimizer = make_optimizer(model, LR, config)
    precision = Precision("cpu")
    step = fused_train_step if embedding_type == "joint_fused" else train_step
    source = data()
    losses = [float(step(model, source.read_batch(i), optimizer, precision.grad_scaler(), precision))
              for i in range(STEPS)]
    ref_losses, ref_params = reference_run(embedding, dense, initial=0.25)
    undamped = reference_run(embedding, dense)[1]
    assert (undamped["top_mlp.layers.0.weight"] - ref_params["top_mlp.layers.0.weight"]).abs().max() > 1e-3
    # joint_fused updates in its own kernels, whose sums run in another order: 1e-7, where 0.25 moves 1e-3
    rtol, atol = (1e-7, 1e-9) if embedding_type == "joint_fused" else (1e-9, 1e-12)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=0)
    for name, value in model.named_parameters():
        if not name.startswith("embeddings."):
            torch.testing.assert_close(value.detach(), ref_params[name], rtol=rtol, atol=atol, msg=name)
    joint = torch.cat([model.embeddings.table_weight(i) for i in range(len(TABLES))])
    want = ref_params.get("embeddings.weight")
    if want is None:
        want = torch.cat([ref_params[f"embeddings.tables.{i}.weight"] for i in range(len(TABLES))])
    torch.testing.assert_close(joint, want, rtol=rtol, atol=atol)


def test_rowwise_adagrad_sums_duplicate_ids_before_the_update():
    """Two lookups of row 1 in one batch: one accumulator update with the summed gradient row."""
    weight = torch.nn.Parameter(torch.arange(12, dtype=torch.float64).view(4, 3) / 10)
    optimizer = RowWiseAdagrad([weight], lr=0.1, eps=0.0)
    out = torch.nn.functional.embedding(torch.tensor([1, 3, 1]), weight, sparse=True)
    (out * torch.tensor([[1.0], [2.0], [3.0]], dtype=torch.float64)).sum().backward()
    before = weight.detach().clone()
    optimizer.step()
    g1 = torch.full((3,), 4.0, dtype=torch.float64)  # 1 + 3, the two lookups of row 1
    g3 = torch.full((3,), 2.0, dtype=torch.float64)
    expected = before.clone()
    expected[1] -= 0.1 * g1 / (g1 * g1).mean().sqrt()
    expected[3] -= 0.1 * g3 / (g3 * g3).mean().sqrt()
    torch.testing.assert_close(weight.detach(), expected, rtol=1e-12, atol=0)
    torch.testing.assert_close(optimizer.state[weight]["sum"], torch.tensor([0, 16, 0, 4], dtype=torch.float64))


def test_embedding_adam_is_torch_sparse_adam_and_one_step_of_the_plain_rule():
    """Three steps with duplicate ids against torch.optim.SparseAdam (NVIDIA's embedding Adam),
    and the first step against the rule written out in float64."""
    ids = [torch.tensor([1, 3, 1]), torch.tensor([0, 3]), torch.tensor([2, 2, 2, 1])]
    scale = [torch.tensor([[1.0], [-2.0], [3.0]]), torch.tensor([[0.5], [4.0]]), torch.tensor([[1.0], [1.0], [2.0], [-1.0]])]
    init = torch.randn(4, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ours, theirs = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    ours_opt, theirs_opt = EmbeddingAdam([ours], lr=0.1, eps=1e-3), torch.optim.SparseAdam([theirs], lr=0.1, eps=1e-3)
    for step, (i, w) in enumerate(zip(ids, scale)):
        for p, opt in ((ours, ours_opt), (theirs, theirs_opt)):
            opt.zero_grad()
            (torch.nn.functional.embedding(i, p, sparse=True) * w.double()).sum().backward()
            opt.step()
        if step == 0:  # rows 1 (gradient 1 + 3 = 4 per column) and 3 (-2); rows 0 and 2 untouched
            g = torch.tensor([0.0, 4.0, 0.0, -2.0], dtype=torch.float64)[:, None].expand(4, 3)
            m, v = 0.1 * g, 0.001 * g * g
            expected = init - 0.1 * (1 - 0.999) ** 0.5 / (1 - 0.9) * m / (v.sqrt() + 1e-3)
            torch.testing.assert_close(ours.detach(), expected, rtol=1e-12, atol=0)
            assert torch.equal(ours.detach()[[0, 2]], init[[0, 2]])
        torch.testing.assert_close(ours.detach(), theirs.detach(), rtol=1e-12, atol=1e-15)
    state, reference = ours_opt.state[ours], theirs_opt.state[theirs]
    assert float(state["step"]) == 3
    torch.testing.assert_close(state["exp_avg"], reference["exp_avg"], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(state["exp_avg_sq"], reference["exp_avg_sq"], rtol=1e-12, atol=1e-15)


def test_adam_is_refused_for_half_precision_tables():
    with pytest.raises(ValueError, match="`optimizer=adam` keeps two fp32 moments"):
        OptimizerConfig("adam").validate_table_dtype(torch.bfloat16)
    assert OptimizerConfig("adam").state_bytes_per_row(16) == 8 * 16
    assert OptimizerConfig("sgd", "adam").dense_state_bytes() == 8


@pytest.mark.parametrize("embedding_type", ["joint", "multi_table", "joint_fused"])
@pytest.mark.parametrize("frozen", ["dense", "embeddings"])
def test_a_frozen_part_keeps_its_weights_and_state_while_the_other_trains(embedding_type, frozen, monkeypatch):
    """NVIDIA's --freeze_mlps / --freeze_embeddings: the frozen part's weights and optimizer state
    stay bit for bit, the other part changes (joint_fused: its own update kernels skip too)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the fused kernels' torch references
    torch.manual_seed(0)
    model = DLRM(model_config(embedding_type))
    config = OptimizerConfig("rowwise_adagrad", "adagrad", freeze_dense=frozen == "dense",
                             freeze_embeddings=frozen == "embeddings")
    optimizer = make_optimizer(model, LR, config)
    before = copy.deepcopy(model.state_dict())
    precision = Precision("cpu")
    step = fused_train_step if embedding_type == "joint_fused" else train_step
    for i in range(2):
        step(model, data().read_batch(i), optimizer, precision.grad_scaler(), precision)
    for name, value in model.state_dict().items():
        is_table = name.startswith("embeddings.")
        if is_table != (frozen == "embeddings"):
            assert not torch.equal(value, before[name]), f"{name} did not train"
        else:
            assert torch.equal(value, before[name]), f"{name} is frozen but changed"
    tables = model.embeddings.weight if embedding_type != "multi_table" else model.embeddings.tables[0].weight
    accumulator = optimizer.embedding_state(tables)["sum"]
    assert (accumulator == 0).all() == (frozen == "embeddings")
    dense_state = optimizer.dense.state_dict()["state"]
    assert all((s["sum"] == 0).all() for s in dense_state.values()) == (frozen == "dense")


@pytest.mark.parametrize("embedding,dense", [("adagrad", "adam"), ("rowwise_adagrad", "adagrad")])
def test_fp16_overflow_leaves_every_weight_and_optimizer_state_untouched(embedding, dense):
    torch.manual_seed(0)
    model = DLRM(model_config())
    optimizer = make_optimizer(model, LR, OptimizerConfig(embedding, dense))
    precision = Precision("cpu", torch.float16)
    batch = data().read_batch(0)
    train_step(model, batch, optimizer, precision.grad_scaler(init_scale=2.0**8), precision)  # creates the state
    weights = copy.deepcopy(model.state_dict())
    state = copy.deepcopy(optimizer.state_dict())
    table_state = {k: v.clone() for k, v in optimizer.embedding_state(model.embeddings.weight).items()}
    scaler = precision.grad_scaler(init_scale=2.0**60)  # scaled fp16 gradients overflow
    train_step(model, batch, optimizer, scaler, precision)
    assert scaler.get_scale() < 2.0**60
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    for key, value in optimizer.embedding_state(model.embeddings.weight).items():
        assert torch.equal(value, table_state[key]), key
    torch.testing.assert_close(optimizer.state_dict()["dense"]["state"], state["dense"]["state"], rtol=0, atol=0)


def _train(model, optimizer, start, steps):
    precision = Precision("cpu")
    source = data()
    return [float(train_step(model, source.read_batch(i), optimizer, precision.grad_scaler(), precision))
            for i in range(start, start + steps)]


@pytest.mark.parametrize("embedding,dense", [("adagrad", "adam"), ("rowwise_adagrad", "adagrad"), ("adam", "sgd")])
def test_resume_from_a_checkpoint_is_exact(tmp_path, embedding, dense):
    cfg = OptimizerConfig(embedding, dense)
    torch.manual_seed(0)
    model = DLRM(model_config()).double()
    full = _train(model, make_optimizer(model, LR, cfg), 0, STEPS)
    torch.manual_seed(0)
    first = DLRM(model_config()).double()
    optimizer = make_optimizer(first, LR, cfg)
    part = _train(first, optimizer, 0, 2)
    save_checkpoint(str(tmp_path / "ck"), first, optimizer, None, TrainState(step=2))
    assert os.path.isfile(tmp_path / "ck" / "table_1_optimizer.pt")
    torch.manual_seed(7)  # other weights: all of them must come from the checkpoint
    resumed = DLRM(model_config()).double()
    resumed_optimizer = make_optimizer(resumed, LR, cfg)
    load_checkpoint(str(tmp_path / "ck"), resumed, resumed_optimizer)
    part += _train(resumed, resumed_optimizer, 2, STEPS - 2)
    assert part == full  # bit for bit
    for name, value in resumed.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name


def test_a_checkpoint_refuses_another_optimizer(tmp_path):
    torch.manual_seed(0)
    model = DLRM(model_config())
    save_checkpoint(str(tmp_path / "ck"), model, make_optimizer(model, LR, OptimizerConfig("rowwise_adagrad")),
                    None, TrainState())
    with pytest.raises(CheckpointError, match="trained with `optimizer=rowwise_adagrad`"):
        load_checkpoint(str(tmp_path / "ck"), model, make_optimizer(model, LR, OptimizerConfig("adagrad")))
    load_checkpoint(str(tmp_path / "ck"), model)  # weights alone (e.g. --mode test) load with any optimizer


def _rank_worker(rank, world, port, plan, out_dir, embedding, dense):
    """2 steps on ``world`` processes, a checkpoint, then every process's weights and losses."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DLRM(model_config(), tables=plan[rank]).double()
    model.exchange = EmbeddingExchange(plan, rank)
    collectives = ProcessGroupCollectives(CPU)
    optimizer = make_optimizer(model, LR, OptimizerConfig(embedding, dense))
    precision = Precision("cpu")
    source = RankSource(lambda *args: data(), plan[rank], rank, world)
    losses = [float(collectives.sum(train_step(model, source.read_batch(i), optimizer, precision.grad_scaler(),
                                               precision, collectives))) for i in range(STEPS)]
    save_checkpoint(os.path.join(out_dir, "ck"), model, optimizer, None, TrainState(step=STEPS),
                    collectives=collectives)
    torch.save({"losses": losses}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.parametrize("embedding,dense", [("adagrad", "adam"), ("rowwise_adagrad", "adagrad")])
def test_distributed_training_equals_one_process_and_its_checkpoint_resumes_on_one(tmp_path, embedding, dense):
    """3 processes (uneven tables) step for step against one process in float64; the 3-process
    checkpoint (optimizer state per table) then continues on one process exactly as the
    one-process run continues."""
    plan = [[1], [3, 0], [2]]
    spawn(_rank_worker, args=(3, free_port(), plan, str(tmp_path), embedding, dense), nprocs=3)
    cfg = OptimizerConfig(embedding, dense)
    torch.manual_seed(0)
    single = DLRM(model_config()).double()
    single_optimizer = make_optimizer(single, LR, cfg)
    single_losses = _train(single, single_optimizer, 0, STEPS)
    for rank in range(3):
        losses = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(single_losses), rtol=1e-10, atol=0)
    torch.manual_seed(5)
    resumed = DLRM(model_config()).double()
    resumed_optimizer = make_optimizer(resumed, LR, cfg)
    load_checkpoint(str(tmp_path / "ck"), resumed, resumed_optimizer)
    continued = _train(resumed, resumed_optimizer, 0, 3)  # the same batches again: the state matters
    expected = _train(single, single_optimizer, 0, 3)
    torch.testing.assert_close(torch.tensor(continued), torch.tensor(expected), rtol=1e-9, atol=0)


def test_the_planner_counts_the_optimizer_state_of_each_row():
    dim = 16
    for name, per_row in [("sgd", 0), ("adagrad", 4 * dim), ("rowwise_adagrad", 4)]:
        extra = OptimizerConfig(name).state_bytes_per_row(dim)
        assert extra == per_row
        assert table_bytes([10, 1000], dim, extra) == [10 * (4 * dim + per_row), 1000 * (4 * dim + per_row)]
    # weights alone (32 KiB) fit one rank of 48 KiB; with Adagrad's state (twice the bytes) they need two ranks
    rows = [256, 256]
    assert plan_tables(rows, dim, 1, 48 * 1024).tables == [[0, 1]]
    with pytest.raises(ValueError):
        plan_tables(rows, dim, 1, 48 * 1024, state_bytes_per_row=OptimizerConfig("adagrad").state_bytes_per_row(dim))
    assert sorted(map(len, plan_tables(rows, dim, 2, 48 * 1024, state_bytes_per_row=4 * dim).tables)) == [1, 1]


def rowwise_adagrad_cli_args(log: str) -> list[str]:
    """A small synthetic run of row-wise Adagrad tables (and Adagrad MLPs) that learns in 48
    steps, logging to ``log``: what the command-line tests of the optimizers share."""
    return ["--base_device", "cpu", "--synthetic_dataset_table_sizes", "30,300,4,1000,70",
            "--synthetic_dataset_numerical_features", "13", "--synthetic_dataset_num_entries", "32768",
            "--synthetic_dataset_num_test_entries", "8192", "--batch_size", "512", "--test_batch_size", "4096",
            "--embedding_dim", "8", "--bottom_mlp_sizes", "16,8", "--top_mlp_sizes", "32,16,1",
            "--lr", "0.02", "--warmup_steps", "0", "--decay_start_step", "0", "--decay_steps", "0",
            "--print_freq", "16", "--optimizer", "rowwise_adagrad", "--log_path", log]


def test_cli_trains_with_rowwise_adagrad_resumes_and_refuses_another_optimizer(cli, tmp_path):
    """The MLPerf DLRMv2 pairing through the command line: row-wise Adagrad tables with Adagrad
    MLPs learn the synthetic labels, the checkpoint resumes, and another optimizer is refused."""
    import json

    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.json")
    common = rowwise_adagrad_cli_args(log)
    out = cli("dlrm.scripts.main", *common, "--max_steps", "48", "--save_checkpoint_path", ckpt).stdout
    assert "table_0_optimizer.pt" in os.listdir(ckpt)
    first = [json.loads(line) for line in open(log) if json.loads(line)["type"] == "summary"][-1]
    assert first["best_auc"] > 0.6, out
    out = cli("dlrm.scripts.main", *common, "--resume", "--load_checkpoint_path", ckpt).stdout
    assert "Resuming from" in out
    proc = cli("dlrm.scripts.main", *common, "--optimizer", "adagrad", "--resume", "--load_checkpoint_path", ckpt,
               check=False)
    assert proc.returncode == 2
    assert "trained with --optimizer=rowwise_adagrad and --dense_optimizer=adagrad" in proc.stderr, proc.stderr
