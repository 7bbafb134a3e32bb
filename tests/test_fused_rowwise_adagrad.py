"""Row-wise Adagrad tables and an Adagrad (or SGD) dense part for ``embedding_type="joint_fused"``
(``fused_train_step``), each against an independent reference: the sparse-gradient ``joint``
layout stepped by ``train_step`` and torch's / ``RowWiseAdagrad``'s optimizers, and the update
rules written out in float64 on dense gradients. One-hot batches and multi-hot ``Bags``; fp16
overflow skips; checkpoints that cross between the two layouts and between process counts; a
command-line run. On CPU the kernels run in Triton's interpreter (tests/conftest.py)."""

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlrm.data.batch import Batch
from dlrm.data.rank_source import RankSource
from dlrm.data.synthetic import SyntheticDataset
from dlrm.distributed.exchange import EmbeddingExchange
from dlrm.engine.collectives import ProcessGroupCollectives
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.embeddings import JointEmbedding, JointFusedEmbedding
from dlrm.nn.table_spec import table_specs
from dlrm.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from dlrm.training.optimizers import OptimizerConfig, RowWiseAdagrad, make_optimizer
from dlrm.training.train import fused_train_step, make_train_step
from conftest import spawn
from test_bag_embeddings import bags_of, random_lists
from test_distributed import free_port
from test_optimizers import EPS, LR, PlainReference, rowwise_adagrad_cli_args

TABLES = [3, 200, 17, 50]
POOLINGS = ["sum", "mean", "sum", "mean"]
# Two steps (the second reads the accumulators the first wrote) of small batches: each table
# update is one program of the interpreted kernels, which run their scan one element at a time.
DIM, STEPS, BATCH = 8, 2, 16
INPUTS = ["one_hot", "bags"]


def model_config(embedding_type):
    return DLRMConfig(4, TABLES, DIM, [16, DIM], [32, 16, 1], embedding_type=embedding_type, poolings=POOLINGS)


def make_model(embedding_type, seed=0):
    torch.manual_seed(seed)  # every layout gets the same weights from the same seed
    return DLRM(model_config(embedding_type))


