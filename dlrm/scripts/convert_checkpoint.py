r"""Convert a DLRM checkpoint between this program's format and NVIDIA's DLRM example's layout.

    python -m dlrm.scripts.convert_checkpoint --checkpoint /ckpt/last --output /ckpt/nvidia --to nvidia
    python -m dlrm.scripts.convert_checkpoint --checkpoint /ngc/dlrm --output /ckpt/ours --to dlrm

Either layout is read (the model is built from the checkpoint alone, as for export); the weights
are written in the layout of --to: NVIDIA's (what its main.py --load_checkpoint_path reads on
--nvidia_gpus GPUs, one by default, without --bottom_features_ordered) or this program's (checksummed, loadable at any
process count). Weights only: the copy holds no optimizer state, so a run from it starts at step 0
(--load_checkpoint_path), never --resume. --output is new or empty, or (with --overwrite) a
checkpoint of the same layout; a folder holding anything else is never written into.
"""

from __future__ import annotations

from absl import app, flags

from dlrm.scripts import cli

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "Checkpoint directory to read: this program's or NVIDIA's layout.")
flags.DEFINE_string("output", None, "Directory of the converted checkpoint (new or empty; with --overwrite, a "
                    "checkpoint of the --to layout).")
flags.DEFINE_enum("to", None, ["nvidia", "dlrm"], "Layout to write: nvidia (NVIDIA's DLRM example) or dlrm (this "
                  "program's).")
flags.DEFINE_integer("nvidia_gpus", 1, "--to nvidia: the number of GPUs NVIDIA's main.py will load it on (without "
                     "--bottom_features_ordered, its default): its interaction's table order depends on it.",
                     lower_bound=1)
MAX_GPUS = 1024  # dlrm.training.nvidia_checkpoint_checks.MAX_GPUS (not imported here: it loads torch)
flags.register_validator(
    "nvidia_gpus", lambda gpus: gpus is None or gpus <= MAX_GPUS,
    message=f"--nvidia_gpus is at most {MAX_GPUS}: NVIDIA's DLRM places tables on the GPUs of one node, and a "
            "device mapping for more GPUs than that is no run of its")
flags.DEFINE_boolean("overwrite", False, "Replace a checkpoint of the --to layout already at --output (never a "
                     "folder holding anything else).")
flags.mark_flags_as_required(["checkpoint", "output", "to"])


def main(argv: list[str]) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS["nvidia_gpus"].present and FLAGS.to != "nvidia":
        raise app.UsageError("--nvidia_gpus applies to --to nvidia; drop it")
    from dlrm.engine.checkpoint_store import claim_checkpoint_path
    from dlrm.training import nvidia_checkpoint
    from dlrm.training.checkpoint import FORMAT, TrainState, read_meta, save_checkpoint

    inputs = {"checkpoint": FLAGS.checkpoint}
    # Before any work (dlrm.engine.outputs): never a foreign folder, a link, or the checkpoint read.
    if FLAGS.to == "nvidia":
        nvidia_checkpoint.claim(FLAGS.output, inputs=inputs, replace=FLAGS.overwrite, setting="output")
    else:
        claim_checkpoint_path(FLAGS.output, FORMAT, "output", inputs=inputs, replace=FLAGS.overwrite,
                              keep_setting=None)
    from dlrm.inference.export import build_inference_model

    model = build_inference_model(FLAGS.checkpoint)  # CheckpointError: one line and exit 2 (cli.run)
    if nvidia_checkpoint.is_nvidia_checkpoint(FLAGS.checkpoint):
        source = nvidia_checkpoint.read(FLAGS.checkpoint)
        epoch, step = source.epoch, source.step
    else:
        state = read_meta(FLAGS.checkpoint).get("train_state", {})
        epoch, step = state.get("epoch", 0), state.get("step", 0)
    if FLAGS.to == "nvidia":
        try:
            nvidia_checkpoint.check_can_write(model.config)
        except ValueError as e:
            raise app.UsageError(f"--checkpoint {FLAGS.checkpoint}: {e}".replace("`checkpoint_format=nvidia`",
                                                                                 "--to nvidia")) from None
        nvidia_checkpoint.save(FLAGS.output, model, epoch=epoch, step=step, nvidia_gpus=FLAGS.nvidia_gpus)
    else:
        # Weights only: the step is kept as a record, the data position and optimizer are not.
        save_checkpoint(FLAGS.output, model, None, None, TrainState(step=int(step or 0)),
                        {"converted_from": FLAGS.checkpoint})
    print(f"wrote {FLAGS.output}: the weights of {FLAGS.checkpoint} in "
          f"{'NVIDIA' if FLAGS.to == 'nvidia' else 'this program'}'s layout "
          f"({len(model.config.table_sizes)} tables, step {step})")
    return 0


if __name__ == "__main__":
    cli.run(main)
