"""The fused dot-interaction kernels against a float64 torch computation.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (conftest sets
TRITON_INTERPRET=1), so shapes here stay small; the ``cuda`` parameters and the Criteo-batch
test run the compiled kernels and skip themselves without a GPU.

Tolerances are error bounds, not guesses: the kernel rounds its operands to the compute dtype
(``u_op`` each, TF32 included), sums ``K`` products in fp32 (at most ``K * 2^-24`` relative,
recursive-summation bound), and rounds the result to the output dtype (``u_out``). So
``|got - exact| <= (u_out + 2 u_op + K 2^-24) * sum_k |x_k y_k|``, and the right-hand
magnitude is the same float64 computation on absolute values. A margin of 2 covers the
second-order terms. Padding is compared exactly (zero), and so is the copied bottom vector.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from dlrm.kernels import backend
from dlrm.kernels.dot_interaction import dot_interaction, supports
from dlrm.nn.interactions import DotInteraction, dot_interaction_reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_NODE = "DotInteractionFunctionBackward"  # autograd node of the kernels' Function
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
TF32_ROUNDOFF = 2.0**-10  # 10 stored mantissa bits; covers truncation as well as rounding
MARGIN = 2.0
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

# (batch, embeddings F, dim D), n = F + 1: one embedding and batch 1; D below 16 (tl.dot's
# minimum) and odd; Criteo (n = 27, width 479 -> 480); n = 64 (one 64-row tile); n = 65 and
# n = 131 (several tiles per side, off-diagonal tiles); D = 256 (several column steps).
SHAPES = [(1, 1, 16), (7, 3, 5), (3, 5, 37), (3, 26, 128), (2, 63, 64), (2, 64, 16), (1, 130, 24), (2, 7, 256)]


def kernel_device(device: str) -> torch.device:
    """The device to test on, skipping CPU runs where the interpreter is off (a GPU machine)."""
    if device == "cpu" and not backend.interpreting():
        pytest.skip("CPU tensors reach the kernels only under TRITON_INTERPRET=1")
    return torch.device(device)


def random_inputs(batch: int, num_embedded: int, dim: int, dtype: torch.dtype, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    bottom = torch.randn(batch, dim, generator=g).to(device=device, dtype=dtype)
    embedded = torch.randn(batch, num_embedded, dim, generator=g).to(device=device, dtype=dtype)
    return bottom, embedded


def exact_interaction(bottom: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
    """The layout from its definition, in float64: bottom, <v_i, v_j> for i > j row by row, zeros."""
    bottom, embedded = bottom.double(), embedded.double()
    features = torch.cat([bottom.unsqueeze(1), embedded], dim=1)
    n = features.shape[1]
    gram = features @ features.transpose(1, 2)
    pairs = [(i, j) for i in range(n) for j in range(i)]
    rows = torch.tensor([i for i, _ in pairs], dtype=torch.long, device=bottom.device)
    cols = torch.tensor([j for _, j in pairs], dtype=torch.long, device=bottom.device)
    values = torch.cat([bottom, gram[:, rows, cols]], dim=1)
    padding = (-values.shape[1]) % 8
    return torch.cat([values, values.new_zeros(values.shape[0], padding)], dim=1)


def assert_within(got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, rel: float, what: str) -> None:
    """``|got - exact| <= MARGIN * rel * magnitude + tiny`` elementwise, in float64, where
    ``tiny`` is half the spacing of ``got``'s subnormals: an fp16 output near zero cannot be
    closer than that, however exact the arithmetic."""
    assert got.shape == exact.shape, what
    error = (got.double() - exact).abs()
    info = torch.finfo(got.dtype)
    bound = MARGIN * rel * magnitude + info.smallest_normal * info.eps / 2
    if error.numel() == 0:
        return
    worst = (error - bound).argmax()
    assert torch.all(error <= bound), (
        f"{what}: error {error.flatten()[worst].item():.3g} > bound {bound.flatten()[worst].item():.3g} "
        f"at flat index {worst.item()} (max error {error.max().item():.3g})"
    )


def operand_roundoff(input_dtype: torch.dtype, compute: torch.dtype, device: torch.device) -> float:
    """Relative rounding of one operand on its way into the dot product."""
    if compute == torch.float32:
        tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
        return TF32_ROUNDOFF if tf32 else 0.0
    return 0.0 if input_dtype == compute else UNIT_ROUNDOFF[compute]


def check_forward(out, bottom, embedded, compute: torch.dtype) -> None:
    """Shape, dtype, exact bottom copy and padding, and the Gram bound against float64."""
    exact = exact_interaction(bottom, embedded)
    assert out.shape == exact.shape and out.dtype == compute
    dim = bottom.shape[1]
    n = embedded.shape[1] + 1
    used = dim + n * (n - 1) // 2
    assert torch.equal(out[:, :dim], bottom.to(compute))
    assert torch.all(out[:, used:] == 0)
    magnitude = exact_interaction(bottom.abs(), embedded.abs())
    u_op = max(operand_roundoff(bottom.dtype, compute, out.device),
               operand_roundoff(embedded.dtype, compute, out.device))
    rel = UNIT_ROUNDOFF[compute] + 2 * u_op + dim * UNIT_ROUNDOFF[torch.float32]
    assert_within(out, exact, magnitude, rel, "forward")


def exact_gradients(bottom, embedded, grad_out):
    """float64 autograd through ``exact_interaction``; with absolute values it gives the
    magnitude ``|S + S^T| @ |features| + |grad_out[:, :D]|`` the error bound scales with."""
    b = bottom.detach().double().requires_grad_(True)
    e = embedded.detach().double().requires_grad_(True)
    torch.autograd.backward(exact_interaction(b, e), grad_out.double())
    return b.grad, e.grad


def check_backward(bottom, embedded, grad_out, compute: torch.dtype) -> None:
    """Gradients in each input's dtype, within the bound, against float64 autograd."""
    exact_b, exact_e = exact_gradients(bottom, embedded, grad_out)
    magnitude_b, magnitude_e = exact_gradients(bottom.abs(), embedded.abs(), grad_out.abs())
    n = embedded.shape[1] + 1
    assert bottom.grad.dtype == bottom.dtype and embedded.grad.dtype == embedded.dtype
    u_op = max(operand_roundoff(bottom.dtype, compute, bottom.device),
               operand_roundoff(embedded.dtype, compute, bottom.device))
    accumulate = (n + 1) * UNIT_ROUNDOFF[torch.float32]
    rel_b = UNIT_ROUNDOFF[bottom.dtype] + 2 * u_op + accumulate
    rel_e = UNIT_ROUNDOFF[embedded.dtype] + 2 * u_op + accumulate
    assert_within(bottom.grad, exact_b, magnitude_b, rel_b, "d_bottom")
    assert_within(embedded.grad, exact_e, magnitude_e, rel_e, "d_embedded")


