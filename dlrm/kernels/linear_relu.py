"""``relu(x @ W^T + b)`` with its element-wise work fused: one MLP layer.

Run as ``F.linear`` then ``relu``, a layer costs, besides its GEMMs, a ReLU pass forward, a
ReLU-backward pass and a bias-gradient reduction backward, each reading and writing the whole
``[B, N]`` activation. Here:

* Forward: ``torch._addmm_activation(b, x, W^T)``. On CUDA it runs cuBLASLt with the bias and
  the ReLU in the GEMM's epilogue (fp32, fp16 and bf16; fp32 in TF32 when torch allows it for
  matmuls), and on shapes cuBLASLt refuses torch itself runs the GEMM and a ReLU; on the CPU
  it is ``addmm`` then ``relu_``, the very ops of ``F.linear`` and ``relu``. Either way the
  result equals ``relu(F.linear(x, W, b))``: rounding commutes with ReLU.
* Backward: one Triton kernel reads ``grad_out`` and the layer's output once and writes
  ``grad_pre = grad_out`` where ``out > 0`` and zero elsewhere (``threshold_backward``'s rule:
  a NaN output passes its gradient on), and per block of rows the fp32 column sums of
  ``grad_pre``; a second, small kernel adds those partial sums in a fixed order into the bias
  gradient. No atomics: a run repeats bit for bit. The two GEMMs (``grad_x = grad_pre @ W``,
  ``grad_W = grad_pre^T @ x``) stay with torch. The bias gradient is the fp32 sum rounded once
  into the bias dtype; torch's plain path under autocast rounds it to the compute dtype first,
  so there the two differ by that rounding (here it is the more accurate).

``relu_bias_grad_reference`` is the kernel's torch twin (same signature, the fallback and the
test oracle) and ``linear_relu_reference`` the layer's; ``linear_relu`` takes the references
whenever ``supports`` says no: no Triton or a device it cannot drive, dtypes other than
fp32/fp16/bf16, tracing or export (which must record plain ops), ``torch.compile``.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from dlrm.kernels.backend import (
    AUTOCAST_DTYPES,
    compute_dtype,
    exporting,
    interpreting,
    triton_installed,
    triton_usable,
)

if triton_installed():
    import triton
    import triton.language as tl

    from dlrm.kernels.rounding import round_nearest
else:  # the references run instead; nothing below is reached without Triton
    triton = None

# Kernels are built for the interpreter or for the GPU when they are defined (triton.jit reads
# TRITON_INTERPRET then): CPU tensors may only go to interpreted ones, CUDA tensors to compiled.
_KERNELS_INTERPRETED = interpreting()

SUPPORTED_DTYPES = AUTOCAST_DTYPES  # fp32 / fp16 / bf16
BLOCK_M = 32  # rows of one compiled tile of the element-wise kernel
MAX_BLOCK_N = 128  # columns of one compiled tile
MAX_STEPS = 8  # tiles one compiled program walks down its columns
BLOCK_P = 32  # at most this many partial sums added per step of the reduction kernel
_GRID_Y_MAX = 65535  # CUDA's limit on the second grid dimension (column blocks)
_INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------- references


def linear_relu_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The layer in plain torch ops: what exporters record and what ``linear_relu`` must equal."""
    return F.relu(F.linear(x, weight, bias))


