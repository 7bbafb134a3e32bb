"""Multi-hot (``Bags``) lookups in every embedding layout and in training, each against an
independent float64 reference: bags pooled by a Python loop over samples and features, dense
autograd through that loop, and the update rules written out. On CPU the ``joint_fused``
kernels run in Triton's interpreter (tests/conftest.py)."""

import copy
import os
import random

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlrm.data.batch import Bags, Batch
from dlrm.data.rank_source import RankSource
from dlrm.data.synthetic import SyntheticDataset
from dlrm.distributed.exchange import EmbeddingExchange
from dlrm.engine.collectives import ProcessGroupCollectives
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.embeddings import JointEmbedding, JointFusedEmbedding, MultiTableEmbedding
from dlrm.nn.table_spec import table_specs
from dlrm.training.optimizers import OptimizerConfig, make_optimizer
from dlrm.training.train import evaluate, fused_train_step, make_train_step
from test_distributed import free_port
from conftest import spawn

LAYOUTS = {"joint": JointEmbedding, "multi_table": MultiTableEmbedding, "joint_fused": JointFusedEmbedding}
SIZES = [6, 40, 3, 25]
POOLINGS = ["sum", "mean", "mean", "sum"]
DIM = 4
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- references


def random_lists(batch, sizes=SIZES, seed=0, max_len=5, low=None, high=None):
    """``lists[t][b]``: the ids of feature ``t``'s bag for sample ``b``. Sample 0 has only empty
    bags, sample 1 bags of one, sample 2 one id repeated; the rest random lengths (0 included).
    ``low``/``high`` (multiples of a table's rows) widen the ids, for ``hash_indices``."""
    rng = random.Random(seed)
    lists = []
    for rows in sizes:
        lo, hi = int((low or 0) * rows), int((high or 1) * rows) - 1
        feature = []
        for b in range(batch):
            if b == 0:
                ids = []
            elif b == 1:
                ids = [rng.randint(lo, hi)]
            elif b == 2:
                ids = [rng.randint(lo, hi)] * 3
            else:
                ids = [rng.randint(lo, hi) for _ in range(rng.randint(0, max_len))]
                if ids and rng.random() < 0.3:
                    ids.append(ids[0])  # a repeat inside a longer bag
            feature.append(ids)
        lists.append(feature)
    return lists


def bags_of(lists, dtype=torch.int64):
    """Feature-major ``Bags`` from ``lists[t][b]``, written out by hand."""
    values, offsets = [], [0]
    for feature in lists:
        for ids in feature:
            values += ids
            offsets.append(len(values))
    return Bags(torch.tensor(values, dtype=dtype), torch.tensor(offsets, dtype=torch.int64), len(lists))


def plain_pool(tables, lists, poolings, hash_indices=False):
    """``[B, T, D]``: for every sample and feature, the sum (or mean) of the rows of its bag,
    zeros for an empty bag. Differentiable in ``tables`` (float64 leaves)."""
    batch = len(lists[0])
    out = []
    for b in range(batch):
        per_feature = []
        for t, table in enumerate(tables):
            ids = lists[t][b]
            acc = torch.zeros(table.shape[1], dtype=table.dtype)
            for i in ids:
                acc = acc + table[i % table.shape[0] if hash_indices else i]
            if poolings[t] == "mean" and ids:
                acc = acc / len(ids)
            per_feature.append(acc)
        out.append(torch.stack(per_feature))
    return torch.stack(out)


def tables64(module):
    return [module.table_weight(t).double().clone() for t in range(module.num_tables)]


def module(layout, sizes=SIZES, poolings=POOLINGS, **kwargs):
    return LAYOUTS[layout](table_specs(sizes, poolings), DIM, init_seed=3, **kwargs)


# ----------------------------------------------------------------------------- forward


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("poolings", [POOLINGS, ["sum"] * 4, ["mean"] * 4], ids=["mixed", "sum", "mean"])
def test_forward_pools_like_the_plain_loop(layout, poolings):
    m = module(layout, poolings=poolings)
    lists = random_lists(9)
    for dtype in (torch.int64, torch.int32):
        out = m(bags_of(lists, dtype))
        assert out.shape == (9, 4, DIM) and out.dtype == torch.float32 and out.is_contiguous()
        expected = plain_pool(tables64(m), lists, poolings)
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-7)
    assert torch.equal(out[0], torch.zeros(4, DIM))  # empty bags pool to zeros


