"""Feature interactions: how the bottom MLP output meets the embeddings.

``dot_interaction_reference`` is the pure-torch definition of the dot interaction. A fused
kernel (``dlrm.kernels``) must match it exactly in layout and is chosen by ``DotInteraction``
when it supports the inputs; this function stays the fallback and the test oracle.
"""

from __future__ import annotations

import torch
from torch import nn

PAD_MULTIPLE = 8  # output width is padded so the top MLP's first GEMM has an aligned K dimension


def padded_width(width: int) -> int:
    """``width`` rounded up to a multiple of ``PAD_MULTIPLE``."""
    return -(-width // PAD_MULTIPLE) * PAD_MULTIPLE


def dot_interaction_width(num_features: int, embedding_dim: int) -> int:
    """Output width of the dot interaction over ``num_features`` vectors (bottom included)."""
    return padded_width(embedding_dim + num_features * (num_features - 1) // 2)


def lower_triangle_index(num_features: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Flat indices into a row-major ``[n, n]`` matrix of its strictly-lower triangle.

    Order is row-major: (1,0), (2,0), (2,1), (3,0), ... -- the layout checkpoints and kernels
    rely on.
    """
    rows, cols = torch.tril_indices(num_features, num_features, offset=-1, device=device)
    return rows * num_features + cols


def dot_interaction_reference(
    bottom: torch.Tensor,
    embedded: torch.Tensor,
    triangle_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pairwise dot products of ``[bottom, embeddings]``, after the bottom vector itself.

    bottom ``[B, D]``, embedded ``[B, F, D]`` -> ``[B, padded_width(D + n(n-1)/2)]`` with
    ``n = F + 1``: the bottom vector, the strictly-lower triangle of the Gram matrix in row-major
    order, then zeros. ``triangle_index`` (from ``lower_triangle_index(n)``) may be passed to
    avoid rebuilding it on every call. Under autocast the Gram matrix and the whole output are
    in the autocast dtype.
    """
    batch = bottom.shape[0]
    features = torch.cat([bottom.unsqueeze(1), embedded], dim=1)  # [B, n, D]
    gram = torch.bmm(features, features.transpose(1, 2))  # [B, n, n]
    if triangle_index is None:
        triangle_index = lower_triangle_index(features.shape[1], device=gram.device)
    triangle = gram.flatten(1).index_select(1, triangle_index)
    width = bottom.shape[1] + triangle.shape[1]
    padding = gram.new_zeros(batch, padded_width(width) - width)
    return torch.cat([bottom.to(gram.dtype), triangle, padding], dim=1)


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
            # Imported here: the kernel module imports this one for its reference and fallback.
            from dlrm.kernels.dot_interaction import dot_interaction

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
