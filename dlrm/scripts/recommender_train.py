r"""Train the sparse autoencoder recommender on CSR user histories (DSSTNE's train).

    python -m dlrm.scripts.recommender_train --network configs/recommender/movielens_autoencoder.json \
        --input /data/ml20m/input --save_checkpoint_path ckpt/ --epochs 10 --batch_size 256
    # continue where it stopped (the same draws as an uninterrupted run)
    python -m dlrm.scripts.recommender_train --network ... --input ... --save_checkpoint_path ckpt/ --resume
    # item layers split across processes (one GPU each, or CPU processes with gloo)
    torchrun --nproc_per_node 4 -m dlrm.scripts.recommender_train --network ... --input ... \
        --save_checkpoint_path ckpt/

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
kept as aliases.
"""

from __future__ import annotations

import dataclasses
import functools

from absl import app, flags

from dlrm.scripts import cli
from dlrm.scripts import recommender_common as common

FLAGS = flags.FLAGS
flags.DEFINE_string("network", None, "DSSTNE JSON network definition, e.g. "
                    "configs/recommender/movielens_autoencoder.json.")
flags.DEFINE_string("input", None, "CSR dataset of the inputs (user histories), e.g. DIR/input of "
                    "recommender_generate.")
flags.DEFINE_string("output", None, "CSR dataset of the targets, the same users in the same order; default: "
                    "--input (an autoencoder reconstructs its input).")
flags.DEFINE_integer("batch_size", 256, "Users per step (the global batch, whatever the process count).",
                     lower_bound=1)
flags.DEFINE_integer("epochs", None, "Passes over the users. Default: until the validation NDCG@K has not improved "
                     "for --patience validations (at most --max_epochs); with --epochs, exactly that many (the best "
                     "validation's checkpoint is still kept).", lower_bound=1)
flags.DEFINE_integer("max_epochs", 200, "Without --epochs: the most passes validation may ask for.", lower_bound=1)
flags.DEFINE_float("validation_users", 0.1, "Share of the users that lend items to a validation split (seeded by "
                   "--seed; at most --validation_max_users); 0: no validation, then --epochs is required.",
                   lower_bound=0, upper_bound=1)
flags.DEFINE_integer("validation_max_users", 10_000, "At most this many validation users.", lower_bound=1)
flags.DEFINE_float("validation_items", 0.2, "Share of each validation user's items held out of training and ranked "
                   "(at least one item, never the whole history).", lower_bound=0, upper_bound=1)
flags.DEFINE_integer("validation_k", 10, "K of the validation's NDCG@K (which picks the best checkpoint), P@K, R@K.",
                     lower_bound=1)
flags.DEFINE_integer("patience", 5, "Without --epochs: validations without a better NDCG@K before training stops.",
                     lower_bound=1)
flags.DEFINE_integer("validate_every_steps", 0, "Validate every this many steps; 0: at the end of every epoch.",
                     lower_bound=0)
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
flags.mark_flags_as_required(["network", "input", "save_checkpoint_path"])

# Flags a resumed run must share with the checkpoint's run to draw what it would have drawn.
_MUST_MATCH_ON_RESUME = ("seed", "batch_size", "validation_users", "validation_max_users", "validation_items")



_DATASET_HINT = " (e.g. DIR/input of recommender_generate)"


def _plain(message: str) -> str:
    """A network file's message with its JSON paths in quotes: `Alpha` there is a key of the file,
    not a setting cli.run should show as a flag."""
    return str(message).replace("`", "'")


