import math

import pytest
import torch
from torch import nn

from dlrm.nn.embeddings import JointEmbedding, MultiTableEmbedding
from dlrm.nn.init import init_embedding_table_, init_linear_

SIZES = [3, 7, 1, 12, 5]
DIM = 6
LAYOUTS = [JointEmbedding, MultiTableEmbedding]


def random_ids(batch, sizes, dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    columns = [torch.randint(0, rows, (batch,), generator=g) for rows in sizes]
    return torch.stack(columns, dim=1).to(dtype)


def random_tables(sizes, dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, dim, generator=g) for rows in sizes]


def loaded(cls, tables, **kwargs):
    module = cls([t.shape[0] for t in tables], tables[0].shape[1], **kwargs)
    for i, table in enumerate(tables):
        module.load_table_(i, table)
    return module


@pytest.mark.parametrize("cls", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8])
def test_lookup_equals_table_rows(cls, dtype):
    tables = random_tables(SIZES, DIM)
    module = loaded(cls, tables)
    ids = random_ids(9, SIZES, dtype)
    out = module(ids)
    assert out.shape == (9, len(SIZES), DIM)
    for b in range(9):
        for t in range(len(SIZES)):
            assert torch.equal(out[b, t], tables[t][int(ids[b, t])])


def test_joint_equals_multi_table():
    tables = random_tables(SIZES, DIM, seed=3)
    ids = random_ids(32, SIZES, seed=4)
    joint, multi = loaded(JointEmbedding, tables), loaded(MultiTableEmbedding, tables)
    assert torch.equal(joint(ids), multi(ids))


def test_joint_offsets():
    module = JointEmbedding(SIZES, DIM)
    assert module.offsets.dtype == torch.int64
    assert module.offsets.tolist() == [0, 3, 10, 11, 23]
    assert module.weight.shape == (sum(SIZES), DIM)
    # lookup of table t id k is row offset_t + k of the joint weight
    for t, rows in enumerate(SIZES):
        for k in range(rows):
            ids = torch.zeros(1, len(SIZES), dtype=torch.int64)
            ids[0, t] = k
            assert torch.equal(module(ids)[0, t], module.weight[module.offsets[t] + k])


def test_joint_offsets_do_not_overflow_narrow_ids():
    sizes = [300, 200]  # offset 300 does not fit in int8; ids + offsets must be widened first
    tables = random_tables(sizes, 2)
    module = loaded(JointEmbedding, tables)
    ids = torch.tensor([[100, 120]], dtype=torch.int8)
    torch.testing.assert_close(module(ids)[0, 1], tables[1][120])


@pytest.mark.parametrize("cls", LAYOUTS)
def test_gradients_are_sparse_and_touch_only_used_rows(cls):
    tables = random_tables(SIZES, DIM)
    module = loaded(cls, tables)
    ids = torch.tensor([[0, 6, 0, 11, 2], [0, 2, 0, 11, 4], [1, 6, 0, 3, 2]])
    upstream = torch.randn(3, len(SIZES), DIM)
    (module(ids) * upstream).sum().backward()
    params = list(module.parameters())
    assert len(params) == (1 if cls is JointEmbedding else len(SIZES))
    for t in range(len(SIZES)):
        grad = params[0].grad if cls is JointEmbedding else params[t].grad
        assert grad.is_sparse
        grad = grad.coalesce().to_dense()
        if cls is JointEmbedding:
            start = sum(SIZES[:t])
            grad = grad[start : start + SIZES[t]]
        expected = torch.zeros(SIZES[t], DIM)
        for b in range(3):
            expected[ids[b, t]] += upstream[b, t]
        torch.testing.assert_close(grad, expected)
    if cls is JointEmbedding:
        touched = set(params[0].grad.coalesce().indices()[0].tolist())
        used = {int(ids[b, t]) + sum(SIZES[:t]) for b in range(3) for t in range(len(SIZES))}
        assert touched == used


@pytest.mark.parametrize("cls", LAYOUTS)
def test_hash_indices(cls):
    tables = random_tables(SIZES, DIM)
    hashed = loaded(cls, tables, hash_indices=True)
    ids = torch.tensor([[3, 7, 5, 12, 4], [100, -1, 2, 25, 1_000_003], [0, 13, 1, 11, -6]])
    out = hashed(ids)
    for b in range(ids.shape[0]):
        for t, rows in enumerate(SIZES):
            assert torch.equal(out[b, t], tables[t][int(ids[b, t]) % rows])  # Python's % is floor modulo


def test_hash_indices_narrow_dtype():
    tables = random_tables([5, 3], 2)
    module = loaded(JointEmbedding, tables, hash_indices=True)
    ids = torch.tensor([[-128, 127]], dtype=torch.int8)
    out = module(ids)
    assert torch.equal(out[0, 0], tables[0][-128 % 5]) and torch.equal(out[0, 1], tables[1][127 % 3])


@pytest.mark.parametrize("cls", LAYOUTS)
def test_table_weight_round_trip_and_view(cls):
    tables = random_tables(SIZES, DIM)
    module = loaded(cls, tables)
    for i, table in enumerate(tables):
        assert torch.equal(module.table_weight(i), table)
        assert not module.table_weight(i).requires_grad
    # a view: writing through it changes what the model looks up
    module.table_weight(3)[4] = 42.0
    ids = torch.zeros(1, len(SIZES), dtype=torch.int64)
    ids[0, 3] = 4
    assert torch.all(module(ids)[0, 3] == 42.0)
    # and load_table_ copies: changing the source afterwards does not touch the model
    source = torch.ones(SIZES[1], DIM)
    module.load_table_(1, source)
    source.zero_()
    assert torch.all(module.table_weight(1) == 1.0)


