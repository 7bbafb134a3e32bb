"""The bag updates' kernels on fp16/bf16 tables: two passes (fp32 run sums, then one step per
row), fp32 arithmetic, one rounding per row, to nearest or stochastically (bf16).

Checked against the torch references bit for bit where the fp32 sums are exact (dyadic
gradients and mean-pooling weights, so no reassociation can change a sum, which also shows the
stochastic draws are the same), within one unit in the last place otherwise; the references
against float64; stochastic rounding unbiased through the update; ``skip`` and fp32 tables
untouched by it. Without CUDA the kernels run in Triton's interpreter (tests/conftest.py).
"""

import pytest
import torch
import torch.nn.functional as F

from dlrm.kernels import backend
from dlrm.kernels.embedding_bag import (
    _bag_rowwise_adagrad_triton,
    _bag_sgd_update_triton,
    bag_rowwise_adagrad_update,
    bag_rowwise_adagrad_update_reference,
    bag_sgd_update,
    bag_sgd_update_reference,
    pooled_per_sample,
    supports_bag_rowwise_adagrad,
    supports_bag_update,
)
from test_kernel_embedding_bag import DEVICE, EPS, bags_from_lengths, oracle_adagrad, oracle_sgd, scalars, to_device

pytestmark = pytest.mark.skipif(not backend.triton_installed(), reason="needs Triton")

HALF = [torch.float16, torch.bfloat16]
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}
MIN_NORMAL_EXPONENT = {torch.float16: -14, torch.bfloat16: -126, torch.float32: -126}
# (weight dtype, stochastic): fp16 always rounds to nearest, even with a rounding step.
ROUNDINGS = [pytest.param(torch.float16, False, id="fp16"), pytest.param(torch.bfloat16, False, id="bf16"),
             pytest.param(torch.bfloat16, True, id="bf16-stochastic")]
OPTIMIZERS = ["sgd", "adagrad"]
LR = 0.1
# Row-wise Adagrad scales partial sums in the first pass: a power of two keeps them exact. SGD
# steps by (lr * grad_scale) * sum in the second: any scale (the order must be the reference's).
GRAD_SCALE = {"sgd": 0.3, "adagrad": 0.5}
ROWS, DIM = 24, 16  # a power-of-two D: Adagrad's mean(g * g) divides exactly


def spacing(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The distance between neighbouring ``dtype`` values around each ``|x|`` (float64)."""
    _, exponent = torch.frexp(x.double().abs())  # |x| in [2^(e-1), 2^e)
    exponent = (exponent - 1).clamp(min=MIN_NORMAL_EXPONENT[dtype])  # subnormals: the smallest step
    return torch.pow(2.0, (exponent - MANTISSA_BITS[dtype]).double())


def assert_within_one_ulp(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    got, expected = got.double(), expected.double()
    error = (got - expected).abs()
    bound = spacing(torch.maximum(got.abs(), expected.abs()), dtype)
    assert torch.all(error <= bound), f"max excess {(error - bound).max().item():.3g}"


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal bit patterns: also tells -0.0 from 0.0 and compares NaNs."""
    assert a.dtype == b.dtype
    assert torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.view(torch.int16 if b.element_size() == 2 else torch.int32))


def assert_kernel_equals_reference(kernel: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype) -> None:
    """Bit for bit in the interpreter, which computes as torch does; within one unit on a GPU,
    where compiled kernels may fuse a multiply and an add (``enable_fp_fusion``) and divide
    approximately, so a row's fp32 value, and then its rounding, may differ in the last bit."""
    if DEVICE.type == "cpu":
        assert_bits_equal(kernel, reference)
    else:
        assert_within_one_ulp(kernel, reference, dtype)


def rounding_step(stochastic: bool, step: int = 12345) -> torch.Tensor | None:
    return torch.tensor(step, dtype=torch.int64, device=DEVICE) if stochastic else None


