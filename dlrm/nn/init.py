"""Weight initialisers matching NVIDIA's DLRM, so training curves are comparable to theirs.

Every initialiser draws from torch's global generator in a fixed order, which makes a model
built after ``torch.manual_seed(s)`` deterministic.
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


def init_embedding_table_(weight: torch.Tensor) -> None:
    """U(-sqrt(1/rows), sqrt(1/rows)) for one table ``[rows, dim]`` (may be a view of a larger one).

    The bound depends on the table's own row count, so a joint table is initialised slice by
    slice rather than as a whole.
    """
    bound = math.sqrt(1.0 / weight.shape[0])
    nn.init.uniform_(weight, -bound, bound)
