"""The all-to-all between model-parallel embeddings and the data-parallel dense part.

Each process looks up its own tables for the whole global batch, ``[B, T_r, D]``; one
all-to-all hands every process the rows of its own samples from every table, which it puts
back in global table order, ``[B_r, F, D]``. The backward pass is the reverse all-to-all.

The exchange carries the compute dtype: under autocast the embeddings are cast to the autocast
dtype (bf16/fp16) before they are sent, so both directions move half the bytes of fp32, as
NVIDIA's DLRM does; the dense part would cast them on arrival anyway. ``dtype`` fixes it instead
(say fp32 under autocast, to exchange exactly).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dlrm.data.rank_source import local_batch_sizes


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


class EmbeddingExchange(nn.Module):
    """``[B, T_rank, D]`` (this rank's tables, global batch) -> ``[B_rank, F, D]`` (own samples,
    every table in global order). Holds no parameters, so checkpoints do not see it."""

    def __init__(self, tables_per_rank: Sequence[Sequence[int]], rank: int, group: dist.ProcessGroup | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.dtype = dtype  # None: the autocast dtype under autocast, else the embeddings' own
        self.tables_per_rank = [list(t) for t in tables_per_rank]
        self.rank = rank
        self.group = group
        rank_major = [t for tables in self.tables_per_rank for t in tables]
        position = {table: i for i, table in enumerate(rank_major)}
        order = [position[t] for t in range(len(rank_major))]
        self.register_buffer("order", torch.tensor(order, dtype=torch.int64), persistent=False)

    @property
    def world_size(self) -> int:
        return len(self.tables_per_rank)

    def wire_dtype(self, local: torch.Tensor) -> torch.dtype:
        """The dtype the all-to-all carries for ``local``."""
        if self.dtype is not None:
            return self.dtype
        device = local.device.type
        return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else local.dtype

    def forward(self, local: torch.Tensor) -> torch.Tensor:
        local = local.to(self.wire_dtype(local))  # its backward casts the gradient back
        global_batch, num_local, dim = local.shape
        sizes = local_batch_sizes(global_batch, self.world_size)
        mine = sizes[self.rank]
        send = [n * num_local * dim for n in sizes]
        recv = [mine * len(tables) * dim for tables in self.tables_per_rank]
        flat = _AllToAll.apply(local.contiguous().view(-1), send, recv, self.group)
        chunks = [c.view(mine, len(t), dim) for c, t in zip(flat.split(recv), self.tables_per_rank)]
        return torch.cat(chunks, dim=1).index_select(1, self.order)
