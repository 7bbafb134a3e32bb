"""Export a checkpoint for serving and check the files against the eager model.

    python -m dlrm.scripts.export --checkpoint /ckpt/last --output /models/dlrm \
        [--format onnx,torchscript] [--opset 17]

Writes <output>/model.onnx and/or <output>/model.pt, then prints the maximum absolute error of
each file against the eager model per batch size.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags
from absl import logging as absl_logging

from dlrm.inference.export import build_inference_model, check_export, export_onnx, export_torchscript
from dlrm.training.checkpoint import CheckpointError

FORMATS = {"onnx": "model.onnx", "torchscript": "model.pt"}

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "Checkpoint directory (as written by training).")
flags.DEFINE_string("output", None, "Directory for the exported files (created if missing).")
flags.DEFINE_list("format", ["onnx", "torchscript"], f"Comma-separated formats out of {sorted(FORMATS)}.")
flags.DEFINE_integer("opset", 17, "ONNX opset version.", lower_bound=7)
flags.DEFINE_list("check_batch_sizes", ["1", "64", "4096"], "Batch sizes the exported files are checked at.")
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
    try:
        model = build_inference_model(FLAGS.checkpoint)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
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
    app.run(main)
