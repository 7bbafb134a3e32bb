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
(each flag sets the field of its name; --k's comma-separated cut-offs as integers), and the run
is dlrm.recommender.api.evaluate(config), whose config's fields are these flags: the same from
Python.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags

from dlrm.recommender.run_config import BASELINES
from dlrm.scripts import cli
from dlrm.scripts import recommender_common as common

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "CSR dataset of the users' histories (e.g. DIR/input of recommender_generate).")
flags.DEFINE_string("heldout", None, "CSR dataset of their held-out items (e.g. DIR/heldout), the same users in "
                    "the same order.")
common.define_checkpoint_to_load("Checkpoint of recommender_train to evaluate; default: the baselines only.")
flags.DEFINE_list("baselines", list(BASELINES), f"Baselines to evaluate, comma-separated, from "
                  f"{','.join(BASELINES)}; empty (--baselines=) for none.")
flags.DEFINE_list("k", ["1", "5", "10", "20"], "Cut-offs K of the metrics, comma-separated.")
flags.DEFINE_integer("batch_size", 1024, "Users ranked at once.", lower_bound=1)
flags.DEFINE_string("output", None, "JSON file of the metrics, written atomically; default: printed only.")
flags.DEFINE_boolean("overwrite", False, "Replace the --output an earlier run wrote (never a file of anything else).")
flags.DEFINE_integer("mf_factors", 64, "mf: latent factors.", lower_bound=1)
flags.DEFINE_integer("mf_iterations", 10, "mf: ALS iterations.", lower_bound=0)
flags.DEFINE_integer("knn_neighbours", 100, "itemknn: neighbours kept per item.", lower_bound=1)
flags.DEFINE_integer("seed", 0, "mf: seed of the initial item factors.")
flags.DEFINE_float("ease_lambda", 250.0, "ease: L2 regularization lambda (> 0). Common choices are a few hundred "
                   "(250 is RecBole's default); pick it on a validation split, not on --heldout.")
flags.DEFINE_float("ease_max_memory_gb", 12.0, "ease: refuse a catalogue whose items x items matrices need more "
                   "GiB than this (items^2 x 12 bytes; 12 GiB: up to 32,768 items).", lower_bound=0)
common.define_device("Model: automatic mixed precision (torch.autocast, see --amp_dtype).", ["auto", "bf16", "fp16"],
                     common.AMP_DTYPE_HELP)
flags.mark_flags_as_required(["input", "heldout"])


ERRORS = (*cli.DEFAULT_ERRORS, "dlrm.recommender.run_config.ConfigError",
          "dlrm.engine.checkpoint_store.CheckpointError")


def _ks(texts: list[str]) -> list[int]:
    ks = []
    for text in texts:
        try:
            ks.append(int(text))
        except ValueError:
            raise app.UsageError(f"--k {','.join(texts)}: {text!r} is not an integer") from None
    return ks


def config_from_flags(values: flags.FlagValues = FLAGS):
    """The EvaluateConfig of the flags of ``values``: each flag sets the field of its name (--k's
    cut-offs as integers)."""
    from dlrm.recommender.run_config import EvaluateConfig

    settings = {f.name: values[f.name].value for f in dataclasses.fields(EvaluateConfig)}
    settings["k"] = _ks(settings["k"])
    return EvaluateConfig(**settings)


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
    cli.run(main, ERRORS, prefix=cli.rank_prefix)
