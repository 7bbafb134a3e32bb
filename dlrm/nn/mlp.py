"""Stack of Linear layers with ReLU, the bottom and top parts of DLRM.

On CUDA with Triton, each ``Linear -> ReLU`` pair goes through the fused layer of
``dlrm.kernels.linear_relu``: bias and ReLU in the GEMM's epilogue forward, one kernel for the
ReLU and bias gradients backward. Elsewhere (a CPU run, float64, tracing and export) the layers
run as ``F.linear`` and an in-place ``relu``. ``use_kernel=True`` also takes the fused layer on
CPU tensors under ``TRITON_INTERPRET=1`` (how the kernel tests check it); by default a CPU run
keeps the plain path, so its numbers do not depend on whether the interpreter is on.
Parameters, their names and their initialisation are the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from dlrm.kernels.linear_relu import linear_relu, supports
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
        use_kernel: bool | None = None,
    ) -> None:
        """``use_kernel``: None fuses on CUDA only; True wherever the kernels run (CPU tensors
        under the interpreter too); False never (the benchmarks' baseline). It is not part of
        the state dict."""
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
        self.use_kernel = use_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == last and not self.relu_last:
                x = layer(x)
            elif self.use_kernel is not False and (self.use_kernel or x.is_cuda) and _fusable(layer, x):
                x = linear_relu(x, layer.weight, layer.bias)
            else:
                # In place is safe: Linear's backward needs its input, not its output.
                x = F.relu(layer(x), inplace=True)
        return x


def _fusable(layer: nn.Linear, x: torch.Tensor) -> bool:
    """Whether ``layer`` and its ReLU may run fused: the kernels take the operands, and nothing
    hooks the layer's call (the fused path reads its parameters without calling it)."""
    return not (layer._forward_hooks or layer._forward_pre_hooks) and supports(x, layer.weight, layer.bias)