def run_kernel(bottom, embedded, grad_seed: int = 1):
    """Forward and backward through ``dot_interaction``; asserts the kernels, not the reference, ran."""
    bottom.requires_grad_(True)
    embedded.requires_grad_(True)
    out = dot_interaction(bottom, embedded)
    assert out.grad_fn is not None and out.grad_fn.name() == KERNEL_NODE
    g = torch.Generator().manual_seed(grad_seed)
    grad_out = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    out.backward(grad_out)
    return out.detach(), grad_out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch,num_embedded,dim", SHAPES)
def test_forward_and_backward_match_float64(device, dtype, batch, num_embedded, dim):
    device = kernel_device(device)
    bottom, embedded = random_inputs(batch, num_embedded, dim, dtype, device)
    assert supports(bottom, embedded)
    out, grad_out = run_kernel(bottom, embedded)
    check_forward(out, bottom, embedded, dtype)
    check_backward(bottom, embedded, grad_out, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
def test_random_shapes(device, seed):
    device = kernel_device(device)
    g = torch.Generator().manual_seed(100 + seed)
    batch, num_embedded, dim = (int(torch.randint(lo, hi, (1,), generator=g)) for lo, hi in [(1, 6), (1, 80), (1, 150)])
    dtype = DTYPES[seed % len(DTYPES)]
    bottom, embedded = random_inputs(batch, num_embedded, dim, dtype, device, seed=seed)
    out, grad_out = run_kernel(bottom, embedded)
    check_forward(out, bottom, embedded, dtype)
    check_backward(bottom, embedded, grad_out, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("amp_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_autocast_output_dtype_and_values(device, amp_dtype):
    device = kernel_device(device)
    bottom, embedded = random_inputs(3, 26, 64, torch.float32, device)
    with torch.autocast(device.type, dtype=amp_dtype):
        out, grad_out = run_kernel(bottom, embedded)
        reference = dot_interaction_reference(bottom.detach(), embedded.detach())
    assert out.dtype == reference.dtype == amp_dtype
    check_forward(out, bottom.detach(), embedded.detach(), amp_dtype)
    check_backward(bottom, embedded, grad_out, amp_dtype)  # gradients stay float32


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_promote_like_cat(device):
    device = kernel_device(device)
    bottom, _ = random_inputs(3, 4, 24, torch.float16, device)
    _, embedded = random_inputs(3, 4, 24, torch.float32, device, seed=1)
    out, grad_out = run_kernel(bottom, embedded)
    assert out.dtype == dot_interaction_reference(bottom.detach(), embedded.detach()).dtype == torch.float32
    check_forward(out, bottom.detach(), embedded.detach(), torch.float32)
    check_backward(bottom, embedded, grad_out, torch.float32)  # d_bottom in float16


@pytest.mark.parametrize("device", DEVICES)
def test_strided_inputs_and_broadcast_gradient(device):
    device = kernel_device(device)
    base_b, base_e = random_inputs(4, 6, 40, torch.float32, device)
    bottom = base_b.t().contiguous().t()[:, :17]  # column-major view
    embedded = base_e[:, ::2, ::2][:, :, :17]  # every other feature and column
    bottom.requires_grad_(True)
    embedded.requires_grad_(True)
    out = dot_interaction(bottom, embedded)
    assert out.grad_fn.name() == KERNEL_NODE
    out.sum().backward()  # an expanded, stride-0 gradient
    check_forward(out.detach(), bottom.detach(), embedded.detach(), torch.float32)
    check_backward(bottom, embedded, torch.ones_like(out), torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_strided_upstream_gradient(device):
    device = kernel_device(device)
    bottom, embedded = random_inputs(3, 4, 16, torch.float32, device)
    out, _ = run_kernel(bottom, embedded)  # width 32
    bottom.grad = embedded.grad = None
    out = dot_interaction(bottom, embedded)
    grad_out = torch.randn(3, 2 * out.shape[1], generator=torch.Generator().manual_seed(2)).to(device)[:, ::2]
    out.backward(grad_out)
    check_backward(bottom, embedded, grad_out, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_no_embeddings(device):
    # DotInteraction(num_features=1): no pairs, the output is the bottom vector and padding.
    device = kernel_device(device)
    bottom, embedded = random_inputs(3, 0, 13, torch.float32, device)
    out, grad_out = run_kernel(bottom, embedded)
    assert out.shape == (3, 16)
    check_forward(out, bottom.detach(), embedded.detach(), torch.float32)
    check_backward(bottom, embedded, grad_out, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_gradient_for_one_input_only(device):
    device = kernel_device(device)
    bottom, embedded = random_inputs(2, 3, 16, torch.float32, device)
    embedded.requires_grad_(True)
    out = dot_interaction(bottom, embedded)
    assert out.grad_fn.name() == KERNEL_NODE
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device)
    out.backward(grad_out)
    _, exact_e = exact_gradients(bottom, embedded, grad_out)
    assert bottom.grad is None
    torch.testing.assert_close(embedded.grad.double(), exact_e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_module_uses_kernel_and_matches_reference_module(device):
    device = kernel_device(device)
    bottom, embedded = random_inputs(3, 26, 32, torch.float32, device)
    kernel = DotInteraction(27, 32, use_kernel=True).to(device)
    plain = DotInteraction(27, 32).to(device)
    out = kernel(bottom.requires_grad_(True), embedded)
    assert out.grad_fn.name() == KERNEL_NODE and "use_kernel=True" in repr(kernel)
    torch.testing.assert_close(out, plain(bottom, embedded), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit.trace's notice
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")  # the shape check folds to a constant
def test_traced_and_exported_modules_record_the_reference():
    # Export traces the model: the kernel's Python launch must not end up in (or break) a graph.
    bottom, embedded = random_inputs(2, 3, 8, torch.float32, "cpu")
    module = DotInteraction(4, 8, use_kernel=True)
    other_b, other_e = random_inputs(5, 3, 8, torch.float32, "cpu", seed=3)
    expected = exact_interaction(other_b, other_e).float()
    traced = torch.jit.trace(module, (bottom, embedded), check_trace=False)
    torch.testing.assert_close(traced(other_b, other_e), expected)
    batch = torch.export.Dim("batch")
    exported = torch.export.export(module, (bottom, embedded), dynamic_shapes=({0: batch}, {0: batch}))
    torch.testing.assert_close(exported.module()(other_b, other_e), expected)


def assert_reference_taken(bottom: torch.Tensor, embedded: torch.Tensor) -> None:
    """Not supported, and ``dot_interaction`` returns the reference's result (and gradients)."""
    assert not supports(bottom, embedded)
    b1, e1 = bottom.clone().requires_grad_(True), embedded.clone().requires_grad_(True)
    b2, e2 = bottom.clone().requires_grad_(True), embedded.clone().requires_grad_(True)
    out = dot_interaction(b1, e1)
    expected = dot_interaction_reference(b2, e2)
    assert out.grad_fn.name() != KERNEL_NODE
    assert torch.equal(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert torch.equal(b1.grad, b2.grad) and torch.equal(e1.grad, e2.grad)


def test_float64_falls_back():
    bottom, embedded = random_inputs(2, 3, 8, torch.float64, "cpu")
    assert_reference_taken(bottom, embedded)
    torch.testing.assert_close(dot_interaction(bottom, embedded), exact_interaction(bottom, embedded))


@pytest.mark.parametrize("value", ["0", ""])
def test_cpu_without_interpreter_falls_back(monkeypatch, value):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert_reference_taken(*random_inputs(2, 3, 8, torch.float32, "cpu"))


def test_missing_triton_falls_back(monkeypatch):
    monkeypatch.setattr(backend, "triton_installed", lambda: False)
    assert_reference_taken(*random_inputs(2, 3, 8, torch.float32, "cpu"))


def test_module_imports_and_falls_back_when_triton_cannot_be_imported():
    # A fresh interpreter where `import triton` fails: the kernel module must still import.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from dlrm.kernels.dot_interaction import dot_interaction, supports\n"
        "from dlrm.nn.interactions import DotInteraction, dot_interaction_reference\n"
        "b, e = torch.randn(2, 8), torch.randn(2, 3, 8)\n"
        "assert not supports(b, e)\n"
        "assert torch.equal(DotInteraction(4, 8, use_kernel=True)(b, e), dot_interaction_reference(b, e))\n"
        "print('ok')\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_mismatched_shapes_raise_like_the_reference():
    bottom, embedded = random_inputs(2, 3, 8, torch.float32, "cpu")
    assert not supports(bottom[:, :6], embedded)
    with pytest.raises(RuntimeError):
        dot_interaction(bottom[:, :6], embedded)


def test_empty_batch_falls_back():
    bottom, embedded = random_inputs(0, 3, 8, torch.float32, "cpu")
    assert not supports(bottom, embedded)
    assert dot_interaction(bottom, embedded).shape == (0, 16)


@pytest.mark.gpu
@pytest.mark.parametrize("allow_tf32", [False, True])
def test_fp32_uses_tf32_only_when_allowed(monkeypatch, allow_tf32):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", allow_tf32)
    bottom, embedded = random_inputs(64, 26, 128, torch.float32, "cuda")
    out = dot_interaction(bottom, embedded)
    check_forward(out, bottom, embedded, torch.float32)  # the bound includes TF32 when allowed
    exact = exact_interaction(bottom, embedded)
    magnitude = exact_interaction(bottom.abs(), embedded.abs())
    ieee_bound = MARGIN * (2 + 128) * UNIT_ROUNDOFF[torch.float32] * magnitude
    assert torch.any((out.double() - exact).abs() > ieee_bound) == allow_tf32


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_criteo_batch_on_gpu(dtype):
    # The training shape: 65536 samples, bottom + 26 embeddings of dim 128 -> 480 columns.
    bottom, embedded = random_inputs(65536, 26, 128, dtype, "cuda")
    out, grad_out = run_kernel(bottom, embedded)
    assert out.shape == (65536, 480)
    check_forward(out, bottom.detach(), embedded.detach(), dtype)
    check_backward(bottom, embedded, grad_out, dtype)


@pytest.mark.gpu
def test_criteo_batch_under_autocast_on_gpu():
    bottom, embedded = random_inputs(65536, 26, 128, torch.float32, "cuda")
    with torch.autocast("cuda", dtype=torch.float16):
        out, grad_out = run_kernel(bottom, embedded)
        assert out.dtype == dot_interaction_reference(bottom.detach(), embedded.detach()).dtype
    check_forward(out, bottom.detach(), embedded.detach(), torch.float16)
    check_backward(bottom, embedded, grad_out, torch.float16)
