"""Random streams keyed by what they initialise, so initial weights do not depend on the layout.

A sharded weight (an embedding table, a wide layer's items) draws each block of
``INIT_BLOCK_ROWS`` rows from its own generator, keyed by the model seed, the weight's global
key and the block. A process that builds only its own tables, or only a block of one table's
rows, therefore draws the same values as one process building the whole model: N processes
start where one does, and a checkpoint moves between layouts.
"""

from __future__ import annotations

import torch

INIT_BLOCK_ROWS = 2**18  # rows drawn from one generator: a shard's init costs at most 2 such blocks extra


def block_generator(seed: int, key: int, device: torch.device, block: int = 0) -> torch.Generator:
    """The generator of block ``block`` (of ``INIT_BLOCK_ROWS`` rows) of the weight ``key``: a
    function of the model seed, the key and the block only."""
    generator = torch.Generator(device=device)
    mixed = seed * 1_000_003 + key
    if block:
        mixed = mixed * 1_000_033 + block
    generator.manual_seed(mixed % (2**63 - 1))
    return generator
