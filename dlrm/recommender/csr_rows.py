"""A batch of users' rows cut out of a memory-mapped CSR dataset: what training, validation and
prediction all feed the model. Its own module, below all three, so that none of them imports
another's loop to read a batch."""

from __future__ import annotations

import numpy as np
import torch

from dlrm.recommender.csr_dataset import CsrDataset

Csr = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # (offsets [B+1], item ids, values or None)


def take_rows(dataset: CsrDataset, samples: np.ndarray, keep: np.ndarray | None = None) -> Csr:
    """The CSR of the given samples, in the given order (ids of the memory-mapped dataset);
    ``keep`` (bool per stored entry) leaves out the entries where it is False (a validation split)."""
    starts = np.asarray(dataset.offsets[samples], dtype=np.int64)
    lengths = np.asarray(dataset.offsets[samples + 1], dtype=np.int64) - starts
    offsets = np.zeros(len(samples) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    positions = np.repeat(starts - offsets[:-1], lengths) + np.arange(offsets[-1], dtype=np.int64)
    if keep is not None:
        kept = keep[positions]
        rows = np.repeat(np.arange(len(samples), dtype=np.int64), lengths)
        np.cumsum(np.bincount(rows[kept], minlength=len(samples)), out=offsets[1:])
        positions = positions[kept]
    indices = torch.from_numpy(np.asarray(dataset.indices[positions], dtype=np.int64))
    values = None if dataset.values is None else torch.from_numpy(np.asarray(dataset.values[positions], np.float32))
    return torch.from_numpy(offsets), indices, values