def dyadic_case(dtype: torch.dtype, seed: int, hot: float = 0.5):
    """Bags of 0, 1, 2 or 4 ids with mean-pooling weights (1/len), gradients in multiples of
    1/8: every product and every sum of them is exact in fp32, whatever the order. A hot id 0
    (a fraction ``hot`` of the ids) makes runs that cross programs. Weights exact in ``dtype``,
    an Adagrad state in multiples of 1/16."""
    g = torch.Generator().manual_seed(seed)
    features, batch = 3, 8
    lengths = torch.tensor([0, 1, 2, 4])[torch.randint(0, 4, (features * batch,), generator=g)]
    values, offsets = bags_from_lengths(lengths, ROWS, g, hot=hot)
    psw = (1.0 / lengths.clamp(min=1).float()).repeat_interleave(lengths)
    grad = torch.randint(-8, 9, (features * batch, DIM), generator=g) / 8.0
    weight = (torch.randn(ROWS, DIM, generator=g)).to(dtype)
    state = torch.randint(0, 64, (ROWS,), generator=g) / 16.0
    return (*to_device(weight, state, values, offsets, grad, psw), features)


def random_case(dtype: torch.dtype, seed: int, dim: int, batch: int = 8):
    """Random bags (duplicates within and across bags, a hot id), weights and gradients."""
    g = torch.Generator().manual_seed(seed)
    features = 3
    lengths = torch.randint(0, 7, (features * batch,), generator=g)
    values, offsets = bags_from_lengths(lengths, ROWS, g, hot=0.3)
    psw = torch.rand(values.numel(), generator=g) + 0.5
    grad = torch.randn(features * batch, dim, generator=g)
    weight = torch.randn(ROWS, dim, generator=g).to(dtype)
    state = torch.rand(ROWS, generator=g)
    return (*to_device(weight, state, values, offsets, grad, psw), features)


def summed_gradient(rows: int, values, offsets, grad, psw) -> torch.Tensor:
    """Each row's summed gradient ``sum(w_j * grad[bag(j)])``, float64 (``embedding_bag``'s backward)."""
    weight = torch.zeros(rows, grad.shape[1], dtype=torch.float64, device=grad.device, requires_grad=True)
    pooled = F.embedding_bag(values, weight, offsets, mode="sum", per_sample_weights=psw.double(),
                             include_last_offset=True)
    pooled.backward(grad.double())
    return weight.grad


def grad_per_bag(grad: torch.Tensor) -> torch.Tensor:
    """``[T*B, D]`` of a ``[B, T, D]`` gradient (the oracles take bag order)."""
    return grad if grad.dim() == 2 else grad.transpose(0, 1).reshape(-1, grad.shape[2])


def run_update(optimizer: str, kernel: bool, weight, state, values, offsets, grad, psw, step,
               tile: int = 16, tiles: int = 1, skip: bool = False) -> None:
    """One update in place: the kernel path (``supports_*`` must accept it) or the torch
    reference. The kernel runs through the private launchers with a short program span
    (``tiles = 1``): the interpreter walks every tile of a program, used or not."""
    args = scalars(LR, GRAD_SCALE[optimizer], skip)
    if optimizer == "sgd":
        if not kernel:
            bag_sgd_update_reference(weight, values, offsets, grad, *args, psw, step)
            return
        assert supports_bag_update(weight, values, offsets, grad, psw, *args, rounding_step=step)
        _bag_sgd_update_triton(weight, values, offsets, grad, *args, psw, tile=tile, tiles=tiles, rounding_step=step)
        return
    if not kernel:
        bag_rowwise_adagrad_update_reference(weight, state, values, offsets, grad, *args, psw, EPS, step)
        return
    assert supports_bag_rowwise_adagrad(weight, state, values, offsets, grad, psw, *args, rounding_step=step)
    _bag_rowwise_adagrad_triton(weight, state, values, offsets, grad, *args, psw, EPS, tile=tile, tiles=tiles,
                                rounding_step=step)


