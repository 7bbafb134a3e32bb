"""Feature interactions: how the bottom MLP output meets the embeddings.

``dot_interaction_reference`` is the pure-torch definition of the dot interaction; it lives in
``dlrm.kernels.dot_interaction`` beside the fused kernel that must match it exactly in layout,
and is imported from there (the dependency goes nn -> kernels only). ``DotInteraction`` runs
the kernel when asked to and it supports the inputs; otherwise, when training,
``DotInteractionTorch`` (the reference's forward with a shorter backward), and the reference
itself when no gradient is needed or a graph is being exported.
``CatInteraction`` only concatenates; ``DCNInteraction`` (DCNv2 low-rank cross layers, as in
TorchRec's ``LowRankCrossNet`` and the MLPerf DLRMv2 model) learns the interaction terms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dlrm.kernels.backend import compute_dtype, exporting
from dlrm.kernels.dot_interaction import (
    dot_interaction,
    dot_interaction_reference,
    dot_interaction_width,
    lower_triangle_index,
    padded_width,
)


class DotInteraction(nn.Module):
    """Dot interaction with its triangle indices precomputed once, on the module's device.

    ``use_kernel`` runs the fused Triton kernels (``dlrm.kernels.dot_interaction``), which take
    the reference themselves on inputs they do not support; otherwise ``DotInteractionTorch``
    when a gradient is needed, the reference when not.
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
        if torch.is_grad_enabled() and (bottom.requires_grad or embedded.requires_grad) and not exporting():
            return DotInteractionTorch.apply(bottom, embedded, self.triangle_index, compute_dtype(bottom, embedded))
        return dot_interaction_reference(bottom, embedded, self.triangle_index)

    def extra_repr(self) -> str:
        text = f"num_features={self.num_features}, embedding_dim={self.embedding_dim}, num_outputs={self.num_outputs}"
        return text + (", use_kernel=True" if self.use_kernel else "")


