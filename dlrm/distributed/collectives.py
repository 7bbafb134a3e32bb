"""What the training loop needs from the other processes, behind one small interface.

``Collectives`` is the single-process version (every operation is the identity);
``ProcessGroupCollectives`` combines numbers across a torch.distributed process group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


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

    def any(self, flag: bool) -> bool:
        return flag

    def barrier(self) -> None:
        """Waits for every process (checkpoint writers meet here)."""

    def gather_objects(self, obj: object) -> list[object]:
        """Every process's ``obj`` (picklable), in rank order, on every process."""
        return [obj]

    def sync_gradients(self, model: torch.nn.Module) -> None:
        """Makes every process hold the gradient of the global-batch loss for replicated weights."""


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

    def sync_gradients(self, model: torch.nn.Module) -> None:
        """Sums the replicated weights' gradients in one all-reduce (the loss is already divided
        by the global batch, so the sum is the global-batch gradient)."""
        grads = [p.grad for p in model.dense_parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()