# ----------------------------------------------------------------------------- kernel == reference


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype,stochastic", ROUNDINGS)
@pytest.mark.parametrize("layout", ["bags", "per_sample"])
def test_kernel_equals_reference_bit_for_bit_when_sums_are_exact(optimizer, dtype, stochastic, layout):
    """Runs split over many programs (tile 2 x 2), mean pooling, both gradient layouts: with
    exact sums the kernel's fp32 rows are the reference's, so are their roundings (and draws)."""
    weight0, state0, values, offsets, grad, psw, features = dyadic_case(dtype, seed=len(layout) + stochastic)
    if layout == "per_sample":
        grad = pooled_per_sample(grad, features)  # [B, T, D], a strided view
    g = GRAD_SCALE["adagrad"] * summed_gradient(ROWS, values, offsets, grad_per_bag(grad), psw)
    assert (g * g).sum(dim=1).max() < 2**11  # the precondition: Adagrad's sum of g * g is exact too
    step = rounding_step(stochastic)
    results = []
    for kernel in (True, False):
        weight, state = weight0.clone(), state0.clone()
        run_update(optimizer, kernel, weight, state, values, offsets, grad, psw, step, tile=2, tiles=2)
        results.append((weight, state))
    (kernel_weight, kernel_state), (reference_weight, reference_state) = results
    assert not torch.equal(kernel_weight, weight0)
    assert_kernel_equals_reference(kernel_weight, reference_weight, dtype)
    assert_kernel_equals_reference(kernel_state, reference_state, torch.float32)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype,stochastic", ROUNDINGS)
