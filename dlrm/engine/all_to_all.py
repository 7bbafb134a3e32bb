"""The differentiable all-to-all that both products' exchanges are built on.

DLRM's embedding exchange (``dlrm.distributed.exchange``) and the recommender's item-parallel
exchanges (``dlrm.recommender.item_parallel``) move rows between processes with it; it lives
here, apart from either, so that neither product imports the other's exchange.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """Flat all-to-all with per-peer element counts; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, flat: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = flat.new_empty(sum(recv))
        dist.all_to_all_single(out, flat, output_split_sizes=recv, input_split_sizes=send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send))
        dist.all_to_all_single(out, grad.contiguous(), output_split_sizes=ctx.send, input_split_sizes=ctx.recv,
                               group=ctx.group)
        return out, None, None, None


def all_to_all(flat: torch.Tensor, send: list[int], recv: list[int],
               group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Differentiable flat all-to-all: ``send[j]`` elements of ``flat`` go to process j,
    ``recv[j]`` come from it, in rank order; the gradient takes the reverse path."""
    return _AllToAll.apply(flat, list(send), list(recv), group)
