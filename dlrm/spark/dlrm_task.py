"""What each Spark task of a DLRM training runs under torchrun: a ``RunConfig`` in, its job run.

    torchrun ... dlrm/spark/dlrm_task.py '<RunConfig.to_dict() as JSON>'

``dlrm.spark.dlrm_training.train`` ships the config itself (``RunConfig.to_dict``), not a command
line: each task rebuilds it (``RunConfig.from_dict``, checked again) and runs it with
``dlrm.api.run``, so a config runs on Spark as it runs from Python under torchrun. What the job
did is in its run log (the driver reads its summary there); an error is also printed on one
line with the task's rank, and the process leaves without interpreter teardown (gloo's threads
can abort a finished process while it tears down, as ``dlrm.scripts.cli.exit_now`` notes).
"""

from __future__ import annotations

import json
import logging
import os
import sys


def run(config_json: str) -> dict:
    """The job of the config that ``config_json`` (``RunConfig.to_dict`` as JSON) describes."""
    from dlrm import api
    from dlrm.training.run_config import RunConfig

    return api.run(RunConfig.from_dict(json.loads(config_json)))


def _leave(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: dlrm_task.py RUN_CONFIG_JSON", file=sys.stderr)
        _leave(2)
    try:
        run(sys.argv[1])
    except Exception as error:  # the run log holds its summary; the task's stderr gets one line
        print(f"rank {os.environ.get('RANK', '0')}: error: {type(error).__name__}: {error}", file=sys.stderr,
              flush=True)
        _leave(1)
    _leave(0)
