r"""Train the recommender on CSR user histories: a linear item-item model or DSSTNE's sparse
autoencoder (DSSTNE's train).

    # the default: the linear item-item model, its settings chosen on a validation split
    python -m dlrm.scripts.recommender_train --input /data/ml100k/input --save_checkpoint_path ckpt/
    python -m dlrm.scripts.recommender_train --network configs/recommender/movielens_autoencoder.json \
        --input /data/ml20m/input --save_checkpoint_path ckpt/ --epochs 10 --batch_size 256
    # continue where it stopped (the same draws as an uninterrupted run)
    python -m dlrm.scripts.recommender_train --network ... --input ... --save_checkpoint_path ckpt/ --resume
    # item layers split across processes (one GPU each, or CPU processes with gloo)
    torchrun --nproc_per_node 4 -m dlrm.scripts.recommender_train --network ... --input ... \
        --save_checkpoint_path ckpt/

--model auto (the default) fits the linear item-item model (dlrm.recommender.linear: EASE and its
dropout-emphasised form EDLAE, in closed form) when no --network is given and its item x item
matrices fit --linear_max_memory_gb; its regularisation and dropout are chosen by NDCG@K on a
validation split of --input (--validation_items of the items of every user, up to
--validation_max_users users), then it is refitted on all of --input. It needs no epochs, batch
size or learning rate. With --network (or --model autoencoder) the autoencoder trains, as
below: the model of catalogues too large for an item x item matrix, and DSSTNE's.

--network is a DSSTNE JSON network definition ("N": "auto" takes the dataset's item count);
its Optimizer block (this project's addition) can be overridden with --optimizer, --alpha, --mu
and --lambda. --output is the target dataset: by default the input itself (an autoencoder).
--negatives N estimates the loss's zero-target term from N sampled items per step: an unbiased
approximation for very large catalogues, not the exact loss DSSTNE computed.

A checkpoint is written every --checkpoint_every_steps steps (else at the end of every epoch)
and where the run stops; --resume continues from it exactly, given the same --seed and
--batch_size. Without --resume an existing checkpoint at --save_checkpoint_path is an error,
never silently replaced (--overwrite starts over in its place); a folder holding anything else is
never replaced at all.

A run whose training loss turns non-finite (nan or inf: too high an --alpha, say) stops with
exit code 3 and one line naming the step and the flags to change; nothing non-finite is ever
saved, so --save_checkpoint_path (and its .best) keeps the last finite checkpoint. Exit codes:
0 done, 2 a usage or input error (also a disk that fills), 3 a non-finite loss, 130/143 stopped
by Ctrl-C/SIGTERM after saving.

Flag names are dlrm.scripts.main's for the same settings: --save_checkpoint_path, --print_freq
and --base_device; the earlier names --checkpoint_path, --log_every_steps and --device are
kept as aliases, and --eval_every_steps is another name of --validate_every_steps.

The flags describe one dlrm.recommender.run_config.RecommenderConfig (each flag sets the
setting of its name; --print_freq sets log_every_steps, --validate_every_steps eval_every_steps),
and the run is dlrm.recommender.api.train(config): the same run from Python.
"""

from __future__ import annotations

from absl import app, flags

from dlrm.scripts import cli
from dlrm.scripts import recommender_common as common

FLAGS = flags.FLAGS
flags.DEFINE_enum("model", "auto", ["auto", "linear", "autoencoder"], "The model to train. auto: the linear "
                  "item-item model (settings chosen on validation) without --network, the autoencoder with it; "
                  "linear: EASE/EDLAE in closed form (items^2 x 8 bytes of memory); autoencoder: the network of "
                  "--network.")
flags.DEFINE_float("linear_max_memory_gb", None, "The linear model's item x item matrices may take at most this "
                   "much memory (items^2 x 8 bytes; x 16 to redo an ill-conditioned fit in float64); default: 80% "
                   "of the device's (the GPU's, or the machine's RAM). Above it, train the autoencoder (--network).",
                   lower_bound=0)
