"""Helpers the recommender scripts alone share (recommender_train, _predict, _evaluate,
spark_recommend): the flags they have in common; those of every script (rank prefix, exit-now,
our flags, aliases) are dlrm.scripts.cli's, and the runs themselves dlrm.recommender.api's.

It reads no FLAGS, and defines flags only when a script calls a ``define_*`` function (they
then belong to that script: its --help lists them); each other function takes the flag values
it needs. torch (and the library) is imported inside the functions only, so that --help and
flag errors stay fast.
"""

from __future__ import annotations

from absl import app, flags

from dlrm.scripts import cli

flags.disclaim_key_flags()  # the define_* functions' flags belong to the script that calls them
AMP_DTYPE_HELP = ("Autocast dtype with --amp (fp16 on cuda only). auto: bf16, or float32 on a CPU without bf16 "
                  "instructions (where bf16 is slower).")


def define_checkpoint_to_load(help: str) -> None:
    """--load_checkpoint_path (alias --checkpoint, the earlier name) and --best: the trained model."""
    flags.DEFINE_string("load_checkpoint_path", None, help)
    cli.alias("checkpoint", "load_checkpoint_path", "the earlier name")
    flags.DEFINE_boolean("best", True, "Use the checkpoint of the best validation of the training run (PATH.best, "
                         "kept by recommender_train when it validates); --nobest: the run's last checkpoint.")


def define_device(amp_help: str, amp_dtypes: list[str], amp_dtype_help: str) -> None:
    """--base_device (alias --device), --amp, --amp_dtype and --dist_timeout: where and how the model runs."""
    flags.DEFINE_string("base_device", None, "Device: cuda, cuda:N or cpu; default: cuda if available, else cpu. "
                        "Under torchrun each process takes cuda:LOCAL_RANK.")
    cli.alias("device", "base_device", "the earlier name")
    flags.DEFINE_boolean("amp", False, amp_help)
    flags.DEFINE_enum("amp_dtype", "auto", amp_dtypes, amp_dtype_help)
    flags.DEFINE_float("dist_timeout", 300, "Under torchrun: seconds a collective may wait for a peer.", lower_bound=1)


def index_beside(given: str | None, input_path: str, name: str) -> tuple[str | None, bool]:
    """``dlrm.recommender.api.index_beside``: the index file given, else recommender_generate's
    ``name`` beside the --input dataset, and whether it was found rather than given."""
    from dlrm.recommender.api import index_beside as beside

    return beside(given, input_path, name)


def score_format(value: str) -> str:
    """--score_format checked (``dlrm.recommender.run_config.check_score_format``), or one line
    that gives its bounds."""
    from dlrm.recommender.run_config import ConfigError, check_score_format

    try:
        return check_score_format(value)
    except ConfigError as e:
        raise app.UsageError(str(e)) from None
