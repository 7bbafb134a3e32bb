"""Fused embedding kernels: a gather that writes the compute dtype, and an SGD update that
deduplicates ids and changes only the rows a batch used, in place.

``gather(weight, rows, out_dtype)`` reads rows of an fp32 (or fp16/bf16) table and writes them
straight in ``out_dtype``: under AMP no fp32 ``[N, D]`` copy is made only to be cast. Programs
tile ``[BLOCK_N ids, BLOCK_D columns]``, so any ``D`` runs.

``sgd_update(weight, rows, grad, lr, grad_scale, skip)`` does, for every distinct row ``r``,
``weight[r] -= lr * grad_scale * sum(grad[i] for rows[i] == r)`` with the sum in fp32, and
nothing when ``skip`` is true. It never builds a dense ``[R, D]`` gradient nor a COO tensor:

1. ``torch.sort(rows)`` (static size ``N``) puts equal ids next to each other, with the
   permutation that finds each id's gradient row.
2. One kernel walks the sorted ids. A program owns ``SPAN = TILE * TILES`` consecutive sorted
   positions and one block of columns; it loads ``TILE`` gradient rows at a time (through the
   permutation), sums each run of equal ids inside the tile with a segmented scan (adds
   selected by id, never a multiply by a mask: an inf in one row must not turn other rows into
   NaN), carries a run that goes on into the next tile, and writes each run once when it ends.
3. A run that lies inside one program is written with a plain load/store (no other program
   touches that row). A run that crosses a program boundary (a hot id: Criteo's id 0 fills
   most of some columns) is split over several programs, each adding its partial sum with
   ``tl.atomic_add``; so a hot id costs one atomic per ``SPAN`` occurrences and never
   serialises the batch into one program. Only float reassociation differs from the reference.

``lr``, ``grad_scale`` and ``skip`` are 0-dim device tensors read inside the kernel, so the
update has no host sync and a static shape (it can be captured in a CUDA graph), and a step
skipped for an fp16 overflow costs one launch that reads three scalars.

Ids outside ``[0, R)`` are not checked (the data layer does, see ``dlrm.nn.embeddings``): the
kernels read zeros for them and skip their update rather than touch memory outside the table;
the references raise. Each function falls back to its reference when ``supports_*`` says no.
"""

from __future__ import annotations

import torch

from dlrm.kernels.backend import interpreting, triton_installed, triton_usable

if triton_installed():
    import triton
    import triton.language as tl
else:  # the references run instead; nothing below is reached without Triton
    triton = None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# fp32 tables: atomics on fp32 everywhere. fp16/bf16 tables update through embedding_bag's
# two-pass kernels (one rounding per row); the reference here rounds once too.
UPDATE_WEIGHT_DTYPES = (torch.float32,)

# Kernels are built for the interpreter or for the GPU when they are defined; CPU tensors can
# only go to interpreted ones (a later change of TRITON_INTERPRET must not crash a call).
_KERNELS_INTERPRETED = interpreting()

GATHER_ELEMENTS = 4096  # ids x columns per gather program
GATHER_MAX_BLOCK_D = 128
UPDATE_TILE = 16  # sorted positions summed at once: a segmented scan down [TILE, BLOCK_D]
UPDATE_TILES = 16  # tiles per program: a hot id costs one atomic per TILE * TILES occurrences
UPDATE_MAX_BLOCK_D = 128  # columns per update program for fp32 gradients (H100: fastest)
UPDATE_HALF_BLOCK_D = 32  # ... and for fp16/bf16 ones (H100: 1.48 ms vs 1.79 at 128, Criteo batch)


# ----------------------------------------------------------------------------- references


