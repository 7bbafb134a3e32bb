"""Summing the replicated weights' gradients while the backward still runs, in buckets, as DDP does.

``GradientBuckets(params, bucket_bytes, group)`` registers a post-accumulate-grad hook on every
parameter. The parameters are split once, deterministically, into buckets of at most
``bucket_bytes`` (``bucket_layout``), walking them in reverse order: the order in which a
backward usually produces their gradients, and the order DDP assumes on its first iteration.
When a bucket's gradients are all accumulated, it is flattened into a buffer and
``dist.all_reduce(buffer, async_op=True)`` starts; ``synchronize()``, called once after the
backward, starts whatever buckets are left, waits for every one and copies the sums back into
``p.grad``.

Why: on GPUs NCCL runs beside the backward's kernels, so most of the all-reduce hides behind the
rest of the backward. On the 2-core CPU machine it gained nothing (the communication competes for
the same two cores as the backward; docs/distributed.md), so the single all-reduce after the
backward (``ProcessGroupCollectives.sync_gradients``) stays the default.

Why not torch's DDP bucketing instead: measured side by side (benchmarks/gradient_sync.py, 2 gloo
processes, the same model parts and bucket sizes, strategies alternated over 3 rounds; AMD EPYC,
2 vCPUs, 2026-11-26; docs/benchmarks.md) both give the after-backward all-reduce's gradients bit
for bit, and neither is faster: median step 433.8 ms (DDP, 25 MiB) vs 431.0 ms (this, 25 MiB),
444.9 vs 433.6 ms at 1 MiB, 435.8 ms after the backward. DDP would have to wrap the bottom and top
MLPs (two reducers, ``module.``-prefixed state dicts that checkpoints and optimizers then see, and
the sparse, model-parallel embeddings kept out by hand); these 200 lines hook the parameters the
model names as replicated (``replicated_parameters()``, ``dlrm.engine.model_contract``) and
leave the modules as they are.

Every process must issue the same collectives in the same order, or they pair up wrongly and
hang. The rules that make sure of it, and what they give:

- Buckets are started strictly in bucket order (a bucket that completes early waits for the ones
  before it, as in DDP's reducer), and ``synchronize()`` starts the rest in the same order, so
  each step issues exactly one all-reduce per bucket, in bucket order, on every process, whatever
  order the gradients arrive in and whichever gradients are missing.
- The all-reduces run on a process group of their own. The backward issues other collectives
  too (the embedding exchange's all-to-all); the point in the backward at which a bucket fills
  may differ between processes relative to those, and on a separate group it does not matter.
- Sums are the same numbers as the after-backward all-reduce's, but not always bit for bit:
  gloo's ring all-reduce adds the processes' values in an order that depends on an element's
  position in the buffer, so with 3 or more processes and several buckets the last bit can
  differ (2 processes: a + b = b + a, identical; one bucket: the same buffer, identical).
- A parameter without a gradient (unused in this step, on this process) counts as zeros; after
  ``synchronize()`` every parameter holds the sum, so the replicated weights stay identical
  (a parameter that no process used gets a zero gradient, not None).

The contract with the training loop: every backward through the model is run on every process
(as with DDP) and is followed by one ``synchronize()`` on every process. A backward that is not
(one whose sums nobody collects, e.g. a diagnostic backward) is discarded when the next backward
starts: its buckets are all-reduced (all of them, so that every process issues the same
collectives whichever gradients it had) and dropped, nothing is counted twice, and the
next ``synchronize()`` sums the gradients as they then are (the hooks read ``p.grad`` after
accumulation, so gradients accumulated over several backwards are summed once, in full). A
backward that runs on some processes only must be wrapped in ``paused()``: its hooks do
nothing, and no collective is issued.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Sequence

import torch
import torch.distributed as dist


def bucket_layout(params: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices into ``params``, bucket by bucket: the buckets are filled walking the parameters
    in reverse order, a new bucket whenever the next parameter would take the current one past
    ``bucket_bytes`` or has another dtype or device; a parameter larger than ``bucket_bytes``
    gets a bucket of its own. Each bucket is a run of consecutive parameters listed in parameter
    order (its buffer's layout), so one bucket is exactly the after-backward flat buffer.
    Depends only on the parameters' order, sizes, dtypes and devices: every process builds the
    same buckets."""
    if bucket_bytes <= 0:
        raise ValueError(f"`bucket_bytes` must be positive, got {bucket_bytes}")
    buckets: list[list[int]] = []
    current: list[int] = []
    size, key = 0, None
    for index in reversed(range(len(params))):
        param = params[index]
        nbytes = param.numel() * param.element_size()
        param_key = (param.dtype, param.device)
        if current and (param_key != key or size + nbytes > bucket_bytes):
            buckets.append(current[::-1])
            current, size = [], 0
        current.append(index)
        size += nbytes
        key = param_key
    if current:
        buckets.append(current[::-1])
    return buckets


