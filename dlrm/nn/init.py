"""Weight initialisers matching NVIDIA's DLRM, so training curves are comparable to theirs.

Linear layers draw from torch's global generator in a fixed order; each embedding table draws
from its own generators, seeded from its global table index and drawn block by block of
``INIT_BLOCK_ROWS`` rows, so a table's initial weights depend neither on which other tables a
process builds (hybrid parallelism builds only its own) nor on how its rows are split across
processes (row-wise sharding builds one block of rows, with the same values as the whole table).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from dlrm.engine.random_streams import INIT_BLOCK_ROWS, block_generator


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


def init_table_rows_(weight: torch.Tensor, seed: int, table_index: int, table_rows: int, first_row: int = 0,
                     draw_dtype: torch.dtype | None = None, draw_device: torch.device | None = None) -> None:
    """Rows ``[first_row, first_row + len(weight))`` of table ``table_index``'s initial weights,
    U(-sqrt(1/table_rows), sqrt(1/table_rows)) as ``init_embedding_table_`` draws for the whole
    table. Each block of ``INIT_BLOCK_ROWS`` rows comes from its own generator, so the values of a
    row do not depend on which range is built. ``draw_dtype`` (default: the weight's) is the dtype
    of the draws, rounded to the weight's dtype when they differ (fp16/bf16 tables draw fp32);
    ``draw_device`` (default: the weight's) is where they are drawn, since a CPU and a CUDA
    generator with the same seed draw different numbers."""
    rows, dim = weight.shape
    if first_row < 0 or first_row + rows > table_rows:
        raise ValueError(f"rows [{first_row}, {first_row + rows}) are not inside table {table_index} of "
                         f"{table_rows} rows")
    draw_dtype = weight.dtype if draw_dtype is None else draw_dtype
    draw_device = weight.device if draw_device is None else draw_device
    bound = math.sqrt(1.0 / table_rows)
    stop = first_row + rows
    with torch.no_grad():
        for block in range(first_row // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)):
            lo, hi = block * INIT_BLOCK_ROWS, min((block + 1) * INIT_BLOCK_ROWS, table_rows)
            start, end = max(lo, first_row), min(hi, stop)
            generator = block_generator(seed, table_index, draw_device, block)
            target = weight[start - first_row:end - first_row]
            if (start, end) == (lo, hi) and draw_dtype == weight.dtype and draw_device == weight.device:
                target.uniform_(-bound, bound, generator=generator)
                continue
            drawn = torch.empty(hi - lo, dim, dtype=draw_dtype, device=draw_device)
            drawn.uniform_(-bound, bound, generator=generator)
            target.copy_(drawn[start - lo:end - lo])