def gather_reference(weight: torch.Tensor, rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``weight[rows]`` as ``[N, D]`` in ``out_dtype`` (torch; makes a copy in the weight's dtype)."""
    return weight.detach().index_select(0, rows.reshape(-1)).to(out_dtype)


@torch.no_grad()
def sgd_update_reference(
    weight: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    lr: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
) -> None:
    """In place: ``weight[r] -= lr * grad_scale * (sum of grad rows with id r)`` per distinct
    ``r``, nothing when ``skip``. Sums in fp32 (fp64 for an fp64 weight); no host sync, no
    dense ``[R, D]`` tensor: runs of sorted ids are summed into an ``[N, D]`` buffer."""
    rows = rows.reshape(-1).to(torch.int64)
    if rows.numel() == 0:
        return
    acc_dtype = torch.promote_types(weight.dtype, torch.float32)
    sorted_rows, perm = torch.sort(rows)
    starts = torch.ones_like(sorted_rows, dtype=torch.bool)
    starts[1:] = sorted_rows[1:] != sorted_rows[:-1]
    run = torch.cumsum(starts, 0) - 1  # run index of every sorted position
    sums = torch.zeros(rows.numel(), weight.shape[1], dtype=acc_dtype, device=weight.device)
    sums.index_add_(0, run, grad.index_select(0, perm).to(acc_dtype))
    factor = lr.to(acc_dtype) * grad_scale.to(acc_dtype)
    old = weight.index_select(0, sorted_rows)
    new = (old.to(acc_dtype) - factor * sums.index_select(0, run)).to(weight.dtype)
    # Duplicates of a row write the same value, so the order of the copies does not matter.
    weight.index_copy_(0, sorted_rows, torch.where(skip.to(torch.bool), old, new))


# ----------------------------------------------------------------------------- support checks


def _kernels_run_on(device: torch.device) -> bool:
    return triton is not None and (device.type != "cpu" or _KERNELS_INTERPRETED)


def _inner_contiguous(t: torch.Tensor) -> bool:
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] == 1)


