"""``--cuda_graphs`` with multi-hot data: batches of ``Bags`` padded to a static length
(``dlrm.training.cuda_graphs``), each against an independent reference: the unpadded eager step
(bit for bit in fp32 on the Triton kernels, run here by the interpreter, and in float64 on the
references), float64 pooling written out as a loop, and the buckets' arithmetic. On a CPU nothing
can be captured, so the step is checked for what a capture needs: no host synchronisation and
the same operators on the same shapes for every batch of a bucket. The ``gpu`` tests capture and
replay it (``pytest -m gpu``)."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from dlrm.data.batch import Bags, Batch
from dlrm.data.sources import DataConfig
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.embeddings import JointEmbedding, JointFusedEmbedding, MultiTableEmbedding
from dlrm.nn.fused_lookup import PaddedBagUpdate
from dlrm.nn.table_spec import table_specs
from dlrm.kernels.embedding_bag import (bag_gather, bag_rowwise_adagrad_update, bag_rowwise_adagrad_update_reference,
                                        bag_sgd_update)
from dlrm.training.build import model_config
from dlrm.training.cuda_graphs import (GraphedTrainStep, check_cuda_graphs_supported, copy_batch_, fixed_bag_limit,
                                       padded_batch, padded_length)
from dlrm.training.lr_schedule import LRSchedule
from dlrm.training.optimizers import OptimizerConfig, make_optimizer
from dlrm.training.run_config import ModelSettings, RunConfig
from dlrm.training.train import TrainConfig, fused_train_step, make_train_step

TABLES = [30, 7, 50]
MAX_BAG = [4, 2, 5]  # the per-table maximum bag size (a fixed layout fills every bag to it)
POOLINGS = ["sum", "mean", "sum"]
DIM, BATCH, NUMERICAL = 8, 16, 4
CPU = torch.device("cpu")


# ----------------------------------------------------------------------------- data and references


def make_bags(batch: int, seed: int, fixed: bool = False, dtype: torch.dtype = torch.int64) -> Bags:
    """Feature-major bags: with ``fixed`` every bag holds its table's ``MAX_BAG`` ids, else a
    random 0..max ids, sample 0's bags empty and sample 1's at the maximum. Skewed ids, so rows
    repeat within and across bags."""
    g = torch.Generator().manual_seed(seed)
    values, lengths = [], []
    for rows, most in zip(TABLES, MAX_BAG):
        if fixed:
            sizes = torch.full((batch,), most)
        else:
            sizes = torch.randint(0, most + 1, (batch,), generator=g)
            sizes[0], sizes[1] = 0, most
        lengths.append(sizes)
        values.append((torch.rand(int(sizes.sum()), generator=g) ** 3 * rows).long())
    lengths = torch.cat(lengths)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return Bags(torch.cat(values).to(dtype), offsets, len(TABLES))


def make_batch(seed: int, fixed: bool = False, batch: int = BATCH) -> Batch:
    g = torch.Generator().manual_seed(1000 + seed)
    return Batch(torch.randn(batch, NUMERICAL, generator=g), make_bags(batch, seed, fixed),
                 torch.randint(0, 2, (batch,), generator=g).float())


def loop_pool(weights: list[torch.Tensor], bags: Bags) -> torch.Tensor:
    """``[B, T, D]`` float64: each bag's rows summed (or averaged) by a Python loop over the
    true bags (``offsets``), zeros for an empty bag."""
    batch = bags.batch_size
    out = torch.zeros(batch, len(weights), weights[0].shape[1], dtype=torch.float64)
    for t, (table, pooling) in enumerate(zip(weights, POOLINGS)):
        for b in range(batch):
            start, end = int(bags.offsets[t * batch + b]), int(bags.offsets[t * batch + b + 1])
            ids = bags.values[start:end].long()
            if len(ids):
                rows = table.double()[ids]
                out[b, t] = rows.mean(0) if pooling == "mean" else rows.sum(0)
    return out


def model(dtype: torch.dtype = torch.float32, embedding_type: str = "joint_fused", device=None) -> DLRM:
    torch.manual_seed(0)
    cfg = DLRMConfig(NUMERICAL, TABLES, DIM, [16, DIM], [16, 1], embedding_type=embedding_type, poolings=POOLINGS)
    return DLRM(cfg, device=device).to(dtype)


def assert_models_equal(a: DLRM, b: DLRM) -> None:
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), (name, (pa - pb).abs().max())


def assert_optimizers_equal(opt_a, opt_b, model_a: DLRM, model_b: DLRM) -> None:
    """Bit for bit: the tables' row-wise accumulators (if any) and every dense state tensor."""
    state_a, _ = opt_a.fused_rowwise_state(model_a.embeddings.weight)
    state_b, _ = opt_b.fused_rowwise_state(model_b.embeddings.weight)
    assert (state_a is None) == (state_b is None)
    if state_a is not None:
        assert torch.equal(state_a, state_b)
        assert int((state_a > 0).sum()) > 5  # the rows the batches used moved
    da, db = opt_a.state_dict()["dense"]["state"], opt_b.state_dict()["dense"]["state"]
    assert da.keys() == db.keys()
    for key in da:
        for name, value in da[key].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(db[key][name])), (key, name)


