"""The wide model: one weight per id, split by rows across processes, and a replicated bias."""

from __future__ import annotations

import torch
from torch import nn

from dlrm.engine.all_to_all import all_to_all
from dlrm.engine.collectives import Collectives
from dlrm.engine.partition import split_bounds, split_sizes
from dlrm.engine.random_streams import INIT_BLOCK_ROWS, block_generator

WEIGHT_KEY = 0  # the weight's key for its random streams


class WideModel(nn.Module):
    """``logit = bias + sum_f weight[id_f]``. Process r holds the rows ``split_bounds(num_ids,
    world)[r:r + 2]`` of ``weight``; every process holds ``bias`` (the engine's model contract,
    ``dlrm.engine.model_contract``: ``replicated_parameters`` and ``state_dict``).

    ``forward`` takes the ids of the whole global batch and returns the logits of this process's
    samples: each process sums the weights of its rows for every sample, and one all-to-all
    hands each sample's partial sums to the process that trains on it (its gradient goes back
    the same way)."""

    def __init__(self, num_ids: int, collectives: Collectives = Collectives(), seed: int = 0,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.num_ids, self.seed, self.collectives = num_ids, seed, collectives
        bounds = split_bounds(num_ids, collectives.world_size)
        self.rows = (bounds[collectives.rank], bounds[collectives.rank + 1])
        self.weight = nn.Parameter(self._initial_rows().to(device))
        self.bias = nn.Parameter(torch.zeros((), device=device))

    def _initial_rows(self) -> torch.Tensor:
        """N(0, 0.01²) weights, drawn block by block of ``INIT_BLOCK_ROWS`` rows from generators
        keyed by the block (``dlrm.engine.random_streams``): the same values for a row whichever
        process count builds it, so N processes start where one does."""
        start, stop = self.rows
        parts = []
        for block in range(start // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)):
            lo, hi = block * INIT_BLOCK_ROWS, min((block + 1) * INIT_BLOCK_ROWS, self.num_ids)
            drawn = torch.randn(hi - lo, generator=block_generator(self.seed, WEIGHT_KEY, torch.device("cpu"), block))
            parts.append(drawn[max(start, lo) - lo:min(stop, hi) - lo] * 0.01)
        return torch.cat(parts) if parts else torch.zeros(0)

    def replicated_parameters(self) -> list[nn.Parameter]:
        return [self.bias]

    def sample_range(self, global_batch: int) -> tuple[int, int]:
        """This process's samples of a global batch (the engine's one row split)."""
        bounds = split_bounds(global_batch, self.collectives.world_size)
        rank = self.collectives.rank
        return bounds[rank], bounds[rank + 1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        start, stop = self.rows
        mine = (ids >= start) & (ids < stop)
        partial = (self.weight[torch.where(mine, ids - start, 0)] * mine).sum(1)  # every sample, my rows only
        world = self.collectives.world_size
        if world > 1:
            sizes = split_sizes(len(ids), world)
            own = sizes[self.collectives.rank]
            partial = all_to_all(partial, sizes, [own] * world, self.collectives.process_group).view(world, own).sum(0)
        return partial + self.bias
