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
(each flag sets the field of its name), and the run is dlrm.recommender.api.predict(config),
whose config's fields are these flags: the same from Python.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags

from dlrm.scripts import cli
from dlrm.scripts import recommender_common as common

FLAGS = flags.FLAGS
common.define_checkpoint_to_load("Checkpoint directory of recommender_train (its --save_checkpoint_path).")
flags.DEFINE_string("input", None, "CSR dataset of the users' histories to recommend for (e.g. DIR/input).")
flags.DEFINE_integer("k", 10, "Recommendations per user.", lower_bound=1)
flags.DEFINE_string("output", None, "Text file of the recommendations (DSSTNE's format), written atomically.")
flags.DEFINE_string("features_index", None, "Features (items) index for item names; default: the features_index.txt "
                    "recommender_generate wrote beside --input (DIR/ of DIR/input), else column numbers; "
                    "--features_index= for column numbers.")
flags.DEFINE_string("samples_index", None, "Samples (users) index for user names; default: the samples_index.txt "
                    "beside --input, else row numbers; --samples_index= for row numbers.")
flags.DEFINE_list("filter", [], "CSR datasets (comma-separated) of further items not to recommend, row r for "
                  "user r of --input.")
flags.DEFINE_boolean("exclude_inputs", True, "Never recommend the items of a user's own history "
                     "(--noexclude_inputs: allow them).")
flags.DEFINE_string("score_format", "%.6g", "printf format of the scores (one float conversion; the % may be left "
                    "out): %.6g, 6 significant digits, so that a user's top K rarely tie; %4.3f is DSSTNE's (its "
                    "-p 4.3f), which ties scores that differ after the 3rd decimal.")
flags.DEFINE_integer("batch_size", 1024, "Users scored at once.", lower_bound=1)
flags.DEFINE_string("scores_path", None, "Also write every raw score, before exclusion, as a float32 .npy "
                    "[users, items] (one process only).")
flags.DEFINE_boolean("overwrite", False, "Replace the --output (and --scores_path) an earlier run wrote; a file "
                     "of anything else is never replaced.")
common.define_device("Automatic mixed precision (torch.autocast, see --amp_dtype).", ["auto", "bf16", "fp16"],
                     common.AMP_DTYPE_HELP)
flags.mark_flags_as_required(["load_checkpoint_path", "input", "output"])


ERRORS = (*cli.DEFAULT_ERRORS, "dlrm.recommender.run_config.ConfigError",
          "dlrm.engine.checkpoint_store.CheckpointError")


def config_from_flags(values: flags.FlagValues = FLAGS):
    """The PredictConfig of the flags of ``values``: each flag sets the field of its name."""
    from dlrm.recommender.run_config import PredictConfig

    return PredictConfig(**{f.name: values[f.name].value for f in dataclasses.fields(PredictConfig)})


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
    cli.run(main, ERRORS, prefix=cli.rank_prefix)
