"""Checks on a tensor read from a file a user handed in, before anything uses it.

``torch.load(weights_only=True)`` never runs code, but it returns whatever tensors the file
describes: a 2 KB file can hold ``torch.zeros(1).expand(10**8, 13)`` (one float behind a shape of
1.3 G values, which the first ``.contiguous()``, ``.float()`` or copy turns into 5 GB), a view
into a larger storage, or NaN weights that make every later score NaN without an error. So every
tensor taken from a checkpoint, of either layout, passes ``checked_tensor`` first: it is dense
(contiguous, its storage no larger than its values need, so a shape cannot promise more than
the file holds), of an expected kind, and finite. Messages name the file and the tensor, never
the values read.

Why the strict rule (storage bytes == the bytes the shape needs, offset 0) holds for every
checkpoint this program wrote: its writers save owning copies (``checkpoint_store.host_copy``
of every table, row block and dense tensor; optimizers' state tensors are their own
allocations), in every version since the first (the committed fixtures of the format before the
checkpoint store pass it too). A file whose tensors are views was not written by this program.
Rows cut in memory from a checked tensor (``read_rows`` of a memory-mapped file) are views of
it: ``is_compact`` is the rule for those (contiguous, within a storage that holds them).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from dlrm.engine.errors import CheckpointError

NAME_CHARS = 60  # at most this much of a name read from a file goes into a message


def is_dense(value: torch.Tensor) -> bool:
    """Whether ``value`` is contiguous and its storage holds exactly the bytes of its values
    (no zero strides, no window onto a larger storage)."""
    if value.layout != torch.strided or not value.is_contiguous():
        return False
    needed = value.numel() * value.element_size()
    return value.untyped_storage().nbytes() == needed and value.storage_offset() == 0


def is_compact(value: torch.Tensor) -> bool:
    """Whether ``value`` is contiguous (no zero or overlapping strides) and its storage holds all
    its values: what a view cut from a dense tensor (rows of a memory-mapped file) still is."""
    if value.layout != torch.strided or not value.is_contiguous():
        return False
    end = (value.storage_offset() + value.numel()) * value.element_size()
    return value.untyped_storage().nbytes() >= end


def checked_tensor(value: Any, file: str, name: str, *, floating: bool = True,
                   dims: Iterable[int] | None = None, finite: bool = True) -> torch.Tensor:
    """``value``, read from ``file`` as ``name``, as a dense tensor; else a ``CheckpointError``.

    ``floating``: a floating-point tensor is expected (weights); ``dims``: its allowed numbers of
    dimensions; ``finite``: every value is finite (NaN or inf weights would score NaN silently)."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{file}: {name} is a {type(value).__name__}, not a tensor: the checkpoint is damaged")
    if dims is not None and value.dim() not in set(dims):
        raise CheckpointError(f"{file}: {name} has {value.dim()} dimensions, expected "
                              f"{' or '.join(map(str, sorted(set(dims))))}: the checkpoint is damaged")
    if floating and not value.is_floating_point():
        raise CheckpointError(f"{file}: {name} holds {str(value.dtype).removeprefix('torch.')} values, not floating "
                              "point: the checkpoint is damaged")
    if not is_dense(value):
        raise CheckpointError(f"{file}: {name} is not a dense tensor (its strides or storage do not match its shape "
                              f"{list(value.shape)[:8]}; this program's and NVIDIA's writers save dense tensors): "
                              "the checkpoint is damaged or was crafted")
    if finite and value.is_floating_point():
        check_finite(value, file, name)
    return value


def check_finite(value: torch.Tensor, file: str, name: str) -> None:
    """Every value of ``value`` is finite; else a ``CheckpointError`` naming ``file`` and ``name``
    (a model with NaN or inf weights gives NaN scores, which no later step reports)."""
    if value.is_floating_point() and value.numel() and not _all_finite(value):
        raise CheckpointError(f"{file}: {name} holds non-finite values (NaN or inf): a model with them scores NaN; "
                              "load an earlier checkpoint of the run")


def _all_finite(value: torch.Tensor) -> bool:
    """Whether every value is finite, in one reduction that allocates nothing the size of
    ``value``: min and max propagate NaN, and an inf is one of them. (``isfinite(value).all()``
    writes a mask as large as the table first: 18x slower on a 10M x 16 table here.)"""
    low, high = torch.aminmax(value.reshape(-1))
    return bool(torch.isfinite(low)) and bool(torch.isfinite(high))


def label(key: Any) -> str:
    """A key read from a file, as a message shows it: its repr, cut to ``NAME_CHARS``."""
    text = repr(key) if isinstance(key, (str, int)) else f"<{type(key).__name__}>"
    return text if len(text) <= NAME_CHARS else text[:NAME_CHARS - 3] + "..."


def tensors_in(obj: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in ``obj`` (nested dicts, lists, tuples, as a tensor file holds them), with
    its place (``name['key'][0]``). Walked with a stack: a deeply nested file cannot exhaust
    Python's recursion limit."""
    stack = [(name, obj)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, torch.Tensor):
            yield where, value
        elif isinstance(value, dict):
            stack.extend((f"{where}[{label(k)}]", v) for k, v in reversed(list(value.items())))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{where}[{i}]", v) for i, v in reversed(list(enumerate(value))))


def check_all(obj: Any, file: str, name: str, finite: bool = True) -> Any:
    """``obj`` (what ``file`` holds) once every tensor in it is dense and, with ``finite``, every
    floating-point one finite: before any of it is used, reshaped or copied."""
    for where, value in tensors_in(obj, name):
        checked_tensor(value, file, where, floating=False, finite=finite)
    return obj