class GradientBuckets:
    """Hooks on ``params`` that all-reduce (sum) their gradients on ``group`` in buckets while the
    backward runs; ``synchronize()`` finishes the step. See the module docstring for the contract."""

    def __init__(self, params: Sequence[torch.nn.Parameter], bucket_bytes: int, group: dist.ProcessGroup | None):
        self.params = list(params)
        self.group = group
        self.layout = bucket_layout(self.params, bucket_bytes)
        self._bucket_of = [0] * len(self.params)
        for b, indices in enumerate(self.layout):
            for i in indices:
                self._bucket_of[i] = b
        self._lock = threading.RLock()
        self._enabled = True
        self._reset()
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(self.params)]

    # -- per-step state -----------------------------------------------------------------------
    def _reset(self) -> None:
        self._ready = [False] * len(self.params)
        self._pending = [len(indices) for indices in self.layout]
        self._next = 0  # the next bucket to start: buckets start in order only
        self._in_flight: list[tuple[int, dist.Work, torch.Tensor]] = []
        self._backward_open = False  # a backward has fed this state and has not finished
        self._backward_done = False  # ... and has finished: a new hook means a new backward

    def _hook_for(self, index: int):
        def hook(param: torch.Tensor) -> None:
            self._on_gradient(index)
        return hook

    def _on_gradient(self, index: int) -> None:
        with self._lock:
            if not self._enabled:
                return
            if self._backward_done or self._ready[index]:
                # An earlier backward's sums were never collected: drop them (see the contract).
                self.discard()
            if not self._backward_open:
                self._backward_open = True
                torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)
            self._ready[index] = True
            bucket = self._bucket_of[index]
            self._pending[bucket] -= 1
            while self._next < len(self.layout) and self._pending[self._next] == 0:
                self._start(self._next)

    def _on_backward_end(self) -> None:
        with self._lock:
            if self._backward_open:
                self._backward_done = True

    def _start(self, bucket: int) -> None:
        """Flattens bucket ``bucket``'s gradients (zeros where there is none) and starts their sum."""
        grads = []
        for i in self.layout[bucket]:
            grad = self.params[i].grad
            grads.append((grad if grad is not None else torch.zeros_like(self.params[i])).reshape(-1))
        buffer = torch.cat(grads)  # a copy: p.grad stays untouched until synchronize()
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self._in_flight.append((bucket, work, buffer))
        self._next = bucket + 1

    # -- the step's end -------------------------------------------------------------------------
    def synchronize(self) -> None:
        """Starts the buckets the hooks did not (in bucket order), waits for every sum and writes
        it into ``p.grad`` (creating it where a parameter had none). Then ready for the next step."""
        with self._lock:
            while self._next < len(self.layout):
                self._start(self._next)
            for bucket, work, buffer in self._in_flight:
                work.wait()
                offset = 0
                for i in self.layout[bucket]:
                    param = self.params[i]
                    summed = buffer[offset: offset + param.numel()].view_as(param)
                    offset += param.numel()
                    if param.grad is None:
                        param.grad = summed.clone()
                    else:
                        param.grad.copy_(summed)
            self._reset()

    def discard(self) -> None:
        """Drops the sums of a backward that nobody collected, leaving ``p.grad`` as it is. Which
        buckets the hooks started depends on which gradients this process had, so it starts the
        rest first, in order, like ``synchronize()``: every backward then costs every process
        one all-reduce per bucket, and the next step's all-reduces pair up again."""
        with self._lock:
            if self._backward_open or self._in_flight:
                while self._next < len(self.layout):
                    self._start(self._next)
            for _, work, _ in self._in_flight:
                work.wait()
            self._reset()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Backwards inside issue no collective (e.g. one that runs on some processes only);
        their gradients stay local until a later ``synchronize()`` sums ``p.grad`` as it is."""
        with self._lock:
            was, self._enabled = self._enabled, False
        try:
            yield
        finally:
            with self._lock:
                self._enabled = was

    def remove(self) -> None:
        """Drops any started sums and removes the hooks."""
        self.discard()
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def matches(self, params: Sequence[torch.Tensor]) -> bool:
        return len(params) == len(self.params) and all(a is b for a, b in zip(params, self.params))
