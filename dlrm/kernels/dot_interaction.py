"""Fused dot interaction: one Triton kernel forward, one backward.

The forward reads ``bottom [B, D]`` and ``embedded [B, F, D]`` once and writes the whole
``[B, padded_width(D + n(n-1)/2)]`` row of ``dot_interaction_reference`` (``n = F + 1``): the
bottom vector, the strictly-lower triangle of the Gram matrix of ``[bottom, embeddings]`` in
row-major order, and the zero padding. The concatenation and the ``[B, n, n]`` Gram matrix
never exist in memory, which is what makes it faster than the reference (three extra passes).

The backward turns ``grad_out`` into ``d_features = (S + S^T) @ features``, with ``S`` the
``[n, n]`` matrix holding the triangle's gradients at their ``(i, j)`` positions, and adds
``grad_out[:, :D]`` to the bottom row; ``S`` is gathered straight from ``grad_out``.

Tiling: one program per (sample, tile of the Gram matrix) forward and per (sample, block of
feature rows) backward. Feature rows are padded to ``BLOCK_N`` (a power of two, at least 16,
as ``tl.dot`` needs; at most 64 so the fp32 accumulator stays in registers: more features
mean more tiles), and the embedding dimension is walked in ``BLOCK_D`` steps, so any ``F``
and ``D`` run. Products accumulate in fp32.

``dot_interaction_reference``, the definition in plain torch, lives here beside the kernels
(``dlrm.nn.interactions`` builds ``DotInteraction`` on both; this module imports nothing from
``dlrm.nn``). ``dot_interaction`` falls back to it whenever ``supports`` says no.
"""

from __future__ import annotations

import torch

from dlrm.kernels.backend import (
    AUTOCAST_DTYPES,
    compute_dtype,
    exporting,
    interpreting,
    tf32_allowed,
    triton_installed,
    triton_usable,
)

if triton_installed():
    import triton
    import triton.language as tl

    from dlrm.kernels.rounding import round_nearest
else:  # the reference runs instead; nothing below is reached without Triton
    triton = None

# Kernels are built for the interpreter or for the GPU when they are defined (triton.jit reads
# TRITON_INTERPRET then): CPU tensors may only go to interpreted ones, CUDA tensors to compiled.
_KERNELS_INTERPRETED = interpreting()

SUPPORTED_DTYPES = AUTOCAST_DTYPES  # fp32 / fp16 / bf16
MAX_BLOCK_N = 64  # feature rows per tile: a 64x64 fp32 accumulator is 32 registers a thread
MAX_BLOCK_D = 128  # embedding columns per step
_INT32_MAX = 2**31 - 1


# ----------------------------------------------------------------------------- reference
# The definition of the dot interaction in plain torch: the kernels match it in layout, it is
# their fallback and test oracle, and it is what exporters record.

PAD_MULTIPLE = 8  # output width is padded so the top MLP's first GEMM has an aligned K dimension