flags.DEFINE_string("network", None, "DSSTNE JSON network definition, e.g. "
                    "configs/recommender/movielens_autoencoder.json.")
flags.DEFINE_string("input", None, "CSR dataset of the inputs (user histories), e.g. DIR/input of "
                    "recommender_generate.")
flags.DEFINE_string("output", None, "CSR dataset of the targets, the same users in the same order; default: "
                    "--input (an autoencoder reconstructs its input).")
flags.DEFINE_integer("batch_size", 256, "Users per step (the global batch, whatever the process count).",
                     lower_bound=1)
flags.DEFINE_integer("epochs", None, "Passes over the users. Default: until the validation NDCG@K has not improved "
                     "for --patience validations and --patience_steps steps (at most --max_epochs); with --epochs, "
                     "exactly that many (the best validation's checkpoint is still kept).", lower_bound=1)
flags.DEFINE_integer("max_epochs", 200, "Without --epochs: the most passes validation may ask for.", lower_bound=1)
flags.DEFINE_float("validation_users", None, "Share of the users that lend items to a validation split (seeded by "
                   "--seed; at most --validation_max_users); default: 0.1 for the autoencoder, every user (1) for "
                   "the linear model; 0: no validation, then --epochs is required.",
                   lower_bound=0, upper_bound=1)
flags.DEFINE_integer("validation_max_users", 10_000, "At most this many validation users.", lower_bound=1)
flags.DEFINE_float("validation_items", 0.2, "Share of each validation user's items held out of training and ranked "
                   "(at least one item, never the whole history).", lower_bound=0, upper_bound=1)
flags.DEFINE_integer("validation_k", 10, "K of the validation's NDCG@K (which picks the best checkpoint), P@K, R@K.",
                     lower_bound=1)
flags.DEFINE_integer("patience", 5, "Without --epochs: validations without a better NDCG@K before training stops.",
                     lower_bound=1)
flags.DEFINE_integer("patience_steps", 200, "Without --epochs: training also goes on until this many steps have "
                     "passed since the best NDCG@K (on small data an epoch is a few steps, and --patience epochs "
                     "alone would stop a run that is still improving); 0: --patience alone.", lower_bound=0)
flags.DEFINE_integer("validate_every_steps", 0, "Validate every this many steps; 0: at the end of every epoch.",
                     lower_bound=0)
cli.alias("eval_every_steps", "validate_every_steps", "dlrm.scripts.main's name")
flags.DEFINE_integer("seed", 0, "Seed of the weights and of every random draw (user order, denoising, dropout, "
                     "negatives).")
flags.DEFINE_string("save_checkpoint_path", None, "Checkpoint directory, written during and at the end of the "
                    "run (and the one --resume continues).")
cli.alias("checkpoint_path", "save_checkpoint_path", "the earlier name")
flags.DEFINE_boolean("resume", False, "Continue from the checkpoint at --save_checkpoint_path if there is one "
                     "(exactly where it stopped; same --seed and --batch_size).")
flags.DEFINE_boolean("overwrite", False, "Start a new run and replace the checkpoint (and its .best) already at "
                     "--save_checkpoint_path; a folder that holds anything but this program's checkpoint is never "
                     "replaced.")
flags.DEFINE_integer("checkpoint_every_steps", 0, "Save every this many steps; 0: at the end of every epoch.",
                     lower_bound=0)
flags.DEFINE_integer("max_steps", None, "Stop after this many steps of this run (the checkpoint resumes).",
                     lower_bound=1)
common.define_device("Automatic mixed precision (torch.autocast, see --amp_dtype).", ["auto", "bf16"],
                     "Autocast dtype with --amp. auto: bf16, or float32 on a CPU without bf16 instructions (where "
                     "bf16 is slower). fp16 is not offered because the training loop does no loss scaling (fp16 "
                     "gradients underflow).")
flags.DEFINE_integer("negatives", None, "Sampled negative items per step (an approximation of the full loss for "
                     "large catalogues); default: every item is scored.", lower_bound=1)
flags.DEFINE_enum("optimizer", None, ["sgd", "momentum", "nesterov", "adagrad", "rmsprop", "adam"],
                  "Override the network file's Optimizer.Kind.")
