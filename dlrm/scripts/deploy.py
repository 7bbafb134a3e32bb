r"""Write a Triton Inference Server model repository from a checkpoint.

    python -m dlrm.scripts.deploy --checkpoint ckpt/ --model_repository models/ \
        [--format onnx|torchscript] [--python_backend] [--numerical_type fp32|fp16] [--instance_kind gpu|cpu] \
        [--quantize_tables int8|int4|int2|fp16 [--quantize_min_rows N]]

(also ``python triton/deployer.py ...``). Exports the model into
<model_repository>/<model_name>/<version>/, checks the file against the eager model at each
--check_batch_sizes, and writes config.pbtxt (and model.py with --python_backend).

--model_repository is new, empty or a Triton model repository (the model is added to it; a folder
holding anything else is refused); a model folder of --model_name that exists already is written
over only with --overwrite. --model_name takes Triton's model names: 1 to 128 characters from
A-Z a-z 0-9 _ . - not starting with a dot; anything else is refused before anything is written.
"""

from __future__ import annotations

from absl import app, flags
from absl import logging as absl_logging

from dlrm.inference.triton_repository import (
    FORMATS, INSTANCE_KINDS, NUMERICAL_TYPES, TritonModelConfig, check_quantized_target, claim_repository,
    deploy_checkpoint,
)
from dlrm.scripts import cli, serving_flags

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "Checkpoint directory (as written by training).")
flags.DEFINE_string("model_repository", None, "Triton model repository directory (created if missing; an existing "
                    "one must be empty or a Triton repository, to which the model is added).")
flags.DEFINE_flag(serving_flags.model_name_flag(
    "dlrm", "Model name: the directory inside the repository, and what clients ask for."))
flags.DEFINE_enum("format", "onnx", sorted(FORMATS),
                  "onnx: platform onnxruntime_onnx (one file, weights up to 2 GiB); torchscript: pytorch_libtorch.")
flags.DEFINE_boolean("python_backend", False,
                     "Serve the file through Triton's python backend (model.py runs ONNX Runtime or TorchScript), "
                     "for servers without the onnxruntime or pytorch backends, such as nvidia-pytriton's.")
flags.DEFINE_enum("numerical_type", "fp32", sorted(NUMERICAL_TYPES),
                  "Type of the numerical input; fp16 halves its bytes and loses nothing for split-binary data.")
flags.DEFINE_integer("max_batch_size", 65536, "Largest batch the server accepts (after dynamic batching).")
flags.DEFINE_list("preferred_batch_sizes", ["4096", "16384"], "Batch sizes dynamic batching aims for (may be empty).")
flags.DEFINE_integer("max_queue_delay_us", 100, "How long dynamic batching may hold a request to batch it, in µs.")
flags.DEFINE_enum("instance_kind", "gpu", sorted(INSTANCE_KINDS), "Where model instances run.")
flags.DEFINE_integer("instance_count", 1, "Model instances per GPU (or in all, on the CPU).")
flags.DEFINE_list("gpus", None, "GPU indices for the instances (default: every GPU the server sees).")
flags.DEFINE_integer("version", 1, "Model version directory to write.")
flags.DEFINE_integer("intra_op_threads", 0, "Python backend: CPU threads per instance (0: the runtime's default).")
flags.DEFINE_list("check_batch_sizes", ["1", "64", "4096"], "Batch sizes the file is checked at against eager.")
flags.DEFINE_boolean("overwrite", False, "Write over the --model_name folder an earlier deploy wrote in the "
                     "repository (never a folder holding anything else).")
flags.adopt_module_key_flags(serving_flags)  # --quantize_tables, --quantize_min_rows
flags.mark_flags_as_required(["checkpoint", "model_repository"])


def _ints(values: list[str] | None, flag: str, positive: bool = False) -> list[int] | None:
    if values is None:
        return None
    try:
        ints = [int(v) for v in values]
    except ValueError:
        raise app.UsageError(f"--{flag} must be a comma-separated list of integers, got {','.join(values)}") from None
    if positive and any(i < 1 for i in ints):
        raise app.UsageError(f"--{flag} must be positive, got {','.join(values)}")
    return ints


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    absl_logging.set_verbosity(absl_logging.WARNING)  # the ONNX exporter logs every graph pass at INFO
    quantize_tables = serving_flags.quantize_tables()
    try:  # a config field out of range: one line naming its flag
        cfg = TritonModelConfig(
            model_name=FLAGS.model_name, format=FLAGS.format, python_backend=FLAGS.python_backend,
            numerical_type=FLAGS.numerical_type, max_batch_size=FLAGS.max_batch_size,
            preferred_batch_sizes=_ints(FLAGS.preferred_batch_sizes, "preferred_batch_sizes"),
            max_queue_delay_us=FLAGS.max_queue_delay_us, instance_kind=FLAGS.instance_kind,
            instance_count=FLAGS.instance_count, gpus=_ints(FLAGS.gpus, "gpus"), version=FLAGS.version,
            intra_op_threads=FLAGS.intra_op_threads,
        )
        cfg.validate()
        check_quantized_target(cfg, quantize_tables)
    except ValueError as e:
        raise app.UsageError(cli.flag_terms(str(e), FLAGS)) from None
    check_batch_sizes = _ints(FLAGS.check_batch_sizes, "check_batch_sizes", positive=True)
    # Before any work (dlrm.engine.outputs): never a foreign folder, a link, the working directory or the checkpoint.
    claim_repository(FLAGS.model_repository, cfg.model_name, FLAGS.overwrite, inputs={"checkpoint": FLAGS.checkpoint},
                     settings=("model_repository", "model_name"))
    # a bad checkpoint raises CheckpointError: cli.run prints it as one line and exits 2
    try:
        deployed = deploy_checkpoint(FLAGS.checkpoint, FLAGS.model_repository, cfg, check_batch_sizes, FLAGS.overwrite,
                                     quantize_tables, FLAGS.quantize_min_rows)
    except ValueError as e:  # --quantize_tables that does not fit the model; a config that reads back wrong
        raise app.UsageError(cli.flag_terms(str(e), FLAGS)) from None
    flavour = "python backend" if cfg.python_backend else f"platform {FORMATS[cfg.format][1]}"
    print(f"deployed {cfg.model_name!r} ({flavour}, {cfg.format}, numerical {cfg.numerical_type}) "
          f"to {deployed.model_dir}")
    for path in deployed.files:
        print(f"  wrote {path}")
    for batch_size, error in deployed.max_abs_errors.items():
        print(f"  batch {batch_size}: max abs error against eager {error:.3g}")
    return 0


def run() -> None:
    cli.run(main)


if __name__ == "__main__":
    run()
