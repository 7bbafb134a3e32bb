"""The serving precision flags, shared by ``main`` (``--mode test``, ``inference_benchmark``,
``plan``), ``export`` and ``deploy``: the same words mean the same tables everywhere; and the
model-name flag of ``deploy`` and ``triton/client.py``, checked as it is parsed."""

from __future__ import annotations

from typing import Any

from absl import app, flags

from dlrm.inference.model_names import NAME_RULE, is_model_name, shown

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


class ModelNameFlag(flags.Flag):
    """A string flag that takes model names only (``dlrm.inference.model_names``). Refused while
    the command line is parsed, in one line naming the flag and the rule, without echoing the
    whole value (absl's own messages repeat it verbatim, newlines and all)."""

    def parse(self, argument: Any) -> None:
        if not is_model_name(argument):
            raise flags.IllegalFlagValueError(f"--{self.name} {shown(argument)} is not a model name: use {NAME_RULE}")
        super().parse(argument)


def model_name_flag(default: str, help_text: str, name: str = "model_name") -> ModelNameFlag:
    """The flag for ``flags.DEFINE_flag(...)``, called in the script that owns it (so that its
    --help lists it)."""
    return ModelNameFlag(flags.ArgumentParser(), flags.ArgumentSerializer(), name, default,
                         f"{help_text} Names: {NAME_RULE}.")