@pytest.mark.parametrize("layout", LAYOUTS)
def test_hash_indices_map_every_value_into_its_table(layout):
    m = module(layout, hash_indices=True)
    lists = random_lists(8, low=-2, high=3)
    assert any(i < 0 for f in lists for ids in f for i in ids) and any(i >= SIZES[-1] for ids in lists[-1] for i in ids)
    expected = plain_pool(tables64(m), lists, POOLINGS, hash_indices=True)
    torch.testing.assert_close(m(bags_of(lists)).double(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_batches_without_ids_and_with_no_samples(layout):
    m = module(layout)
    lists = [[[] for _ in range(5)] for _ in SIZES]
    assert torch.equal(m(bags_of(lists)), torch.zeros(5, 4, DIM))
    assert m(bags_of([[] for _ in SIZES])).shape == (0, 4, DIM)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_bad_bags_name_what_was_expected(layout):
    m = module(layout)
    bags = bags_of(random_lists(3))
    with pytest.raises(ValueError, match="num_features=4"):
        m(Bags(bags.values, bags.offsets, 3))
    with pytest.raises(ValueError, match=r"offsets of shape \[num_features \* batch_size \+ 1\]"):
        m(Bags(bags.values, bags.offsets[:-1], 4))
    with pytest.raises(ValueError, match="shape \\[nnz\\]"):
        m(Bags(bags.values.view(-1, 1), bags.offsets, 4))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_refuses_bags_and_keeps_one_hot(layout):
    m = module(layout)
    bags = bags_of(random_lists(3))
    with pytest.raises(ValueError, match="multi-hot .*cannot be exported yet"):
        torch.jit.trace(lambda x: m(bags) + x, torch.zeros(3, 4, DIM), check_trace=False)
    ids = torch.tensor([[1, 2, 0, 3], [5, 39, 2, 24]])
    traced = torch.jit.trace(m, ids, check_trace=False)
    torch.testing.assert_close(traced(ids), m(ids))


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("layout", ["joint", "multi_table"])
@pytest.mark.parametrize("hash_indices", [False, True])
def test_sparse_gradient_equals_dense_autograd_through_the_loop(layout, hash_indices):
    m = module(layout, hash_indices=hash_indices)
    lists = random_lists(10, seed=4, **({"low": -1, "high": 2} if hash_indices else {}))
    upstream = torch.randn(10, 4, DIM, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (m(bags_of(lists)) * upstream.float()).sum().backward()
    leaves = [t.requires_grad_() for t in tables64(m)]
    (plain_pool(leaves, lists, POOLINGS, hash_indices) * upstream).sum().backward()
    for t, leaf in enumerate(leaves):
        param, start = m.table_parameter(t)
        assert param.grad.is_sparse
        got = param.grad.to_dense()[start:start + SIZES[t]]
        torch.testing.assert_close(got.double(), leaf.grad, rtol=1e-6, atol=1e-7, msg=f"table {t}")


def test_fused_backward_queues_the_bag_and_applies_sparse_sgd():
    """The ``joint_fused`` backward builds no gradient, queues one bag item, and its update is
    ``w -= lr * dense gradient`` of the loop."""
    m = module("joint_fused")
    lists = random_lists(10, seed=5)
    upstream = torch.randn(10, 4, DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    leaves = [t.requires_grad_() for t in tables64(m)]
    (plain_pool(leaves, lists, POOLINGS) * upstream).sum().backward()
    (m(bags_of(lists)) * upstream.float()).sum().backward()
    assert m.weight.grad is None and len(m._pending) == 1 and not m.pending_nonfinite()
    m.apply_update_(0.5)
    assert not m.has_pending_update
    for t, leaf in enumerate(leaves):
        torch.testing.assert_close(m.table_weight(t).double(), (leaf - 0.5 * leaf.grad).detach(), rtol=1e-6, atol=1e-7)


def test_fused_queue_mixes_one_hot_and_bag_items():
    joint, fused = module("joint"), module("joint_fused")
    ids = torch.tensor([[1, 2, 0, 3], [1, 39, 2, 24]])
    bags = bags_of(random_lists(6, seed=6))
    for m in (joint, fused):
        (m(ids).sum() + 2 * m(bags).sum()).backward()
    assert len(fused._pending) == 2
    torch.optim.SGD(joint.parameters(), lr=0.25).step()
    fused.apply_update_(0.25)
    torch.testing.assert_close(fused.weight, joint.weight, rtol=1e-6, atol=1e-7)


def test_nonfinite_bag_gradient_is_found_and_skips_the_update():
    m = module("joint_fused")
    before = m.weight.detach().clone()
    out = m(bags_of(random_lists(6, seed=7)))
    grad = torch.zeros_like(out)
    grad[3, 1, 2] = float("inf")
    out.backward(grad)
    assert bool(m.pending_nonfinite())
    m.apply_update_(0.5, skip=m.pending_nonfinite())
    assert torch.equal(m.weight, before) and not m.has_pending_update


# ----------------------------------------------------------------------------- the model in training


def model_config(embedding_type, poolings=POOLINGS, sizes=SIZES, **overrides):
    return DLRMConfig(3, sizes, DIM, [8, DIM], [8, 1], embedding_type=embedding_type, poolings=poolings, **overrides)


def make_model(embedding_type, **kwargs):
    torch.manual_seed(0)  # every layout gets the same weights
    return DLRM(model_config(embedding_type, **kwargs))


def bag_batches(n, batch=12, seed=1):
    """``(lists, Batch)`` pairs: the reference reads the lists, the model the ``Bags``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        lists = random_lists(batch, seed=seed * 100 + i)
        out.append((lists, Batch(torch.randn(batch, 3, generator=g), bags_of(lists),
                                 torch.randint(0, 2, (batch,), generator=g).float())))
    return out


class Reference:
    """The float64 model: the dense part of a copy of the untrained model (checked elsewhere),
    embeddings as plain float64 tables pooled by ``plain_pool``, and the update rules written
    out on dense gradients (which are zero on the rows a batch did not use)."""

    def __init__(self, model, embedding_rule="sgd", eps=1e-8):
        self.model = copy.deepcopy(model).double()
        self.tables = [self.model.embeddings.table_weight(t).clone() for t in range(len(SIZES))]
        self.state = [torch.zeros_like(t) if embedding_rule == "adagrad" else torch.zeros(t.shape[0], dtype=t.dtype)
                      for t in self.tables]
        self.rule, self.eps = embedding_rule, eps

    def step(self, lists, batch, lr):
        dense = self.model.replicated_parameters()
        tables = [t.requires_grad_() for t in self.tables]
        logits = self.model.dense_forward(batch.numerical.double(), plain_pool(tables, lists, POOLINGS))
        loss = F.binary_cross_entropy_with_logits(logits, batch.label.double())
        grads = torch.autograd.grad(loss, dense + tables)
        with torch.no_grad():
            for p, g in zip(dense, grads):
                p -= lr * g
            self.tables = [self._update(t, g, s, lr) for t, g, s in zip(tables, grads[len(dense):], self.state)]
        return float(loss.detach())

    def _update(self, w, g, state, lr):
        w = w.detach().clone()
        if self.rule == "sgd":
            return w - lr * g
        if self.rule == "adagrad":
            state += g * g
            return w - lr * g / (state.sqrt() + self.eps)
        state += (g * g).mean(dim=1)  # row-wise
        return w - lr * g / (state.sqrt() + self.eps)[:, None]


def assert_like_reference(model, ref, rtol=1e-5, atol=1e-6):
    for t, table in enumerate(ref.tables):
        torch.testing.assert_close(model.embeddings.table_weight(t).double(), table.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m: f"table {t}: {m}")
    ref_dense = dict(ref.model.named_parameters())
    for name, p in model.named_parameters():
        if not name.startswith("embeddings."):
            torch.testing.assert_close(p.double(), ref_dense[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def train(model, batches, lr, optimizer_config=OptimizerConfig()):
    precision = Precision("cpu")
    step = make_train_step(model, make_optimizer(model, lr, optimizer_config), precision.grad_scaler(), precision)
    return [float(step(batch)) for _, batch in batches]


def test_sgd_steps_on_bags_agree_across_layouts_and_with_the_reference():
    batches, lr = bag_batches(3), 0.5
    models = {name: make_model(name) for name in LAYOUTS}
    ref = Reference(models["joint"])
    ref_losses = [ref.step(lists, batch, lr) for lists, batch in batches]
    for name, model in models.items():
        losses = train(model, batches, lr)
        assert losses == pytest.approx(ref_losses, rel=1e-5), name
        assert_like_reference(model, ref)
    assert models["joint_fused"].embeddings.weight.grad is None  # updated by its kernel, not torch.optim
    for name in ("multi_table", "joint_fused"):
        for t in range(len(SIZES)):
            torch.testing.assert_close(models[name].embeddings.table_weight(t),
                                       models["joint"].embeddings.table_weight(t), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["joint", "multi_table"])
@pytest.mark.parametrize("rule", ["adagrad", "rowwise_adagrad"])
def test_adagrad_rules_on_bags_follow_the_written_out_update(layout, rule):
    batches, lr = bag_batches(3, seed=2), 0.05
    model = make_model(layout)
    ref = Reference(model, embedding_rule=rule)
    ref_losses = [ref.step(lists, batch, lr) for lists, batch in batches]
    losses = train(model, batches, lr, OptimizerConfig(embedding=rule, dense="sgd"))
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_like_reference(model, ref, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_hot_ids_and_the_same_ids_as_bags_train_alike(layout):
    g = torch.Generator().manual_seed(3)
    batches = [Batch(torch.randn(16, 3, generator=g),
                     torch.stack([torch.randint(0, rows, (16,), generator=g) for rows in SIZES], dim=1),
                     torch.randint(0, 2, (16,), generator=g).float()) for _ in range(3)]
    as_bags = [(None, Batch(b.numerical, Bags.from_one_hot(b.categorical), b.label)) for b in batches]
    one_hot_model, bag_model = make_model(layout), make_model(layout)
    torch.testing.assert_close(bag_model(batches[0].numerical, as_bags[0][1].categorical),
                               one_hot_model(batches[0].numerical, batches[0].categorical), rtol=1e-6, atol=1e-7)
    losses_one_hot = train(one_hot_model, [(None, b) for b in batches], 0.5)
    losses_bags = train(bag_model, as_bags, 0.5)
    assert losses_bags == pytest.approx(losses_one_hot, rel=1e-6)
    for (name, a), b in zip(one_hot_model.named_parameters(), bag_model.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_evaluate_takes_bags():
    class Source:
        batches = [b for _, b in bag_batches(2, seed=4)]

        def __len__(self):
            return len(self.batches)

        def read_batch(self, i):
            return self.batches[i]

    model = make_model("joint")
    result = evaluate(model, Source(), CPU, Precision("cpu"))
    logits = torch.cat([model(b.numerical, b.categorical) for b in Source.batches]).detach()
    labels = torch.cat([b.label for b in Source.batches])
    assert result.samples == 24
    assert result.loss == pytest.approx(float(F.binary_cross_entropy_with_logits(logits, labels)), rel=1e-6)


def test_fp16_overflow_skips_the_bag_update():
    """As for one-hot ids (tests/test_fused_train_step.py): a loss scale that overflows skips
    every update, the queued bag update of ``joint_fused`` included, and halves the scale."""
    precision = Precision("cpu", torch.float16)
    model = make_model("joint_fused")
    before = [p.detach().clone() for p in model.parameters()]
    scaler = precision.grad_scaler(init_scale=2.0**120)
    fused_train_step(model, bag_batches(1)[0][1], make_optimizer(model, 0.5), scaler, precision)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)
    assert scaler.get_scale() == 2.0**119
    assert not model.embeddings.has_pending_update
    # and with a scale that does not overflow, the same step moves the tables
    fused_train_step(model, bag_batches(1)[0][1], make_optimizer(model, 0.5), precision.grad_scaler(), precision)
    assert not torch.equal(model.embeddings.weight, before[0])


# ----------------------------------------------------------------------------- config


def test_config_poolings_are_checked_and_optional():
    with pytest.raises(ValueError, match="`poolings` must list one pooling per table \\(4 tables\\)"):
        model_config("joint", poolings=["sum"] * 3).validate()
    with pytest.raises(ValueError, match="`poolings` may only hold .*'max'"):
        model_config("joint", poolings=["sum", "max", "mean", "sum"]).validate()
    with pytest.raises(ValueError, match="`poolings`"):
        model_config("joint", poolings="mean").validate()
    saved = {k: v for k, v in vars(model_config("joint")).items() if k != "poolings"}  # an older config
    assert DLRMConfig(**saved).poolings is None
    assert make_model("joint", poolings=None).embeddings.poolings == ["sum"] * 4


def test_each_process_pools_its_own_tables_by_the_config():
    model = DLRM(model_config("multi_table"), tables=[2, 0])
    assert model.embeddings.poolings == [POOLINGS[2], POOLINGS[0]]


# ----------------------------------------------------------------------------- hybrid parallel

DIST_TABLES, DIST_BAGS, DIST_POOLINGS = [3, 1000, 17, 250, 40], [2, 1, 3, 1, 4], ["sum", "mean", "mean", "sum", "mean"]
DIST_STEPS, DIST_BATCH, DIST_LR = 4, 61, 0.5  # 61: uneven local batches


def _dist_config(embedding_type):
    return DLRMConfig(5, DIST_TABLES, 8, [16, 8], [32, 16, 1], embedding_type=embedding_type, poolings=DIST_POOLINGS)


def _dist_data(split, rows):
    return SyntheticDataset(5, DIST_TABLES, rows, DIST_BATCH if split == "train" else 50, seed=11, split=split,
                            bag_sizes=DIST_BAGS, pooling=DIST_POOLINGS)


def _dist_worker(rank, world, port, plan, out_dir, embedding_type):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = DLRM(_dist_config(embedding_type), tables=plan[rank]).double()
    model.exchange = EmbeddingExchange(plan, rank)
    collectives = ProcessGroupCollectives(CPU)
    precision = Precision("cpu")
    step = make_train_step(model, make_optimizer(model, DIST_LR), precision.grad_scaler(), precision, collectives)
    data = RankSource(lambda *a: _dist_data("train", DIST_STEPS * DIST_BATCH), plan[rank], rank, world)
    losses = []
    for i in range(DIST_STEPS):
        batch = data.read_batch(i)
        assert isinstance(batch.categorical, Bags)
        losses.append(float(collectives.sum(step(batch))))
    test = RankSource(lambda *a: _dist_data("test", 150), plan[rank], rank, world)
    auc = evaluate(model, test, CPU, precision, collectives=collectives).auc
    torch.save({"tables": {t: model.embeddings.table_weight(i).clone() for i, t in enumerate(plan[rank])},
                "dense": {k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")},
                "losses": losses, "auc": auc}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as tests/test_distributed.py: skip finalization, where gloo's threads can abort


@pytest.mark.parametrize("embedding_type", ["joint", "joint_fused"])
def test_two_processes_equal_one_on_multi_hot_data(tmp_path, embedding_type):
    """float64: 2 gloo processes holding tables [1, 3] and [0, 2, 4] against one process with
    all of them (``joint``, torch's sparse SGD), step by step on multi-hot synthetic batches."""
    plan = [[1, 3], [0, 2, 4]]
    spawn(_dist_worker, args=(2, free_port(), plan, str(tmp_path), embedding_type), nprocs=2)
    torch.manual_seed(0)
    reference = DLRM(_dist_config("joint")).double()
    precision = Precision("cpu")
    step = make_train_step(reference, make_optimizer(reference, DIST_LR), precision.grad_scaler(), precision)
    data = _dist_data("train", DIST_STEPS * DIST_BATCH)
    ref_losses = [float(step(data.read_batch(i))) for i in range(DIST_STEPS)]
    ref_auc = evaluate(reference, _dist_data("test", 150), CPU, precision).auc
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref_losses), rtol=1e-10, atol=0)
        assert result["auc"] == pytest.approx(ref_auc, abs=1e-12)
        for name, value in result["dense"].items():
            torch.testing.assert_close(value, reference.state_dict()[name], rtol=1e-10, atol=1e-13, msg=name)
    held = {t: w for r in results for t, w in r["tables"].items()}
    assert sorted(held) == list(range(len(DIST_TABLES)))
    for t, weight in held.items():
        torch.testing.assert_close(weight, reference.embeddings.table_weight(t), rtol=1e-10, atol=1e-13)
