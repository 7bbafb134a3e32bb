"""Embedding tables with sparse gradients, in two storage layouts with identical results.

``JointEmbedding`` keeps all tables in one ``[sum(rows), D]`` weight and shifts each feature's
ids by its table's row offset: one gather for the whole batch. ``MultiTableEmbedding`` keeps
one ``nn.Embedding`` per feature: one gather per table, but each table is its own tensor
(easier to place, shard or give its own dtype). Both map ids ``[B, F]`` to ``[B, F, D]``.
``JointFusedEmbedding`` is the joint layout on the fused kernels of ``dlrm.kernels.embedding``:
its lookup writes the compute dtype directly, and its SGD update is applied in place from the
pending gradients instead of through a sparse ``weight.grad`` and ``torch.optim``.

Ids are expected in ``[0, rows)`` per table. Nothing here checks that (a check would cost a
device sync per batch); the data layer does. With ``hash_indices`` the model maps any id to
``id % rows`` instead. In the joint layout an unchecked out-of-range id would read another
table's row, so do not turn the data-side check off without ``hash_indices``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from dlrm.kernels.backend import compute_dtype, exporting
from dlrm.kernels.embedding import gather, sgd_update
from dlrm.nn.init import init_embedding_table_, table_generator


class EmbeddingTables(nn.Module):
    """What both layouts share: table bookkeeping, id preparation, per-table weight access."""

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int,
        hash_indices: bool,
        table_indices: Sequence[int] | None = None,
        init_seed: int | None = None,
    ) -> None:
        super().__init__()
        table_sizes = [int(rows) for rows in table_sizes]
        if any(rows < 1 for rows in table_sizes) or (not table_sizes and table_indices is None):
            raise ValueError(f"table_sizes must be a non-empty list of positive row counts, got {table_sizes}")
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be positive, got {embedding_dim}")
        self.table_sizes = table_sizes
        self.num_tables = len(table_sizes)
        self.embedding_dim = embedding_dim
        self.hash_indices = hash_indices
        # Global indices of the tables held here (all of them unless hybrid parallelism splits them).
        self.table_indices = list(range(len(table_sizes))) if table_indices is None else [int(t) for t in table_indices]
        if len(self.table_indices) != len(table_sizes):
            raise ValueError(f"{len(table_sizes)} table sizes but {len(self.table_indices)} table indices")
        # One draw from the global generator whatever the tables, so layers built after the
        # embeddings get the same weights in every process.
        self.init_seed = int(torch.randint(0, 2**62, ())) if init_seed is None else init_seed
        self.register_buffer("rows", torch.tensor(table_sizes, dtype=torch.int64), persistent=False)

    def _prepare_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != self.num_tables:
            raise ValueError(f"expected ids of shape [B, {self.num_tables}], got {list(ids.shape)}")
        ids = ids.to(torch.int64)  # narrow storage dtypes would overflow when offsets are added
        if self.hash_indices:
            ids = ids % self.rows  # floor modulo: also maps negative ids into [0, rows)
        return ids

    def table_weight(self, i: int) -> torch.Tensor:
        """Table ``i`` as a ``[rows_i, D]`` view of the storage (detached), e.g. for checkpoints."""
        raise NotImplementedError

    def table_parameter(self, i: int) -> tuple[nn.Parameter, int]:
        """The parameter that stores table ``i`` and the table's first row in it: optimizer
        state is kept per parameter, and checkpoints store it per table."""
        raise NotImplementedError

    def _init_table_(self, i: int) -> None:
        weight = self.table_weight(i)
        init_embedding_table_(weight, table_generator(self.init_seed, self.table_indices[i], weight.device))

    def load_table_(self, i: int, weight: torch.Tensor) -> None:
        """Copy ``weight`` into table ``i``; its shape must be exactly ``[rows_i, D]``."""
        self._check_index(i)
        target = self.table_weight(i)
        if tuple(weight.shape) != tuple(target.shape):
            raise ValueError(
                f"table {i}: expected shape {tuple(target.shape)}, got {tuple(weight.shape)}"
            )
        with torch.no_grad():
            target.copy_(weight)

    def _check_index(self, i: int) -> None:
        if not 0 <= i < self.num_tables:
            raise IndexError(f"table index {i} out of range for {self.num_tables} tables")

    def extra_repr(self) -> str:
        return (
            f"tables={self.num_tables}, rows={sum(self.table_sizes)}, dim={self.embedding_dim}, "
            f"hash_indices={self.hash_indices}"
        )


class JointEmbedding(EmbeddingTables):
    """All tables in one weight; table ``t`` occupies rows ``[offsets[t], offsets[t] + rows_t)``."""

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int,
        hash_indices: bool = False,
        device: torch.device | str | None = None,
        table_indices: Sequence[int] | None = None,
        init_seed: int | None = None,
    ) -> None:
        super().__init__(table_sizes, embedding_dim, hash_indices, table_indices, init_seed)
        starts = [0]
        for rows in self.table_sizes:
            starts.append(starts[-1] + rows)
        self._starts = starts  # host copy, so slicing a table never syncs with the device
        self.register_buffer("offsets", torch.tensor(starts[:-1], dtype=torch.int64), persistent=False)
        device = torch.get_default_device() if device is None else device
        self.weight = nn.Parameter(torch.empty(starts[-1], embedding_dim, device=device))
        for i in range(self.num_tables):
            self._init_table_(i)
        self.to(device)  # the buffers

    def table_weight(self, i: int) -> torch.Tensor:
        self._check_index(i)
        return self.weight.detach()[self._starts[i] : self._starts[i + 1]]

    def table_parameter(self, i: int) -> tuple[nn.Parameter, int]:
        self._check_index(i)
        return self.weight, self._starts[i]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(self._prepare_ids(ids) + self.offsets, self.weight, sparse=True)


class MultiTableEmbedding(EmbeddingTables):
    """One ``nn.Embedding(sparse=True)`` per table, looked up one after the other."""

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int,
        hash_indices: bool = False,
        device: torch.device | str | None = None,
        table_indices: Sequence[int] | None = None,
        init_seed: int | None = None,
    ) -> None:
        super().__init__(table_sizes, embedding_dim, hash_indices, table_indices, init_seed)
        # skip_init: nn.Embedding's default N(0, 1) init would be overwritten anyway.
        device = torch.get_default_device() if device is None else device
        self.tables = nn.ModuleList(
            skip_init(nn.Embedding, rows, embedding_dim, sparse=True, device=device) for rows in self.table_sizes
        )
        for i in range(self.num_tables):
            self._init_table_(i)
        self.to(device)  # the buffers

    def table_weight(self, i: int) -> torch.Tensor:
        self._check_index(i)
        return self.tables[i].weight.detach()

    def table_parameter(self, i: int) -> tuple[nn.Parameter, int]:
        self._check_index(i)
        return self.tables[i].weight, 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = self._prepare_ids(ids)
        return torch.stack([table(ids[:, i]) for i, table in enumerate(self.tables)], dim=1)


PendingUpdate = tuple[torch.Tensor, torch.Tensor]  # (joint rows [N] int64, gradient rows [N, D])


class _FusedLookup(torch.autograd.Function):
    """``gather`` forward; the backward queues ``(rows, grad)`` on the module instead of
    returning a weight gradient, so no dense or COO gradient is ever built."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, rows: torch.Tensor, out_dtype: torch.dtype,
                pending: list[PendingUpdate]) -> torch.Tensor:
        ctx.save_for_backward(rows)
        ctx.pending = pending
        return gather(weight, rows, out_dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (rows,) = ctx.saved_tensors
        # contiguous: upstream gradients may be expanded views (stride 0) the kernel cannot read
        ctx.pending.append((rows, grad_out.reshape(rows.shape[0], -1).contiguous()))
        return None, None, None, None


class JointFusedEmbedding(JointEmbedding):
    """``JointEmbedding`` (same constructor, init, ``table_weight``/``load_table_`` and state
    dict) on fused kernels: the lookup writes ``[B, F, D]`` in the compute dtype (the autocast
    dtype when autocast is on for the weight's device, else the weight's), and SGD updates
    the used rows in place with their duplicates summed, from a deferred update.

    The backward leaves ``weight.grad`` as ``None`` and queues ``(rows, grad_out)``; the
    training step then calls ``apply_update_(lr, grad_scale, skip)``. Deferred, not applied
    inside the backward, because with fp16 loss scaling the step is skipped when any gradient
    of the model overflowed, which is known only once the whole backward has run: the step
    calls ``apply_update_(lr, 1 / scale, skip=found_inf)`` (``pending_nonfinite()`` adds this
    module's share to ``found_inf``). Several forward/backward passes before one update
    accumulate (one queued item each). Only plain SGD (no momentum, no weight decay), which
    is what the sparse path supports too.
    """

    def __init__(
        self,
        table_sizes: Sequence[int],
        embedding_dim: int,
        hash_indices: bool = False,
        device: torch.device | str | None = None,
        table_indices: Sequence[int] | None = None,
        init_seed: int | None = None,
    ) -> None:
        super().__init__(table_sizes, embedding_dim, hash_indices, device, table_indices, init_seed)
        self._pending: list[PendingUpdate] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if exporting():
            # torch.jit.trace / torch.export cannot record the kernel's autograd.Function: they
            # get the joint layout's plain gather of the same rows (in the weight's dtype).
            return super().forward(ids)
        rows = (self._prepare_ids(ids) + self.offsets).reshape(-1)
        # Output in the compute dtype (what autocast would compute in, else the weight's).
        out = _FusedLookup.apply(self.weight, rows, compute_dtype(self.weight), self._pending)
        return out.view(ids.shape[0], self.num_tables, self.embedding_dim)

    @property
    def has_pending_update(self) -> bool:
        return bool(self._pending)

    def pending_nonfinite(self) -> torch.Tensor:
        """0-dim bool on the weight's device: whether any queued gradient value is inf/NaN
        (no host sync, so it can join the step's ``found_inf``)."""
        flags = [torch.isfinite(grad).all().logical_not() for _, grad in self._pending]
        if not flags:
            return torch.zeros((), dtype=torch.bool, device=self.weight.device)
        return torch.stack(flags).any()

    def apply_update_(
        self,
        lr: float | torch.Tensor,
        grad_scale: float | torch.Tensor = 1.0,
        skip: bool | torch.Tensor | None = None,
    ) -> None:
        """``weight[r] -= lr * grad_scale * (sum of queued gradients of row r)`` for every queued
        item, none of it when ``skip`` is true (the queue is cleared either way). Each argument
        is a Python number or a one-element tensor (e.g. a GradScaler's ``found_inf``); tensors
        already on the weight's device keep the whole update free of host syncs."""
        device = self.weight.device
        lr_t = _device_scalar(lr, torch.float32, device)
        scale_t = _device_scalar(grad_scale, torch.float32, device)
        skip_t = _device_scalar(False if skip is None else skip, torch.bool, device)
        for rows, grad in self._pending:
            sgd_update(self.weight, rows, grad, lr_t, scale_t, skip_t)
        self._pending.clear()

    def discard_pending_(self) -> None:
        """Drops the queued gradients (e.g. after an evaluation pass that ran a backward)."""
        self._pending.clear()


def _device_scalar(value: float | bool | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor on ``device``; from a Python number by a fill (no blocking copy)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(())
    return torch.full((), value, dtype=dtype, device=device)
