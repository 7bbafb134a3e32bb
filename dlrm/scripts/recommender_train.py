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
kept as aliases.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import uuid

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
flags.DEFINE_integer("patience_steps", 200, "Without --epochs: training also goes on until this many steps have "
                     "passed since the best NDCG@K (on small data an epoch is a few steps, and --patience epochs "
                     "alone would stop a run that is still improving); 0: --patience alone.", lower_bound=0)
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
flags.mark_flags_as_required(["input", "save_checkpoint_path"])

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


# Flags of the autoencoder's training alone: the linear model refuses them rather than ignore them.
_AUTOENCODER_FLAGS = ("network", "output", "batch_size", "epochs", "max_epochs", "patience", "patience_steps",
                      "validate_every_steps", "resume", "checkpoint_every_steps", "max_steps", "amp", "amp_dtype",
                      "negatives", "optimizer", "alpha", "mu", "lambda", "tensorboard_dir", "print_freq")


def _main(argv: list[str], env) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    model = FLAGS.model if FLAGS.model != "auto" else ("autoencoder" if FLAGS.network else "linear")
    if model == "linear":
        return _fit_linear(env)
    if not FLAGS.network:
        raise app.UsageError("--model autoencoder needs --network (a DSSTNE JSON network, e.g. "
                             "configs/recommender/mult_dae.json); or drop --model for the linear model")
    network = _network()  # before any dataset: a bad file fails at once, naming the key
    for flag in ("input", "output"):
        common.check_dataset_dir(flag, FLAGS[flag].value, _DATASET_HINT)

    from dlrm.engine.checkpoint_store import latest_checkpoint
    from dlrm.engine.checkpoint_store import claim_checkpoint_path
    from dlrm.engine.logger import RunLogger
    from dlrm.engine.outputs import LOG, TENSORBOARD, claim_output
    from dlrm.engine.signals import StopOnSignals
    from dlrm.recommender import checkpoint
    from dlrm.recommender.item_parallel import ItemParallel
    from dlrm.recommender.model import SparseAutoencoder
    from dlrm.recommender.network import NetworkConfigError
    from dlrm.recommender.train import TrainConfig, check_datasets, make_optimizer, train
    from dlrm.recommender.validation import ValidationConfig, make_split
    from dlrm.recommender.validation import validate as validate_split

    device = common.device(FLAGS.base_device, env)
    amp_dtype = common.amp_dtype(FLAGS.amp, FLAGS.amp_dtype, device)
    if FLAGS.negatives is not None and network.output.activation == "softmax":
        raise app.UsageError("--negatives needs an element-wise output activation; the network's Output layer is "
                             "SoftMax, which needs every item's score: drop --negatives")
    path = FLAGS.save_checkpoint_path
    if FLAGS.resume and FLAGS.overwrite:
        raise app.UsageError("--resume continues the checkpoint at --save_checkpoint_path and --overwrite starts over "
                             "in its place: pass one of them")
    # Before any work, every path the run writes obeys the output rule (dlrm.engine.outputs).
    inputs = {"input": FLAGS.input, "output": FLAGS.output, "network": FLAGS.network}
    claim_checkpoint_path(path, checkpoint.META_FORMAT, inputs=inputs, replace=FLAGS.overwrite, keep=FLAGS.resume,
                          suffixes=("", ".best") if FLAGS.validation_users > 0 else ("",))
    inputs["save_checkpoint_path"] = path
    if FLAGS.log_path:
        claim_output(FLAGS.log_path, LOG, "log_path", inputs=inputs, keep=True)
    if FLAGS.tensorboard_dir:
        claim_output(FLAGS.tensorboard_dir, TENSORBOARD, "tensorboard_dir", inputs=inputs, keep=True)
    found = None if FLAGS.overwrite else latest_checkpoint(path)
    run_id = uuid.uuid4().hex  # names this run in its checkpoints, so a .best of another run is never taken for it
    if found is not None:
        saved = checkpoint.read_meta(found).get("run_config", {})
        run_id = saved.get(checkpoint.RUN_ID, run_id)
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
                      patience_steps=FLAGS.patience_steps,
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
    run_config = {**cli.our_flags(), checkpoint.RUN_ID: run_id}
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


