"""The fused MLP layer (``dlrm.kernels.linear_relu``) against float64 torch computations.

Without CUDA the backward kernels run in Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1), so shapes stay small; the ``cuda`` parameters run the compiled kernels
and skip themselves without a GPU.

Tolerances are error bounds, not guesses (unit roundoff ``u``: 2^-24 fp32, 2^-11 fp16, 2^-8
bf16). ``grad_pre`` is a selection, so it must be exact. The bias gradient sums ``B`` values
in fp32 in some order (any order: at most ``(B - 1) 2^-24`` relative to the sum of absolute
values, the recursive-summation bound) and rounds once to the bias dtype (``u_bias``).

For a whole MLP the bound is carried through the layers in float64 alongside the reference
(``reference_with_bounds``): a layer with ``K`` inputs rounds its operands to the compute
dtype (``u_op`` each: zero where they already are), sums ``K`` products and the bias in fp32
(``(K + 1) 2^-24``) and rounds the result (``u_out``), so its pre-activation error is at most
``|W| e_in + (u_op + (K + 1) 2^-24 + u_out)(|W| (|x| + e_in) + |b|)``; ReLU does not increase
it. Backward, the three products obey the same rule with their own sum lengths. The
reference is the float64 MLP linearised at the activation pattern the fused run computed:
where a float64 pre-activation lies within the bound of zero the two patterns may differ
legitimately (checked: they differ nowhere else), and there the gradient of the float64
network is a different function. A margin of 2 covers the second-order terms.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn.functional as F
import warm_python

from dlrm.kernels import backend
from dlrm.kernels import linear_relu as kernel
from dlrm.nn import mlp as mlp_module
from dlrm.nn.mlp import MLP

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
MARGIN = 2.0
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# The compiled kernels' tiling, run in the interpreter too: several row chunks, column blocks
# and reduction steps on small shapes.
GPU_TILING = {"BLOCK_M": 16, "BLOCK_N": 16, "STEPS": 2, "BLOCK_P": 2}

# (rows, cols): batch 1; one column; sizes off every block multiple (16, 32, 128, 256).
SHAPES = [(1, 7), (1, 300), (37, 1), (37, 5), (67, 33), (150, 130)]


def kernel_device(device: str) -> torch.device:
    """The device to test on, skipping CPU runs where the interpreter is off (a GPU machine)."""
    if device == "cpu" and not backend.interpreting():
        pytest.skip("CPU tensors reach the kernels only under TRITON_INTERPRET=1")
    return torch.device(device)


def randn(shape, dtype: torch.dtype, device, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device=device, dtype=dtype)


def assert_within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """``|got - exact| <= MARGIN * bound + tiny`` elementwise in float64, ``tiny`` half the
    spacing of ``got``'s subnormals (nothing near zero is closer than that)."""
    assert got.shape == exact.shape, what
    error = (got.double() - exact).abs()
    info = torch.finfo(got.dtype)
    limit = MARGIN * bound + info.smallest_normal * info.eps / 2
    worst = (error - limit).flatten().argmax()
    assert torch.all(error <= limit), (
        f"{what}: error {error.flatten()[worst].item():.3g} > bound {limit.flatten()[worst].item():.3g} "
        f"at flat index {worst.item()} (max error {error.max().item():.3g})")


# ----------------------------------------------------------------------------- the kernel


