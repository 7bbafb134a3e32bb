r"""Ranking metrics of the sparse autoencoder and of standard baselines on a held-out split.

    python -m dlrm.scripts.recommender_evaluate --input /data/ml20m/input --heldout /data/ml20m/heldout \
        --load_checkpoint_path ckpt/ --k 1,5,10,20 --output metrics.json

Every user's --input items are the history a recommender sees; their --heldout items (the same
users in the same order, from recommender_generate's held-out split) are what it should find.
The model (--load_checkpoint_path) and each of --baselines rank every item the user has not seen, through
the same exclusion and top-K path, and are scored with precision, recall and NDCG at each K and
catalogue coverage (dlrm.recommender.metrics defines them). Baselines, fitted on the --input rows:
popularity (item counts), itemknn (item-item cosine kNN, --knn_neighbours), mf (implicit ALS
matrix factorisation, --mf_factors, --mf_iterations) and ease (Steck's closed-form linear
autoencoder, --ease_lambda; its items x items matrices need items^2 x 12 bytes, refused above
--ease_max_memory_gb).

Under torchrun the model is evaluated with its item layers split across the processes; the
baselines then run on the first process alone.

--output writes the metrics as a JSON object (input, heldout, checkpoint, k, users, results); an
existing --output is replaced only with --overwrite, and only when it is such a file.

--load_checkpoint_path and --base_device are dlrm.scripts.main's names; --checkpoint and
--device are kept as aliases. The flags describe one dlrm.recommender.run_config.EvaluateConfig
and are generated from it (dlrm.scripts.recommender_flags: each flag sets the field of its
name; --k's comma-separated cut-offs as integers), and the run is
dlrm.recommender.api.evaluate(config), whose config's fields are these flags: the same from
Python.
"""

from __future__ import annotations

from absl import app, flags

from dlrm.scripts import cli, recommender_flags

FLAGS = flags.FLAGS
recommender_flags.EVALUATE.define(__name__)  # every flag, from EvaluateConfig's fields


ERRORS = (*cli.DEFAULT_ERRORS, "dlrm.recommender.run_config.ConfigError",
          "dlrm.engine.checkpoint_store.CheckpointError")


def config_from_flags(values: flags.FlagValues = FLAGS):
    """The EvaluateConfig of the flags of ``values``: each flag sets the field of its name (--k's
    cut-offs as integers), as ``recommender_flags.EVALUATE`` declares."""
    return recommender_flags.EVALUATE.config(values)


def _table(results: dict[str, dict], ks: list[int]) -> str:
    columns = [(f"{name}@{k}", f"{key}@{k}") for k in ks for name, key in
               (("P", "precision"), ("R", "recall"), ("NDCG", "ndcg"))]
    columns.append((f"cov@{ks[-1]}", f"coverage@{ks[-1]}"))
    width = max(10, *(len(name) for name in results)) + 2
    lines = ["".ljust(width) + "".join(title.rjust(9) for title, _ in columns)]
    for name, row in results.items():
        lines.append(name.ljust(width) + "".join(f"{row[key]:9.4f}" for _, key in columns))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return cli.run_processes(_main, argv, ERRORS)


def _main(argv: list[str], env) -> int:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    from dlrm.recommender import api

    cfg = config_from_flags()
    report = api.evaluate(cfg)
    if report is None:  # under torchrun, a process other than the first: the first reports
        return 0
    print(f"{report['n_users']:,} users ({report['users']:,} with held-out items), {report['n_items']:,} items")
    print(_table(report["results"], report["k"]))
    if cfg.output:
        print(f"wrote {cfg.output}")
    return 0


if __name__ == "__main__":
    cli.run(main, ERRORS, prefix=cli.rank_prefix, short_help=recommender_flags.EVALUATE.short_help)