def batches(kind, n=STEPS, seed=1):
    """Skewed one-hot ids (rows repeat within a batch, as in Criteo), or bags with empty bags,
    repeats inside a bag and across bags (tests/test_bag_embeddings.py's ``random_lists``)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        numerical, label = torch.randn(BATCH, 4, generator=g), torch.randint(0, 2, (BATCH,), generator=g).float()
        if kind == "one_hot":
            ids = torch.stack([(torch.rand(BATCH, generator=g) ** 3 * rows).long() for rows in TABLES], dim=1)
        else:
            ids = bags_of(random_lists(BATCH, sizes=TABLES, seed=seed * 100 + i))
        out.append(Batch(numerical, ids, label))
    return out


class Float64Reference:
    """The model in float64 (``joint`` layout, for its gradients only) and the update rules of
    ``test_optimizers.PlainReference``, written out on dense gradients, independent of
    torch.optim, sparse tensors and kernels."""

    def __init__(self, model, embedding, dense):
        self.model = DLRM(model_config("joint")).double()
        self.model.load_state_dict(model.state_dict())
        self.rules = PlainReference(embedding, dense)
        self.state = self.rules.state

    def step(self, batch):
        self.model.zero_grad(set_to_none=True)
        loss = F.binary_cross_entropy_with_logits(self.model(batch.numerical.double(), batch.categorical),
                                                  batch.label.double())
        loss.backward()
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            self.rules.step(params, {name: p.grad.to_dense() if p.grad.is_sparse else p.grad
                                     for name, p in params.items()})
        return float(loss.detach())


def train(model, optimizer, data):
    precision = Precision("cpu")
    step = make_train_step(model, optimizer, precision.grad_scaler(), precision)
    return [float(step(batch)) for batch in data]


def assert_params_close(a, b, rtol, atol):
    named_b = dict(b.named_parameters())
    for name, pa in a.named_parameters():
        torch.testing.assert_close(pa.detach().double(), named_b[name].detach().double(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{name}: {m}")


def assert_states_equal(opt_a, model_a, opt_b, model_b):
    """Bit for bit: the tables' row-wise accumulators and the dense optimizer's state dict."""
    sa, sb = opt_a.embedding_state(model_a.embeddings.weight), opt_b.embedding_state(model_b.embeddings.weight)
    assert set(sa) == set(sb) == {"sum"}
    assert torch.equal(sa["sum"], sb["sum"])
    da, db = opt_a.state_dict()["dense"], opt_b.state_dict()["dense"]
    assert da["param_groups"] == db["param_groups"]
    assert da["state"].keys() == db["state"].keys()
    for key in da["state"]:
        for name, value in da["state"][key].items():
            assert torch.equal(value.cpu(), db["state"][key][name].cpu()), (key, name)


# ----------------------------------------------------------------------------- training


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("embedding,dense", [("rowwise_adagrad", "adagrad"), ("rowwise_adagrad", "sgd"),
                                             ("sgd", "adagrad")])
def test_fused_steps_equal_the_joint_layout_and_the_float64_rules(inputs, embedding, dense):
    cfg = OptimizerConfig(embedding, dense, eps=EPS)
    data = batches(inputs)
    joint, fused = make_model("joint"), make_model("joint_fused")
    ref = Float64Reference(joint, embedding, dense)
    ref_losses = [ref.step(batch) for batch in data]
    opt_j, opt_f = make_optimizer(joint, LR, cfg), make_optimizer(fused, LR, cfg)
    losses_j, losses_f = train(joint, opt_j, data), train(fused, opt_f, data)

    assert losses_f == pytest.approx(losses_j, rel=1e-5)
    assert losses_f == pytest.approx(ref_losses, rel=1e-5)
    assert_params_close(fused, joint, rtol=1e-5, atol=1e-6)
    assert_params_close(fused, ref.model, rtol=1e-4, atol=1e-5)
    assert fused.embeddings.weight.grad is None  # updated by its kernel, never through a gradient
    # The optimizer state: the tables' accumulator and the dense one, as both references hold them.
    if embedding == "rowwise_adagrad":
        acc_f = opt_f.embedding_state(fused.embeddings.weight)["sum"]
        assert acc_f.dtype == torch.float32 and acc_f.shape == (sum(TABLES),)
        torch.testing.assert_close(acc_f, opt_j.embedding_state(joint.embeddings.weight)["sum"], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(acc_f.double(), ref.state["embeddings.weight"]["sum"], rtol=1e-4, atol=1e-9)
        assert int((acc_f > 0).sum()) > 10  # the rows the batches used moved, ...
        assert int((acc_f == 0).sum()) > 10  # ... the others did not
    else:
        assert opt_f.embedding_state(fused.embeddings.weight) == {}
    dense_j, dense_f = opt_j.state_dict()["dense"], opt_f.state_dict()["dense"]
    assert dense_f["param_groups"] == dense_j["param_groups"]
    if dense == "adagrad":
        names = [n for n, _ in joint.named_parameters() if not n.startswith("embeddings.")]
        for i, name in enumerate(names):
            state_f, state_j = dense_f["state"][i], dense_j["state"][i]
            assert float(state_f["step"]) == float(state_j["step"]) == STEPS
            torch.testing.assert_close(state_f["sum"], state_j["sum"], rtol=1e-5, atol=1e-9)
            torch.testing.assert_close(state_f["sum"].double(), ref.state[name]["sum"], rtol=1e-4, atol=1e-9)
    else:
        assert dense_f["state"] == dense_j["state"] == {}


def test_several_backward_passes_before_one_update_sum_before_the_accumulator_moves():
    """Row-wise Adagrad is not linear in the gradient: a one-hot pass and a bag pass queued before
    one update must act as one step on their summed gradient, as torch accumulates a sparse
    ``weight.grad`` and ``RowWiseAdagrad`` coalesces it."""
    sizes, dim = [5, 9], 4
    torch.manual_seed(0)
    fused = JointFusedEmbedding(table_specs(sizes, ["sum", "mean"]), dim)
    plain = JointEmbedding(table_specs(sizes, ["sum", "mean"]), dim)
    plain.load_state_dict(fused.state_dict())
    ids = torch.tensor([[1, 3], [1, 8], [4, 3]])
    bags = bags_of([[[1], [], [1, 1, 2]], [[3, 0], [8], []]])
    g1, g2 = torch.randn(3, 2, dim), torch.randn(3, 2, dim)
    for module in (fused, plain):
        (module(ids) * g1).sum().backward()
        (module(bags) * g2).sum().backward()
    state = torch.zeros(sum(sizes))
    fused.apply_update_(0.3, rowwise_state=state, eps=EPS)
    optimizer = RowWiseAdagrad([plain.weight], lr=0.3, eps=EPS)
    optimizer.step()
    torch.testing.assert_close(state, optimizer.state[plain.weight]["sum"], rtol=1e-6, atol=0)
    torch.testing.assert_close(fused.weight, plain.weight, rtol=1e-6, atol=1e-7)
    assert not fused.has_pending_update


# ----------------------------------------------------------------------------- fp16 overflow


@pytest.mark.parametrize("inputs", INPUTS)
@pytest.mark.parametrize("dense", ["adagrad", "sgd"])
def test_fp16_overflow_leaves_every_weight_and_state_bit_identical(inputs, dense):
    precision = Precision("cpu", torch.float16)
    model = make_model("joint_fused")
    optimizer = make_optimizer(model, LR, OptimizerConfig("rowwise_adagrad", dense))
    first, second = batches(inputs, n=2)
    fused_train_step(model, first, optimizer, precision.grad_scaler(init_scale=2.0**8), precision)  # states move
    assert float(optimizer.embedding_state(model.embeddings.weight)["sum"].max()) > 0
    weights = copy.deepcopy(model.state_dict())
    table_state = optimizer.embedding_state(model.embeddings.weight)["sum"].clone()
    dense_state = copy.deepcopy(optimizer.state_dict()["dense"])
    scaler = precision.grad_scaler(init_scale=2.0**120)  # scaled fp16 gradients overflow
    fused_train_step(model, second, optimizer, scaler, precision)
    assert scaler.get_scale() == 2.0**119
    for name, value in model.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert torch.equal(optimizer.embedding_state(model.embeddings.weight)["sum"], table_state)
    for key, state in dense_state["state"].items():
        for name, value in state.items():
            assert torch.equal(optimizer.state_dict()["dense"]["state"][key][name], value), (key, name)
    assert not model.embeddings.has_pending_update
    # and with a scale that does not overflow, the same step moves the tables and their state
    fused_train_step(model, second, optimizer, precision.grad_scaler(init_scale=2.0**8), precision)
    assert not torch.equal(model.embeddings.weight, weights["embeddings.weight"])
    assert not torch.equal(optimizer.embedding_state(model.embeddings.weight)["sum"], table_state)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [None, torch.float16])
def test_cuda_graph_replays_equal_eager_steps(dtype):
    """No host sync in the row-wise and the dense Adagrad updates: the captured step replays them,
    and the accumulators, Adagrad's sums and its step count follow the eager run."""
    device = torch.device("cuda")
    cfg = OptimizerConfig("rowwise_adagrad", "adagrad")
    eager, graphed = make_model("joint_fused").to(device), make_model("joint_fused").to(device)
    precision = Precision("cuda", dtype)
    opt_e, opt_g = make_optimizer(eager, LR, cfg), make_optimizer(graphed, LR, cfg)
    step_e = make_train_step(eager, opt_e, precision.grad_scaler(), precision)
    step_g = make_train_step(graphed, opt_g, precision.grad_scaler(), precision, cuda_graphs=True)
    data = batches("one_hot", n=8) + batches("one_hot", n=1, seed=5)[:1]
    data[-1] = Batch(data[-1].numerical[:17], data[-1].categorical[:17], data[-1].label[:17])  # runs eagerly
    for batch in data:
        batch = batch.to(device)
        torch.testing.assert_close(step_g(batch), step_e(batch), rtol=1e-5, atol=1e-6)
    assert_params_close(graphed, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(opt_g.embedding_state(graphed.embeddings.weight)["sum"],
                               opt_e.embedding_state(eager.embeddings.weight)["sum"], rtol=1e-5, atol=1e-9)
    dense_g, dense_e = opt_g.state_dict()["dense"]["state"], opt_e.state_dict()["dense"]["state"]
    for key in dense_e:
        assert float(dense_g[key]["step"]) == float(dense_e[key]["step"]) > 0  # fp16: minus skipped steps
        torch.testing.assert_close(dense_g[key]["sum"], dense_e[key]["sum"], rtol=1e-5, atol=1e-9)


# ----------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("saved_as,resumed_as", [("joint_fused", "joint"), ("joint", "joint_fused"),
                                                 ("joint_fused", "joint_fused")])
