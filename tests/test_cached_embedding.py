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
from dlrm.nn.cached_embedding import CacheTooSmallError, CachedEmbedding
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


# ---------------------------------------------------------------------------------------------
# Victim selection, dirty rows, prefetch


@pytest.mark.parametrize("select_below", [1, None])
@pytest.mark.parametrize("huge_scores", [False, True])
def test_victims_are_those_a_stable_sort_of_every_candidate_puts_first(huge_scores, select_below, monkeypatch):
    """The selection (the k lowest scores, ties to the lowest slot, in that order) equals the
    stable sort of every candidate's score it replaces: scores with many ties (empty slots at
    -1 among them), candidates any subset of the slots, k from 1 to all of them; by the unique
    key, and by the threshold where scores may be too large for that key; selected for every k
    (``SELECT_BELOW=1``), or as the cache chooses between selection and sort."""
    from dlrm.nn import cached_embedding

    if select_below is not None:
        monkeypatch.setattr(cached_embedding, "SELECT_BELOW", select_below)
    cache = CachedEmbedding([400], 2, cache_rows=200)
    gen = torch.Generator().manual_seed(11)
    for trial in range(30):
        top = 2**61 if huge_scores else 1 + trial % 6
        scores = torch.randint(-1, 1 + trial % 6, (200,), generator=gen)
        cache.slot_score.copy_(torch.where(scores > 0, top - scores, scores))
        cache._score_limit = top
        candidates = (torch.rand(200, generator=gen) < 0.7).nonzero().squeeze(1)
        for k in range(1, candidates.numel() + 1):
            expected = candidates[torch.sort(cache.slot_score[candidates], stable=True).indices[:k]]
            assert torch.equal(cache._victims(candidates, k), expected), (trial, k)


def test_read_only_lookups_write_nothing_back():
    """Lookups without gradients (evaluation) evict rows all the time and change none: no write-back,
    on eviction or on flush; without dirty tracking every evicted row is written back."""
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 300, (12, 2), generator=gen) for _ in range(20)]
    tracked, untracked = (CachedEmbedding([300, 300], 4, cache_rows=30, track_dirty=t) for t in (True, False))
    for cache in (tracked, untracked):
        cache.train(False)
        with torch.no_grad():
            for ids in batches:
                cache(ids)
        cache(batches[0]).sum().backward()
        cache.discard_pending_()  # a backward whose update is dropped changes no row either
        cache.table_weight(0)
    assert tracked.unique_misses > 5 * tracked.cache_rows  # rows were evicted and fetched again and again
    assert tracked.writebacks == 0
    assert untracked.writebacks >= untracked.unique_misses - untracked.cache_rows


def test_a_row_updated_once_is_written_back_once():
    """Row 7 updated once: written back when evicted, not when evicted again after being fetched
    and only read, not by a flush. Row 20 updated once: written by a flush, not again when
    evicted. The host table then holds the uncached updates."""
    plain = JointFusedEmbedding([50], 3)
    cache = CachedEmbedding([50], 3, init_seed=plain.init_seed, cache_rows=4)

    def update(row):
        for module in (plain, cache):
            module(torch.tensor([[row]])).sum().backward()
            module.apply_update_(0.5)

    def read(*rows):
        with torch.no_grad():
            cache(torch.tensor(rows)[:, None])

    update(7)
    assert cache.writebacks == 0
    read(1, 2, 3, 4)  # evicts 7
    read(7)
    read(10, 11, 12, 13)  # evicts 7 again
    assert cache.writebacks == 1
    cache.flush_()
    assert cache.writebacks == 1
    update(20)
    cache.flush_()
    assert cache.writebacks == 2
    read(30, 31, 32, 33)  # evicts 20
    assert cache.writebacks == 2
    assert torch.equal(cache.table_weight(0), plain.table_weight(0))


def _ids(gen, batch):
    return torch.stack([(torch.rand(batch, generator=gen) ** 3 * 500).long(), torch.randint(0, 40, (batch,),
                                                                                              generator=gen)], 1)