def _device_memory(device) -> int:
    """Bytes of memory of ``device``: the GPU's, or the machine's RAM."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _fit_linear(env) -> int:
    """--model linear: the item x item model, its settings chosen on validation, refitted on all
    of --input and saved at --save_checkpoint_path."""
    given = [name for name in _AUTOENCODER_FLAGS if FLAGS[name].present]
    if given:
        raise app.UsageError(f"--{given[0]} applies to the autoencoder (--network), not to the linear model, which "
                             f"has no epochs, steps or optimizer: drop it, or give --network")
    if env is not None:
        raise app.UsageError("the linear model fits on one process: run it without torchrun (under torchrun, "
                             "--network trains the item-parallel autoencoder)")
    if not 0 < FLAGS.validation_items < 1:
        raise app.UsageError(f"--validation_items {FLAGS.validation_items:g}: must be in (0, 1)")
    if FLAGS.validation_users <= 0:
        raise app.UsageError("--validation_users 0: the linear model's settings are chosen on validation; give a "
                             "share of the users in (0, 1]")
    common.check_dataset_dir("input", FLAGS.input, _DATASET_HINT)

    import torch

    from dlrm.engine.checkpoint_store import CheckpointLock, claim_checkpoint_path
    from dlrm.engine.logger import RunLogger
    from dlrm.engine.outputs import LOG, claim_output
    from dlrm.recommender import checkpoint, linear
    from dlrm.recommender.validation import ValidationConfig, make_split, validate_scores

    path = FLAGS.save_checkpoint_path
    inputs_named = {"input": FLAGS.input}
    claim_checkpoint_path(path, checkpoint.META_FORMAT, inputs=inputs_named, replace=FLAGS.overwrite)
    if FLAGS.log_path:
        claim_output(FLAGS.log_path, LOG, "log_path", inputs={**inputs_named, "save_checkpoint_path": path}, keep=True)
    inputs = common.dataset("input", FLAGS.input, _DATASET_HINT)
    n = inputs.n_features
    device = common.device(FLAGS.base_device, env)
    need = linear.memory_bytes(n, len(inputs))
    budget = (FLAGS.linear_max_memory_gb * 2**30 if FLAGS.linear_max_memory_gb is not None
              else 0.8 * _device_memory(device))
    # float64 redoes a fit whose float32 inverse is off (linear.solve), if its memory is there.
    allow_float64 = linear.memory_bytes(n, len(inputs), torch.float64) <= budget
    if need > budget:
        raise app.UsageError(f"the linear model of {n:,} items needs {need / 2**30:.1f} GiB (items^2 x "
                             f"{need // max(n * n, 1)} bytes), "
                             f"over the {budget / 2**30:.1f} GiB of --linear_max_memory_gb: raise it if {device} has "
                             f"the memory, or train the item-parallel autoencoder (--network)")
    # Small data needs every user's say: the linear model validates on all users up to
    # --validation_max_users unless --validation_users is given (it costs one ranking pass).
    users = FLAGS.validation_users if FLAGS["validation_users"].present else 1.0
    try:
        v_cfg = ValidationConfig(user_fraction=users, max_users=FLAGS.validation_max_users,
                                 item_fraction=FLAGS.validation_items, k=FLAGS.validation_k)
        split = make_split(inputs, v_cfg, FLAGS.seed)
    except ValueError as e:
        raise app.UsageError(f"--validation_users: {e}") from None
    k = FLAGS.validation_k
    run_config = cli.our_flags()
    with CheckpointLock(path), RunLogger(FLAGS.log_path) as logger:
        logger.record("flags", **run_config)
        logger.print(f"linear item-item model (EASE, EDLAE): {len(inputs):,} users, {n:,} items, "
                     f"{inputs.nnz:,} interactions; device {device}; settings chosen by validation NDCG@{k} over "
                     f"{split.n_held:,} items of {len(split.users):,} users held out of the fit")
        started = time.perf_counter()
        g = linear.gram(inputs, split.train_mask, device)

        def validate(model: linear.LinearModel):
            return validate_scores(model.scores, inputs, split, v_cfg)

        def report(trial: linear.Trial) -> None:
            m = trial.metrics
            logger.record("validation", regularization=trial.settings.regularization, dropout=trial.settings.dropout,
                          ndcg=m.ndcg, precision=m.precision, recall=m.recall, seconds=trial.seconds)
            logger.print(f"  {trial.settings.describe():<32} validation NDCG@{k} {m.ndcg:.4f}  P@{k} "
                         f"{m.precision:.4f}  R@{k} {m.recall:.4f}  ({trial.seconds:.1f} s)")

        try:
            choice = linear.choose(g, validate, report=report, allow_float64=allow_float64)
            del g
            best = choice.best
            ease = max((t for t in choice.trials if t.settings.dropout == 0), key=lambda t: t.metrics.ndcg)
            fitted = linear.LinearModel(linear.solve(linear.gram(inputs, None, device), best.settings, allow_float64),
                                         best.settings)
        except linear.LinearFitError as e:
            raise app.UsageError(str(e).replace("`regularization`", "the regularisation")) from None
        validation = {"k": k, "ndcg": best.metrics.ndcg, "precision": best.metrics.precision,
                      "recall": best.metrics.recall, "users": len(split.users), "held_out": split.n_held,
                      "ease_ndcg": ease.metrics.ndcg, "ease_regularization": ease.settings.regularization,
                      "trials": len(choice.trials)}
        checkpoint.save_linear(path, fitted, validation, run_config)
        seconds = time.perf_counter() - started
        summary = {"stop_reason": "completed", "model": "linear", **dataclasses.asdict(best.settings),
                   "best_validation_ndcg": best.metrics.ndcg, "seconds": seconds}
        logger.record("summary", **summary)
        why = ("EASE's best" if best.settings.dropout == 0 else
               f"EASE's best {ease.metrics.ndcg:.4f} at lambda {ease.settings.regularization:g}")
        logger.print(f"chose {best.settings.describe()}: validation NDCG@{k} {best.metrics.ndcg:.4f} ({why}, the "
                     f"best of {len(choice.trials)} settings); refitted on all {len(inputs):,} users; "
                     f"{seconds:.1f} s; checkpoint {path}")
    return 0


if __name__ == "__main__":
    cli.run(main, prefix=cli.rank_prefix)
