"""The all-to-all between model-parallel embeddings and the data-parallel dense part.

Each process looks up its own tables for the whole global batch, ``[B, T_r, D]``; one
all-to-all hands every process the rows of its own samples from every table, which it puts
back in global table order, ``[B_r, F, D]``. The backward pass is the reverse all-to-all.

The exchange carries the compute dtype: under autocast the embeddings are cast to the autocast
dtype (bf16/fp16) before they are sent, so both directions move half the bytes of fp32, as
NVIDIA's DLRM does; the dense part would cast them on arrival anyway. ``dtype`` fixes it instead
(say fp32 under autocast, to exchange exactly).

A table split row-wise (``TableShard`` blocks on several processes) is looked up by every process
that holds a block, for the whole global batch, each contributing the partial sum of the ids in
its block (zero for the others); the same all-to-all carries the partial sums, and the receiver
adds them up. No second exchange, at the price of one ``[B, D]`` slice per block instead of one
per table.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from dlrm.data.rank_source import local_batch_sizes
from dlrm.engine.all_to_all import all_to_all
from dlrm.nn.table_spec import TableShard, table_of


class EmbeddingExchange(nn.Module):
    """``[B, T_rank, D]`` (this rank's tables, global batch) -> ``[B_rank, F, D]`` (own samples,
    every table in global order). Holds no parameters, so checkpoints do not see it."""

    def __init__(self, tables_per_rank: Sequence[Sequence[int | TableShard]], rank: int,
                 group: dist.ProcessGroup | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.dtype = dtype  # None: the autocast dtype under autocast, else the embeddings' own
        # Per rank, what it looks up: global table indices, or row blocks of row-wise tables.
        self.tables_per_rank = [list(t) for t in tables_per_rank]
        self.rank = rank
        self.group = group
        rank_major = [table_of(t) for tables in self.tables_per_rank for t in tables]
        self.num_features = len(set(rank_major))
        if sorted(set(rank_major)) != list(range(self.num_features)):
            raise ValueError(f"the ranks hold tables {sorted(set(rank_major))}: every table from 0 to the last must "
                             "be held by some rank")
        # Row-wise tables come from several ranks, as partial sums: added up in rank order.
        self.partial_sums = len(rank_major) != self.num_features
        if self.partial_sums:
            order = rank_major  # the feature each received slice adds to
        else:
            position = {table: i for i, table in enumerate(rank_major)}
            order = [position[t] for t in range(len(rank_major))]  # the received slice of each feature
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
        flat = all_to_all(local.contiguous().view(-1), send, recv, self.group)
        chunks = torch.cat([c.view(mine, len(t), dim) for c, t in zip(flat.split(recv), self.tables_per_rank)], dim=1)
        if self.partial_sums:  # its backward hands every block's rank the gradient of its feature
            return chunks.new_zeros(mine, self.num_features, dim).index_add(1, self.order, chunks)
        return chunks.index_select(1, self.order)