def test_a_checkpoint_resumes_in_the_other_layout(tmp_path, saved_as, resumed_as):
    """The fused tables' accumulators are saved per table in ``RowWiseAdagrad``'s format, so a
    checkpoint loads into either layout with every weight and every state bit for bit, and the
    resumed run continues as the uninterrupted one (exactly when the layout is the same)."""
    cfg = OptimizerConfig("rowwise_adagrad", "adagrad")
    data = batches("one_hot", n=2)  # one step saved, one resumed: it reads the loaded accumulators
    saver = make_model(saved_as)
    saver_opt = make_optimizer(saver, LR, cfg)
    train(saver, saver_opt, data[:1])
    save_checkpoint(str(tmp_path / "ck"), saver, saver_opt, None, TrainState(step=1))
    assert os.path.isfile(tmp_path / "ck" / "table_1_optimizer.pt")
    resumed = make_model(resumed_as, seed=7)  # other weights: all of them must come from the checkpoint
    resumed_opt = make_optimizer(resumed, LR, cfg)
    load_checkpoint(str(tmp_path / "ck"), resumed, resumed_opt)
    for name, value in saver.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], value), name
    assert_states_equal(resumed_opt, resumed, saver_opt, saver)
    continued = train(resumed, resumed_opt, data[1:])
    expected = train(saver, saver_opt, data[1:])
    if saved_as == resumed_as:
        assert continued == expected  # bit for bit
        assert_states_equal(resumed_opt, resumed, saver_opt, saver)
    else:
        assert continued == pytest.approx(expected, rel=1e-5)
    assert_params_close(resumed, saver, rtol=1e-5, atol=1e-6)


