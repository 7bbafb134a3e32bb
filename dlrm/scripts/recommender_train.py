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

The flags describe one dlrm.recommender.run_config.RecommenderConfig and are generated from it
(dlrm.scripts.recommender_flags: each flag sets the setting of its name; --print_freq sets
log_every_steps, --validate_every_steps eval_every_steps), and the run is
dlrm.recommender.api.train(config): the same run from Python.
"""

from __future__ import annotations

from absl import app, flags

from dlrm.scripts import cli, recommender_flags

FLAGS = flags.FLAGS
recommender_flags.TRAIN.define(__name__)  # every flag, from RecommenderConfig's fields


# The library errors a run reports as one line, exit 2: a refused setting, and checkpoints.
ERRORS = (*cli.DEFAULT_ERRORS, "dlrm.recommender.run_config.ConfigError",
          "dlrm.engine.checkpoint_store.CheckpointError")


def config_from_flags(values: flags.FlagValues = FLAGS):
    """The RecommenderConfig of the flags of ``values``: each flag sets the setting of its name
    (--print_freq ``log_every_steps``, --validate_every_steps ``eval_every_steps``, --lambda
    ``lambda_``), as ``recommender_flags.TRAIN`` declares."""
    return recommender_flags.TRAIN.config(values)


def main(argv: list[str]) -> int:
    return cli.run_processes(_main, argv, ERRORS)


def _main(argv: list[str], env) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from dlrm.recommender import api

    summary = api.train(config_from_flags()).summary
    signum = summary.get("signal")
    return 128 + signum if summary["stop_reason"] == "interrupted" and signum else 0


if __name__ == "__main__":
    cli.run(main, ERRORS, prefix=cli.rank_prefix, short_help=recommender_flags.TRAIN.short_help)
