"""Embedding tables with sparse gradients, in two storage layouts with identical results.

``JointEmbedding`` keeps all tables in one ``[sum(rows), D]`` weight and shifts each feature's
ids by its table's row offset: one gather for the whole batch. ``MultiTableEmbedding`` keeps
one ``nn.Embedding`` per feature: one gather per table, but each table is its own tensor
(easier to place, shard or give its own dtype). Both map ids ``[B, F]`` to ``[B, F, D]``.
``JointFusedEmbedding`` is the joint layout on the fused kernels of ``dlrm.kernels.embedding``:
its lookup writes the compute dtype directly, and its SGD or row-wise Adagrad update is applied in
place from the pending gradients instead of through a sparse ``weight.grad`` and ``torch.optim``.

Ids are expected in ``[0, rows)`` per table. Nothing here checks that (a check would cost a
device sync per batch); the data layer does. With ``hash_indices`` the model maps any id to
``id % rows`` instead. In the joint layout an unchecked out-of-range id would read another
table's row, so do not turn the data-side check off without ``hash_indices``.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from dlrm.data.batch import Bags
from dlrm.kernels.backend import compute_dtype, exporting
from dlrm.kernels.embedding import sgd_update
from dlrm.kernels.embedding_bag import ADAGRAD_EPS, bag_of_positions, bag_rowwise_adagrad_update, bag_sgd_update
from dlrm.kernels.rounding import HALF_DTYPES
from dlrm.nn.fused_lookup import (PaddedBagUpdate, PendingBagUpdate, PendingUpdate,
                                  _FusedBagLookup, _FusedLookup)
from dlrm.nn.init import init_table_rows_
from dlrm.nn.table_spec import TableSpec, check_poolings

WEIGHT_DTYPES = (torch.float32, torch.float64, *HALF_DTYPES)  # float64: tests' exact references


class EmbeddingTables(nn.Module):
    """What both layouts share: table bookkeeping, id preparation, per-table weight access."""

    def __init__(
        self,
        tables: Sequence[TableSpec | int],
        embedding_dim: int,
        hash_indices: bool = False,
        device: torch.device | str | None = None,
        init_seed: int | None = None,
        weight_dtype: torch.dtype = torch.float32,
        init_device: torch.device | str | None = None,
        empty_ok: bool = False,
    ) -> None:
        """Checks and records the tables, then builds the layout's weights (``_make_weights``)
        on ``device`` and draws every table's initial values."""
        super().__init__()
        specs = [table if isinstance(table, TableSpec) else TableSpec(i, int(table)) for i, table in enumerate(tables)]
        table_sizes = [spec.block_rows for spec in specs]
        if any(rows < 1 for rows in table_sizes) or (not specs and not empty_ok):
            raise ValueError(f"tables must be a non-empty list of tables of positive row counts, got {table_sizes}")
        if embedding_dim < 1:
            raise ValueError(f"embedding_dim must be positive, got {embedding_dim}")
        self.specs = tuple(specs)
        self.table_sizes = table_sizes
        self.num_tables = len(table_sizes)
        self.embedding_dim = embedding_dim
        self.hash_indices = hash_indices
        # Global indices of the tables held here (all of them unless hybrid parallelism splits them).
        self.table_indices = [spec.index for spec in specs]
        # One draw from the global generator whatever the tables, so layers built after the
        # embeddings get the same weights in every process.
        self.init_seed = int(torch.randint(0, 2**62, ())) if init_seed is None else init_seed
        # Where the initial weights are drawn (default: where they are kept). CPU and CUDA
        # generators draw different numbers, so tables kept in host memory for a GPU model draw on
        # the GPU: a table's initial values must not depend on where it is kept.
        self.init_device = None if init_device is None else torch.device(init_device)
        # Row-wise sharding: local table i holds rows [row_starts[i], row_starts[i] + table_sizes[i])
        # of a table of full_table_sizes[i] rows (by default every table is whole).
        self.row_starts = [spec.start for spec in specs]
        self.full_table_sizes = [spec.rows for spec in specs]
        for i, (start, rows, full) in enumerate(zip(self.row_starts, table_sizes, self.full_table_sizes)):
            if start < 0 or start + rows > full:
                raise ValueError(f"table {self.table_indices[i]}: rows [{start}, {start + rows}) are not inside "
                                 f"its {full} rows")
        self.row_sharded = self.row_starts != [0] * len(table_sizes) or self.full_table_sizes != table_sizes
        # The whole tables' rows: ids are hashed (`hash_indices`) into the whole table, then a
        # row-wise block keeps those in its range.
        self.register_buffer("rows", torch.tensor(self.full_table_sizes, dtype=torch.int64), persistent=False)
        self.register_buffer("row_start", torch.tensor(self.row_starts, dtype=torch.int64), persistent=False)
        self.register_buffer("block_rows", torch.tensor(table_sizes, dtype=torch.int64), persistent=False)
        self.poolings = check_poolings([spec.pooling for spec in specs], len(table_sizes))
        # Per table: whether its bags are mean-pooled (a device copy, so building weights never syncs).
        self.register_buffer("mean_pooled", torch.tensor([p == "mean" for p in self.poolings], dtype=torch.bool),
                             persistent=False)
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"`weight_dtype` must be one of {list(WEIGHT_DTYPES)}, got {weight_dtype}")
        device = torch.get_default_device() if device is None else device
        self._make_weights(device, weight_dtype)
        self._init_tables_(torch.device(device))
        self.to(device)  # the buffers

    # Whether tables may be drawn at once on several threads: each writes rows of its own from
    # generators of its own, so the values are those of a draw one table after another.
    PARALLEL_INIT = True

    def _init_tables_(self, device: torch.device) -> None:
        """Draws every table's initial weights; on the CPU one table per thread (torch draws a
        tensor on one core: the Criteo-sized synthetic tables took 3 s alone on two cores)."""
        threads = min(torch.get_num_threads(), self.num_tables)
        on_cpu = device.type == "cpu" and (self.init_device is None or self.init_device.type == "cpu")
        if not (self.PARALLEL_INIT and on_cpu and threads > 1):
            for i in range(self.num_tables):
                self._init_table_(i)
            return
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(self._init_table_, range(self.num_tables)))

    def _make_weights(self, device: torch.device | str, weight_dtype: torch.dtype) -> None:
        """The layout's parameters, uninitialised (the constructor draws them)."""
        raise NotImplementedError

    def _prepare_ids(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() != 2 or ids.shape[1] != self.num_tables:
            raise ValueError(f"expected ids of shape [B, {self.num_tables}], got {list(ids.shape)}")
        ids = ids.to(torch.int64)  # narrow storage dtypes would overflow when offsets are added
        if self.hash_indices:
            ids = ids % self.rows  # floor modulo: also maps negative ids into [0, rows)
        return ids

    def _bag_batch_size(self, bags: Bags) -> int:
        """The batch size of ``bags`` after checking that this module can pool them (shapes only,
        no host sync); multi-hot export is refused here for every layout."""
        if exporting():
            raise ValueError(
                "multi-hot ids (`Bags`) cannot be exported yet: export a model fed one-hot ids [B, F] "
                "(one id per feature), or serve the multi-hot model from Python"
            )
        if bags.num_features != self.num_tables or self.num_tables == 0:
            raise ValueError(
                f"expected Bags with num_features={self.num_tables} (one per table held here), got "
                f"num_features={bags.num_features}" + ("; pass ids of shape [B, 0] instead" if not self.num_tables else "")
            )
        offsets, values = bags.offsets, bags.values
        if offsets.dim() != 1 or offsets.shape[0] < 1 or (offsets.shape[0] - 1) % self.num_tables:
            raise ValueError(
                f"expected Bags offsets of shape [num_features * batch_size + 1] = [{self.num_tables} * B + 1], "
                f"got shape {list(offsets.shape)}"
            )
        if values.dim() != 1:
            raise ValueError(f"expected Bags values of shape [nnz], got shape {list(values.shape)}")
        if bags.padded and not self._takes_padded_bags():
            raise ValueError(f"padded Bags (values past the last bag, for a captured CUDA graph) are pooled by the "
                             f"`joint_fused` lookup only, not by {type(self).__name__}")
        return (offsets.shape[0] - 1) // self.num_tables

    def _takes_padded_bags(self) -> bool:
        """Whether ``forward`` pools padded ``Bags`` (``Bags.padded_to``): its own lookup must
        leave the values past the last bag out."""
        return False

    def _value_tables(self, bags: Bags, batch: int) -> torch.Tensor:
        """The table of every value, ``[nnz]`` int64: each feature's values are one contiguous run,
        of length ``offsets[(t+1)*B] - offsets[t*B]``. On the device, no host sync."""
        if bags.padded:  # the padding, past the last bag, counts as the last table's (its row is masked later)
            return bag_of_positions(bags.offsets[::batch], bags.values.shape[0]).clamp_(max=self.num_tables - 1)
        per_feature = bags.offsets[::batch].diff()  # offsets[::B] holds the T + 1 feature bounds
        tables = torch.arange(self.num_tables, device=bags.offsets.device)
        return torch.repeat_interleave(tables, per_feature, output_size=bags.values.shape[0])

    def _bag_ids_and_weights(self, bags: Bags, batch: int, tables: torch.Tensor,
                             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every value's row in its local table (int64, hashed into the whole table with
        ``hash_indices`` as one-hot ids are) and the per-value weights of the pooled sum: ``1 / len``
        for mean-pooled bags, and for row-wise blocks 0 for the ids outside the block (the ranks
        holding the other blocks add their part: partial sums, with the whole bag's ``len``).
        None when every weight would be 1. On the device, no host sync."""
        ids = bags.values.to(torch.int64)
        if self.hash_indices:
            ids = ids % self.rows[tables]
        weights = self._mean_weights(bags, batch, dtype)
        if self.row_sharded:
            ids = ids - self.row_start[tables]
            keep = (ids >= 0) & (ids < self.block_rows[tables])
            ids = torch.where(keep, ids, 0)  # any row of the block: its weight is 0
            weights = keep.to(dtype) if weights is None else weights * keep
        return ids, weights

    def _as_bags(self, ids: torch.Tensor | Bags) -> Bags:
        """Row-wise blocks look ids up as bags (one-hot ids as bags of one), whose per-value
        weights drop the ids of other blocks."""
        if isinstance(ids, Bags):
            return ids
        if ids.dim() != 2 or ids.shape[1] != self.num_tables:
            raise ValueError(f"expected ids of shape [B, {self.num_tables}], got {list(ids.shape)}")
        return Bags.from_one_hot(ids)

    def _mean_weights(self, bags: Bags, batch: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Per-value weights that make a weighted sum the mean: ``1 / len`` for the values of
        mean-pooled bags, 1 elsewhere; None when every table sums (no weights at all)."""
        if "mean" not in self.poolings:
            return None
        lengths = bags.offsets.diff()  # [T*B], the true lengths: padding is in no bag
        scale = lengths.clamp(min=1).to(dtype).reciprocal()
        scale = torch.where(self.mean_pooled[:, None], scale.view(self.num_tables, batch), 1.0).reshape(-1)
        if bags.padded:  # the padding's bag is "one past the last": weight 0
            return torch.cat([scale, scale.new_zeros(1)])[bag_of_positions(bags.offsets, bags.values.shape[0])]
        bag = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths,
                                      output_size=bags.values.shape[0])
        return scale[bag]

    def row_range(self, i: int) -> tuple[int, int]:
        """The rows ``[start, stop)`` of its whole table that local table ``i`` holds."""
        return self.row_starts[i], self.row_starts[i] + self.table_sizes[i]

    def is_block(self, i: int) -> bool:
        """Whether local table ``i`` is a row-wise block rather than a whole table."""
        return self.row_range(i) != (0, self.full_table_sizes[i])

    def table_weight(self, i: int) -> torch.Tensor:
        """Table ``i`` as a ``[rows_i, D]`` view of the storage (detached), e.g. for checkpoints."""
        raise NotImplementedError

    def table_parameter(self, i: int) -> tuple[nn.Parameter, int]:
        """The parameter that stores table ``i`` and the table's first row in it: optimizer
        state is kept per parameter, and checkpoints store it per table."""
        raise NotImplementedError

    def _init_table_(self, i: int) -> None:
        # Half tables hold the fp32 initial weights rounded to nearest: the same draws as fp32
        # tables, so runs that differ only in embedding_dtype start from the same model.
        weight = self.table_weight(i)
        init_table_rows_(weight, self.init_seed, self.table_indices[i], self.full_table_sizes[i], self.row_starts[i],
                         draw_dtype=torch.float32 if weight.dtype in HALF_DTYPES else weight.dtype,
                         draw_device=self.init_device)

    def storage_dtype(self) -> torch.dtype:
        """The tables' dtype as it is now (a model may be cast after it was built)."""
        param = next(self.parameters(), None)
        return torch.float32 if param is None else param.dtype

    def output_dtype(self) -> torch.dtype:
        """What lookups return: the weights' dtype, or for fp16/bf16 tables the compute dtype
        (autocast's when it is on, else fp32): half storage never leaks into an fp32 model."""
        dtype = self.storage_dtype()
        if dtype not in HALF_DTYPES:
            return dtype
        device_type = self.rows.device.type
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else torch.float32

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
            + ("" if "mean" not in self.poolings else f", poolings={self.poolings}")
            + ("" if self.storage_dtype() == torch.float32 else f", weight_dtype={self.storage_dtype()}")
            + ("" if not self.row_sharded else ", row_blocks=" + str(
                [(t, *self.row_range(i)) for i, t in enumerate(self.table_indices) if self.is_block(i)]))
        )


