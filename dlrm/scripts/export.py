r"""Export a checkpoint for serving and check the files against the eager model.

    python -m dlrm.scripts.export --checkpoint /ckpt/last --output /models/dlrm \
        [--format onnx,torchscript] [--opset 17] [--quantize_tables int8|int4|int2|fp16 [--quantize_min_rows N]]

Writes <output>/model.onnx and/or <output>/model.pt, then prints the maximum absolute error of
each file against the eager model per batch size. --output is new or empty, or (with
--overwrite) an earlier export; a folder holding anything else is never written into.
"""

from __future__ import annotations

import os

from absl import app, flags
from absl import logging as absl_logging

from dlrm.engine.storage import check_can_create
from dlrm.engine.outputs import OutputKind, claim_output, holds_only
from dlrm.scripts import cli, serving_flags

FORMATS = {"onnx": "model.onnx", "torchscript": "model.pt"}
# What --output holds: the exported files and nothing else (dlrm.engine.outputs).
# model.onnx.data: the weights of an ONNX export past 2 GiB (ONNX's external data), beside it.
EXPORT = OutputKind("model export", directory=True,
                    recognise=lambda p: holds_only(p, [*FORMATS.values(), "model.onnx.data"]))

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "Checkpoint directory (as written by training).")
flags.DEFINE_string("output", None, "Directory for the exported files (created if missing; an existing one "
                    "must be empty, or with --overwrite an earlier export).")
flags.DEFINE_boolean("overwrite", False, "Replace the files an earlier export wrote in --output (never a folder "
                     "holding anything else).")
flags.DEFINE_list("format", ["onnx", "torchscript"], f"Comma-separated formats out of {sorted(FORMATS)}.")
flags.DEFINE_integer("opset", 17, "ONNX opset version.", lower_bound=7)
flags.DEFINE_list("check_batch_sizes", ["1", "64", "4096"], "Batch sizes the exported files are checked at.")
flags.adopt_module_key_flags(serving_flags)  # --quantize_tables, --quantize_min_rows
flags.mark_flags_as_required(["checkpoint", "output"])


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # the ONNX exporter logs every graph pass at INFO
    unknown = [f for f in FLAGS.format if f not in FORMATS]
    if unknown or not FLAGS.format:
        raise app.UsageError(f"--format: unknown format(s) {unknown}; choose from {sorted(FORMATS)}")
    try:
        batch_sizes = [int(b) for b in FLAGS.check_batch_sizes]
    except ValueError:
        raise app.UsageError(f"--check_batch_sizes must be integers, got {FLAGS.check_batch_sizes}") from None
    if any(b < 1 for b in batch_sizes):
        raise app.UsageError(f"--check_batch_sizes must be positive, got {FLAGS.check_batch_sizes}")
    quantize_tables = serving_flags.quantize_tables()
    if "onnx" in FLAGS.format:
        import onnx  # the exporter needs it anyway; only here for the highest opset it can write

        if FLAGS.opset > onnx.defs.onnx_opset_version():
            raise app.UsageError(f"--opset {FLAGS.opset}: the installed onnx writes opsets up to "
                                 f"{onnx.defs.onnx_opset_version()}")
    # Before any work (dlrm.engine.outputs): never a foreign folder, a link, the working directory or the checkpoint.
    claim_output(FLAGS.output, EXPORT, "output", inputs={"checkpoint": FLAGS.checkpoint}, replace=FLAGS.overwrite)
    from dlrm.inference.export import EXPORTED, build_inference_model, check_export, export_onnx, export_torchscript

    for fmt in FLAGS.format:  # a read-only or missing file system fails before the export's work
        check_can_create(os.path.join(FLAGS.output, FORMATS[fmt]), EXPORTED)
    try:  # CheckpointError: one line and exit 2 (cli.run)
        model = build_inference_model(FLAGS.checkpoint, quantize_tables=quantize_tables,
                                      quantize_min_rows=FLAGS.quantize_min_rows)
    except ValueError as e:  # --quantize_tables that does not fit the checkpoint's model
        raise app.UsageError(cli.flag_terms(str(e), FLAGS)) from None
    if quantize_tables != "fp32" or FLAGS.quantize_min_rows:
        from dlrm.inference.quantize import describe

        print(describe(model))
    for fmt in FLAGS.format:
        path = os.path.join(FLAGS.output, FORMATS[fmt])
        if fmt == "onnx":
            export_onnx(model, path, opset=FLAGS.opset)
        else:
            export_torchscript(model, path)
        errors = check_export(model, path, batch_sizes=batch_sizes)
        print(f"wrote {path}")
        for batch_size, error in errors.items():
            print(f"  {fmt} batch {batch_size}: max abs error {error:.3g}")
    return 0


if __name__ == "__main__":
    cli.run(main)
