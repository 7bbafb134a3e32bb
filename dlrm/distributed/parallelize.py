"""The one place that turns the single-device DLRM into this process's part of the hybrid-parallel one.

    model, parallel = parallelize(config, [plan.entries(r) for r in range(plan.world_size)], device, collectives)

The model is the same class with two differences: it holds only the embedding tables (or, for
tables split row-wise, the blocks of rows) the plan gives this process (built with the same
per-table initialisation, so a table's weights do not depend on where it lands or how it is
split), and the all-to-all exchange sits between its embeddings and its dense part. The MLPs stay replicated; ``parallel.collectives`` sums their gradients and combines
metrics and checkpoints across processes, and ``parallel.tables`` says which id columns this
process reads for the whole global batch.

It takes the config rather than a built model on purpose: building every table first and then
dropping the others would allocate all of them (16.7 GB at Criteo size) on every process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlrm.distributed.exchange import EmbeddingExchange
from dlrm.engine.collectives import ProcessGroupCollectives
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.nn.table_spec import TableShard, table_of


@dataclass
class HybridParallel:
    """What the rest of a hybrid-parallel run needs: the plan and the process group's collectives."""

    plan: list[list[int | TableShard]]  # per rank: global table indices, or row blocks of row-wise tables
    collectives: ProcessGroupCollectives

    @property
    def rank(self) -> int:
        return self.collectives.rank

    @property
    def world_size(self) -> int:
        return self.collectives.world_size

    @property
    def tables(self) -> list[int]:
        """The global indices of this process's tables (whole, or a block of rows): it looks
        their ids up for every sample of the global batch."""
        return [table_of(t) for t in self.plan[self.rank]]


def parallelize(
    config: DLRMConfig, plan: list[list[int | TableShard]], device: torch.device, collectives: ProcessGroupCollectives,
    exchange_dtype: torch.dtype | None = None,
) -> tuple[DLRM, HybridParallel]:
    """This process's part of the hybrid-parallel model (see the module docstring).
    ``exchange_dtype``: what the all-to-all carries (None: the compute dtype)."""
    if len(plan) != collectives.world_size:
        raise ValueError(f"the plan has {len(plan)} ranks, the process group {collectives.world_size}")
    parallel = HybridParallel([list(tables) for tables in plan], collectives)
    model = DLRM(config, device=device, tables=parallel.plan[parallel.rank])
    model.exchange = EmbeddingExchange(parallel.plan, parallel.rank, collectives.group, exchange_dtype).to(device)
    return model, parallel
