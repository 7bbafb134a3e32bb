"""How the autoencoder is split across processes, and the four exchanges between the parts.

The wide layers are the item layers: the input table (one row per item, looked up as a bag)
and the output layer (one row per item, scored for every user). For catalogues in the millions
they do not fit one device, and they hold almost all the work, so each process owns one
contiguous item range of both, as DSSTNE's "model parallel for each layer" did. The hidden
layers are narrow (hundreds of units): they run data-parallel, each process on its own share
of the batch's users.

One global batch, on every process:

1. every process reads the whole batch (histories are small: ids only) and looks up the ids
   that fall in its item range, a partial sum ``[B, H1]`` over its rows;
2. ``scatter_sum``: one all-to-all hands every process its own users' rows of every partial sum,
   which it adds up (a reduce-scatter; gloo has no reduce-scatter, every backend has all-to-all);
3. the hidden stack runs on the process's users ``[B_r, H]``;
4. ``gather``: one all-to-all gives every process all users' last hidden activations ``[B, H]``
   (an all-gather), and it scores its item slice ``[B, n_r]``; the loss is the sum over slices.

The backward of each exchange is the other one. The hidden weights are replicated, so their
gradients are summed across processes once per step (``sync_gradients``); the item rows are
each on one process and need nothing. On one process every exchange is the identity.

Sums, gradient sync and same-shape gathers are the engine's ``Collectives`` (the process group,
or its single-process null object); only the two user-split exchanges above are this module's.
Items split over processes by ``dlrm.engine.partition.split_bounds``, users by the batch split.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dlrm.engine.all_to_all import all_to_all
from dlrm.engine.collectives import Collectives, ProcessGroupCollectives
from dlrm.engine.partition import split_bounds, split_sizes


@dataclass(frozen=True)
class ItemParallel:
    """This process's place in an item-parallel run: its rank, the process count and the group
    (None on one process, or for the default group)."""

    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup | None = None) -> "ItemParallel":
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def item_range(self, n_items: int) -> tuple[int, int]:
        bounds = split_bounds(n_items, self.world_size)
        return bounds[self.rank], bounds[self.rank + 1]

    def user_sizes(self, batch: int) -> list[int]:
        """Users per process in a batch of ``batch``: contiguous, the first ones get one more."""
        return split_sizes(batch, self.world_size)

    def user_range(self, batch: int) -> tuple[int, int]:
        sizes = self.user_sizes(batch)
        start = sum(sizes[: self.rank])
        return start, start + sizes[self.rank]

    def collectives(self, device: torch.device | str = "cpu") -> Collectives:
        """The training engine's ``Collectives`` over this group (checkpoints meet through them)."""
        return ProcessGroupCollectives(torch.device(device), self.group) if self.distributed else Collectives()

    def scatter_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` partial sums, one per process -> this process's users' rows of their sum,
        ``[B_r, H]``, added in rank order (the same order on every process)."""
        if not self.distributed:
            return partial
        sizes = self.user_sizes(partial.shape[0])
        width = partial.shape[1]
        mine = sizes[self.rank]
        flat = all_to_all(partial.contiguous().view(-1), [n * width for n in sizes], [mine * width] * self.world_size,
                          self.group)
        return flat.view(self.world_size, mine, width).sum(0)

    def gather(self, local: torch.Tensor, batch: int) -> torch.Tensor:
        """This process's users' rows ``[B_r, H]`` -> all users' rows ``[B, H]`` in user order;
        the gradient of every process's copy is summed back onto the owner's rows."""
        if not self.distributed:
            return local
        sizes = self.user_sizes(batch)
        width = local.shape[1]
        flat = local.contiguous().view(-1)
        out = all_to_all(torch.cat([flat] * self.world_size), [flat.numel()] * self.world_size,
                         [n * width for n in sizes], self.group)
        return out.view(batch, width)

    def all_gather_same(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` (same shape everywhere) stacked in rank order, ``[W, ...]``,
        differentiable (for terms that need the whole catalogue or the whole batch: softmax's
        normaliser, the sparseness penalty's mean activation)."""
        return self.collectives(tensor.device).all_gather_same(tensor)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """A copy summed over processes (no gradient; for logged figures)."""
        return self.collectives(tensor.device).sum(tensor.detach().clone())

    def sync_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sums the replicated weights' gradients over processes in one all-reduce (each process
        computed its users' share of the global-batch gradient)."""
        params = list(params)
        if params:
            self.collectives(params[0].device).sync_parameter_gradients(params)
