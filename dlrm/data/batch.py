"""The unit that flows from every data source to the model: a ``Batch``; multi-hot ids as ``Bags``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Bags:
    """Multi-hot ids of ``num_features`` features for ``batch_size`` samples, jagged and
    feature-major: bag ``f * batch_size + b`` (feature ``f`` of sample ``b``) holds
    ``values[offsets[i]:offsets[i + 1]]`` for ``i = f * batch_size + b``. A bag may be empty.

    This is the layout ``torch.nn.functional.embedding_bag`` takes for all features at once
    (one joint table, ``offsets[:-1]``), and one-hot ids ``[B, F]`` are its special case of
    bags of one (``Bags.from_one_hot``). Pooling (sum or mean) is the model's, per feature.

    ``padded`` bags (``padded_to``) hold more values than their bags do: ``values`` has a static
    length and the entries past ``offsets[-1]`` belong to no bag. A captured CUDA graph needs
    that (``dlrm.training.cuda_graphs``); only the ``joint_fused`` lookup takes them.
    """

    values: torch.Tensor  # [nnz], any integer dtype (storage dtype on the host); padded: [length >= nnz]
    offsets: torch.Tensor  # [num_features * batch_size + 1], int64, offsets[0] == 0, non-decreasing
    num_features: int
    padded: bool = False  # values past offsets[-1] are padding

    @property
    def batch_size(self) -> int:
        return (self.offsets.shape[0] - 1) // self.num_features if self.num_features else 0

    @staticmethod
    def from_one_hot(ids: torch.Tensor) -> "Bags":
        """``[B, F]`` ids as bags of one id each."""
        batch, features = ids.shape
        offsets = torch.arange(batch * features + 1, dtype=torch.int64, device=ids.device)
        return Bags(ids.t().reshape(-1), offsets, features)

    def lengths(self) -> torch.Tensor:
        """Ids per bag, ``[num_features, batch_size]``."""
        return (self.offsets[1:] - self.offsets[:-1]).view(self.num_features, self.batch_size)

    def padded_to(self, length: int) -> "Bags":
        """These bags with ``values`` zero-filled to ``length`` entries, the added ones in no bag:
        ``offsets`` (so every bag, its ids and its true length) stay as they are. Shapes only,
        no host sync."""
        nnz = self.values.shape[0]
        if length < nnz:
            raise ValueError(f"cannot pad {nnz} values to {length}")
        values = self.values.new_zeros(length)
        values[:nnz] = self.values
        return Bags(values, self.offsets, self.num_features, padded=True)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Bags":
        return Bags(self.values.to(device, non_blocking=non_blocking),
                    self.offsets.to(device, non_blocking=non_blocking), self.num_features, self.padded)

    def pin_memory(self) -> "Bags":
        return Bags(self.values.pin_memory(), self.offsets.pin_memory(), self.num_features, self.padded)

    def select(self, features: Sequence[int]) -> "Bags":
        """The bags of ``features`` (indices into this ``Bags``), in that order: what a
        hybrid-parallel process keeps of a generated global batch. One slice per feature."""
        batch = self.batch_size
        bounds = self.offsets[[i * batch for f in features for i in (f, f + 1)]].tolist() if features else []
        parts, pieces, base = [], [], 0
        for k, f in enumerate(features):
            start, end = bounds[2 * k], bounds[2 * k + 1]
            parts.append(self.values[start:end])
            pieces.append(self.offsets[f * batch:(f + 1) * batch] - (start - base))
            base += end - start
        pieces.append(torch.tensor([base], dtype=self.offsets.dtype, device=self.offsets.device))
        values = torch.cat(parts) if parts else self.values[:0]
        return Bags(values, torch.cat(pieces), len(features))

    def equals(self, other: "Bags") -> bool:
        """Same bags holding the same ids (values compared as int64, so storage dtypes may differ)."""
        return (
            isinstance(other, Bags)
            and self.num_features == other.num_features
            and torch.equal(self.offsets.long(), other.offsets.long())
            and torch.equal(self.values.long(), other.values.long())
        )


@dataclass
class Batch:
    """One batch as read from disk or generated.

    Host-side dtypes are the storage dtypes (numerical float16, categorical the narrowest integer
    type of the selected columns, label uint8/bool) so host-to-device copies move the fewest
    bytes; the training step widens them on the device.
    """

    numerical: torch.Tensor  # [B, num_numerical], float16 or float32
    # [B, num_categorical] one id per feature (any integer dtype), or Bags when any feature is multi-hot
    categorical: torch.Tensor | Bags
    label: torch.Tensor  # [B], bool / uint8 / float

    def __len__(self) -> int:
        return self.label.shape[0]

    @property
    def categorical_rows(self) -> int:
        """Samples the ids cover: in a hybrid-parallel run the global batch, else ``len(self)``."""
        c = self.categorical
        return c.batch_size if isinstance(c, Bags) else c.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        return Batch(
            numerical=self.numerical.to(device, non_blocking=non_blocking),
            categorical=self.categorical.to(device, non_blocking=non_blocking),
            label=self.label.to(device, non_blocking=non_blocking),
        )

    def pin_memory(self) -> "Batch":
        return Batch(self.numerical.pin_memory(), self.categorical.pin_memory(), self.label.pin_memory())
