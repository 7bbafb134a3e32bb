"""Helpers the recommender scripts alone share (recommender_train, _predict, _evaluate,
spark_recommend): the checks they share, and the checkpoint flags of spark_recommend (the other
scripts' flags are generated from their configs, dlrm.scripts.recommender_flags); those of every
script (rank prefix, exit-now, our flags, aliases) are dlrm.scripts.cli's, and the runs themselves
dlrm.recommender.api's.

It reads no FLAGS, and defines flags only when a script calls a ``define_*`` function (they
then belong to that script: its --help lists them); each other function takes the flag values
it needs. torch (and the library) is imported inside the functions only, so that --help and
flag errors stay fast.
"""

from __future__ import annotations

from absl import app, flags

from dlrm.scripts import cli

flags.disclaim_key_flags()  # the define_* functions' flags belong to the script that calls them
BEST_HELP = ("Use the checkpoint of the best validation of the training run (PATH.best, kept by recommender_train "
             "when it validates); --nobest: the run's last checkpoint.")


def define_checkpoint_to_load(help: str) -> None:
    """--load_checkpoint_path (alias --checkpoint, the earlier name) and --best: the trained model,
    for a script whose flags no config table declares (spark_recommend); the others' are
    ``recommender_flags.checkpoint_settings``, with the same help."""
    flags.DEFINE_string("load_checkpoint_path", None, help)
    cli.alias("checkpoint", "load_checkpoint_path", "the earlier name")
    flags.DEFINE_boolean("best", True, BEST_HELP)


def index_beside(given: str | None, input_path: str, name: str) -> tuple[str | None, bool]:
    """``dlrm.recommender.predict_job.index_beside``: the index file given, else recommender_generate's
    ``name`` beside the --input dataset, and whether it was found rather than given."""
    from dlrm.recommender.predict_job import index_beside as beside

    return beside(given, input_path, name)


def score_format(value: str) -> str:
    """--score_format checked (``dlrm.recommender.run_config.check_score_format``), or one line
    that gives its bounds."""
    from dlrm.recommender.run_config import ConfigError, check_score_format

    try:
        return check_score_format(value)
    except ConfigError as e:
        raise app.UsageError(str(e)) from None
