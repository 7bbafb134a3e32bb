"""What the engine needs from a model, declared once: products implement it, the engine calls it.

The engine trains a model whose weights are of two kinds. Replicated weights (DLRM's MLPs, the
autoencoder's hidden layers) are whole on every process, and their gradients are summed across
processes after each backward (``Collectives.sync_gradients``). Sharded weights (embedding
tables, the autoencoder's wide item layers) live on one process each, or in row blocks split by
``dlrm.engine.partition``; the product's exchange moves activations to them, and its checkpoint
format writes each piece from the process that holds it (``dlrm.engine.checkpoint_store``).

The engine never calls a product's method by name beyond this protocol, so a new model only has
to provide these two methods to train data-parallel through ``run_loop`` and be checkpointed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ParallelModel(Protocol):
    """A model the engine can train over several processes and checkpoint."""

    def replicated_parameters(self) -> list[torch.nn.Parameter]:
        """The weights every process holds whole; the engine sums their gradients."""
        ...

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        """This process's weights (replicated and its own shards): what a checkpoint saves."""
        ...