class DotInteractionTorch(torch.autograd.Function):
    """``dot_interaction_reference``'s forward, in plain torch ops, with a shorter backward.

    Autograd through the reference takes the Gram matrix ``G = X X^T`` (``X = [bottom,
    embeddings]``, ``[B, n, D]``) apart into two batched GEMMs on transposed operands and sums
    them (``dX = dG X + dG^T X``); under autocast it also casts ``X`` twice (once per operand of
    ``bmm``) and both gradients back. On the CPU (batch 4096, 26 tables, dim 128) that was about
    half of a bf16 training step. Here ``X`` is built once, in the compute dtype, and as
    ``dG`` is strictly lower triangular, ``S = dG + dG^T`` has no overlapping terms: the backward
    scatters the triangle's gradient into both halves of one ``[B, n, n]`` matrix and computes
    ``dX = S X``, rows 1.. (the embeddings') and row 0 (the bottom vector's) as two products so
    that the embeddings' gradient comes out contiguous (the embedding backward would copy a
    slice). The forward gives the reference's values exactly (same ops on the same operands);
    gradients agree up to rounding (one rounding of one product instead of two, then a sum).
    """

    @staticmethod
    def forward(ctx, bottom: torch.Tensor, embedded: torch.Tensor, triangle_index: torch.Tensor,
                dtype: torch.dtype) -> torch.Tensor:
        batch, num_embedded, dim = embedded.shape
        n = num_embedded + 1
        features = torch.empty(batch, n, dim, dtype=dtype, device=embedded.device)
        features[:, 0] = bottom  # copy_ casts as it copies: one pass over each input
        features[:, 1:] = embedded
        gram = torch.bmm(features, features.transpose(1, 2))  # [B, n, n]
        triangle = gram.flatten(1).index_select(1, triangle_index)
        width = dim + triangle.shape[1]
        padding = gram.new_zeros(batch, padded_width(width) - width)
        ctx.save_for_backward(features, triangle_index)
        ctx.input_dtypes = bottom.dtype, embedded.dtype
        return torch.cat([features[:, 0], triangle, padding], dim=1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        features, triangle_index = ctx.saved_tensors
        bottom_dtype, embedded_dtype = ctx.input_dtypes
        batch, n, dim = features.shape
        grad_out = grad_out.to(features.dtype)
        grad_triangle = grad_out[:, dim : dim + triangle_index.numel()]
        # (i, j) below the diagonal and (j, i) above it: the two halves never share an entry.
        rows, cols = triangle_index // n, triangle_index % n
        symmetric = grad_out.new_zeros(batch, n * n)
        symmetric.index_copy_(1, triangle_index, grad_triangle)
        symmetric.index_copy_(1, cols * n + rows, grad_triangle)
        symmetric = symmetric.view(batch, n, n)
        grad_embedded = torch.bmm(symmetric[:, 1:], features)  # [B, n - 1, D]
        grad_bottom = torch.bmm(symmetric[:, :1], features).squeeze(1) + grad_out[:, :dim]
        return grad_bottom.to(bottom_dtype), grad_embedded.to(embedded_dtype), None, None


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


class DCNInteraction(nn.Module):
    """DCNv2 cross network over ``x0 = [bottom, embeddings flattened]`` (width ``K``).

    Layer ``l`` computes ``x_{l+1} = x0 * (W_l (V_l x_l) + b_l) + x_l`` with ``V_l: [r, K]`` (no
    bias), ``W_l: [K, r]`` and ``b_l: [K]``, as TorchRec's ``LowRankCrossNet`` (Wang et al.,
    "DCN V2", arXiv:2008.13535, eq. 1 with the low-rank ``W = U V``). The output keeps the
    width ``K``. Parameters are named and shaped as TorchRec's, except that ``bias.<l>`` is
    ``[K]`` rather than ``[K, 1]``.

    Initialisation as TorchRec's (xavier-normal kernels, zero bias), drawn here from torch's
    global generator in a fixed order (``W_0 .. W_{L-1}``, then ``V_0 .. V_{L-1}``, TorchRec's
    order) so that a model built after ``torch.manual_seed`` is deterministic and identical on
    every process of a hybrid-parallel run.
    """

    def __init__(
        self,
        num_features: int,
        embedding_dim: int,
        bottom_dim: int | None = None,
        num_layers: int = 3,
        low_rank_dim: int = 512,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if num_features < 1 or embedding_dim < 1:
            raise ValueError(f"need num_features >= 1 and embedding_dim >= 1, got {num_features}, {embedding_dim}")
        if num_layers < 1 or low_rank_dim < 1:
            raise ValueError(f"need num_layers >= 1 and low_rank_dim >= 1, got {num_layers}, {low_rank_dim}")
        self.num_features = num_features
        self.embedding_dim = embedding_dim
        self.bottom_dim = embedding_dim if bottom_dim is None else bottom_dim
        self.num_layers = num_layers
        self.low_rank_dim = low_rank_dim
        width = self.bottom_dim + (num_features - 1) * embedding_dim
        self.num_outputs = width  # the cross layers keep the width of x0
        device = torch.get_default_device() if device is None else device
        # torch.empty draws nothing; the kernels are drawn below in TorchRec's order.
        self.W_kernels = nn.ParameterList(
            nn.Parameter(torch.empty(width, low_rank_dim, device=device)) for _ in range(num_layers)
        )
        self.V_kernels = nn.ParameterList(
            nn.Parameter(torch.empty(low_rank_dim, width, device=device)) for _ in range(num_layers)
        )
        self.bias = nn.ParameterList(nn.Parameter(torch.zeros(width, device=device)) for _ in range(num_layers))
        with torch.no_grad():
            for kernel in [*self.W_kernels, *self.V_kernels]:
                nn.init.xavier_normal_(kernel)  # N(0, sqrt(2 / (K + r)))

    def forward(self, bottom: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        _check_features(self.num_features, embedded)
        if bottom.dim() != 2 or bottom.shape[1] != self.bottom_dim:
            # Caught here: the first cross layer would fail with an anonymous matmul shape error.
            raise ValueError(f"expected bottom of shape [B, {self.bottom_dim}], got {list(bottom.shape)}")
        x0 = torch.cat([bottom, embedded.flatten(1)], dim=1)
        x = x0
        for w, v, b in zip(self.W_kernels, self.V_kernels, self.bias):
            # Two thin matmuls (K -> r -> K) instead of one K x K: the point of the low rank.
            x = x0 * F.linear(F.linear(x, v), w, b) + x
        return x

    def extra_repr(self) -> str:
        return (
            f"num_features={self.num_features}, embedding_dim={self.embedding_dim}, bottom_dim={self.bottom_dim}, "
            f"num_layers={self.num_layers}, low_rank_dim={self.low_rank_dim}, num_outputs={self.num_outputs}"
        )


def _check_features(num_features: int, embedded: torch.Tensor) -> None:
    # A wrong feature count would otherwise gather the wrong Gram entries without any error.
    if embedded.dim() != 3 or embedded.shape[1] != num_features - 1:
        raise ValueError(
            f"expected embedded of shape [B, {num_features - 1}, D], got {list(embedded.shape)}"
        )
