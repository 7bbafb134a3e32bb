"""Learning-rate schedule of NVIDIA's DLRM: linear warmup, hold, polynomial decay.

A pure function of the step, so resuming a run needs no scheduler state beyond the step count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dlrm.engine.config_check import check_types


@dataclass(frozen=True)
class LRSchedule:
    """Steps count optimizer updates from 1 (the first update uses ``lr_at(1)``).

    - warmup (step <= warmup_steps): factor rises linearly to 1; ``warmup_factor`` w starts it at
      1 - 1/2**w instead of 0 (NVIDIA's definition).
    - hold until ``decay_start_step``.
    - decay (decay_start_step < step <= decay_start_step + decay_steps):
      factor = ((end - step) / decay_steps) ** decay_power, floored at decay_end_lr / lr.
    - after the decay: decay_end_lr.
    ``decay_steps = 0`` means no decay at all (NVIDIA's flag help says so; its code instead drops
    to ``decay_end_lr`` right after ``decay_start_step``).
    """

    lr: float
    warmup_steps: int = 0
    warmup_factor: int = 0
    decay_start_step: int = 0
    decay_steps: int = 0
    decay_power: float = 2.0
    decay_end_lr: float = 0.0

    def __post_init__(self) -> None:
        check_types(self)  # typed first: the bounds below compare numbers
        if self.warmup_steps < 0 or self.decay_steps < 0 or self.decay_start_step < 0:
            raise ValueError("`warmup_steps`, `decay_steps` and `decay_start_step` must be >= 0")
        if self.warmup_factor < 0:
            raise ValueError("`warmup_factor` must be a non-negative integer")
        if not self.decay_power > 0:
            raise ValueError(f"`decay_power` must be positive, got {self.decay_power}")
        if self.decay_steps > 0 and self.decay_start_step < self.warmup_steps:
            raise ValueError(
                f"`decay_start_step` ({self.decay_start_step}) must not be smaller than "
                f"`warmup_steps` ({self.warmup_steps}): warmup must finish before decay starts"
            )

    def factor(self, step: int) -> float:
        if step <= self.warmup_steps:
            return 1.0 - (self.warmup_steps - step) / (self.warmup_steps * 2.0**self.warmup_factor)
        if self.decay_steps == 0 or step <= self.decay_start_step:
            return 1.0
        end_factor = self.decay_end_lr / self.lr if self.lr else 0.0
        decay_end = self.decay_start_step + self.decay_steps
        if step <= decay_end:
            return max(((decay_end - step) / self.decay_steps) ** self.decay_power, end_factor)
        return end_factor

    def lr_at(self, step: int) -> float:
        return self.lr * self.factor(step)

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Sets every param group's lr for the update numbered ``step``; returns it."""
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr
