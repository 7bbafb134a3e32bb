"""The serving precision flags, shared by ``main`` (``--mode test``, ``inference_benchmark``,
``plan``), ``export`` and ``deploy``: the same words mean the same tables everywhere."""

from __future__ import annotations

from absl import app, flags

flags.DEFINE_list("quantize_tables", ["fp32"],
                  "Store the embedding tables for serving at fp32 (as trained), fp16, or row-wise quantized int8, "
                  "int4 or int2 (each row with its own scale and bias, read by torch's quantized embedding-bag "
                  "operators on the CPU and a Triton kernel on a GPU): one precision for every table, or a "
                  "comma-separated list with one per table.")
flags.DEFINE_integer("quantize_min_rows", 0, "Tables with fewer rows than this stay fp32 under --quantize_tables "
                     "(the largest tables hold the bytes; small ones cost little at full precision).", lower_bound=0)

SERVING_MODES = ("test", "inference_benchmark", "plan")


def quantize_tables(values: flags.FlagValues = flags.FLAGS, mode: str | None = None) -> str | list[str]:
    """--quantize_tables as ``dlrm.inference.quantize.table_precisions`` takes it (one name, or a
    list), after checking its names and, for ``main``, its ``mode``."""
    from dlrm.kernels.quantized_rows import PRECISION_BITS

    chosen = values.quantize_tables or ["fp32"]
    bad = [p for p in chosen if p not in PRECISION_BITS]
    if bad:
        raise app.UsageError(f"--quantize_tables: unknown precision {bad[0]!r}; choose from {list(PRECISION_BITS)}, "
                             "one for all tables or one per table")
    quantizing = set(chosen) != {"fp32"} or values.quantize_min_rows
    if quantizing and mode is not None and mode not in SERVING_MODES:
        raise app.UsageError(f"--quantize_tables stores a trained model's tables for serving: use it with --mode "
                             f"{', '.join(SERVING_MODES)}, or with dlrm.scripts.export / deploy (training keeps "
                             "float tables; see --embedding_dtype)")
    return chosen[0] if len(chosen) == 1 else list(chosen)
