r"""Top-K recommendations of a trained sparse autoencoder (DSSTNE's predict).

    python -m dlrm.scripts.recommender_predict --load_checkpoint_path ckpt/ --input /data/ml20m/input \
        --features_index /data/ml20m/features_index.txt --samples_index /data/ml20m/samples_index.txt \
        --k 10 --output recs.txt
    torchrun --nproc_per_node 4 -m dlrm.scripts.recommender_predict --load_checkpoint_path ckpt/ ...

Writes DSSTNE's output, one line per user of --input, best first:

    <user>\t<item>,<score>:<item>,<score>:...

Scores are the Output layer's activations, with 6 significant digits (--score_format %.6g), so
that a user's top K rarely tie on paper; --score_format %4.3f writes them as DSSTNE did (its
-p 4.3f). The run ends with its speed on stdout: "predicted N users in S s (U users/s)".

Items of the user's own history (--input) are never recommended (--noexclude_inputs keeps
them), nor those of the --filter datasets (the same users in the same order, e.g. items already
bought). Names come from the index files of
recommender_generate; without them users and items are shown as their row and column numbers.
Under torchrun each process scores its own item range and the lists are merged exactly; the
first process writes the file. --scores_path also writes every score before exclusion, a float32
.npy of [users, items] (one process only: it is as large as users x items x 4 bytes).

An existing --output or --scores_path is replaced only with --overwrite, and only when it holds
what this command writes (a file of anything else is refused, whatever the flags say).

--load_checkpoint_path and --base_device are dlrm.scripts.main's names; --checkpoint and
--device are kept as aliases. The flags describe one dlrm.recommender.run_config.PredictConfig
and are generated from it (dlrm.scripts.recommender_flags: each flag sets the field of its
name), and the run is dlrm.recommender.api.predict(config), whose config's fields are these
flags: the same from Python.
"""

from __future__ import annotations

from absl import app, flags

from dlrm.scripts import cli, recommender_flags

FLAGS = flags.FLAGS
recommender_flags.PREDICT.define(__name__)  # every flag, from PredictConfig's fields


ERRORS = (*cli.DEFAULT_ERRORS, "dlrm.recommender.run_config.ConfigError",
          "dlrm.engine.checkpoint_store.CheckpointError")


def config_from_flags(values: flags.FlagValues = FLAGS):
    """The PredictConfig of the flags of ``values``: each flag sets the field of its name,
    as ``recommender_flags.PREDICT`` declares."""
    return recommender_flags.PREDICT.config(values)


def main(argv: list[str]) -> int:
    return cli.run_processes(_main, argv, ERRORS)


def _main(argv: list[str], env) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from dlrm.recommender import api

    cfg = config_from_flags()
    done = api.predict(cfg)
    if done["first"]:
        lines, seconds, processes = done["users"], done["seconds"], done["processes"]
        print(f"wrote {cfg.output}: {lines:,} users, top {cfg.k} items each from {done['items']:,} "
              f"(inputs {'excluded' if cfg.exclude_inputs else 'allowed'}"
              f"{', ' + str(done['filters']) + ' filter(s)' if done['filters'] else ''}), {processes} "
              f"process{'es' if processes > 1 else ''}")
        if cfg.scores_path:
            print(f"wrote {cfg.scores_path}: float32 [{lines:,}, {done['items']:,}] scores")
        print(f"predicted {lines:,} users in {seconds:.2f} s ({lines / max(seconds, 1e-9):,.0f} users/s)")
    return 0


if __name__ == "__main__":
    cli.run(main, ERRORS, prefix=cli.rank_prefix, short_help=recommender_flags.PREDICT.short_help)