def _network():
    """The network file, its optimizer overridden by the flags."""
    from dlrm.recommender.network import NetworkConfigError, parse_network

    try:
        config = parse_network(FLAGS.network)
    except NetworkConfigError as e:
        raise app.UsageError(f"--network {_plain(e)}") from None
    overrides = {}
    if FLAGS.optimizer is not None:
        overrides["kind"] = FLAGS.optimizer
    if FLAGS.alpha is not None:
        if not FLAGS.alpha > 0:
            raise app.UsageError(f"--alpha {FLAGS.alpha:g}: the learning rate must be > 0")
        overrides["alpha"] = FLAGS.alpha
    if FLAGS.mu is not None:
        if not 0 <= FLAGS.mu < 1:
            raise app.UsageError(f"--mu {FLAGS.mu:g}: must be in [0, 1)")
        overrides["mu"] = FLAGS.mu
    if FLAGS["lambda"].value is not None:
        if not FLAGS["lambda"].value >= 0:
            raise app.UsageError(f"--lambda {FLAGS['lambda'].value:g}: the weight decay must be >= 0")
        overrides["lambda_"] = FLAGS["lambda"].value
    if overrides:
        config = dataclasses.replace(config, optimizer=dataclasses.replace(config.optimizer, **overrides))
    return config


def main(argv: list[str]) -> int:
    return cli.run_processes(_main, argv)


