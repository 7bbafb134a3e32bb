"""Stack of Linear layers with ReLU, the bottom and top parts of DLRM."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from dlrm.nn.init import init_linear_


class MLP(nn.Module):
    """``Linear -> ReLU`` repeated; the last ReLU is dropped when ``relu_last`` is False.

    The bottom MLP keeps it (its output is a feature vector); the top MLP drops it (its output
    is a logit).
    """

    def __init__(
        self,
        in_features: int,
        sizes: Sequence[int],
        relu_last: bool,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if in_features < 1 or not sizes or any(s < 1 for s in sizes):
            raise ValueError(f"MLP needs positive in_features and sizes, got {in_features} and {list(sizes)}")
        dims = [in_features, *sizes]
        # skip_init: the default init would be thrown away, and would consume random numbers.
        device = torch.get_default_device() if device is None else device
        self.layers = nn.ModuleList(
            skip_init(nn.Linear, fan_in, fan_out, device=device) for fan_in, fan_out in zip(dims[:-1], dims[1:])
        )
        for layer in self.layers:
            init_linear_(layer)
        self.in_features = in_features
        self.out_features = dims[-1]
        self.relu_last = relu_last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < last or self.relu_last:
                # In place is safe: Linear's backward needs its input, not its output.
                x = F.relu(x, inplace=True)
        return x
