r"""Train the wide logistic model of docs/adding_a_model.md on its synthetic clicks.

    python -m dlrm.scripts.wide_train --field_sizes=1000,300,50,7 --epochs=2 --print_freq=16 \
        --save_checkpoint_path=wide_checkpoint
    # continue where it stopped (the same batches as an uninterrupted run)
    python -m dlrm.scripts.wide_train --epochs=3 --save_checkpoint_path=wide_checkpoint --resume
    # the id space split across processes (CPU processes on gloo)
    torchrun --nproc_per_node 2 -m dlrm.scripts.wide_train --save_checkpoint_path=wide_checkpoint

The flags describe one dlrm.wide.train.WideConfig: each flag sets the field of its name, but
--print_freq (log_every_steps) and --checkpoint_freq (checkpoint_every_steps), which keep
dlrm.scripts.main's names. The run is dlrm.wide.train.train(config), the same run as from Python.
It prints a loss line every --print_freq steps, then the run's summary as one JSON line.

Exit codes: 0 done, 2 a usage error (one line naming the flag), 3 a non-finite loss (too high an
--lr), 130/143 stopped by Ctrl-C/SIGTERM after saving.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from absl import app, flags

from dlrm.scripts import cli, flag_table
from dlrm.scripts.flag_table import Setting
from dlrm.wide.train import WideConfig

FLAGS = flags.FLAGS
DATA, TRAINING, CHECKPOINTS = "data", "training", "checkpoints"
DEFAULTS = WideConfig()
DIST_TIMEOUT_S = 300.0  # a collective that waits longer (a peer died) fails on every process


def _field_sizes(value: str, flag_values: flags.FlagValues) -> tuple[int, ...]:
    """--field_sizes=1000,300 -> (1000, 300): the field is a tuple, the flag a comma-separated list."""
    return tuple(flag_table.ints([v for v in value.split(",") if v.strip()], "field_sizes"))


def _comma_separated(value: tuple[int, ...]) -> str:
    return ",".join(str(v) for v in value)


# One line per WideConfig field: flag, field, --help section, help. Type and default come from the field.
SETTINGS: tuple[Setting, ...] = (
    Setting("field_sizes", "field_sizes", DATA,
            "Ids of each field, comma-separated: one weight per id, the id space split across processes.",
            to_config=_field_sizes, to_flag=_comma_separated),
    Setting("num_samples", "num_samples", DATA, "Synthetic samples (clicks) in the data set."),
    Setting("batch_size", "batch_size", TRAINING, "Samples per step (the global batch, whatever the process count)."),
    Setting("epochs", "epochs", TRAINING, "Passes over the samples."),
    Setting("lr", "lr", TRAINING, "SGD learning rate. Too high, and the loss diverges: exit code 3."),
    Setting("seed", "seed", TRAINING, "Seed of the data, the initial weights and the batch order.", lower_bound=0),
    Setting("max_steps", "max_steps", TRAINING, "Stop after this many steps in all (a checkpoint resumes).",
            lower_bound=1),
    Setting("print_freq", "log_every_steps", TRAINING, "Print the loss every this many steps; 0: never.",
            lower_bound=0),
    Setting("checkpoint_freq", "checkpoint_every_steps", CHECKPOINTS,
            "Save every this many steps; 0: only at the end of the run.", lower_bound=0),
    Setting("save_checkpoint_path", "save_checkpoint_path", CHECKPOINTS,
            "Checkpoint directory, written during and at the end of the run."),
    Setting("resume", "resume", CHECKPOINTS,
            "Continue from the checkpoint at --save_checkpoint_path if there is one."),
    Setting("overwrite", "overwrite", CHECKPOINTS,
            "Start over in place of the checkpoint at --save_checkpoint_path (never a folder of anything else)."),
)
# absl files a script's own flags under its path (``sys.argv[0]``), which --help looks up; not "__main__".
flag_table.define(SETTINGS, WideConfig, DEFAULTS, sys.argv[0] if __name__ == "__main__" else __name__)


def config_from_flags(values: flags.FlagValues = FLAGS) -> WideConfig:
    """The WideConfig of the flags; ``app.UsageError`` naming the flag that the config refuses."""
    try:
        return flag_table.build(WideConfig, flag_table.read_values(SETTINGS, WideConfig, values))
    except ValueError as e:
        raise app.UsageError(cli.flag_terms(str(e), values)) from None


def config_args(cfg: WideConfig) -> list[str]:
    """The command line that reads back as ``cfg``, every setting spelled out."""
    return flag_table.args(SETTINGS, WideConfig, DEFAULTS, cfg)


def _main(argv: list[str], env: Any) -> int:
    """Flags -> WideConfig -> ``train`` on this process's part of the job -> the summary as JSON."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    cfg = config_from_flags()
    import torch

    from dlrm.engine.collectives import Collectives, ProcessGroupCollectives
    from dlrm.engine.logger import RunLogger
    from dlrm.engine.process_group import join_processes, leave_processes
    from dlrm.engine.signals import StopOnSignals
    from dlrm.wide.train import train

    device = torch.device("cpu")
    join_processes(env, device, DIST_TIMEOUT_S)
    collectives = ProcessGroupCollectives(device) if env is not None else Collectives()
    first = collectives.rank == 0
    stop = StopOnSignals()
    _, summary = train(cfg, collectives, RunLogger(None, enabled=first), stop.event.is_set)
    stop.over()
    leave_processes(env)
    if first:
        print(json.dumps(summary), flush=True)
    return stop.exit_code_of(summary["stop_reason"])


def main(argv: list[str]) -> int:
    return cli.run_processes(_main, argv)


if __name__ == "__main__":
    cli.run(main, prefix=cli.rank_prefix)
