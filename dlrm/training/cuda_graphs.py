"""``--cuda_graphs`` for training: the whole step (forward, backward, every update) recorded
once as a CUDA graph and replayed for every batch, so a step costs one launch instead of
hundreds of kernel launches and Python dispatches.

What a graph needs, and so the limits of this mode:
- static shapes and addresses: batches are copied into buffers owned here; a batch of another
  size (the last, partial batch of an epoch) runs the same step eagerly;
- no host synchronisation inside the step: ``fused_train_step`` keeps the learning rate, the
  fp16 overflow check and the loss scale on the device;
- no sparse gradients (their size depends on the batch): ``embedding_type='joint_fused'`` only;
- one process: collectives inside a captured graph need NCCL capture support and are not
  wired up yet.
The first ``warmup_steps`` steps run eagerly on a side stream, as PyTorch requires before a
capture (they are real steps; only their speed differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from dlrm.data.batch import Batch
from dlrm.model.precision import Precision

# The loader's background thread pins host memory and copies on its own stream while a step is
# captured. In torch's default "global" mode such a call from any thread invalidates the
# capture (seen on an H100: capture failed or not from run to run, as the thread's timing
# fell); "thread_local" checks only the capturing thread, which is all the graph depends on.
CAPTURE_MODE = "thread_local"


def check_cuda_graphs_supported(model: torch.nn.Module, device: torch.device, world_size: int,
                                training: bool = True) -> None:
    """Raise ValueError naming what stands in the way of ``--cuda_graphs`` and the fix (for
    inference only the device matters)."""
    if device.type != "cuda":
        raise ValueError(f"`cuda_graphs` needs a CUDA device, the run uses {device}: set `cuda_graphs=False`")
    if not training:
        return
    if not model.fused_embeddings():
        raise ValueError(
            f"`cuda_graphs` needs `embedding_type=joint_fused` (got {model.config.embedding_type!r}): sparse "
            "gradients change size with every batch, which a captured graph cannot do"
        )
    if getattr(model, "host_embeddings", None) is not None:
        raise ValueError("`cuda_graphs` cannot capture lookups in host memory (`host_tables`): keep every table on "
                         "the GPU (`host_tables=none`, with `max_table_size` or `embedding_dtype` to make them fit) "
                         "or set `cuda_graphs=False`")
    if world_size != 1:
        raise ValueError(f"`cuda_graphs` supports one process only, this run has {world_size}: set `cuda_graphs=False`")


class GraphedTrainStep:
    """``GraphedTrainStep(step)(batch) -> loss``, where ``step(batch, capturing)`` is a sync-free
    training step (``fused_train_step`` bound to its model). Device-side inputs the step reads,
    such as the learning rate, must be updated in place before each call, outside the graph."""

    def __init__(self, step: Callable[[Batch, bool], torch.Tensor], warmup_steps: int = 3) -> None:
        self.step = step
        self.warmup_steps = warmup_steps
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_batch: Batch | None = None
        self.static_loss: torch.Tensor | None = None
        self.calls = 0

    def __call__(self, batch: Batch) -> torch.Tensor:
        self.calls += 1
        if self.calls <= self.warmup_steps:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self.step(batch, False)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if self.graph is None:
            self.static_batch = Batch(batch.numerical.clone(), batch.categorical.clone(), batch.label.clone())
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode=CAPTURE_MODE):  # records only: replayed below
                self.static_loss = self.step(self.static_batch, True)
        elif not self._fits(batch):
            return self.step(batch, False)
        else:
            for name in ("numerical", "categorical", "label"):
                getattr(self.static_batch, name).copy_(getattr(batch, name))
        self.graph.replay()
        return self.static_loss.clone()

    def _fits(self, batch: Batch) -> bool:
        return all(
            getattr(batch, name).shape == getattr(self.static_batch, name).shape
            and getattr(batch, name).dtype == getattr(self.static_batch, name).dtype
            for name in ("numerical", "categorical", "label")
        )


# ---------------------------------------------------------------- inference
# Inference through CUDA graphs: one graph per input shape, captured on first use and replayed
# after, so a forward pass costs one launch. Used by evaluation and the inference benchmark
# with ``--cuda_graphs``.
# 
# Limits: CUDA only; inputs of a new shape (say, the last, smaller batch of a test split) cost
# one capture each, so serve a few fixed batch sizes; the returned logits are a copy, safe to keep.


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
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {device}: set `cuda_graphs=False`")
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
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode=CAPTURE_MODE):
            logits = self._forward(static_numerical, static_categorical, cache=False)
        return _Captured(graph, static_numerical, static_categorical, logits)