@pytest.mark.parametrize("policy, dtype, num_steps, adagrad", [
    ("lru", torch.float32, 6, True),  # the kernels a GPU runs (Triton's interpreter here: slow, so few steps)
    ("lru", torch.float64, 40, True),  # the torch reference kernels
    ("lfu", torch.float64, 40, True),
    ("lru", torch.float64, 40, False),  # SGD of one-hot ids: an update per lookup, sorted unstably
])
def test_prefetch_trains_exactly_as_without_it_and_as_the_uncached_table(policy, dtype, num_steps, adagrad):
    """Row-wise Adagrad (or SGD), each step's rows fetched ahead during the step before: the
    lookups, the tables and the accumulators equal, bit for bit, the uncached table's (and in
    float64 the same steps' without prefetch); with evaluation passes in between, and a cache so
    small that prefetches evict (more rows fetched ahead than there are slots)."""
    gen = torch.Generator().manual_seed(3)
    steps = [(_ids(gen, 16), torch.randn(16, 2, 4, generator=gen, dtype=dtype)) for _ in range(num_steps)]
    evals = [_ids(gen, 24) for _ in range(3)]
    plain = JointFusedEmbedding([500, 40], 4).to(dtype)
    caches = [CachedEmbedding([500, 40], 4, init_seed=plain.init_seed, cache_rows=48, policy=policy).to(dtype)
              for _ in range(1 if dtype == torch.float32 else 2)]
    modules = [plain, *caches]
    states = [torch.zeros(540) for _ in modules]
    for i, (ids, grad) in enumerate(steps):
        if i + 1 < len(steps):
            caches[0].prefetch_(steps[i + 1][0])
        outs = []
        for module, state in zip(modules, states):
            out = module(ids)
            out.backward(grad)
            module.apply_update_(0.1, rowwise_state=state if adagrad else None)
            outs.append(out.detach())
        assert all(torch.equal(out, outs[0]) for out in outs[1:]), i
        if i % 9 == 2:
            with torch.no_grad():
                for e in evals:
                    looked_up = [module(e) for module in modules]
                    assert all(torch.equal(out, looked_up[0]) for out in looked_up[1:]), i
    assert caches[0].prefetched > caches[0].cache_rows and caches[0].writebacks > 0
    assert all(cache.prefetched == 0 for cache in caches[1:])
    for module, state in zip(caches, states[1:]):
        assert torch.equal(module.table_weight(0), plain.table_weight(0))
        assert torch.equal(module.table_weight(1), plain.table_weight(1))
        assert torch.equal(state, states[0])


def test_a_prefetch_never_moves_a_row_whose_update_is_queued():
    """Two lookups, then one update of both (gradient accumulation), the second lookup running a
    prefetch that needs more slots than are empty: the first lookup's slots hold queued gradients
    and stay; the update equals the uncached table's."""
    gen = torch.Generator().manual_seed(8)
    plain = JointFusedEmbedding([300], 2).double()
    cache = CachedEmbedding([300], 2, init_seed=plain.init_seed, cache_rows=40).double()
    for _ in range(6):
        first, second, following = (torch.randperm(100, generator=gen)[:16].add(100 * k)[:, None] for k in range(3))
        grads = torch.randn(2, 16, 1, 2, generator=gen, dtype=torch.float64)
        for module in (plain, cache):
            module(first).backward(grads[0])
            if module is cache:
                cache.prefetch_(following)  # run once the update of both lookups is queued
            module(second).backward(grads[1])
            module.apply_update_(0.1)
    assert cache.prefetched > 0
    assert torch.equal(cache.table_weight(0), plain.table_weight(0))


def test_a_training_lookup_leaves_the_prefetch_to_its_update():
    """The prefetch runs once the step's update is queued (on a GPU, beside the step's later
    work), not at the lookup; a lookup that queues no update (evaluation) runs it at once."""
    cache = CachedEmbedding([300], 2, cache_rows=64)
    now, following = torch.arange(16)[:, None], torch.arange(100, 116)[:, None]
    cache.prefetch_(following)
    cache(now).backward(torch.ones(16, 1, 2))
    assert cache.prefetched == 0 and bool((cache.slot_map[100:116] < 0).all())
    cache.apply_update_(0.1)
    assert cache.prefetched == 16 and bool((cache.slot_map[100:116] >= 0).all())
    assert not bool(cache.slot_pinned.any()) and cache._used == []
    cache.prefetch_(following + 50)
    with torch.no_grad():
        cache(now)
    assert cache.prefetched == 32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("adagrad", [False, True])
def test_cuda_prefetch_on_its_stream_trains_as_the_uncached_table(adagrad):
    """The cache on the GPU, each next batch fetched on the side stream while the step's update
    runs, with evictions: lookups, tables and accumulators equal the uncached table's on the GPU
    (the same kernels), up to the order of atomic adds of an id two update programs share."""
    gen = torch.Generator().manual_seed(5)
    steps = [(_ids(gen, 256), torch.randn(256, 2, 4, generator=gen)) for _ in range(30)]
    plain = JointFusedEmbedding([500, 40], 4, device="cuda", init_device="cpu")  # the host table's values
    cache = CachedEmbedding([500, 40], 4, init_seed=plain.init_seed, cache_rows=300, cache_device="cuda")
    states = [torch.zeros(540, device="cuda"), torch.zeros(540)]
    for i, (ids, grad) in enumerate(steps):
        if i + 1 < len(steps):
            cache.prefetch_(steps[i + 1][0].cuda())
        for module, state in ((plain, states[0]), (cache, states[1])):
            out = module(ids.cuda())
            out.backward(grad.cuda())
            module.apply_update_(0.1, rowwise_state=state if adagrad else None)
            if module is plain:
                expected = out.detach()
        torch.testing.assert_close(out.detach(), expected, rtol=1e-5, atol=1e-6)
    assert cache.prefetched > 0 and cache.writebacks > 0
    for t in range(2):
        torch.testing.assert_close(cache.table_weight(t).cuda(), plain.table_weight(t), rtol=1e-5, atol=1e-6)
    if adagrad:
        torch.testing.assert_close(states[1].cuda(), states[0], rtol=1e-5, atol=1e-6)


