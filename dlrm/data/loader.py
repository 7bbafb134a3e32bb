"""Batch order and background prefetching.

Shuffling permutes whole batches (files carry rows in written order), seeded by (seed, epoch) so
every rank computes the same order without talking to the others. The prefetcher overlaps
disk reads and host-to-device copies with the training step.
"""

from __future__ import annotations

import queue
import threading
import weakref
from typing import Any, Iterator, Protocol, Sequence

import numpy as np
import torch

from dlrm.data.batch import Bags, Batch

_POLL_S = 0.05  # how often blocked queue operations look at the stop event


def batch_order(num_batches: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Batch indices for one epoch: a permutation seeded by [seed, epoch], or 0..n-1 in order."""
    if num_batches < 0:
        raise ValueError(f"num_batches must be >= 0, got {num_batches}")
    if not shuffle:
        return np.arange(num_batches, dtype=np.int64)
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0 for a reproducible order, got seed={seed}, epoch={epoch}")
    return np.random.default_rng([int(seed), int(epoch)]).permutation(num_batches).astype(np.int64)


class BatchSource(Protocol):
    batch_size: int
    num_samples: int

    def __len__(self) -> int: ...

    def read_batch(self, index: int) -> Batch: ...


class RowOffsetSource:
    """The batches of ``source`` that start ``offset`` rows into the split: where a run resumed
    with another batch size continues, at the exact next sample. ``source`` reads any row range
    (``read_rows``), as the split-binary reader does."""

    def __init__(self, source: Any, offset: int):
        self.source = source
        self.offset = offset
        self.batch_size = source.batch_size
        self.num_samples = max(source.num_samples - offset, 0)

    def __len__(self) -> int:
        return -(-self.num_samples // self.batch_size)

    def read_batch(self, index: int) -> Batch:
        start = index * self.batch_size
        return self.source.read_rows(self.offset + start, min(self.batch_size, self.num_samples - start))


def remaining_batches(
    source: Any, epoch: int, samples_done: int, seed: int, shuffle: bool
) -> tuple[Any, np.ndarray, int]:
    """What is left of an epoch of which ``samples_done`` samples are trained: ``(source to read,
    batch indices in order, the sample the first of them starts at)``.

    On a batch boundary of the source's batch size this is the rest of the epoch's batch order.
    Between boundaries (a resume with another batch size; callers refuse that for a shuffled
    order, whose batches were of the old size) a source that reads any rows continues at the exact
    next sample, and one that generates whole batches (synthetic data) at the next boundary."""
    batch_size, num_samples = source.batch_size, source.num_samples
    if samples_done >= num_samples:
        return source, np.zeros(0, dtype=np.int64), num_samples
    if samples_done % batch_size == 0:
        order = batch_order(len(source), epoch, seed, shuffle)
        return source, order[samples_done // batch_size:], samples_done
    if getattr(source, "reads_any_rows", hasattr(source, "read_rows")):
        offset = RowOffsetSource(source, samples_done)
        return offset, np.arange(len(offset), dtype=np.int64), samples_done
    first = -(-samples_done // batch_size)
    return source, np.arange(first, len(source), dtype=np.int64), min(first * batch_size, num_samples)


class _End:
    """Marks the end of the stream in the queue."""


class _Failure:
    """Carries an exception raised by the worker to the consumer."""

    def __init__(self, exc: BaseException):
        self.exc = exc


def _tensors(batch: Batch) -> tuple[torch.Tensor, ...]:
    """Every tensor of a batch (a ``Bags`` contributes its values and offsets)."""
    c = batch.categorical
    if isinstance(c, Bags):
        return batch.numerical, c.values, c.offsets, batch.label
    return batch.numerical, c, batch.label


def _on_device(batch: Batch, device: torch.device) -> bool:
    for t in _tensors(batch):
        if t.device.type != device.type or (device.index is not None and t.device.index != device.index):
            return False
    return True


def _put(q: queue.Queue, item: Any, stop: threading.Event) -> bool:
    """Blocking put that gives up when asked to stop, so the worker never hangs on a full queue."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _stage(batch: Batch, device: torch.device, stream: "torch.cuda.Stream | None") -> tuple[Batch, Any]:
    """Move a host batch towards ``device``; on CUDA the copy is async and an event marks its end."""
    if _on_device(batch, device):
        return batch, None
    if stream is None:
        return batch.to(device), None
    host = batch.pin_memory()
    with torch.cuda.stream(stream):
        moved = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    return moved, event


def _work(
    source: BatchSource,
    order: list[int],
    device: torch.device,
    stream: "torch.cuda.Stream | None",
    out: queue.Queue,
    stop: threading.Event,
) -> None:
    """Thread body. Holds no reference to the loader, so dropping the loader can stop it."""
    try:
        for index in order:
            if stop.is_set():
                return
            item = _stage(source.read_batch(index), device, stream)
            if not _put(out, item, stop):
                return
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which re-raises it
        _put(out, _Failure(exc), stop)
        return
    _put(out, _End(), stop)


class PrefetchLoader:
    """Reads batches of any `source` (anything with __len__ and read_batch(i) -> Batch) in `order`
    on a background thread, `prefetch` batches ahead, and yields them on `device`.

    On CUDA the host batch is pinned and copied on a side stream; the consuming stream waits on
    an event before the batch is yielded. Batches already on `device` pass through. An exception
    in the thread is re-raised in the consumer at the batch where it happened. The thread stops
    when iteration ends, on close(), or when the iterator is garbage collected; it is a daemon
    and only ever blocks with a timeout, so it cannot hang interpreter exit.
    """

    def __init__(self, source: BatchSource, order: Sequence[int], device: torch.device | str, prefetch: int = 2):
        if prefetch < 1:
            raise ValueError(f"prefetch must be >= 1, got {prefetch}")
        self.source = source
        self.order = [int(i) for i in order]
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefetch = int(prefetch)
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._consumer: weakref.ref | None = None  # weak: the loader must not keep its iterator alive

    def __len__(self) -> int:
        return len(self.order)

    @property
    def thread(self) -> threading.Thread | None:
        """The current worker thread (for diagnostics); None before the first iteration."""
        return self._thread

    def __iter__(self) -> Iterator[Batch]:
        self.close()  # a new pass replaces any unfinished one
        stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
        out: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        thread = threading.Thread(
            target=_work,
            args=(self.source, self.order, self.device, stream, out, stop),
            name="PrefetchLoader",
            daemon=True,
        )
        self._thread, self._stop = thread, stop
        thread.start()
        consumer = self._consume(out, stop, thread)
        # Also covers an iterator dropped before its first next(), whose finally never runs.
        weakref.finalize(consumer, _shutdown, out, stop, thread).atexit = False
        self._consumer = weakref.ref(consumer)
        return consumer

    def _consume(self, out: queue.Queue, stop: threading.Event, thread: threading.Thread) -> Iterator[Batch]:
        try:
            while True:
                try:
                    item = out.get(timeout=_POLL_S)
                except queue.Empty:
                    if stop.is_set() or not thread.is_alive() and out.empty():
                        return
                    continue
                if isinstance(item, _End):
                    return
                if isinstance(item, _Failure):
                    raise item.exc
                batch, event = item
                if event is not None:
                    current = torch.cuda.current_stream(self.device)
                    current.wait_event(event)
                    for t in _tensors(batch):
                        t.record_stream(current)
                yield batch
        finally:
            _shutdown(out, stop, thread)

    def close(self) -> None:
        """Stop the worker (mid-iteration too), free staged batches and wait for the thread to exit."""
        consumer = self._consumer() if self._consumer is not None else None
        if consumer is not None:
            try:
                consumer.close()  # runs its cleanup; a later next() raises StopIteration
            except ValueError:  # close() called from inside the running generator
                pass
        if self._stop is not None and self._thread is not None:
            self._stop.set()
            if self._thread is not threading.current_thread():
                self._thread.join()
        self._stop = None
        self._consumer = None

    def __del__(self) -> None:
        if getattr(self, "_stop", None) is not None:
            self._stop.set()


def _shutdown(out: queue.Queue, stop: threading.Event, thread: threading.Thread) -> None:
    stop.set()
    while True:  # drop staged batches so their memory goes now
        try:
            out.get_nowait()
        except queue.Empty:
            break
    if thread is not threading.current_thread():
        thread.join(timeout=10)
