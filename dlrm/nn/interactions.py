"""Feature interactions: how the bottom MLP output meets the embeddings.

``dot_interaction_reference`` is the pure-torch definition of the dot interaction; it lives in
``dlrm.kernels.dot_interaction`` beside the fused kernel that must match it exactly in layout,
and is imported from there (the dependency goes nn -> kernels only). ``DotInteraction`` runs
the kernel when asked to and it supports the inputs, the reference otherwise.
"""

from __future__ import annotations

import torch
from torch import nn

from dlrm.kernels.dot_interaction import (
    dot_interaction,
    dot_interaction_reference,
    dot_interaction_width,
    lower_triangle_index,
)


class DotInteraction(nn.Module):
    """Dot interaction with its triangle indices precomputed once, on the module's device.

    ``use_kernel`` runs the fused Triton kernels (``dlrm.kernels.dot_interaction``), which take
    the reference themselves on inputs they do not support; otherwise the reference runs.
    """

    def __init__(self, num_features: int, embedding_dim: int, use_kernel: bool = False) -> None:
        super().__init__()
        if num_features < 1 or embedding_dim < 1:
            raise ValueError(f"need num_features >= 1 and embedding_dim >= 1, got {num_features}, {embedding_dim}")
        self.num_features = num_features  # bottom output + one per embedding table
        self.embedding_dim = embedding_dim
        self.use_kernel = use_kernel
        self.num_outputs = dot_interaction_width(num_features, embedding_dim)
        # Derived from the shape alone, so kept out of the state dict.
        self.register_buffer("triangle_index", lower_triangle_index(num_features), persistent=False)

    def forward(self, bottom: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        _check_features(self.num_features, embedded)
        if self.use_kernel:
            return dot_interaction(bottom, embedded, self.triangle_index)
        return dot_interaction_reference(bottom, embedded, self.triangle_index)

    def extra_repr(self) -> str:
        text = f"num_features={self.num_features}, embedding_dim={self.embedding_dim}, num_outputs={self.num_outputs}"
        return text + (", use_kernel=True" if self.use_kernel else "")


class CatInteraction(nn.Module):
    """Concatenation ``[bottom, embeddings flattened]``: no interaction terms at all.

    ``bottom_dim`` defaults to ``embedding_dim``; unlike the dot interaction, the cat
    interaction does not need them equal.
    """

    def __init__(self, num_features: int, embedding_dim: int, bottom_dim: int | None = None) -> None:
        super().__init__()
        if num_features < 1 or embedding_dim < 1:
            raise ValueError(f"need num_features >= 1 and embedding_dim >= 1, got {num_features}, {embedding_dim}")
        self.num_features = num_features
        self.embedding_dim = embedding_dim
        bottom_dim = embedding_dim if bottom_dim is None else bottom_dim
        self.num_outputs = bottom_dim + (num_features - 1) * embedding_dim

    def forward(self, bottom: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        _check_features(self.num_features, embedded)
        return torch.cat([bottom, embedded.flatten(1)], dim=1)

    def extra_repr(self) -> str:
        return f"num_features={self.num_features}, embedding_dim={self.embedding_dim}, num_outputs={self.num_outputs}"


def _check_features(num_features: int, embedded: torch.Tensor) -> None:
    # A wrong feature count would otherwise gather the wrong Gram entries without any error.
    if embedded.dim() != 3 or embedded.shape[1] != num_features - 1:
        raise ValueError(
            f"expected embedded of shape [B, {num_features - 1}, D], got {list(embedded.shape)}"
        )
