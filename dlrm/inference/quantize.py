"""Serve a trained DLRM with row-wise quantized tables (``dlrm.nn.quantized_embedding``).

    model = build_quantized_model("/ckpt/last", "int8")            # every table int8
    model = build_quantized_model("/ckpt/last", "int4", min_rows=100_000)  # large tables int4, others fp32
    model = quantize_model(trained_model, ["int4", "int8", "fp32", ...])    # one per table

The model is the same ``DLRM``; only its ``embeddings`` are replaced, so export, the inference
benchmark and the Triton deployer take it as they take a float one. Tables are quantized one at a
time straight from the checkpoint's (memory-mapped) files, so building a quantized model never
holds the fp32 tables in memory: a model that fits a host only quantized can be built on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dlrm.kernels.quantized_rows import PRECISION_BITS, QUANTIZED, check_dim, row_bytes
from dlrm.model.dlrm import DLRM, DLRMConfig
from dlrm.nn.quantized_embedding import QuantizedEmbedding
from dlrm.training.checkpoint import CheckpointError, load_checkpoint, model_config_of

TABLE_PRECISIONS = tuple(PRECISION_BITS)  # fp32, fp16, int8, int4, int2


def table_precisions(table_sizes: Sequence[int], precision: str | Sequence[str], min_rows: int = 0,
                     embedding_dim: int | None = None) -> list[str]:
    """One precision per table: ``precision`` for all (or a list, one per table), except that
    tables of fewer than ``min_rows`` rows stay fp32 (the largest tables are where the bytes are).
    Raises ValueError naming the setting when the list's length or a name is wrong, or
    ``embedding_dim`` cannot be packed at a precision."""
    if isinstance(precision, str):
        precisions = [precision] * len(table_sizes)
    else:
        precisions = list(precision)
        if len(precisions) != len(table_sizes):
            raise ValueError(f"`quantize_tables` lists {len(precisions)} precisions for the model's "
                             f"{len(table_sizes)} tables: give one precision, or one per table")
    bad = sorted({p for p in precisions if p not in TABLE_PRECISIONS})
    if bad:
        raise ValueError(f"`quantize_tables`: unknown precision {bad[0]!r}; choose from {list(TABLE_PRECISIONS)}")
    if not isinstance(min_rows, int) or min_rows < 0:
        raise ValueError(f"`quantize_min_rows` must be a non-negative integer, got {min_rows!r}")
    precisions = [p if rows >= min_rows else "fp32" for p, rows in zip(precisions, table_sizes)]
    if embedding_dim is not None:
        for p in set(precisions):
            check_dim(embedding_dim, p)
    return precisions


def table_bytes(table_sizes: Sequence[int], embedding_dim: int, precisions: Sequence[str]) -> int:
    """Bytes the tables take when stored at ``precisions`` (scales and biases included)."""
    return sum(rows * row_bytes(embedding_dim, p) for rows, p in zip(table_sizes, precisions))


def _quantized_tables(config: DLRMConfig, precisions: Sequence[str],
                      device: torch.device | str) -> QuantizedEmbedding:
    from dlrm.nn.table_spec import table_specs

    return QuantizedEmbedding(table_specs(config.table_sizes, config.poolings), config.embedding_dim, precisions,
                              hash_indices=config.hash_indices, device=device)


def _without_tables(config: DLRMConfig, device: torch.device | str) -> DLRM:
    """The model's dense part with no tables built (its embeddings are put in afterwards)."""
    return DLRM(config, device=device, tables=[])


class NonFiniteTableError(CheckpointError):
    """A table to quantize holds NaN or inf: its rows' scales would be NaN, every score too. A
    ``CheckpointError`` (one line, exit 2 at the command line): such weights come from a
    checkpoint, or from a run that a checkpoint of theirs would show."""


def finite_table(weight: torch.Tensor, index: int) -> torch.Tensor:
    """``weight`` (table ``index``) once every value is finite. Quantizing takes each row's min
    and max: one NaN or inf makes the row's scale NaN and its lookups NaN, with no error."""
    if not bool(torch.isfinite(weight).all()):
        raise NonFiniteTableError(f"table {index} holds non-finite values (NaN or inf): it cannot be quantized; "
                                  "load an earlier checkpoint of the run")
    return weight


