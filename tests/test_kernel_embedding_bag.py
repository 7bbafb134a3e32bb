"""Bag (multi-hot) embedding kernels: pooled gather, deduplicating SGD and row-wise Adagrad updates.

Kernels and torch references are both checked against independent float64 oracles: torch's
``embedding_bag`` (sum) for the forward, its sparse gradient + ``torch.optim.SGD`` for the SGD
update, and row-wise Adagrad written out row by row for the Adagrad one. Without CUDA the kernels
run in Triton's interpreter on CPU tensors (tests/conftest.py sets ``TRITON_INTERPRET=1``), and
every kernel test asserts that ``supports_*`` accepts its inputs, so the kernel path is the one
tested; ``gpu`` tests repeat the checks at training sizes and under CUDA-graph capture.
"""

import pytest
import torch
import torch.nn.functional as F

from dlrm.kernels import backend
from dlrm.kernels.embedding_bag import (
    ADAGRAD_MAX_DIM,
    _bag_rowwise_adagrad_triton,
    _bag_sgd_update_triton,
    bag_gather,
    bag_gather_reference,
    bag_of_positions,
    bag_rowwise_adagrad_update,
    bag_rowwise_adagrad_update_reference,
    bag_sgd_update,
    bag_sgd_update_reference,
    pooled_per_sample,
    supports_bag_gather,
    supports_bag_rowwise_adagrad,
    supports_bag_update,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
FP32_SUM_TOL = 1e-5  # fp32 sums of <= ~150 terms, relative to the sum of absolute values
EPS = 1e-8
needs_triton = pytest.mark.skipif(not backend.triton_installed(), reason="needs Triton")


def scalars(lr: float, grad_scale: float = 1.0, skip: bool = False, device=DEVICE):
    """The 0-dim device tensors the updates take."""
    return (torch.tensor(lr, device=device), torch.tensor(grad_scale, device=device),
            torch.tensor(skip, device=device))


# ----------------------------------------------------------------------------- bags


def bags_from_lengths(lengths, num_rows: int, g: torch.Generator, hot: float = 0.0):
    """Feature-major bags with these lengths, random ids in ``[0, num_rows)`` (so duplicates
    within a bag and across bags and features), a fraction ``hot`` of them replaced by id 0."""
    lengths = torch.as_tensor(lengths, dtype=torch.int64)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    values = torch.randint(0, num_rows, (int(offsets[-1]),), generator=g)
    values[torch.rand(values.numel(), generator=g) < hot] = 0
    return values, offsets


def bag_case(kind: str, num_rows: int, g: torch.Generator, long_bag: int = 130):
    """``(values, offsets, num_features, batch)`` of a named pattern, on the CPU. The updates'
    tests give "mixed" a shorter long bag (``LONG_BAG``): still longer than a small program."""
    if kind == "mixed":  # 3 features x 5 samples: empty bags, bags of one, one long bag, a dup run
        features, batch = 3, 5
        lengths = torch.randint(0, 7, (features * batch,), generator=g)
        lengths[[0, 6, 14]] = 0
        lengths[[1, 9]] = 1
        lengths[7] = long_bag
        values, offsets = bags_from_lengths(lengths, num_rows, g)
        values[offsets[2]:offsets[3]] = 5  # one id repeated inside a bag ...
        values[offsets[12]] = 5  # ... and again in another feature's bag
        return values, offsets, features, batch
    if kind == "hot":  # most ids equal: runs longer than a (small) program's span
        features, batch = 2, 8
        lengths = torch.randint(3, 12, (features * batch,), generator=g)
        return (*bags_from_lengths(lengths, num_rows, g, hot=0.7), features, batch)
    if kind == "one_hot":
        features, batch = 4, 6
        return (*bags_from_lengths(torch.ones(features * batch), num_rows, g), features, batch)
    if kind == "empty":
        features, batch = 2, 3
        return (*bags_from_lengths(torch.zeros(features * batch), num_rows, g), features, batch)
    raise ValueError(kind)


def to_device(*tensors):
    return [None if t is None else t.to(DEVICE) for t in tensors]


# ----------------------------------------------------------------------------- float64 oracles


def oracle_pooled(weight, values, offsets, psw=None, absolute=False):
    """torch's ``embedding_bag`` (sum) in float64; with ``absolute`` the sum of |terms|."""
    w = weight.double()
    p = None if psw is None else psw.double()
    if absolute:
        w, p = w.abs(), (None if p is None else p.abs())
    return F.embedding_bag(values.long(), w, offsets.long(), mode="sum", per_sample_weights=p,
                           include_last_offset=True)


def assert_pooled_close(out, weight, values, offsets, psw=None):
    """Within fp32 summation error of the float64 sum, plus one rounding into ``out``'s dtype.
    A half-precision accumulator, a dropped or doubled id would be far outside it."""
    exact = oracle_pooled(weight, values, offsets, psw)
    scale = oracle_pooled(weight, values, offsets, psw, absolute=True)
    assert out.shape == exact.shape
    error = (out.double() - exact).abs()
    bound = UNIT_ROUNDOFF[out.dtype] * exact.abs() + FP32_SUM_TOL * scale
    assert torch.all(error <= bound), f"max excess {(error - bound).max().item()}"


def oracle_sgd(weight, values, offsets, grad, psw, lr, grad_scale):
    """torch's sparse ``embedding_bag`` gradient and ``torch.optim.SGD``, in float64."""
    w = weight.detach().double().clone().requires_grad_()  # a copy, also of a float64 weight
    p = None if psw is None else psw.double()
    out = F.embedding_bag(values.long(), w, offsets.long(), mode="sum", per_sample_weights=p,
                          include_last_offset=True, sparse=True)
    out.backward(grad.double())
    assert w.grad.is_sparse
    torch.optim.SGD([w], lr=lr * grad_scale).step()
    return w.detach()


def oracle_adagrad(weight, state, values, offsets, grad, psw, lr, grad_scale, eps=EPS):
    """Row-wise Adagrad (FBGEMM / TorchRec), row by row in float64."""
    w = weight.detach().double().clone().requires_grad_()  # a copy, also of a float64 weight
    p = None if psw is None else psw.double()
    out = F.embedding_bag(values.long(), w, offsets.long(), mode="sum", per_sample_weights=p,
                          include_last_offset=True)
    out.backward(grad.double())
    summed = w.grad * grad_scale
    w, s = w.detach().clone(), state.double().clone()
    for r in values.unique().tolist():
        g = summed[r]
        s[r] += (g * g).mean()
        w[r] -= lr * g / (s[r].sqrt() + eps)
    return w, s


def assert_update_matches(weight0, weight, expected, values, atol=1e-5):
    torch.testing.assert_close(weight.double(), expected, rtol=1e-5, atol=atol)
    untouched = torch.ones(weight0.shape[0], dtype=torch.bool, device=weight0.device)
    untouched[values.long()] = False
    assert torch.equal(weight[untouched], weight0[untouched])  # bit for bit


# ----------------------------------------------------------------------------- implementations


def kernel_gather(weight, values, offsets, psw=None, out_dtype=None, num_features=None):
    assert supports_bag_gather(weight, values, offsets, psw, out_dtype)
    return bag_gather(weight, values, offsets, psw, out_dtype, num_features)


def kernel_sgd(weight, values, offsets, grad, lr, scale, skip, psw=None):
    assert supports_bag_update(weight, values, offsets, grad, psw, lr, scale, skip)
    bag_sgd_update(weight, values, offsets, grad, lr, scale, skip, psw)


def kernel_adagrad(weight, state, values, offsets, grad, lr, scale, skip, psw=None, eps=EPS):
    assert supports_bag_rowwise_adagrad(weight, state, values, offsets, grad, psw, lr, scale, skip)
    bag_rowwise_adagrad_update(weight, state, values, offsets, grad, lr, scale, skip, psw, eps)


# The interpreter runs the updates' segmented scan one element at a time: an update costs about
# (sorted ids, rounded up to whole programs) x (columns, rounded up to a block). The update
# cases run on programs of 2 tiles of 16 (a run carried between tiles, runs shared between
# programs) so that a few dozen ids cover what hundreds do at the default program shape;
# test_bag_updates_default_program_shape and the tests calling kernel_sgd / kernel_adagrad
# run that shape.
SMALL_TILE, SMALL_TILES = 16, 2
SMALL_SPAN = SMALL_TILE * SMALL_TILES
LONG_BAG = 40  # "mixed"'s long bag in the update tests: its ids alone fill more than a small program


def small_program_sgd(weight, values, offsets, grad, lr, scale, skip, psw=None):
    assert supports_bag_update(weight, values, offsets, grad, psw, lr, scale, skip)
    _bag_sgd_update_triton(weight, values, offsets, grad, lr, scale, skip, psw, tile=SMALL_TILE, tiles=SMALL_TILES)


def small_program_adagrad(weight, state, values, offsets, grad, lr, scale, skip, psw=None, eps=EPS):
    assert supports_bag_rowwise_adagrad(weight, state, values, offsets, grad, psw, lr, scale, skip)
    _bag_rowwise_adagrad_triton(weight, state, values, offsets, grad, lr, scale, skip, psw, eps,
                                tile=SMALL_TILE, tiles=SMALL_TILES)


def run_spans(values: torch.Tensor, span: int) -> list[tuple[int, int]]:
    """``(first program, last program)`` of every run of equal ids in sorted order."""
    _, counts = torch.unique_consecutive(torch.sort(values.cpu().long()).values, return_counts=True)
    ends = torch.cumsum(counts, 0)
    return [(int(e - c) // span, int(e - 1) // span) for e, c in zip(ends, counts)]


def assert_case_has_its_property(kind, values):
    """What each ``bag_case`` exists for, at the small program shape."""
    spans = run_spans(values, SMALL_SPAN)
    if kind == "hot":  # a run covers a whole program and is shared at both its ends
        assert any(last - first >= 2 for first, last in spans)
    if kind == "mixed":  # more than one program, duplicates
        assert values.numel() > SMALL_SPAN and len(spans) < values.numel()
        assert LONG_BAG > SMALL_SPAN


GATHERS = [pytest.param(kernel_gather, marks=needs_triton, id="kernel"),
           pytest.param(bag_gather_reference, id="reference")]
SGDS = [pytest.param(small_program_sgd, marks=needs_triton, id="kernel"),
        pytest.param(bag_sgd_update_reference, id="reference")]
ADAGRADS = [pytest.param(small_program_adagrad, marks=needs_triton, id="kernel"),
            pytest.param(bag_rowwise_adagrad_update_reference, id="reference")]


# ----------------------------------------------------------------------------- layout helpers


def test_bag_of_positions_passes_over_empty_bags():
    offsets = torch.tensor([0, 0, 2, 2, 2, 3, 6], device=DEVICE)
    assert bag_of_positions(offsets, 6).tolist() == [1, 1, 4, 5, 5, 5]
    assert bag_of_positions(offsets, 0).shape == (0,)


def test_pooled_per_sample_is_a_view_in_sample_order():
    pooled = torch.arange(2 * 3 * 4, dtype=torch.float32, device=DEVICE).view(6, 4)  # T=2, B=3
    per_sample = pooled_per_sample(pooled, 2)
    assert per_sample.shape == (3, 2, 4) and per_sample.data_ptr() == pooled.data_ptr()
    for t in range(2):
        for b in range(3):
            assert torch.equal(per_sample[b, t], pooled[t * 3 + b])
    with pytest.raises(ValueError, match="num_features"):
        pooled_per_sample(pooled, 4)


# ----------------------------------------------------------------------------- bag_gather


@pytest.mark.parametrize("gather", GATHERS)
@pytest.mark.parametrize("kind", ["mixed", "hot", "one_hot", "empty"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 33, 160])
def test_bag_gather_matches_float64(gather, kind, weighted, dim):
    g = torch.Generator().manual_seed(dim + 7 * weighted)
    values, offsets, _, _ = bag_case(kind, 40, g)
    weight = torch.randn(40, dim, generator=g)
    psw = torch.rand(values.numel(), generator=g) * 2 - 0.5 if weighted else None
    weight, values, offsets, psw = to_device(weight, values, offsets, psw)
    out = gather(weight, values, offsets, psw)
    assert out.dtype == torch.float32
    assert_pooled_close(out, weight, values, offsets, psw)


@pytest.mark.parametrize("gather", GATHERS)
@pytest.mark.parametrize("weight_dtype", FLOATS)
@pytest.mark.parametrize("out_dtype", FLOATS)
def test_bag_gather_half_precision_accumulates_in_fp32(gather, weight_dtype, out_dtype):
    """The 130-id bag would be off by far more than the bound with a half-precision sum."""
    g = torch.Generator().manual_seed(11)
    values, offsets, _, _ = bag_case("mixed", 30, g)
    weight = torch.randn(30, 24, generator=g).to(weight_dtype)
    psw = torch.rand(values.numel(), generator=g).to(weight_dtype)
    weight, values, offsets, psw = to_device(weight, values, offsets, psw)
    out = gather(weight, values, offsets, psw, out_dtype)
    assert out.dtype == out_dtype
    assert_pooled_close(out, weight, values, offsets, psw)


@needs_triton
@pytest.mark.parametrize("weight_dtype", FLOATS)
@pytest.mark.parametrize("out_dtype", FLOATS)
def test_bag_gather_bags_of_one_equal_reference_bit_for_bit(weight_dtype, out_dtype):
    """One product, one rounding: the kernel and the reference must agree exactly (this also
    pins the kernel's fp32 -> bf16 rounding to nearest even)."""
    g = torch.Generator().manual_seed(12)
    values, offsets, _, _ = bag_case("one_hot", 50, g)
    weight = torch.randn(50, 40, generator=g).to(weight_dtype)
    psw = torch.rand(values.numel(), generator=g) * 3
    weight, values, offsets, psw = to_device(weight, values, offsets, psw)
    for p in (None, psw):
        out = kernel_gather(weight, values, offsets, p, out_dtype)
        assert torch.equal(out, bag_gather_reference(weight, values, offsets, p, out_dtype))
    assert torch.equal(kernel_gather(weight, values, offsets, None, torch.float32), weight[values].float())


@pytest.mark.parametrize("gather", GATHERS)
def test_bag_gather_per_sample_layout(gather):
    g = torch.Generator().manual_seed(13)
    values, offsets, features, batch = bag_case("mixed", 40, g)
    weight = torch.randn(40, 20, generator=g)
    weight, values, offsets = to_device(weight, values, offsets)
    flat = gather(weight, values, offsets)
    per_sample = gather(weight, values, offsets, None, torch.float16, features)
    assert per_sample.shape == (batch, features, 20) and per_sample.is_contiguous()
    assert torch.equal(per_sample, pooled_per_sample(flat, features).half())
    for t in range(features):
        for b in range(batch):
            i = t * batch + b
            ids = values[offsets[i]:offsets[i + 1]]
            torch.testing.assert_close(flat[t * batch + b], weight[ids].double().sum(0).float(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="num_features"):
        gather(weight, values, offsets, None, None, 4)  # 15 bags are not 4 features


@needs_triton
def test_bag_gather_strided_inputs():
    """A weight with a row stride and a storage offset, every-other-element values, offsets and
    weights: the same result as contiguous copies."""
    g = torch.Generator().manual_seed(14)
    values, offsets, _, _ = bag_case("mixed", 30, g)
    psw = torch.rand(values.numel(), generator=g)
    big = torch.randn(70, 24, generator=g)
    weight, values, offsets, psw, big = to_device(big[7:67:2], values, offsets, psw, big)
    strided = [every_other(x, -999) for x in (values, offsets)]
    psw_strided = every_other(psw, float("nan"))
    assert not weight.is_contiguous() and strided[0].stride(0) == 2
    out = kernel_gather(weight, *strided, psw_strided)
    assert torch.equal(out, kernel_gather(weight.contiguous(), values, offsets, psw))
    assert_pooled_close(out, weight, values, offsets, psw)


@needs_triton
def test_bag_gather_int32_ids_and_offsets():
    g = torch.Generator().manual_seed(15)
    values, offsets, _, _ = bag_case("mixed", 30, g)
    weight, values, offsets = to_device(torch.randn(30, 16, generator=g), values, offsets)
    out = kernel_gather(weight, values.int(), offsets.int())
    assert torch.equal(out, kernel_gather(weight, values, offsets))
    assert_pooled_close(out, weight, values, offsets)


@pytest.mark.parametrize("gather", GATHERS)
def test_bag_gather_no_bags_and_no_ids(gather):
    weight = torch.randn(5, 8, device=DEVICE)
    none = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    out = gather(weight, none, torch.zeros(1, dtype=torch.int64, device=DEVICE), None, torch.bfloat16)
    assert out.shape == (0, 8) and out.dtype == torch.bfloat16
    out = gather(weight, none, torch.zeros(4, dtype=torch.int64, device=DEVICE))
    assert out.shape == (3, 8) and torch.all(out == 0)


@needs_triton
def test_bag_gather_kernel_reads_zeros_for_out_of_range_ids():
    """The data layer checks ids; the kernel must still never read outside the table."""
    weight = torch.randn(6, 16, device=DEVICE)
    values = torch.tensor([2, 6, -1, 1_000_000, 5, 1], device=DEVICE)
    offsets = torch.tensor([0, 2, 4, 6], device=DEVICE)
    out = kernel_gather(weight, values, offsets)
    assert torch.equal(out[0], weight[2]) and torch.all(out[1] == 0)
    torch.testing.assert_close(out[2], weight[5] + weight[1])
    with pytest.raises((IndexError, RuntimeError)):
        bag_gather_reference(weight, values, offsets)


# ----------------------------------------------------------------------------- bag_sgd_update


@pytest.mark.parametrize("update", SGDS)
@pytest.mark.parametrize("kind", ["mixed", "hot", "one_hot", "empty"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 20])  # one column; a ragged block of columns
def test_bag_sgd_update_equals_torch_sparse_sgd(update, kind, weighted, dim):
    g = torch.Generator().manual_seed(100 + dim + weighted)
    values, offsets, features, batch = bag_case(kind, 30, g, LONG_BAG)
    weight0 = torch.randn(30, dim, generator=g)
    grad = torch.randn(features * batch, dim, generator=g)
    psw = torch.rand(values.numel(), generator=g) * 2 - 0.5 if weighted else None
    assert_case_has_its_property(kind, values)
    weight0, values, offsets, grad, psw = to_device(weight0, values, offsets, grad, psw)
    weight = weight0.clone()
    update(weight, values, offsets, grad, *scalars(0.1, 0.5), psw)
    expected = oracle_sgd(weight0, values, offsets, grad, psw, 0.1, 0.5)
    assert_update_matches(weight0, weight, expected, values)
    if kind != "empty":
        assert not torch.equal(weight, weight0)


@needs_triton
@pytest.mark.parametrize("tile,tiles", [(2, 1), (4, 2), (16, 1)])
def test_bag_sgd_update_runs_shared_by_many_programs(tile, tiles):
    """Small programs: the hot id's run crosses dozens of them (atomic adds), others cross
    tiles inside one program (carried partial sums)."""
    g = torch.Generator().manual_seed(tile * 10 + tiles)
    values, offsets = bags_from_lengths(torch.randint(0, 16, (8,), generator=g), 25, g, hot=0.85)
    assert max(last - first for first, last in run_spans(values, tile * tiles)) >= 2  # whole programs inside
    weight0 = torch.randn(25, 12, generator=g)
    grad = torch.randn(8, 12, generator=g)
    psw = torch.rand(values.numel(), generator=g)
    weight0, values, offsets, grad, psw = to_device(weight0, values, offsets, grad, psw)
    weight = weight0.clone()
    _bag_sgd_update_triton(weight, values, offsets, grad, *scalars(0.05, 2.0), psw, tile=tile, tiles=tiles)
    assert_update_matches(weight0, weight, oracle_sgd(weight0, values, offsets, grad, psw, 0.05, 2.0), values)


@pytest.mark.parametrize("update", SGDS)
def test_bag_sgd_update_gradient_layouts(update):
    """``grad_pooled`` as ``[B, T, D]`` (contiguous, or the per-sample view of ``[T*B, D]``) and
    as a ``[T*B, D]`` view with a row stride: all give the bag-order result."""
    g = torch.Generator().manual_seed(16)
    values, offsets, features, batch = bag_case("mixed", 30, g, LONG_BAG)
    weight0 = torch.randn(30, 12, generator=g)
    grad = torch.randn(features * batch, 12, generator=g)
    weight0, values, offsets, grad = to_device(weight0, values, offsets, grad)
    expected = oracle_sgd(weight0, values, offsets, grad, None, 0.1, 1.0)
    layouts = [
        pooled_per_sample(grad, features).contiguous(),  # [B, T, D], what bag_gather(num_features) gives
        pooled_per_sample(grad, features),  # its strided view
        torch.cat([grad, torch.full_like(grad, float("nan"))], 1)[:, :12],  # row stride 24
    ]
    for layout in layouts:
        weight = weight0.clone()
        update(weight, values, offsets, layout, *scalars(0.1))
        assert_update_matches(weight0, weight, expected, values)


def every_other(x: torch.Tensor, filler) -> torch.Tensor:
    """``x`` as a view with stride 2, ``filler`` in between."""
    return torch.stack([x, torch.full_like(x, filler)], 1).view(-1)[::2]


@needs_triton
def test_bag_updates_strided_int32_bags():
    """int32 ids and offsets with stride 2, strided per-sample weights and Adagrad state, a
    row-strided weight: both update kernels still match their float64 oracles."""
    g = torch.Generator().manual_seed(24)
    values, offsets, features, batch = bag_case("mixed", 30, g, LONG_BAG)
    big = torch.randn(60, 16, generator=g)
    grad = torch.randn(features * batch, 16, generator=g)
    psw = torch.rand(values.numel(), generator=g)
    state0 = torch.rand(30, generator=g)
    big, values, offsets, grad, psw, state0 = to_device(big, values, offsets, grad, psw, state0)
    strided = (every_other(values.int(), -7), every_other(offsets.int(), -7), every_other(psw, float("nan")))
    weight0 = big[::2]
    weight = weight0.clone()
    kernel_sgd(weight, strided[0], strided[1], grad, *scalars(0.1), strided[2])
    assert_update_matches(weight0, weight, oracle_sgd(weight0, values, offsets, grad, psw, 0.1, 1.0), values)
    weight, state = big.clone()[::2], every_other(state0, float("nan"))  # a strided state too
    assert weight.stride(0) == 32 and state.stride(0) == 2
    kernel_adagrad(weight, state, strided[0], strided[1], grad, *scalars(0.1), strided[2])
    expected_weight, expected_state = oracle_adagrad(weight0, state0, values, offsets, grad, psw, 0.1, 1.0)
    assert_update_matches(weight0, weight, expected_weight, values)
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("update", SGDS)
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_bag_sgd_update_half_gradients_accumulate_in_fp32(update, grad_dtype):
    g = torch.Generator().manual_seed(17)
    values, offsets, features, batch = bag_case("hot", 20, g)
    weight0 = torch.randn(20, 16, generator=g)
    grad = torch.randn(features * batch, 16, generator=g).to(grad_dtype)
    # Id 0 sums ~90 gradient rows: a half-precision sum would be off by far more than atol.
    rows_of_0 = grad[bag_of_positions(offsets, values.numel())[values == 0]]
    half_sum = torch.zeros(16, dtype=grad_dtype)
    for row in rows_of_0:
        half_sum += row
    assert len(rows_of_0) > 60
    assert (0.01 * (half_sum.double() - rows_of_0.double().sum(0))).abs().max() > 1e-5
    weight0, values, offsets, grad = to_device(weight0, values, offsets, grad)
    weight = weight0.clone()
    update(weight, values, offsets, grad, *scalars(0.01))
    assert_update_matches(weight0, weight, oracle_sgd(weight0, values, offsets, grad, None, 0.01, 1.0), values,
                          atol=2e-6)


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.bfloat16])
def test_bag_sgd_update_half_weights_round_each_row_once(weight_dtype):
    """Half-precision master weights (the kernel's two passes, or the reference): sums in fp32
    and rounds each row once, to within half an ulp of the float64 result."""
    g = torch.Generator().manual_seed(18)
    values, offsets, features, batch = bag_case("mixed", 30, g, LONG_BAG)
    weight0 = torch.randn(30, 16, generator=g).to(weight_dtype)
    grad = torch.randn(features * batch, 16, generator=g)
    weight0, values, offsets, grad = to_device(weight0, values, offsets, grad)
    args = scalars(0.5)
    weight = weight0.clone()
    bag_sgd_update(weight, values, offsets, grad, *args)
    exact = oracle_sgd(weight0, values, offsets, grad, None, 0.5, 1.0)
    assert torch.all((weight.double() - exact).abs() <= UNIT_ROUNDOFF[weight_dtype] * exact.abs() * 1.001 + 1e-6)


@pytest.mark.parametrize("update", SGDS)
def test_bag_sgd_update_skip_leaves_weight_bit_identical(update):
    g = torch.Generator().manual_seed(19)
    values, offsets, features, batch = bag_case("mixed", 30, g, LONG_BAG)
    weight0 = torch.randn(30, 16, generator=g)
    weight0[5] = -0.0  # a signed zero must keep its sign
    grad = torch.randn(features * batch, 16, generator=g)
    grad[2, 3], grad[7, 0] = float("nan"), float("inf")
    weight0, values, offsets, grad = to_device(weight0, values, offsets, grad)
    weight = weight0.clone()
    update(weight, values, offsets, grad, *scalars(0.1, 1.0, skip=True))
    assert torch.equal(weight.view(torch.int32), weight0.view(torch.int32))


@pytest.mark.parametrize("update", SGDS)
def test_bag_sgd_update_nonfinite_gradient_stays_in_its_rows(update):
    """An inf in one bag's gradient reaches only the rows of that bag."""
    weight0 = torch.randn(10, 16, generator=torch.Generator().manual_seed(20), device="cpu").to(DEVICE)
    values = torch.tensor([1, 2, 2, 5, 7, 1, 8, 2], device=DEVICE)
    offsets = torch.tensor([0, 3, 5, 8], device=DEVICE)  # bag 1 is {5, 7}
    grad = torch.randn(3, 16, generator=torch.Generator().manual_seed(21)).to(DEVICE)
    grad[1, 4] = float("inf")
    weight = weight0.clone()
    update(weight, values, offsets, grad, *scalars(0.1))
    assert weight[5, 4] == float("-inf") and weight[7, 4] == float("-inf")
    finite = torch.tensor([1, 2, 8], device=DEVICE)
    expected = oracle_sgd(weight0, values, offsets, torch.where(grad.isinf(), 0.0, grad), None, 0.1, 1.0)
    torch.testing.assert_close(weight[finite].double(), expected[finite], rtol=1e-6, atol=1e-6)


@needs_triton
def test_bag_sgd_update_kernel_skips_out_of_range_ids():
    weight0 = torch.randn(6, 16, device=DEVICE)
    values = torch.tensor([2, 6, -1, 1_000_000, 5, 2], device=DEVICE)
    offsets = torch.tensor([0, 2, 4, 6], device=DEVICE)
    grad = torch.randn(3, 16, device=DEVICE)
    weight = weight0.clone()
    kernel_sgd(weight, values, offsets, grad, *scalars(1.0))
    in_range = values.clamp(0, 5) == values
    expected = oracle_sgd(weight0, values[in_range], torch.tensor([0, 1, 1, 3], device=DEVICE), grad, None, 1.0, 1.0)
    torch.testing.assert_close(weight.double(), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises((IndexError, RuntimeError)):
        bag_sgd_update_reference(weight0.clone(), values, offsets, grad, *scalars(1.0))


# ----------------------------------------------------------------------------- row-wise Adagrad


@pytest.mark.parametrize("update", ADAGRADS)
@pytest.mark.parametrize("kind", ["mixed", "hot", "one_hot"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dim", [1, 20])  # one column; a ragged block of columns
def test_bag_rowwise_adagrad_matches_float64(update, kind, weighted, dim):
    g = torch.Generator().manual_seed(200 + dim + weighted)
    values, offsets, features, batch = bag_case(kind, 30, g, LONG_BAG)
    weight0 = torch.randn(30, dim, generator=g)
    state0 = torch.rand(30, generator=g) * (kind != "one_hot")  # one case starts from zeros
    grad = torch.randn(features * batch, dim, generator=g)
    psw = torch.rand(values.numel(), generator=g) * 2 - 0.5 if weighted else None
    assert_case_has_its_property(kind, values)
    weight0, state0, values, offsets, grad, psw = to_device(weight0, state0, values, offsets, grad, psw)
    weight, state = weight0.clone(), state0.clone()
    update(weight, state, values, offsets, grad, *scalars(0.1, 0.5), psw)
    expected_weight, expected_state = oracle_adagrad(weight0, state0, values, offsets, grad, psw, 0.1, 0.5)
    assert_update_matches(weight0, weight, expected_weight, values)
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-5, atol=1e-7)
    untouched = torch.ones(30, dtype=torch.bool, device=DEVICE)
    untouched[values] = False
    assert torch.equal(state[untouched], state0[untouched])


@needs_triton
@pytest.mark.parametrize("tile,tiles", [(2, 1), (2, 2), (4, 4)])
def test_bag_rowwise_adagrad_runs_shared_by_many_programs(tile, tiles):
    """Runs that cross programs are summed by several programs of the first pass (atomics
    into the run's buffer row) before the row-wise step; two steps, so the second one reads the
    state the first wrote."""
    g = torch.Generator().manual_seed(tile * 10 + tiles)
    values, offsets = bags_from_lengths(torch.randint(0, 16, (8,), generator=g), 25, g, hot=0.85)
    assert max(last - first for first, last in run_spans(values, tile * tiles)) >= 2  # whole programs inside
    weight0 = torch.randn(25, 12, generator=g)
    state0 = torch.zeros(25)
    grads = torch.randn(2, 8, 12, generator=g)
    psw = torch.rand(values.numel(), generator=g)
    weight0, state0, values, offsets, grads, psw = to_device(weight0, state0, values, offsets, grads, psw)
    weight, state = weight0.clone(), state0.clone()
    expected_weight, expected_state = weight0, state0
    for grad in grads:
        _bag_rowwise_adagrad_triton(weight, state, values, offsets, grad, *scalars(0.05, 2.0), psw,
                                    tile=tile, tiles=tiles)
        expected_weight, expected_state = oracle_adagrad(expected_weight, expected_state, values, offsets, grad,
                                                         psw, 0.05, 2.0)
    assert_update_matches(weight0, weight, expected_weight, values)
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-5, atol=1e-7)


@needs_triton
def test_bag_updates_default_program_shape():
    """The public functions at their own program shape: a hot run shared by two programs."""
    g = torch.Generator().manual_seed(25)
    values, offsets = bags_from_lengths(torch.full((12,), 25), 20, g, hot=0.9)
    assert any(last > first for first, last in run_spans(values, 256))
    weight0 = torch.randn(20, 8, generator=g)
    state0 = torch.rand(20, generator=g)
    grad = torch.randn(12, 8, generator=g)
    weight0, state0, values, offsets, grad = to_device(weight0, state0, values, offsets, grad)
    weight = weight0.clone()
    kernel_sgd(weight, values, offsets, grad, *scalars(0.1, 0.5))
    assert_update_matches(weight0, weight, oracle_sgd(weight0, values, offsets, grad, None, 0.1, 0.5), values)
    weight, state = weight0.clone(), state0.clone()
    kernel_adagrad(weight, state, values, offsets, grad, *scalars(0.1, 0.5))
    expected_weight, expected_state = oracle_adagrad(weight0, state0, values, offsets, grad, None, 0.1, 0.5)
    assert_update_matches(weight0, weight, expected_weight, values)
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("update", ADAGRADS)
def test_bag_rowwise_adagrad_skip_leaves_weight_and_state_bit_identical(update):
    g = torch.Generator().manual_seed(22)
    values, offsets, features, batch = bag_case("hot", 30, g)
    weight0 = torch.randn(30, 16, generator=g)
    weight0[0] = -0.0
    state0 = torch.rand(30, generator=g)
    grad = torch.randn(features * batch, 16, generator=g)
    grad[2, 3] = float("inf")
    weight0, state0, values, offsets, grad = to_device(weight0, state0, values, offsets, grad)
    weight, state = weight0.clone(), state0.clone()
    update(weight, state, values, offsets, grad, *scalars(0.1, 1.0, skip=True))
    assert torch.equal(weight.view(torch.int32), weight0.view(torch.int32))
    assert torch.equal(state, state0)


def test_bag_rowwise_adagrad_wide_rows_take_the_reference():
    weight0 = torch.randn(4, ADAGRAD_MAX_DIM + 1, device=DEVICE)
    values = torch.tensor([1, 3, 1], device=DEVICE)
    offsets = torch.tensor([0, 2, 3], device=DEVICE)
    grad = torch.randn(2, ADAGRAD_MAX_DIM + 1, device=DEVICE)
    state0 = torch.zeros(4, device=DEVICE)
    assert not supports_bag_rowwise_adagrad(weight0, state0, values, offsets, grad, None, *scalars(0.1))
    weight, state = weight0.clone(), state0.clone()
    bag_rowwise_adagrad_update(weight, state, values, offsets, grad, *scalars(0.1))
    expected_weight, expected_state = oracle_adagrad(weight0, state0, values, offsets, grad, None, 0.1, 1.0)
    torch.testing.assert_close(weight.double(), expected_weight, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- fallbacks


def fallback_case(dtype=torch.float32, device=DEVICE):
    g = torch.Generator().manual_seed(23)
    weight = torch.randn(12, 16, generator=g).to(dtype).to(device)
    values = torch.tensor([1, 1, 4, 11, 1, 0], device=device)
    offsets = torch.tensor([0, 3, 3, 5, 6], device=device)
    grad = torch.randn(4, 16, generator=g).to(device)
    psw = torch.rand(6, generator=g).to(device)
    return weight, values, offsets, grad, psw


def assert_reference_taken(weight, values, offsets, grad, psw):
    """``supports_*`` refuse, and the public functions give the references' results, which are
    right (float64 oracles)."""
    args = scalars(0.3, 0.5, device=weight.device)
    state0 = torch.rand(weight.shape[0], dtype=weight.dtype, device=weight.device)
    assert not supports_bag_gather(weight, values, offsets, psw)
    assert not supports_bag_update(weight, values, offsets, grad, psw, *args)
    assert not supports_bag_rowwise_adagrad(weight, state0, values, offsets, grad, psw, *args)
    out = bag_gather(weight, values, offsets, psw)
    assert torch.equal(out, bag_gather_reference(weight, values, offsets, psw))
    assert_pooled_close(out, weight, values, offsets, psw)
    updated, expected = weight.clone(), weight.clone()
    bag_sgd_update(updated, values, offsets, grad, *args, psw)
    bag_sgd_update_reference(expected, values, offsets, grad, *args, psw)
    assert torch.equal(updated, expected)
    assert_update_matches(weight, updated, oracle_sgd(weight, values, offsets, grad, psw, 0.3, 0.5), values)
    updated, state = weight.clone(), state0.clone()
    bag_rowwise_adagrad_update(updated, state, values, offsets, grad, *args, psw)
    expected_weight, expected_state = oracle_adagrad(weight, state0, values, offsets, grad, psw, 0.3, 0.5)
    assert_update_matches(weight, updated, expected_weight, values)
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-5, atol=1e-7)


def test_fallback_float64_weight():
    assert_reference_taken(*fallback_case(torch.float64))


def test_fallback_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert_reference_taken(*fallback_case(device="cpu"))


def test_fallback_without_triton(monkeypatch):
    monkeypatch.setattr(backend, "triton_installed", lambda: False)
    assert_reference_taken(*fallback_case())


def test_fallback_unsupported_layouts():
    weight, values, offsets, grad, psw = fallback_case()
    args = scalars(0.3, 0.5)
    assert not supports_bag_gather(weight.t().contiguous().t(), values, offsets)  # columns not contiguous
    assert not supports_bag_gather(weight, values.float(), offsets)
    assert not supports_bag_gather(weight, values, offsets, psw[:-1])
    assert not supports_bag_gather(weight, values, offsets, None, torch.float64)
    assert not supports_bag_update(weight, values, offsets, torch.randn(4, 32, device=DEVICE)[:, ::2], None, *args)
    assert not supports_bag_update(weight, values, offsets, grad[:-1], None, *args)
    assert not supports_bag_update(weight, values, offsets, grad, None, torch.tensor([0.3], device=DEVICE),
                                   *args[1:])
    state = torch.zeros(weight.shape[0], device=DEVICE)
    assert not supports_bag_rowwise_adagrad(weight, state.double(), values, offsets, grad, None, *args)
    assert not supports_bag_rowwise_adagrad(weight, state[:-1], values, offsets, grad, None, *args)
    out = bag_gather(weight.t().contiguous().t(), values, offsets, psw, torch.float64)
    assert out.dtype == torch.float64
    assert_pooled_close(out, weight, values, offsets, psw)
    with pytest.raises(ValueError, match="grad_pooled"):
        bag_sgd_update(weight.clone(), values, offsets, grad[:-1], *args)


# ----------------------------------------------------------------------------- GPU, training sizes


def gpu_case(weighted=True):
    """26 features x 8192 samples, 0-20 ids a bag (1 in a few features), 1M rows of 128,
    a hot id 0 in 20% of the positions."""
    g = torch.Generator().manual_seed(0)
    features, batch, rows, dim = 26, 8192, 1_000_000, 128
    lengths = torch.randint(0, 21, (features, batch), generator=g)
    lengths[:5] = 1
    values, offsets = bags_from_lengths(lengths.view(-1), rows, g, hot=0.2)
    weight = torch.rand(rows, dim, generator=g) - 0.5
    psw = torch.rand(values.numel(), generator=g) if weighted else None
    grad = torch.randn(batch, features, dim, generator=g)
    return [t if t is None else t.cuda() for t in (weight, values, offsets, psw, grad)] + [features]


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", FLOATS)
def test_gpu_bag_gather_training_sizes(out_dtype):
    weight, values, offsets, psw, _, features = gpu_case()
    out = kernel_gather(weight, values, offsets, psw, out_dtype, features)
    expected = bag_gather_reference(weight, values, offsets, psw, torch.float32, features)
    torch.testing.assert_close(out.float(), expected, rtol=UNIT_ROUNDOFF[out_dtype] * 2, atol=1e-4)


def assert_near_float64(got, exact, sums_magnitude, rtol=1e-5, atol=1e-4):
    """Within ``rtol``/``atol`` of the float64 result, plus fp32 summation error where a row
    sums very many contributions (the hot id: 350k here): ``1e-6 * sum |contributions|``, a few
    hundred ulps of that magnitude, whatever the order the kernel and the reference add in."""
    bound = atol + rtol * exact.abs() + 1e-6 * sums_magnitude
    error = (got.double() - exact).abs()
    assert torch.all(error <= bound), f"max excess {(error - bound).max().item():.3g}"


def contribution_magnitude(values, offsets, grad, psw, scale, rows):
    """``scale * sum |w_j * grad[bag(j)]|`` per row, in float64: what a row's fp32 sum can lose."""
    from dlrm.kernels.embedding_bag import bag_of_positions
    per_bag = grad.transpose(0, 1).reshape(-1, grad.shape[2]).abs().double()
    contrib = per_bag.index_select(0, bag_of_positions(offsets, values.numel())) * psw.double().abs()[:, None]
    out = torch.zeros(rows, grad.shape[2], dtype=torch.float64, device=grad.device)
    return out.index_add_(0, values, contrib) * scale


@pytest.mark.gpu
def test_gpu_bag_updates_training_sizes():
    weight0, values, offsets, psw, grad, _ = gpu_case()
    args = scalars(0.01, 0.5)
    f64 = (torch.tensor(0.01, dtype=torch.float64, device="cuda"), torch.tensor(0.5, dtype=torch.float64,
           device="cuda"), args[2])
    magnitude = 0.01 * contribution_magnitude(values, offsets, grad, psw, 0.5, weight0.shape[0])
    weight, expected = weight0.clone(), weight0.double()
    kernel_sgd(weight, values, offsets, grad, *args, psw)
    bag_sgd_update_reference(expected, values, offsets, grad.double(), *f64, psw.double())
    assert_near_float64(weight, expected, magnitude)
    state0 = torch.rand(weight0.shape[0], device="cuda")
    weight, state = weight0.clone(), state0.clone()
    expected, expected_state = weight0.double(), state0.double()
    kernel_adagrad(weight, state, values, offsets, grad, *args, psw)
    bag_rowwise_adagrad_update_reference(expected, expected_state, values, offsets, grad.double(), *f64,
                                         psw.double())
    # Adagrad normalises the step by the row's own gradient size, so the summation error is
    # relative: rtol on the state, and on the step through it.
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-4, atol=1e-5)
    assert_near_float64(weight, expected, 0.0, rtol=1e-4)


@pytest.mark.gpu
def test_gpu_bag_updates_in_cuda_graph():
    """No host sync and static shapes: both updates can be captured and replayed, and ``skip``
    is read at replay time."""
    weight0, values, offsets, psw, grad, _ = gpu_case()
    lr, scale, skip = scalars(0.01, 1.0)
    state0 = torch.rand(weight0.shape[0], device="cuda")
    weight, state = weight0.clone(), state0.clone()
    expected, expected_state = weight0.double(), state0.double()
    f64 = (lr.double(), scale.double(), skip)
    bag_sgd_update_reference(expected, values, offsets, grad.double(), *f64, psw.double())
    bag_rowwise_adagrad_update_reference(expected, expected_state, values, offsets, grad.double(), *f64,
                                         psw.double())
    on = torch.tensor(True, device="cuda")
    kernel_sgd(weight, values, offsets, grad, lr, scale, on, psw)  # compile first
    kernel_adagrad(weight, state, values, offsets, grad, lr, scale, on, psw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kernel_sgd(weight, values, offsets, grad, lr, scale, skip, psw)
        kernel_adagrad(weight, state, values, offsets, grad, lr, scale, skip, psw)
    weight.copy_(weight0)
    state.copy_(state0)
    graph.replay()
    torch.testing.assert_close(state.double(), expected_state, rtol=1e-4, atol=1e-5)
    assert_near_float64(weight, expected, 0.01 * contribution_magnitude(values, offsets, grad, psw, 1.0,
                                                                        weight0.shape[0]), rtol=1e-4)
    weight.copy_(weight0)
    state.copy_(state0)
    skip.fill_(True)
    graph.replay()
    assert torch.equal(weight, weight0) and torch.equal(state, state0)