def relu_bias_grad_reference(
    grad_out: torch.Tensor, out: torch.Tensor, bias_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_pre, grad_bias)`` of ``out = relu(pre)``, ``pre = x W^T + b``: ``grad_pre`` is
    ``grad_out`` where ``out > 0``, else zero, in ``out``'s dtype; ``grad_bias`` its column sum,
    accumulated in fp32 and returned in ``bias_dtype``."""
    grad_pre = torch.ops.aten.threshold_backward(grad_out.to(out.dtype), out, 0)
    return grad_pre, grad_pre.sum(0, dtype=torch.float32).to(bias_dtype)


# ----------------------------------------------------------------------------- kernels


if triton is not None:

    @triton.jit
    def _relu_grad_partials_kernel(grad_ptr, out_ptr, grad_pre_ptr, partial_ptr, rows, cols,
                                   stride_gm, stride_gn, stride_om, stride_on,
                                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STEPS: tl.constexpr,
                                   INTERPRETER: tl.constexpr):
        """Program ``(row chunk, column block)``: ``grad_pre`` for ``STEPS * BLOCK_M`` rows, and
        their fp32 column sums into row ``pid_m`` of the ``[chunks, cols]`` partial sums."""
        DTYPE = grad_pre_ptr.dtype.element_ty
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        columns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = columns < cols
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for step in range(STEPS):
            r = ((pid_m * STEPS + step) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            mask = (r < rows)[:, None] & col_ok[None, :]
            grad = tl.load(grad_ptr + r[:, None] * stride_gm + columns[None, :] * stride_gn, mask=mask, other=0.0)
            out = tl.load(out_ptr + r[:, None] * stride_om + columns[None, :] * stride_on, mask=mask, other=0.0)
            grad = round_nearest(grad, DTYPE, INTERPRETER)
            # threshold_backward's test (a NaN output passes its gradient), made in fp32: the
            # interpreter compares bf16 as raw bits (Triton 3.x).
            grad_pre = tl.where(out.to(tl.float32) <= 0, tl.zeros_like(grad), grad)
            tl.store(grad_pre_ptr + r[:, None] * cols + columns[None, :], grad_pre, mask=mask)
            acc += grad_pre.to(tl.float32)
        tl.store(partial_ptr + pid_m * cols + columns, tl.sum(acc, axis=0), mask=col_ok)

    @triton.jit
    def _sum_partials_kernel(partial_ptr, bias_grad_ptr, parts, cols,
                             BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETER: tl.constexpr):
        """Program ``column block``: the partial sums added down their rows in a fixed order."""
        pid = tl.program_id(0)
        columns = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = columns < cols
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        for p0 in range(0, parts, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            acc += tl.load(partial_ptr + p[:, None] * cols + columns[None, :],
                           mask=(p < parts)[:, None] & col_ok[None, :], other=0.0)
        total = tl.sum(acc, axis=0)
        tl.store(bias_grad_ptr + columns, round_nearest(total, bias_grad_ptr.dtype.element_ty, INTERPRETER),
                 mask=col_ok)


def _launch(rows: int, cols: int, tuning: dict | None = None) -> dict:
    """Meta-parameters of a launch (``BLOCK_M``, ``BLOCK_N``, ``STEPS``, ``BLOCK_P``), or
    ``tuning``'s. Fixed by the shape alone, so the order of every sum is too.

    Compiled: ``BLOCK_M x BLOCK_N`` tiles of 32 rows by up to 128 columns (256 contiguous bytes
    of a bf16 row), each program walking ``STEPS`` of them down its columns (up to 8: one fp32
    partial sum per 256 rows, 1 MiB of partial sums for a 65536 x 1024 layer). The interpreter
    pays for every operation a program runs, not for its size: there a program takes up to 64K
    elements at once, so a CPU test's MLP step costs a few launches, not hundreds."""
    if _KERNELS_INTERPRETED:
        block_n = min(max(16, triton.next_power_of_2(cols)), 256)
        block_m = min(max(16, triton.next_power_of_2(rows)), 2**16 // block_n)
        steps = 1
    else:
        block_n = min(max(16, triton.next_power_of_2(cols)), MAX_BLOCK_N)
        block_m = BLOCK_M
        # A power of two: each value compiles once.
        steps = min(MAX_STEPS, triton.next_power_of_2(triton.cdiv(rows, block_m)))
    launch = {"BLOCK_M": block_m, "BLOCK_N": block_n, "STEPS": steps}
    launch.update(tuning or {})
    parts = triton.cdiv(rows, launch["BLOCK_M"] * launch["STEPS"])
    launch.setdefault("BLOCK_P", min(max(16, triton.next_power_of_2(parts)), BLOCK_P))
    return launch


def _relu_bias_grad(
    grad_out: torch.Tensor, out: torch.Tensor, bias_dtype: torch.dtype, tuning: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the two kernels; same contract as ``relu_bias_grad_reference``. ``tuning``
    overrides ``_launch``'s meta-parameters (tests run the GPU's tiling in the interpreter)."""
    rows, cols = out.shape
    launch = _launch(rows, cols, tuning)
    block_m, block_n, steps = launch["BLOCK_M"], launch["BLOCK_N"], launch["STEPS"]
    parts = triton.cdiv(rows, block_m * steps)
    column_blocks = triton.cdiv(cols, block_n)
    grad_pre = torch.empty(rows, cols, dtype=out.dtype, device=out.device)
    partials = torch.empty(parts, cols, dtype=torch.float32, device=out.device)
    grad_bias = torch.empty(cols, dtype=bias_dtype, device=out.device)
    _relu_grad_partials_kernel[(parts, column_blocks)](
        grad_out, out, grad_pre, partials, rows, cols,
        grad_out.stride(0), grad_out.stride(1), out.stride(0), out.stride(1),
        BLOCK_M=block_m, BLOCK_N=block_n, STEPS=steps, INTERPRETER=_KERNELS_INTERPRETED, num_warps=4,
    )
    _sum_partials_kernel[(column_blocks,)](
        partials, grad_bias, parts, cols,
        BLOCK_P=launch["BLOCK_P"], BLOCK_N=block_n, INTERPRETER=_KERNELS_INTERPRETED, num_warps=4,
    )
    return grad_pre, grad_bias


def _tracing() -> bool:
    # TorchScript tracing, torch.export and torch.compile see the references: plain torch ops
    # they can record (and fuse), instead of an opaque Python launch.
    return exporting() or torch.compiler.is_compiling()


def _kernel_device_ok(*tensors: torch.Tensor) -> bool:
    """Triton can take the tensors, on the device its kernels were built for (bf16 loads and
    stores need compute capability 8.0 on a GPU)."""
    if triton is None or not triton_usable(*tensors):
        return False
    device = tensors[0].device
    if _KERNELS_INTERPRETED != (device.type == "cpu"):
        return False
    if device.type == "cuda" and any(t.dtype == torch.bfloat16 for t in tensors):
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return True


def supports_relu_bias_grad(grad_out: torch.Tensor, out: torch.Tensor, bias_dtype: torch.dtype) -> bool:
    """Whether the backward kernels take these tensors: a non-empty ``[B, N]`` pair on one
    device Triton drives, fp32/fp16/bf16 throughout, at most 65535 column blocks (CUDA's limit
    on a grid's second dimension), and in-row offsets within int32 (row offsets are int64)."""
    if not _kernel_device_ok(grad_out, out):
        return False
    if out.dim() != 2 or grad_out.shape != out.shape or out.numel() == 0:
        return False
    if not {grad_out.dtype, out.dtype, bias_dtype} <= set(SUPPORTED_DTYPES):
        return False
    rows, cols = out.shape
    in_row = (cols - 1) * max(abs(grad_out.stride(1)), abs(out.stride(1)), 1)
    partial_sums = triton.cdiv(rows, 16) * cols  # at least 16 rows per partial sum, either tiling
    return triton.cdiv(cols, MAX_BLOCK_N) <= _GRID_Y_MAX and max(in_row, partial_sums) <= _INT32_MAX


# GPUs (by name) on which the compiled kernels failed to build: their MLPs take the reference.
_UNBUILDABLE: set[str] = set()


def relu_bias_grad(
    grad_out: torch.Tensor, out: torch.Tensor, bias_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``relu_bias_grad_reference``'s result from the fused kernels where they run, else from it.

    The MLP runs on every CUDA training step, so a Triton that cannot build these kernels for a
    GPU (a compiler error at the first launch, which happens in an eager step, before any CUDA
    graph capture) must not stop a run: it warns once and that GPU takes the reference from then
    on. The interpreter raises as it is, for the tests."""
    if not supports_relu_bias_grad(grad_out, out, bias_dtype):
        return relu_bias_grad_reference(grad_out, out, bias_dtype)
    if _KERNELS_INTERPRETED:
        return _relu_bias_grad(grad_out, out, bias_dtype)
    gpu = torch.cuda.get_device_name(out.device)
    if gpu in _UNBUILDABLE:
        return relu_bias_grad_reference(grad_out, out, bias_dtype)
    try:
        return _relu_bias_grad(grad_out, out, bias_dtype)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as e:  # Triton's compiler errors have no common base class across versions
        _UNBUILDABLE.add(gpu)
        warnings.warn(f"the fused MLP backward kernel could not be built for {gpu} ({type(e).__name__}: "
                      f"{str(e).splitlines()[0] if str(e) else ''}); the MLP layers use plain torch ops there",
                      RuntimeWarning, stacklevel=2)
        return relu_bias_grad_reference(grad_out, out, bias_dtype)


# ----------------------------------------------------------------------------- the layer


def _fused_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``relu(x W^T + b)`` by one ``_addmm_activation``; the operands are already in the compute
    dtype, and autocast stays out of the call (it must not cast them again)."""
    if not torch.is_autocast_enabled(x.device.type):
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=False)
    with torch.autocast(x.device.type, enabled=False):
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=False)


def _make_function(device_type: str) -> type[torch.autograd.Function]:
    """The layer's autograd Function for one device type (``custom_fwd`` takes it at definition):
    the backward then runs under the forward's autocast state, as torch's own backward would."""

    class LinearReLUFunction(torch.autograd.Function):
        """Casts to the compute dtype inside, so the parameters stay fp32 under AMP and their
        gradients come back in their own dtypes (as autocast's casts give them back)."""

        @staticmethod
        @torch.amp.custom_fwd(device_type=device_type)
        def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                    dtype: torch.dtype) -> torch.Tensor:
            x_c, weight_c = x.to(dtype), weight.to(dtype)
            out = _fused_forward(x_c, weight_c, bias.to(dtype))
            ctx.save_for_backward(x_c, weight_c, out)
            ctx.dtypes = x.dtype, weight.dtype, bias.dtype
            return out

        @staticmethod
        @torch.amp.custom_bwd(device_type=device_type)
        @torch.autograd.function.once_differentiable
        def backward(ctx, grad_out: torch.Tensor):
            x_c, weight_c, out = ctx.saved_tensors
            x_dtype, weight_dtype, bias_dtype = ctx.dtypes
            needs_x, needs_weight, needs_bias, _ = ctx.needs_input_grad
            grad_pre, grad_bias = relu_bias_grad(grad_out, out, bias_dtype)
            grad_x = grad_pre.mm(weight_c).to(x_dtype) if needs_x else None
            grad_weight = grad_pre.t().mm(x_c).to(weight_dtype) if needs_weight else None
            return grad_x, grad_weight, (grad_bias if needs_bias else None), None

    return LinearReLUFunction