def _synthetic(split="train", rows=STEPS * BATCH):
    return SyntheticDataset(4, TABLES, rows, BATCH, seed=3, split=split)


def _rank_worker(rank, world, port, plan, out_dir):
    """``joint_fused`` + row-wise Adagrad on ``world`` processes (each holds its own tables and
    their accumulators), then a checkpoint written by all of them."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DLRM(model_config("joint_fused"), tables=plan[rank])
    model.exchange = EmbeddingExchange(plan, rank)
    collectives = ProcessGroupCollectives(torch.device("cpu"))
    optimizer = make_optimizer(model, LR, OptimizerConfig("rowwise_adagrad", "adagrad"))
    precision = Precision("cpu")
    step = make_train_step(model, optimizer, precision.grad_scaler(), precision, collectives)
    source = RankSource(lambda *args: _synthetic(), plan[rank], rank, world)
    losses = [float(collectives.sum(step(source.read_batch(i)))) for i in range(STEPS)]
    save_checkpoint(os.path.join(out_dir, "ck"), model, optimizer, None, TrainState(step=STEPS),
                    collectives=collectives)
    torch.save({"losses": losses}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_two_processes_equal_one_and_their_checkpoint_resumes_on_one_as_joint(tmp_path):
    """The accumulators are per table, wherever the tables were placed: 2 processes train as one
    does, and their checkpoint continues on one process, in the ``joint`` layout, as the
    one-process ``joint_fused`` run continues."""
    plan = [[1, 2], [3, 0]]
    spawn(_rank_worker, args=(2, free_port(), plan, str(tmp_path)), nprocs=2)
    cfg = OptimizerConfig("rowwise_adagrad", "adagrad")
    single = make_model("joint_fused")
    single_opt = make_optimizer(single, LR, cfg)
    source = _synthetic()
    single_losses = train(single, single_opt, [source.read_batch(i) for i in range(STEPS)])
    for rank in range(2):
        losses = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)["losses"]
        assert losses == pytest.approx(single_losses, rel=1e-5)
    resumed = make_model("joint", seed=5)
    resumed_opt = make_optimizer(resumed, LR, cfg)
    load_checkpoint(str(tmp_path / "ck"), resumed, resumed_opt)
    torch.testing.assert_close(resumed_opt.embedding_state(resumed.embeddings.weight)["sum"],
                               single_opt.embedding_state(single.embeddings.weight)["sum"], rtol=1e-5, atol=1e-9)
    again = [source.read_batch(0)]  # the same batch again: the loaded state matters
    assert train(resumed, resumed_opt, again) == pytest.approx(train(single, single_opt, again), rel=1e-5)
    assert_params_close(resumed, single, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("embedding,dense", [("sgd", "adam"), ("rowwise_adagrad", "adam"), ("adagrad", "adagrad")])
def test_optimizers_the_fused_step_cannot_apply_are_refused(embedding, dense):
    with pytest.raises(ValueError, match=f"`optimizer={embedding}` and `dense_optimizer={dense}`.*"
                                         "`embedding_type=joint`"):
        make_optimizer(make_model("joint_fused"), LR, OptimizerConfig(embedding, dense))


def test_the_planner_counts_one_fp32_value_per_row():
    model = make_model("joint_fused")
    optimizer = make_optimizer(model, LR, OptimizerConfig("rowwise_adagrad"))
    state = optimizer.embedding_state(model.embeddings.weight)["sum"]
    assert state.element_size() * state.numel() == OptimizerConfig("rowwise_adagrad").state_bytes_per_row(DIM) * \
        sum(TABLES)
    assert optimizer.param_groups[-1]["params"] == []  # the fused tables are in no param group


# ----------------------------------------------------------------------------- command line


def test_cli_trains_joint_fused_with_rowwise_adagrad_and_resumes_as_joint(cli, tmp_path, monkeypatch):
    """The MLPerf DLRMv2 pairing on the fused step through the command line: it learns, its
    checkpoint resumes as ``joint``, and dense Adam is refused with the flags to change. The
    kernels' torch references run here (the interpreter is too slow for a whole run; the tests
    above run the kernels)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ckpt, log = str(tmp_path / "ckpt"), str(tmp_path / "log.json")
    common = rowwise_adagrad_cli_args(log)
    out = cli("dlrm.scripts.main", *common, "--embedding_type", "joint_fused", "--max_steps", "48",
              "--save_checkpoint_path", ckpt).stdout
    assert "table_0_optimizer.pt" in os.listdir(ckpt)
    with open(log) as f:
        summary = [r for r in map(json.loads, f) if r["type"] == "summary"][-1]
    assert summary["steps"] == 48 and summary["best_auc"] > 0.6, out
    out = cli("dlrm.scripts.main", *common, "--embedding_type", "joint", "--max_steps", "56",
              "--resume", "--load_checkpoint_path", ckpt).stdout
    assert "Resuming from" in out and "at step 48" in out
    proc = cli("dlrm.scripts.main", *common, "--embedding_type", "joint_fused", "--dense_optimizer", "adam",
               check=False)
    assert proc.returncode == 2
    assert "--optimizer=rowwise_adagrad and --dense_optimizer=adam" in proc.stderr, proc.stderr
    assert "--embedding_type=joint" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