@pytest.mark.parametrize("cls", LAYOUTS)
def test_load_table_shape_mismatch(cls):
    module = cls(SIZES, DIM)
    with pytest.raises(ValueError, match=r"table 2: expected shape \(1, 6\), got \(2, 6\)"):
        module.load_table_(2, torch.zeros(2, DIM))
    with pytest.raises(ValueError, match=r"table 0: expected shape \(3, 6\), got \(3, 5\)"):
        module.load_table_(0, torch.zeros(3, DIM - 1))
    with pytest.raises(IndexError, match="table index 5"):
        module.load_table_(5, torch.zeros(3, DIM))


@pytest.mark.parametrize("cls", LAYOUTS)
def test_rejects_wrong_number_of_features(cls):
    module = cls(SIZES, DIM)
    with pytest.raises(ValueError, match=r"\[B, 5\]"):
        module(torch.zeros(2, 1, dtype=torch.int64))  # would silently broadcast over offsets


@pytest.mark.parametrize("cls", LAYOUTS)
def test_init_bounds_per_table(cls):
    torch.manual_seed(0)
    sizes = [4, 100, 20_000]
    module = cls(sizes, 16)
    for i, rows in enumerate(sizes):
        weight = module.table_weight(i)
        bound = math.sqrt(1.0 / rows)
        assert weight.abs().max() <= bound
        # the bound is reached (nearly): the table uses its own bound, not one shared by all
        assert weight.abs().max() > 0.9 * bound


def test_init_statistics_large_table():
    torch.manual_seed(0)
    rows, dim = 50_000, 16
    weight = torch.empty(rows, dim)
    init_embedding_table_(weight)
    bound = math.sqrt(1.0 / rows)
    assert weight.min() >= -bound and weight.max() <= bound
    assert weight.min() < -0.999 * bound and weight.max() > 0.999 * bound
    assert abs(weight.mean().item()) < 0.01 * bound
    # uniform on [-a, a] has std a / sqrt(3)
    assert weight.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.01)


def test_init_statistics_large_linear():
    torch.manual_seed(0)
    layer = nn.Linear(1024, 512)
    init_linear_(layer)
    weight_std = math.sqrt(2.0 / (1024 + 512))
    bias_std = math.sqrt(1.0 / 512)
    assert layer.weight.std().item() == pytest.approx(weight_std, rel=0.01)
    assert abs(layer.weight.mean().item()) < 0.01 * weight_std
    # normal, not uniform: about 4.6% of samples lie beyond 2 sigma (a uniform has none)
    beyond = (layer.weight.abs() > 2 * weight_std).float().mean().item()
    assert beyond == pytest.approx(0.0455, abs=0.003)
    # 512 biases: the sample std is within ~3% (1 sigma) of the true one
    assert layer.bias.std().item() == pytest.approx(bias_std, rel=0.15)


@pytest.mark.parametrize("cls", LAYOUTS)
def test_deterministic_under_seed(cls):
    torch.manual_seed(7)
    a = cls(SIZES, DIM)
    torch.manual_seed(7)
    b = cls(SIZES, DIM)
    torch.manual_seed(8)
    c = cls(SIZES, DIM)
    for i in range(len(SIZES)):
        assert torch.equal(a.table_weight(i), b.table_weight(i))
    assert not torch.equal(a.table_weight(3), c.table_weight(3))


def test_same_seed_same_tables_in_both_layouts():
    torch.manual_seed(11)
    joint = JointEmbedding(SIZES, DIM)
    torch.manual_seed(11)
    multi = MultiTableEmbedding(SIZES, DIM)
    for i in range(len(SIZES)):
        assert torch.equal(joint.table_weight(i), multi.table_weight(i))


@pytest.mark.parametrize("cls", LAYOUTS)
def test_buffers_not_in_state_dict(cls):
    keys = set(cls(SIZES, DIM).state_dict())
    if cls is JointEmbedding:
        assert keys == {"weight"}
    else:
        assert keys == {f"tables.{i}.weight" for i in range(len(SIZES))}


@pytest.mark.parametrize("cls", LAYOUTS)
@pytest.mark.parametrize("sizes,dim", [([], 4), ([3, 0], 4), ([3], 0)])
def test_invalid_sizes(cls, sizes, dim):
    with pytest.raises(ValueError):
        cls(sizes, dim)


@pytest.mark.parametrize("cls", LAYOUTS)
def test_tables_drawn_on_several_threads_equal_those_drawn_one_after_another(cls):
    """On the CPU the tables are drawn on a thread each; every table has its own generators, so
    the weights are those of drawing each table alone (``init_table_rows_``, the plain path)."""
    from dlrm.nn.init import init_table_rows_

    sizes = [300_000, 7, 20_000, 1, 4_096]  # one past a generator block (2**18 rows)
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        module = cls(sizes, 8, init_seed=1234)
    finally:
        torch.set_num_threads(threads)
    for i, rows in enumerate(sizes):
        expected = torch.empty(rows, 8)
        init_table_rows_(expected, 1234, i, rows)
        assert torch.equal(module.table_weight(i), expected), i
