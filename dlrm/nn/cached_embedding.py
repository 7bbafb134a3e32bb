"""A cache of hot rows on the device in front of tables held in host memory.

Tables larger than device memory stay in (pinned) host memory; the rows a batch uses are looked
up in a fixed number of device slots, as TorchRec/FBGEMM's UVM caching does. Per call:

1. the batch's rows, made unique on the device, are looked up in the slot map (``[rows]`` int32
   on the device, -1 for a row not cached: 4 bytes per row against ``4 * D`` for the row itself);
2. the misses get slots: empty ones first, then the least recently (``"lru"``) or least often
   (``"lfu"``) used slots that this step does not use (a selection of the ``misses`` lowest
   scores, ties to the lowest slot: no sort of every slot); evicted rows that an update touched
   since they were fetched or last written back (``slot_dirty``) are written back to the host
   table with their row-wise Adagrad accumulator, clean ones are dropped (the host copy is
   current), and the misses are fetched in one batched copy;
3. the lookup and the deferred update run on the cache exactly as ``JointFusedEmbedding`` runs
   on its weight, with slots in place of rows: the same kernels, the same sums.

The module is a ``JointFusedEmbedding`` whose ``weight`` is the whole table on the host, so the
optimizer (row-wise Adagrad state keyed by that weight, ``[rows]`` on the host), checkpoints
(``table_weight`` flushes first) and ``fused_train_step`` use it unchanged. The row-wise
accumulator follows its rows: it is bound at the first update (``apply_update_`` receives it),
cached beside the rows and written back with them.

Prefetch (``prefetch_``, wired into the training loop by ``prefetching``): the loop hands the
cache the next batch's ids before the current step; once the step's update is queued
(``apply_update_``), the cache fetches the next batch's misses into slots that the step does not
use (so a row with a queued update is never evicted, and a cached row is never fetched again).
On CUDA that fetch runs on a side stream that waits only for the step's lookups, so the host's
part (reading which rows miss, gathering them from the host table) runs while the GPU works
through the step's MLPs, backward and update, and the next forward waits on its event; on the
CPU it runs in place. A lookup without an update to queue (evaluation) runs a queued prefetch
at once. A row fetched ahead counts as a miss of the lookup that first uses it, so the hit rate
means the same with and without prefetch.

Host syncs: the number of misses is read on the host once per call (to size the copy), so a
step with a cache cannot be captured in a CUDA graph; a prefetch reads its own on the side
stream, which waits only for the step's lookups, not for its MLPs, backward or update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from dlrm.data.batch import Bags
from dlrm.kernels.backend import compute_dtype
from dlrm.kernels.embedding import sgd_update
from dlrm.kernels.embedding_bag import ADAGRAD_EPS, bag_rowwise_adagrad_update, bag_sgd_update
from dlrm.kernels.rounding import HALF_DTYPES
from dlrm.nn.embeddings import JointFusedEmbedding
from dlrm.nn.fused_lookup import PendingBagUpdate, _FusedBagLookup, _FusedLookup

POLICIES = ("lru", "lfu")
# Device bytes per slot besides the row and its accumulator: slot_row and slot_score (int64),
# slot_pinned, slot_dirty and slot_prefetched (bool). The planner sizes ``auto`` caches with it.
SLOT_BOOKKEEPING_BYTES = 8 + 8 + 3
# The cached accumulator (fp32, one per slot whatever the optimizer: row-wise Adagrad's state).
SLOT_STATE_BYTES = 4
# Victims are selected (top-k) when they are fewer than 1/SELECT_BELOW of the candidates, as a
# step's misses usually are; more of them are taken from a sort, which is then the cheaper.
SELECT_BELOW = 16


class CacheTooSmallError(ValueError):
    """A batch looks up more distinct rows than the cache has slots (the user's setting, not a
    fault: the command line reports it in one line; the run saves its last whole step first)."""


class CachedEmbedding(JointFusedEmbedding):
    """``JointFusedEmbedding`` kept on the host behind ``cache_rows`` device slots.

    ``cache_device`` holds the slots (on a CPU machine it may be the CPU: the cache is then just
    another tensor, and every path runs). Counters: ``lookups``, ``lookup_misses`` (ids whose row
    was not cached when their step asked for it: fetched by the lookup, or ahead of it by a
    prefetch), ``unique_rows``, ``unique_misses`` (those rows, once per lookup), ``prefetched``
    (rows fetched ahead by ``prefetch_``), ``writebacks`` (rows copied back to the host, on
    eviction or flush: only rows an update touched since their last copy, unless
    ``track_dirty=False``, which writes back every evicted row and flushes every cached one);
    ``hit_rate()`` is ``1 - lookup_misses / lookups``.
    """

    PARALLEL_INIT = False  # its table_weight flushes the cache: one table at a time

    def __init__(self, table_sizes: Sequence[int], embedding_dim: int, *args, cache_rows: int,
                 cache_device: torch.device | str | None = None, policy: str = "lru", track_dirty: bool = True,
                 **kwargs) -> None:
        super().__init__(table_sizes, embedding_dim, *args, **kwargs)
        if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) or cache_rows < 1:
            raise ValueError(f"`cache_rows` must be a positive integer, got {cache_rows!r}")
        if policy not in POLICIES:
            raise ValueError(f"`policy` must be one of {list(POLICIES)}, got {policy!r}")
        if self.row_sharded:
            raise ValueError("a cached table must be whole: row-wise blocks are not cached")
        device = torch.device(cache_device) if cache_device is not None else self.weight.device
        total = self.weight.shape[0]
        self.cache_rows, self.policy, self.track_dirty = min(cache_rows, total), policy, track_dirty
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
        # Slots an update changed since their row was fetched or written back: the host copy is stale.
        self.register_buffer("slot_dirty", torch.zeros(slots, dtype=torch.bool, device=device), persistent=False)
        # Slots a prefetch filled that no lookup has used yet (their first lookup counts them as misses).
        self.register_buffer("slot_prefetched", torch.zeros(slots, dtype=torch.bool, device=device),
                             persistent=False)
        for name in ("offsets", "rows", "row_start", "block_rows", "mean_pooled"):  # ids are prepared there
            setattr(self, name, getattr(self, name).to(device))
        self._host_state: torch.Tensor | None = None  # the optimizer's row-wise accumulator, once seen
        self._dirty = False  # any update since the last flush (spares a flush the look at every slot)
        self._calls = 0
        self._score_limit = 0  # no slot scores more (the victims' keys must fit in int64)
        self._request: torch.Tensor | None = None  # joint rows a prefetch_ queued for the next forward
        self._stream: Any = None  # CUDA: the side stream prefetches run on
        self._prefetch_done: Any = None  # CUDA: the event of the last prefetch, until a stream waits on it
        self._used: list[torch.Tensor] = []  # slots of the lookups whose update is queued (the pinned ones)
        self._lookup_done: Any = None  # CUDA: the event of the last lookup's fill, which a prefetch waits for
        # The CPU's sort is not stable: equal ids' gradients are summed in an order that depends on the
        # ids' values, so the update runs on the rows' ranks (ordered as the rows, whatever their slots).
        self._row_order = device.type == "cpu"
        self.lookups = self.lookup_misses = self.unique_rows = self.unique_misses = 0
        self.prefetched = self.writebacks = 0

    # ---------------------------------------------------------------------------------------
    # Slots

    @torch.no_grad()
    def _slots_for(self, rows: torch.Tensor, pin: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots holding ``rows`` (joint rows, any device), fetching the misses: ``([N] int64 per
        id, the distinct slots)``. ``pin``: the lookup's backward will queue these slots (the
        caller's grad mode: in here it is off), so none may move before the update."""
        self._join_prefetch()
        device = self.cache_weight.device
        rows = rows.to(device=device, dtype=torch.int64)
        self._calls += 1
        unique, inverse, counts = torch.unique(rows, return_inverse=True, return_counts=True)
        slots = self.slot_map[unique].to(torch.int64)
        missing = slots < 0
        needed = missing | (self.slot_prefetched[slots.clamp(min=0)] & ~missing)  # fetched ahead for this lookup
        # The host sync: sizes the fetch (and reads the counters with it).
        num_missing, num_needed, needed_ids = torch.stack(
            [missing.sum(), needed.sum(), (counts * needed).sum()]).tolist()
        self.lookups += rows.numel()
        self.lookup_misses += needed_ids
        self.unique_rows += unique.numel()
        self.unique_misses += num_needed
        if num_missing:
            slots[missing] = self._fill_(unique[missing], slots[~missing])
        self.slot_prefetched[slots] = False
        if self.policy == "lru":
            self.slot_score[slots] = self._score_limit = self._calls
        else:
            self.slot_score.index_add_(0, slots, counts)
            self._score_limit += rows.numel()
        if pin:
            self.slot_pinned[slots] = True
        return slots[inverse], slots

    def _fill_(self, rows: torch.Tensor, hits: torch.Tensor) -> torch.Tensor:
        """Slots for the uncached ``rows``: free ones, then victims (written back), then fetched."""
        free = ~self.slot_pinned
        free[hits] = False
        candidates = free.nonzero().squeeze(1)
        if candidates.numel() < rows.numel():
            raise CacheTooSmallError(
                f"`cache_rows={self.cache_rows}` is too small: one step needs {rows.numel()} more rows than the "
                f"{candidates.numel()} slots it may evict; give at least the distinct rows one batch looks up in "
                f"the cached tables (at most the batch size times the ids per sample)")
        victims = self._victims(candidates, rows.numel())
        self._place_(rows, victims)
        return victims

    def _victims(self, candidates: torch.Tensor, k: int) -> torch.Tensor:
        """The ``k`` of ``candidates`` (ascending slots) with the lowest ``(score, slot)``, in that
        order: what a stable sort of every candidate's score puts first (empty slots score -1 and
        go first; ties fall to the lowest slot), selected without sorting every candidate: a
        ``topk`` of ``(score + 1) * n + position``, one key per candidate (no ties), or where that
        key could overflow int64, ``_victims_by_threshold``; when ``k`` is a large share of the
        candidates, that stable sort itself."""
        n = candidates.numel()
        scores = self.slot_score[candidates]
        if k * SELECT_BELOW > n:  # many victims: one sort costs less than selecting them (benchmarks/host_cache.py)
            return candidates[torch.sort(scores, stable=True).indices[:k]]
        if (self._score_limit + 2) * n >= 2**62:
            return self._victims_by_threshold(candidates, scores, k)
        key = (scores + 1) * n + torch.arange(n, device=scores.device)
        return candidates[torch.topk(key, k, largest=False, sorted=True).indices]

    @staticmethod
    def _victims_by_threshold(candidates: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
        """``_victims`` by the k-th lowest score: the candidates below it, then of those at it the
        lowest slots, then a sort of the k chosen (linear in the candidates but for that sort)."""
        if k < candidates.numel():
            threshold = scores.kthvalue(k).values
            below = scores < threshold
            tied = scores == threshold
            room = k - below.sum()  # of the ties at the threshold, the lowest slots take the rest
            chosen = below | (tied & (tied.cumsum(0) <= room))
            candidates, scores = candidates[chosen], scores[chosen]
        return candidates[torch.sort(scores, stable=True).indices]

    def _place_(self, rows: torch.Tensor, victims: torch.Tensor) -> None:
        """``rows`` into the slots ``victims`` (one each): the victims' rows written back if
        dirty, then the rows (and accumulators) fetched from the host in one batched copy."""
        self._write_back_(victims)
        self.slot_map[rows] = victims.to(torch.int32)
        self.slot_row[victims] = rows
        self.slot_score[victims] = 0
        self.slot_dirty[victims] = not self.track_dirty  # untracked: every cached row counts as changed
        self.slot_prefetched[victims] = False
        host_rows = rows.cpu()
        self.cache_weight[victims] = self._to_cache(self.weight.detach().index_select(0, host_rows))
        if self._host_state is not None:
            self.cache_state[victims] = self._to_cache(self._host_state.index_select(0, host_rows))

    def _to_cache(self, host: torch.Tensor) -> torch.Tensor:
        """One batched host-to-device copy (pinned staging on CUDA)."""
        if self.cache_weight.device.type == "cuda":
            return host.pin_memory().to(self.cache_weight.device, non_blocking=True)
        return host.to(self.cache_weight.device)

    def _write_back_(self, slots: torch.Tensor) -> None:
        """Empties ``slots``, copying back to the host table and state the dirty ones (clean
        rows: the host copy is already current)."""
        held = self.slot_row[slots] >= 0
        write = slots[held & self.slot_dirty[slots]]
        slots = slots[held]
        if slots.numel() == 0:
            return
        if write.numel():
            self._copy_to_host(write, self.slot_row[write].cpu())
            self.writebacks += write.numel()
        self.slot_map[self.slot_row[slots]] = -1
        self.slot_row[slots] = -1
        self.slot_dirty[slots] = False

    @torch.no_grad()
    def flush_(self) -> None:
        """Writes every dirty cached row (and its accumulator) back to the host; the rows stay
        cached, clean."""
        if not self.__dict__.get("_dirty"):  # also while the parent constructor initialises the table
            return
        self._join_prefetch()
        slots = (self.slot_dirty & (self.slot_row >= 0)).nonzero().squeeze(1)
        if slots.numel():
            self._copy_to_host(slots, self.slot_row[slots].cpu())
            self.writebacks += slots.numel()
            if self.track_dirty:
                self.slot_dirty[slots] = False
        self._dirty = False

    def _copy_to_host(self, slots: torch.Tensor, host_rows: torch.Tensor) -> None:
        """The values (and accumulators) in ``slots`` into the host table's ``host_rows``."""
        self.weight.detach().index_copy_(0, host_rows, self.cache_weight[slots].cpu())
        if self._host_state is not None:
            self._host_state.index_copy_(0, host_rows, self.cache_state[slots].cpu().to(self._host_state.dtype))

    @torch.no_grad()
    def invalidate_(self) -> None:
        """Drops every cached row without writing it back (the host copy was replaced), and any
        queued prefetch."""
        self._join_prefetch()
        self._request = None
        self.slot_map.fill_(-1)
        self.slot_row.fill_(-1)
        self.slot_score.fill_(-1)
        self.slot_pinned.fill_(False)
        self.slot_dirty.fill_(False)
        self.slot_prefetched.fill_(False)
        self._dirty = False

    def hit_rate(self) -> float:
        """Share of looked-up ids whose row was already cached (1.0 before any lookup); a row a
        prefetch fetched for a lookup is that lookup's miss."""
        return 1.0 - self.lookup_misses / self.lookups if self.lookups else 1.0

    # ---------------------------------------------------------------------------------------
    # Prefetch

    @torch.no_grad()
    def prefetch_(self, ids: torch.Tensor | Bags) -> None:
        """Fetches the rows of ``ids`` (a later batch, as ``forward`` takes it) ahead: queued now,
        fetched once the next update is queued (``apply_update_``; or by the next lookup that
        queues none), into slots no lookup since the last update uses (those rows stay; a row
        already cached, with or without a pending update, is not fetched again). As many misses
        as such slots allow are fetched (the rest by their own lookup). On CUDA the fetch runs on
        a side stream while the step goes on; the forward after it waits on its event. A later
        call replaces the queued request."""
        self._request = self._joint_rows(ids)

    def _joint_rows(self, ids: torch.Tensor | Bags) -> torch.Tensor | None:
        """The joint rows ``forward`` would look up for ``ids`` (None for an empty batch)."""
        device = self.cache_weight.device
        if isinstance(ids, Bags):
            batch = self._bag_batch_size(ids)
            if batch == 0:
                return None
            bags = Bags(ids.values.to(device), ids.offsets.to(device), ids.num_features)
            return self._joint_bags(bags, batch)[0].to(torch.int64)
        ids = ids.to(device)
        rows = (self._prepare_ids(ids) + self.offsets).reshape(-1)
        return rows if rows.numel() else None

    def _note_lookup(self, used: torch.Tensor, queues_update: bool) -> None:
        """After a lookup of the slots ``used``: kept until the update when it queues one (a
        prefetch must leave them alone), else the queued prefetch runs now."""
        if queues_update:
            self._used.append(used)
            if used.device.type == "cuda":
                self._lookup_done = torch.cuda.Event()
                self._lookup_done.record(torch.cuda.current_stream(used.device))
        elif self._request is not None:
            self._lookup_done = None  # this lookup's fill is newer than that event: wait for the stream
            self._run_request(torch.cat([*self._used, used]))

    def _run_request(self, used: torch.Tensor) -> None:
        """The queued prefetch, into slots outside ``used`` (every slot a lookup since the last
        update holds). On CUDA on the side stream, after the last lookup's fill only: the step's
        later work, queued or not, goes on beside it."""
        rows, self._request = self._request, None
        if rows is None:
            return
        if self.cache_weight.device.type != "cuda":
            self._prefetch_rows(rows, used)
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.cache_weight.device)
        stream = self._stream
        if self._lookup_done is not None:  # the lookups' fills and slot maps: what the prefetch reads
            stream.wait_event(self._lookup_done)
        else:
            stream.wait_stream(torch.cuda.current_stream(self.cache_weight.device))
        with torch.cuda.stream(stream):
            rows.record_stream(stream)  # made on the step's stream: not reused while the side stream reads them
            used.record_stream(stream)
            self._prefetch_rows(rows, used)
            self._prefetch_done = torch.cuda.Event()
            self._prefetch_done.record(stream)

    def _prefetch_rows(self, rows: torch.Tensor, used: torch.Tensor) -> None:
        """Fetches the uncached of ``rows`` into slots outside ``used`` (which hold every pinned
        slot: ``slot_pinned`` itself is not read, the step's stream may be clearing it) and those
        holding ``rows``; as many as there are such slots."""
        unique = torch.unique(rows)
        slots = self.slot_map[unique].to(torch.int64)
        missing = slots < 0
        blocked = torch.zeros_like(self.slot_pinned)
        blocked[used] = True
        blocked[slots[~missing]] = True
        candidates = (~blocked).nonzero().squeeze(1)
        fetch = unique[missing]
        take = min(fetch.numel(), candidates.numel())
        if take == 0:
            return
        victims = self._victims(candidates, take)
        self._place_(fetch[:take], victims)
        self.slot_prefetched[victims] = True
        if self.policy == "lru":
            self.slot_score[victims] = self._calls  # as recent as the current step's rows
        self.prefetched += take

    def _join_prefetch(self) -> None:
        """Makes the current stream wait for the last prefetch (CUDA; nothing to wait for on the CPU)."""
        if self._prefetch_done is not None:
            torch.cuda.current_stream(self.cache_weight.device).wait_event(self._prefetch_done)
            self._prefetch_done = None

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
            queues_update = self._queues_update()
            slots, used = self._slots_for(rows, queues_update)
            out = _FusedBagLookup.apply(self._tracked_cache(), slots, bags.offsets.to(torch.int64), weights,
                                        self.output_dtype(), self.num_tables, self._pending, False)
        else:
            ids = ids.to(self.cache_weight.device)
            rows = (self._prepare_ids(ids) + self.offsets).reshape(-1)
            queues_update = self._queues_update()
            slots, used = self._slots_for(rows, queues_update)
            out = _FusedLookup.apply(self._tracked_cache(), slots, self.output_dtype(), self._pending)
            out = out.view(ids.shape[0], self.num_tables, self.embedding_dim)
        self._note_lookup(used, queues_update)
        return out

    def _queues_update(self) -> bool:
        """Whether a lookup now has a backward, which queues an update of its slots."""
        return self.weight.requires_grad and torch.is_grad_enabled()

    def _tracked_cache(self) -> torch.Tensor:
        """The cache as a leaf that requires grad (sharing its storage), so that autograd runs the
        lookup's backward, which queues the update; the cache itself is a buffer."""
        return self.cache_weight.detach().requires_grad_(self._queues_update())

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
        """``JointFusedEmbedding.apply_update_`` on the cached rows (the queue holds slots), which
        turn dirty. ``rowwise_state`` is the optimizer's ``[rows]`` host accumulator: the cache
        keeps its cached rows' part and writes it back with them."""
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
            for item in pending:  # a skipped update leaves them as they were: written back for nothing
                self.slot_dirty[item.values if isinstance(item, PendingBagUpdate) else item[0]] = True
        if pending and (state is not None or self.cache_weight.dtype in HALF_DTYPES):
            values, offsets, weights, grad = self._pending_as_one_bag_batch()
            if state is not None:
                self._on_rows(values, True, lambda w, s, v: bag_rowwise_adagrad_update(
                    w, s, v, offsets, grad, lr_t, scale_t, skip_t, weights, eps))
            else:
                self._on_rows(values, False, lambda w, s, v: bag_sgd_update(
                    w, v, offsets, grad, lr_t, scale_t, skip_t, weights))
        elif pending:
            for item in pending:
                if isinstance(item, PendingBagUpdate):
                    self._on_rows(item.values, False, lambda w, s, v, item=item: bag_sgd_update(
                        w, v, item.offsets, item.grad, lr_t, scale_t, skip_t, item.per_sample_weights))
                else:
                    self._on_rows(item[0], False, lambda w, s, v, item=item: sgd_update(
                        w, v, item[1], lr_t, scale_t, skip_t))
        used = self._used
        self.discard_pending_()
        if self._request is not None:  # the next batch's rows, while the device works through this step
            self._run_request(torch.cat(used) if used else self.slot_pinned.new_zeros(0, dtype=torch.int64))

    def _on_rows(self, slots: torch.Tensor, with_state: bool,
                 update: Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], None]) -> None:
        """``update(weight, state, ids)`` of the cached rows in ``slots``. Where the kernels' sort
        is not stable (the CPU), on a copy of the rows those slots hold, keyed by the rows' ranks,
        so that equal ids' gradients are summed in the order the uncached table sums them."""
        state = self.cache_state if with_state else None
        if not self._row_order:
            update(self.cache_weight, state, slots)
            return
        rows, ranks = torch.unique(self.slot_row[slots.to(torch.int64)], return_inverse=True)
        held = self.slot_map[rows].to(torch.int64)  # ascending rows, so the ranks order ids as the rows do
        weight = self.cache_weight[held]
        state_rows = state[held] if state is not None else None
        update(weight, state_rows, ranks.reshape(slots.shape))
        self.cache_weight[held] = weight
        if state is not None:
            self.cache_state[held] = state_rows

    def _bind_state(self, state: torch.Tensor) -> None:
        """Takes the optimizer's accumulator: the cached rows' part comes from it (the host holds
        every row's current value: no update has used the cache's copy yet)."""
        self._join_prefetch()
        self._host_state = state
        self.cache_state = self.cache_state.to(state.dtype)  # the kernels update it in the optimizer's dtype
        slots = (self.slot_row >= 0).nonzero().squeeze(1)
        self.cache_state[slots] = self._to_cache(state.index_select(0, self.slot_row[slots].cpu()))

    def discard_pending_(self) -> None:
        self._pending.clear()
        self.slot_pinned.fill_(False)
        self._used = []
        self._lookup_done = None

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