def test_a_second_lookup_before_the_update_cannot_evict_the_first_ones_rows():
    """With gradients, the first lookup's slots hold queued updates: a second lookup that would
    have to evict them is refused; without gradients (nothing queued) it may."""
    cache = CachedEmbedding([100], 2, cache_rows=20)
    first, second = torch.arange(16)[:, None], torch.arange(16, 32)[:, None]
    cache(first)
    with pytest.raises(CacheTooSmallError, match="one step needs 16 more rows than the 4 slots it may evict"):
        cache(second)
    cache.discard_pending_()
    with torch.no_grad():
        cache(first)
        cache(second)


def test_a_prefetched_row_is_a_miss_of_the_lookup_that_needs_it():
    """With room for every row (no eviction) the counters are those of the cache without
    prefetch; every row but the first batch's came in ahead, and was cached before its lookup."""
    gen = torch.Generator().manual_seed(4)
    steps = [_ids(gen, 16) for _ in range(12)]
    caches = [CachedEmbedding([500, 40], 4, cache_rows=540) for _ in range(2)]
    with torch.no_grad():
        for i, ids in enumerate(steps):
            for cache in caches:
                cache(ids)
            if i + 1 < len(steps):
                caches[1].prefetch_(steps[i + 1])
                caches[1](ids)  # a lookup of cached rows, which runs the prefetch
                caches[0](ids)
                rows = (steps[i + 1] + caches[1].offsets).reshape(-1)
                assert bool((caches[1].slot_map[rows] >= 0).all())  # fetched before the next lookup
    counters = [(c.lookups, c.lookup_misses, c.unique_rows, c.unique_misses) for c in caches]
    assert counters[0] == counters[1]
    first = torch.unique(steps[0] + caches[1].offsets).numel()
    assert caches[1].prefetched == caches[1].unique_misses - first > 0


def test_training_loop_prefetches_and_trains_exactly_as_the_uncached_model():
    """``train`` (whose loop hands the cache each next batch) with tests in between: the tables,
    the row-wise Adagrad state and the MLPs equal, bit for bit (float64: the fp32 kernels are
    the module test's), the uncached host tables' run and the cached run's without prefetch (the
    step called by hand)."""
    import io

    from dlrm.data.synthetic import SyntheticDataset
    from dlrm.engine.logger import RunLogger
    from dlrm.training.lr_schedule import LRSchedule
    from dlrm.training.train import TrainConfig, train

    def source(split, rows):
        return SyntheticDataset(4, TABLES, rows, BATCH, seed=9, split=split, bag_sizes=[2, 3, 1, 2],
                                zipf_exponent=1.1)

    def model(cache_rows):
        torch.manual_seed(0)
        config = DLRMConfig(4, TABLES, 8, [16, 8], [32, 16, 1], embedding_type="joint_fused",
                            poolings=["sum", "mean", "sum", "mean"])
        return DLRM(config, host_tables=HOST, host_cache_rows=cache_rows).double()  # the reference kernels: fast

    cfg = TrainConfig(LRSchedule(0.3), eval_every_steps=7, log_every_steps=100)
    runs = {}
    for name, cache_rows in (("plain", 0), ("prefetch", CACHE_ROWS), ("by_hand", CACHE_ROWS)):
        m = model(cache_rows)
        opt = make_optimizer(m, 0.3, OptimizerConfig(embedding="rowwise_adagrad"))
        if name == "by_hand":
            step = make_train_step(m, opt, Precision("cpu").grad_scaler(), Precision("cpu"))
            data = source("train", BATCH * STEPS)
            for i in range(len(data)):
                step(data.read_batch(i))
        else:
            train(m, opt, Precision("cpu").grad_scaler(), Precision("cpu"), source("train", BATCH * STEPS),
                  source("test", 3 * BATCH), cfg, torch.device("cpu"), RunLogger(None, stream=io.StringIO()))
        runs[name] = (m, opt)
    cache = runs["prefetch"][0].host_embeddings
    assert cache.prefetched > CACHE_ROWS and runs["by_hand"][0].host_embeddings.prefetched == 0
    plain, plain_opt = runs["plain"]
    for name in ("prefetch", "by_hand"):
        m, opt = runs[name]
        for table, weight in tables_of(plain).items():
            assert torch.equal(tables_of(m)[table], weight), (name, table)
        assert torch.equal(opt.embedding_state(m.host_embeddings.weight)["sum"],
                           plain_opt.embedding_state(plain.host_embeddings.weight)["sum"]), name
        for (key, a), b in zip(plain.state_dict().items(), m.state_dict().values()):
            assert torch.equal(a, b), (name, key)