flags.DEFINE_float("alpha", None, "Override Optimizer.Alpha (learning rate, > 0). Too high, and the loss "
                   "diverges: the run stops with exit code 3, keeping its last finite checkpoint.")
flags.DEFINE_float("mu", None, "Override Optimizer.Mu (momentum; RMSProp's decay), in [0, 1).")
flags.DEFINE_float("lambda", None, "Override Optimizer.Lambda (L2 weight decay of the weights, >= 0).")
flags.DEFINE_string("log_path", None, "JSON-lines log: the flags, periodic train records, checkpoints and a "
                    "final summary (appended to).")
flags.DEFINE_string("tensorboard_dir", None, "Also write the logged metrics (train/loss, validation/ndcg, ...) as "
                    "TensorBoard scalars to this directory, to watch with `tensorboard --logdir DIR` (pip extra: "
                    "tensorboard).")
flags.DEFINE_integer("print_freq", 100, "Print and log the loss every this many steps; 0: never.",
                     lower_bound=0)
cli.alias("log_every_steps", "print_freq", "the earlier name")
flags.mark_flags_as_required(["input", "save_checkpoint_path"])


# The library errors a run reports as one line, exit 2: a refused setting, and checkpoints.
ERRORS = (*cli.DEFAULT_ERRORS, "dlrm.recommender.run_config.ConfigError",
          "dlrm.engine.checkpoint_store.CheckpointError")


def config_from_flags():
    """The RecommenderConfig of the flags: each flag sets the setting of its name (--print_freq
    ``log_every_steps``, --validate_every_steps ``eval_every_steps``, --lambda ``lambda_``)."""
    from dlrm.recommender.run_config import (CheckpointConfig, DataConfig, LinearConfig, ModelConfig,
                                             OptimizerOverrides, RecommenderConfig, TrainSettings, ValidationSettings)

    return RecommenderConfig(
        data=DataConfig(input=FLAGS.input, output=FLAGS.output),
        model=ModelConfig(model=FLAGS.model, network=FLAGS.network,
                          linear=LinearConfig(linear_max_memory_gb=FLAGS.linear_max_memory_gb),
                          optimizer=OptimizerOverrides(optimizer=FLAGS.optimizer, alpha=FLAGS.alpha, mu=FLAGS.mu,
                                                       lambda_=FLAGS["lambda"].value)),
        validation=ValidationSettings(validation_users=FLAGS.validation_users,
                                      validation_max_users=FLAGS.validation_max_users,
                                      validation_items=FLAGS.validation_items, validation_k=FLAGS.validation_k,
                                      patience=FLAGS.patience, patience_steps=FLAGS.patience_steps),
        train=TrainSettings(epochs=FLAGS.epochs, max_epochs=FLAGS.max_epochs, max_steps=FLAGS.max_steps,
                            log_every_steps=FLAGS.print_freq, eval_every_steps=FLAGS.validate_every_steps,
                            checkpoint_every_steps=FLAGS.checkpoint_every_steps, negatives=FLAGS.negatives,
                            amp=FLAGS.amp, amp_dtype=FLAGS.amp_dtype),
        checkpoint=CheckpointConfig(save_checkpoint_path=FLAGS.save_checkpoint_path, resume=FLAGS.resume,
                                    overwrite=FLAGS.overwrite),
        seed=FLAGS.seed, batch_size=FLAGS.batch_size, base_device=FLAGS.base_device,
        dist_timeout=FLAGS.dist_timeout, log_path=FLAGS.log_path, tensorboard_dir=FLAGS.tensorboard_dir)


def main(argv: list[str]) -> int:
    return cli.run_processes(_main, argv, ERRORS)


def _main(argv: list[str], env) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from dlrm.recommender import api

    summary = api.train(config_from_flags())
    signum = summary.get("signal")
    return 128 + signum if summary["stop_reason"] == "interrupted" and signum else 0


if __name__ == "__main__":
    cli.run(main, ERRORS, prefix=cli.rank_prefix)
