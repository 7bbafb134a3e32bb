"""What the training loop needs from the other processes, behind one small interface.

``Collectives`` is the single-process version (every operation is the identity);
``ProcessGroupCollectives`` combines numbers across a torch.distributed process group and sums
the replicated weights' gradients in one all-reduce after the backward (the default);
``OverlappedCollectives`` sums them in buckets while the backward runs, as DDP does.
``process_group_collectives(device, group, gradient_sync)`` picks one by name.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from typing import Iterator

import torch
import torch.distributed as dist

from dlrm.engine.all_to_all import all_to_all
from dlrm.engine.gradient_buckets import GradientBuckets
from dlrm.engine.model_contract import ParallelModel

GRADIENT_SYNC = ("after_backward", "overlap")
DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


class Collectives:
    """One process: nothing to combine."""

    rank = 0
    world_size = 1
    process_group: dist.ProcessGroup | None = None  # None: nothing to agree with (see Precision.grad_scaler)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenates 1-D tensors of any lengths from all processes, in rank order."""
        return tensor

    def all_gather_same(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every process's ``tensor`` (the same shape everywhere) stacked in rank order,
        ``[world_size, ...]``; differentiable: each copy's gradient goes back to its owner."""
        return tensor.unsqueeze(0)

    def any(self, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        """Waits for every process (checkpoint writers meet here)."""

    def gather_objects(self, obj: object) -> list[object]:
        """Every process's ``obj`` (picklable), in rank order, on every process."""
        return [obj]

    def sync_gradients(self, model: ParallelModel) -> None:
        """Makes every process hold the gradient of the global-batch loss for replicated weights."""

    def sync_parameter_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        """``sync_gradients`` for an explicit list of replicated parameters (those without a
        gradient are skipped, on every process alike)."""


class ProcessGroupCollectives(Collectives):
    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None):
        self.device = device
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.process_group = group if group is not None else dist.group.WORLD

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        dist.all_reduce(tensor, group=self.group)
        return tensor

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        length = torch.tensor([tensor.numel()], device=tensor.device)
        lengths = [torch.empty_like(length) for _ in range(self.world_size)]
        dist.all_gather(lengths, length, group=self.group)
        lengths = [int(n) for n in lengths]
        padded = tensor.new_zeros(max(lengths))
        padded[: tensor.numel()] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p[:n] for p, n in zip(parts, lengths)])

    def all_gather_same(self, tensor: torch.Tensor) -> torch.Tensor:
        # An all-to-all sending every process the same copy: all_gather has no autograd.
        flat = tensor.contiguous().view(-1)
        n = flat.numel()
        out = all_to_all(torch.cat([flat] * self.world_size), [n] * self.world_size, [n] * self.world_size,
                         self.group)
        return out.view(self.world_size, *tensor.shape)

    def any(self, flag: bool) -> bool:
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def gather_objects(self, obj: object) -> list[object]:
        parts: list[object] = [None] * self.world_size
        dist.all_gather_object(parts, obj, group=self.group)
        return parts

    def sync_gradients(self, model: ParallelModel) -> None:
        """Sums the replicated weights' gradients in one all-reduce (the loss is already divided
        by the global batch, so the sum is the global-batch gradient)."""
        self.sync_parameter_gradients(model.replicated_parameters())

    def sync_parameter_gradients(self, params: Iterable[torch.nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()


class OverlappedCollectives(ProcessGroupCollectives):
    """``ProcessGroupCollectives`` whose ``sync_gradients`` overlaps the backward: hooks on the
    dense parameters all-reduce their gradients in buckets of at most ``bucket_bytes`` as soon as
    a bucket's gradients are ready (``dlrm.engine.gradient_buckets``), and
    ``sync_gradients(model)``, still the one call after the backward, only starts what is left,
    waits and copies the sums back. The result is the same sum as the after-backward one.

    Why: on GPUs NCCL runs beside the backward, so most of the gradient sync hides behind it. On
    the 2-core CPU machine it gained nothing (the communication shares the two cores with the
    backward; docs/distributed.md, benchmarks/gradient_sync.py), so it is not the default.

    The hooks go on at the first ``sync_gradients(model)`` (that step syncs after its backward;
    every later one overlaps), or earlier with ``attach(model)``. The contract is DDP's: every
    process runs every backward and then ``sync_gradients``; a backward not followed by it has
    its sums dropped when the next backward starts; a backward that only some processes run goes
    inside ``no_sync(model)``. The gradient all-reduces use a process group of their own, built
    here (so every process of the default group must construct this object, at the same point),
    because the backward also runs the embedding exchange's all-to-all on ``group``.
    Not for CUDA graph capture (one process only anyway).
    """

    def __init__(self, device: torch.device, group: dist.ProcessGroup | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        super().__init__(device, group)
        if bucket_bytes <= 0:
            raise ValueError(f"`bucket_bytes` must be positive, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        ranks = None if group is None else dist.get_process_group_ranks(group)
        self.gradient_group = dist.new_group(ranks=ranks, backend=dist.get_backend(self.process_group))
        self._buckets: weakref.WeakKeyDictionary[ParallelModel, GradientBuckets] = weakref.WeakKeyDictionary()

    def attach(self, model: ParallelModel) -> GradientBuckets:
        """Registers the hooks on ``model.replicated_parameters()`` (again if they changed since)."""
        params = model.replicated_parameters()
        buckets = self._buckets.get(model)
        if buckets is not None and buckets.matches(params):
            return buckets
        if buckets is not None:
            buckets.remove()
        buckets = self._buckets[model] = GradientBuckets(params, self.bucket_bytes, self.gradient_group)
        return buckets

    def detach(self, model: ParallelModel) -> None:
        """Removes the hooks (dropping any sums started); the next ``sync_gradients`` re-attaches."""
        buckets = self._buckets.pop(model, None)
        if buckets is not None:
            buckets.remove()

    @contextlib.contextmanager
    def no_sync(self, model: ParallelModel) -> Iterator[None]:
        """Backwards inside start no all-reduce; their gradients are summed, as accumulated in
        ``p.grad``, by the next ``sync_gradients``."""
        with self.attach(model).paused():
            yield

    def sync_gradients(self, model: ParallelModel) -> None:
        """Finishes the bucketed sum of the replicated weights' gradients that the backward began."""
        self.attach(model).synchronize()


def process_group_collectives(device: torch.device, group: dist.ProcessGroup | None = None,
                              gradient_sync: str = "after_backward",
                              bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> ProcessGroupCollectives:
    """``gradient_sync``: ``after_backward`` (one all-reduce once the backward is done) or
    ``overlap`` (buckets of ``bucket_bytes`` all-reduced during the backward)."""
    if gradient_sync == "after_backward":
        return ProcessGroupCollectives(device, group)
    if gradient_sync == "overlap":
        return OverlappedCollectives(device, group, bucket_bytes)
    raise ValueError(f"`gradient_sync` must be one of {', '.join(GRADIENT_SYNC)}, got {gradient_sync!r}")
