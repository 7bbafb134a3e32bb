"""The unit that flows from every data source to the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    """One batch as read from disk or generated.

    Host-side dtypes are the storage dtypes (numerical float16, categorical the narrowest integer
    type of the selected columns, label uint8/bool) so host-to-device copies move the fewest
    bytes; the training step widens them on the device.
    """

    numerical: torch.Tensor  # [B, num_numerical], float16 or float32
    categorical: torch.Tensor  # [B, num_categorical], any integer dtype
    label: torch.Tensor  # [B], bool / uint8 / float

    def __len__(self) -> int:
        return self.label.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(
            numerical=self.numerical.to(device, non_blocking=non_blocking),
            categorical=self.categorical.to(device, non_blocking=non_blocking),
            label=self.label.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "Batch":
        return Batch(self.numerical.pin_memory(), self.categorical.pin_memory(), self.label.pin_memory())