def test_kernel_within_one_ulp_of_reference_for_random_gradients(optimizer, dtype, stochastic):
    """fp32 sums in another order may differ in their last bits, and so flip a rounding by one
    unit; D = 200 makes SGD's second pass tile columns (the draws key on the whole row's column)."""
    dim = 200 if optimizer == "sgd" else 40
    # Half the samples at D = 200: the cost in the interpreter is ids x columns.
    weight0, state0, values, offsets, grad, psw, _ = random_case(dtype, seed=7 + stochastic, dim=dim,
                                                                 batch=4 if optimizer == "sgd" else 8)
    assert values.unique().numel() < values.numel()  # duplicates: sums the kernel reassociates
    step = rounding_step(stochastic)
    kernel_weight, kernel_state = weight0.clone(), state0.clone()
    run_update(optimizer, True, kernel_weight, kernel_state, values, offsets, grad, psw, step)
    reference_weight, reference_state = weight0.clone(), state0.clone()
    run_update(optimizer, False, reference_weight, reference_state, values, offsets, grad, psw, step)
    assert_within_one_ulp(kernel_weight, reference_weight, dtype)
    assert (kernel_weight == reference_weight).float().mean() > 0.95
    torch.testing.assert_close(kernel_state, reference_state, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------- against float64


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype,stochastic", ROUNDINGS)
def test_update_is_the_float64_result_rounded_once(kernel, optimizer, dtype, stochastic):
    """Within one unit of the float64 result rounded to nearest; stochastically rounded values
    are one of the two neighbours of the float64 result (less than a unit from it). Rows not
    used stay bit for bit."""
    weight0, state0, values, offsets, grad, psw, _ = random_case(dtype, seed=11, dim=40)
    weight, state = weight0.clone(), state0.clone()
    run_update(optimizer, kernel, weight, state, values, offsets, grad, psw, rounding_step(stochastic))
    if optimizer == "sgd":
        exact = oracle_sgd(weight0, values, offsets, grad, psw, LR, GRAD_SCALE[optimizer])
    else:
        exact, exact_state = oracle_adagrad(weight0, state0, values, offsets, grad, psw, LR, GRAD_SCALE[optimizer])
        torch.testing.assert_close(state.double(), exact_state, rtol=1e-5, atol=1e-7)
    assert_within_one_ulp(weight, exact.to(dtype), dtype)
    if stochastic:
        assert torch.all((weight.double() - exact).abs() < spacing(exact, dtype))
    unused = torch.ones(ROWS, dtype=torch.bool, device=DEVICE)
    unused[values] = False
    assert_bits_equal(weight[unused], weight0[unused])


# ----------------------------------------------------------------------------- stochastic rounding


def tiny_update_case(rows: int = 64, dim: int = 64):
    """bf16 weights in [1, 2) (spacing 2^-7), one bag of one id per row, and a gradient that
    moves every weight up by 2^-10 with ``lr = 1``: an eighth of the spacing."""
    g = torch.Generator().manual_seed(5)
    weight = (1 + torch.rand(rows, dim, generator=g) * 0.9).to(torch.bfloat16)
    values = torch.arange(rows)
    offsets = torch.arange(rows + 1)
    grad = torch.full((rows, dim), -(2.0**-10))
    return to_device(weight, values, offsets, grad)


def tiny_update(kernel: bool, weight, values, offsets, grad, step: int | None) -> None:
    step = None if step is None else torch.tensor(step, device=DEVICE)
    if kernel:
        assert supports_bag_update(weight, values, offsets, grad, None, *scalars(1.0), rounding_step=step)
        _bag_sgd_update_triton(weight, values, offsets, grad, *scalars(1.0), None, tiles=1, rounding_step=step)
    else:
        bag_sgd_update_reference(weight, values, offsets, grad, *scalars(1.0), None, step)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
def test_stochastic_rounding_is_unbiased_through_the_update(kernel):
    """From the same start, steps with different ``rounding_step`` move a weight by 2^-10 (an
    eighth of its spacing) on average, each element up one unit with probability 1/8;
    round to nearest never moves it."""
    weight0, values, offsets, grad = tiny_update_case()
    moves = []
    for step in range(8):
        weight = weight0.clone()
        tiny_update(kernel, weight, values, offsets, grad, step)
        moves.append(weight.double() - weight0.double())
    moves = torch.stack(moves)
    assert torch.all((moves == 0) | (moves == 2.0**-7))  # one of the two neighbours
    # 32768 Bernoulli(1/8) draws: the mean fraction has a standard deviation of 0.0018.
    moved_up = (moves != 0).double().mean().item()
    assert abs(moved_up - 0.125) < 0.01, moved_up
    assert not torch.equal(moves[0], moves[1])  # the step changes the draws
    weight = weight0.clone()
    tiny_update(kernel, weight, values, offsets, grad, None)
    assert_bits_equal(weight, weight0)


def test_stochastic_rounding_keeps_a_row_learning_over_many_steps():
    """Applied again and again (the kernel, stepping ``rounding_step``), updates far below
    half a unit add up as they would in exact arithmetic."""
    weight0, values, offsets, grad = tiny_update_case(rows=16)
    weight = weight0.clone()
    steps = 24
    for step in range(steps):
        tiny_update(True, weight, values, offsets, grad, step)
    moved = (weight.double() - weight0.double()).mean().item() / (steps * 2.0**-10)
    assert 0.9 < moved < 1.1, moved


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fp16_tables_ignore_the_rounding_step(optimizer):
    weight0, state0, values, offsets, grad, psw, _ = random_case(torch.float16, seed=13, dim=DIM)
    results = []
    for step in (None, rounding_step(True)):
        weight, state = weight0.clone(), state0.clone()
        run_update(optimizer, True, weight, state, values, offsets, grad, psw, step)
        results.append(weight)
    assert_bits_equal(*results)


# ----------------------------------------------------------------------------- skip, fp32, edge cases


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("dtype", HALF)
def test_skip_leaves_weight_and_state_bit_identical(optimizer, dtype):
    weight0, state0, values, offsets, grad, psw, _ = random_case(dtype, seed=17, dim=16)
    weight0[0] = -0.0  # a signed zero keeps its sign
    grad[2, 3], grad[5, 0] = float("nan"), float("inf")
    weight, state = weight0.clone(), state0.clone()
    run_update(optimizer, True, weight, state, values, offsets, grad, psw, rounding_step(dtype == torch.bfloat16),
               skip=True)
    assert_bits_equal(weight, weight0)
    assert_bits_equal(state, state0)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_public_functions_take_the_kernels_for_half_tables(optimizer):
    """``bag_sgd_update`` / ``bag_rowwise_adagrad_update`` (default program shapes) give the
    kernel path's result, bit for bit."""
    weight0, state0, values, offsets, grad, psw, _ = dyadic_case(torch.bfloat16, seed=29, hot=0.0)
    step = rounding_step(True)
    args = scalars(LR, GRAD_SCALE[optimizer])
    weight, state = weight0.clone(), state0.clone()
    if optimizer == "sgd":
        bag_sgd_update(weight, values, offsets, grad, *args, psw, rounding_step=step)
    else:
        bag_rowwise_adagrad_update(weight, state, values, offsets, grad, *args, psw, EPS, rounding_step=step)
    expected, expected_state = weight0.clone(), state0.clone()
    run_update(optimizer, True, expected, expected_state, values, offsets, grad, psw, step)
    assert not torch.equal(weight, weight0)
    assert_bits_equal(weight, expected)
    assert_bits_equal(state, expected_state)


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "reference"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_fp32_tables_ignore_the_rounding_step(kernel, optimizer):
    weight0, state0, values, offsets, grad, psw, _ = random_case(torch.float32, seed=19, dim=DIM)
    results = []
    for step in (None, rounding_step(True)):
        weight, state = weight0.clone(), state0.clone()
        run_update(optimizer, kernel, weight, state, values, offsets, grad, psw, step)
        results.append((weight, state))
    assert_bits_equal(results[0][0], results[1][0])
    assert_bits_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_kernel_skips_out_of_range_ids_on_half_tables(optimizer):
    """Ids outside the table are passed over (the reference, which raises on them, runs on the
    bags without them); the other rows are stepped as usual."""
    g = torch.Generator().manual_seed(23)
    weight0 = torch.randn(6, DIM, generator=g).to(torch.bfloat16).to(DEVICE)
    state0 = torch.rand(6, generator=g).to(DEVICE)
    values = torch.tensor([2, 6, -1, 1_000_000, 5, 2], device=DEVICE)
    offsets = torch.tensor([0, 2, 4, 6], device=DEVICE)
    grad = (torch.randint(-8, 9, (3, DIM), generator=g) / 8.0).to(DEVICE)
    step = rounding_step(True)
    weight, state = weight0.clone(), state0.clone()
    run_update(optimizer, True, weight, state, values, offsets, grad, None, step)
    in_range = (values >= 0) & (values < 6)
    expected, expected_state = weight0.clone(), state0.clone()
    run_update(optimizer, False, expected, expected_state, values[in_range], torch.tensor([0, 1, 1, 3], device=DEVICE),
               grad, None, step)
    assert_kernel_equals_reference(weight, expected, torch.bfloat16)
    assert_kernel_equals_reference(state, expected_state, torch.float32)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_no_ids_change_nothing(optimizer):
    weight0 = torch.randn(5, DIM, device=DEVICE).to(torch.bfloat16)
    state0 = torch.rand(5, device=DEVICE)
    values = torch.zeros(0, dtype=torch.int64, device=DEVICE)
    offsets = torch.zeros(4, dtype=torch.int64, device=DEVICE)  # three empty bags
    grad = torch.randn(3, DIM, device=DEVICE)
    weight, state = weight0.clone(), state0.clone()
    run_update(optimizer, True, weight, state, values, offsets, grad, None, rounding_step(True))
    assert_bits_equal(weight, weight0)
    assert_bits_equal(state, state0)