def check_relu_bias_grad(grad_out: torch.Tensor, out: torch.Tensor, bias_dtype: torch.dtype,
                         tuning: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' outputs against float64: ``grad_pre`` exactly, the bias gradient within
    the summation bound; returns them."""
    assert kernel.supports_relu_bias_grad(grad_out, out, bias_dtype)
    grad_pre, grad_bias = kernel._relu_bias_grad(grad_out, out, bias_dtype, tuning)
    exact_pre = torch.where(out.double() > 0, grad_out.double(), 0.0)
    assert grad_pre.dtype == out.dtype and grad_bias.dtype == bias_dtype
    assert torch.equal(grad_pre.double(), exact_pre)
    rows = out.shape[0]
    rel = (rows - 1) * UNIT_ROUNDOFF[torch.float32] + UNIT_ROUNDOFF[bias_dtype]
    assert_within(grad_bias, exact_pre.sum(0), rel * exact_pre.abs().sum(0), "bias gradient")
    return grad_pre, grad_bias


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tuning", [None, GPU_TILING], ids=["default", "gpu_tiling"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,cols", SHAPES)
def test_kernel_matches_float64(device, tuning, dtype, rows, cols):
    device = kernel_device(device)
    grad_out, out = randn((rows, cols), dtype, device, 0), randn((rows, cols), dtype, device, 1)
    check_relu_bias_grad(grad_out, out, torch.float32, tuning)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_bias_gradient_in_a_half_bias_dtype(device, dtype):
    # A model held in fp16/bf16: the fp32 sum is rounded once, into the bias dtype.
    device = kernel_device(device)
    check_relu_bias_grad(randn((67, 33), dtype, device, 0), randn((67, 33), dtype, device, 1), dtype, GPU_TILING)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sign", [-1.0, 1.0], ids=["all_negative", "all_positive"])
def test_all_negative_and_all_positive_outputs(device, sign):
    device = kernel_device(device)
    # ReLU outputs: zero everywhere (all pre-activations negative), or positive everywhere.
    grad_out = randn((37, 20), torch.float32, device, 0)
    out = randn((37, 20), torch.float32, device, 1).abs() * (sign > 0)
    grad_pre, grad_bias = check_relu_bias_grad(grad_out, out, torch.float32, GPU_TILING)
    if sign < 0:
        assert not grad_pre.any() and not grad_bias.any()
    else:
        assert torch.equal(grad_pre, grad_out)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_and_broadcast_gradients(device):
    device = kernel_device(device)
    out = randn((37, 20), torch.float32, device, 1)
    column_major = randn((20, 37), torch.float32, device, 0).t()
    expanded = torch.ones((), device=device).expand(37, 20)  # what ``out.sum().backward()`` sends
    for grad_out in (column_major, expanded):
        check_relu_bias_grad(grad_out, out, torch.float32, GPU_TILING)


def test_nan_output_passes_its_gradient_like_threshold_backward():
    device = kernel_device("cpu")
    out = torch.tensor([[float("nan"), 0.0, -1.0, 2.0]], device=device)
    grad_out = torch.tensor([[1.0, 2.0, 3.0, 4.0]], device=device)
    grad_pre, grad_bias = kernel._relu_bias_grad(grad_out, out, torch.float32)
    reference = kernel.relu_bias_grad_reference(grad_out, out, torch.float32)
    assert torch.equal(grad_pre, reference[0]) and torch.equal(grad_bias, reference[1])
    assert grad_pre.tolist() == [[1.0, 0.0, 0.0, 4.0]]


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_repeats_bit_for_bit(device):
    device = kernel_device(device)
    grad_out, out = randn((100, 40), torch.float32, device, 0), randn((100, 40), torch.float32, device, 1)
    first = kernel._relu_bias_grad(grad_out, out, torch.float32, GPU_TILING)
    second = kernel._relu_bias_grad(grad_out, out, torch.float32, GPU_TILING)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


# ----------------------------------------------------------------------------- the MLP


def reference_with_bounds(mlp: MLP, x: torch.Tensor, grad_out: torch.Tensor, masks: list[torch.Tensor],
                          compute: torch.dtype, fused: list[bool]):
    """The float64 MLP with ``mlp``'s weights, ReLUs replaced by ``masks`` (the computed
    activation pattern): its output and gradients, each with its error bound (module
    docstring), and the float64 pre-activations with theirs. ``compute`` is the compute dtype
    (parameters and input are fp32); ``fused[l]`` says layer ``l`` ran fused (its bias
    gradient is rounded once from fp32, not through ``compute`` as torch's plain path does)."""
    u32, u_c = UNIT_ROUNDOFF[torch.float32], UNIT_ROUNDOFF[compute]
    u_param = 0.0 if compute == torch.float32 else u_c  # parameters cast to the compute dtype
    weights = [layer.weight.detach().double() for layer in mlp.layers]
    biases = [layer.bias.detach().double() for layer in mlp.layers]
    xs, errors = [x.double()], [u_param * x.double().abs()]  # the input is cast like the parameters
    pres, pre_errors = [], []
    for layer, (w, b) in enumerate(zip(weights, biases)):
        a, e = xs[-1], errors[-1]
        pre = a @ w.t() + b
        magnitude = (a.abs() + e) @ w.abs().t() + b.abs()
        pre_error = e @ w.abs().t() + (u_param + (w.shape[1] + 1) * u32 + u_c) * magnitude
        pres.append(pre)
        pre_errors.append(pre_error)
        mask = masks[layer].double() if layer < len(masks) else torch.ones_like(pre)
        xs.append(mask * pre)
        errors.append(mask * pre_error)
    grads = {}
    g, eg = grad_out.double(), torch.zeros_like(grad_out, dtype=torch.float64)
    for layer in reversed(range(len(weights))):
        w, a, e_a = weights[layer], xs[layer], errors[layer]
        mask = masks[layer].double() if layer < len(masks) else torch.ones_like(g)
        gp, egp = mask * g, mask * eg
        batch, fan_out = gp.shape
        gp_magnitude = gp.abs() + egp
        u_bias = u32 if fused[layer] else u_c
        grads[f"layers.{layer}.bias"] = (gp.sum(0), egp.sum(0) + (batch * u32 + u_bias) * gp_magnitude.sum(0))
        grads[f"layers.{layer}.weight"] = (
            gp.t() @ a,
            egp.t() @ (a.abs() + e_a) + gp.abs().t() @ e_a + (batch * u32 + u_c) * gp_magnitude.t() @ (a.abs() + e_a))
        g = gp @ w
        eg = egp @ w.abs() + (u_param + fan_out * u32 + u_c) * gp_magnitude @ w.abs()
    grads["input"] = (g, eg)
    return (xs[-1], errors[-1]), grads, pres, pre_errors


def run_fused_mlp(mlp: MLP, x: torch.Tensor, grad_seed: int, monkeypatch, amp: torch.dtype | None):
    """Forward and backward through ``mlp``, recording the output of every fused layer (its
    activation pattern) and checking that the fused path ran for each ReLU layer."""
    fused_outputs = []

    def recording(*args):
        out = kernel.linear_relu(*args)
        fused_outputs.append(out.detach())
        assert out.grad_fn.name() == kernel.KERNEL_NODE
        return out

    monkeypatch.setattr(mlp_module, "linear_relu", recording)
    x = x.clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        out = mlp(x)
    grad_out = randn(out.shape, out.dtype, out.device, grad_seed)
    out.backward(grad_out)
    relu_layers = len(mlp.layers) - (0 if mlp.relu_last else 1)
    assert len(fused_outputs) == relu_layers
    return out.detach(), grad_out, x.grad, fused_outputs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "autocast_bf16"])