# ----------------------------------------------------------------------------- padding


@pytest.mark.parametrize("fixed", [False, True], ids=["variable", "fixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_padded_bags_pool_to_the_original(fixed, dtype):
    """Sum and mean pooling, empty bags and bags at the table's maximum: the padded bags pool to
    the unpadded ones bit for bit, and both to the float64 loop."""
    module = JointFusedEmbedding(table_specs(TABLES, POOLINGS), DIM, init_seed=3, weight_dtype=dtype)
    bags = make_bags(BATCH, seed=4, fixed=fixed, dtype=torch.int32)
    lengths = bags.lengths()
    if fixed:
        assert all(bool((lengths[t] == most).all()) for t, most in enumerate(MAX_BAG))
    else:
        assert bool((lengths[:, 0] == 0).all()) and lengths[:, 1].tolist() == MAX_BAG
    expected = loop_pool([module.table_weight(t) for t in range(len(TABLES))], bags)
    with torch.no_grad():
        plain = module(bags)
        torch.testing.assert_close(plain.double(), expected, rtol=1e-6, atol=1e-7)
        nnz = bags.values.shape[0]
        for length in (nnz, nnz + 1, padded_length(nnz), 3 * nnz + 7):
            padded = bags.padded_to(length)
            assert padded.padded and padded.values.shape == (length,) and padded.values.dtype == torch.int32
            assert padded.offsets is bags.offsets and torch.equal(padded.lengths(), lengths)
            assert torch.equal(padded.values[:nnz], bags.values) and not padded.values[nnz:].any()
            assert torch.equal(module(padded), plain), length
    with pytest.raises(ValueError, match="cannot pad"):
        bags.padded_to(nnz - 1)


def test_padding_is_in_no_bag_whatever_its_ids():
    """The ids past the last bag may be anything (here the hottest real rows): they are pooled
    into no bag, the queued update names them by the row one past the last, and with mean
    pooling their weight is 0."""
    module = JointFusedEmbedding(table_specs(TABLES, POOLINGS), DIM, init_seed=3)
    bags = make_bags(BATCH, seed=5)
    nnz, tail = bags.values.shape[0], 11
    padded = bags.padded_to(nnz + tail)
    padded.values[nnz:] = bags.values[:tail]
    out = module(padded)
    with torch.no_grad():
        assert torch.equal(out, module(bags))
    out.sum().backward()
    (item,) = module._pending
    assert isinstance(item, PaddedBagUpdate) and item.values.shape == (nnz + tail,)
    assert bool((item.values[nnz:] == module.weight.shape[0]).all())  # one past the last row: none
    assert bool((item.values[:nnz] < module.weight.shape[0]).all())
    assert item.per_sample_weights is not None and not item.per_sample_weights[nnz:].any()
    # The true lengths: mean-pooled bags weigh each id 1 / len, as without padding.
    unpadded = JointFusedEmbedding(table_specs(TABLES, POOLINGS), DIM, init_seed=3)
    unpadded(bags).sum().backward()
    assert torch.equal(item.per_sample_weights[:nnz], unpadded._pending[0].per_sample_weights)
    assert torch.equal(item.values[:nnz], unpadded._pending[0].values)


@pytest.mark.parametrize("layout", [JointEmbedding, MultiTableEmbedding])
def test_padded_bags_are_refused_by_the_other_layouts(layout):
    """torch's embedding_bag would add the padding to the last bag: these layouts refuse it."""
    module = layout(table_specs(TABLES, POOLINGS), DIM, init_seed=3)
    bags = make_bags(BATCH, seed=5)
    with pytest.raises(ValueError, match="padded Bags .* `joint_fused` lookup only"):
        module(bags.padded_to(bags.values.shape[0] + 3))


def test_padded_bags_take_one_pass_per_update():
    """Two queued padded passes cannot be joined into one update: refused, not mixed up."""
    module = JointFusedEmbedding(table_specs(TABLES, POOLINGS), DIM, init_seed=3)
    for seed in (1, 2):
        bags = make_bags(BATCH, seed=seed)
        module(bags.padded_to(bags.values.shape[0] + 5)).sum().backward()
    state = torch.zeros(module.weight.shape[0])
    with pytest.raises(ValueError, match="one forward and backward per update"):
        module.apply_update_(0.1, rowwise_state=state)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ids_only_padding_names_keep_their_rows_and_state(dtype):
    """The kernels' own arithmetic on padding that names real rows (the lookup never lets it):
    no gradient comes from past the last bag, so a row that only padding names keeps its weight
    and row-wise Adagrad state bit for bit (``state + 0``, ``weight - rate * 0``), and SGD too.
    fp32 runs the kernels, float64 the references."""
    g = torch.Generator().manual_seed(7)
    rows = 40
    weight0 = torch.randn(rows, DIM, generator=g, dtype=dtype)
    state0 = torch.rand(rows, generator=g)
    values = torch.randint(0, 20, (30,), generator=g)  # real ids: rows 0..19
    offsets = torch.tensor([0, 4, 4, 9, 15, 22, 30])
    grad = torch.randn(6, DIM, generator=g, dtype=dtype)
    psw = torch.rand(30, generator=g, dtype=dtype)
    padded_values = torch.cat([values, torch.arange(25, 35)])  # padding names rows 25..34 only
    padded_psw = torch.cat([psw, torch.ones(10, dtype=dtype)])  # even with weight 1
    scalars = [torch.tensor(v) for v in (0.1, 1.0)] + [torch.tensor(False)]
    untouched = torch.arange(20, rows)
    for weighted in (False, True):
        w, s = weight0.clone(), state0.clone()
        bag_rowwise_adagrad_update(w, s, padded_values, offsets, grad, *scalars,
                                   padded_psw if weighted else None, padded=True)
        assert torch.equal(w[untouched], weight0[untouched]) and torch.equal(s[untouched], state0[untouched])
        w_ref, s_ref = weight0.clone(), state0.clone()
        bag_rowwise_adagrad_update(w_ref, s_ref, values, offsets, grad, *scalars, psw if weighted else None)
        torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(s, s_ref, rtol=1e-6, atol=1e-9)
        w = weight0.clone()
        bag_sgd_update(w, padded_values, offsets, grad, *scalars, padded_psw if weighted else None, padded=True)
        assert torch.equal(w[untouched], weight0[untouched])
    # The float64 reference with the padding as the lookup names it: exact, padding or not.
    w, s, w_ref, s_ref = weight0.double(), state0.clone(), weight0.double(), state0.clone()
    bag_rowwise_adagrad_update_reference(w, s, torch.cat([values, torch.full((10,), rows)]), offsets, grad.double(),
                                         *scalars, padded=True)
    bag_rowwise_adagrad_update_reference(w_ref, s_ref, values, offsets, grad.double(), *scalars)
    assert torch.equal(w, w_ref) and torch.equal(s, s_ref)
    assert torch.equal(bag_gather(weight0, padded_values, offsets, padded=True), bag_gather(weight0, values, offsets))


# ----------------------------------------------------------------------------- buckets


def test_padded_lengths_are_four_steps_an_octave():
    assert [padded_length(n) for n in (0, 1, 63, 64)] == [64] * 4
    assert [padded_length(n) for n in (65, 80, 81, 100, 112, 113, 128, 129)] == [80, 80, 96, 112, 112, 128, 128, 160]
    lengths = [padded_length(n) for n in range(1, 20_000)]
    assert all(b >= a for a, b in zip(lengths, lengths[1:]))  # never shorter for more ids
    assert all(n <= length <= max(64, 1.25 * n) for n, length in enumerate(lengths, start=1))
    for length in set(lengths):  # each length is m * 2**k, m in 4..7: four buckets an octave
        shift = max(length.bit_length() - 3, 0)
        assert length % (1 << shift) == 0 and 4 <= length >> shift <= 7
    assert {padded_length(n) for n in range(4097, 8193)} == {5120, 6144, 7168, 8192}
    # MLPerf DLRMv2's 214 ids a sample at batch 65536: under 5% padding.
    nnz = 65536 * 214
    assert padded_length(nnz) == 14_680_064 and padded_length(nnz) / nnz < 1.05


def test_fixed_bag_sizes_cap_the_padding():
    limit = fixed_bag_limit([4, None, 5], BATCH)  # None: a one-hot feature, one id
    assert limit == BATCH * 10
    assert padded_length(limit, limit) == limit  # full bags: no padding at all
    assert padded_length(limit - 3, limit) == limit
    assert padded_length(limit // 2, limit) == padded_length(limit // 2) < limit
    assert padded_length(limit + 1, limit) == padded_length(limit + 1)  # past the bound: the buckets
    assert fixed_bag_limit([4, "variable"], BATCH) is None
    fixed = make_batch(0, fixed=True)
    assert fixed.categorical.values.shape[0] == fixed_bag_limit(MAX_BAG, BATCH)


def test_a_feature_spec_bounds_a_batch_of_fixed_bags_only():
    """What ``--cuda_graphs`` runs pass as ``max_bag_values``: fixed bags (and one-hot features
    beside them) bound a batch's ids, so full bags take an exact bucket; a variable bag does not."""
    from dlrm.data.feature_spec import FeatureSpec
    from dlrm.training.cuda_graphs import batch_bag_limit

    fixed = FeatureSpec.default(2, [10, 20, 30], bag_sizes=[3, None, 5])
    assert batch_bag_limit(fixed, 64) == 64 * (3 + 1 + 5)
    assert batch_bag_limit(FeatureSpec.default(2, [10, 20], bag_sizes=[3, "variable"]), 64) is None
    assert batch_bag_limit(FeatureSpec.default(2, [10, 20]), 64) is None


def test_graphed_step_buckets_by_padded_length():
    step = GraphedTrainStep(lambda batch, capturing: None, max_bag_values=fixed_bag_limit(MAX_BAG, BATCH))
    variable, fixed, other = make_batch(1), make_batch(2, fixed=True), make_batch(3)
    keys = [step.bucket(b) for b in (variable, fixed, other)]
    assert keys[0][-1] == padded_length(variable.categorical.values.shape[0])
    assert keys[1][-1] == fixed.categorical.values.shape[0]  # at the fixed layout's bound exactly
    assert keys[0] != keys[1]
    same = padded_length(variable.categorical.values.shape[0]) == padded_length(other.categorical.values.shape[0])
    assert (keys[0] == keys[2]) == same
    one_hot = Batch(variable.numerical, torch.zeros(BATCH, 3, dtype=torch.int32), variable.label)
    assert step.bucket(one_hot)[-2:] == ((BATCH, 3), torch.int32)


# ----------------------------------------------------------------------------- the padded step


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_padded_steps_equal_unpadded_eager_steps(optimizer, dtype):
    """Several steps over two buckets, each batch copied into its bucket's static buffers as the
    graphed step does (stale ids from the bucket's last batch left in them): loss, every weight,
    the row-wise and the dense optimizer state all equal the unpadded eager run bit for bit."""
    eager = model(dtype)
    padded = copy.deepcopy(eager)
    cfg = OptimizerConfig(optimizer)
    opt_e, opt_p = make_optimizer(eager, 0.1, cfg), make_optimizer(padded, 0.1, cfg)
    precision = Precision("cpu")
    lr = torch.tensor(0.1)
    limit = fixed_bag_limit(MAX_BAG, BATCH)
    data = [make_batch(1), make_batch(2, fixed=True), make_batch(3)]
    statics: dict[int, Batch] = {}
    for batch in data:
        length = padded_length(batch.categorical.values.shape[0], limit)
        if length not in statics:
            statics[length] = padded_batch(make_batch(9), length)  # another batch's ids in the buffers first
        static = statics[length]
        copy_batch_(static, batch)
        loss_e = fused_train_step(eager, batch, opt_e, precision.grad_scaler(), precision, lr=lr)
        loss_p = fused_train_step(padded, static, opt_p, precision.grad_scaler(), precision, lr=lr)
        assert torch.equal(loss_e, loss_p)
    assert len(statics) == 2
    assert any(length > b.categorical.values.shape[0] for length, b in zip(statics, data))  # some padding
    assert_models_equal(eager, padded)
    assert_optimizers_equal(opt_e, opt_p, eager, padded)
    assert not torch.equal(eager.embeddings.weight, model(dtype).embeddings.weight)  # it trained


# ----------------------------------------------------------------------------- what a capture needs


class HostSyncGuard:
    """Records every operator a block runs (outside Triton's interpreter, which stands in for a
    GPU kernel here) with the shapes it returns, and fails on anything that reads a tensor on
    the host or makes a shape from tensor values: what breaks a CUDA graph capture."""

    FUNCTIONS = {"item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__"}
    OPERATORS = {"_local_scalar_dense", "item", "nonzero", "masked_select", "_unique", "_unique2",
                 "unique_consecutive", "unique_dim", "equal", "is_nonzero", "allclose", "masked_scatter"}

    def __init__(self) -> None:
        self.trace: list[tuple[str, tuple]] = []
        self.syncs: list[str] = []

    @staticmethod
    def _in_interpreter() -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if "/triton/" in frame.f_code.co_filename.replace("\\", "/"):
                return True
            frame = frame.f_back
        return False

    def function(self, func) -> None:
        if getattr(func, "__name__", "") in self.FUNCTIONS and not self._in_interpreter():
            self.syncs.append(func.__name__)

    def operator(self, func, args, kwargs, out) -> None:
        if self._in_interpreter():
            return
        name = func.overloadpacket.__name__
        indices = args[1] if name in ("index", "index_put", "index_put_") and len(args) > 1 else ()
        if (name in self.OPERATORS or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                       and len(args) < 4)
                or any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())):
            self.syncs.append(str(func))
        shapes = tuple(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        self.trace.append((str(func), shapes))

    def __enter__(self) -> "HostSyncGuard":
        guard = self

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                guard.function(func)
                return func(*args, **(kwargs or {}))

        class Operators(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                guard.operator(func, args, kwargs or {}, out)
                return out

        self._modes = [Functions(), Operators()]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def test_the_guard_sees_host_syncs_and_shapes():
    """The guard itself: a host read, a value-made shape and a boolean mask are caught."""
    t = torch.tensor([3, 1, 2])
    for block in (lambda: int(t[0]), lambda: t.tolist(), lambda: t[t > 1],
                  lambda: torch.repeat_interleave(t, t), lambda: torch.nonzero(t)):
        with HostSyncGuard() as guard:
            block()
        assert guard.syncs, block
    with HostSyncGuard() as guard:
        torch.repeat_interleave(t, t, output_size=6)
        torch.searchsorted(t.sort().values, t)
    assert not guard.syncs


def test_padded_step_is_free_of_host_syncs_and_its_shapes_are_static():
    """Row-wise Adagrad with mean and sum pooling: two batches with different numbers of ids in
    one bucket run the same operators on the same shapes, and nothing reads the device on the
    host. Unpadded, the shapes differ (so the trace does see them)."""
    first, second = make_batch(1), make_batch(3)
    nnz = [b.categorical.values.shape[0] for b in (first, second)]
    assert nnz[0] != nnz[1] and padded_length(nnz[0]) == padded_length(nnz[1])
    net = model()
    opt = make_optimizer(net, 0.1, OptimizerConfig("rowwise_adagrad"))
    precision, lr = Precision("cpu"), torch.tensor(0.1)
    fused_train_step(net, first, opt, precision.grad_scaler(), precision, lr=lr)  # optimizer state made
    static = padded_batch(first, padded_length(nnz[0]))
    traces = []
    for batch in (first, second):
        copy_batch_(static, batch)
        with HostSyncGuard() as guard:
            fused_train_step(net, static, opt, precision.grad_scaler(), precision, lr=lr, autocast_cache=False)
        assert not guard.syncs, guard.syncs
        traces.append(guard.trace)
    assert len(traces[0]) > 50 and traces[0] == traces[1]
    unpadded = []
    for batch in (first, second):
        with HostSyncGuard() as guard:
            fused_train_step(net, batch, opt, precision.grad_scaler(), precision, lr=lr, autocast_cache=False)
        unpadded.append(guard.trace)
    assert [op for op, _ in unpadded[0]] == [op for op, _ in unpadded[1]] and unpadded[0] != unpadded[1]


# ----------------------------------------------------------------------------- the refusals


def run_config(**model) -> RunConfig:
    return RunConfig(data=DataConfig(dataset_type="synthetic", synthetic_table_sizes=TABLES, synthetic_num_numerical=4,
                                     synthetic_bag_sizes=MAX_BAG, synthetic_pooling="mean"),
                     model=ModelSettings(embedding_dim=DIM, bottom_mlp_sizes=[16, DIM], top_mlp_sizes=[16, 1],
                                         **model),
                     train=TrainConfig(LRSchedule(lr=0.1), cuda_graphs=True))


def test_multi_hot_data_is_no_longer_refused_and_the_other_limits_stay():
    spec, cfg = model_config(run_config(embedding_type="joint_fused"), CPU)
    assert spec.multi_hot_features and cfg.embedding_type == "joint_fused"
    cuda = torch.device("cuda")  # only its type is read: the model's own limits, checked on a CPU
    fused = DLRM(cfg)
    check_cuda_graphs_supported(fused, cuda, 1)
    with pytest.raises(ValueError, match="CUDA device"):
        check_cuda_graphs_supported(fused, CPU, 1)
    with pytest.raises(ValueError, match="one process only"):
        check_cuda_graphs_supported(fused, cuda, 2)
    with pytest.raises(ValueError, match="embedding_type=joint_fused"):
        check_cuda_graphs_supported(DLRM(model_config(run_config(embedding_type="joint"), CPU)[1]), cuda, 1)
    for cache_rows in (0, 64):  # tables in host memory, looked up there or through a device cache
        host = DLRM(cfg, host_tables=[2], host_cache_rows=cache_rows)
        with pytest.raises(ValueError, match="host_tables"):
            check_cuda_graphs_supported(host, cuda, 1)


# ----------------------------------------------------------------------------- on a GPU


def cuda_batches(seed: int, count: int, fixed: bool, batch: int = 256) -> list[Batch]:
    return [make_batch(seed + i, fixed=fixed, batch=batch).to("cuda") for i in range(count)]


def two_bucket_run() -> list[Batch]:
    """Batches of two buckets (variable bags of several lengths; full bags), then both again,
    then a partial last batch."""
    variable, fixed = cuda_batches(10, 6, False), cuda_batches(40, 5, True)
    partial = make_batch(99, batch=100).to("cuda")
    return variable[:5] + fixed + [variable[5], fixed[0], variable[0]] + [partial]


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
def test_cuda_graphed_multi_hot_steps_equal_eager_steps(optimizer):
    """Captured and replayed per bucket, without a host sync during replays (the sync debug mode
    raises on one), equal to the eager unpadded run: two graphs, a partial last batch eager."""
    device = torch.device("cuda")
    eager = model(device=device)
    graphed = copy.deepcopy(eager)
    cfg = OptimizerConfig(optimizer)
    opt_e, opt_g = make_optimizer(eager, 0.1, cfg), make_optimizer(graphed, 0.1, cfg)
    precision = Precision("cuda")
    scaler_e, scaler_g = precision.grad_scaler(), precision.grad_scaler()
    lr = torch.full((), 0.1, device=device)
    step = GraphedTrainStep(lambda batch, capturing: fused_train_step(
        graphed, batch, opt_g, scaler_g, precision, lr=lr, autocast_cache=not capturing))
    data = two_bucket_run()
    assert len({step.bucket(b) for b in data[:-1]}) == 2
    replayed = 0
    for batch in data:
        entry = step.graphs.get(step.bucket(batch))
        replaying = step.rows == len(batch) and entry is not None and entry.graph is not None
        torch.cuda.set_sync_debug_mode("error" if replaying else 0)  # a host sync raises
        try:
            loss_g = step(batch)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        replayed += replaying
        loss_e = fused_train_step(eager, batch, opt_e, scaler_e, precision, lr=lr)
        torch.testing.assert_close(loss_g, loss_e, rtol=1e-6, atol=1e-7)
    assert len(step.graphs) == 2 and all(entry.graph is not None for entry in step.graphs.values())
    assert step.replays == len(data) - 1 - 2 * step.warmup_steps  # the partial batch ran eagerly
    assert replayed == step.replays - 2  # all but the two replays right after each capture
    for (name, pe), pg in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(pg, pe, rtol=1e-5, atol=1e-6, msg=name)
    state_e, _ = opt_e.fused_rowwise_state(eager.embeddings.weight)
    state_g, _ = opt_g.fused_rowwise_state(graphed.embeddings.weight)
    if state_e is not None:
        torch.testing.assert_close(state_g, state_e, rtol=1e-5, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16])
def test_cuda_make_train_step_graphs_multi_hot_data(amp_dtype):
    """``make_train_step(cuda_graphs=True)``, what ``--cuda_graphs`` runs, on multi-hot data."""
    device = torch.device("cuda")
    eager = model(device=device)
    graphed = copy.deepcopy(eager)
    cfg = OptimizerConfig("rowwise_adagrad")
    opt_e, opt_g = make_optimizer(eager, 0.1, cfg), make_optimizer(graphed, 0.1, cfg)
    precision = Precision("cuda", amp_dtype)
    step_e = make_train_step(eager, opt_e, precision.grad_scaler(), precision)
    step_g = make_train_step(graphed, opt_g, precision.grad_scaler(), precision, cuda_graphs=True,
                             max_bag_values=fixed_bag_limit(MAX_BAG, 256))
    assert step_g.graphed.max_bag_values == fixed_bag_limit(MAX_BAG, 256)
    for batch in two_bucket_run():
        torch.testing.assert_close(step_g(batch), step_e(batch), rtol=1e-5, atol=1e-6)
    for (name, pe), pg in zip(eager.named_parameters(), graphed.parameters()):
        torch.testing.assert_close(pg, pe, rtol=1e-5, atol=1e-6, msg=name)