@torch.no_grad()
def quantize_model(model: DLRM, precisions: str | Sequence[str], min_rows: int = 0) -> DLRM:
    """A copy of ``model`` (a whole model: every table, none kept on the host) whose tables are
    stored at ``precisions`` (``table_precisions``); ``model`` is left as it was. In eval mode."""
    config = model.config
    if model.embeddings.num_tables != config.num_categorical_features or model.host_embeddings is not None:
        raise ValueError("only a model holding all of its tables on one device can be quantized "
                         "(build it with build_inference_model or build_quantized_model)")
    precisions = table_precisions(config.table_sizes, precisions, min_rows, config.embedding_dim)
    device = next(model.bottom_mlp.parameters()).device
    quantized = _without_tables(config, device)
    quantized.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("embeddings.")},
                              strict=False)
    tables = _quantized_tables(config, precisions, device)
    for i in range(tables.num_tables):
        tables.load_table_(i, finite_table(model.embeddings.table_weight(i), i))
    quantized.embeddings = tables
    return quantized.eval()


def build_quantized_model(checkpoint: str, precisions: str | Sequence[str], min_rows: int = 0,
                          device: torch.device | str = "cpu") -> DLRM:
    """The DLRM of ``checkpoint`` (either layout) with its tables at ``precisions``, in eval mode.
    Tables are read and quantized one by one: peak memory is the quantized model plus one fp32
    table, whatever the model's fp32 size."""
    config = DLRMConfig(**model_config_of(checkpoint))  # CheckpointError when missing or damaged
    precisions = table_precisions(config.table_sizes, precisions, min_rows, config.embedding_dim)
    model = _without_tables(config, device)
    model.embeddings = _quantized_tables(config, precisions, device)
    load_checkpoint(checkpoint, model)  # each table through QuantizedEmbedding.load_table_, finite-checked
    return model.eval()


def describe(model: DLRM) -> str:
    """One line: how many tables at which precision, and their bytes against fp32."""
    tables = model.embeddings
    if not isinstance(tables, QuantizedEmbedding):
        return "tables: fp32"
    counts = ", ".join(f"{len(t)} {p}" for p, (t, _) in tables.groups.items())
    fp32 = table_bytes(tables.table_sizes, tables.embedding_dim, ["fp32"] * tables.num_tables)
    return (f"tables: {counts}; {tables.table_bytes() / 2**20:,.1f} MiB "
            f"({tables.table_bytes() / fp32:.3f}x the fp32 {fp32 / 2**20:,.1f} MiB)")


__all__ = ["TABLE_PRECISIONS", "QUANTIZED", "build_quantized_model", "quantize_model", "table_bytes",
           "table_precisions", "describe"]


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def serving_report(config: DLRMConfig, device_bytes: int | None, host_bytes: int,
                   chosen: Sequence[str] | None = None) -> str:
    """For ``--mode plan``: the model's bytes for serving at each precision (every table at it;
    ``chosen``, one per table, as a last row), and whether one device of ``device_bytes`` and one
    host of ``host_bytes`` hold it (weights only: activations are a few MiB per 4,096 samples)."""
    dense = sum(p.numel() * p.element_size() for p in DLRM(config, device="meta", tables=[]).parameters())
    fp32 = table_bytes(config.table_sizes, config.embedding_dim, ["fp32"] * len(config.table_sizes))
    rows = []
    candidates = [(p, [p] * len(config.table_sizes)) for p in TABLE_PRECISIONS
                  if p not in QUANTIZED or config.embedding_dim % (8 // PRECISION_BITS[p]) == 0]
    if chosen is not None and len(set(chosen)) > 1:
        candidates.append(("chosen", list(chosen)))
    for name, precisions in candidates:
        tables = table_bytes(config.table_sizes, config.embedding_dim, precisions)
        total = tables + dense

        def fits(capacity: int | None) -> str:
            return "-" if capacity is None else ("yes" if total <= capacity else "no")

        rows.append(f"{name:>8} {tables / 2**30:>12,.3f} {tables / fp32:>8.3f} {total / 2**30:>12,.3f} "
                    f"{fits(device_bytes):>12} {fits(host_bytes):>10}")
    header = f"{'tables':>8} {'tables GiB':>12} {'x fp32':>8} {'model GiB':>12} {'one device':>12} {'this host':>10}"
    where = (f"one device: {device_bytes / 2**30:,.1f} GiB; " if device_bytes else "") + \
        f"this host: {host_bytes / 2**30:,.1f} GiB"
    return "\n".join([f"Serving (weights only; {where}); --quantize_tables picks the precision:", header, *rows])