@pytest.mark.parametrize("relu_last", [True, False], ids=["relu_last", "no_relu_last"])
def test_mlp_matches_float64_reference(device, amp, relu_last, monkeypatch):
    device = kernel_device(device)
    torch.manual_seed(0)
    mlp = MLP(13, [24, 17, 5], relu_last=relu_last, device=device, use_kernel=True)
    x = randn((9, 13), torch.float32, device, 2)
    out, grad_out, grad_x, fused_outputs = run_fused_mlp(mlp, x, 3, monkeypatch, amp)
    compute = amp or torch.float32
    assert out.dtype == compute and all(p.grad.dtype == torch.float32 for p in mlp.parameters())
    masks = [o > 0 for o in fused_outputs]
    fused = [layer < len(masks) for layer in range(len(mlp.layers))]
    (exact_out, out_bound), grads, pres, pre_bounds = reference_with_bounds(mlp, x, grad_out, masks, compute, fused)
    # The computed pattern is the float64 network's wherever a pre-activation is clear of zero.
    for mask, pre, bound in zip(masks, pres, pre_bounds):
        clear = pre.abs() > MARGIN * bound
        assert torch.equal(mask[clear], (pre > 0)[clear])
    assert_within(out, exact_out, out_bound, "output")
    assert_within(grad_x, *grads.pop("input"), "input gradient")
    for name, parameter in mlp.named_parameters():
        assert_within(parameter.grad, *grads[name], f"{name} gradient")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp", [None, torch.bfloat16], ids=["fp32", "autocast_bf16"])