_FUNCTIONS = {device_type: _make_function(device_type) for device_type in ("cpu", "cuda")}
KERNEL_NODE = "LinearReLUFunctionBackward"  # the autograd node of the fused layer, on either device


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether ``linear_relu`` takes the fused path for these operands: a 2-D ``x`` and a bias,
    shapes ``F.linear`` accepts, on a device the backward kernels run on (``triton_usable``;
    the CPU only under the interpreter), fp32/fp16/bf16 (one dtype, or any mix under autocast),
    and no tracing, export or ``torch.compile``."""
    if _tracing() or bias is None or not hasattr(torch, "_addmm_activation"):
        return False
    if not _kernel_device_ok(x, weight, bias):
        return False
    if x.dim() != 2 or weight.dim() != 2 or bias.dim() != 1:
        return False
    if x.shape[0] == 0 or x.shape[1] != weight.shape[1] or bias.shape[0] != weight.shape[0] or bias.shape[0] == 0:
        return False
    dtypes = {x.dtype, weight.dtype, bias.dtype}
    if not dtypes <= set(SUPPORTED_DTYPES):
        return False
    # Without autocast F.linear refuses mixed dtypes; the reference then raises its own error.
    if len(dtypes) > 1 and not torch.is_autocast_enabled(x.device.type):
        return False
    return triton.cdiv(weight.shape[0], MAX_BLOCK_N) <= _GRID_Y_MAX


def linear_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``relu(F.linear(x, weight, bias))``: value, dtype (autocast's included) and gradients of
    ``linear_relu_reference``, fused where ``supports`` says so (module docstring)."""
    if not supports(x, weight, bias):
        return linear_relu_reference(x, weight, bias)
    dtype = compute_dtype(x, weight, bias)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or bias.requires_grad)):
        return _fused_forward(x.to(dtype), weight.to(dtype), bias.to(dtype))
    return _FUNCTIONS[x.device.type].apply(x, weight, bias, dtype)