def _main(argv: list[str], env) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    network = _network()  # before any dataset: a bad file fails at once, naming the key
    for flag in ("input", "output"):
        common.check_dataset_dir(flag, FLAGS[flag].value, _DATASET_HINT)

    from dlrm.recommender import checkpoint
    from dlrm.recommender.item_parallel import ItemParallel
    from dlrm.recommender.model import SparseAutoencoder
    from dlrm.recommender.network import NetworkConfigError
    from dlrm.recommender.train import TrainConfig, check_datasets, make_optimizer, train
    from dlrm.recommender.validation import ValidationConfig, make_split
    from dlrm.recommender.validation import validate as validate_split
    from dlrm.training.signals import StopOnSignals
    from dlrm.data.outputs import LOG, TENSORBOARD, claim_output
    from dlrm.training.checkpoint import latest_checkpoint
    from dlrm.training.checkpoint_store import claim_checkpoint_path
    from dlrm.training.logger import RunLogger

    device = common.device(FLAGS.base_device, env)
    amp_dtype = common.amp_dtype(FLAGS.amp, FLAGS.amp_dtype, device)
    if FLAGS.negatives is not None and network.output.activation == "softmax":
        raise app.UsageError("--negatives needs an element-wise output activation; the network's Output layer is "
                             "SoftMax, which needs every item's score: drop --negatives")
    path = FLAGS.save_checkpoint_path
    if FLAGS.resume and FLAGS.overwrite:
        raise app.UsageError("--resume continues the checkpoint at --save_checkpoint_path and --overwrite starts over "
                             "in its place: pass one of them")
    # Before any work, every path the run writes obeys the output rule (dlrm.data.outputs).
    inputs = {"input": FLAGS.input, "output": FLAGS.output, "network": FLAGS.network}
    claim_checkpoint_path(path, checkpoint.META_FORMAT, inputs=inputs, replace=FLAGS.overwrite, keep=FLAGS.resume,
                          suffixes=("", ".best") if FLAGS.validation_users > 0 else ("",))
    inputs["save_checkpoint_path"] = path
    if FLAGS.log_path:
        claim_output(FLAGS.log_path, LOG, "log_path", inputs=inputs, keep=True)
    if FLAGS.tensorboard_dir:
        claim_output(FLAGS.tensorboard_dir, TENSORBOARD, "tensorboard_dir", inputs=inputs, keep=True)
    found = None if FLAGS.overwrite else latest_checkpoint(path)
    if found is not None:
        saved = checkpoint.read_meta(found).get("run_config", {})
        for name in _MUST_MATCH_ON_RESUME:
            if name in saved and saved[name] != FLAGS[name].value:
                raise app.UsageError(f"--resume: the checkpoint at {found} was trained with --{name} {saved[name]}, "
                                     f"this run has {FLAGS[name].value}; use the same --{name} to continue it exactly")
    validating = FLAGS.validation_users > 0
    if validating and FLAGS.output:
        if FLAGS.epochs is None:
            raise app.UsageError("--output: validation holds out items of an autoencoder's own input, which other "
                                 "targets cannot follow; give --epochs (and --validation_users 0)")
        validating = False
    if not validating and FLAGS.epochs is None:
        raise app.UsageError("--validation_users 0: without validation, give --epochs")
    if validating and not 0 < FLAGS.validation_items < 1:
        raise app.UsageError(f"--validation_items {FLAGS.validation_items:g}: must be in (0, 1)")
    inputs = common.dataset("input", FLAGS.input, _DATASET_HINT)
    targets = common.dataset("output", FLAGS.output, _DATASET_HINT) if FLAGS.output else inputs
    try:
        network = network.resolve(inputs.n_features, targets.n_features)
    except NetworkConfigError as e:
        raise app.UsageError(f"--network {_plain(e)}") from None

    common.start_processes(env, device, FLAGS.dist_timeout)
    parallel = ItemParallel.from_process_group()
    try:
        model = SparseAutoencoder(network, parallel, seed=FLAGS.seed, device=device)
        check_datasets(inputs, targets, model)
    except ValueError as e:
        raise app.UsageError(f"--network {FLAGS.network}: {e}") from None
    optimizer = make_optimizer(model, network.optimizer)
    state = checkpoint.load(found, model, optimizer) if found is not None else None
    best_path = checkpoint.best_path(path)
    cfg = TrainConfig(batch_size=FLAGS.batch_size, epochs=FLAGS.epochs or FLAGS.max_epochs, seed=FLAGS.seed,
                      shuffle=network.shuffle_indices, negatives=FLAGS.negatives, amp_dtype=amp_dtype,
                      log_every_steps=FLAGS.print_freq, checkpoint_path=path,
                      checkpoint_every_steps=FLAGS.checkpoint_every_steps, max_steps=FLAGS.max_steps,
                      best_checkpoint_path=best_path if validating else None,
                      patience=FLAGS.patience if FLAGS.epochs is None else None,
                      validate_every_steps=FLAGS.validate_every_steps)
    validate, split = None, None
    if validating:
        try:
            v_cfg = ValidationConfig(user_fraction=FLAGS.validation_users, max_users=FLAGS.validation_max_users,
                                     item_fraction=FLAGS.validation_items, k=FLAGS.validation_k,
                                     patience=FLAGS.patience)
            split = make_split(inputs, v_cfg, FLAGS.seed)
        except ValueError as e:
            raise app.UsageError(f"--validation_users: {e}") from None
        validate = functools.partial(validate_split, model, inputs, split, v_cfg, amp_dtype)
    logger = RunLogger(FLAGS.log_path, enabled=parallel.rank == 0, tensorboard_dir=FLAGS.tensorboard_dir)
    run_config = cli.our_flags()
    with logger:
        logger.record("flags", **run_config)
        hidden = " x ".join(str(layer.n) for layer in network.hidden)
        logger.print(f"{network.name}: {model.n_input:,} inputs, hidden {hidden}, {model.n_output:,} outputs; "
                     f"{len(inputs):,} users; optimizer {network.optimizer.kind} (alpha {network.optimizer.alpha:g}); "
                     f"device {device}, {parallel.world_size} process{'es' if parallel.world_size > 1 else ''}"
                     + (f"; resuming at step {state.step} (epoch {state.epoch})" if state is not None else ""))
        if split is not None:
            logger.print(f"validation: {split.n_held:,} items of {len(split.users):,} users held out of training "
                         f"(NDCG@{FLAGS.validation_k} picks the best checkpoint, {best_path})")
        stop = StopOnSignals()
        try:
            summary = train(model, optimizer, inputs, targets, cfg, logger, device, state, run_config,
                            should_stop=stop.event.is_set, validate=validate,
                            train_mask=None if split is None else split.train_mask)
        finally:
            stop.over()
        best = (f"; best validation NDCG@{FLAGS.validation_k} {summary['best_validation_ndcg']:.4f} at epoch "
                f"{summary['best_epoch']} ({best_path})" if "best_validation_ndcg" in summary else "")
        logger.print(f"Finished ({summary['stop_reason']}) after {summary['steps']} steps, {summary['epochs']} "
                     f"epochs: {summary['users_per_s']:,.0f} users/s over {summary['seconds']:.1f} s; checkpoint "
                     f"{path}{best}")
    common.end_processes(env)
    return stop.exit_code_of(summary["stop_reason"])


if __name__ == "__main__":
    cli.run(main, prefix=cli.rank_prefix)
