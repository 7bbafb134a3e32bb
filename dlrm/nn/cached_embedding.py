"""A cache of hot rows on the device in front of tables held in host memory.

Tables larger than device memory stay in (pinned) host memory; the rows a batch uses are looked
up in a fixed number of device slots, as TorchRec/FBGEMM's UVM caching does. Per call:

1. the batch's rows, made unique on the device, are looked up in the slot map (``[rows]`` int32
   on the device, -1 for a row not cached: 4 bytes per row against ``4 * D`` for the row itself);
2. the misses get slots: empty ones first, then the least recently (``"lru"``) or least often
   (``"lfu"``) used slots that this step does not use; evicted rows are written back to the host
   table (with their row-wise Adagrad accumulator) and the misses fetched in one batched copy;
3. the lookup and the deferred update run on the cache exactly as ``JointFusedEmbedding`` runs
   on its weight, with slots in place of rows: the same kernels, the same sums.

The module is a ``JointFusedEmbedding`` whose ``weight`` is the whole table on the host, so the
optimizer (row-wise Adagrad state keyed by that weight, ``[rows]`` on the host), checkpoints
(``table_weight`` flushes first) and ``fused_train_step`` use it unchanged. The row-wise
accumulator follows its rows: it is bound at the first update (``apply_update_`` receives it),
cached beside the rows and written back with them.

Host syncs: the number of misses is read on the host once per call (to size the copy), so a
step with a cache cannot be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dlrm.data.batch import Bags
from dlrm.kernels.backend import compute_dtype
from dlrm.kernels.embedding import sgd_update
from dlrm.kernels.embedding_bag import ADAGRAD_EPS, bag_rowwise_adagrad_update, bag_sgd_update
from dlrm.kernels.rounding import HALF_DTYPES
from dlrm.nn.embeddings import JointFusedEmbedding, PendingBagUpdate, _FusedBagLookup, _FusedLookup

POLICIES = ("lru", "lfu")


class CacheTooSmallError(ValueError):
    """A batch looks up more distinct rows than the cache has slots (the user's setting, not a
    fault: the command line reports it in one line; the run saves its last whole step first)."""


class CachedEmbedding(JointFusedEmbedding):
    """``JointFusedEmbedding`` kept on the host behind ``cache_rows`` device slots.

    ``cache_device`` holds the slots (on a CPU machine it may be the CPU: the cache is then just
    another tensor, and every path runs). Counters: ``lookups``, ``lookup_misses`` (ids whose row
    was not cached when looked up), ``unique_rows``, ``unique_misses`` (rows fetched),
    ``writebacks`` (rows written back); ``hit_rate()`` is ``1 - lookup_misses / lookups``.
    """

    def __init__(self, table_sizes: Sequence[int], embedding_dim: int, *args, cache_rows: int,
                 cache_device: torch.device | str | None = None, policy: str = "lru", **kwargs) -> None:
        super().__init__(table_sizes, embedding_dim, *args, **kwargs)
        if not isinstance(cache_rows, int) or cache_rows < 1:
            raise ValueError(f"`cache_rows` must be a positive integer, got {cache_rows!r}")
        if policy not in POLICIES:
            raise ValueError(f"`policy` must be one of {list(POLICIES)}, got {policy!r}")
        if self.row_sharded:
            raise ValueError("a cached table must be whole: row-wise blocks are not cached")
        device = torch.device(cache_device) if cache_device is not None else self.weight.device
        total = self.weight.shape[0]
        self.cache_rows, self.policy = min(cache_rows, total), policy
        if device.type == "cuda" and not self.weight.is_pinned():
            self.weight.data = self.weight.data.pin_memory()  # fetches and write-backs by DMA
        slots = self.cache_rows
        self.register_buffer("cache_weight", torch.zeros(slots, embedding_dim, dtype=self.weight.dtype, device=device),
                             persistent=False)
        self.register_buffer("cache_state", torch.zeros(slots, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("slot_map", torch.full((total,), -1, dtype=torch.int32, device=device), persistent=False)
        self.register_buffer("slot_row", torch.full((slots,), -1, dtype=torch.int64, device=device), persistent=False)
        # Eviction score (last step used, or uses) and slots a queued gradient still refers to.
        self.register_buffer("slot_score", torch.full((slots,), -1, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("slot_pinned", torch.zeros(slots, dtype=torch.bool, device=device), persistent=False)
        for name in ("offsets", "rows", "row_start", "block_rows", "mean_pooled"):  # ids are prepared there
            setattr(self, name, getattr(self, name).to(device))
        self._host_state: torch.Tensor | None = None  # the optimizer's row-wise accumulator, once seen
        self._dirty = False
        self._calls = 0
        self.lookups = self.lookup_misses = self.unique_rows = self.unique_misses = self.writebacks = 0

    # ---------------------------------------------------------------------------------------
    # Slots

    @torch.no_grad()
    def _slots_for(self, rows: torch.Tensor) -> torch.Tensor:
        """Slots holding ``rows`` (joint rows, any device), fetching the misses: ``[N]`` int64."""
        device = self.cache_weight.device
        rows = rows.to(device=device, dtype=torch.int64)
        self._calls += 1
        unique, inverse, counts = torch.unique(rows, return_inverse=True, return_counts=True)
        slots = self.slot_map[unique].to(torch.int64)
        missing = slots < 0
        num_missing = int(missing.sum())  # the host sync: sizes the fetch
        self.lookups += rows.numel()
        self.lookup_misses += int(counts[missing].sum()) if num_missing else 0
        self.unique_rows += unique.numel()
        self.unique_misses += num_missing
        if num_missing:
            slots[missing] = self._fill_(unique[missing], slots[~missing])
        if self.policy == "lru":
            self.slot_score[slots] = self._calls
        else:
            self.slot_score.index_add_(0, slots, counts)
        if torch.is_grad_enabled():
            self.slot_pinned[slots] = True  # the backward queues these slots: none may move before the update
        return slots[inverse]

    def _fill_(self, rows: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
        """Slots for the uncached ``rows``: free ones, then victims (written back), then fetched."""
        free = torch.ones_like(self.slot_pinned)
        free[hits] = False
        free &= ~self.slot_pinned
        candidates = free.nonzero().squeeze(1)
        if candidates.numel() < rows.numel():
            raise CacheTooSmallError(
                f"`cache_rows={self.cache_rows}` is too small: one step needs {rows.numel()} more rows than the "
                f"{candidates.numel()} slots it may evict; give at least the distinct rows one batch looks up in "
                f"the cached tables (at most the batch size times the ids per sample)")
        # Empty slots score -1 and go first; ties fall to the lowest slot (a stable sort).
        order = torch.sort(self.slot_score[candidates], stable=True).indices[: rows.numel()]
        victims = candidates[order]
        self._write_back_(victims)
        self.slot_map[rows] = victims.to(torch.int32)
        self.slot_row[victims] = rows
        self.slot_score[victims] = 0
        host_rows = rows.cpu()
        self.cache_weight[victims] = self._to_cache(self.weight.detach().index_select(0, host_rows))
        if self._host_state is not None:
            self.cache_state[victims] = self._to_cache(self._host_state.index_select(0, host_rows))
        return victims

    def _to_cache(self, host: torch.Tensor) -> torch.Tensor:
        """One batched host-to-device copy (pinned staging on CUDA)."""
        if self.cache_weight.device.type == "cuda":
            return host.pin_memory().to(self.cache_weight.device, non_blocking=True)
        return host.to(self.cache_weight.device)

    def _write_back_(self, slots: torch.Tensor) -> None:
        """Copies the rows in ``slots`` (those holding one) back to the host table and state, and
        empties the slots."""
        slots = slots[self.slot_row[slots] >= 0]
        if slots.numel() == 0:
            return
        rows = self.slot_row[slots]
        self._copy_to_host(slots, rows.cpu())
        self.slot_map[rows] = -1
        self.slot_row[slots] = -1
        self.writebacks += slots.numel()

    @torch.no_grad()
    def flush_(self) -> None:
        """Writes every cached row (and its accumulator) back to the host; the rows stay cached."""
        if not self.__dict__.get("_dirty"):  # also while the parent constructor initialises the table
            return
        slots = (self.slot_row >= 0).nonzero().squeeze(1)
        self._copy_to_host(slots, self.slot_row[slots].cpu())
        self._dirty = False

    def _copy_to_host(self, slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        """The values (and accumulators) in ``slots`` into the host table's ``host_rows``."""
        self.weight.detach().index_copy_(0, host_rows, self.cache_weight[slots].cpu())
        if self._host_state is not None:
            self._host_state.index_copy_(0, host_rows, self.cache_state[slots].cpu().to(self._host_state.dtype))

    @torch.no_grad()
    def invalidate_(self) -> None:
        """Drops every cached row without writing it back (the host copy was replaced)."""
        self.slot_map.fill_(-1)
        self.slot_row.fill_(-1)
        self.slot_score.fill_(-1)
        self.slot_pinned.fill_(False)
        self._dirty = False

    def hit_rate(self) -> float:
        """Share of looked-up ids whose row was already cached (1.0 before any lookup)."""
        return 1.0 - self.lookup_misses / self.lookups if self.lookups else 1.0

    # ---------------------------------------------------------------------------------------
    # The JointFusedEmbedding interface, on the cache

    def forward(self, ids: torch.Tensor | Bags) -> torch.Tensor:
        if isinstance(ids, Bags):
            batch = self._bag_batch_size(ids)
            if batch == 0:
                return self.cache_weight.new_zeros(0, self.num_tables, self.embedding_dim, dtype=self.output_dtype())
            bags = Bags(ids.values.to(self.cache_weight.device), ids.offsets.to(self.cache_weight.device),
                        ids.num_features)
            rows, weights = self._joint_bags(bags, batch)
            return _FusedBagLookup.apply(self._tracked_cache(), self._slots_for(rows), bags.offsets.to(torch.int64),
                                         weights, self.output_dtype(), self.num_tables, self._pending)
        ids = ids.to(self.cache_weight.device)
        rows = (self._prepare_ids(ids) + self.offsets).reshape(-1)
        out = _FusedLookup.apply(self._tracked_cache(), self._slots_for(rows), self.output_dtype(), self._pending)
        return out.view(ids.shape[0], self.num_tables, self.embedding_dim)

    def _tracked_cache(self) -> torch.Tensor:
        """The cache as a leaf that requires grad (sharing its storage), so that autograd runs the
        lookup's backward, which queues the update; the cache itself is a buffer."""
        return self.cache_weight.detach().requires_grad_(self.weight.requires_grad and torch.is_grad_enabled())

    def output_dtype(self) -> torch.dtype:
        dtype = compute_dtype(self.cache_weight)
        device_type = self.cache_weight.device.type
        return torch.float32 if dtype in HALF_DTYPES and not torch.is_autocast_enabled(device_type) else dtype

    def pending_nonfinite(self) -> torch.Tensor:
        flags = [torch.isfinite(item[-1]).all().logical_not() for item in self._pending]
        if not flags:
            return torch.zeros((), dtype=torch.bool, device=self.cache_weight.device)
        return torch.stack(flags).any()

    @torch.no_grad()
    def apply_update_(self, lr: float | torch.Tensor, grad_scale: float | torch.Tensor = 1.0,
                      skip: bool | torch.Tensor | None = None, rowwise_state: torch.Tensor | None = None,
                      eps: float = ADAGRAD_EPS, rounding_step: torch.Tensor | None = None) -> None:
        """``JointFusedEmbedding.apply_update_`` on the cached rows (the queue holds slots).
        ``rowwise_state`` is the optimizer's ``[rows]`` host accumulator: the cache keeps its
        cached rows' part and writes it back with them."""
        if rounding_step is not None and self.weight.dtype in HALF_DTYPES:
            raise ValueError("a cached table rounds to nearest: stochastic rounding is keyed by row, not by slot; "
                             "set `stochastic_rounding=False`")
        if rowwise_state is not None and rowwise_state is not self._host_state:
            self._bind_state(rowwise_state)
        device = self.cache_weight.device
        lr_t, scale_t = (_scalar(v, torch.float32, device) for v in (lr, grad_scale))
        skip_t = _scalar(False if skip is None else skip, torch.bool, device)
        pending, state = self._pending, (self.cache_state if rowwise_state is not None else None)
        if pending:
            self._dirty = True
        if pending and (state is not None or self.cache_weight.dtype in HALF_DTYPES):
            values, offsets, weights, grad = self._pending_as_one_bag_batch()
            if state is not None:
                bag_rowwise_adagrad_update(self.cache_weight, state, values, offsets, grad, lr_t, scale_t, skip_t,
                                           weights, eps)
            else:
                bag_sgd_update(self.cache_weight, values, offsets, grad, lr_t, scale_t, skip_t, weights)
        elif pending:
            for item in pending:
                if isinstance(item, PendingBagUpdate):
                    bag_sgd_update(self.cache_weight, item.values, item.offsets, item.grad, lr_t, scale_t, skip_t,
                                   item.per_sample_weights)
                else:
                    sgd_update(self.cache_weight, item[0], item[1], lr_t, scale_t, skip_t)
        self.discard_pending_()

    def _bind_state(self, state: torch.Tensor) -> None:
        """Takes the optimizer's accumulator: the cached rows' part comes from it (the host holds
        every row's current value: no update has used the cache's copy yet)."""
        self._host_state = state
        self.cache_state = self.cache_state.to(state.dtype)  # the kernels update it in the optimizer's dtype
        slots = (self.slot_row >= 0).nonzero().squeeze(1)
        self.cache_state[slots] = self._to_cache(state.index_select(0, self.slot_row[slots].cpu()))

    def discard_pending_(self) -> None:
        self._pending.clear()
        self.slot_pinned.fill_(False)

    def table_weight(self, i: int) -> torch.Tensor:
        """The host table, flushed first: what checkpoints save is current (the accumulator too)."""
        self.flush_()
        return super().table_weight(i)

    def load_table_(self, i: int, weight: torch.Tensor) -> None:
        """Loads the host table; the cached copies are stale then, and dropped (flushed first, so
        the other tables' updates are kept)."""
        self.flush_()
        super().load_table_(i, weight)
        self.invalidate_()

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, cache_rows={self.cache_rows}, policy={self.policy}, " \
               f"cache_device={self.cache_weight.device}"


def _scalar(value: float | bool | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).reshape(())
    return torch.full((), value, dtype=dtype, device=device)