def supports_gather(weight: torch.Tensor, rows: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``gather`` runs its kernel: a 2-D fp32/fp16/bf16 weight with unit column stride,
    1-D int64 ids, a float ``out_dtype``, all on one device Triton can use."""
    return (
        triton_usable(weight, rows)
        and _kernels_run_on(weight.device)
        and weight.dtype in FLOAT_DTYPES
        and out_dtype in FLOAT_DTYPES
        and _inner_contiguous(weight)
        and rows.dim() == 1
        and rows.dtype == torch.int64
        and rows.is_contiguous()
    )


def supports_update(
    weight: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    *scalars: torch.Tensor,
) -> bool:
    """Whether ``sgd_update`` runs its kernel: an fp32 2-D weight (atomics and in-place fp32
    accumulation), int64 ids ``[N]``, a float ``grad [N, D]`` with unit column stride, and
    (when given) 0-dim ``lr``/``grad_scale``/``skip``, all on one device Triton can use."""
    return (
        triton_usable(weight, rows, grad, *scalars)
        and _kernels_run_on(weight.device)
        and weight.dtype in UPDATE_WEIGHT_DTYPES
        and _inner_contiguous(weight)
        and rows.dim() == 1
        and rows.dtype == torch.int64
        and grad.dtype in FLOAT_DTYPES
        and _inner_contiguous(grad)
        and tuple(grad.shape) == (rows.shape[0], weight.shape[1])
        and all(s.dim() == 0 for s in scalars)
    )


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def gather_block(rows_ptr, n, num_rows, dim, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """What a gather program ``(i, j)`` owns: ids ``[i*BLOCK_N, +BLOCK_N)`` x columns
        ``[j*BLOCK_D, +BLOCK_D)``, the rows those ids name, and the masks (``row_ok``: an id in
        ``[0, num_rows)``; others read zeros). Shared by every gather kernel."""
        idx = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        idx_ok = idx < n
        col_ok = cols < dim
        rows = tl.load(rows_ptr + idx, mask=idx_ok, other=0)
        row_ok = idx_ok & (rows >= 0) & (rows < num_rows)
        return idx, cols, idx_ok, col_ok, rows, row_ok

    @triton.jit
    def store_block(out_ptr, vals, idx, cols, idx_ok, col_ok, dim):
        """Writes a gather program's ``[BLOCK_N, BLOCK_D]`` values into ``out [n, dim]`` in its dtype."""
        tl.store(out_ptr + idx[:, None] * dim + cols[None, :], vals.to(out_ptr.dtype.element_ty),
                 mask=idx_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _gather_kernel(weight_ptr, rows_ptr, out_ptr, n, num_rows, dim, weight_stride,
                       BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program ``(i, j)``: ids ``[i*BLOCK_N, +BLOCK_N)`` x columns ``[j*BLOCK_D, +BLOCK_D)``."""
        idx, cols, idx_ok, col_ok, rows, row_ok = gather_block(rows_ptr, n, num_rows, dim, BLOCK_N, BLOCK_D)
        vals = tl.load(weight_ptr + rows[:, None] * weight_stride + cols[None, :],
                       mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        store_block(out_ptr, vals, idx, cols, idx_ok, col_ok, dim)

    @triton.jit
    def _segment_add(id_a, sum_a, id_b, sum_b):
        """Segmented sum over sorted ids: ``(last id, sum of its run so far)`` pairs combine by
        adding only when the id goes on. Associative because the ids are sorted (invalid lanes,
        id -1, only trail the valid ones, which never read them); a select, so an inf stays in
        its own run."""
        return id_b, tl.where(id_a == id_b, sum_a + sum_b, sum_b)

    @triton.jit
    def run_sums(ids, nxt, valid, grad, carry, carry_id, lane, TILE: tl.constexpr):
        """``sums[p]`` = the gradient rows of the tile's run of ``ids[p]`` up to ``p`` (the whole
        run at its last lane), plus ``carry`` for the run ``carry_id`` that began in an earlier
        tile; and the carry the last lane hands on when its run goes on. An inclusive
        segmented scan down the tile: ``log2(TILE)`` adds per element."""
        _, sums = tl.associative_scan((tl.broadcast_to(ids[:, None], grad.shape), grad), 0, _segment_add)
        sums += tl.where((ids == carry_id)[:, None], carry[None, :], 0.0)
        goes_on = valid & (ids == nxt) & (lane == TILE - 1)
        carry = tl.sum(tl.where(goes_on[:, None], sums, 0.0), axis=0)
        carry_id = tl.max(tl.where(goes_on, ids, -1), axis=0)
        return sums, carry, carry_id

    @triton.jit
    def write_runs(weight_ptr, ids, nxt, valid, sums, before, after, cols, col_ok, factor, num_rows,
                   weight_stride):
        """``weight[id] -= factor * sums`` at the last lane of every run (ids in ``[0, num_rows)``):
        a load/store when the run lies in this program, an atomic add of the partial sum when it
        is shared with the program before (``before``) or after (``after``)."""
        ends = valid & (ids != nxt) & (ids >= 0) & (ids < num_rows)
        shared = (ids == before) | (ids == after)
        offsets = ids[:, None] * weight_stride + cols[None, :]
        step = factor * sums
        mask = ends[:, None] & col_ok[None, :]
        tl.atomic_add(weight_ptr + offsets, -step, mask=mask & shared[:, None], sem="relaxed")
        own = mask & ~shared[:, None]
        old = tl.load(weight_ptr + offsets, mask=own, other=0.0)
        tl.store(weight_ptr + offsets, old - step, mask=own)

    @triton.jit
    def _sgd_update_kernel(weight_ptr, sorted_ptr, perm_ptr, grad_ptr, lr_ptr, scale_ptr, skip_ptr,
                           n, num_rows, dim, weight_stride, grad_stride,
                           TILE: tl.constexpr, TILES: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program ``(p, j)``: sorted positions ``[p*SPAN, +SPAN)`` x a block of columns. Sums
        runs of equal ids in fp32 and writes each run once: a plain store when the run lies in
        this program, an atomic add of the partial sum when it crosses into a neighbour."""
        factor = tl.load(lr_ptr).to(tl.float32) * tl.load(scale_ptr).to(tl.float32)
        start = tl.program_id(0).to(tl.int64) * (TILE * TILES)
        end = tl.minimum(start + TILE * TILES, n)
        # The ids just outside this program: a run equal to one of them is shared.
        before = tl.load(sorted_ptr + start - 1, mask=start > 0, other=-1)
        after = tl.load(sorted_ptr + end, mask=end < n, other=-1)
        # A skipped step owns no positions: it loads no gradient and writes nothing. (An
        # empty range rather than a scalar flag in every mask: the interpreter mistypes
        # scalar-bool & tensor-bool.)
        end = tl.where(tl.load(skip_ptr).to(tl.int32) != 0, start, end)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        lane = tl.arange(0, TILE)
        carry = tl.zeros([BLOCK_D], dtype=tl.float32)  # partial sum of a run going on into this tile
        carry_id = tl.full([], -1, tl.int64)
        for t in range(TILES):
            pos = start + t * TILE + lane
            valid = pos < end
            ids = tl.load(sorted_ptr + pos, mask=valid, other=-1)
            nxt = tl.load(sorted_ptr + pos + 1, mask=valid & (pos + 1 < end), other=-1)
            src = tl.load(perm_ptr + pos, mask=valid, other=0)
            grad = tl.load(grad_ptr + src[:, None] * grad_stride + cols[None, :],
                           mask=valid[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            sums, carry, carry_id = run_sums(ids, nxt, valid, grad, carry, carry_id, lane, TILE)
            write_runs(weight_ptr, ids, nxt, valid, sums, before, after, cols, col_ok, factor, num_rows,
                       weight_stride)


def _pow2_block(dim: int, cap: int) -> int:
    return min(max(triton.next_power_of_2(dim), 16), cap)


def update_block_d(dim: int, grad_dtype: torch.dtype, max_block_d: int | None = None) -> int:
    """Columns per update program: the fastest measured shape for the gradient's dtype
    (``UPDATE_MAX_BLOCK_D`` / ``UPDATE_HALF_BLOCK_D``) unless ``max_block_d`` says otherwise."""
    if max_block_d is None:
        max_block_d = UPDATE_MAX_BLOCK_D if grad_dtype == torch.float32 else UPDATE_HALF_BLOCK_D
    return _pow2_block(dim, max_block_d)


# ----------------------------------------------------------------------------- public functions


def gather(weight: torch.Tensor, rows: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``weight[rows]`` as a new ``[N, D]`` tensor in ``out_dtype``, written by one kernel
    (the reference when ``supports_gather`` says no). Not differentiable by itself."""
    if not supports_gather(weight, rows, out_dtype):
        return gather_reference(weight, rows, out_dtype)
    n, dim = rows.shape[0], weight.shape[1]
    out = torch.empty(n, dim, dtype=out_dtype, device=weight.device)
    if n == 0:
        return out
    block_d = _pow2_block(dim, GATHER_MAX_BLOCK_D)
    block_n = max(GATHER_ELEMENTS // block_d, 16)
    grid = (triton.cdiv(n, block_n), triton.cdiv(dim, block_d))
    _gather_kernel[grid](weight, rows, out, n, weight.shape[0], dim, weight.stride(0),
                         BLOCK_N=block_n, BLOCK_D=block_d)
    return out


def sgd_update(
    weight: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    lr: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
) -> None:
    """In place: ``weight[r] -= lr * grad_scale * (sum of grad rows with id r)`` for each
    distinct ``r``; nothing when ``skip``. Sort + one kernel, no host sync (the reference when
    ``supports_update`` says no)."""
    if not supports_update(weight, rows, grad, lr, grad_scale, skip):
        sgd_update_reference(weight, rows, grad, lr, grad_scale, skip)
        return
    _sgd_update_triton(weight, rows, grad, lr, grad_scale, skip)


def _sgd_update_triton(
    weight: torch.Tensor,
    rows: torch.Tensor,
    grad: torch.Tensor,
    lr: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    tile: int = UPDATE_TILE,
    tiles: int = UPDATE_TILES,
    max_block_d: int | None = None,
) -> None:
    """The kernel path of ``sgd_update``; ``tile``/``tiles`` are exposed so tests can make
    runs cross many programs with few ids, and ``max_block_d`` for tuning."""
    n, dim = rows.shape[0], weight.shape[1]
    if n == 0:
        return
    sorted_rows, perm = torch.sort(rows)
    block_d = update_block_d(dim, grad.dtype, max_block_d)
    grid = (triton.cdiv(n, tile * tiles), triton.cdiv(dim, block_d))
    _sgd_update_kernel[grid](weight, sorted_rows, perm, grad, lr, grad_scale, skip,
                             n, weight.shape[0], dim, weight.stride(0), grad.stride(0),
                             TILE=tile, TILES=tiles, BLOCK_D=block_d)
