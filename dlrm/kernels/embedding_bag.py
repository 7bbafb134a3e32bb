"""Multi-hot (bag) embedding kernels: a pooled lookup, and SGD and row-wise Adagrad updates
that deduplicate ids and change only the rows a batch used, in place.

Layout (``dlrm.data.batch.Bags``): one joint ``weight [rows, D]`` holds every table; for ``T``
features and ``B`` samples, ``values [nnz]`` are row ids into it (table offsets already added)
and ``offsets [T*B + 1]`` cut them into bags, feature-major: bag ``i = t*B + b`` (feature ``t``
of sample ``b``) is ``values[offsets[i]:offsets[i + 1]]``, possibly empty. Optional
``per_sample_weights [nnz]`` weigh each id (mean pooling is weights ``1 / len``), so sum is the
only pooling the kernels know. ``offsets[0] == 0`` and ``offsets[-1] == nnz`` as in ``Bags``.

Padded bags (``Bags.padded_to``, the static shapes a captured CUDA graph needs) hold more
values than ``offsets[-1]``: the tail is in no bag. The kernels need no flag for it: the gather
never reads past a bag's end, the updates find the tail's bag "one past the last" and load no
gradient for it, and the lookup (``JointFusedEmbedding``) gives padding the row id ``rows``, one
past the last row, which the updates skip and which their stable sort puts after every real id.
So the real ids are sorted, cut into programs, summed and written exactly as without padding,
and a row named only by padding keeps its weight and row-wise Adagrad state untouched. The
references leave the tail out when told (``padded=True``).

``bag_gather(weight, values, offsets, per_sample_weights, out_dtype)`` is the pooled forward,
``out[i] = sum_j w_j * weight[values[j]]`` over bag ``i``, accumulated in fp32 whatever the
weight and output dtypes, written straight in ``out_dtype``: ``[T*B, D]``, or ``[B, T, D]``
(per sample, what the interaction takes) with ``num_features=T``; ``pooled_per_sample`` views
a ``[T*B, D]`` result as ``[B, T, D]`` without a copy. One program pools ``BLOCK_B``
consecutive bags (one feature's bags for consecutive samples, usually of similar length) over
a block of columns, one id of every bag per step (bags of one id take a single step).

``bag_sgd_update(weight, values, offsets, grad_pooled, lr, grad_scale, skip, ...)`` is the
backward and the update in one: for every distinct row ``r``,
``weight[r] -= lr * grad_scale * sum(w_j * grad_pooled[bag(j)] for values[j] == r)``, the sum
over all bags in fp32, nothing when ``skip``: torch's sparse SGD step on the gradient of
``embedding_bag``, without its ``[nnz, D]`` gradient or COO tensor. As ``embedding.sgd_update``:

1. ``bag(j)`` of every position comes from ``torch.searchsorted(offsets, j)`` and
   ``torch.sort(values)`` puts equal ids next to each other (both static sizes, on the device).
2. One kernel walks the sorted ids; a program owns ``SPAN = TILE * TILES`` sorted positions and
   a block of columns, loads ``TILE`` gradient rows at a time straight from ``grad_pooled``
   (position -> original position -> bag -> row, times the id's weight), sums runs of equal ids
   with ``embedding.run_sums`` (a segmented scan), carries a run into the next tile, and writes each
   run once: a plain store when the run lies in the program, an atomic add of the partial sum
   when a hot id crosses programs.

``bag_rowwise_adagrad_update(weight, state, ...)`` is FBGEMM's / TorchRec's row-wise Adagrad
on the same summed gradient ``g = grad_scale * sum(...)``: ``state[r] += mean(g * g)``, then
``weight[r] -= lr * g / (sqrt(state[r]) + eps)``. The state needs the whole row's sum before
the step, so the SGD kernel first writes every run's sum into an fp32 ``[nnz, D]`` buffer
(keyed by run index, the sorted order unchanged), and a row-wise kernel then steps each run's
row: two passes, no cross-program bookkeeping.

fp16/bf16 tables (``embedding_dtype``) take the same two passes for SGD too: every row is
computed in fp32 from its upcast old value and its whole summed gradient, and rounded *once*
into the table's dtype (``dlrm.kernels.rounding.round_to``): an atomic add of a partial sum
into a half-precision row would round every partial. The rounding is to nearest, or with
``rounding_step`` (a 0-dim int64 device tensor, changed every step) stochastic for bf16
tables. fp32 tables keep the one-pass SGD kernel and ignore ``rounding_step``.

``lr``, ``grad_scale`` and ``skip`` are 0-dim device tensors read inside the kernels: no host
sync, static shapes (CUDA-graph capture), and a skipped step (an fp16 overflow) writes nothing.
Ids outside ``[0, rows)`` are not checked (the data layer does): the kernels read zeros for
them and skip their update; the references raise. Each function falls back to its reference
when ``supports_*`` says no (no Triton or GPU, float64, unsupported layouts, rows wider than
``ADAGRAD_MAX_DIM`` for row-wise Adagrad).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dlrm.kernels.backend import interpreting, triton_installed, triton_usable
from dlrm.kernels.embedding import UPDATE_TILE, UPDATE_TILES, update_block_d  # one program shape for both
from dlrm.kernels.rounding import round_to

if triton_installed():
    import triton
    import triton.language as tl

    from dlrm.kernels.embedding import run_sums, write_runs
    from dlrm.kernels.rounding import round_nearest, stochastic_bf16
else:  # the references run instead; nothing below is reached without Triton
    triton = None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
# Tables the updates' kernels take: fp32 (one pass, atomics for shared runs) and fp16/bf16
# (two passes through an fp32 buffer, one rounding per row).
UPDATE_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROUNDING_STEP_DTYPES = (torch.int32, torch.int64)
ADAGRAD_EPS = 1e-8  # FBGEMM's default

# Kernels are built for the interpreter or for the GPU when they are defined (triton.jit reads
# TRITON_INTERPRET then): CPU tensors may only go to interpreted ones, CUDA tensors to compiled.
_KERNELS_INTERPRETED = interpreting()

GATHER_ELEMENTS = 4096  # bags x columns per gather program
GATHER_MAX_BLOCK_D = 128
ADAGRAD_TILE_ELEMENTS = 4096  # second pass: runs x BLOCK_D per program (BLOCK_D the whole row for Adagrad)
ADAGRAD_MAX_DIM = 1024  # wider rows take the reference
APPLY_MAX_BLOCK_D = 128  # columns per program of the second SGD pass (half tables), which tiles columns


# ----------------------------------------------------------------------------- layout helpers


def pooled_per_sample(pooled: torch.Tensor, num_features: int) -> torch.Tensor:
    """``[T*B, D]`` (feature-major bags) viewed as ``[B, T, D]`` (per sample), no copy. The
    updates take that view (or its gradient) as ``grad_pooled`` as it is."""
    if num_features <= 0 or pooled.dim() != 2 or pooled.shape[0] % num_features:
        raise ValueError(f"pooled {tuple(pooled.shape)} does not hold num_features={num_features} features "
                         "of whole batches")
    return pooled.view(num_features, pooled.shape[0] // num_features, pooled.shape[1]).transpose(0, 1)


def _num_bags(offsets: torch.Tensor) -> int:
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        raise ValueError(f"offsets must be 1-D with num_bags + 1 entries, got shape {tuple(offsets.shape)}")
    return offsets.shape[0] - 1


def _grad_per_bag(grad_pooled: torch.Tensor, num_bags: int) -> torch.Tensor:
    """``grad_pooled`` as ``[num_bags, D]`` in bag order (a copy only for ``[B, T, D]``)."""
    if grad_pooled.dim() == 2 and grad_pooled.shape[0] == num_bags:
        return grad_pooled
    if grad_pooled.dim() == 3 and grad_pooled.shape[0] * grad_pooled.shape[1] == num_bags:
        return grad_pooled.transpose(0, 1).reshape(num_bags, grad_pooled.shape[2])
    raise ValueError(f"grad_pooled {tuple(grad_pooled.shape)} is neither [num_bags, D] nor [B, T, D] "
                     f"with num_bags={num_bags}")


def bag_of_positions(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """The bag of every position ``j < nnz``: the last ``i`` with ``offsets[i] <= j`` (empty bags
    are passed over), as int64 on the device, without a host sync."""
    positions = torch.arange(nnz, dtype=offsets.dtype, device=offsets.device)
    return torch.searchsorted(offsets.contiguous(), positions, right=True).sub_(1).to(torch.int64)


# ----------------------------------------------------------------------------- references


def bag_gather_reference(
    weight: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    num_features: int | None = None,
    padded: bool = False,
) -> torch.Tensor:
    """``torch.nn.functional.embedding_bag(mode="sum")`` of the bags, in fp32 (fp64 for an fp64
    weight) on the rows the bags use (no copy of the table), cast to ``out_dtype`` (default: the
    weight's): ``[T*B, D]``, or ``[B, T, D]`` with ``num_features``. ``padded``: values past
    ``offsets[-1]`` are padding, left out (whatever their ids)."""
    out_dtype = out_dtype or weight.dtype
    acc_dtype = torch.promote_types(weight.dtype, torch.float32)
    _num_bags(offsets)  # raises on malformed offsets
    values = values.reshape(-1).to(torch.int64)
    nnz = values.shape[0]
    positions = torch.arange(nnz, device=values.device)
    weights = None if per_sample_weights is None else per_sample_weights.reshape(-1).to(acc_dtype)
    if not padded:
        rows = weight.detach().index_select(0, values).to(acc_dtype)
        pooled = F.embedding_bag(positions, rows, offsets.to(torch.int64), mode="sum",
                                 per_sample_weights=weights, include_last_offset=True)
    else:
        # embedding_bag would add the padding to the last bag: it points at an extra row
        # (``nnz``) that padding_idx leaves out.
        in_bags = _in_bags(offsets, nnz)
        rows = torch.zeros(nnz + 1, weight.shape[1], dtype=acc_dtype, device=weight.device)
        rows[:nnz] = weight.detach().index_select(0, torch.where(in_bags, values, 0))
        pooled = F.embedding_bag(torch.where(in_bags, positions, nnz), rows, offsets.to(torch.int64), mode="sum",
                                 per_sample_weights=weights, include_last_offset=True, padding_idx=nnz)
    pooled = pooled.to(out_dtype)
    return pooled if num_features is None else pooled_per_sample(pooled, num_features).contiguous()


def _in_bags(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """``[nnz]`` bool: whether each position lies in a bag, i.e. before ``offsets[-1]`` (after
    it: the padding of padded bags). On the device, no host sync."""
    return torch.arange(nnz, device=offsets.device) < offsets[-1]


def _summed_rows(
    weight: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    grad_pooled: torch.Tensor,
    per_sample_weights: torch.Tensor | None,
    acc_dtype: torch.dtype,
    padded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(rows, run, sums, writes)``: the sorted ids, the run index of each sorted position, each
    run's summed gradient ``[nnz, D]`` (rows past the number of runs are zero), and None. Torch
    ops, no host sync. ``padded`` (values past ``offsets[-1]`` are padding): the padding sorts
    last, as the id ``weight.shape[0]``, and adds nothing; its positions name the row of the last
    position in a bag instead (so they write that row's value again), or row 0 when no position
    is in a bag, and ``writes`` ``[nnz]`` says which positions hold a new value (False: rewrite
    the old one)."""
    values = values.reshape(-1).to(torch.int64)
    nnz = values.shape[0]
    num_bags = _num_bags(offsets)
    grad = _grad_per_bag(grad_pooled, num_bags)
    if grad.shape[1] != weight.shape[1]:
        raise ValueError(f"grad_pooled has {grad.shape[1]} columns, the weight {weight.shape[1]}")
    bags = bag_of_positions(offsets, nnz)
    in_bags = _in_bags(offsets, nnz) if padded else None
    if padded:
        bags.clamp_(max=num_bags - 1)  # padding: "one past the last bag"; its contribution is dropped below
        values = torch.where(in_bags, values, weight.shape[0])
    contributions = grad.index_select(0, bags).to(acc_dtype)
    if per_sample_weights is not None:
        contributions *= per_sample_weights.reshape(-1, 1).to(acc_dtype)
    if padded:
        contributions = torch.where(in_bags[:, None], contributions, 0.0)
    # Stable: equal ids are summed in the order of their positions, with or without padding.
    sorted_rows, perm = torch.sort(values, stable=True)
    starts = torch.ones_like(sorted_rows, dtype=torch.bool)
    starts[1:] = sorted_rows[1:] != sorted_rows[:-1]
    run = torch.cumsum(starts, 0) - 1
    sums = torch.zeros(nnz, weight.shape[1], dtype=acc_dtype, device=weight.device)
    sums.index_add_(0, run, contributions.index_select(0, perm))
    if not padded:
        return sorted_rows, run, sums, None
    kept = in_bags.index_select(0, perm)  # in a bag, in sorted order: a prefix
    last = (kept.sum() - 1).clamp_(min=0)
    source = torch.where(kept, torch.arange(nnz, device=values.device), last)
    writes = kept.index_select(0, source)  # False only when no position is in a bag
    rows = torch.where(writes, sorted_rows.index_select(0, source), 0)
    return rows, run.index_select(0, source), sums, writes


@torch.no_grad()
def bag_sgd_update_reference(
    weight: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    grad_pooled: torch.Tensor,
    lr: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    rounding_step: torch.Tensor | None = None,
    padded: bool = False,
) -> None:
    """In place: ``weight[r] -= lr * grad_scale * sum(w_j * grad_pooled[bag(j)] for
    values[j] == r)`` per distinct ``r``, nothing when ``skip``. Sums and steps in fp32 (fp64
    for an fp64 weight) and rounds each new row once into the weight's dtype, with
    ``round_to(new, weight.dtype, rounding_step)``; no host sync, no dense ``[rows, D]``.
    ``padded``: values past ``offsets[-1]`` are padding, left out (whatever their ids)."""
    if values.numel() == 0 or _num_bags(offsets) == 0:
        return
    acc_dtype = torch.promote_types(weight.dtype, torch.float32)
    rows, run, sums, writes = _summed_rows(weight, values, offsets, grad_pooled, per_sample_weights, acc_dtype,
                                           padded)
    factor = lr.to(acc_dtype) * grad_scale.to(acc_dtype)
    old = weight.index_select(0, rows)
    new = round_to(old.to(acc_dtype) - factor * sums.index_select(0, run), weight.dtype, rounding_step)
    keep = skip.to(torch.bool) if writes is None else skip.to(torch.bool) | ~writes[:, None]
    # Duplicates of a row write the same value, so the order of the copies does not matter.
    weight.index_copy_(0, rows, torch.where(keep, old, new))


@torch.no_grad()
def bag_rowwise_adagrad_update_reference(
    weight: torch.Tensor,
    state: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    grad_pooled: torch.Tensor,
    lr: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    eps: float = ADAGRAD_EPS,
    rounding_step: torch.Tensor | None = None,
    padded: bool = False,
) -> None:
    """In place, per distinct row ``r`` with summed gradient ``g = grad_scale * sum(w_j *
    grad_pooled[bag(j)] for values[j] == r)``: ``state[r] += mean(g * g)``, then
    ``weight[r] -= lr * g / (sqrt(state[r]) + eps)``; nothing when ``skip``. fp32 arithmetic
    (fp64 for an fp64 weight), each new row rounded once into the weight's dtype with
    ``round_to(new, weight.dtype, rounding_step)``; no host sync. The step is spelled
    ``(lr / (sqrt(state) + eps)) * g``, as the kernel computes it, so both round alike.
    ``padded``: values past ``offsets[-1]`` are padding, left out (whatever their ids); a row
    only padding names keeps its state and weight untouched (written back as they are)."""
    if values.numel() == 0 or _num_bags(offsets) == 0:
        return
    acc_dtype = torch.promote_types(weight.dtype, torch.float32)
    rows, run, sums, writes = _summed_rows(weight, values, offsets, grad_pooled, per_sample_weights, acc_dtype,
                                           padded)
    g = sums.index_select(0, run) * grad_scale.to(acc_dtype)
    old_state = state.index_select(0, rows)
    new_state = old_state.to(acc_dtype) + (g * g).mean(dim=1)
    old = weight.index_select(0, rows)
    step = (lr.to(acc_dtype) / (new_state.sqrt() + eps))[:, None] * g
    new = round_to(old.to(acc_dtype) - step, weight.dtype, rounding_step)
    keep = skip.to(torch.bool) if writes is None else skip.to(torch.bool) | ~writes
    state.index_copy_(0, rows, torch.where(keep, old_state, new_state.to(state.dtype)))
    weight.index_copy_(0, rows, torch.where(keep[..., None], old, new))


# ----------------------------------------------------------------------------- support checks


def _kernels_run_on(device: torch.device) -> bool:
    return triton is not None and _KERNELS_INTERPRETED == (device.type == "cpu")


def _inner_contiguous(t: torch.Tensor) -> bool:
    return t.shape[-1] == 1 or t.stride(-1) == 1


def _bf16_ok(device: torch.device, *dtypes: torch.dtype) -> bool:
    return (torch.bfloat16 not in dtypes or device.type != "cuda"
            or torch.cuda.get_device_capability(device) >= (8, 0))


def _bags_ok(values: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None) -> bool:
    return (
        values.dim() == 1
        and values.dtype in INDEX_DTYPES
        and offsets.dim() == 1
        and offsets.shape[0] >= 1
        and offsets.dtype in INDEX_DTYPES
        and (per_sample_weights is None
             or (per_sample_weights.shape == values.shape and per_sample_weights.dtype in FLOAT_DTYPES))
    )


def supports_bag_gather(
    weight: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> bool:
    """Whether ``bag_gather`` runs its kernel: a 2-D fp32/fp16/bf16 weight with unit column
    stride (any row stride), 1-D int32/int64 values and offsets (any stride), float per-sample
    weights of the values' shape, a float ``out_dtype``, all on one device Triton can use."""
    out_dtype = out_dtype or weight.dtype
    tensors = [weight, values, offsets] + ([] if per_sample_weights is None else [per_sample_weights])
    return (
        triton_usable(*tensors)
        and _kernels_run_on(weight.device)
        and weight.dim() == 2
        and weight.dtype in FLOAT_DTYPES
        and out_dtype in FLOAT_DTYPES
        and _inner_contiguous(weight)
        and _bags_ok(values, offsets, per_sample_weights)
        and _bf16_ok(weight.device, weight.dtype, out_dtype, *(t.dtype for t in tensors[3:]))
    )


def _grad_ok(grad_pooled: torch.Tensor, num_bags: int, dim: int) -> bool:
    if grad_pooled.dtype not in FLOAT_DTYPES or not _inner_contiguous(grad_pooled) or grad_pooled.shape[-1] != dim:
        return False
    if grad_pooled.dim() == 2:
        return grad_pooled.shape[0] == num_bags
    return grad_pooled.dim() == 3 and grad_pooled.shape[0] * grad_pooled.shape[1] == num_bags


def _rounding_step_ok(rounding_step: torch.Tensor | None) -> bool:
    """The kernels read the step as one integer on the device (the reference takes any)."""
    return rounding_step is None or (rounding_step.dim() == 0 and rounding_step.dtype in ROUNDING_STEP_DTYPES)


def _update_ok(weight, values, offsets, grad_pooled, per_sample_weights, others, scalars, rounding_step) -> bool:
    tensors = [weight, values, offsets, grad_pooled, *others, *scalars]
    if per_sample_weights is not None:
        tensors.append(per_sample_weights)
    if rounding_step is not None:
        tensors.append(rounding_step)
    return (
        _rounding_step_ok(rounding_step)
        and triton_usable(*tensors)
        and _kernels_run_on(weight.device)
        and weight.dim() == 2
        and weight.dtype in UPDATE_WEIGHT_DTYPES
        and _inner_contiguous(weight)
        and _bags_ok(values, offsets, per_sample_weights)
        and _grad_ok(grad_pooled, offsets.shape[0] - 1, weight.shape[1])
        and _bf16_ok(weight.device, *(t.dtype for t in tensors))
        and all(s.dim() == 0 for s in scalars)
    )


def supports_bag_update(
    weight: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    grad_pooled: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    *scalars: torch.Tensor,
    rounding_step: torch.Tensor | None = None,
) -> bool:
    """Whether ``bag_sgd_update`` runs its kernels: an fp32, fp16 or bf16 2-D weight with unit
    column stride (any ``D``: the half tables' second pass tiles columns too), bags as
    ``supports_bag_gather`` takes them, a float ``grad_pooled`` ``[T*B, D]`` or ``[B, T, D]``
    with unit column stride (any other strides), (when given) 0-dim ``lr``/``grad_scale``/
    ``skip`` and a 0-dim integer ``rounding_step``, all on one device Triton can use."""
    return _update_ok(weight, values, offsets, grad_pooled, per_sample_weights, (), scalars, rounding_step)


def supports_bag_rowwise_adagrad(
    weight: torch.Tensor,
    state: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    grad_pooled: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    *scalars: torch.Tensor,
    rounding_step: torch.Tensor | None = None,
) -> bool:
    """Whether ``bag_rowwise_adagrad_update`` runs its kernels: what ``supports_bag_update``
    asks, an fp32 ``state [rows]`` (any stride), and ``1 <= D <= ADAGRAD_MAX_DIM`` (a program
    holds whole rows)."""
    return (
        _update_ok(weight, values, offsets, grad_pooled, per_sample_weights, (state,), scalars, rounding_step)
        and state.dtype == torch.float32
        and state.dim() == 1
        and state.shape[0] == weight.shape[0]
        and 1 <= weight.shape[1] <= ADAGRAD_MAX_DIM
    )


# ----------------------------------------------------------------------------- kernels

if triton is not None:

    @triton.jit
    def _bag_gather_kernel(weight_ptr, values_ptr, offsets_ptr, psw_ptr, out_ptr,
                           num_bags, batch, nnz, num_rows, dim, weight_stride,
                           values_stride, offsets_stride, psw_stride, out_stride_t, out_stride_b,
                           HAS_WEIGHTS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr,
                           INTERPRETER: tl.constexpr):
        """Program ``(i, j)``: bags ``[i*BLOCK_B, +BLOCK_B)`` x columns ``[j*BLOCK_D, +BLOCK_D)``.
        Step ``k`` adds the ``k``-th id of every bag still that long, in fp32."""
        bags = tl.program_id(0).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        bag_ok = bags < num_bags
        col_ok = cols < dim
        starts = tl.load(offsets_ptr + bags * offsets_stride, mask=bag_ok, other=0).to(tl.int64)
        ends = tl.load(offsets_ptr + (bags + 1) * offsets_stride, mask=bag_ok, other=0).to(tl.int64)
        # Never read outside values, whatever the offsets say.
        starts = tl.maximum(starts, 0)
        lengths = tl.maximum(tl.minimum(ends, nnz) - starts, 0)
        longest = tl.max(lengths, axis=0)
        acc = tl.zeros([BLOCK_B, BLOCK_D], dtype=tl.float32)
        for k in range(longest):
            ok = k < lengths
            pos = starts + k
            ids = tl.load(values_ptr + pos * values_stride, mask=ok, other=-1).to(tl.int64)
            row_ok = ok & (ids >= 0) & (ids < num_rows)
            rows = tl.load(weight_ptr + ids[:, None] * weight_stride + cols[None, :],
                           mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                w = tl.load(psw_ptr + pos * psw_stride, mask=ok, other=0.0).to(tl.float32)
                rows = rows * w[:, None]
            acc += rows
        t = bags // batch
        b = bags - t * batch
        tl.store(out_ptr + (t * out_stride_t + b * out_stride_b)[:, None] + cols[None, :],
                 round_nearest(acc, out_ptr.dtype.element_ty, INTERPRETER), mask=bag_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _load_tile(sorted_ptr, perm_ptr, bag_ptr, psw_ptr, grad_ptr, pos, end, cols, col_ok,
                   num_bags, batch, grad_stride_t, grad_stride_b, psw_stride, HAS_WEIGHTS: tl.constexpr):
        """Sorted ids at ``pos`` (-1 past ``end``), the next id (-1 at ``end``), and each
        position's gradient row ``w_j * grad_pooled[bag(j)]`` in fp32 (zeros past ``end``)."""
        valid = pos < end
        ids = tl.load(sorted_ptr + pos, mask=valid, other=-1).to(tl.int64)
        nxt = tl.load(sorted_ptr + pos + 1, mask=valid & (pos + 1 < end), other=-1).to(tl.int64)
        src = tl.load(perm_ptr + pos, mask=valid, other=0)
        bag = tl.load(bag_ptr + src, mask=valid, other=-1)
        bag_ok = valid & (bag >= 0) & (bag < num_bags)
        bag = tl.where(bag_ok, bag, 0)
        t = bag // batch
        b = bag - t * batch
        grad = tl.load(grad_ptr + (t * grad_stride_t + b * grad_stride_b)[:, None] + cols[None, :],
                       mask=bag_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            w = tl.load(psw_ptr + src * psw_stride, mask=bag_ok, other=0.0).to(tl.float32)
            grad = grad * w[:, None]
        return valid, ids, nxt, grad

    @triton.jit
    def _bag_sgd_update_kernel(weight_ptr, sorted_ptr, perm_ptr, bag_ptr, psw_ptr, grad_ptr,
                               lr_ptr, scale_ptr, skip_ptr,
                               n, num_rows, dim, num_bags, batch, weight_stride,
                               grad_stride_t, grad_stride_b, psw_stride,
                               HAS_WEIGHTS: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
                               BLOCK_D: tl.constexpr):
        """Program ``(p, j)``: sorted positions ``[p*SPAN, +SPAN)`` x a block of columns. A run
        inside the program is written with a load/store, one shared with a neighbour with an
        atomic add of this program's partial sum."""
        factor = tl.load(lr_ptr).to(tl.float32) * tl.load(scale_ptr).to(tl.float32)
        start = tl.program_id(0).to(tl.int64) * (TILE * TILES)
        end = tl.minimum(start + TILE * TILES, n)
        before = tl.load(sorted_ptr + start - 1, mask=start > 0, other=-1).to(tl.int64)
        after = tl.load(sorted_ptr + end, mask=end < n, other=-1).to(tl.int64)
        # A skipped step owns no positions (an empty range rather than a scalar flag in every
        # mask: the interpreter mistypes scalar-bool & tensor-bool).
        end = tl.where(tl.load(skip_ptr).to(tl.int32) != 0, start, end)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        lane = tl.arange(0, TILE)
        carry = tl.zeros([BLOCK_D], dtype=tl.float32)
        carry_id = tl.full([], -1, tl.int64)
        for t in range(TILES):
            pos = start + t * TILE + lane
            valid, ids, nxt, grad = _load_tile(sorted_ptr, perm_ptr, bag_ptr, psw_ptr, grad_ptr, pos, end,
                                               cols, col_ok, num_bags, batch, grad_stride_t, grad_stride_b,
                                               psw_stride, HAS_WEIGHTS)
            sums, carry, carry_id = run_sums(ids, nxt, valid, grad, carry, carry_id, lane, TILE)
            write_runs(weight_ptr, ids, nxt, valid, sums, before, after, cols, col_ok, factor, num_rows,
                       weight_stride)

    @triton.jit
    def _adagrad_rate(state_ptr, ids, g, mask_rows, lr, eps, dim, state_stride):
        """Row-wise Adagrad's state update on rows ``ids`` (where ``mask_rows``) with summed
        gradients ``g`` (whole rows); returns each row's rate ``lr / (sqrt(state) + eps)``."""
        mean_sq = tl.sum(g * g, axis=1) / dim  # masked columns are zero
        state = tl.load(state_ptr + ids * state_stride, mask=mask_rows, other=0.0) + mean_sq
        tl.store(state_ptr + ids * state_stride, state, mask=mask_rows)
        return lr / (tl.sqrt_rn(state) + eps)

    @triton.jit
    def _round_rows(x, cols, step_ptr, DTYPE: tl.constexpr, STOCHASTIC: tl.constexpr, INTERPRETER: tl.constexpr):
        """fp32 rows ``x`` in the table's ``DTYPE``: stochastically (bf16, draws keyed by the
        step at ``step_ptr``) or to nearest (a no-op for fp32 tables)."""
        if STOCHASTIC:
            rounded = stochastic_bf16(x, cols, tl.load(step_ptr))
        else:
            rounded = round_nearest(x, DTYPE, INTERPRETER)
        return rounded

    @triton.jit
    def _apply_runs_kernel(weight_ptr, state_ptr, rows_ptr, summed_ptr, num_runs_ptr, lr_ptr, scale_ptr, skip_ptr,
                           step_ptr, eps, num_rows, dim, weight_stride, state_stride, summed_stride,
                           ROWWISE: tl.constexpr, STOCHASTIC: tl.constexpr, INTERPRETER: tl.constexpr,
                           ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program ``(p, j)``: runs ``[p*ROWS, +ROWS)`` x columns ``[j*BLOCK_D, +BLOCK_D)``
        (whole rows, ``j == 0``, for ``ROWWISE``). Row ``rows[r]`` takes the step of its summed
        gradient ``summed[r]``: row-wise Adagrad (``summed`` holds ``grad_scale * sum``) or SGD
        (``summed`` holds the plain sum; the step is ``lr * grad_scale * sum``), computed in fp32
        from the upcast old row and rounded once into the weight's dtype. Runs past
        ``num_runs`` (all of them when ``skip``) and ids outside ``[0, num_rows)`` do nothing."""
        r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        limit = tl.load(num_runs_ptr)
        limit = tl.where(tl.load(skip_ptr).to(tl.int32) != 0, 0, limit)
        in_use = r < limit
        ids = tl.load(rows_ptr + r, mask=in_use, other=-1).to(tl.int64)
        ok = in_use & (ids >= 0) & (ids < num_rows)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = ok[:, None] & (cols < dim)[None, :]
        g = tl.load(summed_ptr + r[:, None] * summed_stride + cols[None, :], mask=mask, other=0.0)
        offsets = ids[:, None] * weight_stride + cols[None, :]
        old = tl.load(weight_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        lr = tl.load(lr_ptr).to(tl.float32)
        if ROWWISE:
            new = old - _adagrad_rate(state_ptr, ids, g, ok, lr, eps, dim, state_stride)[:, None] * g
        else:
            new = old - (lr * tl.load(scale_ptr).to(tl.float32)) * g
        tl.store(weight_ptr + offsets,
                 _round_rows(new, cols, step_ptr, weight_ptr.dtype.element_ty, STOCHASTIC, INTERPRETER), mask=mask)


def _pow2(x: int, low: int, high: int) -> int:
    return min(max(triton.next_power_of_2(max(x, 1)), low), high)


# ----------------------------------------------------------------------------- public functions


def bag_gather(
    weight: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    num_features: int | None = None,
    padded: bool = False,
) -> torch.Tensor:
    """Pooled bags, ``out[i] = sum_j w_j * weight[values[j]]`` over bag ``i``, accumulated in
    fp32 and written in ``out_dtype`` (default: the weight's dtype): ``[T*B, D]`` in bag order,
    or ``[B, T, D]`` per sample when ``num_features=T`` is given (written directly, no copy).
    Empty bags give zeros. The kernel when ``supports_bag_gather`` says so, else the reference;
    not differentiable by itself (the updates consume its gradient). ``padded``: values past
    ``offsets[-1]`` are padding (the kernel never reads them; the reference is told)."""
    out_dtype = out_dtype or weight.dtype
    if not supports_bag_gather(weight, values, offsets, per_sample_weights, out_dtype):
        return bag_gather_reference(weight, values, offsets, per_sample_weights, out_dtype, num_features, padded)
    num_bags, dim = offsets.shape[0] - 1, weight.shape[1]
    if num_features is None:
        out = torch.empty(num_bags, dim, dtype=out_dtype, device=weight.device)
        batch, stride_t, stride_b = max(num_bags, 1), 0, dim
    else:
        if num_features <= 0 or num_bags % num_features:
            raise ValueError(f"{num_bags} bags are not num_features={num_features} features of whole batches")
        batch = num_bags // num_features
        out = torch.empty(batch, num_features, dim, dtype=out_dtype, device=weight.device)
        stride_t, stride_b = dim, num_features * dim
    if num_bags == 0 or dim == 0:
        return out
    if values.shape[0] == 0:  # every bag empty; no launch with an empty (null) values pointer
        return out.zero_()
    block_d = _pow2(dim, 16, GATHER_MAX_BLOCK_D)
    block_b = max(GATHER_ELEMENTS // block_d, 1)
    grid = (triton.cdiv(num_bags, block_b), triton.cdiv(dim, block_d))
    psw = values if per_sample_weights is None else per_sample_weights
    _bag_gather_kernel[grid](weight, values, offsets, psw, out,
                             num_bags, max(batch, 1), values.shape[0], weight.shape[0], dim, weight.stride(0),
                             values.stride(0), offsets.stride(0), psw.stride(0), stride_t, stride_b,
                             HAS_WEIGHTS=per_sample_weights is not None, BLOCK_B=block_b, BLOCK_D=block_d,
                             INTERPRETER=_KERNELS_INTERPRETED)
    return out


def _grad_strides(grad_pooled: torch.Tensor, num_bags: int) -> tuple[int, int, int]:
    """``(batch, stride_t, stride_b)``: bag ``t*batch + b`` is at ``t*stride_t + b*stride_b``."""
    if grad_pooled.dim() == 2:
        return max(num_bags, 1), 0, grad_pooled.stride(0)
    return max(grad_pooled.shape[0], 1), grad_pooled.stride(1), grad_pooled.stride(0)


def _prepare_update(values, offsets, grad_pooled, per_sample_weights):
    """Sorted ids, their permutation, every position's bag, and the kernel's layout arguments."""
    num_bags = offsets.shape[0] - 1
    # Stable: equal ids are summed in the order of their positions, so that padding (the id
    # ``rows``, after every real one) leaves the sorted real ids, and so every sum, as they are.
    sorted_rows, perm = torch.sort(values, stable=True)
    bags = bag_of_positions(offsets, values.shape[0])
    psw = values if per_sample_weights is None else per_sample_weights
    batch, stride_t, stride_b = _grad_strides(grad_pooled, num_bags)
    return sorted_rows, perm, bags, psw, (num_bags, batch), (stride_t, stride_b, psw.stride(0))


def bag_sgd_update(
    weight: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    grad_pooled: torch.Tensor,
    lr: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    rounding_step: torch.Tensor | None = None,
    padded: bool = False,
) -> None:
    """In place, per distinct row ``r``: ``weight[r] -= lr * grad_scale * sum(w_j *
    grad_pooled[bag(j)] for values[j] == r)``, duplicates within and across bags summed (fp32)
    before the update; nothing when ``skip``. ``grad_pooled`` is ``[T*B, D]`` (bag order) or
    ``[B, T, D]`` (per sample, as ``bag_gather(num_features=T)`` returns). An fp16/bf16 weight
    gets each new row computed in fp32 and rounded once, stochastically for bf16 when
    ``rounding_step`` (a 0-dim int64 device tensor) is given, else to nearest; an fp32 weight
    ignores ``rounding_step``. Sort + one kernel (two for half weights), no host sync; the
    reference when ``supports_bag_update`` says no. ``padded``: values past ``offsets[-1]`` are
    padding (see the module's notes; the kernels need no flag, the reference is told)."""
    if not supports_bag_update(weight, values, offsets, grad_pooled, per_sample_weights, lr, grad_scale, skip,
                               rounding_step=rounding_step):
        bag_sgd_update_reference(weight, values, offsets, grad_pooled, lr, grad_scale, skip, per_sample_weights,
                                 rounding_step, padded)
        return
    _bag_sgd_update_triton(weight, values, offsets, grad_pooled, lr, grad_scale, skip, per_sample_weights,
                           rounding_step=rounding_step)


def _bag_sgd_update_triton(weight, values, offsets, grad_pooled, lr, grad_scale, skip, per_sample_weights=None,
                           tile: int = UPDATE_TILE, tiles: int = UPDATE_TILES,
                           max_block_d: int | None = None, rounding_step: torch.Tensor | None = None) -> None:
    """The kernel path of ``bag_sgd_update``; ``tile``/``tiles`` are exposed so tests can make
    runs cross many programs with few ids, and ``max_block_d`` for tuning. fp32 weights: one
    kernel, atomics where a run crosses programs. fp16/bf16 weights: the plain sums of the
    runs into an fp32 buffer, then ``weight[r] = round(weight[r] - lr * grad_scale * sum)``."""
    if values.shape[0] == 0 or weight.shape[1] == 0:
        return
    prepared = _prepare_update(values, offsets, grad_pooled, per_sample_weights)
    if weight.dtype == torch.float32:
        _launch_sgd_kernel(weight, prepared[0], weight.shape[0], prepared, grad_pooled, lr, grad_scale, skip,
                           per_sample_weights is not None, tile, tiles, max_block_d)
        return
    one = torch.ones((), dtype=torch.float32, device=weight.device)
    run_rows, summed, num_runs = _summed_runs(prepared, grad_pooled, one, skip, per_sample_weights is not None,
                                              tile, tiles, max_block_d)
    _apply_runs(weight, None, run_rows, summed, num_runs, lr, grad_scale, skip, rounding_step)


def _launch_sgd_kernel(target, sorted_ids, num_rows, prepared, grad_pooled, lr, grad_scale, skip, weighted: bool,
                       tile: int, tiles: int, max_block_d: int | None = None) -> None:
    """``_bag_sgd_update_kernel`` on ``target`` keyed by ``sorted_ids`` (row ids, or run indices)."""
    _, perm, bags, psw, (num_bags, batch), (stride_t, stride_b, psw_stride) = prepared
    n, dim = sorted_ids.shape[0], target.shape[1]
    block_d = update_block_d(dim, grad_pooled.dtype, max_block_d)
    grid = (triton.cdiv(n, tile * tiles), triton.cdiv(dim, block_d))
    _bag_sgd_update_kernel[grid](target, sorted_ids, perm, bags, psw, grad_pooled, lr, grad_scale, skip,
                                 n, num_rows, dim, num_bags, batch, target.stride(0),
                                 stride_t, stride_b, psw_stride,
                                 HAS_WEIGHTS=weighted, TILE=tile, TILES=tiles, BLOCK_D=block_d)


def _summed_runs(prepared, grad_pooled, grad_scale, skip, weighted: bool, tile: int, tiles: int,
                 max_block_d: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first of the two passes: ``(run_rows, summed, num_runs)``, the row id of every run
    (``[nnz]``, in sorted order), ``grad_scale * sum`` of every run (fp32 ``[nnz, D]``, zeros
    past the last run or when ``skip``) and the number of runs (``[1]``, on the device).

    The SGD kernel, pointed at the buffer with the sorted *run index* in place of the row id and
    ``-1`` as its learning rate, writes each run's sum into that run's buffer row (runs that
    cross programs with atomics, as fp32 rows are). The buffer (``nnz * D * 4`` bytes, freed
    after) buys a race-free second pass that may round each row once."""
    sorted_rows = prepared[0]
    n, dim = sorted_rows.shape[0], grad_pooled.shape[-1]
    starts = torch.ones(n, dtype=torch.bool, device=sorted_rows.device)
    torch.ne(sorted_rows[1:], sorted_rows[:-1], out=starts[1:])
    run = torch.cumsum(starts, 0).sub_(1)  # sorted, grouped exactly as sorted_rows
    run_rows = torch.empty(n, dtype=sorted_rows.dtype, device=sorted_rows.device).scatter_(0, run, sorted_rows)
    num_runs = run[-1:] + 1  # on the device: no host sync
    summed = torch.zeros(n, dim, dtype=torch.float32, device=grad_pooled.device)
    minus_one = torch.full((), -1.0, dtype=torch.float32, device=grad_pooled.device)
    _launch_sgd_kernel(summed, run, n, prepared, grad_pooled, minus_one, grad_scale, skip, weighted, tile, tiles,
                       max_block_d)
    return run_rows, summed, num_runs


def _apply_runs(weight, state, run_rows, summed, num_runs, lr, grad_scale, skip,
                rounding_step: torch.Tensor | None, eps: float = 0.0) -> None:
    """The second pass: every run's row steps by its summed gradient, row-wise Adagrad with a
    ``state`` (whole rows per program), else SGD (tiled columns, any ``D``), rounded once into
    the weight's dtype (stochastically for bf16 with a ``rounding_step``)."""
    n, dim = summed.shape
    rowwise = state is not None
    block_d = _pow2(dim, 16, ADAGRAD_MAX_DIM if rowwise else APPLY_MAX_BLOCK_D)
    rows_per_program = max(ADAGRAD_TILE_ELEMENTS // block_d, 1)
    stochastic = rounding_step is not None and weight.dtype == torch.bfloat16
    grid = (triton.cdiv(n, rows_per_program), 1 if rowwise else triton.cdiv(dim, block_d))
    _apply_runs_kernel[grid](
        weight, state if rowwise else summed, run_rows, summed, num_runs, lr, grad_scale, skip,
        rounding_step if stochastic else num_runs, float(eps), weight.shape[0], dim,
        weight.stride(0), state.stride(0) if rowwise else 0, summed.stride(0),
        ROWWISE=rowwise, STOCHASTIC=stochastic, INTERPRETER=_KERNELS_INTERPRETED,
        ROWS=rows_per_program, BLOCK_D=block_d)


def bag_rowwise_adagrad_update(
    weight: torch.Tensor,
    state: torch.Tensor,
    values: torch.Tensor,
    offsets: torch.Tensor,
    grad_pooled: torch.Tensor,
    lr: torch.Tensor,
    grad_scale: torch.Tensor,
    skip: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    eps: float = ADAGRAD_EPS,
    rounding_step: torch.Tensor | None = None,
    padded: bool = False,
) -> None:
    """In place, per distinct row ``r`` with ``g = grad_scale * sum(w_j * grad_pooled[bag(j)]
    for values[j] == r)``: ``state[r] += mean(g * g)`` (over ``D``), ``weight[r] -= lr * g /
    (sqrt(state[r]) + eps)``; nothing when ``skip``. FBGEMM's / TorchRec's row-wise Adagrad
    (``state`` is their ``momentum1``, fp32 ``[rows]``). fp32 arithmetic; an fp16/bf16 weight
    is rounded once per row as in ``bag_sgd_update`` (``rounding_step`` likewise). Sort + two
    kernels, no host sync; the reference when ``supports_bag_rowwise_adagrad`` says no.
    ``padded``: as in ``bag_sgd_update``."""
    if not supports_bag_rowwise_adagrad(weight, state, values, offsets, grad_pooled, per_sample_weights,
                                        lr, grad_scale, skip, rounding_step=rounding_step):
        bag_rowwise_adagrad_update_reference(weight, state, values, offsets, grad_pooled, lr, grad_scale, skip,
                                             per_sample_weights, eps, rounding_step, padded)
        return
    _bag_rowwise_adagrad_triton(weight, state, values, offsets, grad_pooled, lr, grad_scale, skip,
                                per_sample_weights, eps, rounding_step=rounding_step)


def _bag_rowwise_adagrad_triton(weight, state, values, offsets, grad_pooled, lr, grad_scale, skip,
                                per_sample_weights=None, eps: float = ADAGRAD_EPS,
                                tile: int = UPDATE_TILE, tiles: int = UPDATE_TILES,
                                rounding_step: torch.Tensor | None = None) -> None:
    """The kernel path of ``bag_rowwise_adagrad_update``; ``tile``/``tiles`` as in the SGD one.
    Two passes (``_summed_runs``, then ``_apply_runs``): the state needs each row's whole
    ``g = grad_scale * sum`` before the step."""
    if values.shape[0] == 0 or weight.shape[1] == 0:
        return
    prepared = _prepare_update(values, offsets, grad_pooled, per_sample_weights)
    run_rows, summed, num_runs = _summed_runs(prepared, grad_pooled, grad_scale, skip,
                                              per_sample_weights is not None, tile, tiles)
    _apply_runs(weight, state, run_rows, summed, num_runs, lr, grad_scale, skip, rounding_step, eps)
