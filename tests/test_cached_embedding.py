"""The device cache of hot rows in front of host tables (``DLRM(..., host_cache_rows=K)``): with a
cache far smaller than the tables, so rows are evicted and fetched again every step, training
equals the same model with every row in memory, step by step, for SGD and row-wise Adagrad,
one-hot ids and bags, drawn from a power law; checkpoints of a cached run equal an uncached
run's. On a CPU machine the "device" is the CPU: every path of the cache runs."""

import pytest
import torch

from dlrm.data.batch import Batch
from dlrm.data.synthetic import SyntheticDataset
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.model.precision import Precision
from dlrm.nn.cached_embedding import CachedEmbedding
from dlrm.nn.embeddings import JointFusedEmbedding
from dlrm.training.checkpoint import TrainState, load_checkpoint, save_checkpoint
from dlrm.training.optimizers import OptimizerConfig, make_optimizer
from dlrm.training.train import make_train_step

TABLES = [3, 3000, 17, 800]
HOST = [1, 3]
CACHE_ROWS = 160  # of 3800 host rows: about 4%
BATCH, STEPS = 32, 30


def batches(kind):
    bag_sizes = None if kind == "one_hot" else [2, 3, 1, 2]
    data = SyntheticDataset(4, TABLES, BATCH * STEPS, BATCH, seed=7, bag_sizes=bag_sizes, zipf_exponent=1.1)
    out = [data.read_batch(i) for i in range(len(data))]
    return [Batch(b.numerical.double(), b.categorical, b.label) for b in out]


def build(cache_rows=0, host=HOST):
    torch.manual_seed(0)
    config = DLRMConfig(4, TABLES, 8, [16, 8], [32, 16, 1], embedding_type="joint_fused",
                        poolings=["sum", "mean", "sum", "mean"])
    return DLRM(config, host_tables=host, host_cache_rows=cache_rows).double()


def run(model, optimizer, data):
    precision = Precision("cpu")
    step = make_train_step(model, optimizer, precision.grad_scaler(), precision)
    return torch.stack([step(batch) for batch in data])


def close(actual, expected):
    """float64, equal to the order of additions: the update kernels sort a step's ids (not stably),
    so a row's repeated gradients may be summed in another order when it is keyed by its slot."""
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-15)


def tables_of(model):
    return {module.table_indices[i]: module.table_weight(i) for module in model.embedding_modules()
            for i in range(module.num_tables)}


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad"])
@pytest.mark.parametrize("kind", ["one_hot", "bags"])
def test_cached_training_equals_training_with_every_row_in_memory(optimizer, kind):
    data = batches(kind)
    plain, cached = build(), build(CACHE_ROWS)
    opts = [make_optimizer(m, 0.3, OptimizerConfig(embedding=optimizer)) for m in (plain, cached)]
    losses = [run(m, o, data) for m, o in zip((plain, cached), opts)]
    cache = cached.host_embeddings
    assert cache.writebacks > 0 and cache.unique_misses > CACHE_ROWS  # rows were evicted and fetched again
    assert 0.0 < cache.hit_rate() < 1.0
    close(losses[1], losses[0])
    for table, weight in tables_of(plain).items():
        close(tables_of(cached)[table], weight)
    if optimizer == "rowwise_adagrad":
        for p_plain, p_cached in zip(plain.host_embeddings.parameters(), cached.host_embeddings.parameters()):
            close(opts[1].embedding_state(p_cached)["sum"], opts[0].embedding_state(p_plain)["sum"])


def test_checkpoints_of_a_cached_run_equal_an_uncached_run(tmp_path):
    data = batches("one_hot")
    precision = Precision("cpu")
    saved = {}
    for name, cache_rows in (("plain", 0), ("cached", CACHE_ROWS)):
        model = build(cache_rows)
        opt = make_optimizer(model, 0.3, OptimizerConfig(embedding="rowwise_adagrad"))
        run(model, opt, data[:10])
        save_checkpoint(str(tmp_path / name), model, opt, precision.grad_scaler(), TrainState(step=10))
        saved[name] = tmp_path / name
    files = sorted(p.name for p in saved["plain"].iterdir() if p.suffix == ".pt" or "table" in p.name)
    assert files
    for name in files:
        a, b = (torch.load(saved[k] / name, weights_only=True) for k in ("plain", "cached"))
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            for key in a:
                if isinstance(a[key], torch.Tensor):
                    close(b[key], a[key])
        else:
            close(b, a)
    # a cached model resumes from the uncached run's checkpoint and goes on as the uncached run
    resumed, reference = build(CACHE_ROWS), build()
    opts = [make_optimizer(m, 0.3, OptimizerConfig(embedding="rowwise_adagrad")) for m in (resumed, reference)]
    for model, opt in zip((resumed, reference), opts):
        load_checkpoint(str(saved["plain"]), model, opt, precision.grad_scaler())
    close(run(resumed, opts[0], data[10:]), run(reference, opts[1], data[10:]))


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_module_updates_equal_the_uncached_module_under_either_policy(policy):
    torch.manual_seed(0)
    plain = JointFusedEmbedding([500, 40], 4).double()
    cached = CachedEmbedding([500, 40], 4, init_seed=plain.init_seed, cache_rows=48, policy=policy).double()
    gen = torch.Generator().manual_seed(3)
    state = [torch.zeros(540, dtype=torch.float64) for _ in range(2)]
    for _ in range(40):
        ids = torch.stack([(torch.rand(16, generator=gen) ** 4 * 500).long(), torch.randint(0, 40, (16,))], 1)
        grad = torch.randn(16, 2, 4, generator=gen, dtype=torch.float64)
        outs = []
        for module, s in zip((plain, cached), state):
            out = module(ids)
            out.backward(grad)
            module.apply_update_(0.1, rowwise_state=s)
            outs.append(out.detach())
        close(outs[1], outs[0])
    assert cached.writebacks > 0
    close(cached.table_weight(0), plain.table_weight(0))
    close(state[1], state[0])


def test_lookup_counts_hits_and_misses():
    cached = CachedEmbedding([10], 2, cache_rows=4)
    with torch.no_grad():
        cached(torch.tensor([[1], [2], [1]]))  # 3 lookups, 2 rows fetched
        cached(torch.tensor([[1], [5]]))  # row 1 hits, row 5 is fetched
    assert (cached.lookups, cached.lookup_misses, cached.unique_rows, cached.unique_misses) == (5, 4, 4, 3)
    assert cached.hit_rate() == pytest.approx(1 / 5)


def test_a_cache_smaller_than_one_step_is_refused():
    cached = CachedEmbedding([100], 2, cache_rows=3)
    with pytest.raises(ValueError, match="`cache_rows=3` is too small: one step needs 4 more rows"):
        cached(torch.tensor([[1], [2], [3], [4]]))
    with pytest.raises(ValueError, match="`host_cache_rows` needs embedding_type='joint_fused'"):
        DLRM(DLRMConfig(4, TABLES, 8, [16, 8], [32, 16, 1]), host_tables=HOST, host_cache_rows=10)
