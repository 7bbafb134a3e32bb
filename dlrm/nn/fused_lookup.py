"""The lookups of ``JointFusedEmbedding`` as autograd functions whose backward queues the
gradient rows on the module (``PendingUpdate``, ``PendingBagUpdate``) instead of building a weight
gradient; the module applies the queue in place with the fused SGD or row-wise Adagrad kernels.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dlrm.kernels.embedding import gather
from dlrm.kernels.embedding_bag import bag_gather

PendingUpdate = tuple[torch.Tensor, torch.Tensor]  # (joint rows [N] int64, gradient rows [N, D])


class PendingBagUpdate(NamedTuple):
    """A queued multi-hot update: what ``bag_sgd_update`` takes besides the weight and scalars."""

    values: torch.Tensor  # [nnz] joint rows
    offsets: torch.Tensor  # [T*B + 1]
    per_sample_weights: torch.Tensor | None  # [nnz] (mean pooling), or None (all sums)
    grad: torch.Tensor  # [B, T, D], gradient of the pooled output


class PaddedBagUpdate(PendingBagUpdate):
    """A ``PendingBagUpdate`` of padded bags (``Bags.padded_to``): the values past ``offsets[-1]``
    are padding, with the row id one past the last (no row), which the updates skip."""

    __slots__ = ()


class _FusedLookup(torch.autograd.Function):
    """``gather`` forward; the backward queues ``(rows, grad)`` on the module instead of
    returning a weight gradient, so no dense or COO gradient is ever built."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, rows: torch.Tensor, out_dtype: torch.dtype,
                pending: list[PendingUpdate]) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.pending = pending
        return gather(weight, rows, out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (rows,) = ctx.saved_tensors
        # contiguous: upstream gradients may be expanded views (stride 0) the kernel cannot read
        ctx.pending.append((rows, grad_out.reshape(rows.shape[0], -1).contiguous()))
        return None, None, None, None


class _FusedBagLookup(torch.autograd.Function):
    """``bag_gather`` forward (pooled ``[B, T, D]`` in ``out_dtype``); the backward queues a
    ``PendingBagUpdate`` on the module instead of returning a weight gradient (a
    ``PaddedBagUpdate`` for ``padded`` bags, ``Bags.padded_to``)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None, out_dtype: torch.dtype, num_features: int,
                pending: list, padded: bool) -> torch.Tensor:
        ctx.save_for_backward(values, offsets, per_sample_weights)
        ctx.pending, ctx.padded = pending, padded
        return bag_gather(weight, values, offsets, per_sample_weights, out_dtype, num_features, padded=padded)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        values, offsets, per_sample_weights = ctx.saved_tensors
        update = PaddedBagUpdate if ctx.padded else PendingBagUpdate
        # contiguous: upstream gradients may be expanded views (stride 0) the kernel cannot read
        ctx.pending.append(update(values, offsets, per_sample_weights, grad_out.contiguous()))
        return None, None, None, None, None, None, None, None
