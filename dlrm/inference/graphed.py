"""Inference through CUDA graphs: one graph per input shape, captured on first use and replayed
after, so a forward pass costs one launch. Used by evaluation and the inference benchmark
with ``--cuda_graphs``.

Limits: CUDA only; inputs of a new shape (say, the last, smaller batch of a test split) cost
one capture each, so serve a few fixed batch sizes; the returned logits are a copy, safe to keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlrm.training.precision import Precision


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    numerical: torch.Tensor
    categorical: torch.Tensor
    logits: torch.Tensor


class GraphedInference:
    """``GraphedInference(model, precision)(numerical, categorical) -> logits``, as ``model``."""

    def __init__(self, model: torch.nn.Module, precision: Precision, warmup: int = 2,
                 pool: object | None = None) -> None:
        device = next(model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}: drop --cuda_graphs")
        self.model, self.precision, self.warmup = model, precision, warmup
        self.pool = torch.cuda.graph_pool_handle() if pool is None else pool  # shared by all shapes
        self.captured: dict[tuple, _Captured] = {}

    @torch.no_grad()
    def __call__(self, numerical: torch.Tensor, categorical: torch.Tensor) -> torch.Tensor:
        key = (tuple(numerical.shape), numerical.dtype, tuple(categorical.shape), categorical.dtype)
        entry = self.captured.get(key)
        if entry is None:
            entry = self.captured[key] = self._capture(numerical, categorical)
        entry.numerical.copy_(numerical)
        entry.categorical.copy_(categorical)
        entry.graph.replay()
        return entry.logits.clone()

    def _forward(self, numerical: torch.Tensor, categorical: torch.Tensor, cache: bool) -> torch.Tensor:
        with self.precision.autocast(cache_enabled=cache):
            return self.model(numerical, categorical)

    def _capture(self, numerical: torch.Tensor, categorical: torch.Tensor) -> _Captured:
        static_numerical, static_categorical = numerical.clone(), categorical.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._forward(static_numerical, static_categorical, cache=False)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self._forward(static_numerical, static_categorical, cache=False)
        return _Captured(graph, static_numerical, static_categorical, logits)
