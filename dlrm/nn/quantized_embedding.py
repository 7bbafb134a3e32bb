"""Embedding tables for serving, each stored at its own precision: fp32, fp16, or row-wise
quantized int8, int4 or int2 (``dlrm.kernels.quantized_rows``).

A model trained with float tables is served with these in place of its ``embeddings``: the same
``[B, F] ids (or Bags) -> [B, F, D]`` lookup, at a quarter (int8) to a sixteenth (int2) of the
fp32 bytes plus a scale and a bias per row. Training never uses them: the tables are read-only.

Tables of one precision share one joint buffer (as ``JointEmbedding``'s weight), so a batch costs
one lookup per precision, not one per table:

- on the CPU, torch's quantized embedding-bag operators (FBGEMM's row-wise kernels, in every
  CPU build of torch) read the packed rows, pooled bags included;
- on a GPU, ``dequantize_gather``'s Triton kernel reads them (its torch reference without Triton);
- under ``torch.jit.trace`` the same operators are recorded (TorchScript files keep the packed
  tables), and for ONNX, which has no such operator, ``for_onnx()`` gives a copy that splits each
  packed row into codes and scale/bias tensors and unpacks with plain arithmetic.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dlrm.data.batch import Bags
from dlrm.kernels.backend import exporting, interpreting
from dlrm.kernels.quantized_rows import (
    PRECISION_BITS, QUANTIZED, SCALE_DTYPES, check_dim, code_bytes, codes_per_byte, dequantize_gather,
    dequantize_rows, quantize_rows, row_bytes,
)
from dlrm.nn.embeddings import EmbeddingTables
from dlrm.nn.table_spec import TableSpec

_FLOAT_TABLES = {"fp32": torch.float32, "fp16": torch.float16}
_CPU_OPS = {"int8": "embedding_bag_byte_rowwise_offsets", "int4": "embedding_bag_4bit_rowwise_offsets",
            "int2": "embedding_bag_2bit_rowwise_offsets"}


def _cpu_op(precision: str):
    return getattr(torch.ops.quantized, _CPU_OPS[precision])


def _on_fbgemm(weight: torch.Tensor) -> bool:
    """Whether torch's CPU operators read these packed rows: a CPU buffer, unless Triton's
    interpreter is on (then the GPU kernel runs on the CPU, which is how CI checks it)."""
    return weight.device.type == "cpu" and not interpreting()


class QuantizedEmbedding(EmbeddingTables):
    """Read-only tables for inference, table ``i`` at ``precisions[i]`` (see the module docstring).

    Built empty (zeros); ``load_table_(i, weight)`` quantizes a float table into place, one table
    at a time, so a model larger than memory in fp32 is quantized table by table.
    """

    def __init__(self, tables: Sequence[TableSpec | int], embedding_dim: int, precisions: Sequence[str],
                 hash_indices: bool = False, device: torch.device | str | None = None) -> None:
        precisions = list(precisions)
        if len(precisions) != len(tables):
            raise ValueError(f"`precisions` lists {len(precisions)} precisions for {len(tables)} tables: give one "
                             "per table")
        for precision in precisions:
            check_dim(embedding_dim, precision)
        self.precisions = precisions
        self.split = False  # True in the ONNX form (``for_onnx``)
        super().__init__(tables, embedding_dim, hash_indices=hash_indices, device=device, init_seed=0,
                         empty_ok=False)
        if any(self.is_block(i) for i in range(self.num_tables)):
            raise ValueError("quantized tables hold whole tables only, not row-wise blocks")

    def _make_weights(self, device: torch.device | str, weight_dtype: torch.dtype) -> None:
        # groups: precision -> (the local tables stored at it, their first rows in its buffer)
        self.groups: dict[str, tuple[list[int], list[int]]] = {}
        for i, precision in enumerate(self.precisions):
            tables, starts = self.groups.setdefault(precision, ([], []))
            starts.append(0 if not tables else starts[-1] + self.table_sizes[tables[-1]])
            tables.append(i)
        columns = []
        for precision, (tables, starts) in self.groups.items():
            rows = starts[-1] + self.table_sizes[tables[-1]]
            if precision in QUANTIZED:
                weight = torch.zeros(rows, row_bytes(self.embedding_dim, precision), dtype=torch.uint8, device=device)
            else:
                weight = torch.zeros(rows, self.embedding_dim, dtype=_FLOAT_TABLES[precision], device=device)
            self.register_buffer(f"{precision}_weight", weight)
            self.register_buffer(f"{precision}_offsets", torch.tensor(starts, dtype=torch.int64), persistent=False)
            self.register_buffer(f"{precision}_columns", torch.tensor(tables, dtype=torch.int64), persistent=False)
            columns += tables
        self.register_buffer("column_order", torch.tensor(columns, dtype=torch.int64).argsort(), persistent=False)

    def _init_table_(self, i: int) -> None:
        pass  # tables start as zeros and are loaded (quantized) from trained weights

    def _rows_of(self, i: int) -> tuple[str, torch.Tensor]:
        """Table ``i``'s precision and its rows in that precision's buffer (a view)."""
        self._check_index(i)
        precision = self.precisions[i]
        tables, starts = self.groups[precision]
        start = starts[tables.index(i)]
        return precision, getattr(self, f"{precision}_weight")[start:start + self.table_sizes[i]]

    def load_table_(self, i: int, weight: torch.Tensor) -> None:
        """Stores float table ``weight [rows_i, D]`` as table ``i``, at its precision."""
        precision, target = self._rows_of(i)
        if tuple(weight.shape) != (self.table_sizes[i], self.embedding_dim):
            raise ValueError(f"table {i}: expected shape {(self.table_sizes[i], self.embedding_dim)}, "
                             f"got {tuple(weight.shape)}")
        with torch.no_grad():
            target.copy_(quantize_rows(weight, precision) if precision in QUANTIZED else weight)

    def table_weight(self, i: int) -> torch.Tensor:
        """Table ``i`` dequantized to ``[rows_i, D]`` fp32 (a new tensor: what lookups return)."""
        precision, rows = self._rows_of(i)
        if precision in QUANTIZED:
            return dequantize_rows(rows, self.embedding_dim, precision)
        return rows.float()

    def dequantized_table(self, i: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """Table ``i``'s stored values in ``dtype`` (tests' float64 reference)."""
        precision, rows = self._rows_of(i)
        return dequantize_rows(rows, self.embedding_dim, precision, dtype) if precision in QUANTIZED else rows.to(dtype)

    def table_parameter(self, i: int):
        raise TypeError("quantized tables are read-only: they have no parameter to train")

    def storage_dtype(self) -> torch.dtype:
        return torch.float32  # what lookups compute in, whatever the storage

    def table_bytes(self) -> int:
        """Bytes of every table as stored (codes, scales and biases)."""
        return sum(buffer.nbytes for name, buffer in self.named_buffers() if name.endswith(("_weight", "_scale_bias",
                                                                                             "_codes")))

    def extra_repr(self) -> str:
        counts = {p: len(tables) for p, (tables, _) in self.groups.items()}
        return f"{super().extra_repr()}, precisions={counts}, table_bytes={self.table_bytes()}"

    # ------------------------------------------------------------------------- lookups

    def forward(self, ids: torch.Tensor | Bags) -> torch.Tensor:
        if isinstance(ids, Bags):
            return self._pool_bags(ids)
        ids = self._prepare_ids(ids)
        batch = ids.shape[0]
        parts = []
        for precision, (tables, _) in self.groups.items():
            columns = ids if len(tables) == self.num_tables else ids.index_select(1, getattr(self, f"{precision}_columns"))
            rows = (columns + getattr(self, f"{precision}_offsets")).reshape(-1)
            parts.append(self._lookup(precision, rows).view(batch, len(tables), self.embedding_dim))
        return parts[0] if len(parts) == 1 else torch.cat(parts, 1).index_select(1, self.column_order)

    def _lookup(self, precision: str, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows [N]`` of a precision's buffer as ``[N, D]`` fp32."""
        if self.split:
            return self._split_lookup(precision, rows)
        weight = getattr(self, f"{precision}_weight")
        if precision not in QUANTIZED:
            return F.embedding(rows, weight).float()
        tracing = torch.jit.is_tracing()  # a TorchScript file records the CPU operator, interpreter or not
        if weight.device.type == "cpu" and (tracing or _on_fbgemm(weight)) and not (exporting() and not tracing):
            # FBGEMM's kernel, ids as bags of one (offsets 0..N-1: measured twice as fast at batch 1
            # as [N, 1] ids without offsets, which the operator turns into offsets itself)
            offsets = torch.arange(rows.shape[0], device=rows.device)
            return _cpu_op(precision)(weight, rows, offsets, False, 0, False, None, None, False)
        return dequantize_gather(weight, rows, self.embedding_dim, precision)

    def _pool_bags(self, bags: Bags) -> torch.Tensor:
        """Every feature's bags pooled (sum, or mean by per-value weights) -> ``[B, T, D]`` fp32."""
        batch = self._bag_batch_size(bags)
        out = torch.zeros(batch, self.num_tables, self.embedding_dim, device=bags.offsets.device)
        if batch == 0:
            return out
        for precision, (tables, _) in self.groups.items():
            part = bags if len(tables) == self.num_tables else bags.select(tables)
            group_tables = torch.tensor(tables, dtype=torch.int64, device=part.offsets.device)
            value_tables = torch.repeat_interleave(
                torch.arange(len(tables), device=part.offsets.device), part.offsets[::batch].diff(),
                output_size=part.values.shape[0])
            ids = part.values.to(torch.int64)
            if self.hash_indices:
                ids = ids % self.rows[group_tables][value_tables]
            rows = ids + getattr(self, f"{precision}_offsets")[value_tables]
            weights = self._group_mean_weights(part, batch, group_tables)
            pooled = self._pool(precision, rows, part.offsets.to(torch.int64), weights)
            out[:, tables] = pooled.view(len(tables), batch, self.embedding_dim).transpose(0, 1)
        return out

    def _group_mean_weights(self, bags: Bags, batch: int, group_tables: torch.Tensor) -> torch.Tensor | None:
        """``1 / len`` for the values of mean-pooled bags of these tables, 1 elsewhere; None if all sum."""
        if not any(self.poolings[t] == "mean" for t in group_tables.tolist()):
            return None
        lengths = bags.offsets.diff()
        scale = lengths.clamp(min=1).float().reciprocal()
        mean = self.mean_pooled[group_tables][:, None]
        scale = torch.where(mean, scale.view(-1, batch), 1.0).reshape(-1)
        bag = torch.repeat_interleave(torch.arange(lengths.shape[0], device=lengths.device), lengths,
                                      output_size=bags.values.shape[0])
        return scale[bag]

    def _pool(self, precision: str, rows: torch.Tensor, offsets: torch.Tensor,
              weights: torch.Tensor | None) -> torch.Tensor:
        """Bags ``offsets`` (with the last offset) of rows ``rows`` summed, weighted by ``weights`` -> ``[bags, D]``."""
        weight = getattr(self, f"{precision}_weight")
        if precision in QUANTIZED and _on_fbgemm(weight):
            return _cpu_op(precision)(weight, rows, offsets, False, 0, False, weights, None, True)
        values = self._lookup(precision, rows) if precision in QUANTIZED else weight.index_select(0, rows).float()
        if weights is not None:
            values = values * weights[:, None]
        bag = torch.repeat_interleave(torch.arange(offsets.shape[0] - 1, device=offsets.device), offsets.diff(),
                                      output_size=rows.shape[0])
        return torch.zeros(offsets.shape[0] - 1, self.embedding_dim, device=weight.device).index_add_(0, bag, values)

    # ------------------------------------------------------------------------- the ONNX form

    def for_onnx(self) -> "QuantizedEmbedding":
        """A copy whose packed buffers are split into codes ``[R, code_bytes]`` uint8 and
        ``[R, 2]`` scale and bias (same bytes), looked up with gathers and integer arithmetic:
        the graph ONNX can express (it has no quantized embedding-bag operator and no bitcast)."""
        split = copy.copy(self)
        split._buffers = dict(self._buffers)
        split.split = True
        for precision in self.groups:
            if precision not in QUANTIZED:
                continue
            weight = split._buffers.pop(f"{precision}_weight")
            width = code_bytes(self.embedding_dim, precision)
            split._buffers[f"{precision}_codes"] = weight[:, :width].contiguous()
            scale_bias = weight[:, width:].contiguous().view(SCALE_DTYPES[precision])
            split._buffers[f"{precision}_scale_bias"] = scale_bias
        return split

    def _split_lookup(self, precision: str, rows: torch.Tensor) -> torch.Tensor:
        if precision not in QUANTIZED:
            return getattr(self, f"{precision}_weight").index_select(0, rows).float()
        codes = getattr(self, f"{precision}_codes").index_select(0, rows).to(torch.int32)
        if precision != "int8":
            bits, per_byte = PRECISION_BITS[precision], codes_per_byte(precision)
            # field k of a byte: (byte // 2^(bits*k)) mod 2^bits, with divisions ONNX has for int32
            fields = [torch.div(codes, 1 << (bits * k), rounding_mode="floor") % (1 << bits) for k in range(per_byte)]
            codes = torch.stack(fields, dim=2).reshape(rows.shape[0], self.embedding_dim)
        scale_bias = getattr(self, f"{precision}_scale_bias").index_select(0, rows).float()
        return codes.float() * scale_bias[:, :1] + scale_bias[:, 1:]