class _Ahead:
    """The batches of ``batches``, each handed out after ``prefetch`` got the next one's ids."""

    def __init__(self, batches: Iterable[Any], prefetch: Callable[[Any], None]) -> None:
        self.batches, self.prefetch = batches, prefetch

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.batches)
        current = next(batches, None)
        while current is not None:
            following = next(batches, None)
            if following is not None:
                self.prefetch(following.categorical)
            yield current
            current = following

    def close(self) -> None:
        close = getattr(self.batches, "close", None)
        if close is not None:
            close()


def prefetching(batches: Iterable[Any], model: torch.nn.Module) -> Iterable[Any]:
    """``batches`` (of a model's training loop) with the model's host-table cache fetching each
    next batch's rows during the step before (``CachedEmbedding.prefetch_``); ``batches`` itself
    for a model without a cache. The model is DLRM-like: ``host_embeddings`` looks up the ids
    ``host_ids(categorical)`` of each batch."""
    cache = getattr(model, "host_embeddings", None)
    host_ids = getattr(model, "host_ids", None)
    if not isinstance(cache, CachedEmbedding) or host_ids is None:
        return batches

    def prefetch(categorical: torch.Tensor | Bags) -> None:
        cache.prefetch_(host_ids(categorical))

    return _Ahead(batches, prefetch)
