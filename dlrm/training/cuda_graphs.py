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

Multi-hot batches (``Bags``) hold a different number of ids every batch. Their ids are copied
into a buffer of a static length, ``padded_length(nnz)``: the next of four steps an octave
(``m * 2**k``, ``m`` in 4..7, so at most 25% padding), or the most a batch can hold when every
bag has a fixed size (``fixed_bag_limit``), whichever is less. The ``offsets`` keep their shape
(one per bag plus one) and their values, so the padding lies past the last bag
(``Bags.padded_to``): the lookup gives it no row and weight 0, and the step is exactly the
unpadded one (``dlrm.kernels.embedding_bag``). Each padded length is a bucket with a graph of
its own (its own warm-up steps first); all graphs share one memory pool, and a batch whose
bucket would pass ``max_graphs`` runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch

from dlrm.data.batch import Bags, Batch
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


# Padded lengths of multi-hot ids: m * 2**k with m in MIN_STEP .. 2 * MIN_STEP - 1, i.e. four
# buckets an octave (at most 25% padding, 1/8 on average), and never fewer than this many ids.
MIN_STEP = 4
MIN_PADDED_LENGTH = 64


def padded_length(nnz: int, limit: int | None = None) -> int:
    """The static length ``nnz`` multi-hot ids are padded to for a captured step: the smallest
    ``m * 2**k >= nnz`` with ``m`` in 4..7 (at least ``MIN_PADDED_LENGTH``), or ``limit`` (the
    most ids a batch can hold, ``fixed_bag_limit``) when that is less and ``nnz`` fits in it."""
    length = MIN_PADDED_LENGTH
    if nnz > length:
        shift = nnz.bit_length() - MIN_STEP.bit_length()  # nnz / 2**shift in [MIN_STEP, 2 * MIN_STEP)
        length = -(-nnz >> shift) << shift
    if limit is not None and nnz <= limit:
        length = min(length, limit)
    return length


def fixed_bag_limit(bag_sizes: Sequence[int | str | None], batch_size: int) -> int | None:
    """The most ids a batch of ``batch_size`` samples holds when every feature has bags of at most
    a fixed size (``FeatureSpec.bag_size``: an int ``L``, or None for a one-hot feature, one id),
    else None (a ``"variable"`` feature has no bound)."""
    if any(size is not None and not isinstance(size, int) for size in bag_sizes):
        return None
    return batch_size * sum(1 if size is None else size for size in bag_sizes)


def batch_bag_limit(spec, batch_size: int) -> int | None:
    """``fixed_bag_limit`` of a ``FeatureSpec``'s categorical features: None for one-hot data
    (nothing to pad) and for data with a variable-length bag (no bound)."""
    if not spec.multi_hot_features:
        return None
    return fixed_bag_limit([spec.bag_size(j) for j in range(spec.num_categorical)], batch_size)


def padded_batch(batch: Batch, length: int | None = None) -> Batch:
    """A copy of ``batch`` in buffers of its own, multi-hot ids padded to ``length`` values
    (``Bags.padded_to``; one-hot ids ignore it): what ``GraphedTrainStep`` captures and
    ``copy_batch_`` refills."""
    c = batch.categorical
    if isinstance(c, Bags):
        c = Bags(c.padded_to(c.values.shape[0] if length is None else length).values, c.offsets.clone(),
                 c.num_features, padded=True)
    else:
        c = c.clone()
    return Batch(batch.numerical.clone(), c, batch.label.clone())


def copy_batch_(static: Batch, batch: Batch) -> None:
    """``batch`` into the buffers of ``static`` (``padded_batch``), in place: multi-hot ids fill
    the front of the padded values, the rest is zeroed (it lies in no bag, whatever it holds)."""
    static.numerical.copy_(batch.numerical)
    static.label.copy_(batch.label)
    if isinstance(batch.categorical, Bags):
        values, nnz = static.categorical.values, batch.categorical.values.shape[0]
        values[:nnz].copy_(batch.categorical.values)
        values[nnz:].zero_()
        static.categorical.offsets.copy_(batch.categorical.offsets)
    else:
        static.categorical.copy_(batch.categorical)