def test_mlp_forward_equals_the_plain_path(device, amp):
    # Rounding commutes with ReLU, and on the CPU _addmm_activation is F.linear's addmm then relu_.
    device = kernel_device(device)
    torch.manual_seed(0)
    fused = MLP(13, [24, 17, 5], relu_last=True, device=device, use_kernel=True)
    plain = copy.deepcopy(fused)
    plain.use_kernel = False
    x = randn((9, 13), torch.float32, device, 2)
    with torch.autocast(device.type, dtype=amp or torch.bfloat16, enabled=amp is not None):
        got, expected = fused(x), plain(x)
    assert got.dtype == expected.dtype
    if device.type == "cpu":
        assert torch.equal(got, expected)
    else:  # cuBLASLt's epilogue may take another GEMM algorithm than F.linear's
        torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_mlp_backward_repeats_bit_for_bit(device):
    device = kernel_device(device)
    torch.manual_seed(0)
    mlp = MLP(13, [24, 17, 1], relu_last=False, device=device, use_kernel=True)
    x = randn((300, 13), torch.float32, device, 2)
    runs = []
    for _ in range(2):
        mlp.zero_grad()
        mlp(x).sum().backward()
        runs.append([p.grad.clone() for p in mlp.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_mlp_without_gradients_takes_the_fused_forward():
    device = kernel_device("cpu")
    torch.manual_seed(0)
    mlp = MLP(13, [24, 5], relu_last=True, device=device, use_kernel=True)
    x = randn((9, 13), torch.float32, device, 2)
    with torch.no_grad():
        got = mlp(x)
    mlp.use_kernel = False
    assert torch.equal(got, mlp(x).detach())


def test_float64_and_hooked_layers_take_the_plain_path():
    device = kernel_device("cpu")
    torch.manual_seed(0)
    mlp = MLP(13, [24, 5], relu_last=True, device=device, use_kernel=True)
    x = randn((9, 13), torch.float32, device, 2)
    assert mlp(x).grad_fn.name() == kernel.KERNEL_NODE
    assert mlp.double()(x.double()).grad_fn.name() == "ReluBackward0"
    mlp.float()
    seen = []
    mlp.layers[1].register_forward_hook(lambda module, args, out: seen.append(out.shape))
    assert mlp(x).grad_fn.name() == "ReluBackward0" and seen == [(9, 5)]


# A fresh interpreter without TRITON_INTERPRET: a user's CPU run. The MLP must take the plain
# path, and give what the code before the fused path gave, bit for bit (written out here).
PLAIN_CPU_RUN = """
import torch, torch.nn.functional as F
from dlrm.kernels import linear_relu
from dlrm.nn.mlp import MLP

torch.manual_seed(0)
for relu_last in (True, False):
    for amp in (False, True):
        mlp = MLP(13, [24, 17, 5], relu_last=relu_last, use_kernel=True)
        x = torch.randn(64, 13)
        assert not linear_relu.supports(x, mlp.layers[0].weight, mlp.layers[0].bias)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            out = mlp(x)
            expected = x
            for i, layer in enumerate(mlp.layers):
                expected = layer(expected)
                if i < len(mlp.layers) - 1 or relu_last:
                    expected = F.relu(expected, inplace=True)
        assert torch.equal(out, expected)
        grads = torch.autograd.grad(out.float().sum(), list(mlp.parameters()))
        expected_grads = torch.autograd.grad(expected.float().sum(), list(mlp.parameters()))
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads))
        names, todo = set(), [out.grad_fn]
        while todo:
            node = todo.pop()
            names.add(node.name())
            todo += [n for n, _ in node.next_functions if n is not None]
        assert "ReluBackward0" in names and linear_relu.KERNEL_NODE not in names, names
print("ok")
"""


def test_cpu_without_interpreter_takes_the_plain_path():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = warm_python.run([sys.executable, "-c", PLAIN_CPU_RUN], cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**env, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_a_default_mlp_on_the_cpu_stays_plain_under_the_interpreter():
    """By default only CUDA tensors take the fused layer: a CPU model gives the same numbers
    with the interpreter on or off (the kernel is checked with ``use_kernel=True``)."""
    assert backend.interpreting()
    mlp = MLP(13, [24, 5], relu_last=True)
    out = mlp(randn((4, 13), torch.float32, "cpu", 2))
    assert out.grad_fn.name() == "ReluBackward0"
    mlp.use_kernel = True
    assert mlp(randn((4, 13), torch.float32, "cpu", 2)).grad_fn.name() != "ReluBackward0"


@pytest.mark.parametrize("value", ["0", ""])
def test_interpreter_switched_off_in_process_falls_back(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    x, w, b = randn((4, 3), torch.float32, "cpu", 0), randn((5, 3), torch.float32, "cpu", 1), torch.zeros(5)
    assert not kernel.supports(x, w, b) and not kernel.supports_relu_bias_grad(x, x, torch.float32)
    assert torch.equal(kernel.linear_relu(x, w, b), F.relu(F.linear(x, w, b)))


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.trace's notice
def test_traced_mlp_records_plain_ops():
    # Export traces the model: a Python launch must neither end up in the graph nor break it.
    torch.manual_seed(0)
    mlp = MLP(13, [24, 5], relu_last=True, use_kernel=True)
    x, other = randn((4, 13), torch.float32, "cpu", 2), randn((7, 13), torch.float32, "cpu", 3)
    traced = torch.jit.trace(mlp, (x,), check_trace=False)
    kinds = {node.kind() for node in traced.inlined_graph.nodes()}
    assert "aten::linear" in kinds and ("aten::relu" in kinds or "aten::relu_" in kinds)
    assert not any("PythonOp" in kind or "addmm_activation" in kind for kind in kinds), kinds
    mlp.use_kernel = False
    torch.testing.assert_close(traced(other), mlp(other), rtol=0, atol=0)


@pytest.mark.gpu
def test_cuda_a_kernel_that_cannot_be_built_falls_back_with_a_warning(monkeypatch):
    """A compiler error at the first launch (planted: Triton's own cannot be provoked on
    purpose) warns once; that GPU's MLPs then take the reference, with the same result."""
    calls = []

    def unbuildable(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("planted compiler error\nsecond line")

    monkeypatch.setattr(kernel, "_relu_bias_grad", unbuildable)
    monkeypatch.setattr(kernel, "_UNBUILDABLE", set())
    grad_out, out = randn((64, 48), torch.float32, "cuda", 0), randn((64, 48), torch.float32, "cuda", 1)
    expected = kernel.relu_bias_grad_reference(grad_out, out, torch.float32)
    with pytest.warns(RuntimeWarning, match="could not be built .*planted compiler error"):
        got = kernel.relu_bias_grad(grad_out, out, torch.float32)
    again = kernel.relu_bias_grad(grad_out, out, torch.float32)
    assert len(calls) == 1
    for result in (got, again):
        assert all(torch.equal(a, b) for a, b in zip(result, expected))