def padded_width(width: int) -> int:
    """``width`` rounded up to a multiple of ``PAD_MULTIPLE``."""
    return -(-width // PAD_MULTIPLE) * PAD_MULTIPLE


def dot_interaction_width(num_features: int, embedding_dim: int) -> int:
    """Output width of the dot interaction over ``num_features`` vectors (bottom included)."""
    return padded_width(embedding_dim + num_features * (num_features - 1) // 2)


def lower_triangle_index(num_features: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Flat indices into a row-major ``[n, n]`` matrix of its strictly-lower triangle.

    Order is row-major: (1,0), (2,0), (2,1), (3,0), ... -- the layout checkpoints and kernels
    rely on.
    """
    rows, cols = torch.tril_indices(num_features, num_features, offset=-1, device=device)
    return rows * num_features + cols


def dot_interaction_reference(
    bottom: torch.Tensor,
    embedded: torch.Tensor,
    triangle_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pairwise dot products of ``[bottom, embeddings]``, after the bottom vector itself.

    bottom ``[B, D]``, embedded ``[B, F, D]`` -> ``[B, padded_width(D + n(n-1)/2)]`` with
    ``n = F + 1``: the bottom vector, the strictly-lower triangle of the Gram matrix in row-major
    order, then zeros. ``triangle_index`` (from ``lower_triangle_index(n)``) may be passed to
    avoid rebuilding it on every call. Under autocast the Gram matrix and the whole output are
    in the autocast dtype.
    """
    batch = bottom.shape[0]
    features = torch.cat([bottom.unsqueeze(1), embedded], dim=1)  # [B, n, D]
    gram = torch.bmm(features, features.transpose(1, 2))  # [B, n, n]
    if triangle_index is None:
        triangle_index = lower_triangle_index(features.shape[1], device=gram.device)
    triangle = gram.flatten(1).index_select(1, triangle_index)
    width = bottom.shape[1] + triangle.shape[1]
    padding = gram.new_zeros(batch, padded_width(width) - width)
    return torch.cat([bottom.to(gram.dtype), triangle, padding], dim=1)


# ----------------------------------------------------------------------------- kernels


if triton is not None:

    @triton.jit
    def _load_features(bottom_ptr, embedded_ptr, sample, rows, cols, n, dim,
                       stride_bb, stride_bd, stride_eb, stride_ef, stride_ed, DTYPE: tl.constexpr,
                       INTERPRETER: tl.constexpr):
        """Tile ``features[sample, rows, cols]`` of ``[bottom, embedded]`` in ``DTYPE``, zeros
        outside; the concatenation is a select between two masked loads, never a copy."""
        col_ok = cols < dim
        bottom = tl.load(bottom_ptr + sample * stride_bb + cols * stride_bd, mask=col_ok, other=0.0)
        emb_rows = tl.maximum(rows - 1, 0)  # row 0 is the bottom vector; keep masked offsets in range
        emb_mask = ((rows >= 1) & (rows < n))[:, None] & col_ok[None, :]
        emb = tl.load(embedded_ptr + sample * stride_eb + emb_rows[:, None] * stride_ef + cols[None, :] * stride_ed,
                      mask=emb_mask, other=0.0)
        return tl.where((rows == 0)[:, None], round_nearest(bottom, DTYPE, INTERPRETER)[None, :],
                        round_nearest(emb, DTYPE, INTERPRETER))

    @triton.jit
    def _mma(a, b, PRECISION: tl.constexpr, INTERPRETER: tl.constexpr):
        """``a @ b`` accumulated in fp32. The interpreter's ``tl.dot`` gets bf16 operands wrong
        (Triton 3.x), so there they go in as fp32 copies: exact, and the same products."""
        if INTERPRETER:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, input_precision=PRECISION, out_dtype=tl.float32)

    @triton.jit
    def _forward_kernel(bottom_ptr, embedded_ptr, out_ptr, n, dim, width, tiles_per_side,
                        stride_bb, stride_bd, stride_eb, stride_ef, stride_ed,
                        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, SINGLE_TILE: tl.constexpr,
                        PRECISION: tl.constexpr, INTERPRETER: tl.constexpr):
        """Program ``(sample, tile)``: Gram tile ``(bi, bj)`` with ``bj <= bi``; tile 0 also
        copies the bottom vector and writes the padding. Tiles above the diagonal do nothing."""
        DTYPE = out_ptr.dtype.element_ty
        pid = tl.program_id(0).to(tl.int64)
        tiles = tiles_per_side * tiles_per_side
        sample = pid // tiles
        tile = (pid % tiles).to(tl.int32)
        bi = tile // tiles_per_side
        bj = tile % tiles_per_side
        out_row = out_ptr + sample * width
        if bj <= bi:
            rows_i = bi * BLOCK_N + tl.arange(0, BLOCK_N)
            rows_j = bj * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tl.zeros([BLOCK_N, BLOCK_N], dtype=tl.float32)
            for d0 in range(0, dim, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                a = _load_features(bottom_ptr, embedded_ptr, sample, rows_i, cols, n, dim,
                                   stride_bb, stride_bd, stride_eb, stride_ef, stride_ed, DTYPE, INTERPRETER)
                if SINGLE_TILE:
                    b = a
                else:
                    b = _load_features(bottom_ptr, embedded_ptr, sample, rows_j, cols, n, dim,
                                       stride_bb, stride_bd, stride_eb, stride_ef, stride_ed, DTYPE, INTERPRETER)
                acc += _mma(a, tl.trans(b), PRECISION, INTERPRETER)
            i = rows_i[:, None]
            j = rows_j[None, :]
            position = dim + i * (i - 1) // 2 + j  # row-major strictly-lower triangle
            tl.store(out_row + position, round_nearest(acc, DTYPE, INTERPRETER), mask=(i > j) & (i < n))
            if tile == 0:
                for d0 in range(0, dim, BLOCK_D):
                    cols = d0 + tl.arange(0, BLOCK_D)
                    value = tl.load(bottom_ptr + sample * stride_bb + cols * stride_bd, mask=cols < dim)
                    tl.store(out_row + cols, round_nearest(value, DTYPE, INTERPRETER), mask=cols < dim)
                pad = dim + n * (n - 1) // 2 + tl.arange(0, 8)  # fewer than 8 padding columns
                tl.store(out_row + pad, tl.zeros([8], dtype=DTYPE), mask=pad < width)

    @triton.jit
    def _backward_kernel(grad_ptr, bottom_ptr, embedded_ptr, d_bottom_ptr, d_embedded_ptr, n, dim, tiles_per_side,
                         stride_gb, stride_gw, stride_bb, stride_bd, stride_eb, stride_ef, stride_ed,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                         INTERPRETER: tl.constexpr):
        """Program ``(sample, row block)``: ``d_features[rows] = sum_k (S + S^T)[rows, k] @
        features[k]``, plus ``grad_out[:, :D]`` on the bottom row, stored in each input's dtype."""
        DTYPE = grad_ptr.dtype.element_ty
        pid = tl.program_id(0).to(tl.int64)
        sample = pid // tiles_per_side
        block = (pid % tiles_per_side).to(tl.int32)
        rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
        grad_row = grad_ptr + sample * stride_gb
        d_bottom_row = d_bottom_ptr + sample * dim
        d_embedded_row = d_embedded_ptr + sample * (n - 1) * dim
        emb_rows = tl.maximum(rows - 1, 0)
        for d0 in range(0, dim, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            for bk in range(0, tiles_per_side):
                ks = bk * BLOCK_N + tl.arange(0, BLOCK_N)
                hi = tl.maximum(rows[:, None], ks[None, :])
                lo = tl.minimum(rows[:, None], ks[None, :])
                # (S + S^T)[i, k] is the triangle entry of (max, min); the diagonal is not in it.
                s = tl.load(grad_row + (dim + hi * (hi - 1) // 2 + lo) * stride_gw, mask=(hi != lo) & (hi < n),
                            other=0.0)
                f = _load_features(bottom_ptr, embedded_ptr, sample, ks, cols, n, dim,
                                   stride_bb, stride_bd, stride_eb, stride_ef, stride_ed, DTYPE, INTERPRETER)
                acc += _mma(s.to(DTYPE), f, PRECISION, INTERPRETER)
            col_ok = cols < dim
            direct = tl.load(grad_row + cols * stride_gw, mask=col_ok, other=0.0)
            is_bottom = (rows == 0)[:, None]
            acc += tl.where(is_bottom, direct.to(tl.float32)[None, :], 0.0)
            tl.store(d_bottom_row + rows[:, None] * 0 + cols[None, :],
                     round_nearest(acc, d_bottom_ptr.dtype.element_ty, INTERPRETER), mask=is_bottom & col_ok[None, :])
            tl.store(d_embedded_row + emb_rows[:, None] * dim + cols[None, :],
                     round_nearest(acc, d_embedded_ptr.dtype.element_ty, INTERPRETER),
                     mask=((rows >= 1) & (rows < n))[:, None] & col_ok[None, :])


def _block_n(num_vectors: int) -> int:
    """Feature rows per tile: all of them up to 64 (one tile), at least 16 for ``tl.dot``."""
    return min(max(16, triton.next_power_of_2(num_vectors)), MAX_BLOCK_N)


def _block_d(dim: int, block_n: int, element_size: int) -> int:
    """Embedding columns per step: the whole row up to 128, capped so one ``[BLOCK_N, BLOCK_D]``
    operand takes at most 8 KiB (the kernels then fit the 64 KiB of shared memory of the
    smallest GPUs Triton drives, and several programs share an SM)."""
    cap = min(MAX_BLOCK_D, 8192 // element_size // block_n)
    return min(max(16, triton.next_power_of_2(dim)), cap)


def _precision(dtype: torch.dtype, backward: bool) -> str:
    """``tl.dot`` input precision: TF32 for fp32 when torch allows it for matmuls (as the
    reference's bmm would). Otherwise IEEE, but for the fp32 forward, where Triton's IEEE
    ``tl.dot`` (no tensor cores) took 2.6 ms against torch's 1.6 on an H100: there three TF32
    products (``tf32x3``) give fp32 accuracy in 0.67 ms. The interpreter always computes in IEEE
    fp32."""
    if dtype != torch.float32 or _KERNELS_INTERPRETED:
        return "ieee"
    if tf32_allowed():
        return "tf32"
    return "ieee" if backward else "tf32x3"


def _num_warps(block_n: int, block_d: int) -> int:
    return 4 if block_n * block_d <= 32 * 128 else 8


def _launch(block_n: int, dim: int, dtype: torch.dtype, backward: bool, tuning: dict | None) -> dict:
    """Meta-parameters of a launch, or ``tuning``'s (``BLOCK_D``, ``PRECISION``, ``num_warps``,
    ``num_stages``), which ``benchmarks/dot_interaction_tiles.py`` sweeps on a device.

    The defaults come from that sweep on an H100 (Criteo shape, docs/benchmarks.md): one stage
    (the loop over the dimension has one or two steps, so pipelining only costs shared memory),
    two warps forward, ``BLOCK_D`` at most 64 backward, whose ``[BLOCK_N, BLOCK_D]``
    accumulator lives across the inner loop, and at most 32 for the ``tf32x3`` forward."""
    block_d = _block_d(dim, block_n, dtype.itemsize)
    precision = _precision(dtype, backward)
    if backward or precision == "tf32x3":
        block_d = min(block_d, 64 if backward else 32)
    launch = {"BLOCK_D": block_d, "PRECISION": precision, "num_stages": 1,
              "num_warps": _num_warps(block_n, block_d) if backward else 2}
    return {**launch, **(tuning or {})}


def _forward(bottom: torch.Tensor, embedded: torch.Tensor, dtype: torch.dtype,
             tuning: dict | None = None) -> torch.Tensor:
    """Launches the forward kernel; the output is allocated in ``dtype`` (the compute dtype)."""
    batch, num_embedded, dim = embedded.shape
    n = num_embedded + 1
    width = dot_interaction_width(n, dim)
    out = torch.empty(batch, width, dtype=dtype, device=bottom.device)
    block_n = _block_n(n)
    tiles_per_side = triton.cdiv(n, block_n)
    grid = (batch * tiles_per_side * tiles_per_side,)
    _forward_kernel[grid](
        bottom, embedded, out, n, dim, width, tiles_per_side,
        bottom.stride(0), bottom.stride(1), embedded.stride(0), embedded.stride(1), embedded.stride(2),
        BLOCK_N=block_n, SINGLE_TILE=tiles_per_side == 1, INTERPRETER=_KERNELS_INTERPRETED,
        **_launch(block_n, dim, dtype, False, tuning),
    )
    return out


def _backward(
    grad_out: torch.Tensor, bottom: torch.Tensor, embedded: torch.Tensor, tuning: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launches the backward kernel; gradients come back in the inputs' own dtypes."""
    batch, num_embedded, dim = embedded.shape
    n = num_embedded + 1
    d_bottom = torch.empty(batch, dim, dtype=bottom.dtype, device=bottom.device)
    d_embedded = torch.empty(batch, num_embedded, dim, dtype=embedded.dtype, device=embedded.device)
    block_n = _block_n(n)
    tiles_per_side = triton.cdiv(n, block_n)
    _backward_kernel[(batch * tiles_per_side,)](
        grad_out, bottom, embedded, d_bottom, d_embedded, n, dim, tiles_per_side,
        grad_out.stride(0), grad_out.stride(1),
        bottom.stride(0), bottom.stride(1), embedded.stride(0), embedded.stride(1), embedded.stride(2),
        BLOCK_N=block_n, INTERPRETER=_KERNELS_INTERPRETED, **_launch(block_n, dim, grad_out.dtype, True, tuning),
    )
    return d_bottom, d_embedded


class DotInteractionFunction(torch.autograd.Function):
    """Autograd wrapper of the two kernels. ``dtype`` is the compute and output dtype (the
    autocast dtype, or the promotion of the inputs' dtypes); inputs are cast inside the kernel."""

    @staticmethod
    def forward(ctx, bottom: torch.Tensor, embedded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(bottom, embedded)
        return _forward(bottom, embedded, dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        bottom, embedded = ctx.saved_tensors
        if grad_out.stride(1) > 1:  # keeps in-row offsets within int32; expanded (stride 0) grads are fine
            grad_out = grad_out.contiguous()
        d_bottom, d_embedded = _backward(grad_out, bottom, embedded)
        needs_bottom, needs_embedded, _ = ctx.needs_input_grad
        return (d_bottom if needs_bottom else None), (d_embedded if needs_embedded else None), None


def _tracing() -> bool:
    # TorchScript tracing, torch.export and torch.compile see the reference: plain torch ops
    # they can record (and fuse), instead of an opaque Python launch.
    return exporting() or torch.compiler.is_compiling()


def supports(bottom: torch.Tensor, embedded: torch.Tensor) -> bool:
    """Whether the Triton kernels take these inputs; ``dot_interaction`` runs the reference
    otherwise. Refused: no Triton or a device it cannot drive (``triton_usable``), dtypes other
    than fp32/fp16/bf16 (bf16 also needs compute capability 8.0 for ``tl.dot``), shapes the
    reference would reject, an empty batch, a sample spanning more than 2^31 elements, and
    graph capture (tracing, export, ``torch.compile``)."""
    if _tracing() or triton is None or not triton_usable(bottom, embedded):
        return False
    if _KERNELS_INTERPRETED != (bottom.device.type == "cpu"):
        return False
    if bottom.dim() != 2 or embedded.dim() != 3:
        return False
    batch, num_embedded, dim = embedded.shape
    if bottom.shape != (batch, dim) or batch == 0 or dim == 0:
        return False
    dtypes = {bottom.dtype, embedded.dtype, compute_dtype(bottom, embedded)}
    if not dtypes <= set(SUPPORTED_DTYPES):
        return False
    cuda = bottom.device.type == "cuda"
    if torch.bfloat16 in dtypes and cuda and torch.cuda.get_device_capability(bottom.device) < (8, 0):
        return False
    n = num_embedded + 1
    # Offsets inside one sample are int32 in the kernels (the sample's base offset is int64).
    in_sample = max(dim + n * n, (num_embedded - 1) * embedded.stride(1) + (dim - 1) * embedded.stride(2),
                    (dim - 1) * bottom.stride(1))
    tiles_per_side = -(-n // MAX_BLOCK_N)
    return in_sample <= _INT32_MAX and batch * tiles_per_side * tiles_per_side <= _INT32_MAX


def dot_interaction(
    bottom: torch.Tensor,
    embedded: torch.Tensor,
    triangle_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same result as ``dot_interaction_reference`` (layout, dtype, gradients), fused in Triton
    when ``supports`` says so. ``triangle_index`` is only passed on to the reference: the
    kernels compute positions themselves."""
    if not supports(bottom, embedded):
        return dot_interaction_reference(bottom, embedded, triangle_index)
    return DotInteractionFunction.apply(bottom, embedded, compute_dtype(bottom, embedded))