@dataclass
class _TrainGraph:
    """One bucket's step: the static batch each call is copied into, the steps run so far, and
    once captured, the graph and the loss it writes."""

    batch: Batch
    calls: int = 0
    graph: torch.cuda.CUDAGraph | None = None
    loss: torch.Tensor | None = None


class GraphedTrainStep:
    """``GraphedTrainStep(step)(batch) -> loss``, where ``step(batch, capturing)`` is a sync-free
    training step (``fused_train_step`` bound to its model). Device-side inputs the step reads,
    such as the learning rate, must be updated in place before each call, outside the graph.

    One graph per bucket: one-hot batches have one, multi-hot ones one per padded length
    (``padded_length``, capped by ``max_bag_values``, e.g. ``fixed_bag_limit``). Only batches
    of the size of the first one captured are graphed; others (a partial last batch), and new
    buckets past ``max_graphs``, run the step eagerly as they are."""

    def __init__(self, step: Callable[[Batch, bool], torch.Tensor], warmup_steps: int = 3,
                 max_bag_values: int | None = None, max_graphs: int = 8) -> None:
        self.step = step
        self.warmup_steps = warmup_steps
        self.max_bag_values = max_bag_values
        self.max_graphs = max_graphs
        self.graphs: dict[tuple, _TrainGraph] = {}
        self.pool: object | None = None  # one memory pool for every bucket's graph
        self.rows: int | None = None  # the samples of a graphed batch, set by the first capture
        self.replays = 0

    def bucket(self, batch: Batch) -> tuple:
        """The key of ``batch``'s graph: its shapes and dtypes, multi-hot ids by padded length."""
        c = batch.categorical
        key = (tuple(batch.numerical.shape), batch.numerical.dtype, tuple(batch.label.shape), batch.label.dtype)
        if isinstance(c, Bags):
            length = padded_length(c.values.shape[0], self.max_bag_values)
            return key + (c.num_features, tuple(c.offsets.shape), c.offsets.dtype, c.values.dtype, length)
        return key + (tuple(c.shape), c.dtype)

    def __call__(self, batch: Batch) -> torch.Tensor:
        if self.rows is not None and len(batch) != self.rows:
            return self.step(batch, False)
        key = self.bucket(batch)
        entry = self.graphs.get(key)
        if entry is None:
            if len(self.graphs) >= self.max_graphs:
                return self.step(batch, False)
            length = key[-1] if isinstance(batch.categorical, Bags) else None
            entry = self.graphs[key] = _TrainGraph(padded_batch(batch, length))
        else:
            copy_batch_(entry.batch, batch)
        entry.calls += 1
        if entry.calls <= self.warmup_steps:  # eagerly, on the static batch, as a capture needs
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self.step(entry.batch, False)
            torch.cuda.current_stream().wait_stream(side)
            return loss
        if entry.graph is None:
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            entry.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(entry.graph, pool=self.pool, capture_error_mode=CAPTURE_MODE):
                entry.loss = self.step(entry.batch, True)  # records only: replayed below
            self.rows = len(batch)
        entry.graph.replay()
        self.replays += 1
        return entry.loss.clone()


# ---------------------------------------------------------------- inference
# Inference through CUDA graphs: one graph per input shape, captured on first use and replayed
# after, so a forward pass costs one launch. Used by evaluation and the inference benchmark
# with ``--cuda_graphs``.
# 
# Limits: CUDA only; inputs of a new shape (say, the last, smaller batch of a test split) cost
# one capture each, so serve a few fixed batch sizes; the returned logits are a copy, safe to keep.
# Multi-hot ids (``Bags``) take the eager forward: their number changes with every batch.


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
    def __call__(self, numerical: torch.Tensor, categorical: torch.Tensor | Bags) -> torch.Tensor:
        if isinstance(categorical, Bags):
            return self._forward(numerical, categorical, cache=True)
        key = (tuple(numerical.shape), numerical.dtype, tuple(categorical.shape), categorical.dtype)
        entry = self.captured.get(key)
        if entry is None:
            entry = self.captured[key] = self._capture(numerical, categorical)
        entry.numerical.copy_(numerical)
        entry.categorical.copy_(categorical)
        entry.graph.replay()
        return entry.logits.clone()

    def _forward(self, numerical: torch.Tensor, categorical: torch.Tensor | Bags, cache: bool) -> torch.Tensor:
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