class JointEmbedding(EmbeddingTables):
    """All tables in one weight; table ``t`` occupies rows ``[offsets[t], offsets[t] + rows_t)``."""

    def _make_weights(self, device: torch.device | str, weight_dtype: torch.dtype) -> None:
        starts = [0]
        for rows in self.table_sizes:
            starts.append(starts[-1] + rows)
        self._starts = starts  # host copy, so slicing a table never syncs with the device
        self.register_buffer("offsets", torch.tensor(starts[:-1], dtype=torch.int64), persistent=False)
        self.weight = nn.Parameter(torch.empty(starts[-1], self.embedding_dim, device=device, dtype=weight_dtype))

    def table_weight(self, i: int) -> torch.Tensor:
        self._check_index(i)
        return self.weight.detach()[self._starts[i] : self._starts[i + 1]]

    def table_parameter(self, i: int) -> tuple[nn.Parameter, int]:
        self._check_index(i)
        return self.weight, self._starts[i]

    def forward(self, ids: torch.Tensor | Bags) -> torch.Tensor:
        if isinstance(ids, Bags) or self.row_sharded:
            return self._pool_bags(self._as_bags(ids))
        out = F.embedding(self._prepare_ids(ids) + self.offsets, self.weight, sparse=True)
        return out.to(self.output_dtype())

    def _joint_bags(self, bags: Bags, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows of the joint weight for every value (id + its table's offset) and the pooling
        weights: the input of one pooled lookup over all features."""
        tables = self._value_tables(bags, batch)
        ids, weights = self._bag_ids_and_weights(bags, batch, tables,
                                                 torch.promote_types(self.weight.dtype, torch.float32))
        rows = ids + self.offsets[tables]
        if bags.padded:
            # Padding gets the row one past the last: the kernels read zeros for it and skip its
            # update, and the updates' sort puts it after every real row, so the real rows are
            # sorted, summed and written exactly as without padding.
            positions = torch.arange(rows.shape[0], device=rows.device)
            rows = torch.where(positions < bags.offsets[-1], rows, self.weight.shape[0])
        return rows, weights

    def _pool_bags(self, bags: Bags) -> torch.Tensor:
        """One ``embedding_bag`` over the joint weight for every bag of every feature -> ``[B, T, D]``."""
        batch = self._bag_batch_size(bags)
        if batch == 0:
            return self.weight.new_zeros(0, self.num_tables, self.embedding_dim, dtype=self.output_dtype())
        rows, weights = self._joint_bags(bags, batch)
        pooled = F.embedding_bag(rows, self.weight, bags.offsets.to(torch.int64), mode="sum", sparse=True,
                                 per_sample_weights=None if weights is None else weights.to(self.weight.dtype),
                                 include_last_offset=True)
        # bags are feature-major ([T*B, D]); the model takes samples first, contiguous as one-hot
        pooled = pooled.view(self.num_tables, batch, self.embedding_dim).transpose(0, 1)
        return pooled.to(self.output_dtype()).contiguous()


class MultiTableEmbedding(EmbeddingTables):
    """One ``nn.Embedding(sparse=True)`` per table, looked up one after the other."""

    def _make_weights(self, device: torch.device | str, weight_dtype: torch.dtype) -> None:
        # skip_init: nn.Embedding's default N(0, 1) init would be overwritten anyway.
        self.tables = nn.ModuleList(
            skip_init(nn.Embedding, rows, self.embedding_dim, sparse=True, device=device, dtype=weight_dtype)
            for rows in self.table_sizes
        )

    def table_weight(self, i: int) -> torch.Tensor:
        self._check_index(i)
        return self.tables[i].weight.detach()

    def table_parameter(self, i: int) -> tuple[nn.Parameter, int]:
        self._check_index(i)
        return self.tables[i].weight, 0

    def forward(self, ids: torch.Tensor | Bags) -> torch.Tensor:
        if isinstance(ids, Bags) or self.row_sharded:
            return self._pool_bags(self._as_bags(ids))
        ids, dtype = self._prepare_ids(ids), self.output_dtype()
        # each cast before the stack: autocast's type promotion of stack refuses fp16 on the CPU
        return torch.stack([table(ids[:, i]).to(dtype) for i, table in enumerate(self.tables)], dim=1)

    def _pool_bags(self, bags: Bags) -> torch.Tensor:
        """One ``embedding_bag`` per table on its feature's slice of the values -> ``[B, T, D]``."""
        batch = self._bag_batch_size(bags)
        if batch == 0:
            return self.tables[0].weight.new_zeros(0, self.num_tables, self.embedding_dim, dtype=self.output_dtype())
        offsets, dtype = bags.offsets.to(torch.int64), self.output_dtype()
        weight_dtype = self.tables[0].weight.dtype
        # Weights only where a row-wise block drops ids; mean pooling alone is embedding_bag's mode.
        ids, weights = self._bag_ids_and_weights(bags, batch, self._value_tables(bags, batch), weight_dtype) \
            if self.row_sharded else (bags.values.to(torch.int64), None)
        # One host sync per batch: slicing each feature's values needs its bounds on the host
        # (the joint layout, one lookup for all features, needs none).
        bounds = offsets[::batch].tolist()
        pooled = []
        for t, table in enumerate(self.tables):
            table_ids = ids[bounds[t]:bounds[t + 1]]
            if self.hash_indices and not self.row_sharded:
                table_ids = table_ids % self.table_sizes[t]
            bag_offsets = offsets[t * batch:(t + 1) * batch + 1] - bounds[t]
            if weights is None:
                out = F.embedding_bag(table_ids, table.weight, bag_offsets, mode=self.poolings[t], sparse=True,
                                      include_last_offset=True)
            else:
                out = F.embedding_bag(table_ids, table.weight, bag_offsets, mode="sum", sparse=True,
                                      per_sample_weights=weights[bounds[t]:bounds[t + 1]], include_last_offset=True)
            pooled.append(out.to(dtype))
        return torch.stack(pooled, dim=1)


class JointFusedEmbedding(JointEmbedding):
    """``JointEmbedding`` (same constructor, init, ``table_weight``/``load_table_`` and state
    dict) on fused kernels: the lookup writes ``[B, F, D]`` in the compute dtype (the autocast
    dtype when autocast is on for the weight's device, else the weight's), and SGD or row-wise
    Adagrad updates the used rows in place with their duplicates summed, from a deferred update.

    The backward leaves ``weight.grad`` as ``None`` and queues ``(rows, grad_out)``; the
    training step then calls ``apply_update_(lr, grad_scale, skip)``. Deferred, not applied
    inside the backward, because with fp16 loss scaling the step is skipped when any gradient
    of the model overflowed, which is known only once the whole backward has run: the step
    calls ``apply_update_(lr, 1 / scale, skip=found_inf)`` (``pending_nonfinite()`` adds this
    module's share to ``found_inf``). Several forward/backward passes before one update
    accumulate (one queued item each). Plain SGD (no momentum, no weight decay), or row-wise
    Adagrad when the step passes the accumulator (``rowwise_state``): this module applies the
    rule, the optimizer (``dlrm.training.optimizers``) owns the state and its checkpoints.

    Multi-hot ids (``Bags``) take ``bag_gather`` forward and queue ``(values, offsets,
    per_sample_weights, grad)``, applied by ``bag_sgd_update``; both kinds may share a queue.
    Padded ``Bags`` (``Bags.padded_to``: the static shapes of a captured CUDA graph) are taken
    too, one pass per update: the padding gets the row id one past the last, which the kernels
    read as zeros and never update, and weight 0, so the step is the unpadded step's.
    Row-wise Adagrad runs ``bag_rowwise_adagrad_update`` on the whole queue as one bag batch (a
    one-hot item is bags of one), because its update is not linear in the gradient: a row's
    gradients of the whole step must be summed before its accumulator moves.
    """

    def _make_weights(self, device: torch.device | str, weight_dtype: torch.dtype) -> None:
        super()._make_weights(device, weight_dtype)
        self._pending: list[PendingUpdate | PendingBagUpdate] = []

    def forward(self, ids: torch.Tensor | Bags) -> torch.Tensor:
        if isinstance(ids, Bags) or self.row_sharded:
            return self._pool_bags(self._as_bags(ids))
        if exporting():
            # torch.jit.trace / torch.export cannot record the kernel's autograd.Function: they
            # get the joint layout's plain gather of the same rows (in the weight's dtype).
            return super().forward(ids)
        rows = (self._prepare_ids(ids) + self.offsets).reshape(-1)
        # Output in the compute dtype (what autocast would compute in, else the weight's).
        out = _FusedLookup.apply(self.weight, rows, self.output_dtype(), self._pending)
        return out.view(ids.shape[0], self.num_tables, self.embedding_dim)

    def _pool_bags(self, bags: Bags) -> torch.Tensor:
        """The joint layout's pooled lookup on the fused kernels: ``bag_gather`` writes ``[B, T, D]``
        in the compute dtype, and the backward queues the bag update."""
        batch = self._bag_batch_size(bags)  # also refuses export
        if batch == 0:
            return self.weight.new_zeros(0, self.num_tables, self.embedding_dim, dtype=self.output_dtype())
        rows, weights = self._joint_bags(bags, batch)
        return _FusedBagLookup.apply(self.weight, rows, bags.offsets.to(torch.int64), weights, self.output_dtype(),
                                     self.num_tables, self._pending, bags.padded)

    def _takes_padded_bags(self) -> bool:
        # A subclass with a lookup of its own (the host-table cache) must opt in itself.
        return type(self).forward is JointFusedEmbedding.forward

    def output_dtype(self) -> torch.dtype:
        """The compute dtype, which the kernels write directly: autocast's when it is on (under
        AMP no fp32 ``[B, F, D]`` is made only to be cast), else the weights' (fp32 for half tables)."""
        dtype = compute_dtype(self.weight)
        return torch.float32 if dtype in HALF_DTYPES and not torch.is_autocast_enabled(self.weight.device.type) else dtype

    @property
    def has_pending_update(self) -> bool:
        return bool(self._pending)

    def pending_nonfinite(self) -> torch.Tensor:
        """0-dim bool on the weight's device: whether any queued gradient value is inf/NaN
        (no host sync, so it can join the step's ``found_inf``)."""
        flags = [torch.isfinite(item[-1]).all().logical_not() for item in self._pending]  # grad is last in both kinds
        if not flags:
            return torch.zeros((), dtype=torch.bool, device=self.weight.device)
        return torch.stack(flags).any()

    def apply_update_(
        self,
        lr: float | torch.Tensor,
        grad_scale: float | torch.Tensor = 1.0,
        skip: bool | torch.Tensor | None = None,
        rowwise_state: torch.Tensor | None = None,
        eps: float = ADAGRAD_EPS,
        rounding_step: torch.Tensor | None = None,
    ) -> None:
        """Applies the queued gradients, ``g[r] = grad_scale * (sum of queued gradients of row r)``
        for every row used, none of it when ``skip`` is true (the queue is cleared either way):
        SGD, ``weight[r] -= lr * g[r]``, or with ``rowwise_state`` (fp32 ``[rows]``, updated in
        place) row-wise Adagrad, ``state[r] += mean(g[r]^2); weight[r] -= lr * g[r] / (sqrt(state[r])
        + eps)``. Each scalar is a Python number or a one-element tensor (e.g. a GradScaler's
        ``found_inf``); tensors already on the weight's device keep the whole update free of
        host syncs. fp16/bf16 tables take the whole queue as one update, computed in fp32 and
        rounded once per row: to nearest, or stochastically (bf16) with ``rounding_step`` (a
        0-dim int64 device tensor that should change every step, see ``dlrm.kernels.rounding``)."""
        device = self.weight.device
        lr_t = _device_scalar(lr, torch.float32, device)
        scale_t = _device_scalar(grad_scale, torch.float32, device)
        skip_t = _device_scalar(False if skip is None else skip, torch.bool, device)
        if rounding_step is not None:
            rounding_step = rounding_step.to(device)  # tables in host memory: the step's counter is on the GPU
        if not self._pending:
            return
        if rowwise_state is not None or self.weight.dtype in HALF_DTYPES:
            batch = self._pending_as_one_bag_batch()
            values, offsets, per_sample_weights, grad = batch
            padded = isinstance(batch, PaddedBagUpdate)
            if rowwise_state is not None:
                bag_rowwise_adagrad_update(self.weight, rowwise_state, values, offsets, grad, lr_t, scale_t, skip_t,
                                           per_sample_weights, eps, rounding_step=rounding_step, padded=padded)
            else:
                bag_sgd_update(self.weight, values, offsets, grad, lr_t, scale_t, skip_t, per_sample_weights,
                               rounding_step=rounding_step, padded=padded)
            self._pending.clear()
            return
        for item in self._pending:
            if isinstance(item, PendingBagUpdate):
                bag_sgd_update(self.weight, item.values, item.offsets, item.grad, lr_t, scale_t, skip_t,
                               item.per_sample_weights, padded=isinstance(item, PaddedBagUpdate))
            else:
                rows, grad = item
                sgd_update(self.weight, rows, grad, lr_t, scale_t, skip_t)
        self._pending.clear()

    def _pending_as_one_bag_batch(self) -> PendingBagUpdate:
        """The whole queue as one bag update: a one-hot item is bags of one (offsets ``0..N``);
        several items are concatenated (gradients as ``[bags, D]`` in bag order). Shapes only, no
        host sync."""
        items = []
        for item in self._pending:
            if isinstance(item, PendingBagUpdate):
                items.append(item)
            else:
                rows, grad = item
                offsets = torch.arange(rows.shape[0] + 1, dtype=torch.int64, device=rows.device)
                items.append(PendingBagUpdate(rows, offsets, None, grad))
        if len(items) == 1:
            return items[0]
        if any(isinstance(item, PaddedBagUpdate) for item in items):
            # Concatenated, an item's padding would fall into the next item's first bag.
            raise ValueError("padded Bags take one forward and backward per update: apply the update "
                             "(`apply_update_`) before the next pass")
        values, offsets, weights, grads, start = [], [], [], [], 0
        for item in items:
            num_bags = item.offsets.shape[0] - 1
            values.append(item.values.to(torch.int64))
            bounds = item.offsets.to(torch.int64) + start
            offsets.append(bounds[1:] if offsets else bounds)  # one leading 0, then every item's ends
            grads.append(item.grad if item.grad.dim() == 2
                         else item.grad.transpose(0, 1).reshape(num_bags, item.grad.shape[-1]))
            weights.append(item.per_sample_weights)
            start += item.values.shape[0]
        if all(w is None for w in weights):
            per_sample_weights = None
        else:
            dtype = next(w.dtype for w in weights if w is not None)
            per_sample_weights = torch.cat([torch.ones(v.shape[0], dtype=dtype, device=v.device) if w is None else w
                                            for w, v in zip(weights, values)])
        return PendingBagUpdate(torch.cat(values), torch.cat(offsets), per_sample_weights, torch.cat(grads))

    def discard_pending_(self) -> None:
        """Drops the queued gradients (e.g. after an evaluation pass that ran a backward)."""
        self._pending.clear()



def _device_scalar(value: float | bool | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor on ``device``; from a Python number by a fill (no blocking copy)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(())
    return torch.full((), value, dtype=dtype, device=device)
