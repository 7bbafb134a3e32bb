"""Weight initialisers matching NVIDIA's DLRM, so training curves are comparable to theirs.

Linear layers draw from torch's global generator in a fixed order; each embedding table draws
from its own generator seeded from its global table index, so a table's initial weights do not
depend on which other tables a process builds (hybrid parallelism builds only its own).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def init_linear_(layer: nn.Linear) -> None:
    """Weights N(0, sqrt(2 / (fan_in + fan_out))), biases N(0, sqrt(1 / fan_out))."""
    fan_out, fan_in = layer.weight.shape
    nn.init.normal_(layer.weight, 0.0, math.sqrt(2.0 / (fan_in + fan_out)))
    if layer.bias is not None:
        nn.init.normal_(layer.bias, 0.0, math.sqrt(1.0 / fan_out))


def init_embedding_table_(weight: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """U(-sqrt(1/rows), sqrt(1/rows)) for one table ``[rows, dim]`` (may be a view of a larger one).

    The bound depends on the table's own row count, so a joint table is initialised slice by
    slice rather than as a whole.
    """
    bound = math.sqrt(1.0 / weight.shape[0])
    with torch.no_grad():
        weight.uniform_(-bound, bound, generator=generator)


def table_generator(seed: int, table_index: int, device: torch.device) -> torch.Generator:
    """The generator of one table: a function of the model seed and the global table index."""
    generator = torch.Generator(device=device)
    generator.manual_seed((seed * 1_000_003 + table_index) % (2**63 - 1))
    return generator
